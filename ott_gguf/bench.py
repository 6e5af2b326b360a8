"""Prefill and decode speed per K/V cache type and context depth, measured by the bundled llama-bench.

`ott-gguf bench MODEL` runs `llama-bench -ctk K -ctv V -fa 1 -d DEPTHS -p P -n N -r 1 -o json` per cache type
or "K/V" pair, in rounds: every type once per round, so a machine that slows down or speeds up during the run
affects them alike; the median of the rounds is reported with their spread. ott2..ott4 and kivi2..kivi4 (the
ott cache without outliers) are cache types like the stock ones; they run the C defaults unless a configuration
is given (`tiers`: llama-bench's --ott-params and --ott-layers). "pp" rows time P prompt tokens in one batch,
"tg" rows N generated tokens one at a time, each after `depth` tokens already in the cache. A type written
"T:fa0" runs without flash attention (`-fa 0`: llama.cpp's plain f16 attention, the faster f16 baseline on CPUs
where its flash attention is slow, docs/decode-profile.md), its rows under that name.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._lib import bin_path
from .kv_types import OttConfig, kv_pair_name, resolve_kv_types

# the suffix of a type that bench() runs without flash attention ("f16:fa0")
NO_FLASH = ":fa0"
# a configured ott cache under a label of its own: label -> (K/V pair, its configuration)
Tiers = dict[str, tuple[str, OttConfig]]

__all__ = ["BenchRow", "bench", "bench_command", "parse_bench_json", "plot_bench"]


@dataclass(frozen=True)
class BenchRow:
    kv_type: str  # "ott2", or "ott3/ott2" for K/V types that differ
    test: str  # "pp" (prompt processing, prefill) or "tg" (token generation, decode)
    n_tokens: int  # tokens timed: P for pp, N for tg
    depth: int  # tokens in the cache before the timed ones
    tokens_per_s: float  # median over the rounds
    stddev: float  # over the rounds (0 with one)
    samples: tuple[float, ...] = ()  # tokens/s of each round, in order

    @property
    def spread(self) -> float:
        """(max - min) / median of the rounds: how much the machine moved under the measurement."""
        return (max(self.samples) - min(self.samples)) / self.tokens_per_s if len(self.samples) > 1 else 0.0

    @property
    def label(self) -> str:
        return f"{self.test}{self.n_tokens} @ {self.depth}"


def ott_args(cfg: OttConfig) -> list[str]:
    """An ott cache's configuration as the bundled tools take it: --ott-params (and --ott-layers)."""
    out = ["--ott-params", cfg.params_text()]
    return out + (["--ott-layers", cfg.layer_widths] if cfg.layer_widths else [])


def bench_command(model: Path | str, kv_type: str, *, depths: Sequence[int], n_prompt: int, n_gen: int,
                  threads: int | None, reps: int, n_gpu_layers: int | None = None,
                  ott_config: OttConfig | None = None, flash_attn: bool = True) -> list[str]:  # fmt: skip
    k, v = resolve_kv_types(kv_type)
    cmd = [str(bin_path("llama-bench")), "-m", str(model), "-ctk", k, "-ctv", v, "-fa", str(int(flash_attn)),
           "-p", str(n_prompt), "-n", str(n_gen), "-d", ",".join(str(d) for d in depths), "-r", str(reps),
           "-o", "json"]  # fmt: skip
    if ott_config is not None:
        cmd += ott_args(ott_config)
    if threads is not None:
        cmd += ["-t", str(threads)]
    if n_gpu_layers is not None:
        cmd += ["-ngl", str(n_gpu_layers)]
    return cmd


def parse_bench_json(text: str, kv_type: str) -> list[BenchRow]:
    """llama-bench's `-o json` output (a list of tests) as rows; combined pp+tg tests (-pg) are not read."""
    rows = []
    for t in json.loads(text):
        n_prompt, n_gen = int(t["n_prompt"]), int(t["n_gen"])
        if n_prompt > 0 and n_gen == 0:
            test, n = "pp", n_prompt
        elif n_gen > 0 and n_prompt == 0:
            test, n = "tg", n_gen
        else:
            continue
        rows.append(BenchRow(kv_type, test, n, int(t.get("n_depth", 0)), float(t["avg_ts"]), float(t["stddev_ts"])))
    return rows


def bench(
    model: Path | str,
    kv_types: Sequence[str],
    *,
    depths: Sequence[int] = (0, 512, 2048),
    n_prompt: int = 512,
    n_gen: int = 64,
    threads: int | None = None,
    reps: int = 3,
    progress: Callable[[str], None] | None = None,
    n_gpu_layers: int | None = None,
    tiers: Tiers | None = None,
) -> list[BenchRow]:
    """llama-bench for every cache type, `reps` rounds with the types interleaved (one llama-bench -r 1 per type and
    round); rows in the order of kv_types, then as llama-bench reports them, each the median of its rounds. An
    entry of kv_types that `tiers` names runs its K/V pair with its configuration, its rows under that label."""
    from .info import require_ott_support

    tiers = tiers or {}
    split = [(t[: -len(NO_FLASH)], False) if t.endswith(NO_FLASH) else (t, True) for t in kv_types]
    bases = [t if t in tiers else kv_pair_name(*resolve_kv_types(t)) for t, _ in split]
    types = [b if flash else b + NO_FLASH for b, (_, flash) in zip(bases, split, strict=True)]
    if not Path(model).is_file():
        raise FileNotFoundError(f"model file not found: {model}")
    if any(d < 0 for d in depths) or n_prompt < 0 or n_gen < 0 or reps < 1 or not (n_prompt or n_gen):
        raise ValueError("depths, -p and -n must be >= 0 (-p or -n above 0) and repetitions >= 1")
    require_ott_support(model, [tiers[b][0] if b in tiers else b for b in bases])  # llama-bench only exits
    samples: dict[tuple[str, str, int, int], list[float]] = {}
    for r in range(reps):
        for t, b, (_, flash) in zip(types, bases, split, strict=True):
            pair, cfg = tiers.get(b, (b, None))
            cmd = bench_command(model, pair, depths=depths, n_prompt=n_prompt, n_gen=n_gen, threads=threads, reps=1,
                                n_gpu_layers=n_gpu_layers, ott_config=cfg, flash_attn=flash)  # fmt: skip
            if progress:
                progress(f"round {r + 1}/{reps}, {t}: {' '.join(cmd)}")
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"llama-bench failed for {t} (exit {res.returncode}):\n{res.stderr[-2000:]}")
            for row in parse_bench_json(res.stdout, t):
                samples.setdefault((t, row.test, row.n_tokens, row.depth), []).append(row.tokens_per_s)
    return [
        BenchRow(t, test, n, depth, statistics.median(v), statistics.pstdev(v), tuple(v))
        for (t, test, n, depth), v in samples.items()
    ]


def plot_bench(rows: Sequence[BenchRow], path: Path | str, bytes_per_token: dict[str, float] | None = None,
               title: str = "") -> None:  # fmt: skip
    """Tokens/s against depth, prefill and decode side by side, one line per cache type: the median of the rounds,
    with bars from the slowest to the fastest round."""
    from .evaluate import import_pyplot

    plt = import_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, test, name in zip(axes, ("pp", "tg"), ("prefill", "decode"), strict=True):
        sel = [r for r in rows if r.test == test]
        for t in dict.fromkeys(r.kv_type for r in sel):
            pts = sorted((r for r in sel if r.kv_type == t), key=lambda r: r.depth)
            lo = [r.tokens_per_s - min(r.samples or (r.tokens_per_s,)) for r in pts]
            hi = [max(r.samples or (r.tokens_per_s,)) - r.tokens_per_s for r in pts]
            label = t if not bytes_per_token or t not in bytes_per_token else f"{t} ({bytes_per_token[t]:.0f} B/token)"
            ax.errorbar([r.depth for r in pts], [r.tokens_per_s for r in pts], yerr=[lo, hi], marker="o", capsize=3,
                        label=label)  # fmt: skip
        n = sel[0].n_tokens if sel else 0
        ax.set_title(f"{name} ({test}{n})", fontsize=10)
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
