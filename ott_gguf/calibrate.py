"""Code widths per layer, calibrated on a model (`ott-gguf calibrate`).

Layers differ in how much their cache's error reaches the output (SmolLM2: widening layers 15-24 gains 6x more
than widening layers 5-14; docs/layer-widths.md). Like llama.cpp's imatrix for weights, the widths are chosen once
per model on calibration text:

1. The layers the ott cache serves are cut into contiguous blocks.
2. llama-perplexity measures the mean KL divergence against f16 with the base pair everywhere, then with one
   block at a time widened (`up`) and narrowed (`down`).
3. Every assignment of {base, up, down} to the blocks whose cache is no larger than the base pair's is scored
   by the measured effects, summed (blocks are assumed to act independently); the best is then measured as a
   whole and kept only if it beats the base pair.

The calibration text is the pinned llama.cpp docs from byte CALIB_OFFSET on, disjoint from the first 200,000
bytes that `ott-gguf eval` and the studies measure on.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .kv_types import OTT_KV_TYPES, format_layer_widths, kv_type_bits, resolve_kv_types

CALIB_OFFSET = 300_000  # bytes of the concatenated docs skipped: evaluation text stays out of calibration
Widths = tuple[int, int]


def perplexity_numbers(out: str) -> dict[str, float]:
    """What llama-perplexity --kl-divergence prints at the end: PPL, its ratio to the base's, mean and 99.9% KLD,
    top-1 agreement (percent)."""

    def num(pattern: str) -> float:
        m = re.search(pattern, out)
        if not m:
            raise RuntimeError(f"llama-perplexity output has no match for {pattern!r}:\n{out[-3000:]}")
        return float(m.group(1))

    return {
        "ppl": num(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"),
        "ppl_ratio": num(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([0-9.]+)"),
        "mean_kld": num(r"Mean\s+KLD:\s*([-0-9.]+)"),
        "kld_999": num(r"99\.9%\s+KLD:\s*([-0-9.]+)"),
        "top1": num(r"Same top p:\s*([0-9.]+)"),
    }


def parse_widths(text: str) -> Widths:
    """'4/3' -> (4, 3)."""
    k, _, v = text.partition("/")
    try:
        w = (int(k), int(v))
    except ValueError:
        raise ValueError(f"widths must be K/V bits like 4/3, got {text!r}") from None
    if not all(b in (2, 3, 4) for b in w):
        raise ValueError(f"widths must be K/V bits of 2, 3 or 4, got {text!r}")
    return w


@dataclass(frozen=True)
class Block:
    layers: tuple[int, ...]
    up_gain: float  # KLD(base) - KLD(this block widened)
    down_loss: float  # KLD(this block narrowed) - KLD(base)


@dataclass(frozen=True)
class Plan:
    choice: tuple[str, ...]  # per block: "base", "up" or "down"
    predicted_kld: float
    code_bits: int  # K + V code bits per (layer, element pair) summed over layers, the quantity held at or below base

    def spec(self, blocks: Sequence[Block], base: Widths, up: Widths, down: Widths) -> str:
        widths: dict[int, Widths] = {}
        for b, c in zip(blocks, self.choice, strict=True):
            if c != "base":
                widths.update({il: up if c == "up" else down for il in b.layers})
        return format_layer_widths(widths)


def best_plan(blocks: Sequence[Block], base_kld: float, base: Widths, up: Widths, down: Widths) -> Plan:
    """The assignment of base/up/down to the blocks with the lowest KLD predicted from the per-block effects, among
    those whose code bits (sum over layers of K + V bits) are at most the base pair's; all-base when none is
    better."""
    cost = {"base": sum(base), "up": sum(up), "down": sum(down)}
    budget = sum(cost["base"] * len(b.layers) for b in blocks)
    best = Plan(("base",) * len(blocks), base_kld, budget)
    for choice in itertools.product(("base", "up", "down"), repeat=len(blocks)):
        bits = sum(cost[c] * len(b.layers) for b, c in zip(blocks, choice, strict=True))
        if bits > budget:
            continue
        kld = base_kld
        for b, c in zip(blocks, choice, strict=True):
            kld += -b.up_gain if c == "up" else b.down_loss if c == "down" else 0.0
        if kld < best.predicted_kld - 1e-12:
            best = Plan(choice, kld, bits)
    return best


@dataclass
class Calibration:
    model: str
    kv_type: str
    base: Widths
    up: Widths
    down: Widths
    blocks: list[Block]
    base_kld: float
    plan: Plan
    spec: str  # the layer_widths chosen ("" : the base pair everywhere)
    measured_kld: float  # of spec on the calibration text (base_kld when spec is "")
    commands: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"calibration of {self.model}, base {self.kv_type} (K/V bits {self.base[0]}/{self.base[1]}), "
                 f"up {self.up[0]}/{self.up[1]}, down {self.down[0]}/{self.down[1]}",
                 f"mean KLD vs f16 with the base pair everywhere: {self.base_kld:.4f}",
                 "| layers | gain widened | loss narrowed | chosen |", "|---|---|---|---|"]  # fmt: skip
        for b, c in zip(self.blocks, self.plan.choice, strict=True):
            span = f"{b.layers[0]}-{b.layers[-1]}" if len(b.layers) > 1 else str(b.layers[0])
            lines.append(f"| {span} | {b.up_gain:+.4f} | {b.down_loss:+.4f} | {c} |")
        if self.spec:
            lines.append(f"chosen: --ott-layers {self.spec} (predicted KLD {self.plan.predicted_kld:.4f}, measured "
                         f"{self.measured_kld:.4f}: {self.measured_kld / self.base_kld:.2f}x the base pair, "
                         "no more bytes)")  # fmt: skip
        else:
            lines.append("chosen: the base pair everywhere (no assignment measured better at no more bytes)")
        return "\n".join(lines)


def calibration_text(n_bytes: int) -> str:
    from .corpus import docs_text

    full = docs_text(CALIB_OFFSET + n_bytes)
    text = full.encode()[CALIB_OFFSET:].decode(errors="ignore")
    if len(text) < n_bytes // 2:
        raise RuntimeError(f"the packaged docs hold only {len(full.encode())} bytes: too few to calibrate on")
    return text


def ott_layers(model: Path, kv_type: str) -> list[int]:
    """The model layers an ott cache of kv_type serves (a sliding-window model's window layers are not)."""
    from . import Llama, _lib

    llm = Llama(str(model), kv_type=kv_type, n_ctx=256, n_batch=32, n_ubatch=32, verbose=False)
    try:
        return _lib.ott_cache_layers(llm._ctx.ctx)
    finally:
        llm.close()


def calibrate(
    model: Path,
    kv_type: str = "ott3/ott2",
    up: str = "3/3",  # with k_mix, 3-bit values pay more than a 4th key bit (docs/tiers.md)
    down: str = "2/2",
    n_blocks: int = 6,
    chunks: int = 2,
    n_ctx: int = 2048,
    threads: int = 2,
    log: Callable[[str], None] = print,
) -> Calibration:
    from ._lib import bin_path

    k, v = resolve_kv_types(kv_type)
    if k not in OTT_KV_TYPES:
        raise ValueError(f"calibration is for the ott cache types ({', '.join(OTT_KV_TYPES)}), not {kv_type!r}")
    base, w_up, w_down = (kv_type_bits(k), kv_type_bits(v)), parse_widths(up), parse_widths(down)
    if not (sum(w_down) < sum(base) < sum(w_up)):
        raise ValueError(f"up ({up}) must hold more code bits than the base pair and down ({down}) fewer")
    if n_blocks < 1 or n_blocks > 12:
        raise ValueError(f"blocks must be in [1, 12] (3^blocks assignments are scored), got {n_blocks}")
    layers = ott_layers(model, kv_type)
    n_blocks = min(n_blocks, len(layers))
    # contiguous blocks of nearly equal size
    bounds = [round(i * len(layers) / n_blocks) for i in range(n_blocks + 1)]
    groups = [tuple(layers[bounds[i] : bounds[i + 1]]) for i in range(n_blocks)]
    commands: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "calib.txt"
        text.write_text(calibration_text(chunks * n_ctx * 8))
        ref = Path(tmp) / "f16.kld"
        common = [str(bin_path("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(n_ctx),
                  "-b", str(n_ctx), "-ub", "512", "--chunks", str(chunks), "-t", str(threads), "-fa", "on"]  # fmt: skip

        def run(args: list[str], what: str) -> dict[str, float] | None:
            cmd = [*common, *args]
            commands.append(" ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"llama-perplexity failed ({what}):\n{r.stderr[-3000:]}")
            return None if "--kl-divergence" not in args else perplexity_numbers(r.stdout + r.stderr)

        run(["-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(ref)], "f16 logits")

        def kld(widths: dict[int, Widths], what: str) -> float:
            args = ["-ctk", k, "-ctv", v, "--kl-divergence-base", str(ref), "--kl-divergence"]
            if widths:
                args += ["--ott-layers", format_layer_widths(widths)]
            num = run(args, what)
            assert num is not None
            log(f"  {what}: mean KLD {num['mean_kld']:.4f}")
            return num["mean_kld"]

        base_kld = kld({}, f"{kv_type} everywhere")
        blocks = []
        for g in groups:
            span = f"layers {g[0]}-{g[-1]}"
            gain = base_kld - kld(dict.fromkeys(g, w_up), f"{span} at {up}")
            loss = kld(dict.fromkeys(g, w_down), f"{span} at {down}") - base_kld
            blocks.append(Block(g, gain, loss))
        plan = best_plan(blocks, base_kld, base, w_up, w_down)
        spec = plan.spec(blocks, base, w_up, w_down)
        measured = base_kld
        if spec:
            from .kv_types import parse_layer_widths

            measured = kld(parse_layer_widths(spec), f"chosen {spec}")
            if measured >= base_kld:
                log(f"  the chosen widths measure {measured:.4f}, not below the base pair's: keeping the base pair")
                spec, measured = "", base_kld
    return Calibration(str(model), kv_type, base, w_up, w_down, blocks, base_kld, plan, spec, measured, commands)
