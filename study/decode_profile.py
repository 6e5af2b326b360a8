"""Where a decoded token's time goes, per K/V cache type and context depth (issue 15, docs/decode-profile.md).

    python -m study.decode_profile --out docs/decode-profile.md [--types ott2,f16,compact] [--depths 0,4096,8192]
        [--threads 2] [--tokens 64] [--model smollm2-135m]

For each (type, depth): a context is filled with `depth` random tokens (not timed), then `tokens` tokens are
decoded one at a time while `perf record -e cpu-clock` samples this process. The samples are put into
categories by symbol (weight matmuls, the ott attention partial op, its merge, sealing, thread sync, other) and
turned into milliseconds per decoded token (CPU time summed over the threads, and its share of the wall time).
The bytes of cache state a decoded token reads are counted from the cache's own counters (sealed groups, fp16
tail, pooled tokens) and the block sizes; with the attention op's CPU time they give the achieved GB/s, set
against the streaming bandwidth of this machine measured by study/bandwidth_probe.c (built and run here).
Needs `perf` (linux-perf) and a C compiler. Timings move with the machine's load: compare rows of one run.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ott_gguf import models
from ott_gguf.info import captured_log, model_info
from ott_gguf.kv_types import resolve_kv_types

HERE = Path(__file__).resolve().parent
# symbol -> category, first match wins; symbols are those of libggml-cpu and the generated ott2-head kernels
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("ott attention partial", r"ott_attn_part|attn_group|attn_tail|softmax_tile|_dequantize_vrow|ott_fwht"),
    ("ott merge", r"ott_attn_merge|ott_head_unrotate"),
    ("ott seal", r"ott_seal|_k\dv\dg\d+x\d+_(seal|quantize|pool_insert)|ott_fp64_to_fp16"),
    # f16's attention: flash attention, or (f16:fa0) the f16 mul_mat dot products and the soft_max op
    ("f16 attention", r"flash_attn|ggml_vec_dot_f16|ggml_vec_mad_f16|ggml_vec_scale_f16|online_softmax|soft_max"),
    ("weight matmuls", r"mul_mat|vec_dot_q|gemm|gemv|quantize_row_q8|quantize_mat|repack"),
    # OpenMP workers spin in libgomp between ops; ggml's own barrier when built without OpenMP
    ("thread sync", r"libgomp|ggml_barrier|sched_yield|ggml_graph_compute_thread|futex"),
)
G, GV = 128, 64  # the generated kernels' group and V group (llama_ott_build_info)


@dataclass(frozen=True)
class Row:
    kv_type: str
    depth: int
    threads: int
    tokens: int
    wall_ms: float  # per decoded token
    cpu_ms: dict[str, float]  # per decoded token and category, summed over threads
    top: dict[str, float]  # per decoded token and function (the 12 largest), summed over threads
    state_bytes: int  # cache state one decoded token's attention reads (all ott layers and heads)

    def gbps(self, what: str = "ott attention partial") -> float:
        """state bytes over the op's wall share: its CPU time spread over the threads that run it."""
        ms = self.cpu_ms.get(what, 0.0) / self.threads
        return self.state_bytes / (ms * 1e-3) / 1e9 if ms > 0 else 0.0


def bandwidth(threads: int, sizes: tuple[int, ...] = (16_000_000, 1_000_000_000)) -> list[dict[str, object]]:
    """Medians of study/bandwidth_probe.c for 1..threads threads: an L3-sized buffer like the cache state and
    one far beyond the last-level cache."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) for the bandwidth probe")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "probe"
        subprocess.run([cc, "-O2", "-mavx2", "-mf16c", "-pthread", str(HERE / "bandwidth_probe.c"), "-o", str(exe)],
                       check=True)  # fmt: skip
        out = []
        for s in sizes:
            for t in range(1, threads + 1):
                r = subprocess.run([str(exe), str(s), str(t), "9"], capture_output=True, text=True, check=True)
                out += [json.loads(line) for line in r.stdout.splitlines()]
        return out


class Symbols:
    """Names for the addresses perf cannot name: the installed libggml-cpu is stripped, the build tree's copy
    (same build id) is not."""

    def __init__(self, unstripped: Path | None) -> None:
        self.addrs: list[int] = []
        self.names: list[str] = []
        if unstripped is None:
            return
        r = subprocess.run(["nm", "-C", "--defined-only", str(unstripped)], capture_output=True, text=True, check=True)
        parts = (ln.split(" ", 2) for ln in r.stdout.splitlines() if ln.count(" ") >= 2)
        rows = sorted((int(a, 16), n) for a, t, n in parts if t in "tTwW")
        self.addrs = [a for a, _ in rows]
        self.names = [n for _, n in rows]

    def name(self, addr: int) -> str:
        i = bisect.bisect_right(self.addrs, addr) - 1
        return self.names[i] if i >= 0 else hex(addr)


def microbench(gen_dir: Path, pairs: tuple[str, ...] = ("2/2", "3/2", "4/2", "4/4"), rows: tuple[int, ...] = (3, 96),
               D: int = 64, groups: int = 32) -> list[dict[str, object]]:  # fmt: skip
    """study/attn_microbench.c built against a generated ott2-head.c (gen_dir: a build's ott-gen/ggml): the sealed
    group kernel alone on one thread, ns per group call (best of the repetitions) per (K, V) width pair and rows."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) for the microbenchmark")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "mb"
        inc = [f"-I{gen_dir}", f"-I{HERE.parent / 'native/kernels'}"]
        subprocess.run([cc, "-O3", "-march=native", "-ffp-contract=off", *inc, str(HERE / "attn_microbench.c"),
                        str(gen_dir / "ott2-head.c"), "-lm", "-o", str(exe)], check=True)  # fmt: skip
        out = []
        for pair in pairs:
            kb, vb = pair.split("/")
            for nr in rows:
                r = subprocess.run([str(exe), kb, vb, str(D), str(nr), str(groups), "300" if nr < 16 else "30"],
                                   capture_output=True, text=True, check=True)  # fmt: skip
                out.append(json.loads(r.stdout))
        return out


def _perf_shares(data: Path, syms: Symbols) -> tuple[dict[str, float], dict[str, float]]:
    """Share of samples per category and per function, from `perf report` by (dso, symbol)."""
    r = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,sym",
                        "--percent-limit", "0"], capture_output=True, text=True, check=True)  # fmt: skip
    cats: dict[str, float] = {}
    funcs: dict[str, float] = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.kHu]\]\s+(.*)$", line)
        if not m:
            continue
        pct, dso, sym = float(m.group(1)) / 100, m.group(2), m.group(3).strip()
        if sym.startswith("0x") and "ggml-cpu" in dso:
            sym = syms.name(int(sym, 16))
        key = f"{dso}:{sym}" if sym.startswith("0x") else sym
        cat = next((c for c, rx in CATEGORIES if re.search(rx, key)), "other")
        cats[cat] = cats.get(cat, 0.0) + pct
        funcs[key[:90]] = funcs.get(key[:90], 0.0) + pct
    return cats, funcs


def _state_bytes(info: dict[str, object], d: int, h_kv: int, kbits: int, vbits: int) -> int:
    """Bytes of ott state one decoded token reads: every sealed group's codes, scales and mins, the fp16 tail,
    and the pooled tokens' exact K and V, over the ott layers and KV heads."""
    layers = int(info["ott_layers"])  # type: ignore[call-overload]
    sealed, pos = int(info["sealed"]), int(info["positions"])  # type: ignore[call-overload]
    per_group = d * (4 + G * kbits // 8) + G * (d // GV) * (4 + GV * vbits // 8)
    quant = layers * h_kv * (sealed // G) * per_group
    tail = layers * h_kv * (pos - sealed) * d * 2 * 2
    pools = (int(info["outlier_slots"]) + int(info["aux_slots"])) * d * 2 * 2  # type: ignore[call-overload]
    return quant + tail + pools


def profile_one(path: Path, kv_type: str, depth: int, threads: int, n_tok: int, out_dir: Path, syms: Symbols) -> Row:
    from ott_gguf import Llama
    from ott_gguf.tiers import KV_TIERS

    mi = model_info(path)
    rng = random.Random(depth)
    # "f16:fa0": f16 under llama.cpp's plain attention (mul_mat + soft_max), as llama-bench -fa 0; a tier name
    # (compact, quality): the tier's pair, parameters and this model's calibrated widths
    base, _, mode = kv_type.partition(":")
    if mode not in ("", "fa0") or (mode and base != "f16"):
        raise SystemExit(f"unknown type {kv_type!r}: a cache type, a tier, or f16:fa0")
    tier = base in KV_TIERS
    with captured_log():
        # swa_full=False as llama-bench sets it: window layers hold their window only, as the ott caches' do (the
        # C API's default, true, gives f16 a full-size window cache and an unlike comparison on Gemma 3)
        kind: dict[str, object] = {"kv_tier": base} if tier else {"kv_type": base}
        llm = Llama(str(path), n_ctx=depth + n_tok + 256, n_batch=512, n_ubatch=512, n_threads=threads,
                    n_threads_batch=threads, swa_full=False, flash_attn=mode != "fa0", verbose=False,
                    **kind)  # type: ignore[arg-type]  # fmt: skip
    n_vocab = llm.n_vocab()
    if depth:
        llm.eval([rng.randrange(100, n_vocab) for _ in range(depth)])
    llm.eval([rng.randrange(100, n_vocab)])  # the first decode allocates its graph: not timed
    data = out_dir / f"perf-{kv_type.replace('/', '-').replace(':', '-')}-{depth}.data"
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-p", str(os.getpid()),
                             "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(1.0)  # perf attaches
    t0 = time.perf_counter()
    for _ in range(n_tok):
        llm.eval([rng.randrange(100, n_vocab)])
    wall = (time.perf_counter() - t0) / n_tok
    perf.send_signal(signal.SIGINT)
    perf.wait()
    state = 0
    if tier:
        pass  # widths per layer: the state counted below assumes one width pair; none given (GB/s "-")
    elif base not in ("f16", "q8_0", "q4_0"):
        k, v = resolve_kv_types(kv_type)
        kb, vb = (int(re.sub(r"\D", "", x)) for x in (k, v))
        state = _state_bytes(llm.kv_cache_info(), mi.head_dim_k, mi.n_head_kv or 0, kb, vb)
    else:
        # f16: the dense K and V of every layer at this depth
        state = mi.n_layer * (mi.n_head_kv or 0) * (depth + n_tok // 2) * (mi.head_dim_k + mi.head_dim_v) * 2
    llm.close()
    # CPU time per token: samples / rate, attributed by share; the sampled window includes perf's 1 s start
    shares, funcs = _perf_shares(data, syms)
    r = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "comm"], capture_output=True,
                       text=True, check=True)  # fmt: skip
    m = re.search(r"# Samples: (\d+)(K?)", r.stdout) or re.search(r"Samples: (\d+)(K?)", r.stderr)
    n_samples = int(m.group(1)) * (1000 if m.group(2) else 1) if m else 0
    cpu_total_ms = n_samples / 4000 * 1e3
    # attribute samples in the decode window only: the sleep before it is idle time (no samples on an idle
    # process), so the total is the decode's CPU time
    cpu = {c: round(s * cpu_total_ms / n_tok, 3) for c, s in sorted(shares.items(), key=lambda x: -x[1])}
    top = {f: round(s * cpu_total_ms / n_tok, 3) for f, s in sorted(funcs.items(), key=lambda x: -x[1])[:12]}
    data.unlink(missing_ok=True)
    return Row(kv_type, depth, threads, n_tok, round(wall * 1e3, 3), cpu, top, state)


def markdown(res: dict[str, object]) -> str:
    rows = [Row(**r) for r in res["rows"]]  # type: ignore[union-attr]
    bw = res["bandwidth"]
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = [f"Measured {res['started']} on {res['machine']}, model {res['model']} "
             f"(`python -m study.decode_profile {res['args']}`).", ""]  # fmt: skip
    lines += ["### Streaming-read bandwidth (study/bandwidth_probe.c, median of 9 passes)", "",
              "| buffer | threads | fp16 -> fp32 + sum GB/s, median (best) | plain u8 read GB/s, median (best) |",
              "|---|---|---|---|"]  # fmt: skip
    for s in sorted({b["bytes"] for b in bw}):  # type: ignore[union-attr, index]
        for t in sorted({b["threads"] for b in bw}):  # type: ignore[union-attr, index]
            f = next(b for b in bw if b["bytes"] == s and b["threads"] == t and b["mode"] == "f16")  # type: ignore
            u = next(b for b in bw if b["bytes"] == s and b["threads"] == t and b["mode"] == "u8")  # type: ignore
            lines.append(f"| {s / 1e6:.0f} MB | {t} | {f['gbps_median']} ({f['gbps_best']}) | "
                         f"{u['gbps_median']} ({u['gbps_best']}) |")  # fmt: skip
    if res.get("micro"):
        lines += ["", "### The sealed-group kernel alone (study/attn_microbench.c, one thread, D = 64, 32 groups)", "",
                  "| K/V bits | query rows | ns per group | state bytes per group | GB/s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for m in res["micro"]:  # type: ignore[union-attr]
            lines.append(f"| {m['kbits']}/{m['vbits']} | {m['rows']} | {m['ns_per_group']:.0f} | "
                         f"{m['bytes_per_group']} | {m['GBps']:.2f} |")  # fmt: skip
    lines += ["", "### Per decoded token: wall ms, CPU ms per category (summed over threads), state read", "",
              "| K/V | depth | wall ms | " + " | ".join(cats) + " | state MB | attention GB/s |",
              "|---|---|---|" + "---|" * (len(cats) + 2)]  # fmt: skip
    for r in rows:
        cells = [f"{r.cpu_ms.get(c, 0.0):.2f}" for c in cats]
        dense = r.kv_type.partition(":")[0] in ("f16", "q8_0", "q4_0")
        what = "f16 attention" if dense else "ott attention partial"
        state = f"{r.state_bytes / 1e6:.1f} | {r.gbps(what):.1f}" if r.state_bytes else "- | -"
        lines.append(f"| {r.kv_type} | {r.depth} | {r.wall_ms:.2f} | " + " | ".join(cells) + f" | {state} |")
    lines += ["", "### Largest functions (CPU ms per decoded token, summed over threads)", ""]
    for r in rows:
        tops = ", ".join(f"{f} {ms:.2f}" for f, ms in r.top.items())
        lines.append(f"- {r.kv_type} @ {r.depth}: {tops}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.decode_profile", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--types", default="ott2,f16")
    ap.add_argument("--depths", default="0,4096,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--symbols",
        type=Path,
        default=None,
        help="an unstripped libggml-cpu of the same build (default: the newest under build/*/bin)",
    )
    ap.add_argument(
        "--gen-dir",
        type=Path,
        default=None,
        help="the generated ott2-head.c to microbenchmark (default: the newest build/*/ott-gen/ggml)",
    )
    ap.add_argument("--micro-only", action="store_true", help="only the bandwidth probe and the group microbenchmark")
    ap.add_argument("--out", type=Path, required=True, help="markdown table; the raw numbers go next to it as .json")
    a = ap.parse_args(argv)
    if shutil.which("perf") is None:
        print("perf not found: install linux-perf", file=sys.stderr)
        return 2
    path = models.fetch(a.model, quiet=True)
    # the unstripped libraries and generated sources of this install's build directory (outside the clone since
    # 2026-11-29), else of an in-tree build (OTT_BUILD_DIR=build)
    from ott_gguf import build_info

    trees = [Path(str(build_info().get("build_dir", ""))), *HERE.parent.glob("build/*")]
    found = sorted((p for t in trees for p in t.glob("bin/libggml-cpu.so.*.*")), key=lambda p: p.stat().st_mtime)
    syms = Symbols(a.symbols or (found[-1] if found else None))
    res: dict[str, object] = {
        "machine": f"{platform.machine()}, {a.threads} threads",
        "started": time.ctime(),
        "model": a.model,
        "args": " ".join(argv if argv is not None else sys.argv[1:]),
        "bandwidth": bandwidth(a.threads),
        "rows": [],
    }
    gens = sorted((p for t in trees for p in t.glob("ott-gen/ggml/ott2-head.c")), key=lambda p: p.stat().st_mtime)
    gen_dir = a.gen_dir or (gens[-1].parent if gens else None)
    res["micro"] = microbench(gen_dir) if gen_dir is not None else []
    with tempfile.TemporaryDirectory() as tmp:
        for d in () if a.micro_only else (int(x) for x in a.depths.split(",")):
            for t in a.types.split(","):
                row = profile_one(path, t, d, a.threads, a.tokens, Path(tmp), syms)
                res["rows"].append(asdict(row))  # type: ignore[union-attr]
                print(f"{t} @ {d}: {row.wall_ms:.2f} ms/token {row.cpu_ms}", file=sys.stderr, flush=True)
                a.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    a.out.write_text(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
