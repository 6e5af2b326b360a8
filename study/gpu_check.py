"""The GPU check: one command on a CUDA machine (`make gpu-test` runs it after building with CUDA).

1. the tests that need a GPU: the CUDA ops against the numpy reference on the device (tests/test_cuda_emu.py),
   where the scheduler puts the ott2 ops, GPU-vs-CPU logits per cache type and greedy generation with SmolLM2
   fully offloaded (tests/test_gpu.py);
2. llama-bench decode at depth 4096, 8192 and 32768 for f16, q8_0, q4_0 and ott2 side by side on the same GPU,
   written as a table with the ratios to f16 (default docs/benchmarks-gpu.md).

    python -m study.gpu_check [--out docs/benchmarks-gpu.md] [--skip-tests]
"""

from __future__ import annotations

import argparse
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from ott_gguf import build_info
from ott_gguf.bench import BenchRow, bench, bench_command
from ott_gguf.models import fetch

TYPES = ("f16", "q8_0", "q4_0", "ott2")
DEPTHS = (4096, 8192, 32768)


def gpu_name() -> str:
    res = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError("no NVIDIA GPU visible (nvidia-smi failed): the GPU check needs one")
    return res.stdout.strip().splitlines()[0]


def table(rows: list[BenchRow]) -> str:
    f16 = {(r.test, r.depth): r.tokens_per_s for r in rows if r.kv_type == "f16"}
    lines = ["| cache | test | depth | tok/s | vs f16 |", "|---|---|---|---|---|"]
    for r in rows:
        base = f16.get((r.test, r.depth))
        ratio = f"{r.tokens_per_s / base:.2f}x" if base else ""
        speed = f"{r.tokens_per_s:.1f} ± {r.stddev:.1f}"
        lines.append(f"| {r.kv_type} | {r.test}{r.n_tokens} | {r.depth} | {speed} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks-gpu.md"))
    ap.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    ap.add_argument("--n-gen", type=int, default=64, help="decode tokens timed per depth (default 64)")
    args = ap.parse_args(argv)
    if str(build_info().get("cuda", "OFF")).upper() != "ON":
        print("gpu_check: this ott-gguf build has no CUDA backend: rebuild with "
              "make install PIP_INSTALL_ARGS='-Ccmake.define.OTT_GGUF_CUDA=ON'", file=sys.stderr)  # fmt: skip
        return 2
    gpu = gpu_name()
    root = Path(__file__).resolve().parents[1]
    if not args.skip_tests:
        tests = root / "tests"
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-s", "test_cuda_emu.py", "test_gpu.py"],
                            cwd=tests).returncode  # fmt: skip
        if rc != 0:
            print(f"gpu_check: GPU tests failed (pytest exit {rc})", file=sys.stderr)
            return rc
    model = fetch("smollm2-135m")
    rows = bench(model, TYPES, depths=DEPTHS, n_prompt=0, n_gen=args.n_gen, reps=3, n_gpu_layers=99,
                 progress=lambda m: print(m, file=sys.stderr))  # fmt: skip
    cmds = "\n".join(shlex.join(bench_command(model, t, depths=DEPTHS, n_prompt=0, n_gen=args.n_gen, threads=None,
                                              reps=3, n_gpu_layers=99)) for t in TYPES)  # fmt: skip
    text = (f"# ott2 on the GPU: decode speed\n\nMeasured by `python -m study.gpu_check` on {gpu} "
            f"({platform.node()}), SmolLM2-135M Q4_1 fully offloaded (-ngl 99), flash attention on, "
            f"{args.n_gen} decode tokens after each depth, 3 repetitions.\n\n{table(rows)}\n\n"
            f"Commands (ott2 through OTT_GGUF_PARAMS defaults):\n\n```sh\n{cmds}\n```\n")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
