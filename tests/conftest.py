from __future__ import annotations

import os
import sys
from pathlib import Path

# llama.cpp's CPU threads meet at an OpenMP barrier after every graph node (this build uses OpenMP), and libgomp
# spins 300000 rounds there before it sleeps: when a test runs anything else at the same time (a server, lavapipe's
# thread, an nvcc unit), the waiting thread keeps a core from the one it waits for. 1000 rounds: measured the same
# speed on an idle machine (SmolLM2, 500-token prefill and 60 decoded tokens, 2 threads) and 3.5x faster decode on
# a busy one (docs/testing.md). Set before the native libraries load; the tools the tests start inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
# lavapipe (llvmpipe) without LLVM's optimization passes, for every process of the tests: CI's machine starts with
# no Mesa shader cache, and compiling the ott and ggml-vulkan shaders is most of the Vulkan files' time there;
# test_vulkan_ops.py and test_vulkan.py together: 288 s -> 184 s of wall cold, 59 s -> 78 s warm (docs/testing.md)
os.environ.setdefault("GALLIVM_PERF", "nopt")
# the compiles that run during the tests (tool_cache.py's misses, the test libraries' build) log their seconds here;
# the summary at the end sums them: what a machine without the caches (CI's) pays for them. The workers inherit it.
if "OTT_TEST_COMPILE_LOG" not in os.environ:
    import tempfile

    _fd, _OWN_COMPILE_LOG = tempfile.mkstemp(prefix="ott-test-compiles-", suffix=".tsv")
    os.close(_fd)
    os.environ["OTT_TEST_COMPILE_LOG"] = _OWN_COMPILE_LOG

import pytest  # noqa: E402

import ott_gguf  # noqa: E402
from ott_gguf._lib import LIB_DIR  # noqa: E402

# the repository's study tools (study/, not installed) are importable as `study`; the root goes last so that
# `ott_gguf` stays the installed package (or PYTHONPATH's), never the source tree by accident
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)

# the tests exercise the installed package with its native build (or OTT_GGUF_NATIVE_DIR), never a source
# tree without one
if not LIB_DIR.is_dir():
    pytest.exit(
        f"ott_gguf imported from {ott_gguf.__file__} has no native build: run the tests with the "
        "venv's pytest after installing (make test)",
        returncode=4,
    )


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from ott_gguf import models

    return models.fetch("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def gemma3() -> Path:
    from ott_gguf import models

    return models.fetch("gemma3-270m", quiet=True)


# --- the order the files run in: the longest first (issue 50). Under pytest-xdist's --dist loadfile each worker takes
# the next file when it is done, so a long file taken last runs alone while the other core idles: on a bare machine
# (CI's), lavapipe's and nvcc's compiling made test_vulkan_ops and test_cuda_compile the two longest files, and
# xdist's default order (files with the most tests first, the Makefile turns it off) ran them last. Their seconds
# on a bare machine (2 cores, docs/testing.md), the longest first; the files not named here run after them, in their
# usual order.
COST_ORDER = [
    "test_vulkan_ops.py", "test_same_answer.py", "test_quality.py", "test_vulkan.py", "test_cuda_compile.py",
    "test_cuda_emu.py", "test_cli_tools.py", "test_build.py", "test_cuda_bench.py", "test_ott2_cache.py",
    "test_tiers_flag.py", "test_layer_widths.py", "test_neon.py", "test_llama.py", "test_rpc.py", "test_kv_pairs.py",
    "test_capture.py", "test_key_age.py", "test_served_attention.py", "test_ott2_batch.py", "test_server_load.py",
    "test_chat.py",
]  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    if missing := [n for n in COST_ORDER if not (here / n).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py COST_ORDER names files that do not exist: {missing}")
    rank = {name: i for i, name in enumerate(COST_ORDER)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: each file's own order kept


# --- the suite's time budget, printed at the end of every run (issue 50): wall time per test file, so that a file
# that grows is seen in the CI log when it happens; the ten slowest tests come from pytest's --durations=10
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section("time per test file (setup + call + teardown)")
    for path, sec in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{sec:8.1f} s  {100 * sec / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f} s  in all")
    log = Path(os.environ["OTT_TEST_COMPILE_LOG"])
    runs: dict[str, list[float]] = {}
    for line in log.read_text().splitlines() if log.is_file() else []:
        what, sec, *_ = line.split("\t")
        runs.setdefault(what, []).append(float(sec))
    compiled = ", ".join(f"{w} {len(s)}x {sum(s):.0f} s" for w, s in sorted(runs.items(), key=lambda kv: -sum(kv[1])))
    terminalreporter.write_line(f"compiled during the tests (not in the caches): {compiled or 'nothing'}")
    if log.is_file() and str(log) == globals().get("_OWN_COMPILE_LOG"):
        log.unlink()
    from helpers import TEST_ALL, rotation

    r = rotation()
    scope = (
        "matrix: every case (OTT_TEST_ALL)" if TEST_ALL else f"matrix rotation {r} (OTT_TEST_ROTATION={r} repeats it)"
    )
    terminalreporter.write_line(scope)
