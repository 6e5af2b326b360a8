"""study.long_context: tiers named or given by their --ott-params, runs, and the rows kept between sittings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from study import long_context as LC
from study.tiers import Tier


def test_tier_params_round_trip() -> None:
    t = LC.tier_of("ott2/ott2@128,48,6,64,0,1,1,0", "smollm2-135m")
    assert t.args() == ["-ctk", "ott2", "-ctv", "ott2", "--ott-params", "128,48,6,64,0,1,1,0"]
    assert t.label == "ott2 +rotV uniform K R=48 O=6 aux=64 NOL=0"  # k_mix 1: 2-bit keys uniform
    assert t.ott_config() == {"v_rotate": True, "layer_widths": "", "k_mix": True, "v_sym": False, "R": 48,
                              "outlier_num": 6, "aux_cap": 64, "no_outlier_layers": 0, "k_young": 0,
                              "v_young": 0}  # fmt: skip
    # keys by age: a ninth value, passed on as llama.cpp's tools take it
    young = LC.tier_of("ott2/ott2@128,32,3,32,2,1,2,0,4", "smollm2-135m")
    assert young.args()[-1] == "128,32,3,32,2,1,2,0,4" and young.label == "ott2 +rotV young=4"
    assert young.ott_config()["k_young"] == 4  # type: ignore[index]
    # the defaults give docs/tiers.md's commands unchanged
    assert Tier("ott3", "ott2", True).args()[-1] == "128,32,3,32,2,1,2,0"
    assert LC.tier_of("q4_0", "smollm2-135m").args() == ["-ctk", "q4_0", "-ctv", "q4_0"]
    q = LC.tier_of("quality", "smollm2-135m")
    assert q.args()[5] == "128,64,3,32,2,1,1,1" and q.layers


def test_bad_tiers_and_runs() -> None:
    with pytest.raises(ValueError, match="G is 128"):
        LC.tier_of("ott2@64,32,3,32,2,1,1,0", "smollm2-135m")
    with pytest.raises(ValueError, match="a name of"):
        LC.tier_of("ott5", "smollm2-135m")
    assert LC.parse_runs("smollm2-135m:8192:2,gemma3-270m:16384:1") == [
        LC.Run("smollm2-135m", 8192, 2),
        LC.Run("gemma3-270m", 16384, 1),
    ]


def test_rows_in_raw_are_reused(tmp_path: Path) -> None:
    """A row already measured for the same run and tier is taken from --raw; nothing runs (no model is opened)."""
    raw = tmp_path / "raw.jsonl"
    tier = LC.tier_of("ott2", "smollm2-135m")
    row = {"run": "smollm2-135m:8192:1", "args": " ".join(tier.args()), "label": tier.label, "mean_kld": 0.1,
           "kld_999": 1.0, "top1": 80.0, "ppl_ratio": 1.1, "bits": 2.72, "seconds": 1, "date": "d",
           "command": "c"}  # fmt: skip
    raw.write_text(json.dumps(row) + "\n")
    rows = LC.measure(LC.Run("smollm2-135m", 8192, 1), [("ott2", tier)], raw, 1)
    assert rows == [row]
    assert "| ott2 +rotV | 0.1000 |" in LC.markdown(LC.Run("smollm2-135m", 8192, 1), rows)
