"""The ott2 cache inside the patched llama.cpp, end to end on SmolLM2 and real text (the pinned llama.cpp docs)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest

from ott_gguf import Llama, OttConfig, _lib
from ott_gguf.corpus import docs_text


@pytest.fixture(scope="module")
def doc_tokens(smollm2: Path) -> list[int]:
    llm = Llama(str(smollm2), kv_type="f16", n_ctx=256, verbose=False)
    toks = llm.tokenize(docs_text(40_000).encode())
    llm.close()
    assert len(toks) >= 1024
    return toks[:1024]


def test_ott2_greedy_generation_is_coherent(smollm2: Path) -> None:
    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=2048, verbose=False)
    text = docs_text(6000)
    prompt = text[:2500] + "\n\nIn one sentence, the document above explains how to"
    out = llm(prompt, max_tokens=80, temperature=0.0, top_k=1)["choices"][0]["text"]
    info = llm.kv_cache_info()
    assert info["sealed"] >= 3 * 128, info  # the answer was written over a sealed (2-bit) cache
    words = re.findall(r"[A-Za-z]+", out)
    assert len(words) >= 10, out
    assert sum(w.lower() in prompt.lower() for w in words) / len(words) > 0.5, out  # it speaks the text's language
    again = Llama(str(smollm2), kv_type="ott2", n_ctx=2048, verbose=False)
    assert again(prompt, max_tokens=80, temperature=0.0, top_k=1)["choices"][0]["text"] == out  # deterministic


def metadata_only_gguf(path: Path, arch: str, keys: dict[str, int | float], tokenizer_from: Path) -> Path:
    """A GGUF with an architecture's hparams and a real tokenizer but no tensors (enough for the checks, which
    read the model vocab-only), written with the gguf-py of the pinned llama.cpp source."""
    import sys

    sys.path.insert(0, str(Path(str(_lib.build_info()["llama_src"])) / "gguf-py"))
    import gguf  # type: ignore[import-not-found]

    src = gguf.GGUFReader(str(tokenizer_from))
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        vt = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"{arch}.{key}", value, vt)
    for name, f in src.fields.items():
        if name.startswith("tokenizer."):
            vt = f.types[0]
            w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_recurrent_architecture_is_refused_by_name(smollm2: Path, tmp_path: Path) -> None:
    mamba = metadata_only_gguf(tmp_path / "mamba.gguf", "mamba", {
        "context_length": 2048, "embedding_length": 768, "block_count": 24, "ssm.conv_kernel": 4,
        "ssm.inner_size": 1536, "ssm.state_size": 16, "ssm.time_step_rank": 48,
        "attention.layer_norm_rms_epsilon": 1e-5}, smollm2)  # fmt: skip
    with pytest.raises(ValueError, match="the mamba architecture keeps a recurrent state"):
        Llama(str(mamba), kv_type="ott2", verbose=False)
    with pytest.raises(ValueError, match="mamba architecture"):
        Llama(str(mamba), kv_type="kivi2", verbose=False)


def test_gemma3_server_slots_need_separate_streams(gemma3: Path, tmp_path: Path) -> None:
    """Several sequences of a sliding-window model with a unified cache are refused with the fix named."""
    import subprocess

    cmd = [str(_lib.bin_path("llama-server")), "-m", str(gemma3), "-ctk", "ott2", "-ctv", "ott2", "-np", "2",
           "--kv-unified", "-c", "2048", "--port", "0"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--no-kv-unified" in out.stderr


def test_bad_ott_config_and_state_are_refused(smollm2: Path) -> None:
    with pytest.raises(ValueError, match="unknown ott_config keys: Q"):
        Llama(str(smollm2), kv_type="ott2", ott_config={"Q": 1})
    with pytest.raises(ValueError, match="G must be 128"):
        Llama(str(smollm2), kv_type="ott2", ott_config={"G": 64})
    with pytest.raises(ValueError, match="ott_config applies"):
        Llama(str(smollm2), kv_type="q8_0", ott_config={"R": 16})
    # what the build cannot run is refused with its reason, before anything is allocated
    with pytest.raises(ValueError, match="R=100000 is outside"):
        Llama(str(smollm2), kv_type="ott2", ott_config={"R": 100000}, n_ctx=512)
    with pytest.raises(ValueError, match="outlier_num=65 is outside"):
        Llama(str(smollm2), kv_type="ott2", ott_config={"outlier_num": 65}, n_ctx=512)
    with pytest.raises(ValueError, match="variant of the numpy reference"):
        Llama(str(smollm2), kv_type="ott2", ott_config={"mean": "all"}, n_ctx=512)


def test_ott_config_is_bounded_by_the_context(smollm2: Path, tmp_path: Path) -> None:
    """R larger than a sequence's context (its fp16 ring would hold R+G tokens) and pools larger than the tokens a
    sequence can seal are refused with the limit, in Python and in llama.cpp's tools alike; the defaults fit the
    smallest context (llama.cpp pads n_ctx to 256)."""
    import subprocess

    too_long = r"R=8192 is larger than the context of a sequence \(512 tokens\).*at most 512"
    with pytest.raises(ValueError, match=too_long):
        Llama(str(smollm2), kv_type="ott2", ott_config={"R": 8192}, n_ctx=512, verbose=False)
    # 512 positions with R=32 seal at most 3 groups: 384 tokens the pools could ever hold
    with pytest.raises(ValueError, match=r"outlier_num \+ aux_cap = 403 pool slots exceed the 384 tokens.*at most 384"):
        Llama(str(smollm2), kv_type="ott2", ott_config={"aux_cap": 400}, n_ctx=512, verbose=False)
    for n_ctx in (256, 512):
        Llama(str(smollm2), kv_type="ott2", n_ctx=n_ctx, verbose=False).close()
    Llama(str(smollm2), kv_type="ott2", ott_config={"R": 512, "aux_cap": 125}, n_ctx=512, verbose=False).close()
    text = tmp_path / "docs.txt"
    text.write_text(docs_text(4_000))
    bad = subprocess.run([str(_lib.bin_path("llama-perplexity")), "-m", str(smollm2), "-f", str(text), "-c", "256",
                          "-ctk", "ott2", "-ctv", "ott2", "--ott-params", "128,1000,3,32,2"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "R=1000 is larger than the context of a sequence (256 tokens)" in bad.stderr


def test_each_llama_keeps_its_own_configuration_also_across_threads(smollm2: Path) -> None:
    """The configuration belongs to the context: Llama objects created one after the other or concurrently from
    two threads each run theirs (read back from their caches), and a Llama created afterwards without one gets
    the defaults, not a leftover."""
    from concurrent.futures import ThreadPoolExecutor

    cfgs = [OttConfig(R=16, outlier_num=5), OttConfig(R=64, aux_cap=8, no_outlier_layers=0)]

    def make(cfg: OttConfig) -> Llama:
        return Llama(str(smollm2), kv_type="ott2", ott_config=cfg, n_ctx=512, n_threads=1, verbose=False)

    for _ in range(3):
        with ThreadPoolExecutor(2) as pool:
            made = list(pool.map(make, cfgs))
        for llm, cfg in zip(made, cfgs, strict=True):
            assert llm.ott_config == cfg
            assert llm.kv_cache_info()["config"] == cfg
            llm.close()
    plain = Llama(str(smollm2), kv_type="ott2", n_ctx=512, verbose=False)
    assert plain.ott_config == OttConfig()
    kivi = Llama(str(smollm2), kv_type="kivi2", ott_config=cfgs[0], n_ctx=512, verbose=False)
    assert kivi.ott_config == cfgs[0].replace(outlier_num=0)  # resolved once, in the cache
    # a kivi2 state is not an ott2 state of the same parameters
    kivi.eval(kivi.tokenize(b"Hello there, how are you today?"))
    other = Llama(str(smollm2), kv_type="ott2", ott_config=cfgs[0], n_ctx=512, verbose=False)
    with pytest.raises(ValueError, match="another configuration: outlier_num=0, this cache has outlier_num=5"):
        other.load_state(kivi.save_state())


def greedy(llm: Llama, first: int, n: int) -> list[int]:
    """first, then n greedy tokens; the first is fixed so that logits come from the (restored) cache, not from a
    saved logits buffer."""
    lc = _lib.llama_cpp_module().llama_cpp
    out = [first]
    llm.eval(out)
    for _ in range(n):
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        out.append(int(np.argmax(logits)))
        llm.eval(out[-1:])
    return out


def test_state_save_load_round_trip_and_refusals(smollm2: Path, doc_tokens: list[int]) -> None:
    """A saved ott2 state (sealed groups, pools, ring) continues token-identically after loading; states of
    another cache type or another ott2 configuration are refused with a clear error."""
    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=2048, verbose=False)
    llm.eval(doc_tokens[:450])
    assert llm.kv_cache_info()["sealed"] == 384
    state = llm.save_state()

    first = greedy(llm, doc_tokens[450], 100)  # continues the 450 tokens; at 544 positions group 3 gets sealed
    llm.eval(doc_tokens[600:700])  # change the cache some more
    llm.load_state(state)
    assert llm.kv_cache_info()["positions"] == 450 and llm.kv_cache_info()["sealed"] == 384
    assert greedy(llm, doc_tokens[450], 100) == first

    # each refusal names its reason in the exception itself (verbose=False: no log to read)
    other = Llama(str(smollm2), kv_type="ott2", ott_config=OttConfig(R=16), n_ctx=2048, verbose=False)
    with pytest.raises(ValueError, match="saved with another configuration: R=32, this cache has R=16"):
        other.load_state(state)
    q8 = Llama(str(smollm2), kv_type="q8_0", n_ctx=2048, verbose=False)
    q8.eval(doc_tokens[:50])
    with pytest.raises(ValueError, match="this saved state holds a q8_0 cache; this Llama's cache is ott2"):
        llm.load_state(q8.save_state())
    raw = bytes(state.llama_state)

    def altered(data: bytes) -> object:
        bad = copy.copy(state)
        bad.llama_state, bad.llama_state_size = data, len(data)
        return bad

    with pytest.raises(ValueError, match="the state is truncated"):
        llm.load_state(altered(raw[:-3000]))
    flipped = bytearray(raw)
    for i in range(len(raw) - 20_000, len(raw) - 100, 997):
        flipped[i] ^= 0x10  # bit flips inside the cache's body: refused, never loaded silently
    with pytest.raises(ValueError, match="the state is corrupt"):
        llm.load_state(altered(bytes(flipped)))
    # a state of the previous format (8: before k_young) is refused by its version, naming both
    at = raw.index(b"OTT2")
    assert int.from_bytes(raw[at + 4 : at + 8], "little") == 9
    old = raw[: at + 4] + (8).to_bytes(4, "little") + raw[at + 8 :]
    with pytest.raises(ValueError, match="format version 8 \\(an earlier ott-gguf\\); this build reads version 9"):
        llm.load_state(altered(old))
    # a refused load leaves a cache that still works: the good state loads and continues as before
    llm.load_state(state)
    assert greedy(llm, doc_tokens[450], 100) == first


def test_a_refused_load_loses_nothing(smollm2: Path, doc_tokens: list[int]) -> None:
    """A state the cache refuses leaves the Llama as it was (tokens, scores, cache, logits): generation goes on
    exactly as in a Llama that never tried the load."""
    src = Llama(str(smollm2), type_k="ott3", type_v="ott2", n_ctx=1024, verbose=False)
    src.eval(doc_tokens[:300])
    foreign = src.save_state()
    src.close()

    def started() -> Llama:
        llm = Llama(str(smollm2), kv_type="ott2", n_ctx=1024, verbose=False)
        llm.eval(doc_tokens[400:600])  # seals a group: the cache holds more than its fp16 ring
        return llm

    tried, untouched = started(), started()
    ids, scores = tried.input_ids.copy(), tried.scores[: tried.n_tokens].copy()
    with pytest.raises(ValueError, match="another configuration: K bits=3, this cache has K bits=2"):
        tried.load_state(foreign)
    assert tried.n_tokens == 200
    assert np.array_equal(tried.input_ids, ids) and np.array_equal(tried.scores[:200], scores)
    assert tried.kv_cache_info()["positions"] == 200 and tried.kv_cache_info()["sealed"] == 128
    prompt = [int(t) for t in doc_tokens[400:600]]  # the tokens evaluated: the stock generate reuses them
    a = tried.create_completion(prompt, max_tokens=24, temperature=0.0)["choices"][0]["text"]
    b = untouched.create_completion(prompt, max_tokens=24, temperature=0.0)["choices"][0]["text"]
    assert a == b and a


def test_tools_take_kivi2_and_ott_params(smollm2: Path, tmp_path: Path) -> None:
    """llama.cpp's own tools select kivi2 by name and take --ott-params (kivi2 keeps 0 outliers whatever the
    parameters say), and K/V widths per side; an unknown cache type, an invalid configuration and an ott type
    with a kivi or stock type are refused with the reason."""
    import subprocess

    text = tmp_path / "docs.txt"
    text.write_text(docs_text(4_000))
    ppl = str(_lib.bin_path("llama-perplexity"))
    base = [ppl, "-m", str(smollm2), "-f", str(text), "-c", "128", "--chunks", "1", "-t", "2", "-lv", "4"]
    out = subprocess.run([*base, "-ctk", "kivi2", "-ctv", "kivi2", "--ott-params", "128,16,5,32,2"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(s for s in out.stderr.splitlines() if "kivi2 cache:" in s)
    assert "R=16" in line and "outliers=0" in line
    assert "Final estimate: PPL" in out.stderr
    out = subprocess.run([*base, "-ctk", "ott2", "-ctv", "ott2", "--ott-params", "128,16,5,32,2"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "outliers=5" in next(s for s in out.stderr.splitlines() if "ott2 cache:" in s)
    # per-side widths with rotated V (the 6th --ott-params value), named in the cache's line
    out = subprocess.run([*base, "-ctk", "ott3", "-ctv", "ott2", "--ott-params", "128,16,3,32,2,1"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "K 3 bits mixed, V 2 bits rotated" in next(s for s in out.stderr.splitlines() if "ott3/ott2 cache:" in s)
    # the 7th value: k_mix (on by default), off here
    out = subprocess.run([*base, "-ctk", "ott3", "-ctv", "ott2", "--ott-params", "128,16,3,32,2,1,0"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "K 3 bits, V 2 bits rotated" in next(s for s in out.stderr.splitlines() if "ott3/ott2 cache:" in s)
    # the 8th value: v_sym (off by default), on here: symmetric 2-bit values, "s" in the per-layer widths
    out = subprocess.run([*base, "-ctk", "ott3", "-ctv", "ott2", "--ott-params", "128,16,3,32,2,1,1,1"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [s for s in out.stderr.splitlines() if "ott3/ott2 cache:" in s]
    assert "V 2 bits rotated symmetric" in lines[0] and " 3m/2s" in lines[1], lines
    bad = subprocess.run([*base, "-ctk", "ott5", "-ctv", "ott5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "ott5" in bad.stderr
    # a configuration this build cannot run is refused with the reason, before any model is loaded
    bad = subprocess.run([*base, "-ctk", "ott2", "-ctv", "ott2", "--ott-params", "128,100000,3,32,2"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "--ott-params: R=100000 is outside" in bad.stderr
    bad = subprocess.run([*base, "-ctk", "ott2", "-ctv", "ott2", "--ott-params", "128,32,3,32,2,2"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "v_rotate=2 must be 0 or 1" in bad.stderr
    bad = subprocess.run([*base, "-ctk", "ott3", "-ctv", "ott2", "--ott-params", "128,32,3,32,2,1,3"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "k_mix=3 must be 0, 1 (3-bit keys) or 2 (2- and 3-bit keys)" in bad.stderr
    # k_mix 2: 2-bit keys of mixed widths too ("2m" in the per-layer widths)
    out = subprocess.run([*base, "-ctk", "ott2", "-ctv", "ott2", "--ott-params", "128,16,3,32,2,1,2"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [s for s in out.stderr.splitlines() if "ott2 cache:" in s]
    assert "K 2 bits mixed, V 2 bits rotated" in lines[0] and " 2m/2" in lines[1], lines
    bad = subprocess.run([*base, "-ctk", "ott3", "-ctv", "ott2", "--ott-params", "128,32,3,32,2,0,1,1"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "v_sym=1 needs v_rotate=1" in bad.stderr
    # llama-bench takes the same two flags (for every test of the run) and refuses what the others refuse
    bench = [str(_lib.bin_path("llama-bench")), "-m", str(smollm2), "-ctk", "ott3", "-ctv", "ott2", "-fa", "1",
             "-p", "0", "-n", "2", "-r", "1", "-t", "1", "-o", "json"]  # fmt: skip
    ok = subprocess.run([*bench, "--ott-params", "128,64,3,32,2,1,1,1", "--ott-layers", "0-2:3/3"],
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ok.returncode == 0 and '"n_gen": 2' in ok.stdout, ok.stderr[-2000:]
    for params, why in (("128,32,3,32,2,0,1,1", "v_sym=1 needs v_rotate=1"), ("128,32", "expects G,R")):
        bad = subprocess.run([*bench, "--ott-params", params], capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and why in bad.stderr, bad.stderr[-2000:]
    bad = subprocess.run([*bench, "--ott-layers", "0:5/5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--ott-layers 0:5/5" in bad.stderr
    # an ott type with a kivi type or a stock type is refused, naming the allowed ones
    for k, v in (("ott2", "kivi2"), ("ott3", "f16")):
        mixed = subprocess.run([*base, "-ctk", k, "-ctv", v], capture_output=True, text=True, timeout=120)
        assert mixed.returncode != 0
        assert "must both be ott types (ott2, ott3, ott4) or both kivi types (kivi2, kivi3, kivi4)" in mixed.stderr
    # llama-bench: kivi2 by name too, a cache type of its own (no process-wide setting)
    bench = [str(_lib.bin_path("llama-bench")), "-m", str(smollm2), "-p", "16", "-n", "0", "-r", "1", "-t", "2"]
    ok = subprocess.run([*bench, "-ctk", "kivi2", "-ctv", "kivi2", "-v"], capture_output=True, text=True,
                        timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "outliers=0" in next(s for s in ok.stderr.splitlines() if "kivi2 cache:" in s)


def test_non_finite_keys_are_refused_until_the_sequence_is_cleared(smollm2: Path) -> None:
    """Keys or values that are not finite cannot be quantized: the sequence refuses further batches with an error
    (llama_decode fails) instead of sealing garbage, and works again once it is cleared."""
    import llama_cpp

    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=512, verbose=False)
    ctx = llm._ctx.ctx
    toks = llm.tokenize(docs_text(2_000).encode())[:200]
    llm.eval(toks)
    n_embd = llama_cpp.llama_model_n_embd(llm._model.model)
    batch = llama_cpp.llama_batch_init(1, n_embd, 1)
    try:
        batch.n_tokens = 1
        for i in range(n_embd):
            batch.embd[i] = float("nan")
        batch.pos[0] = len(toks)
        batch.n_seq_id[0] = 1
        batch.seq_id[0][0] = 0
        batch.logits[0] = True
        llama_cpp.llama_decode(ctx, batch)  # computes NaN K/V: the cache marks the sequence
    finally:
        llama_cpp.llama_batch_free(batch)
    nxt = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(toks[0]), 1)
    assert llama_cpp.llama_decode(ctx, nxt) != 0
    with pytest.raises(RuntimeError):
        llm.eval(toks[:1])
    llm.reset()
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, -1, -1)
    llm.eval(toks[:50])
    assert np.isfinite(np.array(llm.scores[49])).all()
    info = _lib.ott_cache_info(ctx)
    assert info is not None and info["positions"] == 50


def test_sequence_state_moves_to_another_context(smollm2: Path, doc_tokens: list[int]) -> None:
    """Per-sequence state (llama_state_seq_get/set_data): a sequence saved from one context continues
    token-identically in another; a context with another ott2 configuration refuses it and stays empty."""
    import ctypes

    lc = _lib.llama_cpp_module().llama_cpp
    src = Llama(str(smollm2), kv_type="ott2", n_ctx=1024, verbose=False)
    src.eval(doc_tokens[:300])
    assert src.kv_cache_info()["sealed"] == 256
    n = lc.llama_state_seq_get_size(src._ctx.ctx, 0)
    buf = (ctypes.c_uint8 * n)()
    assert lc.llama_state_seq_get_data(src._ctx.ctx, buf, n, 0) == n
    want = greedy(src, doc_tokens[300], 40)
    f16 = Llama(str(smollm2), kv_type="f16", n_ctx=1024, verbose=False)
    f16.eval(doc_tokens[:300])
    # only what is held is saved (sealed groups, the unsealed ring rows, used pool slots): 2-bit sized
    assert n < 0.3 * lc.llama_state_seq_get_size(f16._ctx.ctx, 0)

    dst = Llama(str(smollm2), kv_type="ott2", n_ctx=1024, verbose=False)
    assert lc.llama_state_seq_set_data(dst._ctx.ctx, buf, n, 0) == n
    dst.n_tokens = 300  # the Python layer's position counter: the tokens are in the cache already
    dst.input_ids[:300] = doc_tokens[:300]
    assert dst.kv_cache_info()["positions"] == 300 and dst.kv_cache_info()["sealed"] == 256
    assert greedy(dst, doc_tokens[300], 40) == want

    r16 = Llama(str(smollm2), kv_type="ott2", ott_config=OttConfig(R=16), n_ctx=1024, verbose=False)
    assert lc.llama_state_seq_set_data(r16._ctx.ctx, buf, n, 0) == 0
    assert r16.kv_cache_info()["positions"] == 0


def test_decode_reuses_graphs_with_the_same_tokens(smollm2: Path, doc_tokens: list[int],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Decoding reuses the compute graph (the ott2 ops read positions and sealed counts from the plan input),
    across a seal, and gives the tokens of a run that rebuilds every graph."""
    lc = _lib.llama_cpp_module().llama_cpp

    def run() -> tuple[list[int], int]:
        llm = Llama(str(smollm2), kv_type="ott2", n_ctx=1024, verbose=False)
        llm.eval(doc_tokens[:240])
        out = greedy(llm, doc_tokens[240], 60)  # group 1 is sealed at 288 positions
        assert llm.kv_cache_info()["sealed"] == 256
        return out, lc.llama_perf_context(llm._ctx.ctx).n_reused

    reused, n_reused = run()
    assert n_reused >= 50
    monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")
    rebuilt, n_rebuilt = run()
    assert n_rebuilt == 0
    assert reused == rebuilt


def test_kv_cache_info_reports_bytes_by_part_and_pool_slots(smollm2: Path, doc_tokens: list[int]) -> None:
    """Bytes by part as allocated (the quantized part checked against the block layout) and pool slots in use."""
    from native_kernels import kernels

    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=8192, verbose=False)
    llm.eval(doc_tokens[:600])
    info = llm.kv_cache_info()
    assert info["positions"] == 600 and info["sealed"] == 512
    head = kernels().head(2, 2, 128, 64, "scalar", kmix=True)  # ott2's default: 2-bit keys of mixed widths
    n_layer, n_kv_head, D, G, Gv, R = 30, 3, 64, 128, 64, 32  # SmolLM2-135M
    per_group = head.k_group_bytes(D) + G * (D // Gv) * head.v_block_bytes
    # room for the groups that can be sealed: a group is sealed once R newer tokens follow it
    assert info["bytes"]["quantized"] == n_layer * n_kv_head * ((8192 - R) // G) * per_group
    assert info["total_bytes"] == sum(info["bytes"].values()) < 0.2 * 8192 * n_layer * n_kv_head * D * 2 * 2
    # 28 layers with outliers (no_outlier_layers=2), 3 slots per head at most; every group sealed so far competed
    assert 0 < info["outlier_slots"] <= 28 * n_kv_head * 3
    assert info["aux_slots"] <= n_layer * n_kv_head * 32
    kivi = Llama(str(smollm2), kv_type="kivi2", n_ctx=8192, verbose=False)
    kivi.eval(doc_tokens[:600])
    k = kivi.kv_cache_info()
    assert k["outlier_slots"] == 0 and k["aux_slots"] == 0 and k["bytes"]["quantized"] == info["bytes"]["quantized"]
