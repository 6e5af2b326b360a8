"""--kv-tier / Llama(kv_tier=...) and the calibration files the quality tier reads (issue 49, deliverables 1-2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ott_gguf import Llama, tiers
from ott_gguf.models import MODELS

from helpers import THREADS, run_cli

# the widths of the calibrations shipped in the package (docs/tiers.md, the quality tier)
SHIPPED = {"smollm2-135m": "0-2:3/3,3-5:2/2,9-11:2/2,18-23:3/3,27-29:2/2", "gemma3-270m": "11:3/3,17:2/2"}
# and the compact tier's (ott2 with symmetric values, keys widened where they count at 8k, docs/long-context.md)
COMPACT = {"smollm2-135m": "5:3/2,7-9:3/2,14-18:3/2,20:3/2,23:3/2", "gemma3-270m": "5:3/2,11:3/2,17:3/2"}


@pytest.fixture
def user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user cache for calibrations and the sha256 index (the models stay where they are), so that the
    machine's own calibrations do not count and none is left there."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(tiers, "_cache_dir", lambda: cache)
    return cache


def test_shipped_calibrations_are_installed_and_valid() -> None:
    for tier, shipped in (("quality", SHIPPED), ("compact", COMPACT)):
        kv_type, params = tiers.TIER_PAIRS[tier]
        for name, widths in shipped.items():
            sha = MODELS[name].sha256
            cal = tiers.read_calibration(tiers.PACKAGE_CALIBRATIONS / tiers.calibration_name(sha, kv_type, params))
            assert cal.data["model_sha256"] == sha and cal.data["model_file"] == MODELS[name].filename
            assert (cal.kv_type, cal.ott_params, cal.layer_widths) == (kv_type, params, widths)
            assert cal.data["calibration"]["command"].startswith("ott-gguf calibrate ")
    # ott2's defaults with symmetric V blocks: a change of them orphans these files
    assert tiers.COMPACT_PARAMS == "128,32,3,32,2,1,2,1"
    for name in COMPACT:  # the tier's bound: at most 2.8 bits per element at 8k, by the cache's own bytes
        cal = tiers.read_calibration(tiers.PACKAGE_CALIBRATIONS / tiers.calibration_name(
            MODELS[name].sha256, *tiers.TIER_PAIRS["compact"]))  # fmt: skip
        assert cal.data["bits_per_element"]["n_ctx"] == 8192 and cal.data["bits_per_element"]["calibrated"] <= 2.8


@pytest.mark.parametrize("name", list(SHIPPED))
def test_generate_with_the_quality_tier_uses_the_shipped_calibration(
    name: str, user_cache: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    model = request.getfixturevalue(name.split("-")[0])  # the smollm2 / gemma3 fixture: the fetched GGUF
    code, out, err = run_cli(capsys, "generate", model, "What is the capital of France?", "--kv-tier", "quality",
                             "-t", THREADS, "-n", 8)  # fmt: skip
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("kv tier ")]
    assert len(lines) == 1, err  # said in one line
    assert f"ott3/ott2 --ott-params 128,64,3,32,2,1,1,1 --ott-layers {SHIPPED[name]}, calibrated (shipped" in lines[0]
    assert "kv_tier=quality, kv_type=ott3/ott2" in err and out.strip()
    # the digest was computed once and kept by path, size and mtime
    index = json.loads((user_cache / "sha256.json").read_text())
    assert MODELS[name].sha256 in index.values()


def test_llama_kv_tier_runs_the_tiers_configuration(smollm2: Path, user_cache: Path) -> None:
    q = Llama(str(smollm2), kv_tier="quality", n_ctx=256, n_threads=1, verbose=False)
    assert (q.kv_type, q.kv_tier) == ("ott3/ott2", "quality")
    cfg = q.ott_config  # read back from the native cache
    assert cfg is not None and cfg.R == 64 and cfg.v_sym and cfg.k_mix and cfg.layer_widths == SHIPPED["smollm2-135m"]
    assert q.kv_cache_info()["kv_tier"] == "quality" and "calibrated (shipped with ott-gguf" in q.kv_tier_line
    q.close()
    c = Llama(str(smollm2), kv_tier="compact", n_ctx=256, n_threads=1, verbose=False)
    cfg = c.ott_config
    assert c.kv_type == "ott2" and cfg is not None and cfg.R == 32 and cfg.k_mix == 2 and cfg.v_sym and cfg.v_rotate
    assert cfg.layer_widths == COMPACT["smollm2-135m"] and "calibrated (shipped with ott-gguf" in c.kv_tier_line
    c.close()


@pytest.mark.parametrize("extra", [{"kv_type": "ott2"}, {"type_k": "ott3"}, {"ott_config": {"R": 64}}])
def test_a_tier_with_explicit_options_is_an_error(smollm2: Path, extra: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"kv_tier='quality' chooses .*{next(iter(extra))} would override it"):
        Llama(str(smollm2), kv_tier="quality", verbose=False, **extra)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kv_tier 'max'; valid choices: compact, quality"):
        Llama(str(smollm2), kv_tier="max", verbose=False)


@pytest.mark.parametrize("argv", [["--kv-type", "ott2"], ["-ctk", "ott3"], ["--ott-params", "128,64,3,32,2"],
                                  ["--ott-layers", "0:3/3"]])  # fmt: skip
def test_the_cli_refuses_a_tier_with_explicit_options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "generate", "smollm2-135m", "hi", "--kv-tier", "quality", *argv)
    assert code == 2 and f"--kv-tier quality chooses the K/V types and their parameters; {argv[0]} would" in err


def test_lookup_order_next_to_the_model_then_cache_then_package(smollm2: Path, tmp_path: Path,
                                                                user_cache: Path) -> None:  # fmt: skip
    model = tmp_path / "m.gguf"
    model.symlink_to(smollm2)  # the same content: the same sha256
    sha = MODELS["smollm2-135m"].sha256

    def record(widths: str, for_sha: str = sha) -> dict[str, object]:
        return {"model_sha256": for_sha, "model_file": "m.gguf", "kv_type": "ott3/ott2",
                "ott_params": tiers.QUALITY_PARAMS, "layer_widths": widths}  # fmt: skip

    assert tiers.resolve_tier("quality", model).ott_config.layer_widths == SHIPPED["smollm2-135m"]  # type: ignore[union-attr]
    tiers.write_calibration(user_cache / "calibrations" / f"{sha}.json", record("0-29:2/2"))
    t = tiers.resolve_tier("quality", model)
    assert t.ott_config is not None and t.ott_config.layer_widths == "0-29:2/2" and "from the user cache" in t.line
    side = Path(str(model) + tiers.SIDE_SUFFIX)
    tiers.write_calibration(side, record("0-4:3/3"))
    t = tiers.resolve_tier("quality", model)
    assert t.ott_config is not None and t.ott_config.layer_widths == "0-4:3/3" and "next to the model" in t.line
    # a file next to the model made for another GGUF is passed over, and said so in the same line
    tiers.write_calibration(side, record("0-4:3/3", for_sha="0" * 64))
    t = tiers.resolve_tier("quality", model)
    assert t.ott_config is not None and t.ott_config.layer_widths == "0-29:2/2"
    assert "was made for another file" in t.line and "\n" not in t.line
    # each tier reads the calibrations of its own pair: a next-to-the-model file of the quality tier's is passed
    # over by compact (said), which reads its own from the user cache, then the package
    tiers.write_calibration(side, record("0-4:3/3"))
    c = tiers.resolve_tier("compact", model)
    assert c.ott_config is not None and c.ott_config.layer_widths == COMPACT["smollm2-135m"] and "shipped" in c.line
    assert f"{side} calibrates ott3/ott2 --ott-params {tiers.QUALITY_PARAMS}, not ott2 --ott-params" in c.line
    ott2 = {**record("10:3/2"), "kv_type": "ott2", "ott_params": tiers.COMPACT_PARAMS}
    tiers.write_calibration(tiers.calibration_target(ott2), ott2)
    c = tiers.resolve_tier("compact", model)
    assert c.ott_config is not None and c.ott_config.layer_widths == "10:3/2" and "from the user cache" in c.line
    assert tiers.resolve_tier("quality", model).ott_config.layer_widths == "0-4:3/3"  # type: ignore[union-attr]
    side.write_text('{"layer_widths": "0:3/3"}')
    with pytest.raises(ValueError, match="not an ott-gguf-calibration file"):
        tiers.resolve_tier("quality", model)


def test_uncalibrated_model_gets_the_recipe_and_says_so(smollm2: Path, tmp_path: Path, user_cache: Path) -> None:
    model = tmp_path / "copy.gguf"
    model.write_bytes(smollm2.read_bytes()[:-1] + b"\0")  # another file (the last byte is tensor padding)
    t = tiers.resolve_tier("quality", model)
    assert t.kv_type == "ott3/ott2" and t.ott_config is not None and t.ott_config.layer_widths == ""
    assert t.ott_config.R == 64 and t.ott_config.v_sym
    assert re.search(r"uncalibrated \(no ott3/ott2 calibration of copy.gguf found; `ott-gguf calibrate \S+` makes "
                     r"one\)", t.line)  # fmt: skip
    c = tiers.resolve_tier("compact", model)
    assert c.kv_type == "ott2" and c.calibration is None and c.ott_config is not None
    assert c.ott_config.v_sym and c.ott_config.layer_widths == "" and c.ott_config.R == 32  # uniform 2-bit keys
    assert re.search(r"compact: ott2 --ott-params 128,32,3,32,2,1,2,1, uncalibrated \(no ott2 calibration of "
                     r"copy.gguf found; `ott-gguf calibrate \S+ --kv-type ott2 --ott-params 128,32,3,32,2,1,2,1 --up "
                     r"3/2 --max-bits 2.8 --blocks 30` makes one\)", c.line)  # fmt: skip


def test_calibrate_writes_a_file_the_tier_reads(smollm2: Path, tmp_path: Path, user_cache: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A real, small calibration (one block, one 256-token chunk): progress with the time left, the documented
    file, found next to the model by --kv-tier quality."""
    model = tmp_path / "m.gguf"
    model.symlink_to(smollm2)
    out = Path(str(model) + tiers.SIDE_SUFFIX)
    code, stdout, err = run_cli(capsys, "calibrate", model, "--blocks", 1, "--chunks", 1, "--n-ctx", 256,
                                "--threads", THREADS, "--out", out)  # fmt: skip
    assert code == 0, err
    # the estimate before the runs (timed probes), then progress with the time left
    assert re.search(r"estimated time: about \d+(m\d\ds|s) \(timed probe runs of 256 tokens; an estimate\)", err), err
    assert re.search(r"\[1/5, \d+s spent, about \d+(m\d\ds|s) left\] f16 reference logits", err), err
    assert re.search(r"\[3/5, .* left\] layers 0-29 at 3/3: mean KLD", err), err
    assert f"calibration written to {out}" in stdout
    cal = tiers.read_calibration(out)
    d = cal.data
    assert d["model_sha256"] == MODELS["smollm2-135m"].sha256 and d["model_file"] == "m.gguf"
    assert (cal.kv_type, cal.ott_params) == ("ott3/ott2", tiers.QUALITY_PARAMS)  # the tier's, by default
    assert d["calibration"]["command"].startswith("ott-gguf calibrate ") and d["calibration"]["n_ctx"] == 256
    assert d["calibration"]["blocks"] == [[0, 29]] and re.match(r"\d{4}-\d\d-\d\dT", d["calibration"]["date"])
    assert 3.0 < d["bits_per_element"]["base_pair"] < 3.4  # ott3/ott2 with R 64 and symmetric values at 8k
    assert cal.layer_widths in ("", "0-29:3/3", "0-29:2/2")
    t = tiers.resolve_tier("quality", model)
    assert "next to the model" in t.line and t.ott_config is not None
    assert t.ott_config.layer_widths == cal.layer_widths


def test_calibrating_ott2_widens_only_and_keeps_the_tiers_file(smollm2: Path, user_cache: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """ott2 has no narrower widths: down = the base pair (the default 2/2) calibrates by widening only (one run per
    block, no narrowing runs). Without --out the file goes beside the quality tier's, under its pair and
    parameters, so the quality tier's calibration is never overwritten; made with the compact tier's parameters,
    it is the compact tier's (found in the user cache before the shipped one)."""
    code, stdout, err = run_cli(capsys, "calibrate", smollm2, "--kv-type", "ott2", "--ott-params",
                                tiers.COMPACT_PARAMS, "--up", "3/2", "--blocks", 1, "--chunks", 1, "--n-ctx", 256,
                                "--budget", 1.3, "--threads", THREADS)  # fmt: skip
    assert code == 0, err
    assert re.search(r"\[3/4, .* left\] layers 0-29 at 3/2: mean KLD", err), err
    assert "at 2/2" not in err
    assert re.search(r"\| 0-29 \| [+-]\d\.\d{4} \| - \| (up|base) \|", stdout), stdout
    sha = MODELS["smollm2-135m"].sha256
    target = user_cache / "calibrations" / f"{sha}.ott2.{tiers.COMPACT_PARAMS}.json"
    assert f"calibration written to {target}" in stdout
    cal = tiers.read_calibration(target)
    assert (cal.kv_type, cal.ott_params, cal.data["calibration"]["down"]) == ("ott2", tiers.COMPACT_PARAMS, "2/2")
    assert cal.layer_widths in ("", "0-29:3/2")
    assert not (user_cache / "calibrations" / f"{sha}.json").exists()
    t = tiers.resolve_tier("quality", smollm2)
    assert t.ott_config is not None and t.ott_config.layer_widths == SHIPPED["smollm2-135m"]
    c = tiers.resolve_tier("compact", smollm2)
    assert c.calibration == target and "from the user cache" in c.line and c.ott_config is not None
    assert c.ott_config.layer_widths == cal.layer_widths
    assert c.ott_config.native() == tiers.tier_config(tiers.COMPACT_PARAMS).native()


def test_serve_passes_the_tier_to_llama_server(smollm2: Path, user_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import os

    class Exec(Exception):
        pass

    def fake_execv(path: str, cmd: list[str]) -> None:  # the command llama-server would run, not run
        raise Exec(cmd)

    monkeypatch.setattr(os, "execv", fake_execv)
    with pytest.raises(Exec) as got:
        run_cli(capsys, "serve", smollm2, "--kv-tier", "quality", "--port", 0)
    cmd = got.value.args[0]
    assert cmd[cmd.index("-ctk") + 1] == "ott3" and cmd[cmd.index("-ctv") + 1] == "ott2"
    assert cmd[cmd.index("--ott-params") + 1] == tiers.QUALITY_PARAMS
    assert cmd[cmd.index("--ott-layers") + 1] == SHIPPED["smollm2-135m"]
    assert "kv tier quality: " in capsys.readouterr().err
