"""tests/tool_cache.py: a second run of a command with the same inputs returns the first one's files and output
without running it; a changed input runs it again."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import tool_cache

# a stand-in compiler: `tool IN -keep-dir DIR -o OUT` writes OUT and DIR/IN's stem.ptx from IN, prints a report, and
# counts its runs in a file beside itself
TOOL = """#!{py}
import sys
from pathlib import Path
if sys.argv[1:] == ["--version"]:
    print("fake tool 1.0")
    sys.exit(0)
runs = Path(__file__).with_name("runs")
runs.write_text(str(int(runs.read_text() or 0) + 1) if runs.exists() else "1")
src = Path(sys.argv[1])
out, kd = Path(sys.argv[sys.argv.index("-o") + 1]), Path(sys.argv[sys.argv.index("-keep-dir") + 1])
out.write_text("object of " + src.read_text())
(kd / (src.stem + ".ptx")).write_text("ptx of " + src.read_text())
print("report of", src.read_text(), file=sys.stderr)
"""


@pytest.fixture
def tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OTT_TEST_TOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OTT_TEST_COMPILE_LOG", str(tmp_path / "compiles.tsv"))  # not the run's: no compiler here
    exe = tmp_path / "bin" / "faketool"
    exe.parent.mkdir()
    exe.write_text(TOOL.format(py=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    tool_cache._version.cache_clear()
    return exe


def compile_once(tool: Path, src: Path, work: Path) -> tuple[str, str, str]:
    work.mkdir()
    kd, out = work / "keep", work / "a.o"
    kd.mkdir()
    res = tool_cache.run(["faketool", str(src), "-keep-dir", str(kd), "-o", str(out)], keep=[kd / "a.ptx"])
    assert res.returncode == 0, res.stderr
    return out.read_text(), (kd / "a.ptx").read_text(), res.stderr


def test_a_hit_restores_the_output_the_kept_files_and_the_report(tool: Path, tmp_path: Path) -> None:
    src = tmp_path / "a.cu"
    src.write_text("v1")
    first = compile_once(tool, src, tmp_path / "w1")
    assert first == ("object of v1", "ptx of v1", "report of v1\n")
    # another output directory (a new pytest tmp_path): the same key, nothing run
    assert compile_once(tool, src, tmp_path / "w2") == first
    assert (tool.parent / "runs").read_text() == "1"
    src.write_text("v2")  # a changed input runs the tool again
    assert compile_once(tool, src, tmp_path / "w3") == ("object of v2", "ptx of v2", "report of v2\n")
    assert (tool.parent / "runs").read_text() == "2"
    # the compile log (summed at the end of a test run) has the two runs, not the hit: the tool, seconds, output
    log = [line.split("\t") for line in (tmp_path / "compiles.tsv").read_text().splitlines()]
    assert [(w, o) for w, _, o in log] == [("faketool", "a.o"), ("faketool", "a.o")], log
