"""Two builds side by side (issue 15): llama-bench rounds with every (build, K/V type) interleaved in each round,
so a machine whose load moves affects them alike; the median of the rounds, its spread, and the ratio to f16 of
the same build and round set.

    python -m study.bench_ab --builds before=/path/to/ott_gguf,after=.venv/lib/python3.11/site-packages/ott_gguf
        --runs after:f16,before:ott2,after:ott2,before:ott3/ott2,after:ott3/ott2 --depths 0,4096,8192 --rounds 3
        --out /tmp/ab.md

A build is an installed ott_gguf package directory (its bin/llama-bench runs); a run is build:K/V type, where the
type `tier` is the model's quality tier (study.benchmarks.QUALITY_TIERS: ott3/ott2 with its --ott-params and
--ott-layers); build:K/V:fa0 runs without flash attention (llama-bench -fa 0: plain f16 attention, which is faster
than the pinned llama.cpp's CPU flash attention at head dim 64 on AVX512-FP16 CPUs, docs/decode-profile.md).
Ratios are to the first f16 run with flash attention (any build: f16 shares no code with the ott caches).

--model is a test model's name or a GGUF path (study.random_gguf's models); --ott-params gives the tier of a model
outside QUALITY_TIERS ("128,64,3,32,2,1,1,1"); --poll 0 keeps llama-bench's idle threads off a shared CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ott_gguf import models
from ott_gguf.bench import ott_args, parse_bench_json
from ott_gguf.cli import parse_ott_params
from ott_gguf.kv_types import OttConfig, resolve_kv_types

from .benchmarks import QUALITY_TIERS

TIER = "tier"


def command(build: Path, model: Path, kv: str, depths: str, n_prompt: int, n_gen: int, threads: int,
            tier: OttConfig | None = None, flash: bool = True, poll: int | None = None) -> list[str]:  # fmt: skip
    """kv "tier": the model's quality tier (study.benchmarks.QUALITY_TIERS), an ott3/ott2 cache configured."""
    k, v = resolve_kv_types("ott3/ott2" if kv == TIER else kv)
    extra = ott_args(tier) if kv == TIER and tier is not None else []
    extra += ["--poll", str(poll)] if poll is not None else []
    return [str(build / "bin" / "llama-bench"), "-m", str(model), "-ctk", k, "-ctv", v, "-fa", str(int(flash)),
            "-p", str(n_prompt), "-n", str(n_gen), "-d", depths, "-r", "1", "-t", str(threads), "-o", "json",
            *extra]  # fmt: skip


def parse_run(run: str) -> tuple[str, str, bool]:
    """build:kv[:fa0] -> (build, kv, flash attention)."""
    parts = run.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "fa0"):
        raise SystemExit(f"a run is build:kv_type or build:kv_type:fa0, got {run!r}")
    return parts[0], parts[1], len(parts) == 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.bench_ab", description=__doc__)
    ap.add_argument("--builds", required=True, help="name=package_dir,... (the installed ott_gguf directories)")
    ap.add_argument("--model", default="smollm2-135m", help="a test model's name or a GGUF path")
    ap.add_argument("--ott-params", default="", help="the tier's --ott-params where the model has no QUALITY_TIERS")
    ap.add_argument("--poll", type=int, help="llama-bench --poll (0: threads sleep between tasks)")
    ap.add_argument("--runs", required=True, help="build:kv_type,... in the order each round runs them")
    ap.add_argument("--depths", default="0,4096,8192")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True, help="markdown; the raw samples go next to it as .json")
    a = ap.parse_args(argv)
    builds = {n: Path(p).resolve() for n, p in (b.split("=", 1) for b in a.builds.split(","))}
    model = Path(a.model) if Path(a.model).is_file() else models.fetch(a.model, quiet=True)
    tier = OttConfig(**parse_ott_params(a.ott_params)) if a.ott_params else QUALITY_TIERS.get(a.model)  # type: ignore[arg-type]
    runs = a.runs.split(",")
    samples: dict[str, list[float]] = {}
    log: list[str] = []
    t0 = time.time()
    for r in range(a.rounds):
        for run in runs:
            name, kv, flash = parse_run(run)
            if kv == TIER and tier is None:
                raise SystemExit(f"{a.model} has no quality tier in study.benchmarks.QUALITY_TIERS: give --ott-params")
            cmd = command(builds[name], model, kv, a.depths, a.prompt, a.gen, a.threads, tier, flash, a.poll)
            log.append(f"round {r + 1}/{a.rounds}, {name}, {kv}{'' if flash else ' (-fa 0)'}: {' '.join(cmd)}")
            print(log[-1], file=sys.stderr, flush=True)
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"llama-bench failed ({run}):\n{res.stderr[-2000:]}")
            for row in parse_bench_json(res.stdout, kv):
                key = kv if flash else f"{kv}:fa0"
                samples.setdefault(f"{name}|{key}|{row.label}", []).append(row.tokens_per_s)
        a.out.with_suffix(".json").write_text(json.dumps({"samples": samples, "commands": log}, indent=1))
    labels = sorted({k.split("|")[2] for k in samples}, key=lambda s: (int(s.split("@")[1]), s))
    lines = [f"Measured {time.ctime(t0)}, {a.rounds} rounds, {a.threads} threads, model {a.model}, "
             f"{time.time() - t0:.0f} s (`python -m study.bench_ab {' '.join(argv or sys.argv[1:])}`).", "",
             "Tokens/s: median of the rounds (min..max); x: the median's ratio to f16's.", "",
             "| build | K/V | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]  # fmt: skip
    for run in runs:
        name, kv, flash = parse_run(run)
        key = kv if flash else f"{kv}:fa0"
        cells = []
        for lab in labels:
            v = samples.get(f"{name}|{key}|{lab}", [])
            f = next((x for k, x in samples.items() if k.endswith(f"|f16|{lab}")), [])
            if not v:
                cells.append("")
                continue
            m = statistics.median(v)
            ratio = f" {m / statistics.median(f):.2f}x" if f and key != "f16" else ""
            cells.append(f"{m:.1f} ({min(v):.1f}..{max(v):.1f}){ratio}")
        lines.append(f"| {name} | {kv}{'' if flash else ' (-fa 0)'} | " + " | ".join(cells) + " |")
    lines += ["", "Commands:", "", "```", *log, "```", ""]
    a.out.write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
