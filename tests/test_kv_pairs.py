"""Per-side K/V cache types (type_k="ott3", type_v="ott2") and v_rotate, through ott_gguf.Llama, the command line
and llama-server, on SmolLM2."""

from __future__ import annotations

import ctypes
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import ott_gguf
from ott_gguf import Llama, OttConfig, _lib
from ott_gguf.corpus import docs_text
from ott_gguf.info import ModelInfo, model_info
from ott_gguf.kv_types import OTT_KV_TYPES, kv_pair_name, resolve_kv_pair, resolve_kv_types
from ott_gguf.server import server_command

from helpers import THREADS, doc_prefix, greedy, last_logits, run_cli, serving, table

N_CTX = 512


@pytest.fixture(scope="module")
def doc_tokens(smollm2: Path) -> list[int]:
    return doc_prefix(smollm2, 300)


# --- names, ids and the rules of a pair (no model needed) ---------------------------------------------------------


def test_pairs_resolve_by_name_or_id_and_are_named_as_in_c() -> None:
    assert resolve_kv_pair("OTT3", " ott2") == ("ott3", "ott2")
    assert resolve_kv_pair(ott_gguf.GGML_TYPE_KIVI4, ott_gguf.GGML_TYPE_KIVI2) == ("kivi4", "kivi2")
    assert resolve_kv_pair(8, "q4_0") == ("q8_0", "q4_0")  # stock types mix freely, as in llama.cpp
    ids = _lib.ott_kv_type_ids()
    for name in OTT_KV_TYPES:
        assert getattr(ott_gguf, f"GGML_TYPE_{name.upper()}") == ids[name]
    assert resolve_kv_types("ott3/ott2") == resolve_kv_types("ott2", type_k="ott3") == ("ott3", "ott2")
    assert resolve_kv_types("ott4", type_v="ott2") == ("ott4", "ott2")
    assert kv_pair_name("ott3", "ott2") == "ott3/ott2" and kv_pair_name("ott2", "ott2") == "ott2"
    # the reference's configuration of a pair: its code widths, no outliers for kivi
    cfg = OttConfig()
    assert cfg.for_kv_type("ott2") is cfg
    assert cfg.for_kv_type("ott3/ott2") == cfg.replace(k_bits=3)
    assert cfg.for_kv_type("kivi4/kivi3") == cfg.replace(k_bits=4, v_bits=3, outlier_num=0)


@pytest.mark.parametrize(
    ("k", "v", "message"),
    [
        ("ott3", "kivi2", r"must both be ott types \(ott2, ott3, ott4\) or both kivi types \(kivi2, kivi3, kivi4\)"),
        ("kivi2", "ott2", r"must both be ott types .* or both kivi types"),
        ("ott2", "f16", r"'ott2' needs an ott type on the other side too, not the stock type 'f16'"),
        ("q8_0", "kivi3", r"'kivi3' needs an ott type on the other side too, not the stock type 'q8_0'"),
        ("ott5", "ott2", r"unknown type_k 'ott5'; valid choices: f16, .*kivi4"),
        ("ott2", 0, r"type_v=0 is not the ggml id of a K/V cache type \(ggml type 'f32'\); valid: f16=1"),
        ("ott2", True, r"type_v must be a string"),
    ],
)
def test_bad_pairs_are_refused_with_the_rule(k: object, v: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_kv_pair(k, v)  # type: ignore[arg-type]


def test_the_c_struct_carries_v_rotate_k_mix_v_sym_k_young_and_v_young_as_its_last_int32s() -> None:
    assert OttConfig.NATIVE_FIELDS[-5:] == ("v_rotate", "k_mix", "v_sym", "k_young", "v_young")
    assert len(OttConfig.NATIVE_FIELDS) == 10
    assert ctypes.sizeof(_lib.LlamaOttConfig) == 10 * 4 + 256  # then a byte per layer (test_layer_widths.py)
    assert OttConfig().native()[-5:] == (1, 2, 0, 0, 0)
    assert OttConfig(v_rotate=False, k_mix=False).native()[-5:] == (0, 0, 0, 0, 0)
    assert OttConfig(v_sym=True).native()[-3] == 1 and OttConfig(k_young=4, v_young=2).native()[-2:] == (4, 2)
    # --ott-params names k_young and v_young only when set: the tools' default reads as before
    assert OttConfig().params_text() == "128,32,3,32,2,1,2,0"
    assert OttConfig(k_young=4).params_text() == "128,32,3,32,2,1,2,0,4"
    assert OttConfig(v_young=4).params_text() == "128,32,3,32,2,1,2,0,0,4"
    c_default = _lib.native().llama_ott_config_default().to_config()  # 128,32,3,32,2,1,2,0: one default
    assert c_default == OttConfig() and c_default.v_rotate is True and c_default.k_mix == 2
    assert c_default.v_sym is False
    assert _lib.config_problem(OttConfig(v_rotate=True, k_mix=False)) == ""
    assert _lib.config_problem(OttConfig(v_sym=True)) == ""
    why = ctypes.create_string_buffer(256)
    assert _lib.config_problem(OttConfig(k_mix=2)) == ""  # 2-bit keys of mixed widths too
    for field, value, message in (("k_mix", 3, "k_mix=3 must be 0, 1 (3-bit keys) or 2 (2- and 3-bit keys)"),
                                  ("v_sym", 3, "v_sym=3 must be 0 or 1"),
                                  ("k_young", 17, "k_young=17 is outside [0, 16]"),
                                  ("v_young", -1, "v_young=-1 is outside [0, 16]")):  # fmt: skip
        bad = _lib.native().llama_ott_config_default()
        setattr(bad, field, value)
        assert not _lib.native().llama_ott_config_check(ctypes.byref(bad), why, len(why))
        assert why.value.decode() == message
    bad = _lib.native().llama_ott_config_default()
    bad.v_sym, bad.v_rotate = 1, 0  # symmetric blocks need rotated (centred) values: native and Python agree
    assert not _lib.native().llama_ott_config_check(ctypes.byref(bad), why, len(why))
    assert why.value.decode().startswith("v_sym=1 needs v_rotate=1")
    with pytest.raises(ValueError, match="v_sym needs v_rotate"):
        OttConfig(v_sym=True, v_rotate=False)
    with pytest.raises(ValueError, match=r"k_young must be in \[0, 16\]"):
        OttConfig(k_young=17)
    with pytest.raises(ValueError, match=r"v_young must be in \[0, 16\]"):
        OttConfig(v_young=17)


# --- Llama --------------------------------------------------------------------------------------------------------


def test_ott3_keys_with_ott2_values_generate_past_sealing(smollm2: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """3-bit K and 2-bit V: the native cache says so, generation over sealed groups works, and the quantized part
    lies between ott2's and ott3's (K and V blocks add up: ott3/ott2 + ott2/ott3 = ott2 + ott3)."""
    capfd.readouterr()
    llm = Llama(str(smollm2), type_k="ott3", type_v="ott2", n_ctx=N_CTX, n_threads=1, verbose=True)
    log = capfd.readouterr().err
    assert re.search(r"ott3/ott2 cache: .*K 3 bits mixed, V 2 bits", log), log[-3000:]  # k_mix by default
    assert llm.kv_type == "ott3/ott2" and (llm.kv_type_k, llm.kv_type_v) == ("ott3", "ott2")
    ids = _lib.ott_kv_type_ids()
    assert (llm.context_params.type_k, llm.context_params.type_v) == (ids["ott3"], ids["ott2"])
    prompt = docs_text(1500)
    out = llm(prompt, max_tokens=24, temperature=0.0, top_k=1)
    text = out["choices"][0]["text"]
    assert out["usage"]["prompt_tokens"] > 200 and len(re.findall(r"[A-Za-z]+", text)) >= 3, text
    info = llm.kv_cache_info()
    assert info["kv_type"] == "ott3/ott2" and info["type_k"] == "ott3" and info["type_v"] == "ott2"
    assert info["sealed"] >= 128 and info["positions"] == llm.n_tokens

    def quantized(k: str, v: str) -> int:
        other = Llama(str(smollm2), type_k=k, type_v=v, n_ctx=N_CTX, verbose=False)
        q = other.kv_cache_info()["bytes"]["quantized"]  # type: ignore[index]
        other.close()
        return int(q)

    mixed = int(info["bytes"]["quantized"])  # type: ignore[index]
    ott2, ott3 = quantized("ott2", "ott2"), quantized("ott3", "ott3")
    assert ott2 < mixed < ott3
    assert mixed + quantized("ott2", "ott3") == ott2 + ott3


def test_ggml_ids_select_the_sides(smollm2: Path) -> None:
    """llama-cpp-python's way, type_k/type_v as ggml type ids, works on ott_gguf.Llama too, stock ones included."""
    llm = Llama(str(smollm2), type_k=ott_gguf.GGML_TYPE_KIVI3, type_v=ott_gguf.GGML_TYPE_KIVI2, n_ctx=256,
                verbose=False)  # fmt: skip
    assert llm.kv_type == "kivi3/kivi2" and llm.ott_config is not None and llm.ott_config.outlier_num == 0
    q = Llama(str(smollm2), type_k=8, type_v=2, n_ctx=256, verbose=False)  # q8_0 keys, q4_0 values
    assert q.kv_type == "q8_0/q4_0" and q.ott_config is None
    assert (q.context_params.type_k, q.context_params.type_v) == (8, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"type_k": "ott2", "type_v": "kivi2"}, r"K and V must both be ott types .* or both kivi types"),
        ({"kv_type": "ott3", "type_v": "f16"}, r"not the stock type 'f16'"),
        ({"type_k": "ott2"}, r"not the stock type 'f16'"),  # the other side keeps kv_type's default
        ({"kv_type": "ott9"}, r"unknown kv_type 'ott9'; valid choices: .*ott3.*kivi4"),
        ({"kv_type": "ott3/ott2/ott4"}, r"expected one type or 'K/V'"),
        ({"kv_type": "ott2", "ott_config": {"bits": 3}}, r"ott_config.bits=3: .*type_k='ott3', type_v='ott2'"),
        ({"kv_type": "ott2", "ott_config": {"k_bits": 3}}, r"ott_config.k_bits=3: .*choose them with type_k/type_v"),
        ({"kv_type": "ott2", "ott_config": {"v_bits": 4}}, r"ott_config.v_bits=4"),
        ({"kv_type": "ott2", "ott_config": {"k_rotate": True, "k_mix": False}}, r"variant of the numpy reference"),
        ({"kv_type": "ott2", "ott_config": {"k_rotate": True}}, r"k_mix and k_rotate exclude each other"),
        ({"type_k": "q8_0", "type_v": "f16", "flash_attn": False}, r"type_k='q8_0', type_v='f16'.*flash attention"),
        ({"kv_type": "ott3/ott2", "embedding": True}, r"type_k='ott3', type_v='ott2' with embedding=True"),
    ],
)
def test_bad_combinations_are_refused_before_loading(smollm2: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Llama(str(smollm2), n_ctx=256, verbose=False, **kwargs)  # type: ignore[arg-type]


def test_v_rotate_reaches_the_cache(smollm2: Path, doc_tokens: list[int]) -> None:
    """v_rotate True and False each run as asked (read back from the cache as a bool), and change the logits once
    a group is sealed; the Python default is what a Llama without ott_config runs."""
    logits = {}
    for v_rotate in (True, False):
        llm = Llama(str(smollm2), kv_type="ott3/ott2", ott_config={"v_rotate": v_rotate}, n_ctx=N_CTX, n_threads=1,
                    verbose=False)  # fmt: skip
        assert llm.ott_config is not None and llm.ott_config.v_rotate is v_rotate
        assert llm.kv_cache_info()["config"] == llm.ott_config
        llm.eval(doc_tokens[:200])  # the ubatch attends to itself in fp16, then group 0 is sealed
        assert llm.kv_cache_info()["sealed"] == 128
        llm.eval(doc_tokens[200:201])  # this token attends to the sealed group's V
        logits[v_rotate] = last_logits(llm)
        assert np.isfinite(logits[v_rotate]).all()
        llm.close()
    assert not np.array_equal(logits[True], logits[False])
    plain = Llama(str(smollm2), kv_type="ott2", n_ctx=256, verbose=False)
    assert plain.ott_config is not None and plain.ott_config.v_rotate is OttConfig().v_rotate


def k_mix_bytes(info: ModelInfo) -> int:
    """What k_mix on adds to the quantized bytes: D/4 per head and group (3-bit keys' width table)."""
    n_groups = (N_CTX - OttConfig().R) // OttConfig().G
    return info.n_layer * info.n_head_kv * n_groups * info.head_dim_k // 4


def k_mix2_bytes(info: ModelInfo) -> int:
    """What k_mix 2 adds on 2-bit keys (against k_mix 1, which leaves them alone): the same D/4 width table."""
    return k_mix_bytes(info)


def v_sym_bytes(info: ModelInfo) -> int:
    """What v_sym on saves on the quantized bytes: 2 per V block (no min)."""
    n_groups = (N_CTX - OttConfig().R) // OttConfig().G
    return -2 * info.n_layer * info.n_head_kv * n_groups * OttConfig().G * info.head_dim_v // OttConfig().Gv


# (field, the cache type whose bytes it changes, the one it leaves alone, the bytes on minus off)
# (k_mix 2: on is 2, off is 1, the default, which leaves 2-bit keys alone)
SWITCHES = [("k_mix", "ott3/ott2", "ott2", k_mix_bytes, True, False),
            ("v_sym", "ott3/ott2", "ott3", v_sym_bytes, True, False),
            ("k_mix", "ott2", "ott3", k_mix2_bytes, 2, True)]  # fmt: skip


@pytest.mark.parametrize(("field", "kv_type", "untouched", "delta", "on_value", "off_value"), SWITCHES,
                         ids=["k_mix", "v_sym", "k_mix2"])  # fmt: skip
def test_a_format_switch_reaches_the_cache_and_its_state(
    smollm2: Path, doc_tokens: list[int], field: str, kv_type: str, untouched: str, delta: Callable[[ModelInfo], int],
    on_value: bool | int, off_value: bool | int,
) -> None:  # fmt: skip
    """k_mix (3-bit keys' per-channel widths) and v_sym (2-bit values without a min), each on and off, run as asked:
    they change the logits once a group is sealed and the quantized bytes by exactly their format's difference; a
    cache of the type they do not apply to keeps its bytes; a state saved with the switch on continues identically
    in a cache with it on and is refused by one with it off, naming the switch."""
    logits, quantized, states = {}, {}, {}
    for on in (True, False):
        value = on_value if on else off_value
        llm = Llama(str(smollm2), kv_type=kv_type, ott_config={field: value}, n_ctx=N_CTX, n_threads=1, verbose=False)
        assert llm.ott_config is not None and getattr(llm.ott_config, field) == value
        llm.eval(doc_tokens[:200])
        assert llm.kv_cache_info()["sealed"] == 128
        states[on] = llm.save_state()
        llm.eval(doc_tokens[200:201])
        logits[on] = last_logits(llm)
        quantized[on] = int(llm.kv_cache_info()["bytes"]["quantized"])  # type: ignore[index]
        llm.close()
    assert np.isfinite(logits[True]).all() and not np.array_equal(logits[True], logits[False])
    assert quantized[True] - quantized[False] == delta(model_info(smollm2))
    same = Llama(str(smollm2), kv_type=kv_type, ott_config={field: on_value}, n_ctx=N_CTX, n_threads=1, verbose=False)
    same.load_state(states[True])
    same.eval(doc_tokens[200:201])
    np.testing.assert_array_equal(last_logits(same), logits[True])
    off = Llama(str(smollm2), kv_type=kv_type, ott_config={field: off_value}, n_ctx=N_CTX, verbose=False)
    refused = rf"configuration: {field}={int(on_value)}, this cache has {field}={int(off_value)}"
    with pytest.raises(ValueError, match=refused):
        off.load_state(states[True])
    two = [Llama(str(smollm2), kv_type=untouched, ott_config={field: value}, n_ctx=N_CTX, verbose=False)
           for value in (on_value, off_value)]  # fmt: skip
    assert len({int(x.kv_cache_info()["bytes"]["quantized"]) for x in two}) == 1  # type: ignore[index]


def test_state_and_pickle_keep_the_pair(smollm2: Path, doc_tokens: list[int]) -> None:
    """A state saved from ott3/ott2 continues identically in an ott3/ott2 cache and is refused by an ott2/ott2 one,
    naming the K width; a pickled Llama comes back with the same sides and configuration."""
    cfg = OttConfig(R=16, v_rotate=True)
    llm = Llama(str(smollm2), type_k="ott3", type_v="ott2", ott_config=cfg, n_ctx=N_CTX, n_threads=1, verbose=False)
    llm.eval(doc_tokens[:200])
    assert llm.kv_cache_info()["sealed"] == 128
    state = llm.save_state()
    first = greedy(llm, doc_tokens[200], 6)

    same = Llama(str(smollm2), kv_type="ott3/ott2", ott_config=cfg, n_ctx=N_CTX, n_threads=1, verbose=False)
    same.load_state(state)
    assert greedy(same, doc_tokens[200], 6) == first
    other = Llama(str(smollm2), kv_type="ott2", ott_config=cfg, n_ctx=N_CTX, verbose=False)
    with pytest.raises(ValueError, match=r"into a ott2 cache: .*configuration: K bits=3, this cache has K bits=2"):
        other.load_state(state)

    clone = pickle.loads(pickle.dumps(llm))
    assert (clone.kv_type, clone.kv_type_k, clone.kv_type_v) == ("ott3/ott2", "ott3", "ott2")
    assert clone.ott_config == llm.ott_config == cfg
    assert (clone.context_params.type_k, clone.context_params.type_v) == (
        llm.context_params.type_k,
        llm.context_params.type_v,
    )


# --- command line and server --------------------------------------------------------------------------------------


def test_generate_takes_a_type_per_side(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "generate", "Name a fruit.", "--model", smollm2, "--type-k", "ott3", "-ctv",
                             "ott2", "--max-tokens", 4, "--n-ctx", 256)  # fmt: skip
    assert code == 0, err
    assert "kv_type=ott3/ott2" in err and out.strip()
    code, _, err = run_cli(capsys, "generate", "Hi", "--model", smollm2, "--kv-type", "ott2", "-ctv", "kivi2")
    assert code == 2 and "must both be ott types" in err


def test_eval_and_info_take_pairs(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "eval", smollm2, "--n-ctx", 192, "--chunks", 1, "--ubatch", 32, "--threads",
                             THREADS, "--kv-types", "ott2,OTT3/ott2")  # fmt: skip
    assert code == 0, err
    rows = table(out)
    assert list(rows) == ["ott2", "ott3/ott2"] and float(rows["ott3/ott2"]["mean KLD"]) > 0
    code, out, err = run_cli(capsys, "info", smollm2, "--kv-types", "q8_0/q4_0,ott2,ott3/ott2,ott3")
    assert code == 0, err
    rows = table(out)
    bpt = {t: float(r["bytes/token"]) for t, r in rows.items()}
    assert list(bpt) == ["q8_0/q4_0", "ott2", "ott3/ott2", "ott3"]
    assert bpt["ott2"] < bpt["ott3/ott2"] < bpt["ott3"] < bpt["q8_0/q4_0"]
    assert abs(bpt["q8_0/q4_0"] - float(rows["q8_0/q4_0"]["formula"])) <= 2
    assert "ott3/ott2 at 8192 tokens (MiB): quantized" in out
    code, _, err = run_cli(capsys, "eval", smollm2, "--kv-types", "ott2/kivi2")
    assert code == 2 and "must both be ott types" in err


def test_bench_runs_a_pair(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "bench", smollm2, "-p", 16, "-n", 4, "--depths", "0", "-r", 1, "--threads",
                             THREADS, "--kv-types", "kivi3/kivi2")  # fmt: skip
    assert code == 0, err
    row = table(out)["kivi3/kivi2"]
    assert float(row["pp16 @ 0"]) > 0 and float(row["tg4 @ 0"]) > 0


def test_server_command_per_side_and_ott_params(smollm2: Path) -> None:
    def flag(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    cmd = server_command(smollm2, type_k="ott3", type_v="ott2")
    assert (flag(cmd, "-ctk"), flag(cmd, "-ctv")) == ("ott3", "ott2")
    # Python's configuration, v_rotate included, not llama-server's own defaults
    assert flag(cmd, "--ott-params") == "128,32,3,32,2,1,2,0" and "--no-kv-unified" in cmd
    cmd = server_command(smollm2, kv_type="kivi4/kivi2", ott_config=OttConfig(R=16, v_rotate=False))
    assert (flag(cmd, "-ctk"), flag(cmd, "-ctv"), flag(cmd, "--ott-params")) == (
        "kivi4",
        "kivi2",
        "128,16,3,32,2,0,2,0",
    )
    cmd = server_command(smollm2, kv_type="ott2", extra=["--ott-params", "128,16,3,32,2"])
    assert cmd.count("--ott-params") == 1 and cmd[-1] == "128,16,3,32,2"  # the caller's own
    cmd = server_command(smollm2, kv_type="q8_0", type_v="q4_0")
    assert (flag(cmd, "-ctk"), flag(cmd, "-ctv")) == ("q8_0", "q4_0") and "--ott-params" not in cmd
    with pytest.raises(ValueError, match="must both be ott types"):
        server_command(smollm2, type_k="ott2", type_v="kivi2")
    with pytest.raises(ValueError, match="-ctv is set by"):
        server_command(smollm2, kv_type="ott2", extra=["-ctv", "ott3"])


def test_serve_defaults_to_ott2_like_generate_and_chat(smollm2: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`ott-gguf serve MODEL` without a type runs ott2 (as generate and chat do), with Python's configuration."""
    import os

    ran: list[list[str]] = []
    monkeypatch.setattr(os, "execv", lambda path, argv: ran.append(list(argv)))
    code, out, err = run_cli(capsys, "serve", smollm2, "--port", 8099)
    assert code == 0, err
    cmd = ran[0]
    assert (cmd[cmd.index("-ctk") + 1], cmd[cmd.index("-ctv") + 1]) == ("ott2", "ott2")
    assert cmd[cmd.index("--ott-params") + 1] == "128,32,3,32,2,1,2,0" and "kv_type=ott2" in out


def test_serve_with_a_type_per_side(smollm2: Path, tmp_path: Path) -> None:
    """`ott-gguf serve -ctk ott3 -ctv ott2`: llama-server runs 3-bit keys, 2-bit values, V rotated (the default,
    passed as the sixth --ott-params value) and answers."""
    log = tmp_path / "server.log"
    with serving(smollm2, "f16", 1024, log, extra=["-lv", "4"], options=["-ctk", "ott3", "-ctv", "ott2"]) as srv:
        out = srv.chat([{"role": "user", "content": "Name a fruit."}], max_tokens=8, temperature=0.0)
        assert str(out["choices"][0]["message"]["content"]).strip(), out  # type: ignore[index]
    text = log.read_text(errors="replace")
    line = next((s for s in text.splitlines() if "ott3/ott2 cache:" in s), "")
    assert "K 3 bits mixed, V 2 bits rotated" in line, text[-3000:]
