"""Generated quantize/dequantize/vec_dot kernels vs the numpy quantizer of the spec, for every ISA this
machine runs (x86: scalar, AVX2, AVX-512) and every generated config (2-, 3- and 4-bit)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from native_kernels import kernels

from ott_gguf import quantizer as Q

from helpers import make_inputs

K = kernels()
CASES = [(b, g, isa) for (b, g) in K.configs for isa in K.isas]
CLIPPED = [(b, g, c, isa) for (b, g, c) in K.clipped_configs for isa in K.isas]


def kset(bits: int, group: int, isa: str):
    if not K.cpu_supports(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    return K.get(bits, group, isa)


@pytest.mark.parametrize("bits,group,isa", CASES)
def test_quantize_is_bit_exact(bits: int, group: int, isa: str) -> None:
    ks = kset(bits, group, isa)
    fmt = Q.BlockFormat(bits, group)
    x = make_inputs(np.random.default_rng(bits * 1000 + group), group)
    got = ks.quantize(x)
    want = Q.pack(Q.quantize(x, fmt), fmt)
    assert got.shape == want.shape
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"{isa} b{bits}g{group}: blocks differ at {bad[:8]}: {got[bad[0]]} vs {want[bad[0]]}"


@pytest.mark.parametrize("bits,group,isa", CASES)
def test_dequantize_is_exact(bits: int, group: int, isa: str) -> None:
    ks = kset(bits, group, isa)
    fmt = Q.BlockFormat(bits, group)
    x = make_inputs(np.random.default_rng(7 + bits + group), group)
    blocks = Q.pack(Q.quantize(x, fmt), fmt)
    got = ks.dequantize(blocks)
    want = Q.dequantize(Q.unpack(blocks, fmt)).reshape(-1)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("bits,group,isa", CASES)
def test_vec_dot_q8_1_within_fp32_tolerance(bits: int, group: int, isa: str) -> None:
    ks = kset(bits, group, isa)
    fmt = Q.BlockFormat(bits, group)
    rng = np.random.default_rng(11 * bits + group)
    for _ in range(20):
        n = group * int(rng.integers(1, 9))
        x = (rng.standard_normal(n) * rng.uniform(0.01, 10)).astype(np.float32)
        y = (rng.standard_normal(n) * rng.uniform(0.01, 10)).astype(np.float32)
        blocks = Q.pack(Q.quantize(x, fmt), fmt)
        q8 = Q.quantize_q8_1(y)
        want, mag = Q.vec_dot_q8_1(blocks, q8, fmt)
        got = ks.vec_dot_q8_1(blocks, q8)
        assert abs(got - want) <= 1e-5 * mag + 1e-7, (got, want, mag)


@pytest.mark.parametrize("bits,group,isa", CASES)
def test_constant_group_gives_scale_zero(bits: int, group: int, isa: str) -> None:
    ks = kset(bits, group, isa)
    fmt = Q.BlockFormat(bits, group)
    x = np.full(4 * group, 3.14159, dtype=np.float32)
    x[group : 2 * group] = 0.0
    x[2 * group : 3 * group] = -65000.0
    blocks = ks.quantize(x)
    q = Q.unpack(blocks, fmt)
    assert (q.d.view(np.uint16) == 0).all() and (q.codes == 0).all()
    out = ks.dequantize(blocks)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, x.astype(np.float16).astype(np.float32))


finite = st.floats(min_value=-3e4, max_value=3e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_property_every_isa_matches_numpy(data: st.DataObject) -> None:
    bits, group = data.draw(st.sampled_from(K.configs))
    fmt = Q.BlockFormat(bits, group)
    nblocks = data.draw(st.integers(1, 4))
    x = data.draw(hnp.arrays(np.float32, nblocks * group, elements=finite))
    want = Q.pack(Q.quantize(x, fmt), fmt)
    recon = Q.dequantize(Q.unpack(want, fmt)).reshape(-1)
    for isa in K.isas:
        if not K.cpu_supports(isa):
            continue
        ks = K.get(bits, group, isa)
        np.testing.assert_array_equal(ks.quantize(x), want)
        np.testing.assert_array_equal(ks.dequantize(want).view(np.uint32), recon.view(np.uint32))


def test_quantization_error_is_bounded() -> None:
    """|x - x_hat| <= d/2 (+ fp16 rounding of min) for every value: the codes really are nearest."""
    rng = np.random.default_rng(3)
    for bits in (2, 3, 4):
        fmt = Q.BlockFormat(bits, 64)
        x = rng.standard_normal(64 * 200).astype(np.float32)
        q = Q.quantize(x, fmt)
        err = np.abs(Q.dequantize(q) - x).reshape(-1, 64)
        d = q.d.astype(np.float32).reshape(-1, 1)
        mn = x.reshape(-1, 64).min(axis=1, keepdims=True)
        slack = np.abs(q.m.astype(np.float32).reshape(-1, 1) - mn) + 1e-6
        assert (err <= d / 2 + slack + d * 1e-3).all()


def test_machine_runs_the_simd_isas() -> None:
    """Every x86 variant is built; AVX2 runs on every x86 machine CI gets. AVX-512 runs where the CPU has it (the
    Xeon machines); on one without (an AVX2 EPYC) this test is skipped, so the report says they did not run."""
    import platform

    if platform.machine() == "x86_64":
        assert K.isas == ["avx2", "avx512", "avx512vnni", "scalar"]
        assert K.cpu_supports("avx2")
        if not K.cpu_supports("avx512"):
            pytest.skip("this CPU has no AVX-512: the avx512 kernels were built but not run")


def test_the_head_configs_bring_clipped_formats() -> None:
    """Keys and rotated values of the head configs use clipped ranges: those kernels exist to be tested."""
    assert K.clipped_configs, "no clipped config in the kernel library"
    assert {b for (b, _, _) in K.clipped_configs} >= {2, 3}


@pytest.mark.parametrize("bits,group,clip,isa", CLIPPED)
def test_clipped_quantize_is_bit_exact(bits: int, group: int, clip: int, isa: str) -> None:
    if not K.cpu_supports(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    ks = K.get(bits, group, isa, clip)
    fmt = Q.BlockFormat(bits, group, clip)
    x = make_inputs(np.random.default_rng(bits * 1000 + group + clip), group)
    got = ks.quantize(x)
    want = Q.pack(Q.quantize(x, fmt), fmt)
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"{isa} b{bits}g{group}c{clip}: blocks differ at {bad[:8]}: {got[bad[0]]} vs {want[bad[0]]}"
    # the clipped reconstruction stays inside the group's range (up to the fp16 rounding of scale and min)
    xh = Q.dequantize(Q.quantize(x, fmt)).reshape(-1, group)
    g = x.reshape(-1, group)
    # relative, plus the absolute step of fp16 subnormals (2^-24) for scale and min of tiny groups
    tol = 2e-3 * np.abs(g).max(axis=1) + 2.0**-24 * (1 << bits)
    assert (xh.min(axis=1) >= g.min(axis=1) - tol).all() and (xh.max(axis=1) <= g.max(axis=1) + tol).all()


SYM = [(b, g, c, isa) for (b, g, c) in K.sym_configs for isa in K.isas]


def test_the_head_configs_bring_symmetric_formats() -> None:
    """The v_sym heads store 2-bit values in symmetric blocks, clipped (rotated) and full range (fallback)."""
    assert {(b, c == Q.CLIP_ONE) for (b, _, c) in K.sym_configs} == {(2, True), (2, False)}


@pytest.mark.parametrize("bits,group,clip,isa", SYM)
def test_symmetric_blocks_are_bit_exact(bits: int, group: int, clip: int, isa: str) -> None:
    """quantize bit for bit (2 bytes shorter: no min), dequantize exact, vec_dot within fp32 rounding."""
    if not K.cpu_supports(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    ks = K.get(bits, group, isa, clip, sym=True)
    fmt = Q.BlockFormat(bits, group, clip, sym=True)
    assert ks.block_bytes == fmt.block_bytes == 2 + group * bits // 8
    x = make_inputs(np.random.default_rng(bits * 1000 + group + clip + 5), group)
    got = ks.quantize(x)
    want = Q.pack(Q.quantize(x, fmt), fmt)
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, (
        f"{isa} sym b{bits}g{group}c{clip}: blocks differ at {bad[:8]}: {got[bad[0]]} vs {want[bad[0]]}"
    )
    assert not np.signbit(Q.unpack(got, fmt).d).any()  # never -0: the sign bit is the rotation flag
    recon = Q.dequantize(Q.unpack(want, fmt)).reshape(-1)
    np.testing.assert_array_equal(ks.dequantize(want).view(np.uint32), recon.view(np.uint32))
    # levels centred on zero: x_hat = (code - nlev/2) * d, and |x_hat| <= the block's max |x| (clip <= 1)
    q = Q.unpack(want, fmt)
    lev = (q.codes.astype(np.float32) - np.float32(fmt.nlev / 2)) * q.d.astype(np.float32)[:, None]
    np.testing.assert_array_equal(recon.reshape(-1, group), lev)
    amax = np.abs(x.reshape(-1, group)).max(axis=1)
    assert (np.abs(recon.reshape(-1, group)).max(axis=1) <= amax * (1 + 2e-3) + 2.0**-24 * 4).all()
    rng = np.random.default_rng(clip)
    for _ in range(10):
        n = group * int(rng.integers(1, 5))
        xb = Q.pack(Q.quantize((rng.standard_normal(n) * rng.uniform(0.01, 10)).astype(np.float32), fmt), fmt)
        q8 = Q.quantize_q8_1(rng.standard_normal(n).astype(np.float32))
        exact, mag = Q.vec_dot_q8_1(xb, q8, fmt)
        assert abs(ks.vec_dot_q8_1(xb, q8) - exact) <= 1e-5 * mag + 1e-6


def test_symmetric_blocks_cost_little_on_gaussian_values() -> None:
    """What v_sym trades (docs/v-blocks.md): on Gaussian blocks of 64 (rotated values are near-Gaussian), the
    symmetric 2-bit block's error is within 10% of the clipped asymmetric one's, at 16 bits less per block."""
    x = np.random.default_rng(0).standard_normal(64 * 4000).astype(np.float32)
    asym = Q.BlockFormat(2, 64, Q.V_ROT_CLIP64[(2, 64)])
    sym = Q.BlockFormat(2, 64, Q.V_SYM_CLIP64[(2, 64)], sym=True)
    e_asym = float(((Q.dequantize(Q.quantize(x, asym)) - x) ** 2).mean())
    e_sym = float(((Q.dequantize(Q.quantize(x, sym)) - x) ** 2).mean())
    assert sym.block_bytes == asym.block_bytes - 2
    assert e_asym < e_sym < 1.10 * e_asym
