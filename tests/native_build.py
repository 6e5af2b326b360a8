"""The test-only native libraries: CMake targets of the installed build's build tree that are neither built by
default nor installed (CMakeLists.txt, section 5). The first request builds them all (`cmake --build <build dir>
--target ott_test_libs`, seconds once the project is built); `python tests/native_build.py` does the same.

  ott_kernels   the generated kernels, every config for every ISA of this machine (native_kernels.py, cffi)
  ott_cuda_emu  the CUDA kernels' emulation as ggml-cpu's ott2 ops: LD_PRELOAD it into a tool (test_cuda_emu.py)
"""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

from tool_cache import log_compile

from ott_gguf import build_info

TARGET = "ott_test_libs"


def build_dir() -> Path:
    """The CMake build tree the installed package came from (pip keeps it under build/<wheel tag>)."""
    d = build_info().get("build_dir")
    path = Path(str(d)) if d else None
    if path is None or not (path / "CMakeCache.txt").exists():
        raise RuntimeError(
            f"the test libraries need the build tree of the installed package ({path}); install from a source "
            "checkout (`make install`) so that pip keeps it under build/"
        )
    return path


def _cmake(bdir: Path) -> str:
    """The cmake that configured the tree (a different version could refuse it)."""
    for line in (bdir / "CMakeCache.txt").read_text().splitlines():
        if line.startswith("CMAKE_COMMAND:"):
            return line.split("=", 1)[1]
    return "cmake"


@cache
def build_test_libs() -> Path:
    bdir = build_dir()
    # the test processes (make test runs two) build in the same tree: one ninja at a time
    with open(bdir / ".ott-test-libs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.monotonic()
        res = subprocess.run([_cmake(bdir), "--build", str(bdir), "--target", TARGET], capture_output=True, text=True)
        if re.search(r"^\[\d+/\d+\] (?:Building|Linking) ", res.stdout, re.M):  # not a build with nothing to do
            log_compile(TARGET, time.monotonic() - t0)
    if res.returncode != 0:
        raise RuntimeError(f"building {TARGET} in {bdir} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return bdir


def built_lib(name: str) -> Path:
    """Path of a test-only library, e.g. built_lib('ott_kernels'); built on first use."""
    p = build_test_libs() / f"lib{name}.so"
    if not p.exists():
        raise RuntimeError(f"{p} is missing after building {TARGET}")
    return p


if __name__ == "__main__":
    print(build_test_libs(), file=sys.stderr)
