"""Where the quantizer's clipped ranges come from (ott_gguf.quantizer.K_CLIP64, V_ROT_CLIP64; docs/clipping.md).

    python -m study.clipping                          # rotated values: the MSE-optimal clip of Gaussian blocks
    python -m study.clipping --captures --out docs/clipping.md   # keys too: attention error on both test models

Rotated values are close to Gaussian (the Hadamard transform mixes 64 channels), so their clip is the one that
minimises the mean squared error of a block of Gv Gaussian values, found by Monte Carlo on the quantizer's own grid
(sixty-fourths of the range) with the reference arithmetic. Keys are not Gaussian (channel-wise over G tokens,
heavy-tailed) and what matters is q.k, not their MSE: their clip per width is measured as attention error on
captured Q/K/V of both test models (the fidelity study's harness: full-attention layers, decode mode, relative L2
error of the attention output against exact K/V, the same ratio to llama.cpp's rotated q4_0 as docs/fidelity.md).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ott_gguf import quantizer as Q
from ott_gguf import reference as ref

# the captures' models and how many tokens / which query stride to evaluate (as study.fidelity's defaults)
MODELS = ("smollm2-135m", "gemma3-270m")
N_TOKENS = 2048
STRIDE = 16
K_GRID = (40, 44, 48, 52, 56, 58, 60, 64)


def mse(x: np.ndarray, fmt: Q.BlockFormat) -> float:
    return float(((Q.dequantize(Q.quantize(x, fmt)) - x) ** 2).mean())


def best_clip(bits: int, group: int, n_blocks: int, seed: int) -> tuple[int, float]:
    """(clip in sixty-fourths, its MSE over the full range's) for Gaussian blocks of `group` values."""
    x = np.random.default_rng(seed).standard_normal((n_blocks, group)).astype(np.float32)
    full = mse(x, Q.BlockFormat(bits, group))
    errs = {c: mse(x, Q.BlockFormat(bits, group, c)) for c in range(16, Q.CLIP_ONE + 1)}
    c = min(errs, key=lambda k: (errs[k], k))
    return c, errs[c] / full


def gaussian_table(n_blocks: int, seed: int) -> list[str]:
    out = [
        "| V bits | Gv | best clip (64ths) | c | MSE vs min-max | V_ROT_CLIP64 |",
        "|---|---|---|---|---|---|",
    ]
    for group in (32, 64, 128, 256):
        for bits in (2, 3, 4):
            c, ratio = best_clip(bits, group, n_blocks, seed)
            out.append(
                f"| {bits} | {group} | {c} | {c / Q.CLIP_ONE:.3f} | {ratio:.3f} | {Q.V_ROT_CLIP64[(bits, group)]} |"
            )
    return out


class _KClip:
    """Temporarily the given key clip for one width (a study knob: the kernels' table is fixed at build time)."""

    def __init__(self, bits: int, clip: int) -> None:
        self.bits, self.clip = bits, clip

    def __enter__(self) -> None:
        self.saved = Q.K_CLIP64[self.bits]
        Q.K_CLIP64[self.bits] = self.clip

    def __exit__(self, *exc: object) -> None:
        Q.K_CLIP64[self.bits] = self.saved


def attention_errors(model: str, variants: dict[str, tuple[ref.OttConfig, int | None]]) -> dict[str, float]:
    """Mean relative L2 attention error over the full-attention layers, per variant, and for rotated q4_0."""
    from study import fidelity as F
    from study.capture import read_meta

    npz = F.ensure_capture(model, 4096)
    errs: dict[str, list[float]] = {name: [] for name in variants}
    errs["q4_0+rot"] = []
    with np.load(npz) as f:
        meta = read_meta(f)
        swa = set(meta["swa_layers"])
        qpos = np.arange(STRIDE - 1, N_TOKENS, STRIDE)
        for il in (il for il in range(meta["n_layer"]) if il not in swa):
            q, k, v = (np.asarray(f[f"{x}{il}"][:N_TOKENS]) for x in ("q", "k", "v"))
            k16, v16 = k.astype(np.float16), v.astype(np.float16)
            ev = F.LayerEval(q, k16, v16, qpos, meta["attn_scale"], 0)
            o_ref = ev.run()
            base = F.Scheme("q4_0+rot", "token", fmt="q4_0", rotate=True)
            ks, vs = F.served(base, k16, v16, il, int(qpos.max()), (0,))
            errs["q4_0+rot"].append(F.rel_errors(ev.run(ks, vs, F.boundaries(base, qpos, "decode")), o_ref)[1])
            for name, (cfg, kclip) in variants.items():
                with _KClip(cfg.kbits, kclip if kclip is not None else Q.K_CLIP64[cfg.kbits]):
                    ks, vs, _ = F._ott_served(k16, v16, cfg, il, F.n_groups_needed(int(qpos.max()), cfg))
                s = F.Scheme(name, "ott", config=cfg)
                errs[name].append(F.rel_errors(ev.run(ks, vs, F.boundaries(s, qpos, "decode")), o_ref)[1])
    return {name: float(np.mean(e)) for name, e in errs.items()}


def capture_tables() -> list[str]:
    base = ref.OttConfig()
    out: list[str] = []
    for model in MODELS:
        t0 = time.perf_counter()
        variants: dict[str, tuple[ref.OttConfig, int | None]] = {}
        for kb, vb in ((2, 2), (3, 2), (4, 2), (3, 3)):
            cfg = replace(base, k_bits=kb, v_bits=vb)
            variants[f"K{kb}V{vb} min-max"] = (replace(cfg, clip=False), None)
            variants[f"K{kb}V{vb} V clipped"] = (cfg, Q.CLIP_ONE)
            for c in K_GRID:
                variants[f"K{kb}V{vb} K {c}"] = (cfg, c)
        res = attention_errors(model, variants)
        q4 = res.pop("q4_0+rot")
        out += [
            f"### {model}",
            "",
            f"Full-attention layers, {N_TOKENS} tokens, every {STRIDE}th query, decode mode; rotated q4_0: "
            f"{q4:.4f}. Measured in {time.perf_counter() - t0:.0f} s.",
            "",
            "| K/V widths | min-max | V clipped | " + " | ".join(f"+ K {c}/64" for c in K_GRID) + " |",
            "|---|---|---|" + "---|" * len(K_GRID),
        ]
        for kb, vb in ((2, 2), (3, 2), (4, 2), (3, 3)):
            p = f"K{kb}V{vb}"
            cells = [res[f"{p} min-max"], res[f"{p} V clipped"]] + [res[f"{p} K {c}"] for c in K_GRID]
            best = min(cells[2:])
            row = [f"{x / q4:.3f}x" + (" **best**" if x == best and i >= 2 else "") for i, x in enumerate(cells)]
            marks = [f"{r} (table)" if i >= 2 and K_GRID[i - 2] == Q.K_CLIP64[kb] else r for i, r in enumerate(row)]
            out.append(f"| {kb}/{vb} | " + " | ".join(marks) + " |")
        out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=20000, help="Gaussian blocks per Monte Carlo estimate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--captures", action="store_true", help="also measure attention error on the test models")
    ap.add_argument("--out", type=Path, help="write the tables here (markdown) instead of printing them")
    a = ap.parse_args(argv)
    lines = ["## Rotated values: MSE-optimal clip of Gaussian blocks", ""] + gaussian_table(a.blocks, a.seed)
    if a.captures:
        lines += ["", "## Attention error vs rotated q4_0 (lower is better)", ""] + capture_tables()
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
