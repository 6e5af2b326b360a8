"""K widths per channel (issue 12): which channels of a key group deserve more bits, measured two ways.

    python -m study.k_widths --out docs/k-channel-widths.md [--models smollm2-135m,gemma3-270m] [--chunks 4]

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
from ott_gguf.reference import HeadState, key_widths, seal_group

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
    T = len(k)
    qp = np.arange(T - Q_LAST, T)
    mask = np.arange(T)[None, :] > qp[:, None]
    err = np.zeros(2)
    for h in range(q.shape[1]):
        outs = []
        for kk in (k, k_hat):
            s = q[T - Q_LAST :, h] @ kk.T * scale
            s[mask] = -np.inf
            p = np.exp(s - s.max(1, keepdims=True))
            outs.append((p / p.sum(1, keepdims=True)) @ v)
        err += [np.sum((outs[1] - outs[0]) ** 2), np.sum(outs[0] ** 2)]
    return err


def attention_errors(eval_npz: Path, calib_npz: Path) -> dict[str, float]:
    """Part 1: relative attention error per allocation, summed over the served layers and KV heads."""
    z, zc = np.load(eval_npz), np.load(calib_npz)
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


# ----------------------------------------------------------------------------- 2. end to end, eval callback


class _KeySealer:
    """cb_eval: replaces each served layer's `Kcur-<il>` (one 128-token group per ubatch) by what the reference's
    sealing of that group serves: k_hat, with the group's outlier winners exact."""

    def __init__(self, n_kv: int, served: list[int]) -> None:
        self.n_kv = n_kv
        self.names = {f"Kcur-{il}".encode(): il for il in served}
        self.config: OttConfig | None = None
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
                st.tail_k, st.tail_v = k16, np.zeros_like(k16)
                seal_group(st, self.config, self.config.outliers_for_layer(il))
                k_hat = st.groups[-1].k_hat.copy()
                won = st.groups[-1].placeholders - p0
                k_hat[won] = k16[won]
                a[:, h] = k_hat
                st.groups[-1].k_hat = st.groups[-1].v_hat = np.zeros(0, np.float32)  # keep memory flat
            return True
        except BaseException as e:  # noqa: BLE001 - reported after llama_decode returns
            self.error = e
            return False


def end_to_end(name: str, chunks: int, variants: dict[str, OttConfig | None]) -> dict[str, tuple[float, float]]:
    """Part 2: {variant: (mean KLD vs f16, top-1 %)} over `chunks` chunks of N_CTX tokens (second halves)."""
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
        toks = _tokenize(lc, llm, corpus.docs_text(), N_CTX * chunks, True)
        sealer = _KeySealer(n_kv, served)
        cb = lc.ggml_backend_sched_eval_callback(sealer)
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = N_CTX
        cp.n_ubatch, cp.n_seq_max = G, 1
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k = cp.type_v = 1  # f16
        cp.cb_eval, cp.cb_eval_user_data = cb, None
        ctx = lc.llama_init_from_model(llm, cp)
        batch = lc.llama_batch_init(N_CTX, 0, 1)
        first = N_CTX // 2

        def run(c: int, config: OttConfig | None) -> np.ndarray:
            sealer.config, sealer.states, sealer.error = config, {}, None
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            chunk = [toks[0], *toks[c * N_CTX + 1 : (c + 1) * N_CTX]]  # BOS first, as llama-perplexity
            batch.n_tokens = N_CTX
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = tok, i, 1, 0
                batch.logits[i] = first - 1 <= i < N_CTX - 1
            rc = lc.llama_decode(ctx, batch)
            if sealer.error is not None:
                raise RuntimeError("eval callback failed") from sealer.error
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            lg = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(N_CTX - first, vocab)).astype(np.float64)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/k-channel-widths.md"))
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--chunks", type=int, default=4, help="evaluation chunks of 2048 tokens (part 2)")
    ap.add_argument("--captures", type=Path, default=Path.home() / ".cache/ott-gguf/captures")
    a = ap.parse_args(argv)
    t0 = time.time()
    parts: list[str] = []
    for name in a.models.split(","):
        ev, cal = a.captures / f"{name}-4096.npz", a.captures / f"{name}-calib-2048.npz"
        if not ev.exists():
            capture(name, None, 4096, ev)
        if not cal.exists():
            capture(name, calibration_text(60_000), 2048, cal)
        errs = attention_errors(ev, cal)
        base = errs["uniform 3"]
        parts += [f"## {name}", "", "Attention error (keys only, part 1):", "",
                  "| allocation (3 bits per key on average; uniform 2/4 aside) | rel. attention error | vs uniform 3 |",
                  "|---|---|---|"]  # fmt: skip
        parts += [f"| {n} | {e:.4f} | {e / base:.2f}x |" for n, e in errs.items()]
        e2e = end_to_end(name, a.chunks, {v: c for v, c in VARIANTS.items()})
        ref = e2e["ott3 keys"][0]
        parts += ["", f"End to end, keys only, pessimistic (part 2; {a.chunks} chunks of {N_CTX} tokens):", "",
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
