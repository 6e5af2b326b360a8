"""The generated per-head kernels of the ott2 cache (seal one group; attention of one query) against the numpy
reference (ott_gguf.reference), field by field, for every ISA this machine runs and every generated config."""

from __future__ import annotations

import math

import numpy as np
import pytest
from native_kernels import HeadKernelSet, kernels

from ott_gguf import reference as ref

from helpers import check_attention, k_mix_of, keys_values, lockstep, mixed_width_counts

K = kernels()
HEADS = [(kb, vb, G, Gv, kmix, vsym, isa) for (kb, vb, G, Gv, kmix, vsym) in K.head_configs for isa in K.isas]
POOLS = [(3, 32, False), (0, 32, False), (2, 1, False), (3, 32, True), (2, 1, True)]
# v_sym needs v_rotate (ott_config refuses it without): symmetric heads run the rotated pool cases
CASES = [h + p for h in HEADS for p in POOLS if p[2] or not h[5]]


def head_set(
    kbits: int, vbits: int, G: int, Gv: int, isa: str, vrot: bool = False, kmix: bool = False, vsym: bool = False
) -> HeadKernelSet:
    if not K.cpu_supports(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    return K.head(kbits, vbits, G, Gv, isa, vrot, kmix, vsym)


@pytest.mark.parametrize("kbits,vbits,G,Gv,kmix,vsym,isa,outlier_num,aux_cap,vrot", CASES)
def test_seal_and_attention_match_reference(kbits: int, vbits: int, G: int, Gv: int, kmix: bool, vsym: bool,
                                            isa: str, outlier_num: int, aux_cap: int, vrot: bool) -> None:  # fmt: skip
    hk = head_set(kbits, vbits, G, Gv, isa, vrot, kmix, vsym)
    D = 128 if vrot else 64  # two rotation units per token
    cfg = ref.OttConfig(k_bits=kbits, v_bits=vbits, G=G, R=32, Gv=Gv, outlier_num=outlier_num, aux_cap=aux_cap,
                        v_rotate=vrot, k_mix=k_mix_of(kbits, kmix), v_sym=vsym)  # fmt: skip
    assert cfg.k_mixed == kmix
    rng = np.random.default_rng(kbits * 7 + vbits * 3 + G + Gv + outlier_num + kmix + 11 * vsym)
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
    if kmix:  # every sealed group mixed its widths (kbits - 1, kbits, kbits + 1) by the quotas
        assert all(mixed_width_counts(g, kbits) == [D // 4, D // 2, D // 4] for g in st.groups)


@pytest.mark.parametrize("isa", K.isas)
def test_ties_and_constant_groups(isa: str) -> None:
    """Equal scores (ties go to the earlier position) and constant channels (scale 0) in every field."""
    hk = head_set(2, 2, 64, 32, isa)
    # a constant V block; k_mix 1: the uniform 2-bit head (G 64 has no mixed-width one; ties do not depend on it)
    cfg = ref.OttConfig(bits=2, G=64, R=32, Gv=32, outlier_num=3, aux_cap=8, v_rotate=False, k_mix=1)
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
    cfg = ref.OttConfig()  # the defaults (V rotated, 2-bit keys of mixed widths)
    hk = head_set(2, 2, 128, 64, isa, vrot=cfg.v_rotate, kmix=cfg.k_mixed)
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


@pytest.mark.parametrize("isa", K.isas)
@pytest.mark.parametrize("Gv,vsym", [(32, False), (64, False), (32, True)])
def test_rotated_values_fall_back_per_unit(isa: str, Gv: int, vsym: bool) -> None:
    """A token whose rotated values overflow the fp16 scale is stored unrotated in that unit only (scale sign bit
    clear there, set everywhere else), bit for bit as the reference, and attention still matches. With v_sym the
    unrotated unit is a symmetric full-range block."""
    if Gv == 64:
        hk = head_set(3, 2, 128, 64, isa, vrot=True)
    else:
        hk = head_set(2, 2, 64, 32, isa, vrot=True, vsym=vsym)
    G = hk.G
    cfg = ref.OttConfig(k_bits=hk.kbits, v_bits=2, G=G, R=32, Gv=Gv, outlier_num=3, aux_cap=8, v_rotate=True,
                        k_mix=False, v_sym=vsym)  # fmt: skip
    rng = np.random.default_rng(Gv)
    n, D = 2 * G + 40, 128
    k, v = keys_values(rng, n, D)
    v[5, :64] = 60000.0  # unit 0 of token 5: rotated, 8 x 60000 does not fit fp16, even clipped
    v[9, 64:] = 0.5  # a constant unit: scale 0, flagged as -0.0
    st, nat = lockstep(hk, cfg, 3, k, v, [n])
    flags = np.signbit(st.groups[0].v_scale)  # (G, D/Gv)
    per_unit = 64 // Gv if Gv < 64 else 1
    assert not flags[5, :per_unit].any() and flags[5, per_unit:].all()
    assert flags[np.arange(G) != 5].all()
    assert hk.v_block_bytes == (2 if vsym else 4) + Gv // 4
    check_attention(hk, st, nat, rng)


def test_every_x86_isa_was_run() -> None:
    import platform

    if platform.machine() == "x86_64":
        # every ISA is built and tested where the CPU runs it; a CPU without AVX-512 (an AVX2 EPYC) cannot run
        # those kernels at all, which shows as this test's skip, not as a pass
        assert {h[-1] for h in HEADS} == {"scalar", "avx2", "avx512", "avx512vnni"}
        assert K.cpu_supports("avx2")
        if not K.cpu_supports("avx512"):
            pytest.skip("this CPU has no AVX-512: the avx512 kernels were built but not run")


@pytest.mark.parametrize("isa", K.isas)
@pytest.mark.parametrize("vrot", [False, True])
def test_integer_values_are_modeled(isa: str, vrot: bool) -> None:
    """Where attn_group weighs the V codes in integers (2-bit V in one plane: AVX-512 with VNNI with 16-bit
    weights, AVX2 with 8-bit ones), its output is the reference's int_values model of those bits and neither fp32
    attention nor the other width's model; elsewhere it is fp32. A query aimed at one token leaves the others small
    weights, whose quantization moves the output past fp32 rounding (16 bits) or far past it (8 bits)."""
    hk = head_set(2, 2, 128, 64, isa, vrot=vrot)
    assert hk.vint == {"avx2": 8, "avx512vnni": 16}.get(isa, 0)
    cfg = ref.OttConfig(k_bits=2, v_bits=2, G=128, R=32, Gv=64, outlier_num=3, aux_cap=8, v_rotate=vrot, k_mix=1)
    rng = np.random.default_rng(5)
    n, D = 4 * 128 + 40, 64
    k, v = keys_values(rng, n, D)
    st, nat = lockstep(hk, cfg, 3, k, v, [n])
    pooled = st.pooled()
    kq, vq = np.concatenate(nat.kq), np.concatenate(nat.vq)
    lo = st.n_sealed * st.G
    q = np.stack([k[77] * 0.6, k[300] * 0.4, rng.standard_normal(D) * 0.5]).astype(np.float32)
    q_pos = np.full(len(q), st.n_pos - 1, np.int32)
    scale = 1.0 / math.sqrt(D)
    got = hk.attn_rows(q, q_pos, scale, kq, vq, st.n_sealed, pooled.pos, pooled.k, pooled.v, lo, st.tail_k, st.tail_v)
    models = {bits: ref.attend(st, q, q_pos, scale, int8_query=True, int_values=bits, v_rotate=vrot)
              for bits in (0, 8, 16)}  # fmt: skip
    vmax = float(np.abs(st.served()[2]).max())
    gap16 = float(np.abs(models[16] - models[0]).max())
    gap8 = float(np.abs(models[8] - models[0]).max())
    assert 5e-6 * vmax < gap16 < 1e-3 * vmax  # 16-bit weights move the output a little past fp32 rounding
    assert 20 * gap16 < gap8 < 0.02 * vmax  # 8-bit ones much more, still far below the 2-bit codes' own error
    for bits, want in models.items():  # the declared model within fp32 rounding, every other one well apart
        err = float(np.abs(got - want).max())
        assert err < 0.25 * gap16 if bits == hk.vint else err > 0.5 * gap16, bits


@pytest.mark.parametrize("isa", K.isas)
@pytest.mark.parametrize("kbits,D", [(2, 64), (3, 64), (2, 256)])
def test_a_row_does_not_depend_on_its_call(isa: str, kbits: int, D: int) -> None:
    """attn_group computes every query row on its own: a call of n rows gives each row bit for bit what a call with
    that row alone gives, whatever blocks the kernel cuts the rows into (key scores of up to 4 rows at once, the V
    pass's OTT_RB, 16 rows per block). Batch invariance rests on it: a token's attention may not depend on the
    ubatch it came in."""
    hk = head_set(kbits, 2, 128, 64, isa)
    cfg = ref.OttConfig(k_bits=kbits, v_bits=2, G=128, R=32, Gv=64, outlier_num=3, aux_cap=8, v_rotate=False,
                        k_mix=False)  # fmt: skip
    rng = np.random.default_rng(kbits + D)
    n = 3 * 128 + 40
    k, v = keys_values(rng, n, D)
    st, nat = lockstep(hk, cfg, 3, k, v, [n])
    pooled = st.pooled()
    kq, vq = np.concatenate(nat.kq), np.concatenate(nat.vq)
    lo = st.n_sealed * st.G
    scale = 1.0 / math.sqrt(D)
    q = (rng.standard_normal((19, D)) * 0.5).astype(np.float32)
    q_pos = np.full(len(q), st.n_pos - 1, np.int32)

    def rows(i: int, j: int) -> np.ndarray:
        return hk.attn_rows(q[i:j], q_pos[i:j], scale, kq, vq, st.n_sealed, pooled.pos, pooled.k, pooled.v, lo,
                            st.tail_k, st.tail_v)  # fmt: skip

    full = rows(0, len(q))
    for i, j in [(0, 1), (5, 6), (18, 19), (0, 2), (3, 6), (0, 4), (1, 6), (2, 9), (0, 17)]:
        np.testing.assert_array_equal(rows(i, j), full[i:j], err_msg=f"rows {i}..{j - 1}")
