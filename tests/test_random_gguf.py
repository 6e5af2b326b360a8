"""study.random_gguf: the random-weight models at real shapes (issue 47) load and decode with f16 and ott2.

One layer at each named shape and a small vocabulary (the layer is the real one: head dim 128, GQA 4:1 for
llama3-8b and 7:1 for qwen2.5-7b, qwen2's q/k/v biases), past the first sealed group so the ott2 kernels run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ott_gguf import Llama
from study import random_gguf as rg

N_VOCAB = 512
N_PROMPT, N_DECODE = 200, 4  # 200 > G + R (128 + 32): a sealed group in the cache


def test_the_writer_refuses_a_vocabulary_without_the_byte_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--vocab"):
        rg.write(tmp_path / "m.gguf", "llama3-8b", layers=1, n_vocab=100)


def test_random_blocks_have_the_asked_spread() -> None:
    """Decoded weights: zero mean and the standard deviation asked (within sampling noise of 64k values)."""
    rng = np.random.default_rng(1)
    for wtype in ("q4_0", "q8_0"):
        raw = rg.random_blocks(rng, 64, 1024, wtype, 0.05)
        nb = rg._WTYPES[wtype][0]
        blocks = raw.reshape(-1, nb)
        d = blocks[:, :2].copy().view("<f2").astype(np.float64)
        if wtype == "q4_0":
            codes = np.stack([blocks[:, 2:] & 15, blocks[:, 2:] >> 4], axis=1).reshape(-1, 32).astype(np.float64) - 8
        else:
            codes = blocks[:, 2:].view(np.int8).astype(np.float64)
        w = codes * d
        assert abs(w.mean()) < 0.002 and w.std() == pytest.approx(0.05, rel=0.03), wtype


@pytest.mark.parametrize("shape", sorted(rg.SHAPES))
def test_a_layer_at_the_real_shape_decodes_with_f16_and_ott2(tmp_path: Path, shape: str) -> None:
    path = tmp_path / f"{shape}.gguf"
    s = rg.write(path, shape, layers=1, n_vocab=N_VOCAB)
    assert (s.n_layer, s.n_vocab, s.head_dim) == (1, N_VOCAB, 128)
    tokens = [int(t) for t in np.random.default_rng(0).integers(rg.N_SPECIAL, N_VOCAB, N_PROMPT + N_DECODE)]
    logits = {}
    for kv in ("f16", "ott2"):
        llm = Llama(str(path), kv_type=kv, n_ctx=256, n_batch=256, n_threads=1, logits_all=True, verbose=False)
        try:
            assert llm.n_vocab() == N_VOCAB and llm.n_embd() == rg.SHAPES[shape].n_embd
            llm.eval(tokens[:N_PROMPT])
            for t in tokens[N_PROMPT:]:  # decoded one at a time, as in generation
                llm.eval([t])
            logits[kv] = np.array(llm.scores[N_PROMPT : N_PROMPT + N_DECODE], dtype=np.float64)
            if kv == "ott2":
                info = llm.kv_cache_info()
                assert info["positions"] == N_PROMPT + N_DECODE and int(info["sealed"]) >= 128, info
        finally:
            llm.close()
    for kv, x in logits.items():
        assert np.isfinite(x).all() and x.std() > 0.1, kv  # activations stayed O(1): no overflow, no collapse
    # ott2's 2-bit K/V move the logits a little, not wholesale (a broken kernel gives unrelated logits)
    f, o = logits["f16"], logits["ott2"]
    assert not np.array_equal(f, o)
    assert np.sqrt(np.mean((o - f) ** 2)) < 0.3 * f.std()
