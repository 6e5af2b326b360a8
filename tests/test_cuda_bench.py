"""The standalone CUDA kernel harness (native/tests/ott-bench.cu, docs/cuda-harness.md) builds without a GPU: ptxas
reports every kernel it times, its plan has the cache's sizes and grids, and its state and checks pass through the
kernels' CPU emulation. Nothing runs on a GPU here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, require_tool

# the architectures this test builds for (one: CI has 2 cores); the harness's own build takes sm_75..sm_90
BENCH_ARCHS = ["90"]
# the head configs ott-bench.cu includes (its cfgs: ott2, ott2u, the quality tier) and the ops it times
BENCH_TAGS = ["k2mv2g128x64", "k2v2g128x64", "k3mv2sg128x64"]
# (the attention partials: attn_part_vec<CPL, RP, NW>, channels per lane, rows per pass and warps picked by D: 16
# warps at D 64, 8 at D 128; the merge and the seal in one launch, attn_merge_seal)
KERNELS = ["attn_part_vec<2,4,16>", "attn_part_vec<4,4,8>", "attn_part_vec<8,2,4>", "attn_part_vec<16,1,4>",
           "attn_merge", "seal", "attn_merge_seal"]  # fmt: skip
# ott-bench --sweep: ott2's unit also compiles these instances of the partials (OTT_SWEEP_<tag>, the template's SWEEP
# beside the launcher's <2,4,16> and <4,4,8>)
SWEEP_TAG = "k2mv2g128x64"
SWEEP_EXTRA = [
    f"attn_part_vec<{i}>" for i in ("2,4,8", "2,4,4", "2,8,8", "2,2,16", "4,4,4", "4,2,8", "4,2,4", "4,1,16")
]

# (the fused kernel's second parameter, int64_t n_merge, mangles as a trailing l)
ENTRY = re.compile(r"Compiling entry function '_Z\d+(\w+?)(?:I((?:Li\d+E)+)Ev)?\d+ott_cu_argsl?' for '(sm_\d+)'")
STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def ptxas_resources(report: str) -> dict[tuple[str, str], dict[str, int]]:
    """(kernel, sm_XY) -> registers, stack, spill stores and loads, static shared memory, from `nvcc -Xptxas -v`."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    key: tuple[str, str] | None = None
    stack = (0, 0, 0)
    for line in report.splitlines():
        if m := ENTRY.search(line):
            targs = re.findall(r"Li(\d+)E", m.group(2) or "")  # template arguments
            name = m.group(1) + (f"<{','.join(targs)}>" if targs else "")
            key, stack = (name, m.group(3)), (0, 0, 0)
        elif (m := STACK.search(line)) and key:
            stack = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := USED.search(line)) and key:
            out[key] = {"regs": int(m.group(1)), "stack": stack[0], "spill_st": stack[1], "spill_ld": stack[2],
                        "smem": int(m.group(2) or 0)}  # fmt: skip
            key = None
    return out


def test_ott_bench_builds_and_plans(tmp_path: Path) -> None:
    require_tool("nvcc", hint="the CUDA toolkit")
    out = tmp_path / "cuda-bench"
    res = subprocess.run(
        ["bash", str(ROOT / "native" / "tests" / "build-ott-bench.sh"), str(out), " ".join(BENCH_ARCHS)],
        capture_output=True,
        text=True,
        # nvcc through the tests' compiler cache (tool_cache.py)
        env={**os.environ, "PYTHON": sys.executable, "NVCC": f"{sys.executable} {ROOT / 'tests/tool_cache.py'} nvcc"},
    )
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    exe = out / "ott-bench"
    # it travels to a GPU machine with the repository (the device tool carries 64 MiB per call, the bundle included)
    assert exe.stat().st_size < 8 << 20

    found = ptxas_resources((out / "ott-bench.ptxas.txt").read_text())
    for arch in BENCH_ARCHS:
        for tag in BENCH_TAGS:
            for k in KERNELS + (SWEEP_EXTRA if tag == SWEEP_TAG else []):
                r = found.get((f"ott2_cuda_{tag}_{k}", f"sm_{arch}"))
                assert r is not None and r["regs"] > 0, (tag, k, arch, sorted(found))
                # no spills at the datacenter architecture either (test_cuda_compile checks the consumer ones)
                assert r["spill_st"] == r["spill_ld"] == 0, (tag, k, arch, r)
    assert len(found) == len(BENCH_ARCHS) * (len(BENCH_TAGS) * len(KERNELS) + len(SWEEP_EXTRA))

    # the plan without a GPU: the cache's slices (llama.cpp pads -d 4096 -n 16 to 4352 positions: NG 33, NS 9;
    # 32768 to 33024: NG 257, NS 32) and the launchers' grids (SmolLM2: H 3 x (NS + gq 3) partial blocks: a sealed
    # slice's block serves the KV head's 3 query heads, the fp16 tail has one per query head)
    res = subprocess.run([str(exe), "--plan", "smol", "all", "ott2"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert "n_ctx 4352, NG 33, NS 9 (SG 4), sealed 31 groups, ring 128 tokens" in res.stdout
    assert "n_ctx 33024, NG 257, NS 32 (SG 9), sealed 255 groups, ring 128 tokens" in res.stdout
    grids = re.findall(r"^ott2 +smol +(\d+) (attn_part|attn_merge|seal|merge_seal) +(\d+) ", res.stdout, re.M)
    assert grids == [("4096", "attn_part", "36"), ("4096", "attn_merge", "9"), ("4096", "seal", "3"),
                     ("4096", "merge_seal", "12"), ("32768", "attn_part", "105"), ("32768", "attn_merge", "9"),
                     ("32768", "seal", "3"), ("32768", "merge_seal", "12")]  # fmt: skip
    for args in (["gpt2"], ["--plan", "--sweep"], ["--sweep", "all", "all", "ott2u"], ["--fast"]):
        bad = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "usage" in bad.stderr, args

    # the random state and the checks of a GPU run (finite attention output, the fused launch's the same bits, a
    # sealing event with a competition by the seal and by the fused launch, the same group bytes), through the
    # kernels' CPU emulation, at depth 4096 (both shapes, the three configs)
    res = subprocess.run([str(exe), "--emu", "all", "4096"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    done = "emulated: attention output finite, the fused launch's the same; sealing event with a competition"
    assert res.stdout.count(done) == 6

    # the sweep's instances and slice counts through the emulation at both shapes, depth 4096 (the decode step and
    # an 8-token ubatch): each gives the launcher's output within fp32 rounding (the harness fails otherwise), and
    # rows per pass alone change no bit (a row's arithmetic does not depend on the rows beside it)
    for shape, launcher, same_warps, grid9 in (
        ("smol", "<2,4,16>*", "<2,2,16>", 36),
        ("llama8b", "<4,4,8>*", "<4,2,8>", 104),
    ):
        res = subprocess.run([str(exe), "--emu", "--sweep", shape, "4096"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        # the prefill ubatch as the cache cuts one: from the seal boundary R + 31G = 4000, 31 groups sealed before and
        # after it, the R ring tokens before it, the context sized for depth 4096
        assert (
            f"# ott2 {shape} depth 4000, a ubatch of 8 tokens: n_ctx 4352, NG 33, NS 9 (SG 4), sealed 31 groups "
            "(31 after), ring 32 tokens"
        ) in res.stdout, res.stdout
        rows = re.findall(rf"^sweep {shape} +4096 +(\d+) +(\d+) (<[\d,]+>\*?) +(\d+) +- +- +(\S+)$", res.stdout, re.M)
        # 5 instances of the shape's D x 3 slice counts (9, 4, 18) x 2 ubatches
        assert len(rows) == 30, res.stdout
        err = {(int(n), int(ns), inst): float(e) for n, ns, inst, _, e in rows}
        assert err[(1, 9, launcher)] == err[(8, 9, launcher)] == 0.0  # the launcher against itself
        assert err[(1, 9, same_warps)] == err[(8, 9, same_warps)] == 0.0  # other rows per pass, the same warps
        assert 0.0 < max(err.values()) <= 1e-4  # other warps or slices: another summation order
        grids = {(int(n), int(ns)): int(g) for n, ns, _, g, _ in rows}
        assert grids[(1, 9)] == grid9  # H x (NS + gq)
