"""The tuning knobs that give the model the attention partials `ott-bench --sweep` timed fastest (issue 47).

The sweep (docs/cuda-harness.md "The sweep") times every instance <CPL, RP, NW> of the partials at the cache's slice
count, half and twice it, on a decoded token. This picks, for one shape and depth, the fastest decode row, and where
it beats the launcher's (the `*` row at the cache's slice count) by at least `--margin`, prints the environment that
makes a tuning build run it in the model (`OTT_CUDA_PART=<cpl>,<rp>,<nw>`, `OTT_SLICE_GROUPS=<groups per slice>`;
docs/cuda-harness.md "Tuning builds"); nothing when the launcher's is as fast. pipeline.sh times the model with it
beside f16 and the launcher's ott2, so that one lease answers what the sweep's answer is worth in tokens per second.

    ott-bench --sweep | tee sweep.log
    python3 -m study.gpu_offline.sweep_pick --shape smol --depth 4096 sweep.log   # OTT_CUDA_PART=2,4,8 ...
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# `# ott2 smol depth 4096: n_ctx 4352, NG 33, NS 9 (SG 4), ...` (a decoded token's case; a prefill ubatch's header
# says "a ubatch of")
HEADER = re.compile(r"^# \S+ (\S+) depth (\d+): n_ctx \d+, NG (\d+), NS (\d+)", re.M)
# `sweep smol 4096 1 9 <2,4,16>* 36 12.3 11.9 0.00e+00`: shape, depth, tokens, slices, instance, grid, us med, min, err
ROW = re.compile(r"^sweep (\S+) +(\d+) +(\d+) +(\d+) +<(\d+),(\d+),(\d+)>(\*?) +\d+ +([\d.]+) +([\d.]+) +\S+$", re.M)


@dataclass(frozen=True)
class Row:
    ns: int
    cpl: int
    rp: int
    nw: int
    launcher: bool
    us: float  # median us per launch


def decode_rows(text: str, shape: str, depth: int) -> tuple[int, int, list[Row]]:
    """(NG, the cache's NS, the decode rows) of one shape and depth in the sweep's output."""
    cases = [(int(m[3]), int(m[4])) for m in HEADER.finditer(text) if m[1] == shape and int(m[2]) == depth]
    if not cases:
        raise ValueError(f"the sweep has no decode case for {shape} at depth {depth}")
    ng, ns = cases[0]
    rows = [Row(int(m[4]), int(m[5]), int(m[6]), int(m[7]), m[8] == "*", float(m[9])) for m in ROW.finditer(text)
            if m[1] == shape and int(m[2]) == depth and int(m[3]) == 1]  # fmt: skip
    return ng, ns, rows


def pick(text: str, shape: str, depth: int, margin: float) -> str:
    """The environment of the fastest decode row, or "" when the launcher's is within `margin` of it (or missing:
    a sweep that did not get that far says nothing)."""
    ng, ns, rows = decode_rows(text, shape, depth)
    launcher = [r for r in rows if r.launcher and r.ns == ns]
    if not launcher or not rows:
        return ""
    best = min(rows, key=lambda r: r.us)
    if best.us > launcher[0].us * (1.0 - margin):
        return ""
    env = []
    if (best.cpl, best.rp, best.nw) != (launcher[0].cpl, launcher[0].rp, launcher[0].nw):
        env.append(f"OTT_CUDA_PART={best.cpl},{best.rp},{best.nw}")
    if best.ns != ns:
        env.append(f"OTT_SLICE_GROUPS={math.ceil(ng / best.ns)}")  # NS = ceil(NG / groups per slice)
    return " ".join(env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, help="the harness's shape: smol or llama8b")
    ap.add_argument("--depth", type=int, required=True, help="4096 or 32768")
    ap.add_argument("--margin", type=float, default=0.05, help="how much faster than the launcher's (0.05: 5%%)")
    ap.add_argument("log", type=Path, help="ott-bench --sweep's output")
    args = ap.parse_args(argv)
    try:
        print(pick(args.log.read_text(errors="replace"), args.shape, args.depth, args.margin))
    except ValueError as e:
        print(f"sweep_pick: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
