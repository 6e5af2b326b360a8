"""study.pre_rope (docs/pre-rope-keys.md): its RoPE is RoPE (a complex rotation per pair, in either layout), it
undoes itself, and keys that are steady before RoPE quantize better turned back, as the study measures on models."""

from __future__ import annotations

import numpy as np
import pytest

from ott_gguf.kv_types import OttConfig
from study.k_widths import _quantize_keys_with
from study.pre_rope import Rope, quantize_pre


@pytest.mark.parametrize("neox", [False, True])
def test_the_turn_is_a_complex_rotation_per_pair_and_undoes_itself(neox: bool) -> None:
    rope = Rope(base=1e4, n_rot=16, neox=neox)
    rng = np.random.default_rng(1)
    x, pos = rng.standard_normal((40, 16)).astype(np.float32), np.arange(100, 140)
    y = rope.turn(x, pos, +1)
    i0, i1 = (np.arange(8), np.arange(8, 16)) if neox else (np.arange(0, 16, 2), np.arange(1, 16, 2))
    z = (x[:, i0] + 1j * x[:, i1]) * np.exp(1j * pos[:, None] * 1e4 ** (-2 * np.arange(8) / 16))
    np.testing.assert_allclose(y[:, i0], z.real, atol=2e-6)
    np.testing.assert_allclose(y[:, i1], z.imag, atol=2e-6)
    np.testing.assert_allclose(rope.turn(y, pos, -1), x, atol=2e-6)


def test_keys_steady_before_rope_quantize_better_turned_back() -> None:
    """Per-channel offsets with little noise before RoPE: after RoPE the fast pairs spin over a group, so turned
    back they quantize with a smaller error than as they are; slow pairs alone would show no difference."""
    rope, D, T = Rope(base=1e4, n_rot=64, neox=False), 64, 256
    rng = np.random.default_rng(2)
    pre = (rng.standard_normal(D) * 4 + 0.3 * rng.standard_normal((T, D))).astype(np.float32)
    pos = np.arange(T)
    k16 = rope.turn(pre, pos, +1).astype(np.float16)
    cfg = OttConfig(k_bits=2, outlier_num=0)
    exact = k16.astype(np.float32)
    err_post = np.sum((_quantize_keys_with(k16, cfg, None) - exact) ** 2)
    err_pre = np.sum((quantize_pre(k16, pos, rope, cfg, None) - exact) ** 2)
    assert err_pre < 0.5 * err_post, (err_pre, err_post)
