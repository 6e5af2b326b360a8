"""The side-by-side benchmark of issue 4 (docs/benchmarks.md): K/V bytes per token, llama-bench speed and
llama-perplexity fidelity of f16, q8_0, q4_0, kivi2, ott2 and the ott3/ott2 and ott4/ott2 tiers on the test models,
measured on this machine.

    python -m study.benchmarks --out docs/benchmarks.md [--models smollm2-135m,gemma3-270m] [--threads 2]

Every number in the output is measured by the run that writes it; the commands are printed with the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ott_gguf import models
from ott_gguf._lib import bin_path
from ott_gguf.bench import NO_FLASH, BenchRow, Tiers, bench, ott_args
from ott_gguf.calibrate import perplexity_numbers
from ott_gguf.corpus import docs_text
from ott_gguf.evaluate import import_pyplot
from ott_gguf.info import measure_kv_bytes
from ott_gguf.kv_types import OttConfig, resolve_kv_types
from ott_gguf.tiers import quality_config

# the quality tier of issue 12 (3- or 4-bit keys, 2-bit rotated values) beside the maximum-compression ott2
KV_TYPES = ("f16", "q8_0", "q4_0", "kivi2", "ott2", "ott3/ott2", "ott4/ott2")
# and the quality tier as docs/tiers.md recommends it: ott3/ott2 with a 64-token fp16 window, symmetric 2-bit values
# and the widths `ott-gguf calibrate MODEL --ott-params 128,64,3,32,2,1,1,1 --max-bits 3.2` chose for the model (on
# calibration text disjoint from the text measured here)
QUALITY = "ott3/ott2 tier"
QUALITY_TIERS: dict[str, OttConfig] = {
    # the product's quality tier (ott_gguf.tiers.QUALITY_PARAMS: R 64, symmetric V, k_mix 1) with each model's widths
    "smollm2-135m": quality_config("0-2:3/3,3-5:2/2,9-11:2/2,18-23:3/3,27-29:2/2"),
    "gemma3-270m": quality_config("11:3/3,17:2/2"),
}


def model_types(name: str) -> tuple[tuple[str, ...], Tiers]:
    """The cache types measured on a model: KV_TYPES, and its quality tier where it has one."""
    if name not in QUALITY_TIERS:
        return KV_TYPES, {}
    return (*KV_TYPES, QUALITY), {QUALITY: ("ott3/ott2", QUALITY_TIERS[name])}


MEM_CTX = (2048, 8192, 32768)
TEXT_BYTES = 200_000  # spec/targets.md: the first 200,000 bytes of the pinned llama.cpp docs


@dataclass(frozen=True)
class PplRow:
    kv_type: str
    ppl: float
    ppl_ratio: float
    mean_kld: float
    kld_999: float
    top1: float  # percent of positions whose top token equals f16's


def _perplexity_cmd(model: Path, kv_type: str, text: Path, threads: int, chunks: int,
                    tiers: Tiers | None = None) -> list[str]:  # fmt: skip
    pair, cfg = (tiers or {}).get(kv_type, (kv_type, None))
    k, v = resolve_kv_types(pair)
    return [str(bin_path("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "2048", "-b", "2048",
            "-ub", "512", "--chunks", str(chunks), "-t", str(threads), "-fa", "on", "-ctk", k, "-ctv", v,
            *(ott_args(cfg) if cfg else [])]  # fmt: skip


def perplexity(model: Path, threads: int, chunks: int, log: list[str], kv_types: tuple[str, ...] = KV_TYPES,
               tiers: Tiers | None = None) -> list[PplRow]:  # fmt: skip
    """llama-perplexity with f16 as the KL-divergence base, then each type against it."""
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "docs.txt"
        text.write_bytes(docs_text(TEXT_BYTES).encode())
        base = Path(tmp) / "f16.kld"
        cmd = [*_perplexity_cmd(model, "f16", text, threads, chunks), "--kl-divergence-base", str(base)]
        log.append(" ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows = []
        for t in kv_types:
            cmd = [*_perplexity_cmd(model, t, text, threads, chunks, tiers), "--kl-divergence-base", str(base),
                   "--kl-divergence"]  # fmt: skip
            log.append(" ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True)  # -ctk kivi2 names the kivi2 cache itself
            if r.returncode != 0:
                raise RuntimeError(f"llama-perplexity failed for {t}:\n{r.stderr[-3000:]}")
            rows.append(PplRow(kv_type=t, **perplexity_numbers(r.stdout + r.stderr)))
        return rows


def run(model_names: list[str], threads: int, depths: list[int], chunks: int, reps: int,
        save: Path | None = None) -> dict[str, object]:  # fmt: skip
    """Measure every model; with `save`, the results so far are written there after each model."""
    out: dict[str, object] = {"machine": f"{platform.machine()}, {threads} threads", "started": time.ctime()}
    for name in model_names:
        path = models.fetch(name, quiet=True)
        log: list[str] = []
        t0 = time.time()
        types, tiers = model_types(name)
        mem = measure_kv_bytes(path, types, n_ctx=(MEM_CTX[0], MEM_CTX[1]), tiers=tiers)
        # f16 also without flash attention: on some CPUs llama.cpp's plain f16 attention is the faster baseline
        speed_types = (types[0], f"{types[0]}{NO_FLASH}", *types[1:])
        speed: list[BenchRow] = bench(path, speed_types, depths=depths, n_prompt=512, n_gen=64, threads=threads,
                                      reps=reps, progress=log.append, tiers=tiers)  # fmt: skip
        ppl = perplexity(path, threads, chunks, log, types, tiers)
        out[name] = {
            "memory": [{"kv_type": m.kv_type, **{str(n): m.at(n) for n in MEM_CTX}, "parts": m.parts} for m in mem],
            "speed": [asdict(r) for r in speed],
            "perplexity": [asdict(r) for r in ppl],
            "commands": log,
            "seconds": round(time.time() - t0),
        }
        print(f"{name}: done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        if save is not None:
            save.write_text(json.dumps(out, indent=1))
    return out


def markdown(res: dict[str, object], depths: list[int]) -> str:
    lines = [f"Measured {res['started']} on {res['machine']} (`python -m study.benchmarks`).", ""]
    tiers = {name: QUALITY_TIERS[name] for name in res if name in QUALITY_TIERS}
    if tiers:
        widths = "; ".join(f"{name} `{cfg.layer_widths}`" for name, cfg in tiers.items())
        lines += [f"`{QUALITY}`: the quality tier of docs/tiers.md, `-ctk ott3 -ctv ott2 --ott-params "
                  f"128,64,3,32,2,1,1,1 --ott-layers W` with the widths W that `ott-gguf calibrate MODEL --ott-params "
                  f"128,64,3,32,2,1,1,1 --max-bits 3.2` chose on calibration text ({widths}).", ""]  # fmt: skip
    for name, r in res.items():
        if not isinstance(r, dict):
            continue
        lines += [f"## {name}", "", "### K/V cache bytes (the caches' own allocation)", "",
                  "| K/V | " + " | ".join(f"{n // 1024}k MiB" for n in MEM_CTX) + " | f16 / this at 8k | at 32k |",
                  "|---|" + "---|" * (len(MEM_CTX) + 2)]  # fmt: skip
        f16 = next(m for m in r["memory"] if m["kv_type"] == "f16")
        for m in r["memory"]:
            cells = [f"{m[str(n)] / 2**20:.2f}" for n in MEM_CTX]
            lines.append(f"| {m['kv_type']} | " + " | ".join(cells) +
                         f" | {f16['8192'] / m['8192']:.2f}x | {f16['32768'] / m['32768']:.2f}x |")  # fmt: skip
        lines += ["", "### llama-bench tokens/s (pp512 prefill, tg64 decode, at context depth)", ""]
        model_depths = sorted({s["depth"] for s in r["speed"]}) or depths
        labels = [f"{t} @ {d}" for d in model_depths for t in ("pp512", "tg64")]
        lines += ["| K/V | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        by = {(s["kv_type"], s["test"], s["depth"]): s["tokens_per_s"] for s in r["speed"]}
        types = tuple(dict.fromkeys(s["kv_type"] for s in r["speed"]))
        for t in types:
            cells = [by.get((t, lab.split()[0][:2], int(lab.split()[-1]))) for lab in labels]
            lines.append(f"| {t} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
        lines += ["", f"`f16{NO_FLASH}`: f16 under `llama-bench -fa 0` (llama.cpp's plain attention; every other row "
                  "runs with flash attention, which the ott caches implement). Where it is the faster of the two (the "
                  "pinned llama.cpp's CPU flash attention takes a scalar path for head dim 64 on AVX512-FP16 CPUs, "
                  "docs/decode-profile.md), the second table is the fair comparison."]  # fmt: skip
        faster = ("Ratio to the faster f16 of the two, per column (same run):", ("f16", f"f16{NO_FLASH}"))
        for title, bases in (("Ratio to f16 with flash attention (same run):", ("f16",)), faster):
            lines += ["", title, "", "| K/V | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
            for t in types[1:]:
                if t in bases:
                    continue
                cells = []
                for lab in labels:
                    key = (lab.split()[0][:2], int(lab.split()[-1]))
                    a, fs = by.get((t, *key)), [by.get((f, *key)) for f in bases]
                    ok = a is not None and all(f is not None for f in fs)
                    cells.append(f"{a / max(fs):.2f}" if ok else "")  # type: ignore[operator, type-var]
                lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "### llama-perplexity vs f16 (KL divergence base), 2048-token chunks of the pinned docs",
            "",
            "| K/V | PPL | PPL ratio | mean KLD | 99.9% KLD | top-1 same |",
            "|---|---|---|---|---|---|",
        ]
        for p in r["perplexity"]:
            lines.append(f"| {p['kv_type']} | {p['ppl']:.3f} | {p['ppl_ratio']:.4f} | {p['mean_kld']:.4f} | "
                         f"{p['kld_999']:.3f} | {p['top1']:.1f}% |")  # fmt: skip
        lines += ["", f"Commands ({r['seconds']} s in all):", "", "```"] + r["commands"] + ["```", ""]
    return "\n".join(lines)


def plot(res: dict[str, object], out_dir: Path) -> list[Path]:
    """One PNG per model from the measured results: cache MiB vs context, decode tok/s vs depth, mean KLD."""

    plt = import_pyplot()
    paths = []
    for name, r in res.items():
        if not isinstance(r, dict):
            continue
        fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
        for m in r["memory"]:
            ax[0].plot(MEM_CTX, [m[str(n)] / 2**20 for n in MEM_CTX], marker="o", label=m["kv_type"])
        ax[0].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="K/V cache MiB", title="memory")
        for t in dict.fromkeys(s["kv_type"] for s in r["speed"]):
            pts = sorted((s["depth"], s["tokens_per_s"]) for s in r["speed"] if s["kv_type"] == t and s["test"] == "tg")
            ax[1].plot([d for d, _ in pts], [v for _, v in pts], marker="o", label=t)
        ax[1].set(xlabel="context depth (tokens)", ylabel="decode tokens/s (tg64)", title="decode speed")
        kl = [(q["kv_type"], q["mean_kld"]) for q in r["perplexity"] if q["kv_type"] != "f16"]
        ax[2].bar([k for k, _ in kl], [v for _, v in kl], color="tab:gray")
        ax[2].set(ylabel="mean KLD vs f16", title="fidelity (llama-perplexity)")
        for a in ax[:2]:
            a.legend()
            a.grid(alpha=0.3)
        fig.suptitle(f"{name}: ott2 next to llama.cpp's K/V types ({res['machine']})")
        fig.tight_layout()
        path = out_dir / f"benchmarks-{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.benchmarks", description=__doc__)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", default="0,4096,8192")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="markdown file; the raw numbers go next to it as .json")
    ap.add_argument("--from-json", action="store_true", help="only redraw the report and plots from OUT's .json")
    a = ap.parse_args(argv)
    depths = [int(d) for d in a.depths.split(",")]
    import_pyplot()  # the plots need matplotlib: refuse now, not after the hour of measuring
    if a.from_json:
        res = json.loads(a.out.with_suffix(".json").read_text())
    else:
        res = run(a.models.split(","), a.threads, depths, a.chunks, a.reps, save=a.out.with_suffix(".json"))
    pngs = plot(res, a.out.parent)
    a.out.write_text("# Benchmarks: ott2 next to llama.cpp's cache types\n\n" + markdown(res, depths) + "\n"
                     + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
