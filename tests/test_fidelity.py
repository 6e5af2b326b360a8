"""study.fidelity: the measurement code of docs/fidelity.md, on synthetic data (fast).

The q8_0/q4_0 emulation is compared bit for bit with the installed ggml; the fast evaluation (one served array per
scheme plus a per-query boundary) is compared with OttCache.process_ubatch run the slow way, in decode (one-token
ubatches) and ubatch mode; the pipeline runs end to end on a small synthetic capture.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from native_kernels import ggml_quantize_rows

from ott_gguf import reference as ref
from study import fidelity as F

GGML_TYPE_Q4_0 = 2
GGML_TYPE_Q8_0 = 8


def ggml_quantize(type_: int, x: np.ndarray, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(blocks (n/32, block_bytes) from ggml_quantize_chunk, their to_float) for rows of 64 values."""
    blocks, back = ggml_quantize_rows(type_, x, 64)
    assert blocks.shape[1] == block_bytes
    return blocks, back


def awkward_rows(rng: np.random.Generator) -> np.ndarray:
    """Rows of 64 with the cases the rounding rules decide: zeros, ties, signs of the max, huge and tiny values."""
    x = rng.standard_normal((96, 64)).astype(np.float32) * (10.0 ** rng.uniform(-3, 3, (96, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = -3.0  # a constant negative block
    x[2] = np.linspace(-127, 127, 64).round()  # integers: q8_0 hits exact .5 ties after scaling
    x[3, :32] = np.arange(32) - 15.5  # q4_0: values landing on x*id + 8.5 integers
    x[4, 5] = -x[4].__abs__().max() * 2  # the largest magnitude is negative
    x[5, 7] = x[5, 9] = 4.0  # two equal maxima: the first wins
    x[5, 8] = -4.0
    x[6] = rng.uniform(-1e-6, 1e-6, 64)  # scale in fp16 subnormals
    x[7] = rng.uniform(-6e4, 6e4, 64)
    x[8] = (np.arange(64) % 16 - 8) * np.float32(0.25)
    return x


def test_q8_0_matches_ggml() -> None:
    x = awkward_rows(np.random.default_rng(1))
    blocks, back = ggml_quantize(GGML_TYPE_Q8_0, x, 34)
    d, qs = F.q8_0_quantize(x)
    np.testing.assert_array_equal(F.q8_0_pack(d, qs), blocks)
    np.testing.assert_array_equal(F.q8_0_dequantize(d, qs).reshape(-1), back)
    np.testing.assert_array_equal(F.token_roundtrip(x, "q8_0").reshape(-1), back)


def test_q4_0_matches_ggml() -> None:
    x = awkward_rows(np.random.default_rng(2))
    blocks, back = ggml_quantize(GGML_TYPE_Q4_0, x, 18)
    d, codes = F.q4_0_quantize(x)
    np.testing.assert_array_equal(F.q4_0_pack(d, codes), blocks)
    np.testing.assert_array_equal(F.q4_0_dequantize(d, codes).reshape(-1), back)
    np.testing.assert_array_equal(F.token_roundtrip(x, "q4_0").reshape(-1), back)


def gen_hadamard_c(n: int) -> np.ndarray:
    """ggml_gen_hadamard's loops, literally (src/llama-kv-cache.cpp)."""
    data = np.zeros(n * n, np.float32)
    data[0] = np.float32(1.0 / float(np.sqrt(np.float32(n))))
    s = 1
    while s < n:
        for i in range(s):
            for j in range(s):
                val = data[i * n + j]
                data[(i + s) * n + j] = val
                data[i * n + j + s] = val
                data[(i + s) * n + j + s] = -val
        s *= 2
    return data.reshape(n, n)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_hadamard_orthonormal_and_rotation_round_trips(n: int) -> None:
    h = F.hadamard(n)
    np.testing.assert_array_equal(h, gen_hadamard_c(n))
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_allclose(h.astype(np.float64) @ h.T.astype(np.float64), np.eye(n), atol=1e-6)
    x = np.random.default_rng(n).standard_normal((5, 3, 256)).astype(np.float32)
    y = F.rotate(x, n)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(F.rotate(y, n), x, atol=1e-5)
    # blockwise: the first n values depend only on the first n inputs
    x2 = x.copy()
    x2[..., n:] = 0
    np.testing.assert_allclose(F.rotate(x2, n)[..., :n], y[..., :n], atol=1e-6)


def test_rotation_block_sizes() -> None:
    # build_input_k_rot: the largest power of two >= 64 dividing the head dim; no rotation otherwise
    assert [F.k_rot_size(d) for d in (64, 128, 192, 256, 320, 80, 96)] == [64, 128, 64, 256, 64, 0, 0]


# --------------------------------------------------------------------------------- synthetic K/V/Q


def synthetic(rng: np.random.Generator, T: int, H: int, per_kv: int, D: int):
    """K with outlier channels and a few planted low-magnitude tokens (so pools fill), V and Q (float16)."""
    k = rng.standard_normal((T, H, D)).astype(np.float32)
    k[:, :, :4] *= 8
    k[:, :, 4] += 10
    low = rng.choice(T, size=T // 40, replace=False)
    k[low] *= 0.05
    v = rng.standard_normal((T, H, D)).astype(np.float32)
    q = rng.standard_normal((T, H * per_kv, D)).astype(np.float32) * 0.5
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)


def reference_outputs(cfg: ref.OttConfig, layer: int, q, k, v, ub: int) -> np.ndarray:
    cache = ref.OttCache(cfg, layer + 1, k.shape[1], k.shape[2])
    outs = []
    for p0 in range(0, len(k), ub):
        sl = slice(p0, min(len(k), p0 + ub))
        outs.append(cache.process_ubatch(0, layer, q[sl], k[sl], v[sl], np.arange(sl.start, sl.stop)))
    return np.concatenate(outs)


@pytest.mark.parametrize(
    "cfg",
    [
        ref.OttConfig(no_outlier_layers=0, aux_cap=4),  # aux_cap 4: tracing stops within the sequence
        ref.OttConfig(no_outlier_layers=0, Gv=32, R=0, mean="all"),
        ref.OttConfig.kivi2(R=128),
    ],
)
def test_fast_evaluation_matches_reference_cache(cfg: ref.OttConfig) -> None:
    q, k, v = synthetic(np.random.default_rng(3), 560, 2, 2, 64)
    for g in range(4):  # ever smaller keys in every group: all pool members lose each time, the aux pool fills
        k[g * 128 + 40 : g * 128 + 43] *= np.float16(0.02 * 0.5**g)
    qpos = np.arange(len(q))
    scale = 1 / 8
    ev = F.LayerEval(q, k, v, qpos, scale, chunk=128)
    scheme = F.Scheme("x", "ott", config=cfg)
    ks, vs = F.served(scheme, k, v, 0, int(qpos.max()))
    for mode, ub in (("decode", 1), ("ubatch", 128)):
        got = ev.run(ks, vs, F.boundaries(scheme, qpos, mode, ubatch=ub))  # type: ignore[arg-type]
        want = reference_outputs(cfg, 0, q, k, v, ub)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=mode)
    # the reference's pools really were used (and with aux_cap 4, tracing stopped)
    _, _, stats = F._ott_served(k, v, cfg, 0, F.n_groups_needed(int(qpos.max()), cfg))
    if cfg.outlier_num:
        assert all(s.n_pool == cfg.outlier_num for s in stats)
        if cfg.aux_cap == 4:
            assert not any(s.tracing for s in stats)


def dense(q, k, v, scale: float, window: int = 0) -> np.ndarray:
    """Plain float64 causal (optionally windowed) attention: q (T, Hq, D), k/v (T, H, D)."""
    T, Hq, _ = q.shape
    per = Hq // k.shape[1]
    i = np.arange(T)
    ok = i[None, :] <= i[:, None]
    if window:
        ok &= i[:, None] - i[None, :] < window
    out = np.empty(q.shape)
    for h in range(Hq):
        s = np.where(ok, q[:, h].astype(np.float64) @ k[:, h // per].astype(np.float64).T * scale, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = p / p.sum(axis=1, keepdims=True) @ v[:, h // per].astype(np.float64)
    return out


@pytest.mark.parametrize("window", [0, 100])
def test_token_schemes_and_window_against_dense_attention(window: int) -> None:
    q, k, v = synthetic(np.random.default_rng(4), 300, 1, 3, 128)
    qpos = np.arange(2, 300, 3)
    ev = F.LayerEval(q, k, v, qpos, 0.1, window=window, chunk=64)
    np.testing.assert_allclose(ev.run(), dense(q, k, v, 0.1, window)[qpos], rtol=1e-4, atol=1e-5)
    for rot in (False, True):
        s = F.Scheme("q4_0", "token", fmt="q4_0", rotate=rot)
        ks, vs = F.served(s, k, v, 0, 299)
        if rot:
            # llama.cpp's arithmetic: rotated q against the rotated, quantized K; the output rotated back
            kr = F.token_roundtrip(F.rotate(k.astype(np.float32), 128), "q4_0")
            vr = F.token_roundtrip(F.rotate(v.astype(np.float32), 64), "q4_0")
            want = F.rotate(dense(F.rotate(q.astype(np.float32), 128), kr, vr, 0.1, window), 64)
        else:
            want = dense(q, F.token_roundtrip(k, "q4_0"), F.token_roundtrip(v, "q4_0"), 0.1, window)
        got = ev.run(ks, vs, F.boundaries(s, qpos, "decode"))
        np.testing.assert_allclose(got, want[qpos], rtol=1e-3, atol=1e-4)


def test_identity_is_exact_and_quantization_is_not() -> None:
    q, k, v = synthetic(np.random.default_rng(5), 700, 2, 2, 64)
    qpos = np.arange(3, 700, 4)
    ev = F.LayerEval(q, k, v, qpos, 1 / 8)
    o_ref = ev.run()
    ident = F.Scheme("id", "ott", config=ref.OttConfig(identity=True, no_outlier_layers=0))
    ks, vs = F.served(ident, k, v, 0, int(qpos.max()))
    assert F.rel_errors(ev.run(ks, vs, F.boundaries(ident, qpos, "decode")), o_ref) == (0.0, 0.0)
    for s in [*F.default_schemes(64, ref.OttConfig(no_outlier_layers=0)), *F.fig1c_schemes()]:
        ks, vs = F.served(s, k, v, 0, int(qpos.max()))
        l1, l2 = F.rel_errors(ev.run(ks, vs, F.boundaries(s, qpos, "decode")), o_ref)
        assert l1 > 0 and l2 > 0, s.name


def test_keep_zero_is_kivi2_and_keep_serves_the_selected_exactly() -> None:
    _, k, v = synthetic(np.random.default_rng(6), 512, 2, 1, 64)
    kivi = ref.OttConfig.kivi2(v_rotate=False, k_mix=1)  # the keep study models plain KIVI (uniform 2-bit keys)
    ks_ref, vs_ref, _ = F._ott_served(k, v, kivi, 0, 3)
    ks, vs = F._keep_served(k, v, kivi, 3, 0, "smallest", (0,))
    np.testing.assert_array_equal(ks, ks_ref)
    np.testing.assert_array_equal(vs, vs_ref)
    ks, vs = F._keep_served(k, v, kivi, 3, 5, "smallest", (0,))
    sel = F.keep_selection(k[:384, 0].reshape(3, 128, 64), 5, "smallest", None).reshape(-1)
    np.testing.assert_array_equal(ks[:384, 0][sel], k[:384, 0][sel].astype(np.float32))
    assert not np.array_equal(ks[:384, 0][~sel], k[:384, 0][~sel].astype(np.float32))
    np.testing.assert_array_equal(ks[384:], k[384:].astype(np.float32))  # unsealed: exact


def test_smallest_magnitude_picks_a_planted_tiny_key() -> None:
    rng = np.random.default_rng(7)
    g = (rng.standard_normal((4, 128, 64)) * 3 + 5).astype(np.float16)
    g[0, 77] *= np.float16(0.01)
    g[2, 3] = 0
    g[1, 100] *= np.float16(20)
    sel = F.keep_selection(g, 1, "smallest", None)
    assert sel.sum() == 4 and sel[0, 77] and sel[2, 3]
    assert F.keep_selection(g, 1, "largest", None)[1, 100]
    r = F.keep_selection(g, 3, "random", np.random.default_rng(0))
    assert (r.sum(axis=1) == 3).all()


def test_effective_bits() -> None:
    cfg = ref.OttConfig(Gv=64)
    s = F.Scheme("ott2", "ott", config=cfg)
    assert s.effective_bits(64, 8192, 30) == ref.effective_bits(cfg, 64, 8192, 30)
    assert F.Scheme("q4_0", "token", fmt="q4_0").effective_bits(64, 8192, 30) == 4.5
    k0 = F.Scheme("k0", "keep", config=replace(cfg, outlier_num=0), keep=0)
    k3 = F.Scheme("k3", "keep", config=replace(cfg, outlier_num=0), keep=3)
    assert k0.effective_bits(64, 8192, 30) == ref.effective_bits(replace(cfg, outlier_num=0), 64, 8192)
    # 63 sealed groups x 3 tokens x (fp16 K and V + 32-bit position) over 2 * 8192 * 64 elements
    extra = 63 * 3 * (2 * 16 * 64 + 32) / (2 * 8192 * 64)
    assert k3.effective_bits(64, 8192, 30) == pytest.approx(k0.effective_bits(64, 8192, 30) + extra)
    assert F.worst_bits(s, 64, 8192, 30) > s.effective_bits(64, 8192, 30)


def fake_capture(path: Path, T: int, n_layer: int, swa: list[int]) -> None:
    """A synthetic .npz in study.capture's layout (arrays and meta_* keys that read_meta reads)."""
    rng = np.random.default_rng(8)
    arrays = {}
    for il in range(n_layer):
        q, k, v = synthetic(rng, T, 1, 2, 64)
        arrays.update({f"q{il}": q, f"k{il}": k, f"v{il}": v})
    meta = {
        "model": "fake",
        "model_file": "fake.gguf",
        "arch": "fake",
        "n_layer": n_layer,
        "n_head": 2,
        "n_head_kv": 1,
        "head_dim": 64,
        "head_dim_v": 64,
        "n_embd": 128,
        "n_tokens": T,
        "n_ubatch": 512,
        "dtype": "float16",
        "tokens": np.zeros(T, np.int32),
        "n_swa": 128 if swa else 0,
        "swa_layers": np.asarray(swa, np.int32),
        "swa_source": "test",
        "attn_scale": np.float64(1 / 8),
        "source": "synthetic",
        "source_ops": "",
        "extra": "",
    }
    np.savez(path, **arrays, **{f"meta_{k}": np.asarray(v) for k, v in meta.items()})


def test_study_and_report_end_to_end(tmp_path: Path) -> None:
    npz = tmp_path / "fake.npz"
    fake_capture(npz, 384, 3, [0, 1])
    r = F.study_model("fake", npz, 384, 16, log=lambda s: None)
    assert set(r.layer_sets()) == {"all", "full", "swa"}
    for name in ("q4_0+rot", "kivi2", "ott2", "keep 3 random"):
        assert (r.err[name]["decode"] > 0).all(), name
    assert r.err["ott2"]["decode"][0].tolist() == r.err["kivi2"]["decode"][0].tolist()  # no_outlier_layers=2
    md = F.write_report([r], tmp_path / "docs", "python -m study.fidelity --models fake", 16, 1.0, 2.0)
    text = md.read_text()
    assert "Decision: Gv =" in text and "Decision: mean =" in text and "full-attn layers" in text
    assert (tmp_path / "docs" / "fidelity" / "layers-fake.png").stat().st_size > 0
    assert (tmp_path / "docs" / "fidelity" / "fig1c.png").stat().st_size > 0
