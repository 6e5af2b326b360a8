"""The build pipeline: pinned source, patches, code generation."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ott_gguf import build_info

from helpers import ROOT, rotate

FETCH = ROOT / "native" / "fetch_llama_cpp.py"
GEN = ROOT / "gen" / "generate.py"
PIN = ("0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")


def fetch(tmp: Path, patches: Path, sha: str = PIN[1]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(FETCH),
            "--version",
            PIN[0],
            "--sha256",
            sha,
            "--patches",
            str(patches),
            "--dest",
            str(tmp / "llama.cpp"),
        ],
        capture_output=True,
        text=True,
    )


def test_build_is_pinned() -> None:
    info = build_info()
    assert (info["llama_cpp_python"], info["sdist_sha256"]) == PIN


def test_a_patch_that_does_not_apply_fails_with_its_name(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    patches.mkdir()
    bad = patches / "0001-bad.patch"
    bad.write_text(
        "--- a/ggml/include/ggml.h\n+++ b/ggml/include/ggml.h\n@@ -1,3 +1,3 @@\n-this line is not there\n"
        "+nor is this\n context\n"
    )
    res = fetch(tmp_path, patches)
    assert res.returncode != 0
    assert "0001-bad.patch" in res.stderr and "does not apply" in res.stderr


def test_a_changed_pin_fails_with_the_reason(tmp_path: Path) -> None:
    res = fetch(tmp_path, ROOT / "native" / "patches", sha="0" * 64)
    assert res.returncode != 0
    assert "sha256" in res.stderr


def test_an_unpacked_tree_builds_offline_without_the_sdist(tmp_path: Path) -> None:
    """A cache holding the verified, unpacked tree (its stamp names the pinned sha256) and no sdist: the patched
    tree is prepared without pip (an offline GPU machine, study/gpu_offline); a stamp of another pin is not
    taken for it (the fetch then needs the sdist, which pip cannot get here: PIP_NO_INDEX)."""
    from ott_gguf.models import cache_dir

    src = cache_dir() / f"llama.cpp-{PIN[1][:16]}"
    cache = tmp_path / "cache"
    tree = cache / src.name
    for top in ("ggml", "src", "common"):  # what the patches touch lies under these and tools/
        shutil.copytree(src / top, tree / top)
    shutil.copytree(src / "tools", tree / "tools", ignore=shutil.ignore_patterns("ui"))
    (tree / ".ott-pristine").write_text(PIN[1])
    env = {**os.environ, "OTT_GGUF_CACHE": str(cache), "PIP_NO_INDEX": "1"}
    cmd = [sys.executable, str(FETCH), "--version", PIN[0], "--sha256", PIN[1], "--patches",
           str(ROOT / "native" / "patches"), "--dest", str(tmp_path / "llama.cpp")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert not (cache / "sdist").exists()
    assert "GGML_OP_OTT_ATTN" in (tmp_path / "llama.cpp" / "ggml" / "include" / "ggml.h").read_text()
    (tree / ".ott-pristine").write_text("0" * 64)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode != 0 and "could not download" in res.stderr


def test_a_file_whose_patch_is_removed_returns_to_pristine_newer_than_its_objects(tmp_path: Path) -> None:
    """Removing a patch restores the files it alone touched; each restored file must be newer than anything built
    from the patched one, or make keeps the removed patch's objects (copying the pristine file's mtime did)."""
    import difflib
    import time

    from ott_gguf.models import cache_dir

    rel = "ggml/include/ggml.h"
    assert fetch(tmp_path, tmp_path / "none").returncode == 0  # the pristine tree is in the cache from here on
    pristine = (cache_dir() / f"llama.cpp-{PIN[1][:16]}" / rel).read_text().splitlines(keepends=True)
    patches = tmp_path / "patches"
    patches.mkdir()
    diff = difflib.unified_diff(pristine, ["// a removed patch\n", *pristine], f"a/{rel}", f"b/{rel}", n=3)
    (patches / "0001-removed.patch").write_text("".join(diff))
    res = fetch(tmp_path, patches)
    assert res.returncode == 0, res.stderr
    dst = tmp_path / "llama.cpp" / rel
    assert dst.read_text().startswith("// a removed patch")
    built = time.time()  # an object built now from the patched file
    time.sleep(0.05)
    (patches / "0001-removed.patch").unlink()
    res = fetch(tmp_path, patches)
    assert res.returncode == 0, res.stderr
    assert dst.read_text() == "".join(pristine)
    assert dst.stat().st_mtime > built


def test_the_real_patches_apply_and_touch_only_what_they_name(tmp_path: Path) -> None:
    res = fetch(tmp_path, ROOT / "native" / "patches")
    assert res.returncode == 0, res.stderr
    header = (tmp_path / "llama.cpp" / "ggml" / "include" / "ggml.h").read_text()
    # the ott types are selectors only: ids after the stock types, no block format
    ids = header[header.index("GGML_TYPE_Q2_0") : header.index("GGML_TYPE_COUNT")]
    assert "GGML_TYPE_OTT2," in ids and "GGML_TYPE_KIVI2," in ids
    common = (tmp_path / "llama.cpp" / "ggml" / "src" / "ggml-common.h").read_text()
    assert "ott" not in common.lower()


def test_generator_is_deterministic_and_parametric(tmp_path: Path) -> None:
    def gen(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(GEN), *args, "--out", str(out)], capture_output=True, text=True)

    for group in (64, 128):
        a, b = tmp_path / f"a{group}", tmp_path / f"b{group}"
        assert gen(a, "ggml", "--group", str(group)).returncode == 0
        assert gen(b, "ggml", "--group", str(group)).returncode == 0
        for f in a.iterdir():
            assert f.read_bytes() == (b / f.name).read_bytes()
            assert f.read_text().startswith("// Generated by gen/generate.py from gen/templates/")
        head = (a / "ott2-head.h").read_text()
        assert f"#define OTT2_HEAD_GV   {group}" in head
        # kernels for every (K width, V width) pair of the cache types, in one table
        table = (a / "ott2-head.c").read_text()
        for kb in (2, 3, 4):
            for vb in (2, 3, 4):
                assert f"ott_k{kb}v{vb}g128x{group}_seal" in table
    bad = gen(tmp_path / "bad", "kernels", "--heads", "5:128:64")
    assert bad.returncode != 0 and "bits must be one of" in bad.stderr
    # a build directory kept between builds (Makefile OTT_BUILD_DIR): a kernel file an earlier generator made and
    # this one does not is removed (CMake globs the Vulkan kernels); a file the generator did not write is kept
    out = tmp_path / "a64"
    stale, built, mtime = out / "ott2-vk-k9v9g128x64-seal.comp", out / "ott2-vk-x.spv.inc", {}
    stale.write_text((out / "ott2-vk-attn_merge.comp").read_text())
    built.write_text("// compiled from a .comp\n")
    for f in out.iterdir():
        mtime[f.name] = f.stat().st_mtime_ns
    assert gen(out, "ggml", "--group", "64").returncode == 0
    assert not stale.exists() and built.exists()
    # and the files it does make are left alone when unchanged (an incremental build recompiles nothing)
    assert all(f.stat().st_mtime_ns == mtime[f.name] for f in out.iterdir())


def test_generator_and_reference_clip_tables_agree() -> None:
    """The kernels' clipped ranges (gen/generate.py) are the reference quantizer's (ott_gguf.quantizer)."""
    import importlib.util

    from ott_gguf import quantizer

    spec = importlib.util.spec_from_file_location("ott_generate", GEN)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules["ott_generate"] = gen  # dataclasses look their module up
    spec.loader.exec_module(gen)
    assert gen.CLIP_ONE == quantizer.CLIP_ONE
    assert gen.K_CLIP64 == quantizer.K_CLIP64
    assert gen.V_ROT_CLIP64 == quantizer.V_ROT_CLIP64
    hc = gen.HeadConfig(3, 2, 128, 64)
    assert (hc.k.clip, hc.v.clip, hc.vr.clip) == (quantizer.K_CLIP64[3], 64, quantizer.V_ROT_CLIP64[(2, 64)])
    # k_mix on 2-bit keys: 1/2/3-bit channels, the 1-bit ones clipped as the reference's KeyMix clips them
    from ott_gguf.reference import K1_CLIP64

    mixed = gen.HeadConfig(2, 2, 128, 64, True)
    clips = [(f.bits, f.clip) for f in mixed.k_formats]
    assert clips == [(1, K1_CLIP64), (2, quantizer.K_CLIP64[2]), (3, quantizer.K_CLIP64[3])]
    assert gen.PLANES[1] == quantizer.PLANE_WIDTHS[1] == (1,) and gen.WIDTHS == (2, 3, 4)
    assert mixed.k_group_bytes(64) == 64 * gen.HeadConfig(2, 2, 128, 64).k.block_bytes + 16


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 renderings: compiled, not run")
# AVX2, AVX-512 (VNNI added below): a minute of -O3 each on 2 cores, so one per run in rotation (make test-all: both)
@pytest.mark.parametrize("march", rotate(["x86-64-v3", "x86-64-v4"]))
def test_every_group_kernel_prefetches_the_next_group(tmp_path: Path, march: str) -> None:
    """Each attn_group, as this machine's C compiler renders it, issues its prefetches of the next group. GCC 12
    once dropped every call of the (then not always-inlined) prefetch helper in the 2-bit-V AVX2 kernels: their
    state then came from DRAM without overlap (docs/decode-profile.md, 2026-11-27, the 2nd session)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (the build needs one too)"
    gen = tmp_path / "gen"
    subprocess.run([sys.executable, str(GEN), "ggml", "--out", str(gen)], check=True, capture_output=True)
    flags = [f"-march={march}"] + (["-mavx512vnni"] if march == "x86-64-v4" else [])
    asm = tmp_path / "head.s"
    subprocess.run(
        [cc, "-O3", "-ffp-contract=off", *flags, "-I", str(gen), "-I", str(ROOT / "native" / "kernels"), "-S",
         str(gen / "ott2-head.c"), "-o", str(asm)],
        check=True,
    )  # fmt: skip
    bodies: dict[str, list[str]] = {}
    name = None
    for line in asm.read_text().splitlines():
        if line.endswith(":") and not line.startswith((" ", "\t", ".")):
            name = line[:-1] if line[:-1].endswith("_attn_group") else None
            if name:
                bodies[name] = []
        elif name:
            bodies[name].append(line)
    assert len(bodies) >= 16, sorted(bodies)  # every (K, V) width pair of the cache types, and the variants
    missing = [n for n, body in bodies.items() if not any("prefetch" in ln for ln in body)]
    assert not missing, f"no prefetch left in {missing}"


# libstdc++'s own code (the locale facets, iostreams' base, the code converters), which a library defines only if
# a static copy of libstdc++ was linked into it and left exported
LIBSTDCXX_OWN = re.compile(r"std::(locale::|ios_base::|codecvt|__codecvt)|std::[\w:]+<[^>]*>::id$")


def libstdcxx_own_symbols(lib: Path) -> list[str]:
    res = subprocess.run(["nm", "-D", "--defined-only", "-C", str(lib)], capture_output=True, text=True, check=True)
    return [ln for ln in res.stdout.splitlines() if LIBSTDCXX_OWN.search(ln)]


@pytest.mark.skipif(platform.system() != "Linux" or shutil.which("nm") is None, reason="ELF libraries and nm")
def test_no_library_exports_a_copy_of_libstdcxx(tmp_path: Path) -> None:
    """No library of the package may export libstdc++'s internals. The GPU machines' compiler (2026-11-26,
    2026-11-27) linked libstdc++ into every library: each exported its own copy, the process's libstdc++ and
    libllama bound to one of them, and the Python API crashed in std::regex loading a vocabulary. CMakeLists.txt
    links every library with --exclude-libs,ALL. The probe (a static libstdc++ with and without that option) shows
    that the check sees such a copy and that the option hides it."""
    from ott_gguf._lib import LIB_DIR

    src = tmp_path / "probe.cpp"
    src.write_text('#include <regex>\n#include <string>\nextern "C" int probe(const char * s) '
                   '{ return std::regex_search(std::string(s), std::regex("[a-z]+")) ? 1 : 0; }\n')  # fmt: skip
    cxx = os.environ.get("CXX") or shutil.which("c++") or "g++"
    probes = []
    for name, extra in (("exported", []), ("hidden", ["-Wl,--exclude-libs,ALL"])):
        cmd = [cxx, "-O1", "-fPIC", "-shared", "-static-libstdc++", *extra, str(src), "-o", str(tmp_path / name)]
        probes.append(subprocess.run(cmd, capture_output=True, text=True))
    if all(res.returncode == 0 for res in probes):
        assert len(libstdcxx_own_symbols(tmp_path / "exported")) > 100
        assert libstdcxx_own_symbols(tmp_path / "hidden") == []
    else:  # no static libstdc++ to probe with (Fedora's is a package of its own): the libraries are still checked
        warnings.warn(f"no static libstdc++ probe: {probes[0].stderr.strip()[-200:]}", stacklevel=1)
    libs = [p for p in LIB_DIR.glob("lib*.so*") if not p.is_symlink()]
    assert len(libs) >= 6, libs
    found = {p.name: own for p in libs if (own := libstdcxx_own_symbols(p))}
    assert not found, {name: (len(own), own[:3]) for name, own in found.items()}


@pytest.mark.skipif(platform.system() != "Linux" or shutil.which("ldd") is None, reason="ELF libraries and ldd")
def test_every_library_and_tool_resolves_its_symbols() -> None:
    """Hiding what static archives bring in (--exclude-libs) must not take a symbol away from a library or tool
    that needs it: a shared library links with undefined symbols, and the loss would show only when it loads."""
    from ott_gguf._lib import BIN_DIR, LIB_DIR

    files = [p for p in (*LIB_DIR.glob("lib*.so*"), *BIN_DIR.iterdir()) if not p.is_symlink()]
    assert len(files) >= 10, files
    env = {**os.environ, "LD_LIBRARY_PATH": str(LIB_DIR)}
    missing = {}
    for f in files:
        res = subprocess.run(["ldd", "-r", str(f)], capture_output=True, text=True, env=env)
        if lines := [ln.strip() for ln in (res.stdout + res.stderr).splitlines() if "undefined symbol" in ln]:
            missing[f.name] = lines[:3]
    assert not missing, missing


# what llama.cpp runs once per process or request, at OTT_GGUF_FRONTEND_OPT (CMakeLists.txt); all else at -O3
FRONT_END_TARGETS = {"mtmd", "cpp-httplib", "llama-bench-impl"}
FRONT_END_COMMON = {"arg.cpp", "download.cpp", "preset.cpp", "hf-cache.cpp", "fit.cpp", "json-schema-to-grammar.cpp",
                    "debug.cpp", "imatrix-loader.cpp"}  # fmt: skip
PER_TOKEN = {"ggml-base", "ggml-cpu", "ggml-vulkan", "ggml-cuda", "ggml-rpc", "llama", "llama-perplexity-impl",
             "server-context", "llama-server-impl", "llama-cli-impl"}  # fmt: skip


def test_only_what_runs_once_is_built_below_O3() -> None:
    info = build_info()
    ninja = Path(info["build_dir"]) / "build.ninja"
    if not ninja.is_file():
        pytest.skip(f"the build directory of this install is gone ({ninja})")
    opt: dict[tuple[str, str], str] = {}  # (target, source file) -> the effective -O (the last one on its line)
    obj = None
    for line in ninja.read_text().splitlines():
        m = re.match(r"build \S*CMakeFiles/([^/]+)\.dir/(\S+)\.o: (C|CXX|CUDA)_COMPILER", line)
        if m:
            obj = (m.group(1), m.group(2))
        elif obj and line.startswith("  FLAGS = "):
            levels = re.findall(r"(?<!\S)-O[0-3sg]?(?!\S)", line)
            opt[obj] = levels[-1] if levels else "none"
            obj = None
    low = info["frontend_opt"]
    targets = {t for t, _ in opt}
    assert FRONT_END_TARGETS | {"llama-common", "ggml-base", "ggml-cpu", "llama", "server-context"} <= targets
    for (t, src), level in opt.items():
        once = t in FRONT_END_TARGETS or (t == "llama-common" and src in FRONT_END_COMMON)
        if once:
            assert level == low, f"{t} {src}: {level}, OTT_GGUF_FRONTEND_OPT {low}"
        elif t in PER_TOKEN or t == "llama-common":
            assert level == "-O3", f"{t} {src} runs per token: built at {level}"
    if low != "-O3":
        assert {src for t, src in opt if t == "llama-common" and opt[t, src] == low} == FRONT_END_COMMON
    assert opt["llama-common", "sampling.cpp"] == "-O3" and opt["llama-common", "chat.cpp"] == "-O3"
