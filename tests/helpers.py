"""Helpers shared by the tests (tests/ is on sys.path: pytest's default import mode)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(*names: str, hint: str) -> None:
    """Skip when a tool is missing on a developer machine; in CI a missing tool is a failure."""
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        msg = f"missing {', '.join(missing)} ({hint})"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def make_inputs(rng: np.random.Generator, group: int, nblocks: int = 64) -> np.ndarray:
    """Blocks of varied scale and shape, with the adversarial ones every run: constant, +-0, huge, tiny,
    exact ties at code midpoints, one outlier among small values."""
    x = rng.standard_normal((nblocks, group)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-4, 3, size=(nblocks, 1)).astype(np.float32)
    x[:, :] += rng.uniform(-5, 5, size=(nblocks, 1)).astype(np.float32)
    x[0] = 1.25  # constant group: range 0
    x[1] = 0.0
    x[1, ::2] = -0.0  # min of +0/-0 mixes
    x[2] = rng.uniform(-20000, 20000, group)  # large magnitudes (fp16 scale still finite)
    x[3] = rng.uniform(-1e-6, 1e-6, group)  # scale underflows to an fp16 subnormal
    x[4] = np.linspace(0, 3, group)  # 0, ..., 3 with scale 1: many values land exactly on .5 ties
    x[4, : group // 4] = np.array([0.5, 1.5, 2.5, 0.0] * (group // 16))[: group // 4]
    x[5] = 1e-3
    x[5, 7] = 50.0  # one outlier
    x[6] = rng.integers(-3, 4, group).astype(np.float32) * np.float32(0.25)
    x[7] = -7.0
    x[7, 3] = -7.0 + 1e-7  # range below fp16 resolution of the scale: scale 0
    return x.reshape(-1)
