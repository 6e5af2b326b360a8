"""Tests of ott_gguf.reference, the numpy oracle of spec/ott2-algorithm.md.

The reference is checked against independent, deliberately naive models written here: a loop-per-group KIVI,
dense float64 attention, and a plain-Python replay of the outlier competition (tuple sort, math.fsum). These
tests need no native build: run them with `python -m pytest --noconftest tests/test_reference.py`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ott_gguf.quantizer import K_CLIP64, V_ROT_CLIP64, V_SYM_CLIP64, BlockFormat, Quantized, dequantize, quantize
from ott_gguf.reference import (
    K1_CLIP64,
    HeadState,
    KeyMix,
    OttCache,
    OttConfig,
    attend,
    dequantize_group,
    effective_bits,
    hadamard_rotate,
    key_widths,
    memory_bits,
    quantize_keys,
    sealed_at,
    ubatch_splits,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = ("normal", "outlier_channels", "ties", "constant", "magnitudes")


# --------------------------------------------------------------------------------------------------- helpers


def make_kv(rng: np.random.Generator, n: int, H: int, D: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """K and V (n, H, D) float32 of a given flavour, all finite in fp16."""
    k = rng.standard_normal((n, H, D)).astype(np.float32)
    v = rng.standard_normal((n, H, D)).astype(np.float32)
    if kind == "outlier_channels":
        # a few large channels, and rare tokens whose key is small everywhere (the paper's outlier tokens)
        ch = rng.choice(D, size=3, replace=False)
        k[:, :, ch] = k[:, :, ch] + rng.uniform(10, 30, size=(1, H, 3)).astype(np.float32)
        small = rng.random((n, H)) < 0.05
        k[small] *= np.float32(0.05)
    elif kind == "ties":
        # few distinct values: many exactly equal L1 scores
        k = (rng.integers(-2, 3, size=(n, H, D)) * 0.5).astype(np.float32)
        v = (rng.integers(-2, 3, size=(n, H, D)) * 0.25).astype(np.float32)
    elif kind == "constant":
        k[:] = k[:1]
        v[:] = v[:1]
    elif kind == "magnitudes":
        # per-token magnitudes from fp16 subnormals to near the fp16 maximum
        k *= (10.0 ** rng.uniform(-7, 4.3, size=(n, H, 1))).astype(np.float32)
        v *= (10.0 ** rng.uniform(-7, 4.3, size=(n, H, 1))).astype(np.float32)
        k = np.clip(k, -60000, 60000)
        v = np.clip(v, -60000, 60000)
    return k, v


def split_points(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    pts = sorted({c for c in cuts if 0 < c < n})
    bounds = [0, *pts, n]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def run(
    cache: OttCache, seq: int, layer: int, q: np.ndarray | None, k: np.ndarray, v: np.ndarray, cuts: list[int]
) -> np.ndarray | None:
    """Feed [0, n) ubatch by ubatch (cut at `cuts`), from position cache.n_pos; concatenated outputs."""
    base = cache.n_pos(seq, layer)
    outs = []
    for a, b in split_points(len(k), cuts):
        o = cache.process_ubatch(
            seq, layer, None if q is None else q[a:b], k[a:b], v[a:b], np.arange(base + a, base + b)
        )
        outs.append(o)
    return None if q is None else np.concatenate(outs)


def n_sealed_after(n: int, cfg: OttConfig) -> int:
    return max(0, (n - cfg.R) // cfg.G)


def f16_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit equality of fp16 arrays (distinguishes -0 from +0)."""
    a, b = np.asarray(a, np.float16), np.asarray(b, np.float16)
    return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def assert_state_equal(a: HeadState, b: HeadState) -> None:
    assert a.n_sealed == b.n_sealed and a.tracing == b.tracing
    for ga, gb in zip(a.groups, b.groups, strict=True):
        assert ga.index == gb.index
        assert np.array_equal(ga.k_codes, gb.k_codes) and np.array_equal(ga.v_codes, gb.v_codes)
        for x, y in ((ga.k_scale, gb.k_scale), (ga.k_min, gb.k_min), (ga.v_scale, gb.v_scale), (ga.v_min, gb.v_min)):
            assert f16_equal(x, y)
        assert np.array_equal(ga.placeholders, gb.placeholders)
        assert np.array_equal(ga.k_hat, gb.k_hat) and np.array_equal(ga.v_hat, gb.v_hat)
    assert np.array_equal(a.tail_pos, b.tail_pos)
    assert f16_equal(a.tail_k, b.tail_k) and f16_equal(a.tail_v, b.tail_v)
    for pa, pb in ((a.pool, b.pool), (a.aux, b.aux)):
        assert np.array_equal(pa.pos, pb.pos)
        assert f16_equal(pa.k, pb.k) and f16_equal(pa.v, pb.v)
        assert np.array_equal(pa.score, pb.score)


def dense_attention(q: np.ndarray, kpos: np.ndarray, k: np.ndarray, v: np.ndarray, qpos: np.ndarray) -> np.ndarray:
    """float64 causal attention of rows q (n, D) over keys (m, D) at kpos, for queries at qpos."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = q @ k.T / math.sqrt(q.shape[1])
    s = np.where(kpos[None, :] <= qpos[:, None], s, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


def dense_gqa(q: np.ndarray, k16: np.ndarray, v16: np.ndarray, qpos: np.ndarray, kpos: np.ndarray) -> np.ndarray:
    """Dense attention (n, n_q_head, D) with GQA: query head h uses KV head h // (n_q_head // n_kv_head)."""
    n_q_head, H = q.shape[1], k16.shape[1]
    out = np.empty(q.shape, np.float64)
    for h in range(n_q_head):
        kv = h // (n_q_head // H)
        out[:, h] = dense_attention(q[:, h], kpos, k16[:, kv], v16[:, kv], qpos)
    return out


def served_from_fields(s: HeadState, cfg: OttConfig) -> tuple[np.ndarray, np.ndarray]:
    """What each position must contribute, rebuilt from the stored fields alone (codes, scales, mins, pools)."""
    G, D = s.G, s.head_dim
    k = np.zeros((s.n_pos, D), np.float64)
    v = np.zeros((s.n_pos, D), np.float64)
    for g in s.groups:
        sl = slice(g.index * G, (g.index + 1) * G)
        if cfg.identity:
            k[sl], v[sl] = g.k_hat, g.v_hat
        else:
            kq = Quantized(codes=g.k_codes.reshape(D, 1, G), d=g.k_scale.reshape(D, 1), m=g.k_min.reshape(D, 1))
            k[sl] = hadamard_rotate(dequantize(kq).T) if g.k_rotated else dequantize(kq).T
            v[sl] = decode_values(g.v_codes, g.v_scale, g.v_min, cfg)
    for p in (s.pool, s.aux):
        k[p.pos] = p.k
        v[p.pos] = p.v
    k[s.n_sealed * G :] = s.tail_k
    v[s.n_sealed * G :] = s.tail_v
    return k, v


def decode_values(codes: np.ndarray, scale: np.ndarray, mn: np.ndarray, cfg: OttConfig) -> np.ndarray:
    """V (G, D) from stored blocks, unit by unit: m + |d| * code, rotated back where the scale's sign bit is set
    (the same on every block of a unit of max(Gv, 64) channels)."""
    G, D = codes.shape
    U, per = max(cfg.Gv, 64), max(cfg.Gv, 64) // cfg.Gv
    vh = dequantize(Quantized(codes=codes.reshape(G, D // cfg.Gv, cfg.Gv), d=np.abs(scale), m=mn))
    flags = np.signbit(scale).reshape(G, D // U, per)
    assert (flags == flags[..., :1]).all()  # one flag per unit
    for t in range(G):
        for u in range(D // U):
            if flags[t, u, 0]:
                vh[t, u * U : (u + 1) * U] = hadamard_rotate(vh[t, u * U : (u + 1) * U])
    return vh


# ---------------------------------------------------------------------------- plain-Python model of the pools


def exact_score(row: np.ndarray) -> float:
    return float(np.float32(math.fsum(abs(float(x)) for x in row)))


def exact_mean(rows: np.ndarray) -> np.ndarray:
    return np.array([math.fsum(float(x) for x in col) / len(col) for col in rows.T], np.float64).astype(np.float16)


def model_pools(k16: np.ndarray, n_sealed: int, G: int, on: int, aux_cap: int):
    """Replay the competition group by group with Python tuples: (score, position) sorts ties by position."""
    pool: list[tuple[float, int]] = []
    aux: list[tuple[float, int]] = []
    tracing = True
    placeholders: list[list[int]] = []
    for g in range(n_sealed):
        won: list[int] = []
        if on > 0 and tracing:
            cands = sorted(pool + [(exact_score(k16[p]), p) for p in range(g * G, (g + 1) * G)])
            winners = cands[:on]
            lost = [c for c in pool if c not in winners]
            if len(aux) + len(lost) > aux_cap:
                tracing = False
            else:
                aux += lost
                pool = winners
                won = sorted(p for _, p in winners if p >= g * G)
        placeholders.append(won)
    return pool, aux, placeholders, tracing


def check_against_model(s: HeadState, cfg: OttConfig, on: int, k16: np.ndarray, v16: np.ndarray) -> None:
    """Every field of one head's state against the Python model, and the structural invariants."""
    n = len(k16)
    G = cfg.G
    assert s.n_pos == n and s.n_sealed == n_sealed_after(n, cfg)
    pool, aux, placeholders, tracing = model_pools(k16, s.n_sealed, G, on, cfg.aux_cap)
    assert s.tracing == tracing
    assert s.pool.pos.tolist() == sorted(p for _, p in pool)
    assert s.aux.pos.tolist() == sorted(p for _, p in aux)
    # sizes, uniqueness, no token dropped: each position is sealed-non-pooled, pooled or tail, exactly once
    assert len(s.pool) <= on and len(s.aux) <= (cfg.aux_cap if on else 0)
    pooled = np.concatenate([s.pool.pos, s.aux.pos])
    assert len(np.unique(pooled)) == len(pooled)
    sealed = set(range(s.n_sealed * G))
    assert set(pooled.tolist()) <= sealed
    assert s.tail_pos.tolist() == list(range(s.n_sealed * G, n))
    assert len(sealed - set(pooled.tolist())) + len(pooled) + len(s.tail_pos) == n
    if s.n_sealed and n >= cfg.R:
        assert cfg.R <= len(s.tail_pos) <= cfg.R + G - 1
    # pooled tokens hold exactly their fp16 K and V and their exact score
    for p in (s.pool, s.aux):
        assert f16_equal(p.k, k16[p.pos]) and f16_equal(p.v, v16[p.pos])
        assert [float(x) for x in p.score] == [exact_score(k16[i]) for i in p.pos]
    assert f16_equal(s.tail_k, k16[s.n_sealed * G :]) and f16_equal(s.tail_v, v16[s.n_sealed * G :])
    # placeholders are permanent and each is served from a pool
    all_ph = [p for g in s.groups for p in g.placeholders.tolist()]
    assert [g.placeholders.tolist() for g in s.groups] == placeholders
    assert sorted(all_ph) == sorted(pooled.tolist())
    # each group's codes: the inputs with the placeholders overwritten by the mean, quantized
    for g in s.groups:
        lo = g.index * G
        xk = k16[lo : lo + G].copy()
        xv = v16[lo : lo + G].copy()
        won = g.placeholders - lo
        if len(won):
            keep = np.ones(G, bool)
            if cfg.mean == "non_outlier":
                keep[won] = False
            xk[won] = exact_mean(xk[keep])
            xv[won] = exact_mean(xv[keep])
        if cfg.identity:
            assert np.array_equal(g.k_hat, xk.astype(np.float32)) and np.array_equal(g.v_hat, xv.astype(np.float32))
            continue
        # per-side widths; a rotated side is quantized in the rotated basis (scores above stay on the raw keys),
        # unless that gives a scale or min beyond fp16: then unrotated, keys per group (g.k_rotated), values per
        # token and unit of max(Gv, 64) channels, the flag in the sign bit of the V scales (negated when rotated)
        xk32, xv32 = xk.astype(np.float32), xv.astype(np.float32)

        def fits(q: Quantized) -> bool:
            return bool(np.isfinite(q.d).all() and np.isfinite(q.m).all())

        # keys at their clipped range, values at the full range unrotated and the clipped one rotated
        kf = BlockFormat(cfg.kbits, G, K_CLIP64[cfg.kbits])
        qk = quantize(xk32.T, kf)
        if cfg.k_mixed:
            widths = model_key_widths(xk32, cfg.kbits)
            assert g.k_widths is not None and g.k_widths.tolist() == widths
            parts = [quantize(xk32[:, c][None, :], BlockFormat(w, G, K_CLIP64[w])) for c, w in enumerate(widths)]
            codes = np.stack([q.codes[0, 0] for q in parts])[:, None, :]
            qk = Quantized(codes=codes, d=np.stack([q.d[0] for q in parts]), m=np.stack([q.m[0] for q in parts]))
        else:
            assert g.k_widths is None
        # v_sym: 2-bit values in symmetric blocks, rotated at their own clip, the fallback at the full range
        sym = cfg.v_sym and cfg.vbits == 2
        qv = quantize(xv32, BlockFormat(cfg.vbits, cfg.Gv, sym=sym))
        vclip = V_SYM_CLIP64[(2, cfg.Gv)] if sym else V_ROT_CLIP64[(cfg.vbits, cfg.Gv)]
        with np.errstate(over="ignore", invalid="ignore"):  # a rotated group may overflow fp16: the fallback
            rk = quantize(hadamard_rotate(xk32).T, kf)
            rv = quantize(hadamard_rotate(xv32), BlockFormat(cfg.vbits, cfg.Gv, vclip, sym=sym))
        assert g.k_rotated == (cfg.k_rotate and fits(rk))
        qk = rk if g.k_rotated else qk
        per = max(cfg.Gv, 64) // cfg.Gv  # V blocks per rotation unit
        rot = np.zeros(qv.d.shape, bool)
        for t in range(G):
            for b in range(0, rot.shape[1], per):
                unit = Quantized(codes=rv.codes[t, b : b + per], d=rv.d[t, b : b + per], m=rv.m[t, b : b + per])
                rot[t, b : b + per] = cfg.v_rotate and fits(unit)
        assert np.array_equal(g.v_rotated, rot) and np.array_equal(np.signbit(g.v_scale), rot)
        assert np.array_equal(g.k_codes, qk.codes[:, 0, :])
        assert f16_equal(g.k_scale, qk.d[:, 0]) and f16_equal(g.k_min, qk.m[:, 0])
        assert np.array_equal(g.v_codes, np.where(rot[..., None], rv.codes, qv.codes).reshape(G, -1))
        assert f16_equal(g.v_scale, np.where(rot, -rv.d, qv.d))
        if sym:  # no stored min: -1.5 |d| in fp32
            assert np.array_equal(g.v_min, np.float32(-1.5) * np.abs(g.v_scale.astype(np.float32)))
        else:
            assert f16_equal(g.v_min, np.where(rot, rv.m, qv.m))
        assert np.isfinite(g.k_hat).all() and np.isfinite(g.v_hat).all()
        # the cached k_hat/v_hat are exactly what the stored fields decode to
        k_dec, v_dec = dequantize_group(g, cfg)
        assert np.array_equal(g.k_hat, k_dec) and np.array_equal(g.v_hat, v_dec)
        assert np.array_equal(g.v_hat, decode_values(g.v_codes, g.v_scale, g.v_min, cfg))


def model_key_widths(k: np.ndarray, kbits: int = 3) -> list[int]:
    """k_mix's widths, written from its description: rank by fp32 (max - min) * max(|max|, |min|), largest
    first, ties to the lower channel; the first quarter kbits + 1 bits, the last quarter kbits - 1, the rest kbits."""
    D = k.shape[1]
    crit = [
        float(np.float32(np.float32(k[:, c].max() - k[:, c].min()) * max(abs(k[:, c].max()), abs(k[:, c].min()))))
        for c in range(D)
    ]
    order = sorted(range(D), key=lambda c: (-crit[c], c))
    widths = [kbits] * D
    for c in order[: D // 4]:
        widths[c] = kbits + 1
    for c in order[D - D // 4 :]:
        widths[c] = kbits - 1
    return widths


def _config(k_side: tuple[bool, bool], v_side: tuple[bool, bool], **kwargs: object) -> OttConfig:
    """k_rotate and k_mix exclude each other, v_sym needs v_rotate: each side drawn as one pair."""
    return OttConfig(k_rotate=k_side[0], k_mix=k_side[1], v_rotate=v_side[0], v_sym=v_side[1], **kwargs)  # type: ignore[arg-type]


configs = st.builds(
    _config,
    k_side=st.sampled_from([(False, False), (True, False), (False, True)]),
    v_side=st.sampled_from([(False, False), (True, False), (True, True)]),
    bits=st.sampled_from([2, 3, 4]),
    k_bits=st.sampled_from([None, 2, 3, 4]),
    v_bits=st.sampled_from([None, 2, 3]),
    G=st.sampled_from([32, 64]),
    R=st.integers(0, 40),
    Gv=st.sampled_from([32, 64]),
    outlier_num=st.integers(0, 5),
    aux_cap=st.integers(0, 8),
    no_outlier_layers=st.just(0),
    mean=st.sampled_from(["non_outlier", "all"]),
)


# ----------------------------------------------------------------------------------------------- invariants


@SETTINGS
@given(
    cfg=configs,
    n=st.integers(1, 300),
    cuts=st.lists(st.integers(1, 299), max_size=5),
    kind=st.sampled_from(KINDS),
    D=st.sampled_from([64, 128]),
    seed=st.integers(0, 2**32 - 1),
)
def test_state_matches_model_and_invariants(
    cfg: OttConfig, n: int, cuts: list[int], kind: str, D: int, seed: int
) -> None:
    """Sealed codes, pools, aux pool, placeholders and tracing equal the naive replay for any data and split."""
    rng = np.random.default_rng(seed)
    H = 2
    k, v = make_kv(rng, n, H, D, kind)
    cache = OttCache(cfg, 1, H, D)
    run(cache, 0, 0, None, k, v, cuts)
    for h in range(H):
        check_against_model(
            cache.state(0, 0, h), cfg, cfg.outlier_num, k[:, h].astype(np.float16), v[:, h].astype(np.float16)
        )


def kivi_reference(cfg: OttConfig, q, k, v, cuts) -> tuple[np.ndarray, list[list[dict]]]:
    """An independent block-G KIVI: per channel / per token loops, sealing after each ubatch, dense float64."""
    n, H, D = k.shape
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    fk, fv = BlockFormat(cfg.bits, cfg.G, K_CLIP64[cfg.bits]), BlockFormat(cfg.bits, cfg.Gv)
    assert not cfg.v_rotate  # unrotated values: the full range
    k_hat = k16.astype(np.float64)
    v_hat = v16.astype(np.float64)
    groups: list[list[dict]] = [[] for _ in range(H)]
    sealed = 0
    out = np.empty(q.shape, np.float64)
    for a, b in split_points(n, cuts):
        qpos = np.arange(a, b)
        is_sealed = np.arange(b)[:, None, None] < sealed * cfg.G
        kk = np.where(is_sealed, k_hat[:b], k16[:b])
        vv = np.where(is_sealed, v_hat[:b], v16[:b])
        out[a:b] = dense_gqa(q[a:b], kk, vv, qpos, np.arange(b))
        while b - (sealed + 1) * cfg.G >= cfg.R:  # seal after attention
            lo = sealed * cfg.G
            for h in range(H):
                rec = {
                    "k_codes": np.zeros((D, cfg.G), np.uint8),
                    "k_d": [],
                    "k_m": [],
                    "v_codes": [],
                    "v_d": [],
                    "v_m": [],
                }
                for c in range(D):
                    qc = quantize(k16[lo : lo + cfg.G, h, c].astype(np.float32), fk)
                    rec["k_codes"][c] = qc.codes[0]
                    rec["k_d"].append(qc.d[0])
                    rec["k_m"].append(qc.m[0])
                    k_hat[lo : lo + cfg.G, h, c] = dequantize(qc)
                for t in range(lo, lo + cfg.G):
                    row_codes, row_d, row_m = [], [], []
                    for j in range(0, D, cfg.Gv):
                        qt = quantize(v16[t, h, j : j + cfg.Gv].astype(np.float32), fv)
                        row_codes.append(qt.codes[0])
                        row_d.append(qt.d[0])
                        row_m.append(qt.m[0])
                        v_hat[t, h, j : j + cfg.Gv] = dequantize(qt)
                    rec["v_codes"].append(np.concatenate(row_codes))
                    rec["v_d"].append(row_d)
                    rec["v_m"].append(row_m)
                groups[h].append(rec)
            sealed += 1
    return out, groups


@SETTINGS
@given(
    cfg=configs,
    n=st.integers(1, 200),
    cuts=st.lists(st.integers(1, 199), max_size=4),
    kind=st.sampled_from(["normal", "outlier_channels", "ties", "constant"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_outlier_num_zero_is_block_kivi(cfg: OttConfig, n: int, cuts: list[int], kind: str, seed: int) -> None:
    """kivi2: outputs of every ubatch and the sealed codes equal an independent block-G KIVI with R..R+G-1 tail."""
    cfg = OttConfig.kivi2(bits=cfg.bits, G=cfg.G, R=cfg.R, Gv=cfg.Gv, aux_cap=cfg.aux_cap, v_rotate=False, k_mix=False)
    rng = np.random.default_rng(seed)
    H, nq, D = 2, 4, 64
    k, v = make_kv(rng, n, H, D, kind)
    q = rng.standard_normal((n, nq, D)).astype(np.float32)
    cache = OttCache(cfg, 1, H, D)
    out = run(cache, 0, 0, q, k, v, cuts)
    want, groups = kivi_reference(cfg, q, k, v, cuts)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)
    for h in range(H):
        s = cache.state(0, 0, h)
        assert s.n_sealed == len(groups[h]) == n_sealed_after(n, cfg)
        assert len(s.pool) == len(s.aux) == 0
        for g, rec in zip(s.groups, groups[h], strict=True):
            assert np.array_equal(g.k_codes, rec["k_codes"])
            assert f16_equal(g.k_scale, rec["k_d"]) and f16_equal(g.k_min, rec["k_m"])
            assert np.array_equal(g.v_codes, np.stack(rec["v_codes"]))
            assert f16_equal(g.v_scale, rec["v_d"]) and f16_equal(g.v_min, rec["v_m"])


@SETTINGS
@given(
    cfg=configs,
    n=st.integers(1, 260),
    cuts=st.lists(st.integers(1, 259), max_size=5),
    kind=st.sampled_from(["normal", "outlier_channels", "ties", "constant"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_identity_quantizer_is_dense_attention(cfg: OttConfig, n: int, cuts: list[int], kind: str, seed: int) -> None:
    """With quantization off, every ubatch's output equals dense causal attention over the fp16 K/V (GQA too)."""
    cfg = dataclasses.replace(cfg, identity=True)
    rng = np.random.default_rng(seed)
    H, nq, D = 2, 6, 64
    k, v = make_kv(rng, n, H, D, kind)
    q = rng.standard_normal((n, nq, D)).astype(np.float32)
    cache = OttCache(cfg, 1, H, D)
    out = run(cache, 0, 0, q, k, v, cuts)
    want = dense_gqa(q, k.astype(np.float16), v.astype(np.float16), np.arange(n), np.arange(n))
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)
    # and the placeholders really hold the mean (so a placeholder leaking into the output would show up)
    for h in range(H):
        check_against_model(
            cache.state(0, 0, h), cfg, cfg.outlier_num, k[:, h].astype(np.float16), v[:, h].astype(np.float16)
        )


@SETTINGS
@given(
    cfg=configs,
    n=st.integers(1, 260),
    cuts=st.lists(st.integers(1, 259), max_size=4),
    kind=st.sampled_from(["normal", "outlier_channels", "ties"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_ubatch_attends_before_sealing_with_cover(
    cfg: OttConfig, n: int, cuts: list[int], kind: str, seed: int
) -> None:
    """Each ubatch's output is dense attention over the state before it (rebuilt from codes, scales, mins and
    pools: every pooled token contributes its exact fp16 K and V, no placeholder) plus its own fp16 tokens."""
    rng = np.random.default_rng(seed)
    H, nq, D = 2, 4, 64
    k, v = make_kv(rng, n, H, D, kind)
    q = rng.standard_normal((n, nq, D)).astype(np.float32)
    cache = OttCache(cfg, 1, H, D)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    for a, b in split_points(n, cuts):
        before = [cache.state(0, 0, h) for h in range(H)]
        out = cache.process_ubatch(0, 0, q[a:b], k[a:b], v[a:b], np.arange(a, b))
        kk = np.empty((b, H, D))
        vv = np.empty((b, H, D))
        for h, s in enumerate(before):
            kk[:a, h], vv[:a, h] = served_from_fields(s, cfg)
        kk[a:], vv[a:] = k16[a:b], v16[a:b]
        want = dense_gqa(q[a:b], kk, vv, np.arange(a, b), np.arange(b))
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)
        # the same through attend() on a state, for a query at every position seen so far
        for h in range(H):
            s = cache.state(0, 0, h)
            sk, sv = served_from_fields(s, cfg)
            qq = rng.standard_normal((4, D)).astype(np.float32)
            qp = rng.integers(0, b, size=4)
            np.testing.assert_allclose(
                attend(s, qq, qp), dense_attention(qq, np.arange(b), sk, sv, qp), rtol=1e-4, atol=2e-5
            )


# ------------------------------------------------------------------------------------------ ubatch splitting


@SETTINGS
@given(
    cfg=configs,
    n=st.integers(2, 300),
    cuts_a=st.lists(st.integers(1, 299), max_size=5),
    cuts_b=st.lists(st.integers(1, 299), max_size=5),
    kind=st.sampled_from(["normal", "outlier_channels", "ties"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_ubatch_splitting(cfg: OttConfig, n: int, cuts_a: list[int], cuts_b: list[int], kind: str, seed: int) -> None:
    """What must hold when a prompt is split differently into ubatches:
    - the final state is bit-identical for any two splits (sealing depends only on the inputs and on the number of
      sealed groups, floor((n - R) / G), not on when a group was sealed);
    - a token's output is the same in both runs whenever its ubatch started with the same number of sealed groups
      (in particular for every token, when no group is sealed before the last ubatch of either run)."""
    rng = np.random.default_rng(seed)
    H, nq, D = 2, 2, 64
    k, v = make_kv(rng, n, H, D, kind)
    q = rng.standard_normal((n, nq, D)).astype(np.float32)
    outs, sealed_before = [], []
    caches = []
    for cuts in (cuts_a, cuts_b):
        cache = OttCache(cfg, 1, H, D)
        outs.append(run(cache, 0, 0, q, k, v, cuts))
        caches.append(cache)
        per_token = np.empty(n, np.int64)
        for a, b in split_points(n, cuts):
            per_token[a:b] = n_sealed_after(a, cfg)
        sealed_before.append(per_token)
    for h in range(H):
        assert_state_equal(caches[0].state(0, 0, h), caches[1].state(0, 0, h))
    same = sealed_before[0] == sealed_before[1]
    assert same[0]  # the first ubatch of both runs starts from an empty cache
    np.testing.assert_allclose(outs[0][same], outs[1][same], rtol=1e-4, atol=2e-5)  # fp32, differently shaped


def test_split_outputs_differ_only_through_sealing() -> None:
    """Adversarial: a split that seals before the last ubatch does change later outputs (the check above bites)."""
    cfg = OttConfig(G=32, R=4, Gv=32, no_outlier_layers=0)
    rng = np.random.default_rng(7)
    n, H, D = 80, 1, 64
    k, v = make_kv(rng, n, H, D, "outlier_channels")
    q = rng.standard_normal((n, 1, D)).astype(np.float32)
    one = run(OttCache(cfg, 1, H, D), 0, 0, q, k, v, [])
    two = run(OttCache(cfg, 1, H, D), 0, 0, q, k, v, [40])
    np.testing.assert_allclose(one[:40], two[:40], rtol=1e-4, atol=2e-5)
    assert not np.allclose(one[40:], two[40:], rtol=1e-4, atol=2e-5)


# --------------------------------------------------------------------------------------------- adversarial


def test_constant_groups_zero_range_and_tie_order() -> None:
    """All tokens identical (and each V group constant): scale 0, codes 0, exact reconstruction; every score ties:
    the earliest positions win, also against later groups."""
    cfg = OttConfig(G=32, R=8, Gv=32, outlier_num=3, no_outlier_layers=0, v_rotate=False)
    n, H, D = 200, 1, 64
    rng = np.random.default_rng(1)
    row_k = rng.standard_normal(D).astype(np.float16)
    row_v = np.repeat(rng.standard_normal(D // 32), 32).astype(np.float16)  # V groups are within a token
    k = np.broadcast_to(row_k.astype(np.float32), (n, H, D)).copy()
    v = np.broadcast_to(row_v.astype(np.float32), (n, H, D)).copy()
    q = rng.standard_normal((n, 2, D)).astype(np.float32)
    cache = OttCache(cfg, 1, H, D)
    out = run(cache, 0, 0, q, k, v, [50, 120])
    s = cache.state(0, 0, 0)
    assert s.n_sealed == (n - cfg.R) // cfg.G
    assert s.pool.pos.tolist() == [0, 1, 2] and len(s.aux) == 0 and s.tracing
    for g in s.groups:
        assert not g.k_codes.any() and not g.v_codes.any()
        assert not g.k_scale.any() and not g.v_scale.any()
        assert f16_equal(g.k_min, row_k) and np.array_equal(g.k_hat, np.broadcast_to(row_k.astype(np.float32), (32, D)))
        assert np.array_equal(g.v_hat, np.broadcast_to(row_v.astype(np.float32), (32, D)))
    np.testing.assert_allclose(out, np.broadcast_to(row_v.astype(np.float32), out.shape), rtol=1e-6, atol=1e-6)
    check_against_model(s, cfg, 3, k[:, 0].astype(np.float16), v[:, 0].astype(np.float16))


def test_constant_channel_zero_range() -> None:
    """One constant channel among varying ones: that channel's scale is 0, its codes 0, nothing is NaN."""
    cfg = OttConfig(G=32, R=0, Gv=32, no_outlier_layers=0, v_rotate=False)
    rng = np.random.default_rng(2)
    k, v = make_kv(rng, 64, 1, 64, "normal")
    k[:, 0, 9] = -3.5
    v[:, 0, :32] = 0.0  # one whole V group per token is zero
    cache = OttCache(cfg, 1, 1, 64)
    run(cache, 0, 0, None, k, v, [])
    s = cache.state(0, 0, 0)
    for g in s.groups:
        assert g.k_scale[9] == 0 and not g.k_codes[9].any() and g.k_min[9] == np.float16(-3.5)
        assert not g.v_scale[:, 0].any() and not g.v_codes[:, :32].any()
        assert np.isfinite(g.k_hat).all() and np.isfinite(g.v_hat).all()
        assert (g.k_hat[:, 9] == -3.5).all()


def signed_permutations(rng: np.random.Generator, base: np.ndarray, n: int) -> np.ndarray:
    """n rows with the same multiset of |values| as base: exactly equal L1 scores."""
    rows = np.stack([rng.permutation(base) for _ in range(n)])
    return rows * rng.choice([-1.0, 1.0], size=rows.shape)


def test_ties_go_to_the_earlier_position() -> None:
    """Equal scores inside a group, and between a pool member and a later group's token: the earlier wins."""
    cfg = OttConfig(G=32, R=0, Gv=32, outlier_num=2, aux_cap=4, no_outlier_layers=0)
    rng = np.random.default_rng(3)
    D = 64
    k = (rng.standard_normal((96, D)) * 4).astype(np.float32)
    small = rng.standard_normal(D).astype(np.float16).astype(np.float32) * np.float32(0.1)
    tie = signed_permutations(rng, small, 5)
    k[[20, 7, 40, 33, 70]] = tie  # group 0: positions 7 and 20 tie; groups 1, 2: later ties
    v = rng.standard_normal((96, D)).astype(np.float32)
    cache = OttCache(cfg, 1, 1, D)
    run(cache, 0, 0, None, k[:, None], v[:, None], [])
    s = cache.state(0, 0, 0)
    assert len({float(x) for x in s.pool.score}) == 1
    assert s.pool.pos.tolist() == [7, 20]
    assert [g.placeholders.tolist() for g in s.groups] == [[7, 20], [], []]
    assert len(s.aux) == 0
    check_against_model(s, cfg, 2, k.astype(np.float16), v.astype(np.float16))


@pytest.mark.parametrize("aux_cap,stop_group", [(4, 2), (6, 3), (9, 4)])
def test_aux_pool_overflow_stops_tracing(aux_cap: int, stop_group: int) -> None:
    """Every group brings 3 smaller keys, so 3 pool members lose each time. When the aux pool cannot take them,
    that group runs no competition (quantized unchanged), tracing stops, and every token is still served."""
    # k_mix 1: 2-bit keys uniform, so a group that runs no competition is compared with plain 2-bit codes
    cfg = OttConfig(G=32, R=0, Gv=32, outlier_num=3, aux_cap=aux_cap, no_outlier_layers=0, k_mix=1)
    rng = np.random.default_rng(4)
    n_groups, D = 5, 64
    k = rng.standard_normal((n_groups * 32, D)).astype(np.float32) * 5
    base = rng.standard_normal((3, D)).astype(np.float16).astype(np.float32)
    for g in range(n_groups):
        k[g * 32 + 10 : g * 32 + 13] = base * np.float32(2.0 ** -(g + 1))  # exactly half the scores each group
    v = rng.standard_normal(k.shape).astype(np.float32)
    cache = OttCache(cfg, 1, 1, D)
    run(cache, 0, 0, None, k[:, None], v[:, None], [])
    s = cache.state(0, 0, 0)
    winners = [list(range(g * 32 + 10, g * 32 + 13)) for g in range(n_groups)]
    assert not s.tracing
    assert [g.placeholders.tolist() for g in s.groups] == winners[:stop_group] + [[]] * (n_groups - stop_group)
    assert s.pool.pos.tolist() == winners[stop_group - 1]
    assert s.aux.pos.tolist() == sum(winners[: stop_group - 1], [])
    for g in s.groups[stop_group:]:  # quantized plainly
        qk = quantize(
            k[g.index * 32 : (g.index + 1) * 32].astype(np.float16).astype(np.float32).T,
            BlockFormat(2, 32, K_CLIP64[2]),
        )
        assert np.array_equal(g.k_codes, qk.codes[:, 0])
    _, sk, sv = s.served()
    pooled = np.concatenate([s.pool.pos, s.aux.pos])
    assert f16_equal(sk[pooled], k[pooled]) and f16_equal(sv[pooled], v[pooled])
    check_against_model(s, cfg, 3, k.astype(np.float16), v.astype(np.float16))


def test_planted_outlier_is_caught_and_narrows_the_channel() -> None:
    """A token with a tiny key in a large channel wins the pool; the channel's range shrinks vs KIVI, and the
    non-outlier mean keeps each channel's range that of the non-outlier tokens."""
    D, G = 64, 32
    rng = np.random.default_rng(5)
    k = rng.standard_normal((G + 8, D)).astype(np.float32)
    k[:, 5] = 40 + rng.standard_normal(G + 8).astype(np.float32)
    k[13] *= np.float32(0.05)  # the planted outlier token: its channel 5 is ~2 instead of ~40
    v = rng.standard_normal(k.shape).astype(np.float32)
    states = {}
    for name, cfg in {
        # k_mix 1 (2-bit keys uniform): the scales below are those of one 2-bit format per channel
        "ott": OttConfig(G=G, R=8, Gv=32, no_outlier_layers=0, k_mix=1),
        "all": OttConfig(G=G, R=8, Gv=32, no_outlier_layers=0, mean="all", k_mix=1),
        "kivi": OttConfig.kivi2(G=G, R=8, Gv=32, k_mix=1),
    }.items():
        cache = OttCache(cfg, 1, 1, D)
        run(cache, 0, 0, None, k[:, None], v[:, None], [])
        states[name] = cache.state(0, 0, 0)
    ott, kivi = states["ott"].groups[0], states["kivi"].groups[0]
    assert 13 in states["ott"].pool.pos.tolist()
    assert float(ott.k_scale[5]) < 0.25 * float(kivi.k_scale[5])
    others = np.delete(np.arange(G), ott.placeholders)
    k16 = k[:G].astype(np.float16).astype(np.float32)
    # the placeholders (the others' mean) lie inside the others' range: scale and min are those of the others alone
    fmt = BlockFormat(2, G, K_CLIP64[2])
    mn, w = k16[others].min(axis=0), k16[others].max(axis=0) - k16[others].min(axis=0)
    assert f16_equal(ott.k_min, mn + w * np.float32(fmt.clip_offset))
    assert f16_equal(ott.k_scale, (w * np.float32(fmt.clip_scale)) / np.float32(3))
    err_ott = np.abs(ott.k_hat[others, 5] - k16[others, 5]).mean()
    err_kivi = np.abs(kivi.k_hat[others, 5] - k16[others, 5]).mean()
    assert err_ott < 0.5 * err_kivi
    # the paper's "mean of all tokens" drags the placeholder toward the outlier: a different group
    assert not np.array_equal(states["all"].groups[0].k_codes, ott.k_codes)


def test_extreme_magnitudes() -> None:
    """Keys and values near the fp16 maximum and in its subnormals: finite scales, exact pools, dense equality
    with the identity quantizer, and out-of-range inputs refused."""
    rng = np.random.default_rng(6)
    n, H, D = 200, 2, 64
    k, v = make_kv(rng, n, H, D, "magnitudes")
    k[5, 0] = 60000.0
    k[6, 0] = -60000.0
    k[7, 0] = 6e-8  # the smallest fp16 subnormal
    q = (rng.standard_normal((n, 2, D)) * 1e-4).astype(np.float32)
    for identity in (False, True):
        cfg = OttConfig(G=32, R=8, Gv=32, outlier_num=3, aux_cap=6, no_outlier_layers=0, identity=identity)
        cache = OttCache(cfg, 1, H, D)
        out = run(cache, 0, 0, q, k, v, [33, 100])
        assert np.isfinite(out).all()
        for h in range(H):
            check_against_model(cache.state(0, 0, h), cfg, 3, k[:, h].astype(np.float16), v[:, h].astype(np.float16))
        if identity:
            want = dense_gqa(q, k.astype(np.float16), v.astype(np.float16), np.arange(n), np.arange(n))
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError):
        OttCache(OttConfig(), 1, 1, 64).process_ubatch(0, 0, None, np.full((1, 1, 64), 1e5), np.zeros((1, 1, 64)), [0])


# -------------------------------------------------------------------------------------------------- seq_rm


def fed(cache: OttCache, k: np.ndarray, v: np.ndarray, cuts: list[int], seq: int = 0) -> None:
    run(cache, seq, 0, None, k, v, cuts)


@pytest.mark.parametrize("kivi", [False, True])
@pytest.mark.parametrize("p0", [1, 31, 33, 45, 64, 90, 127, 128, 150, 170, 199, 200, 210, 219, 220, 300])
def test_seq_rm_cuts_only_where_a_fresh_run_holds_the_same(p0: int, kivi: bool) -> None:
    """seq_rm(p0) is accepted exactly when S(p0) >= the groups sealed (no sealed group cut or dropped) or p0 is at
    or past the end: then continuing equals a fresh run over the kept tokens, state for state. Any other cut is
    refused and changes nothing (a fresh run would hold some sealed tokens in fp16)."""
    cfg = OttConfig(G=32, R=8, Gv=32, outlier_num=0 if kivi else 2, aux_cap=8, no_outlier_layers=0)
    rng = np.random.default_rng(100 + p0)
    n, H, D = 220, 2, 64
    k, v = make_kv(rng, n, H, D, "outlier_channels")
    k[[3, 40, 41, 75, 99, 130]] *= np.float32(0.01)  # pooled tokens in several groups, some lose to later ones
    k2, v2 = make_kv(rng, 100, H, D, "outlier_channels")
    cache = OttCache(cfg, 1, H, D)
    fed(cache, k, v, [60, 130])
    before = [cache.state(0, 0, h) for h in range(H)]
    assert before[0].n_sealed == 6 == sealed_at(n, cfg)
    ok = cache.seq_rm(0, p0)
    assert ok == (p0 >= 200), p0  # S(p0) = (p0 - 8) // 32 >= 6 from 200 on
    if not ok:
        for h in range(H):
            assert_state_equal(cache.state(0, 0, h), before[h])
        return
    keep = min(p0, n)
    fed(cache, k2, v2, [7])
    fresh = OttCache(cfg, 1, H, D)
    fed(fresh, np.concatenate([k[:keep], k2]), np.concatenate([v[:keep], v2]), [])
    for h in range(H):
        assert_state_equal(cache.state(0, 0, h), fresh.state(0, 0, h))


@pytest.mark.parametrize("n_ubatch", [1, 7, 32, 100, 512])
def test_outputs_do_not_depend_on_batching(n_ubatch: int) -> None:
    """Batch invariance: a prompt processed as one batch (split by the cache at R + kG), in random batches, or
    token by token gives the same outputs and the same state; each batch's ubatches never cross R + kG."""
    cfg = OttConfig(G=32, R=8, Gv=32, outlier_num=2, aux_cap=8, no_outlier_layers=0)
    rng = np.random.default_rng(n_ubatch)
    n, H, D = 230, 2, 64
    k, v = make_kv(rng, n, H, D, "outlier_channels")
    q = rng.standard_normal((n, 4, D)).astype(np.float32)
    one = OttCache(cfg, 1, H, D)
    token = OttCache(cfg, 1, H, D)
    batches = OttCache(cfg, 1, H, D)
    want = np.concatenate([token.process_ubatch(0, 0, q[i : i + 1], k[i : i + 1], v[i : i + 1], [i]) for i in range(n)])
    got = one.process_batch(0, 0, q, k, v, np.arange(n), n_ubatch)
    cuts = [0, *sorted(rng.choice(np.arange(1, n), 6, replace=False).tolist()), n]
    parts = [
        batches.process_batch(0, 0, q[a:b], k[a:b], v[a:b], np.arange(a, b), n_ubatch)
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # fp32 matmuls of other shapes
    np.testing.assert_allclose(np.concatenate(parts), want, rtol=1e-5, atol=1e-5)
    for h in range(H):
        assert_state_equal(one.state(0, 0, h), token.state(0, 0, h))
        assert_state_equal(batches.state(0, 0, h), token.state(0, 0, h))
    for a, b in ubatch_splits(0, n, cfg, n_ubatch):
        assert b - a <= n_ubatch and sealed_at(a, cfg) == sealed_at(b - 1, cfg)


@pytest.mark.parametrize("p0", [45, 50, 59])
def test_seq_rm_within_tail_equals_fresh_run(p0: int) -> None:
    """ott2: removing only tail positions leaves the sealed state untouched: continuing equals a fresh run."""
    cfg = OttConfig(G=32, R=8, Gv=32, outlier_num=2, aux_cap=4, no_outlier_layers=0)
    rng = np.random.default_rng(p0)
    H, D = 2, 64
    k, v = make_kv(rng, 60, H, D, "outlier_channels")
    k2, v2 = make_kv(rng, 90, H, D, "outlier_channels")
    cache = OttCache(cfg, 1, H, D)
    fed(cache, k, v, [])
    assert cache.state(0, 0, 0).n_sealed == 1
    assert cache.seq_rm(0, p0)
    fed(cache, k2, v2, [5])
    fresh = OttCache(cfg, 1, H, D)
    fed(fresh, np.concatenate([k[:p0], k2]), np.concatenate([v[:p0], v2]), [])
    for h in range(H):
        assert_state_equal(cache.state(0, 0, h), fresh.state(0, 0, h))


def test_seq_rm_everything_and_past_the_end() -> None:
    cfg = OttConfig(G=32, R=8, Gv=32, outlier_num=2, aux_cap=0, no_outlier_layers=0)
    rng = np.random.default_rng(9)
    k, v = make_kv(rng, 140, 1, 64, "outlier_channels")
    cache = OttCache(cfg, 1, 1, 64)
    fed(cache, k, v, [])
    before = cache.state(0, 0, 0)
    assert cache.seq_rm(0, 500)  # nothing at or after 500: no change
    assert_state_equal(cache.state(0, 0, 0), before)
    assert not cache.seq_rm(0, 100)  # would cut sealed group 2 (64..95): refused, no change
    assert_state_equal(cache.state(0, 0, 0), before)
    assert cache.seq_rm(0, 0)  # everything: a fresh sequence, tracing on again
    assert cache.n_pos(0) == 0 and cache.state(0, 0, 0).tracing
    fed(cache, k, v, [70])
    assert_state_equal(cache.state(0, 0, 0), before)


# ------------------------------------------------------------------------------------ sequences and layers


def test_sequences_are_independent() -> None:
    """Interleaved ubatches of three sequences, and a seq_rm on one, give each the state it has alone."""
    cfg = OttConfig(G=32, R=8, Gv=32, outlier_num=3, aux_cap=4, no_outlier_layers=1)
    rng = np.random.default_rng(10)
    H, D, L = 2, 64, 2
    data = [make_kv(rng, 150, H, D, kind) for kind in ("outlier_channels", "ties", "normal")]
    qs = [rng.standard_normal((150, 4, D)).astype(np.float32) for _ in data]
    shared = OttCache(cfg, L, H, D)
    outs: dict[tuple[int, int], list[np.ndarray]] = {}
    for a, b in [(0, 40), (40, 41), (41, 100), (100, 150)]:
        for seq in (2, 0, 1):
            k, v = data[seq]
            for layer in range(L):
                o = shared.process_ubatch(seq, layer, qs[seq][a:b], k[a:b], v[a:b], np.arange(a, b))
                outs.setdefault((seq, layer), []).append(o)
    assert shared.seq_rm(1, 140)  # in the tail: S(140) = 4 groups stay sealed
    for seq, (k, v) in enumerate(data):
        alone = OttCache(cfg, L, H, D)
        for layer in range(L):
            want = run(alone, 0, layer, qs[seq], k, v, [40, 41, 100])
            np.testing.assert_array_equal(np.concatenate(outs[(seq, layer)]), want)
        if seq == 1:
            assert alone.seq_rm(0, 140)
        for layer in range(L):
            for h in range(H):
                assert_state_equal(shared.state(seq, layer, h), alone.state(0, layer, h))


def test_no_outlier_layers_never_pool() -> None:
    """Layers below no_outlier_layers are plain KIVI (bit-identical to kivi2); the others pool."""
    cfg = OttConfig(G=32, R=8, Gv=32, outlier_num=3, aux_cap=4, no_outlier_layers=2)
    rng = np.random.default_rng(11)
    H, D, L = 2, 64, 4
    k, v = make_kv(rng, 150, H, D, "outlier_channels")
    cache = OttCache(cfg, L, H, D)
    kivi = OttCache(OttConfig.kivi2(G=32, R=8, Gv=32, aux_cap=4), 1, H, D)
    fed(kivi, k, v, [])
    for layer in range(L):
        run(cache, 0, layer, None, k, v, [20])
    for h in range(H):
        for layer in range(L):
            s = cache.state(0, layer, h)
            if layer < 2:
                assert len(s.pool) == len(s.aux) == 0 and s.tracing
                assert_state_equal(s, kivi.state(0, 0, h))
            else:
                assert len(s.pool) == 3
                check_against_model(s, cfg, 3, k[:, h].astype(np.float16), v[:, h].astype(np.float16))


# ------------------------------------------------------------------------------------------ memory and API


def test_effective_bits() -> None:
    cfg = OttConfig(G=128, R=32, Gv=128)
    D = 128
    # 160 positions: one sealed group (128) and a 32-token tail; 35 pool slots; k_mix's 2-bit width per channel
    want = 2 * 128 * D * 2 + 32 * D * 128 / 128 + 32 * 128 * D / 128 + 2 * 16 * D * 32 + 35 * (2 * 16 * D + 64)
    assert sum(memory_bits(cfg, D, 160).values()) == want + 2 * D
    assert sum(memory_bits(cfg.replace(k_mix=1), D, 160).values()) == want
    cfg = cfg.replace(k_mix=1)  # below: uniform 2-bit keys, the spec's 2.25 bits
    assert effective_bits(cfg, D, 160) == want / (2 * 160 * D)
    assert abs(effective_bits(cfg, D, 128 * 100_000 + 32) - 2.25) < 1e-3  # the spec's 2.25
    kivi = OttConfig.kivi2(G=128, R=32, Gv=128)
    assert memory_bits(kivi, D, 160)["pools"] == 0
    # a 4-layer model: two layers without pools
    per_layer = [sum(memory_bits(cfg, D, 500, layer).values()) for layer in range(4)]
    assert per_layer[0] == per_layer[1] < per_layer[2] == per_layer[3]
    assert effective_bits(cfg, D, 500, n_layer=4) == sum(per_layer) / (4 * 2 * 500 * D)
    # fewer than R + G positions: everything in the fp16 tail (16 bits) plus the pools
    assert effective_bits(kivi, D, 100) == 16.0


# ---------------------------------------------------------------------------------- K widths per channel


def test_k_mix_widths_keep_the_bits_and_follow_the_rule() -> None:
    rng = np.random.default_rng(5)
    cfg = OttConfig(k_bits=3, k_mix=True)
    for D in (64, 256):
        k = (rng.standard_normal((128, D)) * rng.lognormal(0, 1.5, D)).astype(np.float16)
        w = key_widths(k, cfg)
        assert w.dtype == np.uint8 and int(w.sum()) == 3 * D
        assert [int((w == b).sum()) for b in (2, 3, 4)] == [D // 4, D // 2, D // 4]
        assert w.tolist() == model_key_widths(k.astype(np.float32))
    # all channels alike: ties go to the lower channel, so the first quarter is widened, the last narrowed
    assert key_widths(np.ones((128, 8), np.float16), cfg).tolist() == [4, 4, 3, 3, 3, 3, 2, 2]
    # only groups of 3-bit keys mix widths; other widths quantize as without k_mix
    assert cfg.k_mixed and not OttConfig(k_bits=4, k_mix=True).k_mixed and not OttConfig(k_mix=True).k_mixed
    with pytest.raises(ValueError, match="k_mix and k_rotate"):
        OttConfig(k_bits=3, k_mix=True, k_rotate=True)
    with pytest.raises(ValueError, match="k_mix must be False/0, True/1"):
        OttConfig(k_mix=3)
    with pytest.raises(ValueError, match="k_mix must be False/0, True/1"):
        OttConfig(k_mix=1.0)  # type: ignore[arg-type]
    assert OttConfig(k_mix=2) == OttConfig() and not OttConfig(k_mix=0, k_bits=3).k_mixed


def test_k_mix_2_mixes_2_bit_keys_as_the_study_option() -> None:
    """k_mix=2 (docs/long-context-keys.md): groups of 2-bit keys get 1/2/3-bit channels in quarters, bit for bit
    KeyMix() (the measured study option); 3-bit keys keep k_mix's 2/3/4; ott2's default since
    the 8k measurement (docs/long-context-keys.md); the width table is counted in the bytes."""
    rng = np.random.default_rng(52)
    G = 128
    cfg = OttConfig(k_mix=2, outlier_num=0)
    assert cfg.k_mixed and cfg.replace(k_bits=3).k_mixed and not cfg.replace(k_bits=4).k_mixed
    assert OttConfig().k_mixed and not OttConfig(k_mix=1).k_mixed  # the default mixes 2-bit keys; level 1 does not
    for D in (64, 128):
        k = (rng.standard_normal((G, D)) * rng.lognormal(0, 1.5, D)).astype(np.float16)
        got = quantize_keys(k, cfg)
        want = quantize_keys(k, OttConfig(outlier_num=0, k_mix=1), KeyMix())
        assert got[5] is not None and [int((got[5] == b).sum()) for b in (1, 2, 3)] == [D // 4, D // 2, D // 4]
        for a, b in zip(got, want, strict=True):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b)
            else:
                assert a == b
        assert key_widths(k, cfg).tolist() == got[5].tolist()
        # the 1-bit channels are the cache's 1-bit block format (clipped to K_CLIP64[1] = K1_CLIP64)
        c1 = np.flatnonzero(got[5] == 1)
        q1 = quantize(k.astype(np.float32).T[c1], BlockFormat(1, G, K_CLIP64[1]))
        np.testing.assert_array_equal(got[0][c1], q1.codes.reshape(len(c1), G))
        assert K_CLIP64[1] == K1_CLIP64 == 16
        # k_mix 2 on 3-bit keys is k_mix 1's
        k3 = quantize_keys(k, cfg.replace(k_bits=3))
        for a, b in zip(k3, quantize_keys(k, OttConfig(k_bits=3, outlier_num=0)), strict=True):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b)
        # bytes: the codes of 2-bit keys plus a 2-bit width per channel and group
        mixed, plain = memory_bits(cfg, D, 4096), memory_bits(OttConfig(k_mix=1), D, 4096)
        assert mixed["codes"] == plain["codes"] and mixed["k_widths"] == 2 * D * 31 and plain["k_widths"] == 0
    # a whole cache seals 2-bit groups mixed, and serves what the codes decode to
    cache = OttCache(cfg, 1, 1, 64)
    kk = (rng.standard_normal((300, 1, 64)) * rng.lognormal(0, 1.0, 64)).astype(np.float32)
    cache.process_ubatch(0, 0, None, kk, kk[::-1].copy(), np.arange(300))
    st = cache.state(0, 0, 0)
    assert st.n_sealed == 2 and all(g.k_widths is not None and int(g.k_widths.sum()) == 128 for g in st.groups)
    for g in st.groups:
        np.testing.assert_array_equal(dequantize_group(g, cfg)[0], g.k_hat)


def test_k_mix_lowers_the_score_error_at_the_same_code_bits() -> None:
    """Keys whose channels differ in scale (as real keys do, docs/k-channel-widths.md): moving bits from the
    narrow channels to the wide ones lowers the error of q.k for queries of the same shape."""
    rng = np.random.default_rng(11)
    D, G = 64, 128
    scale = rng.lognormal(0, 1.0, D)
    k = (rng.standard_normal((G, D)) * scale).astype(np.float16)
    q = rng.standard_normal((256, D)) * scale
    errs = {}
    for mix in (False, True):
        cfg = OttConfig(k_bits=3, k_mix=mix, outlier_num=0)
        codes, d, m, k_hat, _, widths = quantize_keys(k, cfg)
        assert (widths is not None) == mix
        errs[mix] = float(np.mean((q @ (k_hat - k.astype(np.float32)).T) ** 2))
        if mix:
            assert (codes < (1 << widths.astype(np.int64))[:, None]).all()
    assert errs[True] < 0.7 * errs[False]
    cfg = OttConfig(k_bits=3, k_mix=True)
    mixed, plain = memory_bits(cfg, D, 4096), memory_bits(cfg.replace(k_mix=False), D, 4096)
    assert mixed["codes"] == plain["codes"] and mixed["k_widths"] == 2 * D * 31 and plain["k_widths"] == 0


def test_key_mix_study_option_widths_error_and_default() -> None:
    """KeyMix (issue 51's study option, docs/long-context-keys.md): 2-bit keys with widths exactly 1/2/3 in the
    quarters of the k_mix ranking, each width's error bounded by its own step; KeyMix(3, 2, 4) is k_mix; without
    a mix, k_mix 1 leaves 2-bit keys uniform."""
    rng = np.random.default_rng(51)
    G = 128
    for D in (64, 256):
        k = (rng.standard_normal((G, D)) * rng.lognormal(0, 1.5, D)).astype(np.float16)
        kf = k.astype(np.float32)
        cfg = OttConfig(outlier_num=0, k_mix=1)  # 2-bit keys, clipped, k_mix 1 (which leaves 2-bit keys alone)
        mix = KeyMix()
        codes, d, m, k_hat, rotated, w = quantize_keys(k, cfg, mix)
        assert not rotated and w is not None and w.dtype == np.uint8
        assert [int((w == b).sum()) for b in (1, 2, 3)] == [D // 4, D // 2, D // 4] and int(w.sum()) == 2 * D
        # the same ranking as k_mix: 3 bits where k_mix gives 4, 1 bit where it gives 2
        w3 = key_widths(k, OttConfig(k_bits=3))
        assert (w.astype(int) == w3.astype(int) - 1).all()
        assert (codes < (1 << w.astype(np.int64))[:, None]).all()
        # error bounded: inside its clipped range a value is within half a step of its level, outside it within
        # the clipped-off part of the range plus half a step; steps from the stored scales
        rng_c = kf.max(0) - kf.min(0)
        clip = np.array([{1: K1_CLIP64, 2: K_CLIP64[2], 3: K_CLIP64[3]}[int(b)] for b in w]) / 64
        bound = rng_c * (1 - clip) / 2 + d.astype(np.float32) / 2 + 1e-3 * (np.abs(kf).max(0) + 1e-3)
        assert (np.abs(k_hat - kf) <= bound[None, :] * 1.0001).all()
        # 1-bit channels: two levels exactly, at min + range*(1-c)/2 and max - range*(1-c)/2 (fp16-rounded)
        c1 = int(np.flatnonzero(w == 1)[0])
        lo = np.float16(kf[:, c1].min() + rng_c[c1] * np.float32((64 - K1_CLIP64) / 128))
        assert set(np.unique(k_hat[:, c1]).tolist()) <= {float(lo), float(np.float32(lo) + np.float32(d[c1]))}
        # KeyMix(3, 2, 4) is k_mix, bit for bit
        cfg3 = OttConfig(k_bits=3, outlier_num=0)
        ref = quantize_keys(k, cfg3)
        got = quantize_keys(k, cfg3, KeyMix(bits=3, lo=2, hi=4))
        for a, b in zip(ref[:4], got[:4], strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ref[5], got[5])
        # k_mix 1 without a mix: plain clipped 2-bit keys, no widths table
        codes0, d0, m0, k_hat0, _, w0 = quantize_keys(k, cfg)
        q = quantize(kf.T, BlockFormat(2, G, K_CLIP64[2]))
        assert w0 is None
        np.testing.assert_array_equal(codes0, q.codes.reshape(D, G))
        np.testing.assert_array_equal(k_hat0, dequantize(q).reshape(D, G).T)
        # other proportions keep 2 bits on average: 1/2/4 with twice as many 1-bit as 4-bit channels, 0/2/3 with
        # half as many 0-bit (mean only) as 3-bit channels
        for other, want in (
            (KeyMix(hi=4, hi_div=8), {1: D // 4, 4: D // 8}),
            (KeyMix(lo=0, hi_div=8), {0: D // 16, 3: D // 8}),
        ):
            wo = quantize_keys(k, cfg, other)[5]
            assert int(wo.sum()) == 2 * D and all(int((wo == b).sum()) == n for b, n in want.items())
    with pytest.raises(ValueError, match="lo < bits < hi"):
        KeyMix(bits=2, lo=2)
    with pytest.raises(ValueError, match="whole channel count"):
        KeyMix(lo=0, hi_div=64).counts(64)  # one 3-bit channel would need half a 0-bit one


# ------------------------------------------------------------------------------- widths per side, rotations


def test_hadamard_rotation_is_orthonormal_symmetric_and_its_own_inverse() -> None:
    """The butterfly transform equals the orthonormal Sylvester-Hadamard matrix, block by block of 64 channels."""
    eye = np.eye(64, dtype=np.float32)
    H = hadamard_rotate(eye)  # row i = H e_i
    np.testing.assert_array_equal(H, H.T)
    np.testing.assert_allclose(H @ H, eye, atol=1e-6)
    assert set(np.unique(np.abs(H)).tolist()) == {0.125}  # +-1/8: every entry of an orthonormal H_64
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 256)).astype(np.float32) * 100
    y = hadamard_rotate(x)
    blocks = x.reshape(7, 4, 64) @ H  # block-diagonal: no mixing across blocks of 64
    np.testing.assert_allclose(y.reshape(7, 4, 64), blocks, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-6)
    np.testing.assert_allclose(hadamard_rotate(y), x, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of 64"):
        hadamard_rotate(np.zeros((2, 96), np.float32))


def test_rotation_leaves_the_pools_alone_and_spreads_a_value_outlier() -> None:
    """Scores stay on the raw keys: the same tokens are pooled with and without rotation, exact; with one large V
    channel the rotation spreads it over its block and the served values lose less."""
    rng = np.random.default_rng(3)
    n, H, D = 300, 1, 64
    k, v = make_kv(rng, n, H, D, "outlier_channels")
    v[:, :, 5] *= 40  # one large value channel: token-wise groups get a wide range
    base = OttConfig(G=32, R=8, Gv=32, outlier_num=3, aux_cap=8, no_outlier_layers=0, v_rotate=False)
    states = {}
    rot = dataclasses.replace(base, k_rotate=True, v_rotate=True, k_mix=False)
    for name, cfg in {"plain": base, "rot": rot}.items():
        cache = OttCache(cfg, 1, H, D)
        run(cache, 0, 0, None, k, v, [100])
        states[name] = cache.state(0, 0, 0)
        check_against_model(states[name], cfg, 3, k[:, 0].astype(np.float16), v[:, 0].astype(np.float16))
    for pool in ("pool", "aux"):
        a, b = getattr(states["plain"], pool), getattr(states["rot"], pool)
        assert a.pos.tolist() == b.pos.tolist() and f16_equal(a.k, b.k) and f16_equal(a.v, b.v)
    err = {}
    for name, st_ in states.items():
        _, served_v = st_.served()[1:]
        sealed = st_.n_sealed * st_.G
        want = v[:sealed, 0].astype(np.float16).astype(np.float32)
        err[name] = np.linalg.norm(served_v[:sealed] - want) / np.linalg.norm(want)
    assert err["rot"] < 0.95 * err["plain"], err  # measured 0.237 vs 0.264


def test_a_group_too_large_to_rotate_is_stored_unrotated() -> None:
    """fp16 values beyond 65504/8 can rotate to a scale or min fp16 cannot hold: such a key group is quantized
    unrotated (k_rotated False), and so is every V unit of it (scale sign bits clear), even the Gv block that alone
    would fit (Gv = 32: two blocks per 64-channel unit); nothing stored is ever infinite; an ordinary group is
    rotated."""
    cfg = OttConfig(G=32, R=0, Gv=32, outlier_num=0, no_outlier_layers=0, k_rotate=True, v_rotate=True, k_mix=False)
    rng = np.random.default_rng(5)
    k, v = make_kv(rng, 64, 1, 64, "normal")
    k[32:], v[32:] = 60000.0, 60000.0  # group 1: all channels aligned and large: 8 x 60000 overflows fp16, clipped too
    k[32:, :, 1::2] *= -1
    cache = OttCache(cfg, 1, 1, 64)
    run(cache, 0, 0, None, k, v, [])
    s = cache.state(0, 0, 0)
    assert [(g.k_rotated, g.v_rotated.shape) for g in s.groups] == [(True, (32, 2)), (False, (32, 2))]
    assert s.groups[0].v_rotated.all() and not s.groups[1].v_rotated.any()
    for g in s.groups:
        assert np.isfinite(g.k_scale).all() and np.isfinite(g.v_min).all() and np.isfinite(g.v_hat).all()
    check_against_model(s, cfg, 0, k[:, 0].astype(np.float16), v[:, 0].astype(np.float16))


@pytest.mark.parametrize("Gv", [32, 64, 128])
def test_v_rotation_is_decided_per_token_and_unit(Gv: int) -> None:
    """One token with 60000 in the 64 channels of block 0 (rotated: 8 x 60000 in one channel, beyond fp16): only
    that token's unit of max(Gv, 64) channels is stored unrotated (scale sign bits clear), every other unit rotated
    (sign bits set); decoding (|d|, then the rotated units rotated back) is close to the input."""
    cfg = OttConfig(G=32, R=0, Gv=Gv, outlier_num=0, no_outlier_layers=0, bits=2, v_rotate=True)
    rng = np.random.default_rng(11)
    D, U = 128, max(Gv, 64)
    k, v = make_kv(rng, 32, 1, D, "normal")
    v[5, 0, :64] = 60000.0
    cache = OttCache(cfg, 1, 1, D)
    run(cache, 0, 0, None, k, v, [])
    s = cache.state(0, 0, 0)
    (g,) = s.groups
    want = np.ones((32, D // Gv), bool)
    want[5, : U // Gv] = False  # the blocks of token 5's first unit
    assert np.array_equal(np.signbit(g.v_scale), want) and np.array_equal(g.v_rotated, want)
    assert np.isfinite(g.v_scale).all() and np.isfinite(g.v_min).all()
    check_against_model(s, cfg, 0, k[:, 0].astype(np.float16), v[:, 0].astype(np.float16))
    v16 = v[:, 0].astype(np.float16).astype(np.float32)
    _, v_dec = dequantize_group(g, cfg)
    assert np.array_equal(v_dec, g.v_hat)
    rel = np.linalg.norm(g.v_hat - v16, axis=1) / np.linalg.norm(v16, axis=1)
    assert rel.max() < 0.6, rel  # 2-bit codes
    assert rel[5] < 0.01, rel[5]  # dominated by the 60000s, which no rotation smeared
    if Gv <= 64:
        np.testing.assert_array_equal(g.v_hat[5, :64], 60000.0)  # an unrotated zero-range block: exact
        rel5 = np.linalg.norm(g.v_hat[5, U:] - v16[5, U:]) / np.linalg.norm(v16[5, U:])
        assert rel5 < 0.6, rel5  # token 5's other unit: rotated, ordinary


@pytest.mark.parametrize("kind", KINDS)
def test_without_v_rotate_every_v_scale_sign_bit_is_clear(kind: str) -> None:
    """Without v_rotate (rotated keys or not) V is stored as ever: no scale has its sign bit set."""
    rng = np.random.default_rng(7)
    k, v = make_kv(rng, 200, 2, 128, kind)
    for cfg in (
        OttConfig(G=32, R=8, Gv=32, no_outlier_layers=0, v_rotate=False),
        OttConfig(G=32, R=8, Gv=64, k_rotate=True, v_rotate=False, k_mix=False),
    ):
        cache = OttCache(cfg, 1, 2, 128)
        run(cache, 0, 0, None, k, v, [70])
        for h in range(2):
            s = cache.state(0, 0, h)
            assert s.n_sealed == 6
            for g in s.groups:
                assert not np.signbit(g.v_scale).any() and not g.v_rotated.any()
            on = cfg.outliers_for_layer(0)
            check_against_model(s, cfg, on, k[:, h].astype(np.float16), v[:, h].astype(np.float16))


def test_a_zero_range_rotated_block_keeps_its_flag() -> None:
    """A rotated unit whose rotated values are all equal gets scale 0, stored as -0.0 (the flag), and decodes
    exactly: a zero token, and a token 8c, 0, ..., 0 per 64 channels (rotated: c in every channel)."""
    cfg = OttConfig(G=32, R=0, Gv=32, outlier_num=0, no_outlier_layers=0, v_rotate=True)
    rng = np.random.default_rng(2)
    k, v = make_kv(rng, 32, 1, 128, "normal")
    v[3] = 0.0
    v[9] = 0.0
    v[9, 0, ::64] = 12.0  # rotated: 1.5 in every channel of both blocks of 64
    cache = OttCache(cfg, 1, 1, 128)
    run(cache, 0, 0, None, k, v, [])
    s = cache.state(0, 0, 0)
    (g,) = s.groups
    for t in (3, 9):
        assert (g.v_scale[t].view(np.uint16) == 0x8000).all()  # -0.0: zero scale, flag set
        assert g.v_rotated[t].all() and (g.v_codes[t] == 0).all()
    assert (g.v_min[9] == 1.5).all() and (g.v_min[3] == 0).all()
    assert g.v_rotated.all()
    _, v_dec = dequantize_group(g, cfg)
    for t in (3, 9):
        np.testing.assert_array_equal(g.v_hat[t], v[t, 0])
        np.testing.assert_array_equal(v_dec[t], v[t, 0])
    check_against_model(s, cfg, 0, k[:, 0].astype(np.float16), v[:, 0].astype(np.float16))


@pytest.mark.parametrize("Gv", [32, 64])
def test_v_sym_blocks_are_centred_and_smaller(Gv: int) -> None:
    """v_sym on 2-bit values: every V block decodes to (code - 1.5) * |d| (no stored min), rotated units keep their
    flag, an overflowing unit falls back to a symmetric full-range block, attention matches the naive model, and
    the V side costs 16 bits less per block (memory_bits); 3-bit values are untouched."""
    cfg = OttConfig(G=32, R=0, Gv=Gv, outlier_num=2, no_outlier_layers=0, bits=2, v_rotate=True, v_sym=True)
    rng = np.random.default_rng(5)
    D = 128
    k, v = make_kv(rng, 64, 1, D, "normal")
    v[5, 0, :64] = 60000.0  # token 5's first unit cannot be rotated (8 x 60000 overflows fp16)
    cache = OttCache(cfg, 1, 1, D)
    run(cache, 0, 0, None, k, v, [])
    s = cache.state(0, 0, 0)
    g = s.groups[0]
    d = np.abs(g.v_scale.astype(np.float32))
    np.testing.assert_array_equal(g.v_min, np.float32(-1.5) * d)
    per = max(Gv, 64) // Gv
    assert not g.v_rotated[5, :per].any() and g.v_rotated[np.arange(32) != 5].all()
    check_against_model(s, cfg, 2, k[:, 0].astype(np.float16), v[:, 0].astype(np.float16))
    _, v_dec = dequantize_group(g, cfg)
    assert np.array_equal(v_dec, g.v_hat)
    np.testing.assert_array_equal(g.v_hat[5, :64], 60000.0)  # full range: a constant block is its top level, a
    asym = cfg.replace(v_sym=False)
    bits_sym, bits_asym = memory_bits(cfg, D, 1000), memory_bits(asym, D, 1000)
    assert bits_asym["v_scale_min"] - bits_sym["v_scale_min"] == 16 * (1000 // 32 * 32) * D / Gv
    assert memory_bits(cfg.replace(v_bits=3), D, 1000) == memory_bits(asym.replace(v_bits=3), D, 1000)
    assert not cfg.replace(v_bits=3).v_symmetric and cfg.vr_format.sym and cfg.v_format.sym


@pytest.mark.parametrize("k_bits,v_bits", [(3, 2), (2, 3), (4, 2)])
def test_widths_per_side(k_bits: int, v_bits: int) -> None:
    """K and V codes of their own widths, in bits and in the error they leave; the memory counts each side's."""
    cfg = OttConfig(
        G=32, R=8, Gv=32, outlier_num=2, aux_cap=4, no_outlier_layers=0, k_bits=k_bits, v_bits=v_bits, k_mix=False
    )  # uniform widths (k_mix has its own tests)
    rng = np.random.default_rng(k_bits * 10 + v_bits)
    n, H, D = 200, 1, 64
    k, v = make_kv(rng, n, H, D, "normal")
    cache = OttCache(cfg, 1, H, D)
    run(cache, 0, 0, None, k, v, [64])
    s = cache.state(0, 0, 0)
    check_against_model(s, cfg, 2, k[:, 0].astype(np.float16), v[:, 0].astype(np.float16))
    assert max(int(g.k_codes.max()) for g in s.groups) == (1 << k_bits) - 1
    assert max(int(g.v_codes.max()) for g in s.groups) == (1 << v_bits) - 1
    two = OttConfig(G=32, R=8, Gv=32, outlier_num=2, aux_cap=4, no_outlier_layers=0)
    extra = memory_bits(cfg, D, 1000)["codes"] - memory_bits(two, D, 1000)["codes"]
    t_q = 32 * ((1000 - 8) // 32)
    assert extra == t_q * D * (k_bits + v_bits - 4)


def test_config_and_input_validation() -> None:
    with pytest.raises(ValueError):
        OttConfig(G=48)
    with pytest.raises(ValueError):
        OttConfig(Gv=16)
    with pytest.raises(ValueError):
        OttConfig(G=32, outlier_num=32)
    with pytest.raises(ValueError):
        OttConfig(mean="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k_bits must be one of"):
        OttConfig(k_bits=5)
    with pytest.raises(ValueError, match="v_rotate must be a bool"):
        OttConfig(v_rotate=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="v_sym needs v_rotate"):
        OttConfig(v_sym=True, v_rotate=False)
    with pytest.raises(ValueError, match="v_rotate needs Gv to be 32 or a multiple of 64"):
        OttConfig(Gv=96, v_rotate=True)
    OttConfig(Gv=96, v_rotate=False), OttConfig(Gv=192, v_rotate=True)  # fine
    with pytest.raises(ValueError, match=r"v_rotate needs the head dim to be a multiple of max\(Gv, 64\) = 64"):
        OttCache(OttConfig(Gv=32, v_rotate=True), 1, 1, 96)
    assert OttConfig(bits=3).kbits == OttConfig(bits=3).vbits == 3
    assert (OttConfig(bits=3, v_bits=2).kbits, OttConfig(bits=3, v_bits=2).vbits) == (3, 2)
    with pytest.raises(NotImplementedError, match="unrotated keys"):
        c = OttCache(OttConfig(G=32, Gv=32, k_rotate=True, k_mix=False), 1, 1, 64)
        z = np.zeros((1, 1, 64), np.float32)
        c.process_ubatch(0, 0, z, z, z, [0], int8_query=True)
    with pytest.raises(ValueError):
        OttCache(OttConfig(Gv=64, v_rotate=False), 1, 1, 96)
    assert OttConfig.kivi2().outlier_num == 0 and OttConfig().outliers_for_layer(1) == 0
    cache = OttCache(OttConfig(G=32, Gv=32), 1, 2, 64)
    z = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(ValueError):
        cache.process_ubatch(0, 0, None, z, z, [1, 2])  # must start at 0
    cache.process_ubatch(0, 0, None, z, z, [0, 1])
    with pytest.raises(ValueError):
        cache.process_ubatch(0, 0, None, z, z, [3, 4])  # a gap
    with pytest.raises(ValueError):
        cache.process_ubatch(0, 0, np.zeros((2, 3, 64), np.float32), z, z, [2, 3])  # 3 query heads for 2 KV heads


# --- keys by age (k_young) -----------------------------------------------------------------------------------------


def test_keys_by_age_hold_the_newest_groups_keys_at_3_bits() -> None:
    """k_young 2 on 2-bit keys: after 5 seals the two newest groups carry their keys again at 3 bits, exactly as the
    3-bit-key cache quantizes them (same outlier choice, same placeholders), and attention is served those; the
    older groups are ott2's. Layers with wider keys hold none, and the bytes count the ring of 2 groups."""
    rng = np.random.default_rng(11)
    D, H, G, R = 64, 2, 128, 32
    n = R + 5 * G
    k = (rng.standard_normal((n, H, D)) * rng.uniform(0.2, 4.0, D)).astype(np.float32)
    v = rng.standard_normal((n, H, D)).astype(np.float32)
    caches = {name: OttCache(cfg, 1, H, D) for name, cfg in
              (("young", OttConfig(k_young=2)), ("ott2", OttConfig()), ("3/2", OttConfig(k_bits=3)))}  # fmt: skip
    for c in caches.values():
        for a, b in ubatch_splits(0, n, c.config, 256):
            c.process_ubatch(0, 0, None, k[a:b], v[a:b], np.arange(a, b))
    for h in range(H):
        young, two, three = (caches[name].state(0, 0, h) for name in ("young", "ott2", "3/2"))
        assert young.n_sealed == 5
        assert [g.index for g in young.groups if g.young is not None] == [3, 4]
        _, k_served, _ = young.served()
        _, k_two, _ = two.served()
        _, k_three, _ = three.served()
        for g, g2, g3 in zip(young.groups, two.groups, three.groups, strict=True):
            np.testing.assert_array_equal(g.k_codes, g2.k_codes)  # the 2-bit codes are ott2's
            rows = slice(g.index * G, (g.index + 1) * G)
            if g.young is None:
                np.testing.assert_array_equal(k_served[rows], k_two[rows])
            else:
                np.testing.assert_array_equal(g.young.k_codes, g3.k_codes)
                np.testing.assert_array_equal(g.young.k_widths, g3.k_widths)
                np.testing.assert_array_equal(k_served[rows], k_three[rows])
    # the ring is allocated from the start: 2 groups of 3-bit mixed keys (codes, scale and min, widths)
    assert memory_bits(OttConfig(k_young=2), D, n)["young"] == 2 * (D * 3 * G + 32 * D + 2 * D)
    assert memory_bits(OttConfig(k_young=2, k_bits=3), D, n)["young"] == 0
    assert effective_bits(OttConfig(k_young=2), D, n) > effective_bits(OttConfig(), D, n)


def test_values_by_age_hold_the_newest_groups_values_at_3_bits() -> None:
    """v_young 2 on 2-bit values (symmetric blocks too): the two newest groups carry their values again at 3 bits,
    exactly as the 3-bit-value cache quantizes them (full-range blocks), and attention is served those; older groups
    and the keys are the plain cache's. The bytes count the ring."""
    rng = np.random.default_rng(12)
    D, H, G, R = 64, 1, 128, 32
    n = R + 4 * G
    k = (rng.standard_normal((n, H, D)) * rng.uniform(0.2, 4.0, D)).astype(np.float32)
    v = rng.standard_normal((n, H, D)).astype(np.float32)
    base = OttConfig(v_sym=True)
    caches = {name: OttCache(cfg, 1, H, D) for name, cfg in
              (("young", base.replace(v_young=2)), ("2/2", base), ("2/3", base.replace(v_bits=3)))}  # fmt: skip
    for c in caches.values():
        c.process_ubatch(0, 0, None, k, v, np.arange(n))
    young, two, three = (caches[name].state(0, 0, 0) for name in ("young", "2/2", "2/3"))
    assert [g.index for g in young.groups if g.young_v is not None] == [2, 3]
    assert all(g.young is None for g in young.groups)
    _, k_y, v_y = young.served()
    _, k_two, v_two = two.served()
    _, _, v_three = three.served()
    np.testing.assert_array_equal(k_y, k_two)
    for g, g3 in zip(young.groups, three.groups, strict=True):
        rows = slice(g.index * G, (g.index + 1) * G)
        if g.young_v is None:
            np.testing.assert_array_equal(v_y[rows], v_two[rows])
        else:
            np.testing.assert_array_equal(g.young_v.v_codes, g3.v_codes)
            np.testing.assert_array_equal(v_y[rows], v_three[rows])
    # 2 groups of G tokens, each D // Gv blocks of 3-bit codes with an fp16 scale and min
    assert memory_bits(base.replace(v_young=2), D, n)["young"] == 2 * G * (D * 3 + 32 * D // base.Gv)
