"""How often would the integer V pass's high-byte sums skip a token quad? (docs/decode-profile.md)

The AVX-512 VNNI V pass (ott_head.c.j2 vplane4i) weighs the codes of a sealed group with q_j = rint(w_j*65535/wmax)
split into two bytes, w_j = p_j d_j. A quad of 4 consecutive tokens whose high byte is zero in every query row of
a KV head adds nothing to the high sums, so it could be skipped exactly. This counts such quads on captured
attention (study.capture): each of the last `--queries` positions' query rows against every sealed group before
it (the recent window of 32 left out), p_j = exp(s_j - max of the group), d_j = (max - min)/3 of v_j (V unrotated:
an approximation of the stored scales).

    python -m study.capture --model smollm2-135m --tokens 4096 --out /tmp/smol.npz
    python -m study.v_hi_quads /tmp/smol.npz
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

G = 128
R = 32


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.v_hi_quads", description=__doc__)
    ap.add_argument("npz")
    ap.add_argument("--queries", type=int, default=6, help="query positions, spread over the last 200")
    args = ap.parse_args(argv)
    z = np.load(args.npz)
    n_layer = len([k for k in z.files if k.startswith("q") and k[1:].isdigit()])
    total = skip = 0
    for il in range(n_layer):
        q = z[f"q{il}"].astype(np.float32)
        k = z[f"k{il}"].astype(np.float32)
        v = z[f"v{il}"].astype(np.float32)
        n, n_head, head_dim = q.shape
        n_kv = k.shape[1]
        gq = n_head // n_kv
        for t in np.linspace(n - 200, n - 1, args.queries).astype(int):
            ng = (t + 1 - R) // G
            for h in range(n_kv):
                kk, vv = k[: ng * G, h], v[: ng * G, h]
                d = (vv.max(1) - vv.min(1)) / 3.0
                s = (q[t, h * gq : (h + 1) * gq] @ kk.T / np.sqrt(head_dim)).reshape(gq, ng, G)
                w = np.exp(s - s.max(2, keepdims=True)) * d.reshape(1, ng, G)
                qn = np.rint(w * 65535.0 / np.maximum(w.max(2, keepdims=True), 1e-30))
                live = (qn >= 256).reshape(gq, ng, G // 4, 4).any(3).any(0)
                total += live.size
                skip += int((~live).sum())
    print(f"{n_layer} layers: token quads with a zero high byte in every row: {skip}/{total} = {skip / total:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
