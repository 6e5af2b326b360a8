"""Where a decoded token's GPU time goes, kernel by kernel, f16 against ott2 (issue 47): the device time of every
kernel over the decode phase of `llama-bench -p 0 -n N -d DEPTH -ngl 99`, per decoded token, from nsys's CUDA trace.

The harness (ott-bench) times the ott ops alone; this says, in the whole model, what ott2's decode step spends that
f16's does not: the ott ops, the casts and copies around them, and launches. llama-bench runs a one-token warmup,
then fills the depth in ubatches (batched matmuls: ggml-cuda's mul_mat_q, or cuBLAS's gemm), then decodes N tokens
(matrix-vector kernels): the decode phase is every kernel after the last batched matmul (so also the fill's last few
kernels after its last matmul, its output norm and its last token's logits: a few launches over N tokens).

    nsys profile -t cuda --cuda-graph-trace=node -o f16 llama-bench -m M -ctk f16 -ctv f16 -fa 1 -p 0 -n 32 \\
        -d 4096 -r 1 -ngl 99                              # and -o ott2 with -ctk ott2 -ctv ott2
    nsys stats -r cuda_gpu_trace -f csv -o f16 f16.nsys-rep   # writes f16_cuda_gpu_trace.csv
    python3 -m study.gpu_offline.decode_kernels --tokens 32 f16=f16_cuda_gpu_trace.csv ott2=ott2_cuda_gpu_trace.csv
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# kernels of a batched matmul (the depth fill's ubatches): ggml-cuda's mul_mat_q (mmq; its matrix-vector kernels
# are mul_mat_vec_*), and cuBLAS's or CUTLASS's gemm
BATCHED = re.compile(r"\bmul_mat_q\b|gemm|cutlass|xmma", re.I)


@dataclass
class Phase:
    """The decode phase of one trace: device time per kernel (ns, launches), and in all."""

    kernels: dict[str, list[int]] = field(default_factory=dict)
    busy_ns: int = 0
    span_ns: int = 0  # first kernel's start to last kernel's end
    launches: int = 0


def short_name(name: str) -> str:
    """A kernel's name without its parameter list and return type (`void f<T, 3>(args)` -> `f<T, 3>`)."""
    name = name.strip()
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the parameter list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    return name[5:] if name.startswith("void ") else name


def read_trace(path: Path) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, kernel name) of every kernel in an `nsys stats -r cuda_gpu_trace -f csv` file, by
    start; copies and memsets (names in brackets) left out."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if any(c.startswith("Duration") for c in r) and "Name" in r), None)
    if head is None:
        raise SystemExit(f"{path}: no header with Duration and Name (an nsys stats cuda_gpu_trace CSV?)")
    cols = rows[head]
    i_start = next(i for i, c in enumerate(cols) if c.startswith("Start"))
    i_dur = next(i for i, c in enumerate(cols) if c.startswith("Duration"))
    i_name = cols.index("Name")
    out = []
    for r in rows[head + 1 :]:
        if len(r) <= max(i_start, i_dur, i_name) or not r[i_dur].strip():
            continue
        name = r[i_name]
        if name.startswith("["):  # [CUDA memcpy ...], [CUDA memset]
            continue
        out.append((int(float(r[i_start].replace(",", ""))), int(float(r[i_dur].replace(",", ""))), name))
    out.sort()
    return out


def decode_phase(trace: list[tuple[int, int, str]]) -> Phase:
    """The kernels after the last batched matmul (the depth fill), summed by short name."""
    last = max((i for i, (_, _, n) in enumerate(trace) if BATCHED.search(n)), default=None)
    if last is None:
        raise SystemExit("no batched matmul in the trace: is it llama-bench with -d DEPTH > 0?")
    ph = Phase()
    tail = trace[last + 1 :]
    if not tail:
        raise SystemExit("no kernel after the depth fill: is it llama-bench with -n N > 0?")
    for _, dur, name in tail:
        k = ph.kernels.setdefault(short_name(name), [0, 0])
        k[0] += dur
        k[1] += 1
        ph.busy_ns += dur
        ph.launches += 1
    ph.span_ns = tail[-1][0] + tail[-1][1] - tail[0][0]
    return ph


def report(phases: dict[str, Phase], tokens: int, top: int) -> str:
    """A table of µs per decoded token by kernel, the phases side by side, largest first by the last phase."""
    labels = list(phases)
    names = sorted(
        {k for p in phases.values() for k in p.kernels}, key=lambda k: -phases[labels[-1]].kernels.get(k, [0])[0]
    )
    width = min(72, max(len(n) for n in names))
    lines = [
        f"decode phase, {tokens} tokens: us per decoded token (launches per token)",
        f"{'kernel':<{width}} " + " ".join(f"{lb:>16}" for lb in labels),
    ]
    for n in names[:top]:
        cells = []
        for lb in labels:
            t, c = phases[lb].kernels.get(n, [0, 0])
            cells.append(f"{t / 1e3 / tokens:9.2f} ({c / tokens:4.1f})" if c else f"{'-':>16}")
        lines.append(f"{n[:width]:<{width}} " + " ".join(cells))
    rest = names[top:]
    if rest:
        cells = [
            f"{sum(phases[lb].kernels.get(n, [0, 0])[0] for n in rest) / 1e3 / tokens:9.2f} {'':6}" for lb in labels
        ]
        lines.append(f"{f'({len(rest)} more kernels)':<{width}} " + " ".join(cells))
    for what, get in (
        ("all kernels: device time", lambda p: p.busy_ns),
        ("first kernel to last: wall", lambda p: p.span_ns),
    ):
        lines.append(f"{what:<{width}} " + " ".join(f"{get(phases[lb]) / 1e3 / tokens:9.2f} {'':6}" for lb in labels))
    lines.append(
        f"{'launches per token':<{width}} " + " ".join(f"{phases[lb].launches / tokens:9.1f} {'':6}" for lb in labels)
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", metavar="LABEL=CSV", help="nsys stats cuda_gpu_trace CSV files, labelled")
    ap.add_argument("--tokens", type=int, required=True, help="the decoded tokens (llama-bench -n)")
    ap.add_argument("--top", type=int, default=20, help="kernels listed (the rest summed)")
    args = ap.parse_args(argv)
    phases = {}
    for spec in args.traces:
        label, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"{spec}: LABEL=CSV")
        phases[label] = decode_phase(read_trace(Path(path)))
    print(report(phases, args.tokens, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
