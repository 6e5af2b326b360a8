"""The generated CUDA code compiles with nvcc for the consumer architectures (no GPU needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import tool_cache
from cuda_ops import nvcc_flags

from helpers import ROOT, TEST_ALL, require_tool, rotate

# the consumer architectures: the small check unit compiles for each; the per-head ops library and the ggml-cuda
# units (minutes of nvcc each on 2 cores) for one of them per run, in rotation (make test-all: each)
ARCHS = ["sm_75", "sm_86", "sm_89"]
ARCH_TURN = rotate(ARCHS)
# K/V widths (K/V:G:Gv) of the per-config test library: every width once on each side, all in per-side pairs,
# 3-bit keys with widths per channel (k_mix, "3m"), and symmetric 2-bit V blocks (v_sym, "2s") with mixed keys and
# with Gv 32 (a rotation unit of two blocks), and 2-bit keys with widths per channel (k_mix 2, "2m": 1-bit blocks)
TEST_HEADS = ["3/2:128:64", "4/3:128:64", "2/4:128:64", "3m/2:128:64", "3m/2s:128:64", "2/2s:64:32", "2m/2:128:64"]
# the block configs of the stand-alone check: the cuda target's defaults, and the symmetric formats of the v_sym
# heads (bits "2s", group, clip: rotated units clipped, the unrotated fallback full range)
CONFIGS = ["2:32", "2:64", "2:128", "3:64", "4:64", "2s:32:41", "2s:32", "2s:64:37", "2s:64"]


def run_all(cmds: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """The commands at once, one per core: nvcc runs on one core, and these tests compile independent units. Through
    the tests' compiler cache (tool_cache.py: a second run on this machine reuses the first one's results)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(tool_cache.run, cmds))


def config_tag(spec: str) -> str:
    """gen/generate.py's tag of a bits[s]:group[:clip] config spec."""
    b, g, *c = spec.split(":")
    return f"b{b}g{g}" + (f"c{c[0]}" if c and c[0] != "64" else "")


def spec_tag(spec: str) -> str:
    """gen/generate.py's tag of a K/V:G:Gv (or B:G:Gv) head spec (K as "3m": mixed widths, V as "2s": symmetric)."""
    b, g, gv = spec.split(":")
    kb, _, vb = b.partition("/")
    return f"k{kb}v{vb or kb.removesuffix('m')}g{g}x{gv}"


@pytest.fixture(scope="module")
def cuda_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cuda")
    subprocess.run([sys.executable, str(ROOT / "gen" / "generate.py"), "cuda", "--out", str(out), "--configs",
                    ",".join(CONFIGS)], check=True)  # fmt: skip
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_generated_cuda_compiles(cuda_sources: Path, arch: str, tmp_path: Path) -> None:
    require_tool("nvcc", hint="the CUDA toolkit")
    obj = tmp_path / f"ott-{arch}.o"
    res = tool_cache.run(
        [
            "nvcc",
            "-c",
            "-O2",
            "-std=c++17",
            f"-arch={arch}",
            "-Werror",
            "all-warnings",
            str(cuda_sources / "ott-cuda-check.cu"),
            "-o",
            str(obj),
        ],
    )
    assert res.returncode == 0, res.stderr
    assert obj.stat().st_size > 0
    # every config's kernels made it into the object
    syms = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    for tag in map(config_tag, CONFIGS):
        assert f"ott_cuda_dequantize_{tag}" in syms and f"ott_cuda_quantize_{tag}" in syms


class HeadUnit(NamedTuple):
    obj: Path  # the object file (host code and the device code's SASS and PTX)
    ptx: str  # its PTX (nvcc -keep's), with the CUDA rendering's markers
    ptxas: str  # ptxas -v's report: registers, spills and shared memory of each kernel


@pytest.fixture(scope="module")
def head_units(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, HeadUnit]]:
    """The per-head CUDA units (gen/templates/ott_cuda_ops.j2 with the test program's entry points, one file per
    head config) compiled for an architecture: one nvcc run per head config serves the library check below and the
    structure checks (its PTX kept, ptxas -v's report), at once, one per core; each architecture once per module."""
    require_tool("nvcc", hint="the CUDA toolkit")
    src = tmp_path_factory.mktemp("cuda-ops")
    subprocess.run([sys.executable, str(ROOT / "gen" / "generate.py"), "cuda", "--out", str(src),
                    "--cuda-heads", ",".join(TEST_HEADS)], check=True)  # fmt: skip
    done: dict[str, dict[str, HeadUnit]] = {}

    def compile_for(arch: str) -> dict[str, HeadUnit]:
        if arch in done:
            return done[arch]
        # the objects and nvcc's intermediates outside src: the tool cache hashes the sources under `-I src` into
        # each key, and the units compile two at a time (inside src, one unit's *.cudafe1.cpp changed the next key)
        out = tmp_path_factory.mktemp(f"keep-{arch}")
        tags = {h: spec_tag(h) for h in TEST_HEADS}
        objs = {h: out / f"ott2-cuda-{t}.o" for h, t in tags.items()}
        ptx = {h: out / f"ott2-cuda-{t}.ptx" for h, t in tags.items()}  # -keep's name for it
        cmds = [["nvcc", "-c", "-O3", "-std=c++17", *nvcc_flags(), f"-arch={arch}", "-DOTT_CU_TEST_API", "-Xcompiler",
                 "-fPIC", "-Werror", "all-warnings", "-Xptxas", "-v", "-keep", "-keep-dir", str(out), "-I", str(src),
                 str(src / f"ott2-cuda-{t}.cu"), "-o", str(objs[h])] for h, t in tags.items()]  # fmt: skip
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            results = list(pool.map(lambda c, h: tool_cache.run(c, keep=[ptx[h]]), cmds, TEST_HEADS))
        for res in results:
            assert res.returncode == 0, res.stderr[-4000:]
        done[arch] = {h: HeadUnit(objs[h], ptx[h].read_text(), r.stdout + r.stderr)
                      for h, r in zip(TEST_HEADS, results, strict=True)}  # fmt: skip
        return done[arch]

    return compile_for


@pytest.mark.parametrize("arch", ARCH_TURN)
def test_cuda_ops_and_test_program_compile(arch: str, head_units: Callable[[str], dict[str, HeadUnit]],
                                           tmp_path: Path) -> None:  # fmt: skip
    """The cache's CUDA ops (seal, attention partials, merge; gen/templates/ott_cuda_ops.j2) with the test
    program's entry points (what test_cuda_emu.py runs on a GPU), as a shared library, for each architecture:
    one file per head config, configs that between them have every K width and every V width, k_mix and v_sym."""
    units = head_units(arch)
    lib = tmp_path / "libott_cuda_test.so"
    res = tool_cache.run(["nvcc", "-shared", f"-arch={arch}", *(str(u.obj) for u in units.values()), "-o", str(lib)])
    assert res.returncode == 0, res.stderr[-4000:]
    syms = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True, check=True).stdout
    for tag in map(spec_tag, TEST_HEADS):
        for fn in ("attn", "seal"):
            assert f"ott2_cuda_{tag}_{fn}" in syms and f"ott2_cudatest_{tag}_{fn}" in syms


def head_sections(unit: str) -> tuple[str, dict[str, str]]:
    """(header line, text of each head config's section by spec) of a generated unit of several head configs
    (render_cuda_ops: sections that each open with "// ---- head config" and guard the shared prelude)."""
    m = re.search(r"heads=([0-9ms/:]+(?:,[0-9ms/:]+)*)", unit.splitlines()[0])
    assert m, "no head configs in the header line"
    specs = m.group(1).split(",")
    header, *parts = re.split(r"^(?=// ---- head config )", unit, flags=re.M)
    assert len(parts) == len(specs), (len(parts), specs)
    return header, dict(zip(specs, parts, strict=True))


# head configs of the build's unit compiled per run besides TEST_HEADS (those compile every run on their own, the
# same template's text): the others take turns (make test-all: the build's whole unit, to the SASS)
OPS_TURN_HEADS = 5


@pytest.mark.parametrize("arch", ARCH_TURN)
def test_ggml_cuda_ott_ops_compile(arch: str, tmp_path: Path) -> None:
    """The ggml-cuda side of the ott ops as the CUDA build compiles it: the glue (native/ggml/ggml-cuda-ott.cu,
    against the patched ggml-cuda headers), the build's generated kernels, and the patched ggml-cuda.cu whose
    dispatch and supports_op call the glue. The generated kernels (ott2-cuda-<tag>.cu: every K/V width pair of the
    build, 20 head configs, a unit each; 195 s of nvcc's front end alone on this machine for all) for the first
    architecture of the run: OPS_TURN_HEADS of the head configs not among TEST_HEADS, in turn, in one unit."""
    require_tool("nvcc", hint="the CUDA toolkit")
    from ott_gguf import build_info

    src = Path(str(build_info()["llama_src"]))
    gen = src.parent / "ott-gen" / "ggml"
    inc = ["-I", str(src / "ggml" / "src"), "-I", str(src / "ggml" / "include"), "-I", str(ROOT / "native" / "ggml"),
           "-I", str(gen)]  # fmt: skip
    syms = ""
    header, sections = "", {}
    for ops in sorted(gen.glob("ott2-cuda-*.cu")):  # the build's units, one per head config
        header, one = head_sections(ops.read_text())
        assert len(one) == 1 and ops.name == f"ott2-cuda-{spec_tag(next(iter(one)))}.cu", ops.name
        sections |= one
    # ott2..4 K with ott2..4 V, 3- and 2-bit keys of mixed widths (k_mix) with each V, and every K (k_mix too) with
    # symmetric 2-bit V (v_sym)
    tags = [spec_tag(h) for h in sections]
    assert len(tags) == 20 and sum("v2s" in t for t in tags) == 5 and sum("k2m" in t for t in tags) == 4
    assert set(TEST_HEADS) - set(sections) <= {"2/2s:64:32"}, "TEST_HEADS are the build's configs (and Gv 32)"
    with_ops = arch == ARCH_TURN[0]
    turn = list(sections) if TEST_ALL else rotate([h for h in sections if h not in TEST_HEADS], OPS_TURN_HEADS)
    unit = tmp_path / "ott2-cuda-ops.cu"  # the turn's head configs, the build's units in one
    unit.write_text(header + "".join(sections[h] for h in turn))
    units = [("ops", unit)] if with_ops else []  # the longest first
    units += [
        ("glue", ROOT / "native" / "ggml" / "ggml-cuda-ott.cu"),
        # as a tuning build compiles it (CMake OTT_GGUF_CUDA_SWEEP: ott2's default config has other instances)
        ("glue-tuning", ROOT / "native" / "ggml" / "ggml-cuda-ott.cu"),
        ("dispatch", src / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu"),  # patch 0005's hooks
    ]
    ops_syms = ""
    # the kernels to PTX only (front end, host code and device code, without ptxas: half the time); ptxas runs on
    # the per-head units (test_cuda_ops_and_test_program_compile, whose report the structure checks read) and on
    # the whole unit under make test-all
    ptx_only = f"-gencode=arch=compute_{arch[3:]},code=compute_{arch[3:]}"
    cmds = [["nvcc", "-c", "-O3", "-std=c++17", *nvcc_flags(),
             ptx_only if name == "ops" and not TEST_ALL else f"-arch={arch}", "-DGGML_USE_CUDA",
             *([f"-DOTT_SWEEP_{SWEEP_TAG}"] if name == "glue-tuning" else []), *inc, str(cu),
             "-o", str(tmp_path / f"{name}.o")] for name, cu in units]  # fmt: skip
    tuning_syms = ""
    for (name, _), res in zip(units, run_all(cmds), strict=True):
        assert res.returncode == 0, res.stderr[-4000:]
        out = subprocess.run(["nm", "-C", str(tmp_path / f"{name}.o")], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
        if name == "glue-tuning":
            tuning_syms = out
            continue
        syms += out
        if name == "ops":
            ops_syms = out
    # the tuning build's glue reaches ott2's other instances (OTT_CUDA_PART), the default build's nothing of them
    assert f"U ott2_cuda_{SWEEP_TAG}_attn_part_variant" in tuning_syms
    assert "attn_part_variant" not in syms
    for fn in (
        "ggml_cuda_op_ott_attn_part",
        "ggml_cuda_op_ott_attn",
        "ggml_cuda_op_ott_seal",
        "ggml_cuda_ott_supports_op",
    ):
        assert fn in syms
    # the glue reaches the kernels of every head config the build renders (through ott2_cuda_find)
    for h, tag in zip(sections, tags, strict=True):
        # attn_merge_seal: the merge and the seal in one launch, which the glue's merge runs at decode
        for fn in ("attn_part", "attn_merge", "seal", "attn_merge_seal"):
            assert f"U ott2_cuda_{tag}_{fn}" in syms  # referenced by the glue
            if with_ops and h in turn:
                assert f" T ott2_cuda_{tag}_{fn}" in ops_syms  # and defined by the generated unit
    assert syms.count("U ggml_cuda_op_ott_attn_part") == 1  # referenced by the dispatch


# the head config whose unit a tuning build (CMake OTT_GGUF_CUDA_SWEEP) compiles with the partials' other instances
SWEEP_TAG = re.search(r"^set\(OTT_SWEEP_TAG (\w+)\)", (ROOT / "CMakeLists.txt").read_text(), re.M)[1]


# the attention partials' kernel structure (gen/templates/ott_cuda_ops.j2, attn_part_vec_kernel), for the turn's
# first architecture: the per-head units' own compile (its PTX and ptxas -v's report), no second front end
STRUCT_ARCH = ARCH_TURN[0]
ENTRY = re.compile(r"^\.(?:visible |weak )?\.?entry\s+(\w+)", re.M)
BARRIER = re.compile(r"\b(?:bar|barrier)\.(?:sync|arrive|red)\b")  # block barriers; bar.warp.sync is __syncwarp


def ptx_entries(ptx: str) -> dict[str, str]:
    """The PTX text of each kernel entry, by (mangled) name."""
    marks = list(ENTRY.finditer(ptx))
    return {m.group(1): ptx[m.start() : (marks[i + 1].start() if i + 1 < len(marks) else len(ptx))]
            for i, m in enumerate(marks)}  # fmt: skip


def group_loop_barriers(body: str) -> tuple[int, int]:
    """(group loops, block barriers inside them) of one kernel's PTX: the lines between the CUDA rendering's
    `// ott: group loop begin` and `end` markers."""
    loops = bars = 0
    inside = False
    for line in body.splitlines():
        if "ott: group loop begin" in line:
            loops += 1
            inside = True
        elif "ott: group loop end" in line:
            inside = False
        elif inside and BARRIER.search(line):
            bars += 1
    return loops, bars


def ptxas_spills(log: str) -> dict[str, tuple[int, int]]:
    """(spill store bytes, spill load bytes) of each function in ptxas -v's report."""
    out: dict[str, tuple[int, int]] = {}
    name = None
    for line in log.splitlines():
        if m := re.search(r"Function properties for (\w+)", line):
            name = m.group(1)
        elif name and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            out[name] = (int(m.group(1)), int(m.group(2)))
            name = None
    return out


def ptxas_resources(log: str) -> dict[str, tuple[int, int]]:
    """(registers, static shared memory bytes) of each kernel entry in ptxas -v's report."""
    out: dict[str, tuple[int, int]] = {}
    name = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif name and (m := re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$", line)):
            out[name] = (int(m.group(1)), int(m.group(2) or 0))
            name = None
    return out


@pytest.fixture(params=TEST_HEADS)
def ops_ptx(request: pytest.FixtureRequest, head_units: Callable[[str], dict[str, HeadUnit]]) -> tuple[str, str, str]:
    """(head, PTX, ptxas -v's report) of one head config's CUDA ops, from the per-head units' compile."""
    u = head_units(STRUCT_ARCH)[request.param]
    return request.param, u.ptx, u.ptxas


def test_attention_kernels_do_not_spill(ops_ptx: tuple[str, str, str]) -> None:
    """ptxas keeps every attention partials kernel (each <channels per lane, rows per pass, warps> instance, one
    per head dimension range) and the merge in registers: a spill in the item loop is a local-memory round trip
    per token. The 16-warp instance (D 64) has 128 registers at most (512 threads per block)."""
    head, _, log = ops_ptx
    spills = {n: v for n, v in ptxas_spills(log).items() if "attn_part" in n or "attn_merge11" in n}
    assert sum("attn_part" in n for n in spills) == 4 and sum("attn_merge" in n for n in spills) == 1, (head, spills)
    assert all(v == (0, 0) for v in spills.values()), (head, spills)


def test_seal_does_not_spill(ops_ptx: tuple[str, str, str]) -> None:
    """ptxas keeps the seal's working set in registers and shared memory (its sealing event ranks the pool's
    candidates and moves rows through a shared stage; it spilled 124 B before that rewrite), alone and in the
    kernel that runs the merge's and the seal's blocks in one launch (what ggml-cuda runs at decode). Their
    registers and shared memory are printed: the fused kernel's are the merge blocks' too."""
    head, _, log = ops_ptx
    spills = {n: v for n, v in ptxas_spills(log).items() if "_seal" in n}
    assert sorted(re.sub(r"^_Z\d+ott2_cuda_\w+?_(attn_merge_seal|seal)\w*$", r"\1", n) for n in spills) == [
        "attn_merge_seal",
        "seal",
    ], (head, spills)
    assert all(v == (0, 0) for v in spills.values()), (head, spills)
    res = ptxas_resources(log)
    for n in [*spills, *(n for n in res if "attn_merge11" in n)]:
        print(f"{head} {STRUCT_ARCH} {n}: {res[n][0]} registers, {res[n][1]} B shared memory")


def test_attention_group_loop_has_no_block_barrier(ops_ptx: tuple[str, str, str]) -> None:
    """The item loops of the attention partials run per warp, the sealed groups' and the fp16 tail's: no
    __syncthreads between their markers in the PTX (the block's barriers come before and after a loop, never per
    item)."""
    head, ptx, _ = ops_ptx
    parts = {n: b for n, b in ptx_entries(ptx).items() if "attn_part" in n}
    assert len(parts) == 4, (head, list(parts))  # one kernel per <CPL, RP, NW> instance (per range of D)
    for name, body in parts.items():
        loops, bars = group_loop_barriers(body)
        assert loops >= 2, f"{head} {name}: {loops} item loop markers (want the sealed groups' and the tail's)"
        assert bars == 0, f"{head} {name}: {bars} block barriers inside the group loop"


# PTX of floating-point code that is not IEEE: flush-to-zero and approximate division, reciprocal, square root
NOT_IEEE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z0-9]+(?:\.[a-z0-9]+)*\.(?:ftz|approx)(?:\.[a-z0-9]+)*)", re.M)


def not_ieee(body: str) -> set[str]:
    """The instructions of a PTX function body that are not IEEE, less expf's ex2.approx (attention only)."""
    return {op for op in NOT_IEEE.findall(body) if not op.startswith("ex2.approx")}


def test_stored_state_is_ieee_under_the_builds_flags(ops_ptx: tuple[str, str, str], tmp_path: Path) -> None:
    """ggml-cuda compiles its units with -use_fast_math; the ott units add OTT_CUDA_FLAGS (CMakeLists.txt), and the
    per-head units here compile with both (nvcc_flags, as the GPU test library and ott-bench do). Under them no
    ott kernel flushes subnormals or divides approximately: the seal's codes, scales and pools stay the CPU's bit
    for bit, and the partials' int8 query (127/amax) and the merge's 1/L round as the emulation's. The control:
    the same unit under -use_fast_math alone has such instructions in the seal, so the check sees them."""
    head, ptx, _ = ops_ptx
    entries = ptx_entries(ptx)
    kernels = {n: b for n, b in entries.items() if re.search(r"_(seal|attn_part|attn_merge)", n)}
    assert len(kernels) == 7, (head, list(kernels))  # seal, merge, merge+seal, 4 partials instances
    bad = {n: not_ieee(b) for n, b in kernels.items() if not_ieee(b)}
    assert not bad, (head, bad)
    if head != rotate(TEST_HEADS)[0]:
        return
    src = tmp_path / "src"
    subprocess.run([sys.executable, str(ROOT / "gen" / "generate.py"), "cuda", "--out", str(src), "--cuda-heads",
                    head], check=True)  # fmt: skip
    out = tmp_path / "fast.ptx"
    res = tool_cache.run(["nvcc", "-ptx", "-O3", "-std=c++17", "-use_fast_math", f"-arch={STRUCT_ARCH}", "-I",
                          str(src), str(src / f"ott2-cuda-{spec_tag(head)}.cu"), "-o", str(out)])  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    fast = {n: not_ieee(b) for n, b in ptx_entries(out.read_text()).items() if re.search(r"_seal11", n)}
    assert fast and all(fast.values()), fast
