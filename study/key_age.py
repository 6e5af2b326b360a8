"""Key widths by age (issue 51): what 3-bit keys in the newest sealed groups, narrowed to 2 bits as they age, would
buy ott2 as the cache serves keys.

    python -m study.key_age [--models smollm2-135m,gemma3-270m] [--n-ctx 8192] [--ages 0,1,2,4,8]

Part 1 of study.pre_rope's cache measure (captured keys, the last 256 queries, values exact, the newest R = 32
tokens and the open group exact): a query at position p sees its n_sealed(p) = (p + 1 - R) // G sealed groups; the
newest A of them are served at 3 bits (k_mix 2/3/4, ott3's keys), the older ones at 2 bits (k_mix 1/2/3, ott2's).
A = 0 is ott2 today. Each sealed group is quantized once per width from the same fp16 keys (a cache would narrow
the 3-bit codes; this is the bound that narrowing approaches). Bytes: A groups at 3 bits instead of 2 cost
A * G * (1 + 2/G') bits per key channel, printed as bits per K/V element at the context measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from ott_gguf.kv_types import OttConfig

from .k_widths import Q_LAST, _captures, _Prefix, _quantize_keys_with

G, R = 128, 32


def age_errors(npz: Path, n_ctx: int, ages: list[int]) -> dict[int, float]:
    """{A: relative attention error} with the newest A sealed groups of each query at 3 bits."""
    z = _Prefix(np.load(npz), n_ctx)
    swa = {int(x) for x in z["meta_swa_layers"]}
    n_layer, scale = int(z["meta_n_layer"]), float(z["meta_attn_scale"])
    c2, c3 = OttConfig(k_bits=2, outlier_num=0), OttConfig(k_bits=3, outlier_num=0)
    tot = {a: np.zeros(2) for a in ages}
    for il in (i for i in range(n_layer) if i not in swa):
        q, k, v = (z[f"{x}{il}"] for x in "qkv")
        T = len(k) - len(k) % G
        rep = q.shape[1] // k.shape[1]
        qp = np.arange(T - Q_LAST, T)
        n_sealed = np.maximum(0, (qp + 1 - R) // G)
        cols = np.arange(T)[None, :]
        mask = cols > qp[:, None]
        for h in range(k.shape[1]):
            k16 = k[:T, h].astype(np.float16)
            kx, vh = k16.astype(np.float32), v[:T, h].astype(np.float32)
            k2, k3 = _quantize_keys_with(k16, c2, None), _quantize_keys_with(k16, c3, None)
            for r in range(rep):
                qh = q[T - Q_LAST : T, h * rep + r].astype(np.float32)
                s_x, s_2, s_3 = (qh @ kk.T * scale for kk in (kx, k2, k3))
                outs = {}
                for a in [None, *ages]:
                    if a is None:
                        s = s_x
                    else:
                        sealed = cols < (n_sealed * G)[:, None]
                        young = cols >= (np.maximum(0, n_sealed - a) * G)[:, None]
                        s = np.where(sealed & young, s_3, np.where(sealed, s_2, s_x))
                    s = np.where(mask, -np.inf, s)
                    p = np.exp(s - s.max(1, keepdims=True))
                    outs[a] = (p / p.sum(1, keepdims=True)) @ vh
                for a in ages:
                    tot[a] += [np.sum((outs[a] - outs[None]) ** 2), np.sum(outs[None] ** 2)]
    return {a: float(e[0] / e[1]) for a, e in tot.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--ages", default="0,1,2,4,8,16")
    ap.add_argument("--captures", type=Path, default=Path.home() / ".cache/ott-gguf/captures")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    ages = [int(x) for x in a.ages.split(",")]
    for name in a.models.split(","):
        t0 = time.time()
        ev, _ = _captures(a, name, a.n_ctx)
        errs = age_errors(ev, a.n_ctx, ages)
        print(f"## {name}, {a.n_ctx} tokens ({time.time() - t0:.0f} s)\n")
        print("| newest sealed groups at 3 bits | rel. attention error | vs ott2 | extra bits per K/V element |")
        print("|---|---|---|---|")
        for age, e in errs.items():
            extra = age * G * (1 + 2 / G) / a.n_ctx / 2  # one more code bit (and table bits) on the K side only
            print(f"| {age} | {e:.4f} | {e / errs[ages[0]]:.2f}x | {extra:.3f} |")
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
