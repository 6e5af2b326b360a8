"""Fidelity at long context (issue 51): KLD vs f16, top-1, PPL ratio and bits per element at 2k, 8k and 16k tokens.

    python -m study.long_context --out docs/long-context.md \
        [--runs smollm2-135m:2048:3,smollm2-135m:8192:2,gemma3-270m:16384:1] [--tiers NAMES] [--raw FILE]

A run is MODEL:CONTEXT:CHUNKS: llama-perplexity over CHUNKS chunks of CONTEXT tokens of the pinned llama.cpp docs
(the first 200,000 bytes, as docs/tiers.md; ubatches of 512, one thread, `--poll 0`: the machine is shared), KL
divergence against f16 with the same command, and the bits per element of each cache at CONTEXT tokens (its own
allocated bytes, fp16 tail, pools and f16 window layers included, over the K and V elements of CONTEXT tokens in
every layer). A tier is a K/V pair with its --ott-params (study.tiers.Tier); TIERS names the default set, and
`--tiers` takes names from it or `K/V@G,R,O,AUX,NOL,VROT,KMIX,VSYM[,YOUNG[,YOUNG_V]][#LAYER_WIDTHS]` for variants.

--raw FILE keeps every measured row (JSON lines, with its command and date); rows already in it for the same
run and tier are reused, not measured again, so the report can be built in several sittings on a shared machine.
The report says which rows came from which date.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ott_gguf import models
from ott_gguf import tiers as kv_tiers
from ott_gguf._lib import bin_path
from ott_gguf.corpus import docs_text

from .benchmarks import QUALITY_TIERS, TEXT_BYTES, perplexity_numbers
from .tiers import Tier, bits_per_element

RUNS = "smollm2-135m:2048:3,smollm2-135m:8192:2,gemma3-270m:16384:1"


def tier_of(spec: str, model: str) -> Tier:
    """A tier from its name in TIERS ('quality' is the model's calibrated recipe, 'compact' ott2 with symmetric V and
    the model's shipped compact calibration) or K/V@PARAMS[#WIDTHS]."""
    if spec == "compact":
        kv, params = kv_tiers.TIER_PAIRS["compact"]
        name = kv_tiers.calibration_name(models.MODELS[model].sha256, kv, params)
        widths = kv_tiers.read_calibration(kv_tiers.PACKAGE_CALIBRATIONS / name).layer_widths
        return tier_of(f"{kv}@{params}#{widths}", model)
    if spec == "quality":
        cfg = QUALITY_TIERS[model]
        return Tier("ott3", "ott2", True, layers=cfg.layer_widths, k_mix=cfg.k_mix, v_sym=cfg.v_sym, R=cfg.R)
    if spec in DEFAULT_TIERS:
        return DEFAULT_TIERS[spec]
    pair, _, rest = spec.partition("@")
    params, _, layers = rest.partition("#")
    k, _, v = pair.partition("/")
    v = v or k
    if not params:
        raise ValueError(f"tier {spec!r}: a name of {', '.join(DEFAULT_TIERS)} or K/V@G,R,O,AUX,NOL,VROT,KMIX,VSYM")
    values = [int(x) for x in params.split(",")]
    g, r, o, aux, nol, vrot, kmix, vsym = values[:8]
    young = values[8] if len(values) > 8 else 0
    young_v = values[9] if len(values) > 9 else 0
    if g != 128:
        raise ValueError(f"tier {spec!r}: G is 128 in this build")
    return Tier(k, v, bool(vrot), layers=layers, k_mix=bool(kmix) if kmix < 2 else kmix, v_sym=bool(vsym), R=r,
                outliers=o, aux=aux, nol=nol, young=young, young_v=young_v)  # fmt: skip


DEFAULT_TIERS: dict[str, Tier] = {
    "q8_0": Tier("q8_0", "q8_0"),
    "q4_0": Tier("q4_0", "q4_0"),  # llama.cpp's own Hadamard rotation applies (as docs/tiers.md)
    "kivi2": Tier("kivi2", "kivi2", True),
    "ott2": Tier("ott2", "ott2", True),
    "ott3/ott2": Tier("ott3", "ott2", True),
    # 2-bit keys uniform (k_mix 1: mixed widths in 3-bit keys only), ott2's default before k_mix 2
    "ott2 uniform K": Tier("ott2", "ott2", True, k_mix=1),
}
TIERS = ("q8_0", "q4_0", "kivi2", "ott2", "compact", "ott3/ott2", "quality")


@dataclass(frozen=True)
class Run:
    model: str
    ctx: int
    chunks: int

    @property
    def key(self) -> str:
        return f"{self.model}:{self.ctx}:{self.chunks}"


def parse_runs(text: str) -> list[Run]:
    out = []
    for item in filter(None, text.split(",")):
        model, ctx, chunks = item.split(":")
        out.append(Run(model, int(ctx), int(chunks)))
    return out


def read_raw(path: Path | None) -> list[dict[str, object]]:
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(
    run: Run, tiers: Sequence[tuple[str, Tier]], raw: Path | None, threads: int, keep: Path | None = None
) -> list[dict[str, object]]:
    """The rows of one run: those in `raw` already, and the missing ones measured (one f16 base for them, kept in
    `keep` when given and reused from there)."""
    have = {(r["run"], r["args"]): r for r in read_raw(raw)}
    todo = [(name, t) for name, t in tiers if (run.key, " ".join(t.args())) not in have]
    # a stored row under the tier's label of today (labels name what differs from the defaults, which change)
    rows = {
        name: {**r, "label": t.label} if (r := have.get((run.key, " ".join(t.args())))) else None for name, t in tiers
    }
    if todo:
        path = models.fetch(run.model, quiet=True)
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(tmp) / "docs.txt"
            text.write_bytes(docs_text(TEXT_BYTES).encode())
            base = (keep or Path(tmp)) / f"{run.model}-{run.ctx}x{run.chunks}.f16.kld"
            common = [str(bin_path("llama-perplexity")), "-m", str(path), "-f", str(text), "-c", str(run.ctx),
                      "-b", str(run.ctx), "-ub", "512", "--chunks", str(run.chunks), "-t", str(threads),
                      "--poll", "0", "-fa", "on"]  # fmt: skip
            cmd = [*common, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(base)]
            if not base.exists():
                base.parent.mkdir(parents=True, exist_ok=True)
                t0 = time.time()
                subprocess.run(cmd, capture_output=True, text=True, check=True)
                if not base.exists():  # llama-perplexity exits 0 when it cannot write the base
                    raise RuntimeError(f"llama-perplexity wrote no f16 base {base}: {' '.join(cmd)}")
                print(f"{run.key} f16 base: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            for name, tier in todo:
                cmd = [*common, *tier.args(), "--kl-divergence-base", str(base), "--kl-divergence"]
                t0 = time.time()
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"llama-perplexity failed for {tier.label}:\n{r.stderr[-3000:]}")
                num = perplexity_numbers(r.stdout + r.stderr)
                row: dict[str, object] = {
                    "run": run.key, "args": " ".join(tier.args()), "label": tier.label, **num,
                    "bits": bits_per_element(path, tier, run.ctx), "seconds": round(time.time() - t0),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(cmd),
                }  # fmt: skip
                rows[name] = row
                print(f"  {run.key} {tier.label}: KLD {num['mean_kld']:.4f} ({row['seconds']} s)", file=sys.stderr,
                      flush=True)  # fmt: skip
                if raw is not None:
                    with raw.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    return [r for r in rows.values() if r is not None]


def markdown(run: Run, rows: Sequence[dict[str, object]]) -> str:
    q4 = next((r for r in rows if str(r["args"]).startswith("-ctk q4_0")), None)
    lines = [f"### {run.model}, {run.ctx} tokens x {run.chunks} chunks", "",
             "| K/V cache | mean KLD | vs q4_0 | 99.9% KLD | top-1 % | PPL ratio | bits/elem | s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        kld = float(r["mean_kld"])  # type: ignore[arg-type]
        vs = f"{kld / float(q4['mean_kld']):.2f}x" if q4 else ""  # type: ignore[arg-type]
        lines.append(f"| {r['label']} | {kld:.4f} | {vs} | {float(r['kld_999']):.3f} | {float(r['top1']):.2f} | "  # type: ignore[arg-type]
                     f"{float(r['ppl_ratio']):.4f} | {float(r['bits']):.3f} | {r['seconds']} |")  # type: ignore[arg-type]  # fmt: skip
    return "\n".join(lines) + "\n"


def bits_table(model: str, specs: Sequence[str], ctxs: Sequence[int]) -> str:
    """Bits per element of each tier at each context, from the caches' own bytes (no text is run)."""
    path = models.fetch(model, quiet=True)
    lines = [f"| {model} | " + " | ".join(f"{n}" for n in ctxs) + " |", "|---|" + "---|" * len(ctxs)]
    for spec in specs:
        tier = tier_of(spec, model)
        cells = " | ".join(f"{bits_per_element(path, tier, n):.3f}" for n in ctxs)
        lines.append(f"| {tier.label} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/long-context.md"))
    ap.add_argument("--runs", default=RUNS, help=f"MODEL:CONTEXT:CHUNKS,... (default {RUNS})")
    ap.add_argument("--tiers", default=";".join(TIERS), help="names or K/V@PARAMS[#WIDTHS], separated by ';'")
    ap.add_argument("--raw", type=Path, default=None, help="JSON lines of measured rows, reused and extended")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", type=Path, default=None, help="a folder for the f16 logits, reused when there")
    ap.add_argument("--bits", default="", help="MODEL:CTX,CTX,...: only print the tiers' bits per element there")
    a = ap.parse_args(argv)
    if a.bits:
        model, _, ctxs = a.bits.partition(":")
        print(bits_table(model, a.tiers.split(";"), [int(n) for n in ctxs.split(",")]))
        return 0
    t0 = time.time()
    parts, commands = [], []
    for run in parse_runs(a.runs):
        tiers = [(s, tier_of(s, run.model)) for s in a.tiers.split(";") if s != "quality" or run.model in QUALITY_TIERS]
        rows = measure(run, tiers, a.raw, a.threads, a.keep)
        parts.append(markdown(run, rows))
        commands += [str(r["command"]) + f"   # {r['date']}" for r in rows]
    cmd = f"python -m study.long_context --out {a.out} --runs {a.runs} --tiers '{a.tiers}'"
    head = (
        "# Fidelity at long context\n\n"
        f"Written {time.strftime('%a %b %d %H:%M:%S %Y')} on {platform.machine()}, {a.threads} thread, in "
        f"{time.time() - t0:.0f} s (`{cmd}`{' --raw FILE' if a.raw else ''}); each row's date is in Commands.\n\n"
        "llama-perplexity over chunks of the pinned llama.cpp docs at the context named in each table, KL divergence "
        "against f16 with the same command; q4_0 and q8_0 with llama.cpp's own rotation; the ott caches with V "
        "rotated and k_mix on 3-bit keys (the defaults); `quality`: the model's calibrated recipe of docs/tiers.md. "
        "Bits per element: the bytes each cache allocates for that context over its K and V elements (every layer). "
        "`O=`, `aux=`, `NOL=`: outlier_num, aux_cap and no_outlier_layers where they differ from 3, 32 and 2. "
        "s: seconds of the run on a shared 2-core machine (contended: a cost estimate, not a speed).\n\n"
    )
    a.out.write_text(head + "\n".join(parts) + "\n## Commands\n\n```\n" + "\n".join(commands) + "\n```\n")
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
