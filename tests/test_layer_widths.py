"""Code widths per layer (OttConfig.layer_widths, llama_ott_config.layer_widths, --ott-layers): the spec's two
parsers agree, the reference seals each layer at its widths, and the native cache allocates, runs, saves and
refuses by layer, on SmolLM2 and Gemma 3."""

from __future__ import annotations

import ctypes
import itertools
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ott_gguf import Llama, OttConfig, _lib
from ott_gguf.calibrate import (
    Block,
    best_plan,
    cache_bits,
    calibrate,
    choose_context,
    estimate_seconds,
    fit_seconds,
    plan_within_bits,
    planned_runs,
)
from ott_gguf.kv_types import parse_layer_widths
from ott_gguf.reference import OttCache, effective_bits
from ott_gguf.server import server_command

from helpers import THREADS, doc_prefix, greedy, last_logits, run_cli

N_CTX = 512
TIER = "15-24:4/3"  # docs/layer-widths.md


@pytest.fixture(scope="module")
def doc_tokens(smollm2: Path) -> list[int]:
    return doc_prefix(smollm2, 300)


def c_widths(spec: str) -> tuple[bool, list[int], str]:
    cfg = _lib.native().llama_ott_config_default()
    why = ctypes.create_string_buffer(256)
    ok = bool(_lib.native().llama_ott_config_set_layer_widths(ctypes.byref(cfg), spec.encode(), why, 256))
    return ok, list(cfg.layer_widths), why.value.decode()


# --- the spec (no model needed) -------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["15-24:4/3", "0:3/2,1-3:2/4", "5-9:4/4,7:2/2", " 2 : 3/3 ", ""])
def test_python_and_c_read_a_spec_alike(spec: str) -> None:
    ok, widths, why = c_widths(spec.replace(" ", ""))
    assert ok, why
    cfg = OttConfig(layer_widths=spec)
    assert list(_lib.LlamaOttConfig.of(cfg).layer_widths) == widths
    assert _lib.LlamaOttConfig.of(cfg).to_config().layer_widths == cfg.layer_widths
    assert _lib.config_problem(cfg) == ""


def test_spec_is_canonical_and_later_items_win() -> None:
    cfg = OttConfig(layer_widths="20-24:4/3,15-19:4/3,5-9:4/4,7:2/2")
    assert cfg.layer_widths == "5-6:4/4,7:2/2,8-9:4/4,15-24:4/3"
    assert cfg == OttConfig(layer_widths="5-9:4/4,7:2/2,15-24:4/3")
    assert cfg.widths_for_layer(7) == (2, 2) and cfg.widths_for_layer(16) == (4, 3)
    assert cfg.widths_for_layer(0) == (2, 2) and cfg.replace(k_bits=3).widths_for_layer(0) == (3, 2)
    assert cfg.for_layer(16) == OttConfig(k_bits=4, v_bits=3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("15-24", "items are LAYER"), ("3-1:2/2", "not a range"), ("1:5/2", "widths 5/2"), ("300:2/2", "not a range"),
     ("1:2/2;2:3/3", "cannot read")],
)  # fmt: skip
def test_bad_specs_are_refused_by_both(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OttConfig(layer_widths=spec)
    ok, widths, why = c_widths(spec)
    assert not ok and why and widths == [0] * len(widths)


def test_the_c_struct_carries_a_byte_per_layer() -> None:
    # G, R, outlier_num, aux_cap, no_outlier_layers, v_rotate, k_mix, v_sym, k_young, v_young
    assert ctypes.sizeof(_lib.LlamaOttConfig) == 10 * 4 + 256
    assert list(_lib.native().llama_ott_config_default().layer_widths) == [0] * 256
    bad = _lib.LlamaOttConfig.of(OttConfig())
    bad.layer_widths[3] = 0x51
    why = ctypes.create_string_buffer(256)
    assert not _lib.native().llama_ott_config_check(ctypes.byref(bad), why, 256)
    assert "layer_widths[3]=0x51" in why.value.decode()


def test_reference_seals_each_layer_at_its_widths() -> None:
    """Layer 1 of a 2-layer cache runs 4-bit keys and 3-bit values, layer 0 the configuration's 2/2, and each layer
    holds exactly what a cache of that layer's widths holds; memory counts each layer's widths."""
    rng = np.random.default_rng(3)
    n, H, D = 200, 2, 64
    k, v = rng.standard_normal((n, H, D)), rng.standard_normal((n, H, D))
    cfg = OttConfig(layer_widths="1:4/3")
    cache = OttCache(cfg, 2, H, D)
    alone = OttCache(cfg.for_layer(1), 2, H, D)
    for layer in (0, 1):
        cache.process_ubatch(0, layer, None, k, v, np.arange(n))
        alone.process_ubatch(0, layer, None, k, v, np.arange(n))
    g0, g1 = cache.state(0, 0, 0).groups[0], cache.state(0, 1, 0).groups[0]
    # layer 0: 2-bit keys of widths 1/2/3 per channel (k_mix 2, the default), codes within each channel's width
    assert g0.k_widths is not None and sorted(set(g0.k_widths.tolist())) == [1, 2, 3] and g0.v_codes.max() == 3
    assert (g0.k_codes < (1 << g0.k_widths.astype(np.int64))[:, None]).all()
    assert g1.k_codes.max() == 15 and g1.v_codes.max() == 7
    ga = alone.state(0, 1, 0).groups[0]
    assert np.array_equal(g1.k_codes, ga.k_codes) and np.array_equal(g1.v_codes, ga.v_codes)
    assert np.array_equal(g1.k_scale, ga.k_scale) and np.array_equal(g1.v_scale, ga.v_scale)
    mixed = effective_bits(cfg, D, 8192, n_layer=2)
    assert mixed == pytest.approx(
        (effective_bits(OttConfig(), D, 8192, 2) + effective_bits(cfg.for_layer(1), D, 8192, 2)) / 2
    )


# --- the native cache ----------------------------------------------------------------------------------------------


def quantized_bytes(smollm2: Path, kv_type: str, **cfg: object) -> int:
    llm = Llama(str(smollm2), kv_type=kv_type, ott_config=cfg or None, n_ctx=N_CTX, verbose=False)
    q = int(llm.kv_cache_info()["bytes"]["quantized"])  # type: ignore[index]
    llm.close()
    return q


def test_native_cache_allocates_and_reports_each_layers_widths(
    smollm2: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    llm = Llama(str(smollm2), kv_type="ott2", ott_config={"layer_widths": TIER}, n_ctx=N_CTX, verbose=True)
    log = capfd.readouterr().err
    m = re.search(r"ott2 cache: K/V bits by layer: (.*)", log)
    assert m, log[-3000:]
    assert m.group(1).split() == ["4/3" if 15 <= il <= 24 else "2m/2" for il in range(30)]  # 2m: k_mix's widths
    assert llm.kv_cache_info()["config"] == llm.ott_config == OttConfig(layer_widths=TIER)
    mixed = int(llm.kv_cache_info()["bytes"]["quantized"])  # type: ignore[index]
    llm.close()
    # SmolLM2's 30 layers have one shape: 20 layers of ott2's blocks and 10 of ott4/ott3's
    assert 3 * mixed == 2 * quantized_bytes(smollm2, "ott2") + quantized_bytes(smollm2, "ott4/ott3")


def test_widths_given_to_every_layer_equal_the_types_and_change_the_logits_where_they_differ(
    smollm2: Path, doc_tokens: list[int]
) -> None:
    """ott2 with every layer at 3/2 runs exactly ott3/ott2 (bit-identical logits past sealing); the tier differs."""
    logits = {}
    for name, kv_type, spec in (("pair", "ott3/ott2", ""), ("all", "ott2", "0-29:3/2"), ("tier", "ott2", TIER)):
        llm = Llama(str(smollm2), kv_type=kv_type, ott_config={"layer_widths": spec}, n_ctx=N_CTX, n_threads=2,
                    verbose=False)  # fmt: skip
        llm.eval(doc_tokens[:200])
        assert llm.kv_cache_info()["sealed"] == 128
        llm.eval(doc_tokens[200:230])
        logits[name] = last_logits(llm)
        llm.close()
    assert np.array_equal(logits["pair"], logits["all"])
    assert not np.array_equal(logits["pair"], logits["tier"]) and np.isfinite(logits["tier"]).all()


def test_state_keeps_the_layer_widths(smollm2: Path, doc_tokens: list[int]) -> None:
    cfg = OttConfig(layer_widths=TIER)
    llm = Llama(str(smollm2), kv_type="ott2", ott_config=cfg, n_ctx=N_CTX, n_threads=1, verbose=False)
    llm.eval(doc_tokens[:200])
    state = llm.save_state()
    first = greedy(llm, doc_tokens[200], 6)
    same = Llama(str(smollm2), kv_type="ott2", ott_config=cfg, n_ctx=N_CTX, n_threads=1, verbose=False)
    same.load_state(state)
    assert greedy(same, doc_tokens[200], 6) == first
    other = Llama(str(smollm2), kv_type="ott2", ott_config=cfg.replace(layer_widths="15-24:4/2"), n_ctx=N_CTX,
                  verbose=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"layer 15 has K/V bits 4/3 there, 4/2 in this cache \(layer_widths, k_mix"):
        other.load_state(state)
    for x in (llm, same, other):
        x.close()


def test_widths_for_layers_the_cache_does_not_hold_are_refused(smollm2: Path, gemma3: Path) -> None:
    with pytest.raises(ValueError, match=r"widths to layer 30, but the model has 30 layers \(0..29\)"):
        Llama(str(smollm2), kv_type="ott2", ott_config={"layer_widths": "28-30:4/3"}, n_ctx=N_CTX, verbose=False)
    # Gemma 3: layers 5, 11 and 17 attend globally (ott cache), the others in a window (f16)
    with pytest.raises(ValueError, match=r"widths to layer 4, which this cache does not serve"):
        Llama(str(gemma3), kv_type="ott2", ott_config={"layer_widths": "4-5:4/3"}, n_ctx=N_CTX, verbose=False)
    llm = Llama(str(gemma3), kv_type="ott2", ott_config={"layer_widths": "5:4/3,17:4/4"}, n_ctx=N_CTX, verbose=False)
    assert llm.kv_cache_info()["config"] == OttConfig(layer_widths="5:4/3,17:4/4")
    assert _lib.ott_cache_layers(llm._ctx.ctx) == [5, 11, 17]
    llm.close()


def test_tools_take_ott_layers(smollm2: Path) -> None:
    cmd = server_command(smollm2, kv_type="ott2", ott_config=OttConfig(layer_widths=TIER))
    assert cmd[cmd.index("--ott-layers") + 1] == TIER
    assert "--ott-layers" not in server_command(smollm2, kv_type="ott2")
    bad = [str(_lib.bin_path("llama-cli")), "-m", str(smollm2), "-ctk", "ott2", "-ctv", "ott2", "--ott-layers",
           "3:5/2", "-p", "hi", "-n", "1"]  # fmt: skip
    out = subprocess.run(bad, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--ott-layers: widths 5/2 are not K/V bits of 2, 3 or 4" in out.stderr


# --- calibration ---------------------------------------------------------------------------------------------------


def test_best_plan_widens_what_gains_most_and_pays_with_what_loses_least() -> None:
    """Base 3/2 (5 code bits), up 4/3 (7), down 2/2 (4): one widened block of 2 layers is paid by narrowing 4 layers
    (2 blocks); the plan picks the largest gain net of the cheapest losses, and none when nothing nets a gain."""
    blocks = [Block((0, 1), 0.001, 0.002), Block((2, 3), 0.010, 0.050), Block((4, 5), 0.002, 0.001),
              Block((6, 7), 0.004, 0.001)]  # fmt: skip
    plan = best_plan(blocks, 0.05, (3, 2), (4, 3), (2, 2))
    assert plan.choice == ("base", "up", "down", "down")
    assert plan.predicted_kld == pytest.approx(0.05 - 0.010 + 0.002)
    assert plan.code_bits <= 5 * 8
    assert plan.spec(blocks, (3, 2), (4, 3), (2, 2)) == "2-3:4/3,4-7:2/2"
    dear = [Block(b.layers, b.up_gain, 0.02) for b in blocks]
    assert best_plan(dear, 0.05, (3, 2), (4, 3), (2, 2)).choice == ("base",) * 4


def _exhaustive(blocks: list[Block], base_kld: float, budget: float) -> float:
    """The lowest predicted KLD over every assignment within budget x the base pair's code bits (3/2 base,
    3/3 up, 2/2 down), by brute force."""
    cost = {"base": 5, "up": 6, "down": 4}
    limit = int(budget * 5 * sum(len(b.layers) for b in blocks) + 1e-9)
    best = float("inf")
    for choice in itertools.product(("base", "up", "down"), repeat=len(blocks)):
        if sum(cost[c] * len(b.layers) for b, c in zip(blocks, choice, strict=True)) > limit:
            continue
        kld = base_kld + sum(-b.up_gain if c == "up" else b.down_loss if c == "down" else 0.0
                             for b, c in zip(blocks, choice, strict=True))  # fmt: skip
        best = min(best, kld)
    return best


@pytest.mark.parametrize("budget", [1.0, 0.97, 1.05])
def test_best_plan_is_the_exhaustive_optimum(budget: float) -> None:
    """The dynamic programme finds the assignment brute force finds, at the base pair's bytes and under a tighter
    or looser budget, on random blocks of uneven sizes; a tighter budget spends fewer code bits than the base."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        n = int(rng.integers(1, 7))
        sizes = rng.integers(1, 4, n)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        blocks = [Block(tuple(range(int(s), int(s + z))), float(rng.uniform(-0.002, 0.01)),
                        float(rng.uniform(-0.001, 0.03))) for s, z in zip(starts, sizes, strict=True)]  # fmt: skip
        plan = best_plan(blocks, 0.05, (3, 2), (3, 3), (2, 2), budget)
        want = _exhaustive(blocks, 0.05, budget)
        if budget >= 1.0:
            want = min(want, 0.05)
        assert plan.predicted_kld == pytest.approx(want, abs=1e-12)
        assert plan.code_bits <= int(budget * 5 * int(sizes.sum()) + 1e-9)


def test_best_plan_under_a_tighter_budget_narrows_the_cheapest_block() -> None:
    blocks = [Block((0, 1, 2), 0.0, 0.004), Block((3, 4, 5), 0.0, 0.001), Block((6, 7, 8), 0.0, 0.009)]
    plan = best_plan(blocks, 0.05, (3, 2), (3, 3), (2, 2), budget=0.95)
    assert plan.choice == ("base", "down", "base")
    assert plan.predicted_kld == pytest.approx(0.051)
    with pytest.raises(ValueError, match="no assignment fits"):
        best_plan(blocks, 0.05, (3, 2), (3, 3), (2, 2), budget=0.7)


def test_best_plan_with_a_limit_in_code_bits() -> None:
    """A limit in code bits replaces the budget: above the base pair's it can widen more blocks than it narrows."""
    blocks = [Block((0, 1), 0.004, 0.002), Block((2, 3), 0.003, 0.010), Block((4, 5), 0.001, 0.020)]
    assert best_plan(blocks, 0.05, (3, 2), (3, 3), (2, 2), limit=30 + 2).choice == ("up", "base", "base")
    assert best_plan(blocks, 0.05, (3, 2), (3, 3), (2, 2), limit=30 + 4).choice == ("up", "up", "base")
    assert best_plan(blocks, 0.05, (3, 2), (3, 3), (2, 2), limit=30 - 2).choice == ("down", "base", "base")


def test_best_plan_widens_only_when_down_is_the_base_pair() -> None:
    """ott2 (2/2) has no narrower widths: calibrate takes down = the base pair as "widen only" (no narrowing runs,
    losses unknown); the plan widens the blocks that gain most within the limit and never picks "down"."""
    blocks = [Block((0, 1, 2), 0.002, math.inf), Block((3, 4, 5), 0.030, math.inf), Block((6, 7, 8), 0.010, math.inf)]
    assert best_plan(blocks, 0.12, (2, 2), (3, 2), (2, 2), limit=36 + 3).choice == ("base", "up", "base")
    plan = best_plan(blocks, 0.12, (2, 2), (3, 2), (2, 2), limit=36 + 6)
    assert plan.choice == ("base", "up", "up") and plan.predicted_kld == pytest.approx(0.12 - 0.04)
    assert best_plan(blocks, 0.12, (2, 2), (3, 2), (2, 2)).choice == ("base",) * 3  # the base pair's bytes
    assert planned_runs(10, narrow=False) == 13 and planned_runs(10) == 23


def test_plan_within_bits_fits_the_caches_own_bytes(smollm2: Path) -> None:
    """SmolLM2 ott3/ott2 takes 3.221 bits per element at 8k: with max_bits 3.2 the plan's cache (measured, not
    predicted) fits, and spends more than the code bits of budget 0.98; a limit below every narrowing is refused."""
    blocks = [Block(tuple(range(i, i + 3)), 0.004 - 0.0003 * i, 0.001 + 0.0002 * i) for i in range(0, 30, 3)]
    plan = plan_within_bits(smollm2, "ott3", "ott2", blocks, 0.04, (3, 2), (3, 3), (2, 2), 3.2, log=lambda _: None)
    spec = plan.spec(blocks, (3, 2), (3, 3), (2, 2))
    assert spec and cache_bits(smollm2, "ott3", "ott2", spec) <= 3.2
    assert cache_bits(smollm2, "ott3", "ott2", "") > 3.2
    tight = best_plan(blocks, 0.04, (3, 2), (3, 3), (2, 2), budget=0.98)
    assert plan.code_bits >= tight.code_bits and plan.predicted_kld <= tight.predicted_kld
    with pytest.raises(ValueError, match="no widths of the blocks fit 2 bits"):
        plan_within_bits(smollm2, "ott3", "ott2", blocks, 0.04, (3, 2), (3, 3), (2, 2), 2.0, log=lambda _: None)


def test_calibrate_command_on_smollm2(smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Small but real: 2 blocks, one 512-token chunk of calibration text, the quality tier's parameters (R 64,
    symmetric values); the report covers every layer, and a chosen spec measured below the base pair at no more
    code bits, with the parameters it was calibrated under."""
    out_file = tmp_path / "calib.json"  # not the user cache, where --kv-tier quality would find it
    code, out, err = run_cli(capsys, "calibrate", smollm2, "--blocks", "2", "--chunks", "1", "--n-ctx", "512",
                             "--threads", str(THREADS), "--ott-params", "128,64,3,32,2,1,1,1",
                             "--out", out_file)  # fmt: skip
    assert code == 0, err
    assert out_file.is_file()
    assert "| 0-14 |" in out and "| 15-29 |" in out, out
    base = float(re.search(r"base pair everywhere: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert 0 < base < 1
    m = re.search(r"chosen: --ott-layers (\S+) \(predicted KLD [0-9.]+, measured ([0-9.]+)", out)
    if m:
        assert float(m.group(2)) < base and f"--ott-params 128,64,3,32,2,1,1,1 --ott-layers {m.group(1)}" in out
        assert "'R': 64" in out and "'v_sym': True" in out  # the Python form carries them too
        widths = parse_layer_widths(m.group(1))
        assert sum(sum(widths.get(il, (3, 2))) for il in range(30)) <= 5 * 30  # code bits: no more than ott3/ott2
    else:
        assert "chosen: the base pair everywhere" in out
    assert err.count("mean KLD") >= 5  # base, each block widened and narrowed
    # the cache's own bytes at 8k under those parameters: ott3/ott2 with its fp16 tail and pools (3.16: symmetric
    # values save 0.12, the wider window costs 0.06); widths within the base's code bits
    bits = re.search(r"bits per K/V element at 8192 tokens .*: base pair ([0-9.]+), chosen ([0-9.]+)", out)
    assert bits, out
    assert float(bits.group(1)) == pytest.approx(
        cache_bits(smollm2, "ott3", "ott2", "", ott_config={"R": 64, "v_sym": True}), abs=6e-4
    )
    assert 3.0 < float(bits.group(1)) < 3.2 and float(bits.group(2)) <= float(bits.group(1)) + 0.01


def test_calibrate_refuses_what_it_cannot_do(smollm2: Path) -> None:
    with pytest.raises(ValueError, match="budget is a fraction"):
        calibrate(smollm2, kv_type="ott3/ott2", budget=0.1)
    with pytest.raises(ValueError, match="either a budget .* or max_bits"):
        calibrate(smollm2, kv_type="ott3/ott2", budget=0.99, max_bits=3.2)
    with pytest.raises(ValueError, match="max_bits is bits per K/V element"):
        calibrate(smollm2, kv_type="ott3/ott2", max_bits=0.1)
    with pytest.raises(ValueError, match="not 'q8_0'"):
        calibrate(smollm2, kv_type="q8_0")
    with pytest.raises(ValueError, match="up .* must hold more code bits"):
        calibrate(smollm2, kv_type="ott3/ott2", up="3/2")
    with pytest.raises(ValueError, match="down .* fewer .*widen only"):
        calibrate(smollm2, kv_type="ott2", up="3/2", down="3/2")  # ott2 widens only: down must be 2/2 itself
    with pytest.raises(ValueError, match="widths must be K/V bits"):
        calibrate(smollm2, kv_type="ott3/ott2", up="5/3")
    with pytest.raises(ValueError, match="chooses layer_widths itself"):
        calibrate(smollm2, kv_type="ott3/ott2", ott_config=OttConfig(layer_widths="0:3/3"))
    with pytest.raises(ValueError, match="n_ctx must be at least 64"):
        calibrate(smollm2, kv_type="ott3/ott2", n_ctx=16)
    with pytest.raises(ValueError, match="max_minutes must be positive"):
        calibrate(smollm2, kv_type="ott3/ott2", max_minutes=0)
    with pytest.raises(ValueError, match=r"n_ctx 65536 is beyond .*training context \(8192 tokens\)"):
        calibrate(smollm2, kv_type="ott3/ott2", n_ctx=65536)


def test_calibration_time_estimate_and_context_choice() -> None:
    """The probe's fit: t = c + a n + b n^2 through three timed runs, exact for such a curve, never negative from
    noisy times; the context: the longest of 8192/4096/2048 within the model's training context whose estimate
    fits the time allowed, else the shortest, saying why."""
    t = fit_seconds([256, 512, 1024], [1 + 0.01 * n + 1e-5 * n * n for n in (256, 512, 1024)])
    assert t(8192) == pytest.approx(1 + 81.92 + 1e-5 * 8192**2)
    noisy = fit_seconds([256, 512, 1024], [2.0, 1.9, 2.1])  # a load time and noise
    assert all(noisy(n) >= 0 for n in (256, 2048, 8192)) and noisy(8192) >= noisy(2048)
    # the calibration: one f16 run and 3 + 2 * blocks - 1 ott runs, each of `chunks` chunks
    assert estimate_seconds(lambda n: 10.0, lambda n: 1.0, 2048, 2, 10) == 2 * (10 + 22)
    assert choose_context(lambda n: n / 10, None, 500) == (4096, "the longest of 8192/4096/2048 that fits 8m20s")
    assert choose_context(lambda n: n / 10, 2048, 5000)[0] == 2048  # a model trained at 2k
    n, why = choose_context(lambda n: n, 32768, 60)
    assert n == 2048 and why.startswith("none of 8192/4096/2048 fits")
    assert choose_context(lambda n: 0.0, 1024, 60) == (2048, "the model's training context is 1024 tokens")
