"""The generated CUDA code compiles with nvcc for the consumer architectures (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, require_tool


@pytest.fixture(scope="module")
def cuda_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cuda")
    subprocess.run([sys.executable, str(ROOT / "gen" / "generate.py"), "cuda", "--out", str(out)], check=True)
    return out


@pytest.mark.parametrize("arch", ["sm_75", "sm_86", "sm_89"])
def test_generated_cuda_compiles(cuda_sources: Path, arch: str, tmp_path: Path) -> None:
    require_tool("nvcc", hint="the CUDA toolkit")
    obj = tmp_path / f"ott-{arch}.o"
    res = subprocess.run(
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
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert obj.stat().st_size > 0
    # every config's kernels made it into the object
    syms = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    for tag in ("b2g32", "b2g64", "b2g128", "b3g64", "b4g64"):
        assert f"ott_cuda_dequantize_{tag}" in syms and f"ott_cuda_quantize_{tag}" in syms
