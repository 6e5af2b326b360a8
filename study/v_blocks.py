"""How close the rotated-V block quantizer is to what scalar quantization can do, and what a cheaper block header
would cost (docs/v-blocks.md).

    python -m study.v_blocks --out docs/v-blocks.md

Values are the side that limits the ott3/ott2 tier on SmolLM2 (docs/tiers.md: 3-bit values cut its KLD 2.3x,
a 4th key bit 1.1x), so this asks where the 2-bit V error can still go down at the same bytes. On the captured
values of both test models (full-attention layers, the first 2048 tokens, fp16 as the cache holds them), each
token's blocks of 64 channels are Hadamard-rotated as `v_rotate` does, then quantized by:

- `asym clipped`: the cache's format (fp16 scale and min, range clipped to V_ROT_CLIP64);
- `asym best clip per block`: the same format with each block's clip chosen to minimise its own error (an upper
  bound for any smarter search of scale and min, e.g. llama.cpp's make_qkx2_quants);
- `sym absmax c/64`: one fp16 scale per block (16 bits less), levels (k - (2^b - 1)/2) * d, d from the block's
  absolute maximum clipped to c/64 (order-independent, so exact across SIMD widths);
- `sym rms x c`: the same levels with d = c times the block's RMS;
- `2/3 bits by token range`: within each group of 128 tokens the quarter with the widest blocks at 3 bits, the
  rest at 2 (+0.25 bits per V element), and `1/2/3`: the widest quarter at 3, the narrowest at 1 (same bytes).

The error is the relative squared error sum((x_hat - x)^2) / sum(x^2) over all blocks; for orientation, a
Gaussian source at 2 bits cannot go below 0.1175 with any scalar quantizer (Lloyd-Max).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

MODELS = ("smollm2-135m", "gemma3-270m")
N_TOKENS = 2048
BLOCK = 64
V_CLIP = {1: 32, 2: 42, 3: 55, 4: 61}  # V_ROT_CLIP64 of the cache at Gv = 64 (and 32/64 at 1 bit)


def hadamard(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def asym(x: np.ndarray, bits: int, clip: np.ndarray | float) -> np.ndarray:
    nl = 2**bits - 1
    lo, hi = x.min(1), x.max(1)
    r = hi - lo
    c = np.broadcast_to(np.asarray(clip, np.float32), lo.shape)
    d, m = f16(r * c / nl), f16(lo + r * (1 - c) / 2)
    q = np.clip(np.rint((x - m[:, None]) / np.where(d > 0, d, 1)[:, None]), 0, nl)
    return m[:, None] + d[:, None] * q


def sym(x: np.ndarray, bits: int, d: np.ndarray) -> np.ndarray:
    nl = 2**bits - 1
    d = f16(d)
    q = np.clip(np.rint(x / np.where(d > 0, d, 1)[:, None] + nl / 2), 0, nl)
    return d[:, None] * (q - nl / 2)


def sse(xh: np.ndarray, x: np.ndarray) -> np.ndarray:
    return ((xh - x) ** 2).sum(1)


def rotated_values(model: str) -> np.ndarray:
    """[n_blocks, 64] rotated V blocks of the full-attention layers, in (layer, head, 128-token group) order."""
    from study import fidelity as F
    from study.capture import read_meta

    npz = F.ensure_capture(model, 4096)
    h = hadamard(BLOCK)
    out = []
    with np.load(npz) as f:
        meta = read_meta(f)
        swa = set(meta["swa_layers"])
        for il in (il for il in range(meta["n_layer"]) if il not in swa):
            v = np.asarray(f[f"v{il}"][:N_TOKENS]).astype(np.float16).astype(np.float32)
            t, nh, d = v.shape
            x = v.reshape(t, nh, d // BLOCK, BLOCK) @ h.T  # token-wise blocks, rotated
            out.append(x.transpose(1, 2, 0, 3).reshape(-1, BLOCK))  # head, block, token
    return np.concatenate(out)


def variants(x: np.ndarray, bits: int) -> dict[str, float]:
    ref = float((x**2).sum())
    res: dict[str, float] = {}
    base = sse(asym(x, bits, V_CLIP[bits] / 64), x)
    res["asym clipped (the cache)"] = float(base.sum()) / ref
    best = base.copy()
    for c in range(24, 65, 2):
        best = np.minimum(best, sse(asym(x, bits, c / 64), x))
    res["asym best clip per block"] = float(best.sum()) / ref
    nl = 2**bits - 1
    amax, rms = np.abs(x).max(1), np.sqrt((x**2).mean(1))
    sym_abs = {c: float(sse(sym(x, bits, 2 * amax * c / 64 / nl), x).sum()) / ref for c in range(24, 65, 2)}
    c_abs = min(sym_abs, key=lambda c: sym_abs[c])
    res[f"sym absmax {c_abs}/64 (best clip)"] = sym_abs[c_abs]
    sym_rms = {c / 20: float(sse(sym(x, bits, rms * c / 20), x).sum()) / ref for c in range(6, 31)}
    c_rms = min(sym_rms, key=lambda c: sym_rms[c])
    res[f"sym rms x {c_rms:.2f} (best)"] = sym_rms[c_rms]
    if bits == 2:
        n = x.shape[0] // 128 * 128
        g = x[:n].reshape(-1, 128, BLOCK)
        order = np.argsort(-(g.max(2) - g.min(2)), 1)  # widest blocks first
        e = {b: sse(asym(g.reshape(-1, BLOCK), b, V_CLIP[b] / 64), g.reshape(-1, BLOCK)).reshape(-1, 128)
             for b in (1, 2, 3)}  # fmt: skip
        wide = np.zeros(order.shape, bool)
        np.put_along_axis(wide, order[:, :32], True, 1)
        narrow = np.zeros(order.shape, bool)
        np.put_along_axis(narrow, order[:, 96:], True, 1)
        ref_n = float((g**2).sum())
        res["2/3 bits by token range (+0.25 bits)"] = float(np.where(wide, e[3], e[2]).sum()) / ref_n
        mixed = np.where(wide, e[3], np.where(narrow, e[1], e[2]))
        res["1/2/3 bits by token range (same bytes)"] = float(mixed.sum()) / ref_n
    return res


def report(log: Callable[[str], None] = print) -> list[str]:
    lines = []
    for model in MODELS:
        t = time.time()
        x = rotated_values(model)
        lines += [f"### {model} ({x.shape[0]} blocks of {BLOCK} rotated values)", "",
                  "| V bits | quantizer | bits per element | relative squared error | vs the cache |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for bits in (2, 3):
            res = variants(x, bits)
            base = res["asym clipped (the cache)"]
            for name, err in res.items():
                per = bits + (16 if name.startswith("sym") else 32) / BLOCK
                if name.startswith("2/3"):
                    per += 0.25
                lines.append(f"| {bits} | {name} | {per:.2f} | {err:.4f} | {err / base:.3f}x |")
        lines.append("")
        log(f"{model}: {time.time() - t:.0f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    t = time.time()
    lines = report()
    text = "\n".join(lines) + "\n"
    if a.out:
        head = f"Measured {time.ctime()} in {time.time() - t:.0f} s (`python -m study.v_blocks --out {a.out}`).\n\n"
        a.out.write_text(head + text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
