"""The NEON kernels, cross-compiled for aarch64 and run under qemu-user, against the numpy quantizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ott_gguf import quantizer as Q

from helpers import ROOT, make_inputs, require_tool

CONFIGS = [(2, 32), (2, 64), (2, 128), (3, 64), (4, 64)]
CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tool(CC, QEMU, hint="apt-get install gcc-aarch64-linux-gnu qemu-user; .ci/run installs them")
    out = tmp_path_factory.mktemp("neon")
    gen = out / "gen"
    cfg = ",".join(f"{b}:{g}" for b, g in CONFIGS)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "gen" / "generate.py"),
            "kernels",
            "--arch",
            "aarch64",
            "--configs",
            cfg,
            "--out",
            str(gen),
        ],
        check=True,
    )
    flags = subprocess.run(
        [sys.executable, str(ROOT / "gen" / "generate.py"), "flags", "--isa", "neon"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    exe = out / "ott_kernel_driver"
    srcs = [
        gen / "ott-kernels-scalar.c",
        gen / "ott-kernels-neon.c",
        gen / "ott-kernels-table.c",
        ROOT / "native" / "tests" / "ott_kernel_driver.c",
    ]
    # one flag set for all files: the table and driver are plain C; -ffp-contract=off as in every build
    subprocess.run(
        [
            CC,
            "-O2",
            "-std=c11",
            "-static",
            "-ffp-contract=off",
            *flags,
            "-I",
            str(gen),
            "-I",
            str(ROOT / "native" / "kernels"),
            *map(str, srcs),
            "-lm",
            "-o",
            str(exe),
        ],
        check=True,
    )
    return exe


def run(driver: Path, bits: int, group: int, isa: str, op: str, data: bytes, tmp: Path) -> bytes:
    src, dst = tmp / f"{op}.in", tmp / f"{op}.out"
    src.write_bytes(data)
    subprocess.run(
        [QEMU, "-cpu", "max", str(driver), str(bits), str(group), isa, op, str(src), str(dst)], check=True, timeout=120
    )
    return dst.read_bytes()


@pytest.mark.parametrize("isa", ["neon", "scalar"])
@pytest.mark.parametrize("bits,group", CONFIGS)
def test_aarch64_kernels_match_numpy(driver: Path, bits: int, group: int, isa: str, tmp_path: Path) -> None:
    fmt = Q.BlockFormat(bits, group)
    x = make_inputs(np.random.default_rng(bits * 31 + group), group)
    want = Q.pack(Q.quantize(x, fmt), fmt)
    got = np.frombuffer(run(driver, bits, group, isa, "quantize", x.tobytes(), tmp_path), dtype=np.uint8)
    np.testing.assert_array_equal(got.reshape(want.shape), want)

    recon = Q.dequantize(Q.unpack(want, fmt)).reshape(-1)
    got_f = np.frombuffer(run(driver, bits, group, isa, "dequantize", want.tobytes(), tmp_path), dtype=np.float32)
    np.testing.assert_array_equal(got_f.view(np.uint32), recon.view(np.uint32))

    y = np.random.default_rng(1).standard_normal(x.size).astype(np.float32)
    q8 = Q.quantize_q8_1(y)
    payload = np.int64(x.size).tobytes() + want.tobytes() + q8.tobytes()
    got_dot = float(np.frombuffer(run(driver, bits, group, isa, "vec_dot", payload, tmp_path), dtype=np.float32)[0])
    want_dot, mag = Q.vec_dot_q8_1(want, q8, fmt)
    assert abs(got_dot - want_dot) <= 1e-5 * mag
