"""study.served_attention (docs/long-context.md, keys by age): the harness's numpy attention is llama.cpp's, and a
served-keys scheme with wider keys loses less than ott2's."""

from __future__ import annotations

from pathlib import Path

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
