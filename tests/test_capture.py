"""study.capture on the real models, and the docs corpus it reads by default.

The captured q/k/v are proven to be the tensors llama.cpp's attention used: dense causal attention computed here
from them must reproduce llama.cpp's own attention output (`kqv_out-<il>`, recorded in the same run through the
same eval callback), while plausible mistakes (another layer's K/V, keys off by one token, no causal mask, the
wrong scale or head mapping) miss it by far more than the tolerance. Past Gemma 3's window, the layers the
metadata calls sliding-window are the ones whose output needs the window.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ott_gguf
from ott_gguf import corpus
from study.capture import capture, read_meta

from helpers import ROOT

N_TOKENS = 300  # below Gemma 3's 512-token window: every layer attends to all earlier tokens
N_UBATCH = 128  # 128 + 128 + 44: the layers are stitched together across ubatches of unequal size
EXPECTED = {
    # name: arch, n_layer, n_head, n_head_kv, head_dim, n_swa, sliding-window layers
    "smollm2": ("llama", 30, 9, 3, 64, 0, []),
    # llama.cpp's gemma3 default pattern 6 (no pattern key in this GGUF): every 6th layer is global
    "gemma3": ("gemma3", 18, 4, 1, 256, 512, [il for il in range(18) if il % 6 != 5]),
}
# f16 storage of q (flash attention reads it in f32) and llama.cpp's f16 arithmetic on a short last ubatch:
# measured at most 1.8e-3 (relative Frobenius) and 1.0e-2 (max abs / max |out|) over all layers of both models
REL_FRO_TOL = 5e-3
MAX_ERR_TOL = 3e-2  # max abs error / max |out|
# what the plausible mistakes give (measured >= 0.2)
WRONG_MIN_REL_FRO = 0.1


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool = True, window: int = 0
) -> np.ndarray:
    """Dense attention in float64: q [T, H, D], k/v [T, Hkv, D]; query head h reads KV head h // (H // Hkv).

    window > 0: query i sees keys j with i - j < window (llama.cpp's LLAMA_SWA_TYPE_STANDARD)."""
    t, n_head, _ = q.shape
    group = n_head // k.shape[1]
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    i = np.arange(t)
    visible = (i[None, :] <= i[:, None]) if causal else np.ones((t, t), dtype=bool)
    if window:
        visible &= i[:, None] - i[None, :] < window
    out = np.empty((t, n_head, v.shape[-1]))
    for h in range(n_head):
        s = np.where(visible, q[:, h] @ k[:, h // group].T * scale, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
    return out


def errors(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(max abs error / max |ref|, relative Frobenius error)."""
    d = ref - got
    return float(np.abs(d).max() / np.abs(ref).max()), float(np.linalg.norm(d) / np.linalg.norm(ref))


def _capture(model: Path, out: Path) -> Path:
    got = capture(model, None, N_TOKENS, out, n_ubatch=N_UBATCH, n_threads=2, extra=["kqv_out"])
    assert got == out
    return out


@pytest.fixture(scope="module")
def smollm2_npz(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _capture(smollm2, tmp_path_factory.mktemp("capture") / "smollm2.npz")


@pytest.fixture(scope="module")
def gemma3_npz(gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _capture(gemma3, tmp_path_factory.mktemp("capture") / "gemma3.npz")


@pytest.fixture(params=["smollm2", "gemma3"])
def captured(request: pytest.FixtureRequest) -> tuple[str, Path, Path]:
    name = request.param
    return name, request.getfixturevalue(name), request.getfixturevalue(f"{name}_npz")


# --- corpus ---------------------------------------------------------------------------------------------------


def test_docs_text_is_the_pinned_docs_prefix() -> None:
    root = corpus.docs_dir()
    assert root.name == "docs" and (root.parent / "ggml" / "include" / "ggml.h").is_file()
    files = sorted(root.rglob("*.md"), key=lambda p: str(p.relative_to(root)).replace("\\", "/"))
    assert len(files) > 20
    whole = b"".join(p.read_bytes() for p in files)
    assert len(whole) > 200_000

    text = corpus.docs_text()
    data = text.encode("utf-8")
    assert 200_000 - 3 <= len(data) <= 200_000
    assert whole.startswith(data)
    assert data.startswith(files[0].read_bytes())
    assert "llama" in text and "```" in text  # real Markdown docs

    corpus._docs_bytes.cache_clear()  # deterministic: re-read from disk, same text
    assert corpus.docs_text() == text
    head = corpus.docs_text(1000).encode("utf-8")
    assert 997 <= len(head) <= 1000 and data.startswith(head)


def test_docs_text_never_splits_a_character() -> None:
    whole = corpus.docs_text(10**9).encode("utf-8")
    first = next(i for i, b in enumerate(whole) if b >= 0x80)  # first multi-byte character
    width = next(i for i in range(1, 5) if first + i == len(whole) or (whole[first + i] & 0xC0) != 0x80)
    assert width > 1
    for cut in range(first + 1, first + width):  # inside the character: cut before it
        assert corpus.docs_text(cut).encode("utf-8") == whole[:first]
    assert corpus.docs_text(first + width).encode("utf-8") == whole[: first + width]
    assert corpus.docs_text(0) == ""
    with pytest.raises(ValueError):
        corpus.docs_text(-1)


# --- capture ----------------------------------------------------------------------------------------------------


def test_capture_shapes_and_metadata(captured: tuple[str, Path, Path]) -> None:
    name, model, path = captured
    arch, n_layer, n_head, n_head_kv, head_dim, n_swa, swa_layers = EXPECTED[name]
    meta = read_meta(path)
    assert meta["arch"] == arch and meta["model_file"] == model.name
    assert (meta["n_layer"], meta["n_head"], meta["n_head_kv"], meta["head_dim"]) == (
        n_layer,
        n_head,
        n_head_kv,
        head_dim,
    )
    assert meta["n_tokens"] == N_TOKENS and meta["n_ubatch"] == N_UBATCH and meta["dtype"] == "float16"
    assert meta["n_swa"] == n_swa and meta["swa_layers"] == swa_layers
    # llama: 1/sqrt(head_dim) inside attention; gemma3 270M: Qcur * 1/sqrt(256) (query_pre_attn_scalar = head dim)
    assert meta["attn_scale"] == pytest.approx(1 / math.sqrt(head_dim))
    assert meta["source_ops"] == "Qcur=ROPE Kcur=ROPE Vcur=RESHAPE kqv_out=RESHAPE"

    # the tokens are the model's own tokenization of the docs text (with Gemma's BOS)
    vocab = ott_gguf.Llama(str(model), vocab_only=True, verbose=False)
    want = vocab.tokenize(corpus.docs_text(8 * N_TOKENS).encode(), add_bos=True, special=False)[:N_TOKENS]
    vocab.close()
    assert meta["tokens"].dtype == np.int32 and meta["tokens"].tolist() == want

    with np.load(path) as f:
        names = set(f.files)
        for il in range(n_layer):
            q, k, v = f[f"q{il}"], f[f"k{il}"], f[f"v{il}"]
            assert q.shape == (N_TOKENS, n_head, head_dim) and q.dtype == np.float16
            assert k.shape == v.shape == (N_TOKENS, n_head_kv, head_dim) and k.dtype == v.dtype == np.float16
            assert all(np.isfinite(x).all() and np.abs(x).max() > 0 for x in (q, k, v))
            assert f[f"kqv_out{il}"].shape == (N_TOKENS, n_head * head_dim)
        assert f"q{n_layer}" not in names
        assert not np.array_equal(f["k0"], f["k1"])


def test_attention_from_captured_qkv_matches_llama_cpp(captured: tuple[str, Path, Path]) -> None:
    name, _, path = captured
    meta = read_meta(path)
    n_layer, scale = meta["n_layer"], meta["attn_scale"]
    layers = sorted({0, 1, n_layer // 2, n_layer - 1} | ({5} if name == "gemma3" else set()))  # 5: a global layer
    with np.load(path) as f:
        for il in layers:
            q, k, v = f[f"q{il}"], f[f"k{il}"], f[f"v{il}"]
            out = f[f"kqv_out{il}"].reshape(N_TOKENS, meta["n_head"], -1)
            max_abs, rel_fro = errors(attention(q, k, v, scale), out)
            assert rel_fro <= REL_FRO_TOL and max_abs <= MAX_ERR_TOL, (name, il, max_abs, rel_fro)

            other = (il + 1) % n_layer
            wrong = {
                "another layer's K/V": attention(q, f[f"k{other}"], f[f"v{other}"], scale),
                "K/V one token late": attention(q, np.roll(k, 1, axis=0), np.roll(v, 1, axis=0), scale),
                "no causal mask": attention(q, k, v, scale, causal=False),
                "scale 1": attention(q, k, v, 1.0),
            }
            if k.shape[1] > 1:  # query head h -> KV head h % n_head_kv instead of h // group
                group = q.shape[1] // k.shape[1]
                perm = np.argsort(np.arange(q.shape[1]) % group, kind="stable")
                wrong["head mapping"] = attention(q[:, perm], k, v, scale)
            for what, ref in wrong.items():
                assert errors(ref, out)[1] > WRONG_MIN_REL_FRO, (name, il, what)


def test_float32_capture_matches_to_float32_precision(smollm2: Path, smollm2_npz: Path, tmp_path: Path) -> None:
    """q in f32 and k/v rounded to f16 (as the cache holds them) are exactly flash attention's inputs: on the CPU
    (f32 arithmetic for ubatches of >= 64 tokens) the output agrees to float32 rounding, and the float16 capture's
    q/k/v are bit for bit the f16 roundings of the float32 ones (its first two ubatches compute the same graph)."""
    n = 2 * N_UBATCH
    p32 = capture(
        smollm2, None, n, tmp_path / "f32.npz", n_ubatch=N_UBATCH, n_threads=2, extra=["kqv_out"], dtype="float32"
    )
    tol = 2e-5 if ott_gguf.build_info().get("cuda") == "OFF" else MAX_ERR_TOL  # GPU flash attention rounds to f16
    with np.load(p32) as f, np.load(smollm2_npz) as h:
        assert read_meta(f)["dtype"] == "float32" and f["q0"].dtype == np.float32
        for il in (0, 7, 29):
            q, k, v = f[f"q{il}"], f[f"k{il}"], f[f"v{il}"]
            k16, v16 = k.astype(np.float16), v.astype(np.float16)
            np.testing.assert_array_equal(h[f"k{il}"][:n], k16)
            np.testing.assert_array_equal(h[f"v{il}"][:n], v16)
            np.testing.assert_array_equal(h[f"q{il}"][:n], q.astype(np.float16))
            out = f[f"kqv_out{il}"].reshape(n, q.shape[1], -1)
            max_abs, rel_fro = errors(attention(q, k16, v16, read_meta(f)["attn_scale"]), out)
            assert max_abs <= tol, (il, max_abs, rel_fro)


def test_gemma3_sliding_window_layers(gemma3: Path, tmp_path: Path) -> None:
    """Past Gemma 3's 512-token window, llama.cpp's output matches windowed attention exactly on the layers the
    metadata calls sliding-window, and full causal attention on the others."""
    n = 640
    path = capture(gemma3, None, n, tmp_path / "g.npz", n_ubatch=320, n_threads=2, extra=["kqv_out"])
    meta = read_meta(path)
    assert meta["n_swa"] == 512
    with np.load(path) as f:
        for il in (0, 4, 5, 11):
            q, k, v = f[f"q{il}"], f[f"k{il}"], f[f"v{il}"]
            out = f[f"kqv_out{il}"].reshape(n, meta["n_head"], -1)
            # compared where the window matters: queries 512 and later
            windowed = errors(attention(q, k, v, meta["attn_scale"], window=512)[512:], out[512:])[1]
            full = errors(attention(q, k, v, meta["attn_scale"])[512:], out[512:])[1]
            right, wrong = (windowed, full) if il in meta["swa_layers"] else (full, windowed)
            assert right <= REL_FRO_TOL and wrong > WRONG_MIN_REL_FRO, (il, windowed, full)


def test_capture_from_tokens_and_errors(smollm2: Path, tmp_path: Path) -> None:
    tokens = [1, 504, 2683, 314, 253, 1345, 30, 2, 17, 18]
    out = capture(smollm2, tokens + [99], 10, tmp_path / "t.npz", n_ubatch=4, n_threads=2)
    meta = read_meta(out)
    assert meta["tokens"].tolist() == tokens and meta["source"] == "token ids"
    with np.load(out) as f:
        assert f["q3"].shape == (10, 9, 64) and f["v29"].shape == (10, 3, 64)
    with pytest.raises(ValueError, match="token ids given"):
        capture(smollm2, tokens, 11, tmp_path / "u.npz")
    with pytest.raises(FileNotFoundError):
        capture(tmp_path / "missing.gguf", tokens, 4, tmp_path / "v.npz")
    with pytest.raises(RuntimeError, match="no nope-0 tensor"):
        capture(smollm2, tokens, 4, tmp_path / "w.npz", extra=["nope"])
    assert not (tmp_path / "w.npz").exists()


def test_cli(smollm2: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.npz"
    res = subprocess.run(
        [sys.executable, "-m", "study.capture", "--model", str(smollm2), "--tokens", "48", "--ubatch", "32"]
        + ["--threads", "2", "--out", str(out)],
        cwd=ROOT,  # the study tools run from the repository root
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert str(out) in res.stdout and "48 tokens" in res.stdout
    meta = read_meta(out)
    assert meta["n_tokens"] == 48 and meta["model"] == smollm2.stem and meta["source"].startswith("llama.cpp docs")
