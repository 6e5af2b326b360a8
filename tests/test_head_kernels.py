"""The generated per-head kernels of the ott2 cache (seal one group; attention of one query) against the numpy
reference (ott_gguf.reference), field by field, for every ISA this machine runs and every generated config."""

from __future__ import annotations

import numpy as np
import pytest
from native_kernels import HeadKernelSet, kernels

from ott_gguf import reference as ref

from helpers import check_attention, keys_values, lockstep

K = kernels()
CASES = [(b, G, Gv, isa) for (b, G, Gv) in K.head_configs for isa in K.isas]


def head_set(bits: int, G: int, Gv: int, isa: str) -> HeadKernelSet:
    if not K.cpu_supports(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    return K.head(bits, G, Gv, isa)


@pytest.mark.parametrize("bits,G,Gv,isa", CASES)
@pytest.mark.parametrize("outlier_num,aux_cap", [(3, 32), (0, 32), (2, 1)])
def test_seal_and_attention_match_reference(bits: int, G: int, Gv: int, isa: str, outlier_num: int,
                                            aux_cap: int) -> None:  # fmt: skip
    hk = head_set(bits, G, Gv, isa)
    D = 64
    cfg = ref.OttConfig(bits=bits, G=G, R=32, Gv=Gv, outlier_num=outlier_num, aux_cap=aux_cap)
    rng = np.random.default_rng(bits * 7 + G + Gv + outlier_num)
    n = 5 * G + 40
    k, v = keys_values(rng, n, D)
    if aux_cap == 1:
        # keys shrink over time: every group's tokens beat the pool, whose losers fill the aux pool
        k *= np.linspace(1.0, 0.05, n, dtype=np.float32)[:, None]
    st, nat = lockstep(hk, cfg, outlier_num, k, v, [7, G + 3, 1, 1, n - G - 12])
    assert st.n_sealed >= 4
    if aux_cap == 1 and outlier_num:
        assert not st.tracing  # the small aux pool filled: tracing stopped, no token dropped
    check_attention(hk, st, nat, rng)


@pytest.mark.parametrize("isa", K.isas)
def test_ties_and_constant_groups(isa: str) -> None:
    """Equal scores (ties go to the earlier position) and constant channels (scale 0) in every field."""
    hk = head_set(2, 64, 32, isa)
    cfg = ref.OttConfig(bits=2, G=64, R=32, Gv=32, outlier_num=3, aux_cap=8)
    rng = np.random.default_rng(0)
    n, D = 4 * 64 + 40, 64
    k = np.tile(rng.standard_normal((1, D)).astype(np.float32), (n, 1))  # every token the same key: all tie
    k[:, 5] = 2.0  # a constant channel
    v = rng.standard_normal((n, D)).astype(np.float32)
    v[:, :32] = 0.25  # a constant V block
    st, nat = lockstep(hk, cfg, 3, k, v, [n])
    assert st.pool.pos.tolist() == [0, 1, 2]  # the earliest positions win every tie
    check_attention(hk, st, nat, rng)


@pytest.mark.parametrize("isa", K.isas)
def test_planted_outlier_is_caught(isa: str) -> None:
    hk = head_set(2, 128, 64, isa)
    cfg = ref.OttConfig()
    rng = np.random.default_rng(1)
    n, D = 3 * 128 + 32, 64
    k = (rng.standard_normal((n, D)) * 4).astype(np.float32)
    k[:, 9] += 40.0  # a large channel
    k[200] = 0.001  # a tiny key: the smallest score of all
    k[200, 9] = 0.002
    v = rng.standard_normal((n, D)).astype(np.float32)
    st, nat = lockstep(hk, cfg, 3, k, v, [n])
    assert 200 in st.pool.pos.tolist() and 200 in nat.pool.pos.tolist()
    check_attention(hk, st, nat, rng)


def test_every_x86_isa_was_run() -> None:
    import platform

    if platform.machine() == "x86_64":
        assert K.cpu_supports("avx2") and K.cpu_supports("avx512")
        assert {isa for *_, isa in CASES} == {"scalar", "avx2", "avx512"}
