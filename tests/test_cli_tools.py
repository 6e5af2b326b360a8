"""`ott-gguf info`, `eval` and `bench` on the real models: what they print and how it hangs together."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ott_gguf import _lib, build_info, info
from ott_gguf import evaluate as evaluate_mod
from ott_gguf import reference as ref
from ott_gguf.kv_types import KV_TYPES

from helpers import THREADS, run_cli, table

MIB = 1 << 20


def png_written(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


# --- info ------------------------------------------------------------------------------------------------------


def test_info_on_smollm2(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    budget_mib, n_ctx = 512, 4096
    code, out, err = run_cli(capsys, "info", smollm2, "--budget-mib", budget_mib, "--n-ctx", n_ctx)
    assert code == 0, err
    assert "architecture: llama" in out
    assert "ott2: supported" in out
    rows = table(out)
    assert list(rows) == ["f16", "q8_0", "q4_0", "kivi2", "ott2"]
    bpt = {t: float(r["bytes/token"]) for t, r in rows.items()}
    assert bpt["ott2"] < bpt["q4_0"] < bpt["q8_0"] < bpt["f16"]
    assert bpt["kivi2"] == bpt["ott2"]  # the same layout: only the outlier slots (fixed part) differ
    for t in ("f16", "q8_0", "q4_0"):  # the allocation agrees with the shape read from the metadata
        assert abs(bpt[t] - float(rows[t]["formula"])) <= 2, rows[t]

    longest = {t: int(r[f"max n_ctx in {budget_mib} MiB"]) for t, r in rows.items()}
    assert longest["ott2"] > longest["q4_0"] > longest["q8_0"] > longest["f16"] > 0
    # SmolLM2 was trained on 8192 tokens: contexts the budget allows beyond that are pointed out, by type
    assert "trained context: 8192" in out
    beyond = [t for t in rows if longest[t] > 8192]
    assert beyond and f"the max n_ctx of {', '.join(beyond)} goes beyond it" in " ".join(out.split())
    budget = budget_mib * MIB
    for t, r in rows.items():
        fixed = float(r["fixed MiB"]) * MIB
        # the printed numbers are rounded (bytes/token to 1 B, MiB to 0.01): allow for that
        slack = 0.5 * (longest[t] + 256) + 0.005 * MIB
        assert fixed + bpt[t] * longest[t] <= budget + slack, r  # it fits ...
        assert fixed + bpt[t] * (longest[t] + 256) > budget - slack, r  # ... and 256 more tokens would not
        assert abs(float(r[f"MiB @ {n_ctx}"]) * MIB - (fixed + bpt[t] * n_ctx)) <= 0.5 * n_ctx + 0.01 * MIB, r


def test_kv_bytes_agree_with_the_layouts(smollm2: Path) -> None:
    """The measured slopes equal the stock types' closed form and the ott2 memory model of the numpy reference;
    the fixed part of ott2 is its fp16 ring and pools, larger than kivi2's by the outlier slots."""
    mi = info.model_info(smollm2)
    kb = {k.kv_type: k for k in info.measure_kv_bytes(smollm2, ("f16", "q4_0", "kivi2", "ott2"))}
    for t in ("f16", "q4_0"):
        formula = info.formula_bytes_per_token(mi, t)
        assert formula is not None and abs(kb[t].per_token - formula) <= 2, (t, kb[t].per_token, formula)
        assert abs(kb[t].fixed) <= 0.01 * MIB

    assert mi.head_dim_k == mi.head_dim_v and mi.n_head_kv is not None
    cfg = ref.OttConfig(Gv=int(build_info()["ott2_group"]))  # the defaults the cache is created with
    small, large = info.MEASURE_CTX

    def model_bytes(n: int) -> float:
        per_head = sum(sum(ref.memory_bits(cfg, mi.head_dim_k, n, layer).values()) for layer in range(mi.n_layer))
        return per_head * mi.n_head_kv / 8

    spec_slope = (model_bytes(large) - model_bytes(small)) / (large - small)
    assert abs(kb["ott2"].per_token - spec_slope) <= 2, (kb["ott2"].per_token, spec_slope)
    ott2 = kb["ott2"]
    sealable = (large - cfg.R) // cfg.G * cfg.G  # sealed capacity: the groups that R newer tokens can follow
    assert abs(ott2.parts["quantized"] - ott2.per_token * sealable) <= 0.02 * MIB
    fixed = ott2.parts["fp16 tail"] + ott2.parts["pools"] - ott2.per_token * (large - sealable)
    assert abs(fixed - ott2.fixed) <= 0.02 * MIB
    assert kb["kivi2"].parts["pools"] < ott2.parts["pools"]
    assert kb["kivi2"].fixed < ott2.fixed


def test_info_on_gemma3_reports_what_the_build_says(gemma3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma 3's window layers: ott_gguf.Llama (llama-cpp-python's swa_full) keeps them full size, llama.cpp's tools
    keep the window; info's table is the former, its 'serve' column the latter, both as allocated."""
    from ott_gguf import Llama

    problem = _lib.ott_model_problem(str(gemma3))
    code, out, err = run_cli(capsys, "info", gemma3)
    assert code == 0, err
    assert "architecture: gemma3" in out
    rows = table(out)
    assert rows["f16"]["formula"] == "-"  # window layers: which layers is the architecture's
    # ott_gguf.Llama's allocation: llama-cpp-python keeps the window layers full size (swa_full), so all 18 layers
    # cache every token; llama.cpp's tools (the serve column) keep only the window there
    assert float(rows["f16"]["bytes/token"]) == pytest.approx(18 * 1 * 512 * 2, abs=2)
    assert "window layers as large as the others" in " ".join(out.split())
    # the table is what Llama allocates (Python, chat, generate), the serve column what llama-server does
    n_ctx = 4096
    for t, swa_full, column in [("f16", None, f"MiB @ {n_ctx}"), ("f16", False, f"MiB @ {n_ctx} serve"),
                                ("ott2", None, f"MiB @ {n_ctx}")]:  # fmt: skip
        if t == "ott2" and problem:
            continue
        llm = Llama(
            str(gemma3), kv_type=t, n_ctx=n_ctx, verbose=False, **({} if swa_full is None else {"swa_full": swa_full})
        )
        allocated = int(llm.kv_cache_info()["total_bytes"])  # type: ignore[call-overload]
        llm.close()
        assert float(rows[t][column]) == pytest.approx(allocated / MIB, abs=0.01), (t, column, rows[t])
    assert float(rows["f16"][f"MiB @ {n_ctx} serve"]) < float(rows["f16"][f"MiB @ {n_ctx}"]) / 2
    if problem:
        assert f"ott2: not supported: {problem}" in out
        assert rows["ott2"]["max n_ctx in 1024 MiB"] == "not supported"
    else:
        assert "ott2: supported" in out
        assert float(rows["ott2"]["bytes/token"]) < float(rows["f16"]["bytes/token"])


# --- eval ------------------------------------------------------------------------------------------------------


def test_eval_against_f16(smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    seen: list[evaluate_mod.EvalRow] = []
    real = evaluate_mod.evaluate

    def spy(*args: object, **kwargs: object) -> list[evaluate_mod.EvalRow]:
        seen.extend(real(*args, **kwargs))  # type: ignore[arg-type]
        return list(seen)

    monkeypatch.setattr(evaluate_mod, "evaluate", spy)  # the exact numbers behind the printed table
    png = tmp_path / "eval.png"
    code, out, err = run_cli(capsys, "eval", smollm2, "--n-ctx", 256, "--chunks", 1, "--threads", THREADS,
                             "--kv-types", "f16,q8_0,kivi2,ott2", "--plot", png)  # fmt: skip
    assert code == 0, err
    rows = {r.kv_type: r for r in seen}
    assert list(rows) == ["f16", "q8_0", "kivi2", "ott2"]
    assert all(r.n_tokens == 256 and r.chunks == 1 for r in seen)
    f16 = rows["f16"]  # a second f16 run against the reference run: the evaluation is deterministic
    assert f16.mean_kld == 0.0 and f16.max_kld == 0.0 and f16.top1 == 1.0 and f16.ppl_ratio == 1.0
    assert 0 < rows["q8_0"].mean_kld < rows["ott2"].mean_kld < rows["kivi2"].mean_kld
    assert rows["ott2"].top1 < 1.0

    printed = table(out)
    assert printed["f16"]["mean KLD"] == "0" and printed["f16"]["top-1 = f16"] == "100.0%"
    for t, r in rows.items():
        assert float(printed[t]["mean KLD"]) == pytest.approx(r.mean_kld, rel=1e-3)
        assert float(printed[t]["PPL / f16"]) == pytest.approx(r.ppl_ratio, abs=1e-4)
    assert png_written(png)


# --- bench -----------------------------------------------------------------------------------------------------


def test_bench_speeds_per_type_and_depth(smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "bench.png"
    kv_types = ["f16", "ott2"]  # two types show the interleaving (a third cost a third more, issue 50)
    code, out, err = run_cli(capsys, "bench", smollm2, "-p", 64, "-n", 8, "--depths", "0,256", "-r", 2,
                             "--threads", THREADS, "--kv-types", ",".join(kv_types), "--plot", png)  # fmt: skip
    assert code == 0, err
    assert "median of 2 round(s) with the types interleaved" in out
    # the rounds interleave the types: f16, ott2, f16, ott2
    assert re.findall(r"round (\d)/2, (\w+):", err) == [(r, t) for r in "12" for t in kv_types], err
    rows = table(out)
    assert list(rows) == kv_types
    columns = ["pp64 @ 0", "tg8 @ 0", "pp64 @ 256", "tg8 @ 256"]
    for t in kv_types:
        assert all(float(rows[t][c].split(" ±")[0]) > 0 and rows[t][c].endswith("%") for c in columns), rows[t]
    assert float(rows["ott2"]["KV B/token"]) < float(rows["f16"]["KV B/token"])
    assert png_written(png)


def test_a_configured_tier_runs_with_its_parameters(smollm2: Path) -> None:
    """bench and measure_kv_bytes take a configured ott cache under a label (R 64, symmetric values, widths per
    layer): llama-bench gets --ott-params and --ott-layers, and the bytes are that cache's (smaller than the
    default ott3/ott2's by the 2 bytes of every V block's min, larger by the wider fp16 window)."""
    from ott_gguf.bench import bench, bench_command
    from ott_gguf.kv_types import OttConfig

    cfg = OttConfig(R=64, v_sym=True, layer_widths="0-2:3/3")
    tiers = {"tier": ("ott3/ott2", cfg)}
    cmd = bench_command(smollm2, "ott3/ott2", depths=[0], n_prompt=0, n_gen=4, threads=THREADS, reps=1, ott_config=cfg)
    assert (
        cmd[cmd.index("--ott-params") + 1] == "128,64,3,32,2,1,2,1" and cmd[cmd.index("--ott-layers") + 1] == "0-2:3/3"
    )
    seen: list[str] = []
    rows = bench(smollm2, ["ott3/ott2", "tier"], depths=[256], n_prompt=0, n_gen=4, threads=THREADS, reps=1,
                 progress=seen.append, tiers=tiers)  # fmt: skip
    assert [r.kv_type for r in rows] == ["ott3/ott2", "tier"] and all(r.tokens_per_s > 0 for r in rows)
    assert "--ott-params" not in seen[0] and "--ott-params 128,64,3,32,2,1,2,1 --ott-layers 0-2:3/3" in seen[1]
    plain, tier, sym = info.measure_kv_bytes(smollm2, ["ott3/ott2", "tier", "sym"], n_ctx=(2048, 8192),
                                             tiers={**tiers, "sym": ("ott3/ott2", OttConfig(v_sym=True))})  # fmt: skip
    assert tier.kv_type == "tier" and sym.kv_type == "sym"
    m = info.model_info(smollm2)
    # per token: every layer's V blocks lose their 2-byte min (head dim 64 = one block per KV head)
    assert plain.per_token - sym.per_token == pytest.approx(m.n_layer * m.n_head_kv * 2, rel=0.02)
    assert tier.at(8192) > sym.at(8192)  # the wider window and 3 layers at 3/3


def test_bench_runs_a_type_without_flash_attention(smollm2: Path) -> None:
    """ "T:fa0" is T under llama-bench -fa 0, interleaved with the others under its own name."""
    from ott_gguf.bench import bench

    seen: list[str] = []
    rows = bench(smollm2, ["f16", "f16:fa0"], depths=[0], n_prompt=0, n_gen=4, threads=THREADS, reps=1,
                 progress=seen.append)  # fmt: skip
    assert [r.kv_type for r in rows] == ["f16", "f16:fa0"] and all(r.tokens_per_s > 0 for r in rows)
    assert " -fa 1 " in seen[0] and " -fa 0 " in seen[1] and "-ctk f16 -ctv f16" in seen[1]
    with pytest.raises(ValueError):
        bench(smollm2, ["f17:fa0"], depths=[0], n_prompt=0, n_gen=4, threads=THREADS, reps=1)


def test_ott_params_on_the_command_line() -> None:
    """--ott-params as llama.cpp's tools of this build take it: five to ten integers, switches 0 or 1."""
    import argparse

    from ott_gguf.cli import _ott_config, parse_ott_params

    assert parse_ott_params("128,64,3,32,2") == {"G": 128, "R": 64, "outlier_num": 3, "aux_cap": 32,
                                                 "no_outlier_layers": 2}  # fmt: skip
    assert parse_ott_params("128,64,3,32,2,1,1,1")["v_sym"] is True
    young = parse_ott_params("128,32,3,32,2,1,2,1,4,2")
    assert (young["k_young"], young["v_young"]) == (4, 2)
    for bad, message in (("128,64,3", "expects G,R"), ("128,64,3,32,2,1,1,1,4,4,1", "expects G,R"),
                         ("128,x,3,32,2", "integers"), ("128,64,3,32,2,1,3", "k_mix=3 must be 0, 1 or 2"),
                         ("128,64,3,32,2,2,1", "v_rotate=2 must be 0 or 1")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_ott_params(bad)
    args = argparse.Namespace(ott_layers="", ott_params="128,64,3,32,2,1,1,1")
    cfg = _ott_config(args, "ott3/ott2")
    assert cfg is not None and (cfg.R, cfg.v_sym, cfg.k_mix) == (64, True, True)
    assert parse_ott_params("128,32,3,32,2,1,2")["k_mix"] == 2  # k_mix on 2-bit keys too
    cfg2 = _ott_config(argparse.Namespace(ott_layers="", ott_params="128,32,3,32,2,1,2"), "ott2")
    assert cfg2 is not None and cfg2.k_mixed and cfg2.replace(k_bits=4).k_mixed is False
    with pytest.raises(ValueError, match="--ott-params applies to the ott cache types"):
        _ott_config(args, "q4_0")
    with pytest.raises(ValueError, match="v_sym needs v_rotate"):
        _ott_config(argparse.Namespace(ott_layers="", ott_params="128,64,3,32,2,0,1,1"), "ott2")
    with pytest.raises(ValueError, match=r"k_young must be in \[0, 16\]"):
        _ott_config(argparse.Namespace(ott_layers="", ott_params="128,32,3,32,2,1,2,1,17"), "ott2")


# --- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_unknown_kv_type_is_refused_listing_the_valid_ones(command: str, smollm2: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    code, out, err = run_cli(capsys, command, smollm2, "--kv-types", "f16,q9")
    assert code == 2
    assert "unknown kv_type 'q9'" in err
    assert all(t in err for t in KV_TYPES)


@pytest.mark.parametrize("command", ["info", "eval", "bench"])
def test_missing_or_unreadable_model_is_named(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.gguf"
    code, _, _ = run_cli(capsys, command, missing)
    assert isinstance(code, str) and "no such model file" in code and str(missing) in code

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a GGUF file" * 100)
    code, _, err = run_cli(capsys, command, junk)
    assert code == 2 and "load" in err and str(junk) in err


def test_eval_warns_when_nothing_gets_sealed(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Below R + G positions the ott cache quantizes nothing: eval says so instead of reporting ott2 as lossless."""
    code, out, err = run_cli(capsys, "eval", smollm2, "--n-ctx", 128, "--chunks", 1, "--threads", THREADS,
                             "--kv-types", "f16,ott2")  # fmt: skip
    assert code == 0, err
    assert "no group of 128 tokens is ever sealed" in err and "--n-ctx 160" in err
    code, out, err = run_cli(capsys, "eval", smollm2, "--n-ctx", 128, "--chunks", 1, "--threads", THREADS,
                             "--kv-types", "f16,q8_0")  # fmt: skip
    assert code == 0 and "sealed" not in err


def test_eval_missing_text_file_is_named(smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "eval", smollm2, "--text", tmp_path / "none.txt")
    assert code == 2 and "none.txt" in err


# --- chat and generate: llama.cpp's options, markers (issue 48) ---------------------------------------------------


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_help_shows_every_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, command, "-h")
    assert code == 0
    blocks = re.split(r"\n  (?=-)", out.split("options:", 1)[1])  # one per option, wrapped lines included
    for block in blocks:
        if block.strip() and not block.strip().startswith("-h, --help"):
            assert "default" in block, block
    for flag in ("-m MODEL, --model MODEL", "-ngl N, --n-gpu-layers N", "-t N, --threads N", "--chat-format NAME",
                 "-s SEED, --seed SEED", "--temp TEMPERATURE, --temperature TEMPERATURE"):  # fmt: skip
        assert flag in out, flag


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["chat", "--gpu-layerz", "9"], "unrecognized arguments: --gpu-layerz"),
        (["chat", "--", "-ngl", "99"], "'--' passes options to llama-server, in 'ott-gguf serve' only"),
        (["generate", "Hi", "--", "-ngl", "99"], "'--' passes options to llama-server, in 'ott-gguf serve' only"),
        (["info", "x.gguf", "--", "-c", "512"], "'--' passes options to llama-server, in 'ott-gguf serve' only"),
        (["generate", "Hi", "--chat-format", "nope"], "unknown chat format 'nope'; llama-cpp-python's: "),
        (["chat", "-t", "0"], "expected an integer >= 1, got 0"),
        (["generate", "Hi", "--temp", "-1"], "expected a temperature >= 0"),
    ],
)
def test_chat_and_generate_refuse_what_they_do_not_take(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Refused before any model is loaded (today's main dropped everything after -- and ran)."""
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and message in err, err


class _Loaded(Exception):
    """Raised by a stand-in Llama with the keywords it was given."""


def test_options_reach_the_llama(smollm2: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """chat and generate take the model the same ways (MODEL or -m) and hand llama.cpp's options to ott_gguf.Llama."""
    import ott_gguf
    from ott_gguf import chat

    def fake_llama(path: str, **kw: object) -> None:
        raise _Loaded(path, kw)

    monkeypatch.setattr(ott_gguf, "Llama", fake_llama)
    monkeypatch.setattr(chat, "run", lambda model, **kw: fake_llama(str(model), **kw))
    want = dict(kv_type="ott2", ott_config=None, n_gpu_layers=0, verbose=False, n_threads=1, n_threads_batch=1,
                chat_format="chatml", seed=5)  # fmt: skip
    opts = ["-t", "1", "-s", "5", "--chat-format", "chatml", "--temp", "0.5", "-c", "300", "-n", "7"]
    for argv in (["generate", "-m", smollm2, "Hi", *opts], ["generate", smollm2, "Hi", *opts],
                 ["chat", "-m", smollm2, *opts], ["chat", smollm2, *opts]):  # fmt: skip
        with pytest.raises(_Loaded) as got:
            run_cli(capsys, *argv)
        path, kw = got.value.args
        assert path == str(smollm2), argv
        if argv[0] == "generate":
            assert kw == {**want, "n_ctx": 512}  # rounded up to llama.cpp's multiple of 256
        else:
            assert kw == {**want, "n_ctx": 300, "system": None, "max_tokens": 7, "temperature": 0.5}
    code, _, err = run_cli(capsys, "chat", smollm2, "-m", smollm2)
    assert code == 2 and "the model is given twice" in err


def test_gpu_layers_need_a_gpu(smollm2: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """-ngl reaches the Llama where llama.cpp finds a GPU device; elsewhere it is refused instead of being ignored
    (llama.cpp itself only logs a warning, hidden without --verbose)."""
    import ott_gguf

    def fake_llama(path: str, **kw: object) -> None:
        raise _Loaded(path, kw)

    monkeypatch.setattr(ott_gguf, "Llama", fake_llama)
    if _lib.gpu_devices():
        with pytest.raises(_Loaded) as got:
            run_cli(capsys, "generate", "Hi", "-m", smollm2, "-ngl", "99")
        assert got.value.args[1]["n_gpu_layers"] == 99
    else:
        code, _, err = run_cli(capsys, "generate", "Hi", "-m", smollm2, "-ngl", "99")
        assert code == 2 and "-ngl 99: llama.cpp finds no GPU device" in err, err


def test_generate_says_where_the_answer_was_cut(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "generate", "Tell me a long story about a dragon.", "-m", smollm2, "-n", 4,
                             "-c", 256, "-t", THREADS)  # fmt: skip
    assert code == 0, err
    assert out.rstrip().endswith(" [max tokens]"), out
    assert "has no chat template" not in err  # SmolLM2 has its own


def test_serve_refuses_a_busy_port_before_any_banner(smollm2: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import os
    import socket

    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail(f"llama-server was started: {a}"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, out, err = run_cli(capsys, "serve", smollm2, "--port", port)
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "serving" not in out, (out, err)


# --- what the tools tell a newcomer (issue 49, deliverable 3) --------------------------------------------------


def test_eval_defaults_to_2048_tokens_and_prints_bits_per_element(
    smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 512 tokens most positions stay in ott2's fp16 window; the default chunk is 2048 (a short text gives one
    shorter chunk, cheap here), and each type's row says the bits per element its cache took."""
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 15)
    code, out, err = run_cli(capsys, "eval", smollm2, "--text", text, "--chunks", 1, "--threads", THREADS,
                             "--ubatch", 64, "--kv-types", "q4_0,compact,quality")  # fmt: skip
    assert code == 0, err
    assert "chunk(s) of up to 2048" in out
    rows = table(out)
    bits = {t: float(r["bits/elem @ 2048"]) for t, r in rows.items()}
    assert bits["q4_0"] == pytest.approx(4.5, abs=0.01)  # 18 bytes per block of 32
    assert 2.5 < bits["compact"] < 4.5  # ott2: 2-bit codes, their scales, the fp16 window and pools at 2048 tokens
    assert bits["compact"] < bits["quality"] < 5  # 3-bit keys, a 64-token window (docs/tiers.md: 4.40 at 2k)
    assert "kv tier quality: ott3/ott2" in err and float(rows["quality"]["mean KLD"]) > 0


def test_bench_warns_on_one_round(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "bench", smollm2, "-p", 0, "-n", 4, "--depths", 0, "-r", 1,
                             "--threads", THREADS, "--kv-types", "f16")  # fmt: skip
    assert code == 0, err
    assert "warning: one round: no spread" in err


def test_bench_warns_on_a_wide_spread_and_the_plot_says_the_rounds(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rows' rounds are given (a busy machine cannot be ordered up): the warning and the plot's title follow
    from them."""
    from ott_gguf import bench as bench_mod

    rows = [bench_mod.BenchRow("f16", "tg", 4, 0, 10.0, 1.0, (8.0, 10.0, 10.5)),  # spread 25%
            bench_mod.BenchRow("ott2", "tg", 4, 0, 10.0, 0.1, (9.9, 10.0, 10.1))]  # fmt: skip
    titles: list[str] = []
    monkeypatch.setattr(bench_mod, "bench", lambda *a, **k: rows)
    monkeypatch.setattr(bench_mod, "plot_bench", lambda rows, path, per_token, title: titles.append(title))
    code, out, err = run_cli(capsys, "bench", smollm2, "--kv-types", "f16,ott2", "-r", 3, "--plot", tmp_path / "b.png")
    assert code == 0, err
    assert "warning: the rounds differ by more than 20% of the median for f16 tg4 @ 0 (25%)" in err
    assert "ott2 tg4" not in err and "one round" not in err
    assert titles and "median of 3 round(s)" in titles[0]


@pytest.mark.parametrize("kv_type", ["f16", "q4_0"])
def test_kv_cache_info_gives_bytes_for_stock_types(smollm2: Path, kv_type: str) -> None:
    from ott_gguf import Llama

    mi = info.model_info(smollm2)
    llm = Llama(str(smollm2), kv_type=kv_type, n_ctx=1024, verbose=False)
    got = llm.kv_cache_info()
    formula = info.formula_bytes_per_token(mi, kv_type)
    assert formula is not None and got["total_bytes"] == pytest.approx(1024 * formula, abs=2)
    assert got["bytes"] == {"K and V": got["total_bytes"]}
    llm.close()


def test_kl_divergence_equals_the_float64_definition() -> None:
    """kl_divergence (float32 exponentials, float64 sums) against sum p (log p - log q) from float64 log-softmaxes:
    logits of a 50k vocabulary near each other, shifted by a constant (KL 0), far apart and with
    -inf-like masked entries, over a block boundary (KLD_ROWS)."""
    from ott_gguf.evaluate import KLD_ROWS, kl_divergence, log_softmax

    rng = np.random.default_rng(3)
    n, v = KLD_ROWS + 5, 50_000
    a = (rng.standard_normal((n, v)) * 4).astype(np.float32)
    cases = {
        "near": a + (rng.standard_normal((n, v)) * 0.2).astype(np.float32),
        "shifted": a + np.float32(7.5),
        "far": (rng.standard_normal((n, v)) * 4).astype(np.float32),
        "masked": np.where(rng.random((n, v)) < 0.3, np.float32(-1e4), a),
    }
    for name, b in cases.items():
        la, lb = log_softmax(a), log_softmax(b)
        want = (np.exp(la) * (la - lb)).sum(axis=1)
        got = kl_divergence(a, b)
        assert got.shape == (n,) and got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(kl_divergence(a, a + np.float32(7.5))).max() < 1e-5
    with pytest.raises(ValueError, match="logit shapes differ"):
        kl_divergence(a, a[:-1])
