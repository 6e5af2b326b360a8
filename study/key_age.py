"""Key widths by age (issue 51): what 3-bit keys in the newest sealed groups, narrowed to 2 bits as they age, would
buy ott2 as the cache serves keys.

    python -m study.key_age [--models smollm2-135m,gemma3-270m] [--n-ctx 8192] [--ages 0,1,2,4,8]
    python -m study.key_age --split     (the attention error's K/V split for ott2 and the tiers' wide layers)

Part 1 of study.pre_rope's cache measure (captured keys, the last 256 queries, values exact, the newest R = 32
tokens and the open group exact, position 0 exact as the outlier pool holds BOS): a query at position p sees its
n_sealed(p) = (p + 1 - R) // G sealed groups; the newest A of them are served at 3 bits (k_mix 2/3/4, ott3's
keys), the older ones at 2 bits (k_mix 1/2/3, ott2's). A = 0 is ott2 today. Each sealed group is quantized once
per width from the same fp16 keys (a cache would narrow the 3-bit codes; this is the bound that narrowing
approaches). Bytes: A groups at 3 bits instead of 2 cost about one bit per key element of A * G tokens, printed
as bits per K/V element at the context measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from ott_gguf.kv_types import OttConfig
from ott_gguf.reference import quantize_values

from .k_widths import Q_LAST, _captures, _Prefix, _quantize_keys_with

G = 128


def age_errors(npz: Path, n_ctx: int, ages: list[int], narrowed: bool = False, R: int = 32) -> dict[int, float]:
    """{A: relative attention error} with the newest A sealed groups of each query at 3 bits; narrowed: the older
    groups' 2-bit keys quantized from their 3-bit keys (as a cache that narrows would hold them), not from fp16.
    R: the fp16 window (ott2's R = 32)."""
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
            if narrowed:  # what a cache that narrows its 3-bit groups holds: 2-bit codes of the 3-bit keys
                k2 = _quantize_keys_with(k3.astype(np.float16), c2, None)
            k2[0] = k3[0] = kx[0]  # BOS exact: the outlier pool holds it in most heads
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


# (name, K config, V config, R): ott2 today, the compact tier's 3-bit layers, the quality tier's 3/2 layers
SPLIT_CONFIGS = {
    "ott2 (2-bit k_mix K, 2-bit rotated V, R 32)": (OttConfig(k_bits=2, outlier_num=0), OttConfig(bits=2), 32),
    "3/2, symmetric V, R 32 (compact's wide layers)": (
        OttConfig(k_bits=3, outlier_num=0), OttConfig(bits=2, v_sym=True), 32),
    "3/2, symmetric V, R 64 (the quality tier's 3/2)": (
        OttConfig(k_bits=3, outlier_num=0), OttConfig(bits=2, v_sym=True), 64),
    "3/3, R 64 (the quality tier's 3/3)": (OttConfig(k_bits=3, outlier_num=0), OttConfig(bits=3), 64),
}  # fmt: skip


def kv_split(npz: Path, n_ctx: int) -> dict[str, dict[str, float]]:
    """{config: {"K only", "V only", "K and V": relative attention error}} as the cache serves a query (the newest
    R tokens and the open group exact), position 0 exact (the outlier pool holds BOS in most heads)."""
    z = _Prefix(np.load(npz), n_ctx)
    swa = {int(x) for x in z["meta_swa_layers"]}
    n_layer, scale = int(z["meta_n_layer"]), float(z["meta_attn_scale"])
    parts = ("K only", "V only", "K and V")
    tot = {(c, w): np.zeros(2) for c in SPLIT_CONFIGS for w in parts}
    for il in (i for i in range(n_layer) if i not in swa):
        q, k, v = (z[f"{x}{il}"] for x in "qkv")
        T = len(k) - len(k) % G
        rep = q.shape[1] // k.shape[1]
        qp = np.arange(T - Q_LAST, T)
        cols = np.arange(T)[None, :]
        mask = cols > qp[:, None]
        for h in range(k.shape[1]):
            k16, v16 = k[:T, h].astype(np.float16), v[:T, h].astype(np.float16)
            kx, vx = k16.astype(np.float32), v16.astype(np.float32)
            for name, (ck, cv, r_win) in SPLIT_CONFIGS.items():
                kh = _quantize_keys_with(k16, ck, None)
                vh = np.concatenate([quantize_values(vx[g : g + G], cv)[3] for g in range(0, T, G)])
                kh[0], vh[0] = kx[0], vx[0]
                sealed = cols < (np.maximum(0, (qp + 1 - r_win) // G) * G)[:, None]
                for r in range(rep):
                    qh = q[T - Q_LAST : T, h * rep + r].astype(np.float32)
                    s_x = qh @ kx.T * scale
                    s_q = np.where(sealed, qh @ kh.T * scale, s_x)
                    outs = {}
                    cases = (("exact", s_x, False), ("K only", s_q, False), ("V only", s_x, True),
                             ("K and V", s_q, True))  # fmt: skip
                    for w, s, use_vh in cases:
                        s = np.where(mask, -np.inf, s)
                        p = np.exp(s - s.max(1, keepdims=True))
                        p /= p.sum(1, keepdims=True)
                        outs[w] = (p * sealed) @ vh + (p * ~sealed) @ vx if use_vh else p @ vx
                    for w in parts:
                        tot[(name, w)] += [np.sum((outs[w] - outs["exact"]) ** 2), np.sum(outs["exact"] ** 2)]
    return {c: {w: float(tot[(c, w)][0] / tot[(c, w)][1]) for w in parts} for c in SPLIT_CONFIGS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--ages", default="0,1,2,4,8,16")
    ap.add_argument("--captures", type=Path, default=Path.home() / ".cache/ott-gguf/captures")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--split", action="store_true", help="the K/V split of the attention error instead")
    ap.add_argument("--narrowed", action="store_true", help="old groups' 2-bit keys from their 3-bit keys")
    ap.add_argument("--R", type=int, default=32, help="the fp16 window")
    a = ap.parse_args(argv)
    if a.split:
        for name in a.models.split(","):
            t0 = time.time()
            ev, _ = _captures(a, name, a.n_ctx)
            res = kv_split(ev, a.n_ctx)
            print(f"## {name}, {a.n_ctx} tokens, K/V split ({time.time() - t0:.0f} s)\n")
            print("| cache (no pools; position 0 exact) | K only | V only | K and V | V's share |")
            print("|---|---|---|---|---|")
            for c, r in res.items():
                share = r["V only"] / (r["K only"] + r["V only"])
                print(f"| {c} | {r['K only']:.4f} | {r['V only']:.4f} | {r['K and V']:.4f} | {100 * share:.0f}% |")
            print(flush=True)
        return 0
    ages = [int(x) for x in a.ages.split(",")]
    for name in a.models.split(","):
        t0 = time.time()
        ev, _ = _captures(a, name, a.n_ctx)
        errs = age_errors(ev, a.n_ctx, ages, a.narrowed, a.R)
        print(f"## {name}, {a.n_ctx} tokens, R {a.R} ({time.time() - t0:.0f} s)\n")
        print("| newest sealed groups at 3 bits | rel. attention error | vs ott2 | extra bits per K/V element |")
        print("|---|---|---|---|")
        for age, e in errs.items():
            extra = age * G * (1 + 2 / G) / a.n_ctx / 2  # one more code bit (and table bits) on the K side only
            print(f"| {age} | {e:.4f} | {e / errs[ages[0]]:.2f}x | {extra:.3f} |")
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
