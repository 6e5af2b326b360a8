"""A result cache for the tests' slow compiler runs (nvcc, ptxas): a second test run on the same machine reuses
what an earlier one compiled from the same inputs, as ccache does for the project's build (ccache caches neither
`nvcc -ptx`, ptxas, nor a compile-and-link). Issue 50's warm-cache target; the first run compiles as before.

The key is everything the result can depend on:
  - the tool's and the host compiler's `--version` (the toolkit's own headers and libraries come with them);
  - the command line, with each input file replaced by its content's hash, each directory (`-I DIR`) by the
    hash of every source and header under it, and the output (`-o OUT`) and nvcc's `-keep-dir DIR` by their names;
  - the sources and headers next to each input file (`#include "x.h"` looks there first).
Only a run that succeeded is stored (its output file, the intermediate files asked for with `keep=`, stdout,
stderr); a hit writes the same files and returns the same stdout and stderr. `OTT_TEST_TOOL_CACHE=0` turns the
cache off, `OTT_TEST_TOOL_CACHE=DIR` moves it (default: ~/.cache/ott-gguf/test-tools, kept under 4 GiB, least
recently used entries dropped first).

    python tests/tool_cache.py nvcc ARGS...   # the same through the cache (native/tests/build-ott-bench.sh's NVCC)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path

VERSION = 1
# the files a compile can read from an include directory (objects, PTX and binaries there are outputs of other runs)
SOURCE_SUFFIXES = {".h", ".hpp", ".cuh", ".cu", ".c", ".cc", ".cpp", ".inc", ".def"}
LIMIT_BYTES = 4 << 30


def cache_dir() -> Path | None:
    v = os.environ.get("OTT_TEST_TOOL_CACHE", "")
    if v == "0":
        return None
    return Path(v) if v else Path.home() / ".cache" / "ott-gguf" / "test-tools"


@cache
def _version(tool: str) -> str:
    exe = shutil.which(tool)
    if exe is None:
        return f"{tool}: not found"
    res = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return f"{exe}\n{res.stdout}{res.stderr}"


def _file_hash(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _tree_hash(d: Path) -> str:
    """Every source and header under d (relative path and content), sorted."""
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.suffix in SOURCE_SUFFIXES and p.is_file():
            h.update(str(p.relative_to(d)).encode() + b"\0" + _file_hash(p).encode() + b"\n")
    return h.hexdigest()


def key_of(cmd: list[str], cwd: Path) -> tuple[str, Path | None]:
    """(hex key, output path) of a command line: see the module's text."""
    h = hashlib.sha256(f"ott-gguf test tool cache {VERSION}\n".encode())
    h.update(_version(cmd[0]).encode())
    h.update(_version("g++").encode())  # nvcc's host compiler
    out: Path | None = None
    parents: set[Path] = set()
    args = iter(enumerate(cmd))
    for i, a in args:
        if i == 0:
            h.update(b"tool " + Path(a).name.encode() + b"\n")
            continue
        if a == "-o":
            _, o = next(args)
            out = cwd / o
            h.update(b"-o " + Path(o).name.encode() + b"\n")
            continue
        if a == "-keep-dir":  # where the intermediates go: an output, not an input
            _, d = next(args)
            h.update(b"-keep-dir " + Path(d).name.encode() + b"\n")
            continue
        p = cwd / a
        if a.startswith("-") or not p.exists():
            h.update(b"arg " + a.encode() + b"\n")
        elif p.is_dir():
            h.update(b"dir " + _tree_hash(p).encode() + b"\n")
        else:
            h.update(b"file " + p.name.encode() + b" " + _file_hash(p).encode() + b"\n")
            parents.add(p.resolve().parent)
    for d in sorted(parents):
        h.update(b"next to an input " + _tree_hash(d).encode() + b"\n")
    return h.hexdigest(), out


def log_compile(what: str, seconds: float, detail: str = "") -> None:
    """One line per compile that ran (a miss), appended to OTT_TEST_COMPILE_LOG when set (tests/conftest.py sets it
    for a run and prints the sums at its end: what a cold machine compiles during the tests)."""
    if log := os.environ.get("OTT_TEST_COMPILE_LOG"):
        with open(log, "a") as f:
            f.write(f"{what}\t{seconds:.1f}\t{detail}\n")


def _evict(root: Path) -> None:
    entries = []
    for e in root.iterdir():
        if e.is_dir() and not e.name.startswith("."):
            size = sum(f.stat().st_size for f in e.iterdir())
            entries.append((e.stat().st_mtime, size, e))
    total = sum(s for _, s, _ in entries)
    for _, size, e in sorted(entries):
        if total <= LIMIT_BYTES:
            break
        shutil.rmtree(e, ignore_errors=True)
        total -= size


def run(cmd: list[str], cwd: Path | None = None, keep: Sequence[Path] = ()) -> subprocess.CompletedProcess[str]:
    """subprocess.run(cmd, capture_output=True, text=True) through the cache. keep: files the command writes besides
    its -o output (nvcc -keep's PTX), stored and restored with it."""
    root = cache_dir()
    wd = Path(cwd) if cwd else Path.cwd()
    if root is None:
        t0 = time.monotonic()
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
        log_compile(Path(cmd[0]).name, time.monotonic() - t0)
        return res
    key, out = key_of(cmd, wd)
    h = hashlib.sha256(key.encode())
    for k in keep:
        h.update(b"\0keep " + Path(k).name.encode())
    key = h.hexdigest() if keep else key
    entry = root / key
    meta = entry / "meta.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        if out is not None:
            shutil.copy(entry / "output", out)  # with its mode (an executable)
        for i, k in enumerate(keep):
            shutil.copy(entry / f"keep.{i}", wd / k)
        os.utime(entry)
        return subprocess.CompletedProcess(cmd, 0, m["stdout"], m["stderr"])
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    log_compile(Path(cmd[0]).name, time.monotonic() - t0, out.name if out else "")
    if res.returncode == 0 and (out is None or out.is_file()) and all((wd / k).is_file() for k in keep):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".new-"))
        if out is not None:
            shutil.copy(out, tmp / "output")
        for i, k in enumerate(keep):
            shutil.copy(wd / k, tmp / f"keep.{i}")
        (tmp / "meta.json").write_text(json.dumps({"cmd": cmd, "stdout": res.stdout, "stderr": res.stderr}))
        try:
            tmp.rename(entry)  # another process may have stored the same key meanwhile: keep its entry
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
        _evict(root)
    return res


if __name__ == "__main__":
    r = run(sys.argv[1:])
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    sys.exit(r.returncode)
