"""Quality per byte of the ott tiers (issue 12): K/V code widths per side, with and without rotated V, end to end.

    python -m study.tiers --out docs/tiers.md [--models smollm2-135m,gemma3-270m] [--threads 2] [--chunks 4]
    python -m study.tiers --speed --out docs/tiers-speed.md [--depth 4096] [--rounds 5]

For each model: llama-perplexity over 2048-token chunks of the pinned llama.cpp docs (the first 200,000 bytes;
ubatches of 512, as docs/benchmarks.md), KL divergence against f16 (mean and 99.9th percentile), top-1 agreement
and the PPL ratio; and the bytes each cache allocates for 2k, 8k and 32k tokens (its own account,
llama_ott_kv_cache_bytes), as bits per cached K/V element. --speed: decode speed (llama-bench tg64) at one
depth of f16 and the candidate tiers, interleaved (f16, ott2, ott3/ott2, f16, ...) and repeated, median and
spread. Every number is measured by the run that writes it; the commands are printed with the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ott_gguf import models
from ott_gguf._lib import bin_path
from ott_gguf.calibrate import cache_bits
from ott_gguf.corpus import docs_text
from ott_gguf.kv_types import K_MIX_DEFAULT, K_MIX_WIDTHS

from .benchmarks import QUALITY_TIERS, TEXT_BYTES, perplexity_numbers

CTX = (2048, 8192, 32768)


@dataclass(frozen=True)
class Tier:
    k: str  # cache type of K (llama.cpp name)
    v: str  # cache type of V
    v_rotate: bool | None = None  # None: a stock type (llama.cpp's own rotation applies)
    layers: str = ""  # layer_widths (--ott-layers) of an ott pair
    # K widths per channel in sealed groups (kv_types.K_MIX_WIDTHS): 2, the default, in groups of 2- and 3-bit keys
    # (docs/long-context-keys.md); 1 in groups of 3-bit keys only (docs/k-channel-widths.md); 0 nowhere
    k_mix: bool | int = K_MIX_DEFAULT
    v_sym: bool = False  # symmetric 2-bit V blocks (docs/v-blocks.md)
    R: int = 32  # the fp16 recent window
    outliers: int = 3  # outlier_num
    aux: int = 32  # aux_cap
    nol: int = 2  # no_outlier_layers
    young: int = 0  # k_young: keys by age (docs/long-context.md)
    young_v: int = 0  # v_young: values by age

    @property
    def label(self) -> str:
        name = self.k if self.k == self.v else f"{self.k}/{self.v}"
        if self.v_rotate is None:
            return name
        # keys of a width the default level mixes, left uniform by this tier's level: "uniform K" (the base pair's
        # keys), "uniform W-bit K" (those of some --ott-layers layers only)
        mixes, default = K_MIX_WIDTHS[int(self.k_mix)], K_MIX_WIDTHS[K_MIX_DEFAULT]
        kb = int(self.k[-1])
        key_widths = {kb} | {int(item.split(":")[1].split("/")[0]) for item in self.layers.split(",") if item}
        uniform = sorted(w for w in key_widths if w in default and w not in mixes)
        name += (" +rotV" if self.v_rotate else "") + (" +symV" if self.v_sym else "")
        if uniform == [kb] and not self.layers:
            name += " uniform K"
        elif uniform:
            name += " uniform " + "/".join(map(str, uniform)) + "-bit K"
        name += f" R={self.R}" if self.R != 32 else ""
        name += f" O={self.outliers}" if self.outliers != 3 else ""
        name += f" aux={self.aux}" if self.aux != 32 else ""
        name += f" NOL={self.nol}" if self.nol != 2 else ""
        name += f" young={self.young}" if self.young else ""
        name += f" youngV={self.young_v}" if self.young_v else ""
        return name + (f" --ott-layers {self.layers}" if self.layers else "")

    def args(self) -> list[str]:
        out = ["-ctk", self.k, "-ctv", self.v]
        if self.v_rotate is not None:
            out += ["--ott-params", f"128,{self.R},{self.outliers},{self.aux},{self.nol},{int(self.v_rotate)},"
                    f"{int(self.k_mix)},{int(self.v_sym)}" + (f",{self.young}" if self.young or self.young_v else "")
                    + (f",{self.young_v}" if self.young_v else "")]  # fmt: skip
        if self.layers:
            out += ["--ott-layers", self.layers]
        return out

    def ott_config(self) -> dict[str, object] | None:
        if self.v_rotate is None:
            return None
        return {"v_rotate": self.v_rotate, "layer_widths": self.layers, "k_mix": self.k_mix, "v_sym": self.v_sym,
                "R": self.R, "outlier_num": self.outliers, "aux_cap": self.aux,
                "no_outlier_layers": self.nol, "k_young": self.young,
                "v_young": self.young_v}  # fmt: skip


TIERS = (
    Tier("q8_0", "q8_0"),
    Tier("q4_0", "q4_0"),
    Tier("kivi2", "kivi2", True),
    Tier("kivi2", "kivi2", True, k_mix=1),  # 2-bit keys uniform: the default before k_mix 2
    Tier("kivi3", "kivi2", True),
    Tier("kivi3", "kivi2", True, k_mix=False),
    # rotated V against plain on the two candidates (the default is decided by these); the other pairs rotated
    Tier("ott2", "ott2", False),
    Tier("ott2", "ott2", True),
    Tier("ott2", "ott2", True, k_mix=1),
    Tier("ott2", "ott2", True, v_sym=True),
    Tier("ott3", "ott2", False),
    Tier("ott3", "ott2", True),
    Tier("ott3", "ott2", True, k_mix=False),
    Tier("ott3", "ott2", True, v_sym=True),
    Tier("ott3", "ott2", True, v_sym=True, R=64),
    Tier("ott2", "ott3", True),
    Tier("ott3", "ott3", True),
    Tier("ott4", "ott2", True),
)


def model_tiers(name: str) -> tuple[Tier, ...]:
    """TIERS, and the model's calibrated quality tier (study.benchmarks.QUALITY_TIERS) where it has one."""
    cfg = QUALITY_TIERS.get(name)
    if cfg is None:
        return TIERS
    return (*TIERS, Tier("ott3", "ott2", True, layers=cfg.layer_widths, k_mix=cfg.k_mix, v_sym=cfg.v_sym, R=cfg.R))


@dataclass(frozen=True)
class Row:
    tier: Tier
    ppl_ratio: float
    mean_kld: float
    kld_999: float
    top1: float
    bits: tuple[float, ...]  # bits per cached K/V element at CTX


def bits_per_element(path: Path, tier: Tier, n_ctx: int) -> float:
    """The cache's allocated bytes for n_ctx tokens over the K/V elements those tokens have (every layer)."""
    return cache_bits(path, tier.k, tier.v, n_ctx=n_ctx, ott_config=tier.ott_config())


def measure(path: Path, threads: int, chunks: int, log: list[str], tiers: Sequence[Tier] = TIERS) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "docs.txt"
        text.write_bytes(docs_text(TEXT_BYTES).encode())
        base = Path(tmp) / "f16.kld"
        common = [str(bin_path("llama-perplexity")), "-m", str(path), "-f", str(text), "-c", "2048", "-b", "2048",
                  "-ub", "512", "--chunks", str(chunks), "-t", str(threads), "-fa", "on"]  # fmt: skip
        cmd = [*common, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(base)]
        log.append(" ".join(cmd))
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        for tier in tiers:
            cmd = [*common, *tier.args(), "--kl-divergence-base", str(base), "--kl-divergence"]
            log.append(" ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"llama-perplexity failed for {tier.label}:\n{r.stderr[-3000:]}")
            num = perplexity_numbers(r.stdout + r.stderr)
            rows.append(Row(tier=tier, ppl_ratio=num["ppl_ratio"], mean_kld=num["mean_kld"], kld_999=num["kld_999"],
                            top1=num["top1"], bits=tuple(bits_per_element(path, tier, n) for n in CTX)))  # fmt: skip
            print(f"  {tier.label}: KLD {rows[-1].mean_kld:.4f}", file=sys.stderr, flush=True)
    return rows


def markdown(name: str, rows: list[Row]) -> str:
    q4 = next(r for r in rows if r.tier.k == "q4_0")
    head = " | ".join(f"bits/elem {n // 1024}k" for n in CTX)
    lines = [f"### {name}", "",
             f"| K/V cache | mean KLD | vs q4_0 | 99.9% KLD | top-1 % | PPL ratio | {head} |",
             "|---|---|---|---|---|---|" + "---|" * len(CTX)]  # fmt: skip
    for r in rows:
        bits = " | ".join(f"{b:.2f}" for b in r.bits)
        lines.append(f"| {r.tier.label} | {r.mean_kld:.4f} | {r.mean_kld / q4.mean_kld:.2f}x | {r.kld_999:.3f} | "
                     f"{r.top1:.2f} | {r.ppl_ratio:.4f} | {bits} |")  # fmt: skip
    return "\n".join(lines) + "\n"


SPEED_TYPES = (("f16", "f16"), ("ott2", "ott2"), ("ott3", "ott2"), ("ott3", "ott3"), ("q4_0", "q4_0"))


def speed(path: Path, depth: int, rounds: int, threads: int, log: list[str]) -> dict[str, list[float]]:
    """tg64 tokens/s at `depth` per type, one llama-bench run (-r 1) per type and round, types interleaved."""
    out: dict[str, list[float]] = {f"{k}/{v}" if k != v else k: [] for k, v in SPEED_TYPES}
    for _ in range(rounds):
        for (k, v), name in zip(SPEED_TYPES, out, strict=True):
            cmd = [str(bin_path("llama-bench")), "-m", str(path), "-ctk", k, "-ctv", v, "-fa", "1", "-p", "0",
                   "-n", "64", "-d", str(depth), "-r", "1", "-t", str(threads), "-o", "json"]  # fmt: skip
            log.append(" ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
            out[name].append(float(json.loads(r.stdout)[0]["avg_ts"]))
    return out


def speed_markdown(name: str, depth: int, res: dict[str, list[float]]) -> str:
    f16 = statistics.median(res["f16"])
    lines = [f"### {name}, tg64 at depth {depth}", "", "| K/V cache | median t/s | min..max | median / f16's |",
             "|---|---|---|---|"]  # fmt: skip
    for t, v in res.items():
        lines.append(f"| {t} | {statistics.median(v):.1f} | {min(v):.1f}..{max(v):.1f} | "
                     f"{statistics.median(v) / f16:.2f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/tiers.md"))
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--speed", action="store_true", help="decode speed instead of fidelity")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="fidelity: these row labels only, ';'-separated (q4_0 always runs)")
    a = ap.parse_args(argv)
    only = [x.strip() for x in a.only.split(";") if x.strip()]
    t0 = time.time()
    parts, log = [], []
    if a.speed:
        for name in a.models.split(","):
            res = speed(models.fetch(name, quiet=True), a.depth, a.rounds, a.threads, log)
            parts.append(speed_markdown(name, a.depth, res))
        a.out.write_text(
            "# Decode speed of the ott tiers next to f16\n\n"
            f"Measured {time.strftime('%a %b %d %H:%M:%S %Y')} on {platform.machine()}, {a.threads} threads, "
            f"{a.rounds} rounds, types interleaved in each round (`python -m study.tiers --speed --out {a.out} "
            f"--models {a.models} --depth {a.depth} --rounds {a.rounds}`); llama-bench runs the ott caches with "
            "the defaults (V rotated, 3-bit keys with k_mix).\n\n"
            + "\n".join(parts)
            + "\n## Commands\n\n```\n"
            + "\n".join(log)
            + "\n```\n"
        )
        print(a.out)
        return 0
    for name in a.models.split(","):
        print(f"{name}:", file=sys.stderr, flush=True)
        tiers = model_tiers(name)
        if only:
            unknown = set(only) - {t.label for t in tiers} - {"quality"}  # quality: the model's calibrated row
            if unknown:
                ap.error(f"{name}: no row labelled {sorted(unknown)}; rows: {[t.label for t in tiers]}")
            tiers = tuple(t for t in tiers if t.k == "q4_0" or t.label in only or (t.layers and "quality" in only))
        rows = measure(models.fetch(name, quiet=True), a.threads, a.chunks, log, tiers)
        parts.append(markdown(name, rows))
    when = time.strftime("%a %b %d %H:%M:%S %Y")
    text = (
        "# Quality per byte: K/V widths per side and rotated V\n\n"
        f"Measured {when} on {platform.machine()}, {a.threads} threads, in {time.time() - t0:.0f} s "
        f"(`python -m study.tiers --out {a.out} --models {a.models} --chunks {a.chunks}"
        + (f" --only '{a.only}'" if only else "")
        + "`).\n\n"
        "llama-perplexity over 2048-token chunks of the pinned llama.cpp docs, KL divergence against f16; "
        "`+rotV`: V quantized from its Hadamard-rotated values (`v_rotate`); 2- and 3-bit keys run k_mix (K widths "
        "per channel in each sealed group, the default: docs/long-context-keys.md, docs/k-channel-widths.md) unless "
        "marked `uniform K` (`uniform 2-bit K`: the layers with 2-bit keys only). Bits per element: the bytes the "
        "cache allocates for 2k/8k/32k tokens (fp16 tail, pools and, for Gemma 3, its f16 window layers "
        "included) over the K and V elements of those tokens in every layer. The ott caches split llama-perplexity's "
        "512-token ubatches at their seal boundaries (batch invariance, issue 13), so every position is scored "
        "as generation would score it, one token at a time.\n\n"
    )  # fmt: skip
    write_report(a.out, text, parts, log)
    return 0


def write_report(out: Path, head: str, parts: Sequence[str], log: Sequence[str]) -> None:
    """A study's markdown: its head, the parts, then the commands that measured them."""
    out.write_text(head + "\n".join(parts) + "\n## Commands\n\n```\n" + "\n".join(log) + "\n```\n")
    print(out)


if __name__ == "__main__":
    sys.exit(main())
