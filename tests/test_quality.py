"""Quality end to end: the ott caches' mean KL divergence against the f16 cache's logits on the pinned llama.cpp
docs, bounded and ordered (ott2 against kivi2, the tiers against q4_0 and each other), on SmolLM2 and Gemma 3.

One file, so that each model's f16 reference is computed once (helpers.f16_logits, cached per process; the test
workers run a file each): SmolLM2 over 1024 tokens, Gemma 3 over 1536 scored on the second half."""

from __future__ import annotations

from pathlib import Path

import pytest

from ott_gguf import Llama

from helpers import doc_prefix, eval_logits, f16_logits, kl_divergence, rotate

# Bounds set from measurements on this text (1024 tokens, two 512-token ubatches, 2 threads): mean KLD vs f16
# was 0.082 for ott2, 0.157 for kivi2 and 0.063 for rotated q4_0. The test allows some slack over ott2's
# measurement and requires ott2 to stay clearly better than kivi2.
OTT2_MEAN_KLD_BOUND = 0.11
OTT2_VS_KIVI2_MAX_RATIO = 0.65


def test_ott2_mean_kld_vs_f16_is_bounded_and_beats_kivi2(smollm2: Path) -> None:
    toks = doc_prefix(smollm2, 1024)
    f16 = f16_logits(smollm2, 1024)
    ott2 = kl_divergence(f16, eval_logits(smollm2, "ott2", toks)).mean()
    kivi2 = kl_divergence(f16, eval_logits(smollm2, "kivi2", toks)).mean()
    print(f"mean KLD vs f16: ott2 {ott2:.4f}, kivi2 {kivi2:.4f}")
    assert ott2 < OTT2_MEAN_KLD_BOUND
    assert ott2 < OTT2_VS_KIVI2_MAX_RATIO * kivi2


# Gemma 3 270M (3 full-attention layers with ott2, 15 window layers in f16), 1536 tokens of the docs in 512-token
# ubatches: mean KLD vs f16 measured 0.029 for ott2 and 0.078 for kivi2 with plain V (q4_0 0.144, q8_0 0.0098,
# both of which quantize every layer); with rotated V (the default) ott2 0.028 and kivi2 0.047: rotating V helps
# the kivi baseline more, and outlier tracing still takes 40% off. Scored on the second half only (2026-11-29): ott2
# 0.0464 plain V, 0.0472 rotated; kivi2 0.1011 and 0.0960.
GEMMA_OTT2_MEAN_KLD_BOUND = 0.065
GEMMA_TOKENS = 1536


def test_gemma3_ott2_on_the_full_attention_layers(gemma3: Path) -> None:
    """A sliding-window model: ott2 serves the full-attention layers, an f16 cache the window layers; quality
    vs f16 is bounded and ott2 stays clearly better than kivi2 (the paper's comparison: plain V; and with the
    default rotated V). Scored on the second half of 1536 tokens (4 to 10 groups sealed), as llama-perplexity
    scores a chunk: Gemma 3's 262k-token output layer is most of the cost of a position's logits. The two V
    layouts take turns (helpers.rotate; `make test-all` runs both)."""
    toks = doc_prefix(gemma3, GEMMA_TOKENS)
    f16 = f16_logits(gemma3, GEMMA_TOKENS, GEMMA_TOKENS // 2)
    kld = {
        (t, rot): kl_divergence(
            f16, eval_logits(gemma3, t, toks, first=GEMMA_TOKENS // 2, ott_config={"v_rotate": rot})
        ).mean()
        for t in ("ott2", "kivi2")
        for rot in rotate([True, False])
    }
    print(f"gemma3 mean KLD vs f16: {kld}")
    for rot in {r for _, r in kld}:
        assert kld["ott2", rot] < GEMMA_OTT2_MEAN_KLD_BOUND
        assert kld["ott2", rot] < (0.7 if rot else 0.6) * kld["kivi2", rot]
    llm = Llama(str(gemma3), kv_type="ott2", n_ctx=2048, verbose=False)
    llm.eval(toks[:600])
    info = llm.kv_cache_info()
    assert info["sealed"] == 512  # positions of the full-attention layers' ott2 cache
    assert info["ott_layers"] == 3 and info["bytes"]["f16 window layers"] > 0  # 15 window layers in f16


# --- quality of the tiers, end to end ------------------------------------------------------------------------------

# Measured (ott_gguf.evaluate over the first docs tokens, 512-token ubatches, 2 threads): mean KLD vs f16 and top-1.
# "ott3/ott2" runs k_mix (the default); "uniform" is ott3/ott2 with k_mix off; "layers" the calibrated widths
# 0-14:2/2,15-24:4/3,25-29:2/2 (chosen for uniform 3-bit keys, and no layer keeps 3-bit keys: k_mix is off there).
# SmolLM2, 1024 tokens: q4_0 0.0627 (85.1%), ott3/ott2 0.0184 (91.8%), uniform 0.0228 (90.3%), ott4/ott2 0.0171
# (91.9%), layers 0.0205 (90.0%). Gemma 3, 1536 tokens: q4_0 0.1439 (77.5%), ott3/ott2 0.0128 (94.1%), uniform
# 0.0157 (92.9%), ott4/ott2 0.0122 (93.9%). The quality tier ("quality MODEL"): SmolLM2 0.0113, Gemma 3 0.0105.
# Gemma 3 is scored on the second half of its 1536 tokens (its output layer is most of the cost; more groups are
# sealed there), measured 2026-11-29: q4_0 0.1343, ott3/ott2 0.0145, uniform 0.0197, ott4/ott2 0.0144, quality
# 0.0133. The bounds leave about 40% over each measurement.
TIER_KLD_BOUNDS = {
    "smollm2": (
        1024,
        0,
        {"ott3/ott2": 0.026, "uniform": 0.032, "ott4/ott2": 0.024, "layers": 0.029, "quality smollm2": 0.016},
    ),
    "gemma3": (1536, 768, {"ott3/ott2": 0.020, "uniform": 0.028, "ott4/ott2": 0.020, "quality gemma3": 0.019}),
}
SMOLLM2_LAYERS = "0-14:2/2,15-24:4/3,25-29:2/2"
# the compact tier at 1024 tokens, measured 2026-11-30 with its calibration a layer per block: 0.0200 (ott2 0.0281,
# q4_0 0.0610; with the blocks of two before it 0.0238); about 40% over
COMPACT_KLD_BOUND = 0.028
# the quality tier (docs/tiers.md): symmetric 2-bit values, R 64, the widths `ott-gguf calibrate MODEL --ott-params
# 128,64,3,32,2,1,1,1 --max-bits 3.2` chose
QUALITY = {"R": 64, "v_sym": True}
TIER_RUNS: dict[str, tuple[str, dict[str, object] | None]] = {
    "ott3/ott2": ("ott3/ott2", None),
    "uniform": ("ott3/ott2", {"k_mix": False}),
    "ott4/ott2": ("ott4/ott2", None),
    "layers": ("ott3/ott2", {"k_mix": False, "layer_widths": SMOLLM2_LAYERS}),
    "quality smollm2": ("ott3/ott2", {**QUALITY, "layer_widths": "0-2:3/3,3-5:2/2,9-11:2/2,18-23:3/3,27-29:2/2"}),
    "quality gemma3": ("ott3/ott2", {**QUALITY, "layer_widths": "11:3/3,17:2/2"}),
}
# the compact tier (docs/long-context.md): ott2 with symmetric values, 3-bit keys in the layers its calibration chose
COMPACT_SMOLLM2 = ("ott2", {"v_sym": True, "layer_widths": "5:3/2,7-9:3/2,14-18:3/2,20:3/2,23:3/2"})


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_tiers_kld_is_bounded_and_below_q4_0(model: str, request: pytest.FixtureRequest) -> None:
    from ott_gguf.evaluate import eval_logits, kl_divergence

    path: Path = request.getfixturevalue(model)
    n, first, bounds = TIER_KLD_BOUNDS[model]
    # every run: the default pair and the quality tier; the design comparisons (k_mix off, a 4th key bit, widths
    # calibrated for uniform keys) take turns (helpers.rotate; `make test-all` runs them all)
    turns = [t for t in bounds if t in ("uniform", "ott4/ott2", "layers")]
    bounds = {t: b for t, b in bounds.items() if t not in turns or t in rotate(turns)}
    toks = doc_prefix(path, n)
    f16 = f16_logits(path, n, first)
    kld = {"q4_0": kl_divergence(f16, eval_logits(path, "q4_0", toks, first=first)).mean()}
    for tier in bounds:
        kv, cfg = TIER_RUNS[tier]
        kld[tier] = kl_divergence(f16, eval_logits(path, kv, toks, first=first, ott_config=cfg)).mean()
    print(f"{model}: mean KLD vs f16 " + ", ".join(f"{t} {v:.4f}" for t, v in kld.items()))
    for tier, bound in bounds.items():
        assert kld[tier] < bound, (tier, kld)
        assert kld[tier] < 0.5 * kld["q4_0"], (tier, kld)
    # the same bytes (k_mix: + D/4 per group), spent where they count; and a wider K side
    if "uniform" in kld:
        assert kld["ott3/ott2"] < kld["uniform"]
    for better in ("ott4/ott2", "layers"):
        if better in kld and "uniform" in kld:
            assert kld[better] < kld["uniform"]
    assert kld[f"quality {model}"] < kld["ott3/ott2"]  # the quality tier's recipe pays on both models
    if model == "smollm2":
        # the compact tier: below ott2 and q4_0, at 2.79 bits per element at 8k (ott2 2.73, q4_0 4.5)
        ott2 = kl_divergence(f16, eval_logits(path, "ott2", toks, first=first)).mean()
        kv, cfg = COMPACT_SMOLLM2
        compact = kl_divergence(f16, eval_logits(path, kv, toks, first=first, ott_config=cfg)).mean()
        print(f"smollm2: ott2 {ott2:.4f}, compact {compact:.4f}")
        assert compact < COMPACT_KLD_BOUND and compact < ott2 and compact < kld["q4_0"], (compact, ott2, kld)
