"""Code widths per layer, calibrated on a model (`ott-gguf calibrate`).

Layers differ in how much their cache's error reaches the output (SmolLM2: widening layers 15-24 gains 6x more
than widening layers 5-14; docs/layer-widths.md). Like llama.cpp's imatrix for weights, the widths are chosen once
per model on calibration text:

1. The layers the ott cache serves are cut into contiguous blocks.
2. llama-perplexity measures the mean KL divergence against f16 with the base pair everywhere, then with one
   block at a time widened (`up`) and narrowed (`down`).
3. Among the assignments of {base, up, down} to the blocks whose code bits are at most `budget` times the base
   pair's (1: a cache no larger), the one with the lowest KLD predicted from the measured effects, summed (blocks
   are assumed to act independently), is measured as a whole; at budget 1 it is kept only if it beats the base
   pair. `max_bits` bounds the bits per element at 8k instead, checked on the cache's own bytes.

The calibration text is the pinned llama.cpp docs from byte CALIB_OFFSET on, disjoint from the first 200,000
bytes that `ott-gguf eval` and the studies measure on.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .kv_types import OTT_KV_TYPES, OttConfig, format_layer_widths, kv_type_bits, resolve_kv_types

CALIB_OFFSET = 300_000  # bytes of the concatenated docs skipped: evaluation text stays out of calibration
Widths = tuple[int, int]
BITS_CTX = 8192  # the context the report gives bits per element at (issue 12's targets are at 8k)
# the contexts `calibrate` picks from when none is given, longest first: a calibration made at 2048 tokens loses most
# of its gain at 8192 (docs/long-context.md), so it is made at the longest the model was trained for whose runs fit
# the time allowed (max_minutes)
AUTO_CONTEXTS = (8192, 4096, 2048)
PROBE_SIZES = (256, 512, 1024)  # tokens of the timing probe's single-chunk runs


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
    down_loss: float  # KLD(this block narrowed) - KLD(base); inf when nothing is narrowed (widen only)


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


def best_plan(
    blocks: Sequence[Block],
    base_kld: float,
    base: Widths,
    up: Widths,
    down: Widths,
    budget: float = 1.0,
    limit: int | None = None,
) -> Plan:
    """The assignment of base/up/down to the blocks with the lowest KLD predicted from the per-block effects, among
    those whose code bits (sum over layers of K + V bits) are at most `budget` times the base pair's (or at most
    `limit` code bits, when given); all-base when none is better and the base pair fits.

    The effects add up, so this is a knapsack over the code bits: dynamic programming over the blocks, keyed by
    the code bits spent so far (exact, and fast for one block per layer)."""
    cost = {"base": sum(base), "up": sum(up), "down": sum(down)}
    base_bits = sum(cost["base"] * len(b.layers) for b in blocks)
    if limit is None:
        limit = int(budget * base_bits + 1e-9)
    # code bits spent -> (predicted KLD, choices); ties keep the assignment found first (fewer changes)
    states: dict[int, tuple[float, tuple[str, ...]]] = {0: (base_kld, ())}
    for b in blocks:
        nxt: dict[int, tuple[float, tuple[str, ...]]] = {}
        for bits, (kld, choice) in states.items():
            for c in ("base", "up", "down"):
                nb = bits + cost[c] * len(b.layers)
                nk = kld + (-b.up_gain if c == "up" else b.down_loss if c == "down" else 0.0)
                if nb not in nxt or nk < nxt[nb][0] - 1e-12:
                    nxt[nb] = (nk, (*choice, c))
        states = nxt
    fits = sorted((kld, bits, choice) for bits, (kld, choice) in states.items() if bits <= limit)
    if not fits:
        raise ValueError(f"no assignment fits {limit} code bits (the base pair's: {base_bits}; narrowing every "
                         f"block: {min(states)})")  # fmt: skip
    kld, bits, choice = fits[0]
    if base_bits <= limit and kld >= base_kld - 1e-12:
        return Plan(("base",) * len(blocks), base_kld, base_bits)
    return Plan(choice, kld, bits)


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
    budget: float = 1.0  # code bits allowed, as a fraction of the base pair's
    max_bits: float | None = None  # or: bits per element at BITS_CTX allowed
    bits: tuple[float, float] | None = None  # bits per element at BITS_CTX tokens: base pair, chosen widths
    commands: list[str] = field(default_factory=list)
    ott_params: str = ""  # the configuration's native fields, as --ott-params takes them
    chunks: int = 0
    n_ctx: int = 0
    seconds: float = 0.0

    def record(self, sha256: str, command: str, provenance: str = "") -> dict[str, object]:
        """The calibration file's fields (docs/kv-tiers.md), schema and version aside (tiers.write_calibration)."""
        from datetime import datetime, timezone

        from . import __version__

        try:
            from ._lib import llama_ott_build_info

            build = llama_ott_build_info()
        except Exception:  # noqa: BLE001 (a record without the build line is still a record)
            build = ""
        out: dict[str, object] = {
            "model_sha256": sha256,
            "model_file": Path(self.model).name,
            "kv_type": self.kv_type,
            "ott_params": self.ott_params,
            "layer_widths": self.spec,
            "bits_per_element": None
            if self.bits is None
            else {"n_ctx": BITS_CTX, "base_pair": round(self.bits[0], 4), "calibrated": round(self.bits[1], 4)},
            "mean_kld_vs_f16": {
                "base_pair": round(self.base_kld, 6),
                "calibrated": round(self.measured_kld, 6),
                "predicted": round(self.plan.predicted_kld, 6),
            },  # fmt: skip
            "calibration": {
                "command": command,
                "up": f"{self.up[0]}/{self.up[1]}",
                "down": f"{self.down[0]}/{self.down[1]}",
                "blocks": [[b.layers[0], b.layers[-1]] for b in self.blocks],
                "budget": self.budget,
                "max_bits": self.max_bits,
                "chunks": self.chunks,
                "n_ctx": self.n_ctx,
                "text": f"the pinned llama.cpp docs (ott_gguf.corpus) from byte {CALIB_OFFSET} on, disjoint from "
                "the text ott-gguf eval measures on",
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "seconds": round(self.seconds),
                "ott_gguf": __version__,
                "build": build,
            },
        }
        if provenance:
            out["provenance"] = provenance
        return out

    def report(self) -> str:
        lines = [f"calibration of {self.model}, base {self.kv_type} (K/V bits {self.base[0]}/{self.base[1]}), "
                 f"up {self.up[0]}/{self.up[1]}, down {self.down[0]}/{self.down[1]}",
                 f"mean KLD vs f16 with the base pair everywhere: {self.base_kld:.4f}",
                 "| layers | gain widened | loss narrowed | chosen |", "|---|---|---|---|"]  # fmt: skip
        for b, c in zip(self.blocks, self.plan.choice, strict=True):
            span = f"{b.layers[0]}-{b.layers[-1]}" if len(b.layers) > 1 else str(b.layers[0])
            loss = "-" if math.isinf(b.down_loss) else f"{b.down_loss:+.4f}"
            lines.append(f"| {span} | {b.up_gain:+.4f} | {loss} | {c} |")
        room = "no more bytes" if self.budget == 1.0 else f"at most {self.budget:g}x the base pair's code bits"
        if self.max_bits is not None:
            room = f"at most {self.max_bits:g} bits per element at {BITS_CTX} tokens"
        if self.spec:
            lines.append(f"chosen: --ott-layers {self.spec} (predicted KLD {self.plan.predicted_kld:.4f}, measured "
                         f"{self.measured_kld:.4f}: {self.measured_kld / self.base_kld:.2f}x the base pair, "
                         f"{room})")  # fmt: skip
        else:
            lines.append(f"chosen: the base pair everywhere (no assignment measured better at {room})")
        if self.bits is not None:
            lines.append(f"bits per K/V element at {BITS_CTX} tokens (the cache's own bytes): base pair "
                         f"{self.bits[0]:.3f}, chosen {self.bits[1]:.3f}")  # fmt: skip
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


def fit_seconds(sizes: Sequence[int], seconds: Sequence[float]) -> Callable[[int], float]:
    """t(n) = c + a n + b n^2 through three timed runs (a run's load, its per-token work, its attention), the
    coefficients kept >= 0 (a negative one from timing noise is dropped and the rest refitted): a chunk's time at
    another context, an estimate."""
    import numpy as np

    x = np.asarray(sizes, np.float64)
    y = np.asarray(seconds, np.float64)
    cols = [np.ones_like(x), x, x * x]
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(np.stack([cols[i] for i in keep], 1), y, rcond=None)
        neg = [k for k, c in zip(keep, coef, strict=True) if c < 0]
        if not neg or len(keep) == 1:
            break
        keep.remove(neg[0])
    full = [0.0, 0.0, 0.0]
    for k, c in zip(keep, coef, strict=True):
        full[k] = max(float(c), 0.0)
    return lambda n: full[0] + full[1] * n + full[2] * n * n


def planned_runs(n_blocks: int, narrow: bool = True) -> int:
    """llama-perplexity runs of a calibration: f16 logits, the base pair, each block up (and down, unless it widens
    only), the chosen widths."""
    return 3 + (2 if narrow else 1) * n_blocks


def estimate_seconds(f16: Callable[[int], float], ott: Callable[[int], float], n_ctx: int, chunks: int,
                     n_blocks: int, narrow: bool = True) -> float:  # fmt: skip
    """The calibration's time at n_ctx: one f16 run and the ott runs, each of `chunks` chunks."""
    return chunks * (f16(n_ctx) + (planned_runs(n_blocks, narrow) - 1) * ott(n_ctx))


def choose_context(estimate: Callable[[int], float], n_ctx_train: int | None, max_seconds: float) -> tuple[int, str]:
    """(context, why): the longest of AUTO_CONTEXTS the model was trained for whose estimate fits max_seconds, else
    the shortest."""
    fits = [n for n in AUTO_CONTEXTS if n_ctx_train is None or n <= n_ctx_train]
    if not fits:
        return AUTO_CONTEXTS[-1], f"the model's training context is {n_ctx_train} tokens"
    for n in fits:
        if estimate(n) <= max_seconds:
            return n, f"the longest of {'/'.join(map(str, AUTO_CONTEXTS))} that fits {_duration(max_seconds)}"
    return fits[-1], f"none of {'/'.join(map(str, fits))} fits {_duration(max_seconds)}: the shortest"


def calibrate(
    model: Path,
    kv_type: str = "ott3/ott2",
    up: str = "3/3",  # with k_mix, 3-bit values pay more than a 4th key bit (docs/tiers.md)
    down: str = "2/2",
    n_blocks: int = 10,
    chunks: int = 2,
    n_ctx: int | None = None,
    threads: int = 2,
    budget: float = 1.0,
    max_bits: float | None = None,
    ott_config: OttConfig | None = None,
    log: Callable[[str], None] = print,
    max_minutes: float = 60.0,
) -> Calibration:
    """n_ctx None: the longest of AUTO_CONTEXTS the model was trained for whose estimated time (timed probe runs at
    PROBE_SIZES tokens, extrapolated) fits max_minutes. The estimate is logged before the runs either way."""
    from ._lib import bin_path

    k, v = resolve_kv_types(kv_type)
    if k not in OTT_KV_TYPES:
        raise ValueError(f"calibration is for the ott cache types ({', '.join(OTT_KV_TYPES)}), not {kv_type!r}")
    base, w_up, w_down = (kv_type_bits(k), kv_type_bits(v)), parse_widths(up), parse_widths(down)
    # down equal to the base pair: widen only (ott2 has no narrower widths; its bytes come from a bit budget)
    narrow = w_down != base
    if not (sum(base) < sum(w_up) and (not narrow or sum(w_down) < sum(base))):
        raise ValueError(f"up ({up}) must hold more code bits than the base pair and down ({down}) fewer (or down "
                         f"the base pair's own widths: widen only)")  # fmt: skip
    if n_blocks < 1:
        raise ValueError(f"blocks must be at least 1, got {n_blocks}")
    if n_ctx is not None and n_ctx < 64:
        raise ValueError(f"n_ctx must be at least 64 tokens, got {n_ctx}")
    if max_minutes <= 0:
        raise ValueError(f"max_minutes must be positive, got {max_minutes:g}")
    if not (0.5 <= budget <= 2.0):
        raise ValueError(f"budget is a fraction of the base pair's code bits in [0.5, 2], got {budget:g}")
    if max_bits is not None and budget != 1.0:
        raise ValueError("give either a budget (a fraction of the base pair's code bits) or max_bits, not both")
    if max_bits is not None and not (0.5 <= max_bits <= 16.0):
        raise ValueError(f"max_bits is bits per K/V element in [0.5, 16], got {max_bits:g}")
    if ott_config is not None and ott_config.layer_widths:
        raise ValueError("calibration chooses layer_widths itself: give an ott_config without them")
    # the configuration's native fields (R, v_sym, ...) go to llama-perplexity and to the byte counts alike
    native = {f: getattr(ott_config, f) for f in OttConfig.NATIVE_FIELDS} if ott_config else None
    params = ["--ott-params", ott_config.params_text()] if ott_config else []
    from .info import model_info

    # bits per element need one KV head count for every layer (cache_bits)
    bits_known = model_info(model).n_head_kv is not None
    if max_bits is not None and not bits_known:
        raise ValueError(f"{model}: per-layer KV head counts: max_bits cannot be checked for this model; use budget")
    layers = ott_layers(model, kv_type)
    n_blocks = min(n_blocks, len(layers))
    # contiguous blocks of nearly equal size
    bounds = [round(i * len(layers) / n_blocks) for i in range(n_blocks + 1)]
    groups = [tuple(layers[bounds[i] : bounds[i + 1]]) for i in range(n_blocks)]
    commands: list[str] = []
    # llama-perplexity runs: f16 logits, the base pair, each block up and down, the chosen widths
    planned = planned_runs(len(groups), narrow)
    start = time.monotonic()
    info = model_info(model)
    if n_ctx is not None and info.n_ctx_train is not None and n_ctx > info.n_ctx_train:
        raise ValueError(f"n_ctx {n_ctx} is beyond {model.name}'s training context ({info.n_ctx_train} tokens)")
    # a context told: one chunk of each kind at that context times the runs exactly (two short runs instead of
    # six); otherwise the probe sizes, extrapolated to the candidate contexts
    f16_t, ott_t = _probe(model, k, v, params, threads, PROBE_SIZES if n_ctx is None else (n_ctx,))
    estimate = lambda n: estimate_seconds(f16_t, ott_t, n, chunks, len(groups), narrow)  # noqa: E731
    how = f"{'/'.join(map(str, PROBE_SIZES))} tokens, extrapolated" if n_ctx is None else f"{n_ctx} tokens"
    if n_ctx is None:
        n_ctx, why = choose_context(estimate, info.n_ctx_train, 60.0 * max_minutes)
        log(f"calibrating at {n_ctx} tokens per chunk ({why}; --n-ctx chooses)")
    log(f"estimated time: about {_duration(estimate(n_ctx))} (timed probe runs of {how}; an estimate)")

    run_start = time.monotonic()
    ott_seconds: list[float] = []

    def progress(what: str) -> str:
        done = len(commands)
        spent = time.monotonic() - run_start
        # the runs left are ott runs: their own mean so far, else the probe's estimate of one
        per = sum(ott_seconds) / len(ott_seconds) if ott_seconds else chunks * ott_t(n_ctx)
        left = per * max(planned - done, 0)
        return f"[{done}/{planned}, {_duration(spent)} spent, about {_duration(left)} left] {what}"

    log(f"calibrating {model.name}: {planned} runs of llama-perplexity ({chunks} chunk(s) of {n_ctx} tokens, "
        f"{threads} thread(s)); the first, f16, is the reference")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "calib.txt"
        text.write_text(calibration_text(chunks * n_ctx * 8))
        ref = Path(tmp) / "f16.kld"
        common = [str(bin_path("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(n_ctx),
                  "-b", str(n_ctx), "-ub", "512", "--chunks", str(chunks), "-t", str(threads), "-fa", "on",
                  *params]  # fmt: skip

        def run(args: list[str], what: str) -> dict[str, float] | None:
            cmd = [*common, *args]
            commands.append(" ".join(cmd))
            t0 = time.monotonic()
            r = subprocess.run(cmd, capture_output=True, text=True)
            if "-ctk" in args and args[args.index("-ctk") + 1] != "f16":
                ott_seconds.append(time.monotonic() - t0)
            if r.returncode != 0:
                raise RuntimeError(f"llama-perplexity failed ({what}):\n{r.stderr[-3000:]}")
            return None if "--kl-divergence" not in args else perplexity_numbers(r.stdout + r.stderr)

        run(["-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(ref)], "f16 logits")
        log("  " + progress("f16 reference logits"))

        def kld(widths: dict[int, Widths], what: str) -> float:
            args = ["-ctk", k, "-ctv", v, "--kl-divergence-base", str(ref), "--kl-divergence"]
            if widths:
                args += ["--ott-layers", format_layer_widths(widths)]
            num = run(args, what)
            assert num is not None
            log("  " + progress(f"{what}: mean KLD {num['mean_kld']:.4f}"))
            return num["mean_kld"]

        base_kld = kld({}, f"{kv_type} everywhere")
        blocks = []
        for g in groups:
            span = f"layers {g[0]}-{g[-1]}"
            gain = base_kld - kld(dict.fromkeys(g, w_up), f"{span} at {up}")
            loss = kld(dict.fromkeys(g, w_down), f"{span} at {down}") - base_kld if narrow else math.inf
            blocks.append(Block(g, gain, loss))
        if max_bits is None:
            plan = best_plan(blocks, base_kld, base, w_up, w_down, budget)
        else:
            plan = plan_within_bits(model, k, v, blocks, base_kld, base, w_up, w_down, max_bits, log, native)
        spec = plan.spec(blocks, base, w_up, w_down)
        measured = base_kld
        if spec:
            from .kv_types import parse_layer_widths

            measured = kld(parse_layer_widths(spec), f"chosen {spec}")
            # a plan must beat the base pair where the base pair fits; under a tighter budget it does not
            base_fits = (
                budget >= 1.0 if max_bits is None else cache_bits(model, k, v, "", ott_config=native) <= max_bits
            )
            if measured >= base_kld and base_fits:
                log(f"  the chosen widths measure {measured:.4f}, not below the base pair's: keeping the base pair")
                spec, measured = "", base_kld
    bits = (
        (cache_bits(model, k, v, "", ott_config=native), cache_bits(model, k, v, spec, ott_config=native))
        if bits_known
        else None
    )
    params_text = (ott_config or OttConfig()).params_text()
    return Calibration(str(model), kv_type, base, w_up, w_down, blocks, base_kld, plan, spec, measured, budget,
                       max_bits, bits, commands, params_text, chunks, n_ctx, time.monotonic() - start)  # fmt: skip


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _probe(
    model: Path, k: str, v: str, params: list[str], threads: int, sizes: Sequence[int]
) -> tuple[Callable[[int], float], ...]:
    """Seconds per chunk for the f16 reference and the K/V pair, from single-chunk llama-perplexity runs at `sizes`
    tokens: fit_seconds through three sizes (any context), a run's own time for one size (that context only)."""
    from ._lib import bin_path

    times: dict[str, list[float]] = {"f16": [], "ott": []}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "probe.txt"
        text.write_text(calibration_text(max(sizes) * 8))
        for n in sizes:
            for name, kk, vv in (("f16", "f16", "f16"), ("ott", k, v)):
                cmd = [str(bin_path("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(n), "-b",
                       str(n), "-ub", "512", "--chunks", "1", "-t", str(threads), "-fa", "on", "-ctk", kk, "-ctv", vv,
                       *(params if name == "ott" else [])]  # fmt: skip
                t0 = time.monotonic()
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(
                        f"llama-perplexity failed (timing probe, {name}, {n} tokens):\n{r.stderr[-3000:]}"
                    )
                times[name].append(time.monotonic() - t0)
    if len(sizes) == 1:
        f16_s, ott_s = times["f16"][0], times["ott"][0]
        return (lambda n: f16_s), (lambda n: ott_s)
    return fit_seconds(sizes, times["f16"]), fit_seconds(sizes, times["ott"])


def plan_within_bits(
    model: Path,
    k: str,
    v: str,
    blocks: Sequence[Block],
    base_kld: float,
    base: Widths,
    up: Widths,
    down: Widths,
    max_bits: float,
    log: Callable[[str], None] = print,
    ott_config: dict[str, object] | None = None,
) -> Plan:
    """The best plan whose cache takes at most max_bits per element at BITS_CTX tokens, by the caches' own bytes.

    Bytes grow with the code bits at a rate measured from the base pair and every block widened; the plan for the
    code bits that rate allows is then checked against the cache itself, and the allowance lowered one code bit
    at a time until it fits (the rate is not exact: a 3-bit key layer narrowed to 2 bits also drops its k_mix
    width table)."""
    n_layers = sum(len(b.layers) for b in blocks)
    base_code = sum(base) * n_layers
    all_up = format_layer_widths({il: up for b in blocks for il in b.layers})
    b0, b_up = (
        cache_bits(model, k, v, "", ott_config=ott_config),
        cache_bits(model, k, v, all_up, ott_config=ott_config),
    )
    rate = (b_up - b0) / ((sum(up) - sum(base)) * n_layers)  # bits per element per code bit
    limit = base_code + int((max_bits - b0) / rate + 1e-9) if rate > 0 else base_code
    floor = sum(down) * n_layers
    while limit >= floor:
        plan = best_plan(blocks, base_kld, base, up, down, limit=limit)
        spec = plan.spec(blocks, base, up, down)
        bits = cache_bits(model, k, v, spec, ott_config=ott_config)
        if bits <= max_bits + 1e-9:
            return plan
        log(f"  {spec or 'the base pair'}: {bits:.3f} bits per element, over {max_bits:g}: one code bit less")
        limit -= 1
    raise ValueError(f"no widths of the blocks fit {max_bits:g} bits per element at {BITS_CTX} tokens (the base "
                     f"pair takes {b0:.3f})")  # fmt: skip


def cache_bits(
    model: Path,
    k: str,
    v: str,
    layer_widths: str = "",
    n_ctx: int = BITS_CTX,
    ott_config: dict[str, object] | None = None,
) -> float:
    """Bits per K/V element of the cache a context of n_ctx tokens allocates (fp16 tail, pools and any f16 window
    layers included), over the K and V elements of n_ctx tokens in every layer. ott_config: Llama's, for the ott
    types (layer_widths goes into it)."""
    from . import _lib
    from .info import model_info
    from .llama import Llama

    info = model_info(model)
    if info.n_head_kv is None:
        raise ValueError(f"{model}: per-layer KV head counts: bits per element are not computed for this model")
    config = dict(ott_config or {})
    if layer_widths:
        config["layer_widths"] = layer_widths
    llm = Llama(str(model), type_k=k, type_v=v, ott_config=config or None, n_ctx=n_ctx, n_batch=32, n_ubatch=32,
                swa_full=False, verbose=False)  # fmt: skip
    try:
        nbytes = _lib.kv_cache_bytes(llm._ctx.ctx)
    finally:
        llm.close()
    return 8.0 * nbytes / (n_ctx * info.n_layer * info.n_head_kv * (info.head_dim_k + info.head_dim_v))
