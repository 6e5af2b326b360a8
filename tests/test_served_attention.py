"""study.served_attention (docs/long-context.md, keys by age): the harness's numpy attention is llama.cpp's, and a
served-keys scheme with wider keys loses less than ott2's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from study import served_attention as SA


def test_the_harness_attends_as_llama_cpp_and_wider_young_keys_lose_less(
    smollm2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """384 tokens (2 groups sealed by the last position): numpy's exact attention equals llama.cpp's flash attention
    within fp16 rounding at every served layer and ubatch; ott2's 2-bit keys move the logits; with the newest 4
    sealed groups at 3 bits (all of them here) the loss is lower."""
    assert smollm2.is_file()  # fetched by the fixture; measure() loads it by name
    res = SA.measure("smollm2-135m", 384, 1, ["ott2", "age4"], threads=1, check=True, own=False)
    err = capsys.readouterr().err
    rel = float(err.split("relative squared difference median ")[1].split(",")[0])
    assert rel < 1e-5, err
    assert 0.0 < res["age4"][0] < res["ott2"][0], res


def test_salient_values_are_chosen_from_the_attention_before_the_seal() -> None:
    """v_h2o: a group's chosen tokens are those that received the most attention from queries before its seal
    (position (g + 1) G + R - 1), never BOS (served exactly already); attention after the seal does not count, and
    the ranking by mean attention per query that saw a token favours a late token with half the sum."""
    sa = SA.ServedAttention([0], n_head=1, n_kv=1, D=4, scale=1.0, cap=512)
    qp = np.arange(256)
    seal = SA.G + 64 - 1  # group 0 seals for the query at 191 (R 64)
    p = np.zeros((256, 256))
    p[:, 0] = 10.0  # BOS
    p[:seal, 5] = 1.0
    p[:seal, 9] = 0.9
    p[seal:, 20] = 100.0  # after the seal: must not count
    p[seal - 10 : seal, 120] = 0.05 * seal  # half token 5's sum, from the last 10 queries before the seal

    for mean, want in ((False, {5, 9}), (True, {120, 5})):
        sa.reset(SA.Scheme(age=1 << 30, narrowed=False, values=True, R=64, v_h2o=2, v_h2o_mean=mean))
        lay = SA._Layer(1, 4, 512)
        sa._choose(lay, 0, qp, p)
        assert set(np.flatnonzero(lay.chosen[:, 0])) == want, (mean, np.flatnonzero(lay.chosen[:, 0]))
        assert lay.n_chosen == [1]  # group 1 seals at 319: not yet
        np.testing.assert_allclose(lay.recv[:256, 0], p.sum(0))


def test_the_ideal_value_code_has_the_rate_distortion_error() -> None:
    """rd_values (the q32+rd2 scheme): on Gaussian values its error is the bound's, var 2^(-2 bits), about half
    the 2-bit quantizer's and twice the 3-bit one's."""
    from ott_gguf.reference import OttConfig, quantize_values

    rng = np.random.default_rng(1)
    v = rng.standard_normal((512, 64)).astype(np.float32)
    err = {b: float(((SA.rd_values(v, b, np.random.default_rng(b)) - v) ** 2).mean()) for b in (2, 3)}
    for b in (2, 3):
        assert abs(err[b] / 2.0 ** (-2 * b) - 1) < 0.05, err
    q2, q3 = (float(((quantize_values(v, OttConfig(bits=b))[3] - v) ** 2).mean()) for b in (2, 3))
    assert 1.7 < q2 / err[2] < 2.0 and 0.4 < q3 / err[2] < 0.6, (q2, q3, err)
