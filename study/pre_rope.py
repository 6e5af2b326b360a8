"""Pre-RoPE key quantization (issue 51's lead): quantize keys before the rotary embedding, rotate after.

    python -m study.pre_rope --out docs/pre-rope-keys.md [--models smollm2-135m,gemma3-270m] [--n-ctx 2048,8192]
        [--chunks 2] [--e2e-ctx 2048] [--threads 2]

The cache quantizes keys channel-wise over groups of G = 128 consecutive tokens, after RoPE. RoPE turns each
channel pair (x_a, x_b) of a token at position p by the angle p * theta_i, theta_i = base^(-2i/n_rot): a pair whose
pre-RoPE value barely moves over a group becomes a sinusoid over it when theta_i * G is large (the first pairs
turn by up to 128 radians per group), and a channel's min-max range spans the circle instead of the point. KVQuant
(Hooper et al., 2024) quantizes keys before RoPE for that reason. Keys quantized pre-RoPE must be rotated after
they are dequantized, token by token, in every attention kernel (a query rotated per key position, or each key
rotated as it is read): the measurement comes first.

1. Attention error on captured keys (study.capture, the llama.cpp docs, every full-attention layer): the relative
   error of the attention output of the last 256 queries when only the keys are quantized by the reference's
   sealing quantizer (quantize_keys: clipped ranges, k_mix; no outliers), post-RoPE as the cache does and pre-RoPE
   (the captured post-RoPE keys turned back by -p * theta_i in float64, stored fp16 as a cache would hold them,
   quantized, dequantized and turned forward again). A range check beside it: each pair frequency's mean
   per-group range of the keys, pre over post (RoPE's layout and base read from the GGUF; a wrong layout or base
   shows as no shrink on the fast pairs).
2. End to end, keys only (study.k_widths part 2, the same eval callback, with the pre-RoPE option): mean KL
   divergence against f16 over the second halves of chunks of the evaluation text, values exact. Pessimistic as
   k_widths says (a ubatch sees its own group quantized, no fp16 window): it compares key quantizers, it is not
   the cache's KLD.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ott_gguf import models
from ott_gguf.kv_types import OttConfig
from ott_gguf.reference import KeyMix

from .k_widths import Q_LAST, _attn_err_last, _captures, _Prefix, _quantize_keys_with, end_to_end

G = 128

# llama.cpp's llama_model_rope_type for the architectures the test models use: NORM turns adjacent channels
# (2i, 2i+1), NEOX turns (i, i + n_rot/2).
_NEOX = {"llama": False, "gemma3": True}


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding on its full-attention layers (no frequency scaling)."""

    base: float
    n_rot: int
    neox: bool

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The channel indices (first, second) of each rotated pair, pair i turning at theta_i."""
        h = self.n_rot // 2
        if self.neox:
            return np.arange(h), np.arange(h) + h
        return np.arange(0, self.n_rot, 2), np.arange(1, self.n_rot, 2)

    def theta(self) -> np.ndarray:
        return self.base ** (-2.0 * np.arange(self.n_rot // 2) / self.n_rot)

    def turn(self, x: np.ndarray, pos: np.ndarray, sign: int) -> np.ndarray:
        """x (T, D) at positions pos (T,) turned by sign * pos * theta (sign -1 undoes RoPE), float64 inside,
        float32 out."""
        a = sign * pos.astype(np.float64)[:, None] * self.theta()[None, :]
        c, s = np.cos(a), np.sin(a)
        i0, i1 = self.pairs()
        y = x.astype(np.float64)
        x0, x1 = y[:, i0].copy(), y[:, i1].copy()
        y[:, i0] = x0 * c - x1 * s
        y[:, i1] = x0 * s + x1 * c
        return y.astype(np.float32)


def rope_of(path: Path) -> Rope:
    """The model's RoPE from its GGUF metadata; refuses what this study does not model."""
    from gguf import GGUFReader

    f = GGUFReader(str(path)).fields

    def val(key: str) -> object | None:
        fld = f.get(key)
        if fld is None:
            return None
        part = fld.parts[fld.data[0]]
        return bytes(part).decode() if fld.types and fld.types[0].name == "STRING" else part[0].item()

    arch = str(val("general.architecture"))
    if arch not in _NEOX:
        raise ValueError(f"{path.name}: RoPE layout of architecture {arch!r} not modelled")
    if val(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path.name}: RoPE frequency scaling not modelled")
    base = val(f"{arch}.rope.freq_base")
    n_rot = val(f"{arch}.rope.dimension_count") or val(f"{arch}.attention.key_length")
    return Rope(float(base) if base is not None else 10000.0, int(n_rot), _NEOX[arch])  # type: ignore[arg-type]


def quantize_pre(k16: np.ndarray, pos: np.ndarray, rope: Rope, config: OttConfig, mix: KeyMix | None) -> np.ndarray:
    """Keys (T, D) fp16 post-RoPE: turned back, held fp16, quantized group by group, dequantized, turned forward."""
    pre16 = rope.turn(k16.astype(np.float32), pos, -1).astype(np.float16)
    hat = _quantize_keys_with(pre16, config, mix)
    return rope.turn(hat, pos[: len(hat)], +1)


def quantize_hybrid(k16: np.ndarray, rope: Rope, config: OttConfig, bits: int, min_turn: float) -> np.ndarray:
    """Keys (T, D) fp16, post-RoPE, no trigonometry: the channels of pairs turning by at least min_turn radians per
    group quantized token-wise (one min-max block of those channels per token, as values are, clipped as rotated V
    is not: full range), the other channels channel-wise as the cache does."""
    i0, i1 = rope.pairs()
    fast_pairs = np.flatnonzero(rope.theta() * G >= min_turn)
    fast = np.sort(np.concatenate([i0[fast_pairs], i1[fast_pairs]]))
    slow = np.setdiff1d(np.arange(k16.shape[1]), fast)
    out = np.empty((len(k16) - len(k16) % config.G, k16.shape[1]), np.float32)
    out[:, slow] = _quantize_keys_with(np.ascontiguousarray(k16[:, slow]), config, None)
    x = k16[: len(out), fast].astype(np.float32)
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    nlev = 2**bits - 1
    d = np.where(hi > lo, (hi - lo) / nlev, 1.0)
    out[:, fast] = lo + np.clip(np.rint((x - lo) / d), 0, nlev) * d
    return out


def _attn_err_window(
    q: np.ndarray, k: np.ndarray, k_hat: np.ndarray, v: np.ndarray, scale: float, q_last: int, R: int
) -> np.ndarray:
    """As k_widths._attn_err_last, but each query sees quantized keys only where the cache holds them: positions
    below n_sealed * G, n_sealed = (p + 1 - R) // G (the newest R tokens and the open group exact)."""
    T = len(k_hat)
    qp = np.arange(T - q_last, T)
    sealed_end = np.maximum(0, (qp + 1 - R) // G) * G
    cols = np.arange(T)[None, :]
    mask, use_hat = cols > qp[:, None], cols < sealed_end[:, None]
    err = np.zeros(2)
    for h in range(q.shape[1]):
        qh = q[T - q_last : T, h]
        s_ref, s_hat = qh @ k[:T].T * scale, qh @ k_hat.T * scale
        outs = []
        for s in (s_ref, np.where(use_hat, s_hat, s_ref)):
            s = np.where(mask, -np.inf, s)
            p = np.exp(s - s.max(1, keepdims=True))
            outs.append((p / p.sum(1, keepdims=True)) @ v[:T])
        err += [np.sum((outs[1] - outs[0]) ** 2), np.sum(outs[0] ** 2)]
    return err


VARIANTS: dict[str, tuple[OttConfig, KeyMix | None]] = {
    "2-bit uniform": (OttConfig(k_bits=2, k_mix=0, outlier_num=0), None),
    "2-bit k_mix 1/2/3 (ott2 today)": (OttConfig(k_bits=2, outlier_num=0), None),
    "3-bit k_mix 2/3/4 (ott3 today)": (OttConfig(k_bits=3, outlier_num=0), None),
}


MODES = ("post", "pre", "hybrid")
R_WINDOW = 32  # ott2's fp16 window (the cache-like measure)


def attention_errors(
    npz: Path, n_ctx: int, rope: Rope, min_turn: float = 2.0, bos_exact: bool = True, modes: tuple[str, ...] = MODES
) -> dict[tuple[str, str, str], float]:
    """{(variant, mode, measure): relative attention error}, mode post/pre/hybrid (quantize_hybrid at min_turn),
    measure "all" (every sealed group's keys quantized for every query) or "cache" (as the cache serves them, the
    newest R_WINDOW tokens and the open group exact), plus (variant, mode, "better") the fraction of (layer, KV
    head) pairs where the mode beats post-RoPE (cache measure). bos_exact: position 0's key exact in every mode, as
    the cache's outlier pool holds it in most heads (False: quantized with its group)."""
    z = _Prefix(np.load(npz), n_ctx)
    swa = {int(x) for x in z["meta_swa_layers"]}
    n_layer, scale = int(z["meta_n_layer"]), float(z["meta_attn_scale"])
    tot: dict[tuple[str, str, str], np.ndarray] = {}
    wins: dict[tuple[str, str], int] = {}
    n_pairs = 0
    for il in (i for i in range(n_layer) if i not in swa):
        q, k, v = (z[f"{x}{il}"] for x in "qkv")
        T = len(k) - len(k) % G
        pos = np.arange(T)
        rep = q.shape[1] // k.shape[1]
        for h in range(k.shape[1]):
            kh16 = k[:T, h].astype(np.float16)
            kh, vh = kh16.astype(np.float32), v[:T, h].astype(np.float32)
            qh = q[:T, h * rep : (h + 1) * rep].astype(np.float32)
            n_pairs += 1
            for name, (config, mix) in VARIANTS.items():
                hats = {
                    "post": _quantize_keys_with(kh16, config, mix),
                    "pre": quantize_pre(kh16, pos, rope, config, mix),
                }
                if "hybrid" in modes:
                    hats["hybrid"] = quantize_hybrid(kh16, rope, config, config.kbits, min_turn)
                cache_err = {}
                for mode, hat in hats.items():
                    if bos_exact:
                        hat[0] = kh[0]  # the outlier pool holds BOS in most heads (docs/fidelity.md)
                    for measure, e in (
                        ("all", _attn_err_last(qh, kh, hat, vh, scale, Q_LAST)),
                        ("cache", _attn_err_window(qh, kh, hat, vh, scale, Q_LAST, R_WINDOW)),
                    ):
                        tot.setdefault((name, mode, measure), np.zeros(2))
                        tot[(name, mode, measure)] += e
                    cache_err[mode] = e[0] / e[1]
                for mode in (m for m in modes if m != "post"):
                    wins[(name, mode)] = wins.get((name, mode), 0) + int(cache_err[mode] < cache_err["post"])
    out = {key: float(e[0] / e[1]) for key, e in tot.items()}
    out.update({(n, m, "better"): w / n_pairs for (n, m), w in wins.items()})
    return out


def range_ratios(npz: Path, n_ctx: int, rope: Rope) -> np.ndarray:
    """(n_rot/2,) mean per-group min-max range of each pair's two channels pre-RoPE over post-RoPE, over every
    full-attention layer and KV head."""
    z = _Prefix(np.load(npz), n_ctx)
    swa = {int(x) for x in z["meta_swa_layers"]}
    i0, i1 = rope.pairs()
    num, den = np.zeros(len(i0)), np.zeros(len(i0))
    for il in (i for i in range(int(z["meta_n_layer"])) if i not in swa):
        k = z[f"k{il}"]
        T = len(k) - len(k) % G
        for h in range(k.shape[1]):
            post = k[:T, h].astype(np.float32)
            pre = rope.turn(post, np.arange(T), -1)
            for x, acc in ((pre, num), (post, den)):
                r = np.ptp(x.reshape(T // G, G, -1), axis=1).mean(0)
                acc += r[i0] + r[i1]
    return num / den


# part 2's variants: (config, key mix, quantized before RoPE)
E2E: dict[str, tuple[OttConfig, KeyMix | None, bool] | None] = {
    "unquantized keys (check: 0)": None,
    "ott2 keys, post-RoPE (today)": (OttConfig(k_bits=2), None, False),
    "ott2 keys, pre-RoPE": (OttConfig(k_bits=2), None, True),
    "ott3 keys, post-RoPE (today)": (OttConfig(k_bits=3), None, False),
    "ott3 keys, pre-RoPE": (OttConfig(k_bits=3), None, True),
}


def run(a: argparse.Namespace) -> str:
    ctxs = [int(x) for x in a.n_ctx.split(",") if x]
    parts: list[str] = []
    for name in a.models.split(","):
        t0 = time.time()
        rope = rope_of(models.fetch(name, quiet=True))
        layout = "NEOX (i, i + n_rot/2)" if rope.neox else "NORM (2i, 2i+1)"
        parts += [f"## {name}", "", f"RoPE: base {rope.base:g}, {rope.n_rot} channels rotated, pairs {layout}.", ""]
        if ctxs:
            ev, _ = _captures(a, name, max(ctxs))
            rr = range_ratios(ev, max(ctxs), rope)
            wrong = range_ratios(ev, max(ctxs), Rope(rope.base, rope.n_rot, not rope.neox))
            th = rope.theta() * G
            sel = [i for i in (0, 1, 2, 4, 8, len(rr) // 4, len(rr) // 2, 3 * len(rr) // 4, len(rr) - 1)]
            sel = sorted(set(sel))
            parts += [f"Range check ({max(ctxs)} tokens): per-group range of each pair's channels, pre-RoPE over "
                      "post-RoPE (mean over layers, KV heads and groups); the other layout as a control:", "",
                      "| pair i | theta_i x G (rad per group) | pre/post range | other layout |",
                      "|---|---|---|---|"]  # fmt: skip
            parts += [f"| {i} | {th[i]:.3g} | {rr[i]:.3f} | {wrong[i]:.3f} |" for i in sel]
            parts += ["", f"All pairs: pre/post {rr.mean():.3f}, other layout {wrong.mean():.3f}.", ""]
            modes = MODES if a.hybrid else ("post", "pre")
            res = {n: attention_errors(ev, n, rope, bos_exact=not a.bos_quantized, modes=modes) for n in ctxs}
            bos = "position 0 quantized with its group" if a.bos_quantized else "position 0 exact (the pool's BOS)"
            parts += [f"Attention error, keys only (part 1; last {Q_LAST} queries, relative squared error of the "
                      f"attention output, every full-attention layer and KV head; {bos}). all: every sealed group "
                      f"quantized for every query; cache: as the cache serves them (the newest {R_WINDOW} tokens and "
                      "the open group exact). hybrid: no trigonometry, the fast pairs' channels (at least 2 rad per "
                      "group) token-wise. better: (layer, KV head) pairs below post-RoPE (cache measure).", "",
                      "| keys | context | post: all | pre: all | post: cache | pre: cache | pre/post | better | "
                      "hybrid: cache | hybrid/post |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
            for v in VARIANTS:
                for n in ctxs:
                    r = res[n]
                    pc, rc, hc = (r.get((v, m, "cache"), float("nan")) for m in MODES)
                    parts.append(f"| {v} | {n} | {r[(v, 'post', 'all')]:.4f} | {r[(v, 'pre', 'all')]:.4f} | "
                                 f"{pc:.4f} | {rc:.4f} | {rc / pc:.2f}x | {100 * r[(v, 'pre', 'better')]:.0f}% | "
                                 f"{hc:.4f} | {hc / pc:.2f}x |")  # fmt: skip
            parts += ["", f"({name}: part 1 in {time.time() - t0:.0f} s)", ""]
            print("\n".join(parts), flush=True)
        if a.chunks:
            t0 = time.time()
            e2e = end_to_end(name, a.chunks, dict(E2E), a.e2e_ctx, a.threads, rope=rope)
            parts += [f"End to end, keys only, pessimistic (part 2; {a.chunks} chunk(s) of {a.e2e_ctx} tokens, "
                      f"{time.time() - t0:.0f} s):", "", "| keys | mean KLD | top-1 % |", "|---|---|---|"]  # fmt: skip
            parts += [f"| {v} | {k:.5f} | {t:.2f} |" for v, (k, t) in e2e.items()]
            parts.append("")
            print("\n".join(parts[-len(e2e) - 4 :]), flush=True)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--n-ctx", default="2048,8192", help="contexts of part 1 (comma list; '' skips part 1)")
    ap.add_argument("--chunks", type=int, default=2, help="chunks of part 2 (0 skips it)")
    ap.add_argument("--e2e-ctx", type=int, default=2048, help="tokens per chunk of part 2")
    ap.add_argument("--captures", type=Path, default=Path.home() / ".cache/ott-gguf/captures")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bos-quantized", action="store_true", help="part 1: position 0 quantized with its group")
    ap.add_argument("--hybrid", action="store_true", help="part 1: the token-wise layout of the fast pairs too")
    a = ap.parse_args(argv)
    t0 = time.time()
    body = run(a)
    cmd = " ".join(["python -m study.pre_rope", *(argv if argv is not None else sys.argv[1:])])
    a.out.write_text(
        f"<!-- written by `{cmd}` on {platform.machine()} in {time.time() - t0:.0f} s, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} -->\n\n{body}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
