"""K widths per channel (issue 12): which channels of a key group deserve more bits, measured two ways.

    python -m study.k_widths --out docs/k-channel-widths.md [--models smollm2-135m,gemma3-270m] [--chunks 4]
    python -m study.k_widths --two-bit --n-ctx 2048,8192 --out docs/long-context-keys.md   (issue 51: 2-bit keys)

1. Attention error on captured queries and keys (study.capture, the llama.cpp docs; calibration statistics from
   the calibration text of `ott-gguf calibrate`, the docs from byte 300,000): the relative error of the attention
   output of the last 256 queries when only the keys are quantized (channel-wise, groups of 128 tokens, plain
   min-max, no outliers), over every layer the ott cache serves. Allocations at 3 bits per key element on average:
   - `uniform 3`: every channel at 3 bits (ott3 today);
   - `k_mix`: the reference's rule (reference.key_widths), per group, from the group's keys alone;
   - `greedy on K`: per group, bits water-filled on mean(k^2) * range^2 of the group (widths 2..4);
   - `queries known`: bits water-filled once per (layer, head) on mean(q^2) (calibration text) * mean range^2,
     which a cache cannot know at sealing: an upper reference.
2. End to end, through the model (llama.cpp's eval callback rewrites each 128-token ubatch's keys `Kcur-<il>`
   before the f16 cache stores them, with the numpy reference's sealing of that group: outlier tracing, clipped
   ranges, k_mix): mean KL divergence against f16 and top-1 agreement over the second half of 2048-token chunks of
   the evaluation text of docs/tiers.md. Values stay exact, and a ubatch sees its own group quantized (the real
   cache keeps the newest R tokens and the open group in fp16), so these numbers are pessimistic and compare the
   key quantizers only: they are not the cache's KLD (docs/tiers.md has those).
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ott_gguf import corpus, models
from ott_gguf._lib import llama_cpp_module
from ott_gguf.calibrate import calibration_text
from ott_gguf.kv_types import OttConfig
from ott_gguf.quantizer import BlockFormat, dequantize, quantize
from ott_gguf.reference import K1_CLIP64, HeadState, KeyMix, key_widths, quantize_keys, seal_group

from .capture import GgmlTensor, _ggml, _swa_layers, _tokenize, capture

G = 128
N_CTX = 2048
Q_LAST = 256  # queries whose attention output is compared (part 1)
_F32 = 0  # GGML_TYPE_F32


# ------------------------------------------------------------------------------- 1. attention error, captures


def _greedy(weight: np.ndarray, total: int, lo: int = 2, hi: int = 4) -> np.ndarray:
    """Integer widths in [lo, hi] with sum `total` minimizing sum weight_c / (2^b_c - 1)^2 (greedy, exact for
    this convex objective)."""
    b = np.full(len(weight), lo)
    for _ in range(total - lo * len(weight)):
        gain = weight * (1 / (2.0**b - 1) ** 2 - 1 / (2.0 ** (b + 1) - 1) ** 2)
        gain[b >= hi] = -1
        b[int(np.argmax(gain))] += 1
    return b


def _quant_keys(k: np.ndarray, widths_of: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Keys (T, D) quantized channel-wise per group of G tokens at widths_of(group) bits, full min-max range."""
    out = np.empty_like(k)
    for g0 in range(0, len(k) - len(k) % G, G):
        blk = k[g0 : g0 + G]
        w = widths_of(blk)
        for bits in np.unique(w):
            cs = np.flatnonzero(w == bits)
            out[g0 : g0 + G, cs] = dequantize(quantize(blk[:, cs].T, BlockFormat(int(bits), G))).reshape(len(cs), G).T
    return out[: len(k) - len(k) % G]


def _attn_err(q: np.ndarray, k: np.ndarray, k_hat: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """(squared error, squared norm) of the attention outputs of the last Q_LAST query rows q (n, heads, D),
    causal over keys k / k_hat (T, D) and values v."""
    return _attn_err_last(q, k, k_hat, v, scale, Q_LAST)


def attention_errors(eval_npz: Path, calib_npz: Path, n_ctx: int | None = None) -> dict[str, float]:
    """Part 1: relative attention error per allocation, summed over the served layers and KV heads (the first
    n_ctx tokens of the capture; None: all of it)."""
    z, zc = _Prefix(np.load(eval_npz), n_ctx), np.load(calib_npz)
    swa = {int(x) for x in z["meta_swa_layers"]}
    n_layer, scale = int(z["meta_n_layer"]), float(z["meta_attn_scale"])
    cfg = OttConfig(k_bits=3, k_mix=True, clip=False)
    names = ["uniform 2", "uniform 3", "k_mix", "greedy on K", "queries known", "uniform 4"]
    tot = {n: np.zeros(2) for n in names}
    for il in (i for i in range(n_layer) if i not in swa):
        q, k, v = (z[f"{x}{il}"].astype(np.float32) for x in "qkv")
        qc, kc = zc[f"q{il}"].astype(np.float32), zc[f"k{il}"].astype(np.float32)
        T = len(k) - len(k) % G
        rep = q.shape[1] // k.shape[1]
        for h in range(k.shape[1]):
            kh, vh, qh = k[:T, h], v[:T, h], q[:T, h * rep : (h + 1) * rep]
            D = kh.shape[1]
            qw = (qc[:, h * rep : (h + 1) * rep] ** 2).mean((0, 1))
            r2 = np.mean([np.ptp(kc[g : g + G, h], 0) ** 2 for g in range(0, len(kc) - G + 1, G)], 0)
            known = _greedy(qw * r2, 3 * D)
            rules: dict[str, Callable[[np.ndarray], np.ndarray]] = {
                "uniform 2": lambda b: np.full(b.shape[1], 2),
                "uniform 3": lambda b: np.full(b.shape[1], 3),
                "k_mix": lambda b: key_widths(b.astype(np.float16), cfg),
                "greedy on K": lambda b: _greedy((b**2).mean(0) * np.ptp(b, 0) ** 2, 3 * b.shape[1]),
                "queries known": lambda b, w=known: w,
                "uniform 4": lambda b: np.full(b.shape[1], 4),
            }
            for n, rule in rules.items():
                tot[n] += _attn_err(qh, kh, _quant_keys(kh, rule), vh, scale)
    return {n: float(e[0] / e[1]) for n, e in tot.items()}


class _Prefix:
    """A capture's q/k/v arrays cut to their first n tokens (a causal model: the same as a capture of n tokens
    with the same ubatches), other entries as they are."""

    def __init__(self, z: Any, n: int | None) -> None:
        self.z, self.n = z, n

    def __getitem__(self, key: str) -> np.ndarray:
        a = self.z[key]
        if self.n is not None and key[:1] in "qkv" and key[1:].isdigit():
            if len(a) < self.n:
                raise ValueError(f"the capture holds {len(a)} tokens, {self.n} asked")
            return a[: self.n]
        return a


# --------------------------------------------------------------------- 1b. 2-bit keys at long context (issue 51)


def key_bits(bits: float, G: int, table: bool) -> float:
    """Bits per key element of channel-wise key groups: codes, fp16 scale and min per channel and group of G
    tokens, and a 2-bit width table per channel and group when the widths mix."""
    return bits + 32 / G + (2 / G if table else 0)


def two_bit_variants(clip1: int = K1_CLIP64) -> dict[str, tuple[OttConfig, KeyMix | None, float]]:
    """{name: (config, key mix, bits per key element)}: the key quantizers compared at long context. Every one is
    the reference's quantize_keys (clipped ranges as the cache's, K_CLIP64; 1-bit channels at clip1). The mixes
    besides 1/2/3 in quarters were picked on the calibration split (mix_grid_errors), not on this text."""
    c2, c3 = OttConfig(outlier_num=0), OttConfig(k_bits=3, outlier_num=0)
    return {
        "uniform 2 (ott2 today)": (c2, None, key_bits(2, G, False)),
        "k_mix 1/2/3 (1/4 at 1, 1/4 at 3)": (c2, KeyMix(clip1=clip1), key_bits(2, G, True)),
        "k_mix 1/2/3, 1-bit at full range": (c2, KeyMix(clip1=64), key_bits(2, G, True)),
        "k_mix 1/2/4 (1/3 at 1, 1/6 at 4)": (c2, KeyMix(hi=4, hi_div=6, clip1=clip1), key_bits(2, G, True)),
        "k_mix 0/2/4 (1/4 mean only, 1/4 at 4)": (c2, KeyMix(lo=0, hi=4, hi_div=4), key_bits(2, G, True)),
        "k_mix 0/2/3 (1/4 mean only, 1/2 at 3)": (c2, KeyMix(lo=0, hi_div=2), key_bits(2, G, True)),
        "uniform 2, G = 64": (c2.replace(G=64), None, key_bits(2, 64, False)),
        "uniform 3 (ott3 keys, no k_mix)": (c3.replace(k_mix=False), None, key_bits(3, G, False)),
        "k_mix 2/3/4 (ott3 keys today)": (c3, None, key_bits(3, G, True)),
    }


# mixes at 2 bits on average tried on the calibration split (mix_grid_errors): lo/bits/hi, D // hi_div at hi bits
MIX_GRID = {
    "1/2/3, 1/4 at 3": KeyMix(),
    "1/2/3, 1/8 at 3": KeyMix(hi_div=8),
    "1/2/4, 1/16 at 4": KeyMix(hi=4, hi_div=16),
    "1/2/4, 1/8 at 4": KeyMix(hi=4, hi_div=8),
    "1/2/4, 1/6 at 4": KeyMix(hi=4, hi_div=6),
    "1/2/4, 1/4 at 4": KeyMix(hi=4, hi_div=4),
    "0/2/3, 1/4 at 3": KeyMix(lo=0, hi_div=4),
    "0/2/3, 1/2 at 3": KeyMix(lo=0, hi_div=2),
    "0/2/4, 1/8 at 4": KeyMix(lo=0, hi=4, hi_div=8),
    "0/2/4, 1/4 at 4": KeyMix(lo=0, hi=4, hi_div=4),
}


def mix_grid_errors(calib_npz: Path) -> dict[str, float]:
    """{mix: relative attention error} on the calibration split's capture (last 1024 queries), uniform 2 first."""
    c2 = OttConfig(outlier_num=0)
    v: dict[str, tuple[OttConfig, KeyMix | None, float]] = {"uniform 2": (c2, None, 0.0)}
    v.update({n: (c2, m, 0.0) for n, m in MIX_GRID.items()})
    return {n: e for n, (e, _) in two_bit_errors(calib_npz, None, v, q_last=1024).items()}


def _quantize_keys_with(k: np.ndarray, config: OttConfig, mix: KeyMix | None) -> np.ndarray:
    """Keys (T, D) fp16 as the reference's sealing quantizes them (no outliers), group by group of config.G."""
    g = config.G
    T = len(k) - len(k) % g
    return np.concatenate([quantize_keys(k[g0 : g0 + g], config, mix)[3] for g0 in range(0, T, g)])


def two_bit_errors(
    npz: Path, n_ctx: int | None, variants: dict[str, tuple[OttConfig, KeyMix | None, float]], q_last: int = Q_LAST
) -> dict[str, tuple[float, np.ndarray]]:
    """{variant: (relative attention error of the last q_last queries over the served layers and KV heads, the
    same per (layer, KV head))}, keys only, over the first n_ctx tokens of a capture."""
    z = _Prefix(np.load(npz), n_ctx)
    swa = {int(x) for x in z["meta_swa_layers"]}
    n_layer, scale = int(z["meta_n_layer"]), float(z["meta_attn_scale"])
    tot = {n: np.zeros(2) for n in variants}
    per: dict[str, list[float]] = {n: [] for n in variants}
    for il in (i for i in range(n_layer) if i not in swa):
        q, k, v = (z[f"{x}{il}"] for x in "qkv")
        T = len(k) - len(k) % G
        rep = q.shape[1] // k.shape[1]
        for h in range(k.shape[1]):
            kh16 = k[:T, h].astype(np.float16)
            kh, vh = kh16.astype(np.float32), v[:T, h].astype(np.float32)
            qh = q[:T, h * rep : (h + 1) * rep].astype(np.float32)
            for n, (config, mix, _) in variants.items():
                e = _attn_err_last(qh, kh, _quantize_keys_with(kh16, config, mix), vh, scale, q_last)
                tot[n] += e
                per[n].append(e[0] / e[1])
    return {n: (float(e[0] / e[1]), np.asarray(per[n])) for n, e in tot.items()}


def _attn_err_last(
    q: np.ndarray, k: np.ndarray, k_hat: np.ndarray, v: np.ndarray, scale: float, q_last: int
) -> np.ndarray:
    """(squared error, squared norm) of the attention outputs of the last q_last query rows q (n, heads, D),
    causal over keys k / k_hat (T, D) and values v."""
    T = len(k)
    qp = np.arange(T - q_last, T)
    mask = np.arange(T)[None, :] > qp[:, None]
    err = np.zeros(2)
    for h in range(q.shape[1]):
        outs = []
        for kk in (k, k_hat):
            s = q[T - q_last :, h] @ kk.T * scale
            s[mask] = -np.inf
            p = np.exp(s - s.max(1, keepdims=True))
            outs.append((p / p.sum(1, keepdims=True)) @ v)
        err += [np.sum((outs[1] - outs[0]) ** 2), np.sum(outs[0] ** 2)]
    return err


CLIP1_GRID = (8, 12, 16, 20, 24, 32, 40, 48, 64)


def clip1_errors(calib_npz: Path, grid: tuple[int, ...] = CLIP1_GRID) -> dict[int, float]:
    """{clip1: relative attention error of k_mix 1/2/3 (quarters)} on the calibration split's capture (the last
    1024 of its queries): where the 1-bit channels' clip constant comes from."""
    c2 = OttConfig(outlier_num=0)
    errs = two_bit_errors(calib_npz, None, {str(c): (c2, KeyMix(clip1=c), 0.0) for c in grid}, q_last=1024)
    return {c: errs[str(c)][0] for c in grid}


# ----------------------------------------------------------------------------- 2. end to end, eval callback


class _KeySealer:
    """cb_eval: replaces each served layer's `Kcur-<il>` (one 128-token group per ubatch) by what the reference's
    sealing of that group serves: k_hat, with the group's outlier winners exact."""

    def __init__(self, n_kv: int, served: list[int]) -> None:
        self.n_kv = n_kv
        self.names = {f"Kcur-{il}".encode(): il for il in served}
        self.config: OttConfig | None = None
        self.mix: KeyMix | None = None  # the study option of reference.quantize_keys
        self.rope: Any = None  # study.pre_rope.Rope: quantize the keys before RoPE (None: after, as the cache)
        self.states: dict[tuple[int, int], HeadState] = {}
        self.error: BaseException | None = None

    def __call__(self, t: int, ask: bool, _user_data: Any) -> bool:
        try:
            tt = GgmlTensor.from_address(t)
            il = self.names.get(tt.name)
            if il is None or self.config is None or tt.view_src or tt.type != _F32 or tt.ne[1] != self.n_kv:
                return not ask
            if ask:
                return True
            D, n = int(tt.ne[0]), int(tt.ne[2])
            if n != G:
                raise RuntimeError(f"ubatch of {n} tokens, expected {G}")
            a = np.ctypeslib.as_array((ctypes.c_float * (D * self.n_kv * n)).from_address(tt.data))
            a = a.reshape(n, self.n_kv, D)
            for h in range(self.n_kv):
                st = self.states.setdefault((il, h), HeadState.empty(G, D))
                k16 = a[:, h].astype(np.float16)
                p0 = st.n_pos
                st.tail_pos = np.arange(p0, p0 + n, dtype=np.int64)
                kq = k16 if self.rope is None else self.rope.turn(a[:, h], st.tail_pos, -1).astype(np.float16)
                st.tail_k, st.tail_v = kq, np.zeros_like(kq)
                seal_group(st, self.config, self.config.outliers_for_layer(il), self.mix)
                k_hat = st.groups[-1].k_hat.copy()
                if self.rope is not None:
                    k_hat = self.rope.turn(k_hat, np.arange(p0, p0 + n), 1)
                won = st.groups[-1].placeholders - p0
                k_hat[won] = k16[won]
                a[:, h] = k_hat
                st.groups[-1].k_hat = st.groups[-1].v_hat = np.zeros(0, np.float32)  # keep memory flat
            return True
        except BaseException as e:  # noqa: BLE001 - reported after llama_decode returns
            self.error = e
            return False


Variant = OttConfig | tuple[OttConfig, KeyMix | None] | tuple[OttConfig, KeyMix | None, bool] | None


def end_to_end(
    name: str, chunks: int, variants: dict[str, Variant], n_ctx: int = N_CTX, threads: int = 2, rope: Any = None
) -> dict[str, tuple[float, float]]:
    """Part 2: {variant: (mean KLD vs f16, top-1 %)} over `chunks` chunks of n_ctx tokens (second halves).
    A variant: a configuration, or one with a KeyMix (reference.quantize_keys's study option) and optionally a flag
    that quantizes the keys before RoPE (study.pre_rope; `rope` is the model's), None: exact keys."""
    lc = llama_cpp_module().llama_cpp
    _ggml()  # checks the ggml_tensor layout before any tensor is read
    path = models.fetch(name, quiet=True)
    lc.llama_backend_init()
    llm = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if not llm:
        raise RuntimeError(f"llama.cpp could not load {path}")
    ctx = batch = None
    try:
        n_layer, n_kv = lc.llama_model_n_layer(llm), lc.llama_model_n_head_kv(llm)
        arch = "gemma3" if "gemma" in name else "llama"
        swa, _ = _swa_layers(lc, llm, arch, n_layer, max(0, lc.llama_model_n_swa(llm)))
        served = [il for il in range(n_layer) if il not in set(swa)]
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm))
        toks = _tokenize(lc, llm, corpus.docs_text(), n_ctx * chunks, True)
        sealer = _KeySealer(n_kv, served)
        cb = lc.ggml_backend_sched_eval_callback(sealer)
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = n_ctx
        cp.n_ubatch, cp.n_seq_max = G, 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k = cp.type_v = 1  # f16
        cp.cb_eval, cp.cb_eval_user_data = cb, None
        ctx = lc.llama_init_from_model(llm, cp)
        batch = lc.llama_batch_init(n_ctx, 0, 1)
        first = n_ctx // 2

        def run(c: int, variant: Variant) -> np.ndarray:
            config, mix, pre = (*variant, False)[:3] if isinstance(variant, tuple) else (variant, None, False)
            if pre and rope is None:
                raise ValueError("a pre-RoPE variant needs the model's rope")
            sealer.config, sealer.mix, sealer.states, sealer.error = config, mix, {}, None
            sealer.rope = rope if pre else None
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            chunk = [toks[0], *toks[c * n_ctx + 1 : (c + 1) * n_ctx]]  # BOS first, as llama-perplexity
            batch.n_tokens = n_ctx
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = tok, i, 1, 0
                batch.logits[i] = first - 1 <= i < n_ctx - 1
            rc = lc.llama_decode(ctx, batch)
            if sealer.error is not None:
                raise RuntimeError("eval callback failed") from sealer.error
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            lg = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n_ctx - first, vocab)).astype(np.float64)
            lg -= lg.max(1, keepdims=True)
            return lg - np.log(np.exp(lg).sum(1, keepdims=True))

        got: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {v: [] for v in variants}
        for c in range(chunks):
            base = run(c, None)
            for v, config in variants.items():
                lp = run(c, config)
                got[v].append(((np.exp(base) * (base - lp)).sum(1), base.argmax(1) == lp.argmax(1)))
                print(f"{name} chunk {c} {v}: KLD {got[v][-1][0].mean():.5f}", file=sys.stderr, flush=True)
        out = {}
        for v, rs in got.items():
            kld, top = np.concatenate([r[0] for r in rs]), np.concatenate([r[1] for r in rs])
            out[v] = (float(kld.mean()), 100 * float(top.mean()))
        return out
    finally:
        if batch is not None:
            lc.llama_batch_free(batch)
        if ctx:
            lc.llama_free(ctx)
        lc.llama_model_free(llm)


VARIANTS = {
    "unquantized keys (check: 0)": None,
    "ott2 keys": OttConfig(k_bits=2),
    "ott3 keys": OttConfig(k_bits=3),
    "ott3 keys, k_mix": OttConfig(k_bits=3, k_mix=True),
    "ott4 keys": OttConfig(k_bits=4),
}


TWO_BIT_E2E: dict[str, Variant] = {
    "unquantized keys (check: 0)": None,
    "ott2 keys (uniform 2)": OttConfig(k_bits=2),
    "ott2 keys, k_mix 1/2/3": (OttConfig(k_bits=2), KeyMix()),
    "ott2 keys, k_mix 0/2/4": (OttConfig(k_bits=2), KeyMix(lo=0, hi=4, hi_div=4)),
    "ott3 keys, k_mix (today's ott3)": OttConfig(k_bits=3, k_mix=True),
}


def _captures(a: argparse.Namespace, name: str, n_ctx: int) -> tuple[Path, Path]:
    """The evaluation capture of n_ctx tokens (the docs from byte 0) and the calibration capture (2048 tokens from
    byte CALIB_OFFSET), captured when missing."""
    ev, cal = a.captures / f"{name}-{n_ctx}.npz", a.captures / f"{name}-calib-2048.npz"
    if not ev.exists():
        capture(name, None, n_ctx, ev, n_threads=a.threads)
    if not cal.exists():
        capture(name, calibration_text(60_000), 2048, cal, n_threads=a.threads)
    return ev, cal


def two_bit(a: argparse.Namespace) -> str:
    """Issue 51: 2-bit key quantizers at two contexts (part 1), the 1-bit clip on the calibration split, and
    optionally part 2 end to end. Returns the tables as markdown."""
    ctxs = [int(x) for x in a.n_ctx.split(",")]
    parts: list[str] = []
    for name in a.models.split(","):
        t0 = time.time()
        parts += [f"### {name}", ""]
        if a.e2e_only:
            ctxs = []
        else:
            ev, cal = _captures(a, name, max(ctxs))
        if a.clip1 and ctxs:
            ce = clip1_errors(cal)
            best = min(ce, key=lambda c: ce[c])
            parts += ["1-bit clip (k_mix 1/2/3, quarters; calibration split, 2048 tokens, last 1024 queries):", "",
                      "| clip1 (64ths) | " + " | ".join(str(c) for c in ce) + " |",
                      "|---|" + "---|" * len(ce),
                      "| rel. attention error | " + " | ".join(
                          f"**{e:.4f}**" if c == best else f"{e:.4f}" for c, e in ce.items()) + " |", ""]  # fmt: skip
            me = mix_grid_errors(cal)
            parts += ["Mixes at 2 bits per key on average (calibration split, 2048 tokens, last 1024 queries; "
                      f"1-bit channels at clip {K1_CLIP64}/64):", "",
                      "| keys | rel. attention error | vs uniform 2 |", "|---|---|---|"]  # fmt: skip
            parts += [f"| {n} | {e:.4f} | {e / me['uniform 2']:.2f}x |" for n, e in me.items()]
            parts.append("")
        if ctxs:
            res = {n_ctx: two_bit_errors(ev, n_ctx, two_bit_variants()) for n_ctx in ctxs}
            base = {n: r["uniform 2 (ott2 today)"] for n, r in res.items()}
            head = " | ".join(f"{n} tokens | vs uniform 2 | heads better" for n in ctxs)
            parts += [f"Attention error, keys only (part 1b; last {Q_LAST} queries; bits per key element: codes, fp16 "
                      "scale and min per channel and group, 2-bit width table where widths mix):", "",
                      f"| keys | bits/key | {head} |", "|---|---|" + "---|---|---|" * len(ctxs)]  # fmt: skip
            for v, (_, _, bits) in two_bit_variants().items():
                cells = []
                for n in ctxs:
                    e, per = res[n][v]
                    cells.append(f"{e:.4f} | {e / base[n][0]:.2f}x | {int((per < base[n][1]).sum())}/{len(per)}")
                parts.append(f"| {v} | {bits:.3f} | " + " | ".join(cells) + " |")
            parts += ["", f"({name}: part 1b in {time.time() - t0:.0f} s)", ""]
        print("\n".join(parts), flush=True)
        if a.chunks:
            t0 = time.time()
            e2e = end_to_end(name, a.chunks, TWO_BIT_E2E, a.e2e_ctx, a.threads)
            ref = e2e["ott2 keys (uniform 2)"][0]
            parts += [f"End to end, keys only, pessimistic (part 2; {a.chunks} chunk(s) of {a.e2e_ctx} tokens, "
                      f"{time.time() - t0:.0f} s):", "",
                      "| keys | mean KLD | vs ott2 keys | top-1 % |", "|---|---|---|---|"]  # fmt: skip
            parts += [f"| {v} | {k:.5f} | {k / ref:.2f}x | {t:.2f} |" for v, (k, t) in e2e.items()]
            parts.append("")
        print("\n".join(parts), flush=True)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/k-channel-widths.md"))
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--chunks", type=int, default=4, help="evaluation chunks of 2048 tokens (part 2)")
    ap.add_argument("--captures", type=Path, default=Path.home() / ".cache/ott-gguf/captures")
    ap.add_argument("--two-bit", action="store_true", help="issue 51: 2-bit key quantizers (part 1b, --n-ctx)")
    ap.add_argument("--n-ctx", default="4096", help="contexts of part 1 (--two-bit: comma list, e.g. 2048,8192)")
    ap.add_argument("--e2e-ctx", type=int, default=N_CTX, help="tokens per chunk of part 2")
    ap.add_argument("--clip1", action="store_true", help="--two-bit: measure the 1-bit clip (calibration split)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--e2e-only", action="store_true", help="--two-bit: part 2 only")
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.two_bit:
        body = two_bit(a)
        cmd = " ".join(["python -m study.k_widths", *(argv if argv is not None else sys.argv[1:])])
        a.out.write_text(
            f"<!-- written by `{cmd}` on {platform.machine()} in {time.time() - t0:.0f} s, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} -->\n\n{body}\n"
        )
        return 0
    parts: list[str] = []
    for name in a.models.split(","):
        n_ctx = int(a.n_ctx)
        ev, cal = _captures(a, name, n_ctx)
        errs = attention_errors(ev, cal, n_ctx)
        base = errs["uniform 3"]
        parts += [f"## {name}", "", "Attention error (keys only, part 1):", "",
                  "| allocation (3 bits per key on average; uniform 2/4 aside) | rel. attention error | vs uniform 3 |",
                  "|---|---|---|"]  # fmt: skip
        parts += [f"| {n} | {e:.4f} | {e / base:.2f}x |" for n, e in errs.items()]
        e2e = end_to_end(name, a.chunks, dict(VARIANTS), a.e2e_ctx, a.threads)
        ref = e2e["ott3 keys"][0]
        parts += ["", f"End to end, keys only, pessimistic (part 2; {a.chunks} chunks of {a.e2e_ctx} tokens):", "",
                  "| keys | mean KLD | vs ott3 keys | top-1 % |", "|---|---|---|---|"]  # fmt: skip
        parts += [f"| {v} | {k:.5f} | {k / ref:.2f}x | {t:.2f} |" for v, (k, t) in e2e.items()]
        parts.append("")
    text = (
        "# K widths per channel\n\n"
        f"Measured {time.strftime('%a %b %d %H:%M:%S %Y')} on {platform.machine()} in {time.time() - t0:.0f} s "
        f"(`python -m study.k_widths --out {a.out} --models {a.models} --chunks {a.chunks}`).\n\n"
        + (__doc__ or "").split("\n\n", 2)[2]
        + "\n\n"
        + "\n".join(parts)
    )
    a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
