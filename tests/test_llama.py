"""ott_gguf.Llama on a real model through the patched library."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import ott_gguf
from ott_gguf import KV_TYPES, Llama
from ott_gguf._lib import LIB_DIR

PROMPT = "The three primary colors are"


def greedy(llm: Llama, prompt: str = PROMPT, n: int = 24) -> str:
    out = llm(prompt, max_tokens=n, temperature=0.0, top_k=1)
    return str(out["choices"][0]["text"])


def test_loaded_library_is_ours() -> None:
    assert Path(ott_gguf.loaded_library_path()).resolve().parent == LIB_DIR.resolve()
    info = ott_gguf.llama_ott_build_info()  # only the patched libllama exports this
    assert info.startswith("ott-gguf ") and "ott caches: K and V codes of 2, 3 or 4 bits, G=128" in info


def test_the_ott_types_of_python_are_the_librarys() -> None:
    """The names Python accepts are the ott cache types the native table lists, selected by their ggml ids."""
    ids = ott_gguf._lib.ott_kv_type_ids()
    assert tuple(ids) == ott_gguf.OTT_KV_TYPES
    stock = ott_gguf._lib.ggml_type_ids()
    assert all(stock[name] == i for name, i in ids.items()) and len(set(ids.values())) == len(ids)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_greedy_generation_is_deterministic(smollm2: Path, kv_type: str) -> None:
    a = Llama(str(smollm2), kv_type=kv_type, n_ctx=512, n_threads=2, seed=1, verbose=False)
    first = greedy(a)
    a.reset()
    again = greedy(a)
    b = Llama(str(smollm2), kv_type=kv_type, n_ctx=512, n_threads=2, seed=2, verbose=False)
    other = greedy(b)
    assert len(first.split()) >= 5, first
    assert first == again == other
    assert a.context_params.type_k == a.context_params.type_v == ott_gguf._lib.ggml_type_ids()[kv_type]
    assert a.context_params.flash_attn_type == 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED


def test_q8_0_follows_f16(smollm2: Path) -> None:
    """q8_0 K/V barely changes the logits: the first greedy tokens agree with f16."""
    f16 = greedy(Llama(str(smollm2), kv_type="f16", n_ctx=512, verbose=False), n=8)
    q8 = greedy(Llama(str(smollm2), kv_type="q8_0", n_ctx=512, verbose=False), n=8)
    assert f16.split()[:3] == q8.split()[:3]


def test_gemma3_generates(gemma3: Path) -> None:
    """Gemma 3 (sliding-window layers, head dim 256) with a quantized cache continues a sequence correctly."""
    llm = Llama(str(gemma3), kv_type="q8_0", n_ctx=512, n_threads=2, verbose=False)
    assert greedy(llm, "Monday, Tuesday, Wednesday,", n=8).split()[:2] == ["Thursday,", "Friday,"]
    assert "France" in greedy(llm, "Paris is the capital of", n=4)


def test_unknown_kv_type_lists_valid_choices(smollm2: Path) -> None:
    with pytest.raises(ValueError) as e:
        Llama(str(smollm2), kv_type="q3_z")
    for name in KV_TYPES:
        assert name in str(e.value)


def test_unknown_keyword_is_not_ignored(smollm2: Path) -> None:
    with pytest.raises(TypeError, match="kv_typ"):
        Llama(str(smollm2), kv_typ="q8_0")


def test_quantized_kv_needs_flash_attention(smollm2: Path) -> None:
    with pytest.raises(ValueError, match="flash attention"):
        Llama(str(smollm2), kv_type="q4_0", flash_attn=False)
    with pytest.raises(ValueError, match="type_k='f16', type_v='q8_0'.*flash attention"):
        Llama(str(smollm2), type_v=8, flash_attn=False)  # one quantized side is enough


def test_pickle_keeps_kv_type(smollm2: Path) -> None:
    llm = Llama(str(smollm2), kv_type="q4_0", n_ctx=256, verbose=False)
    clone = pickle.loads(pickle.dumps(llm))
    assert clone.kv_type == "q4_0"
    assert clone.context_params.type_k == llm.context_params.type_k
    mixed = pickle.loads(pickle.dumps(Llama(str(smollm2), type_k="q8_0", type_v="q4_0", n_ctx=256, verbose=False)))
    assert (mixed.kv_type, mixed.kv_type_k, mixed.kv_type_v) == ("q8_0/q4_0", "q8_0", "q4_0")


# --- drop-in behaviour with the ott2 cache ---------------------------------------------------------------------
# (llama-cpp-python 0.3.36 has no context-shift option: at n_ctx it stops generating, tested below)


def test_ott2_streaming_completion(smollm2: Path) -> None:
    """Streaming through the ott2 cache gives, token by token, the text of one call; long enough to seal a group."""
    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=512, n_threads=2, verbose=False)
    chunks = list(llm(PROMPT, max_tokens=170, temperature=0.0, stream=True))
    streamed = "".join(str(c["choices"][0]["text"]) for c in chunks)
    assert len(chunks) > 100 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    info = llm.kv_cache_info()
    assert info["sealed"] == 128 and info["positions"] == llm.n_tokens
    # from scratch (the cached prefix could not be cut losslessly inside group 0 anyway: generate() would start over)
    llm.reset()
    whole = llm(PROMPT, max_tokens=170, temperature=0.0)
    assert whole["choices"][0]["text"] == streamed
    assert whole["usage"]["completion_tokens"] == 170


def test_ott2_chat_completion(smollm2: Path) -> None:
    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=512, n_threads=2, verbose=False)
    messages = [{"role": "user", "content": "Name a fruit."}]
    out = llm.create_chat_completion(messages=messages, max_tokens=16, temperature=0.0)
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip()
    # the cache holds the templated prompt and the answer, less the last sampled token (never evaluated)
    usage = out["usage"]
    expected = usage["prompt_tokens"] + usage["completion_tokens"] - (choice["finish_reason"] == "length")
    assert llm.kv_cache_info()["positions"] == llm.n_tokens == expected

    llm.reset()
    chunks = list(llm.create_chat_completion(messages=messages, max_tokens=16, temperature=0.0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]


def test_ott2_generation_stops_at_the_context_end(smollm2: Path) -> None:
    """No context shift: a generation ends at n_ctx with finish_reason 'length'; a prompt over n_ctx is refused."""
    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=256, n_threads=2, verbose=False)
    out = llm("Once upon a time", max_tokens=1000, temperature=0.0)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == 256
    assert llm.kv_cache_info()["positions"] == llm.n_tokens == 255
    with pytest.raises(ValueError, match="exceed context window"):
        llm("word " * 300, max_tokens=4)


def test_gemma3_without_chat_template_chats_in_its_format(gemma3: Path) -> None:
    """Gemma 3's GGUF has no chat template: the chat uses Gemma's turn format (said in a warning) instead of the
    llama-2 fallback it answered with an empty string; an architecture without a known format refuses to chat
    with the fix named, instead of answering nothing."""
    llm = Llama(str(gemma3), kv_type="ott2", n_ctx=512, verbose=False)
    assert llm.chat_format == "gemma"
    msg = [{"role": "user", "content": "Name three colors."}]
    with pytest.warns(UserWarning, match="no chat template"):
        res = llm.create_chat_completion(messages=msg, max_tokens=16, temperature=0.0)
    text = res["choices"][0]["message"]["content"]
    assert text and text.strip()
    llm.metadata = {**llm.metadata, "general.architecture": "mystery"}
    llm.chat_format, llm.chat_handler = "llama-2", None
    llm._choose_chat_format()
    with pytest.raises(ValueError, match="no chat template and no known chat format.*chat_format="):
        llm.create_chat_completion(messages=msg, max_tokens=4)


def test_plain_llama_cpp_loads_our_build_and_selects_ott2_by_id(smollm2: Path) -> None:
    """Existing llama-cpp-python code: `import llama_cpp` alone (ott_gguf not imported first, no environment
    variable) loads the patched libllama, and llama_cpp.Llama(type_k=..., type_v=...) with the exported ids runs
    the ott2 cache."""
    import os
    import subprocess
    import sys

    code = f"""
import llama_cpp
assert hasattr(llama_cpp.llama_cpp._lib, "llama_ott_build_info"), llama_cpp.llama_cpp._lib._name
llm = llama_cpp.Llama({str(smollm2)!r}, n_ctx=512, flash_attn=True, verbose=False, type_k=OTT_ID, type_v=OTT_ID)
out = llm("The three primary colors are", max_tokens=8, temperature=0.0)["choices"][0]["text"]
import ott_gguf
assert OTT_ID == ott_gguf.GGML_TYPE_OTT2
info = ott_gguf._lib.ott_cache_info(llm._ctx.ctx)
print(info["layers"], info["positions"], repr(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    type_id = ott_gguf.GGML_TYPE_OTT2
    res = subprocess.run([sys.executable, "-c", code.replace("OTT_ID", str(type_id))], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    layers, positions, text = res.stdout.split(" ", 2)
    assert int(layers) == 30 and int(positions) > 8 and len(text.strip("'\n ")) > 0


def test_llama_cpp_python_server_runs_ott2_through_the_openai_client(smollm2: Path, tmp_path: Path) -> None:
    """llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`) selects the ott2 cache by
    its ggml id and answers the official openai client; its log shows that the ott2 cache was created."""
    import os
    import subprocess
    import sys
    import time

    from openai import OpenAI

    from ott_gguf.server import free_port

    port = free_port()
    ott2 = str(ott_gguf.GGML_TYPE_OTT2)
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2), "--type_k", ott2, "--type_v", ott2,
           "--n_ctx", "1024", "--n_threads", "2", "--host", "127.0.0.1", "--port", str(port),
           "--verbose", "true"]  # fmt: skip
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}  # as existing code runs it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)
        deadline = time.monotonic() + 180
        while True:  # until the server listens (it loads the model first)
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                client.models.list()
                break
            except Exception:
                assert time.monotonic() < deadline, "llama_cpp.server did not come up in 180 s"
                time.sleep(1)
        out = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=16,
                                             messages=[{"role": "user", "content": "Name a fruit."}])  # fmt: skip
        answer = out.choices[0].message.content
        assert answer and answer.strip(), out
    finally:
        proc.kill()
        proc.wait(timeout=30)
    text = log.read_text(errors="replace")
    line = next((s for s in text.splitlines() if "ott2 cache:" in s), "")
    assert "llama_kv_cache_ott" in line and "K 2 bits mixed, V 2 bits" in line, text[-3000:]


def test_embeddings_with_an_ott_type_say_what_to_use(smollm2: Path) -> None:
    """Batched embeddings with kv_type='ott2' used to fail inside llama_decode ("failed to find a memory slot");
    now the choice is refused up front with the fix, and the suggested type embeds a batch."""
    with pytest.raises(ValueError, match="embedding=True.*use kv_type='f16'"):
        Llama(str(smollm2), kv_type="ott2", embedding=True, verbose=False)
    emb = Llama(str(smollm2), kv_type="f16", embedding=True, verbose=False).embed(["a", "b"])
    assert len(emb) == 2


def test_a_context_the_ott_cache_refuses_says_why(smollm2: Path) -> None:
    """llama_init_from_model only logs why the cache refused and returns NULL: the reason is kept for the caller
    (llama_ott_last_error), here for an ott type with a kivi type through llama-cpp-python's own Llama (which,
    unlike ott_gguf.Llama, does not check the pair first)."""
    import llama_cpp

    ids = ott_gguf._lib.ott_kv_type_ids()
    with pytest.raises(ValueError, match="Failed to create llama_context"):
        with ott_gguf._lib.thread_config(ott_gguf.OttConfig()):
            llama_cpp.Llama(str(smollm2), n_ctx=512, flash_attn=True, verbose=False, type_k=ids["ott2"],
                            type_v=ids["kivi2"])  # fmt: skip
    assert ott_gguf._lib.last_error() == (
        "ott: K and V must both be ott types (ott2, ott3, ott4) or both kivi types (kivi2, kivi3, kivi4), in any "
        "widths; got K ott2 and V kivi2"
    )


def test_kv_cache_info_after_close_says_closed(smollm2: Path) -> None:
    """close() frees the context: kv_cache_info then says so, instead of reporting that there is no ott cache."""
    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=256, verbose=False)
    assert llm.kv_cache_info()["positions"] == 0
    llm.close()
    with pytest.raises(RuntimeError, match="this Llama is closed"):
        llm.kv_cache_info()


# --- errors that keep their reason (issue 49, deliverable 4) ---------------------------------------------------


@pytest.mark.parametrize("kv_type", ["f16", "ott2"])
def test_a_model_that_cannot_load_says_why(smollm2: Path, tmp_path: Path, kv_type: str) -> None:
    with pytest.raises(ValueError, match="Model path does not exist"):
        Llama(str(tmp_path / "missing.gguf"), kv_type=kv_type, verbose=False)
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model\n")
    with pytest.raises(ValueError, match=r"notes.gguf: invalid magic characters: 'hell', expected 'GGUF'"):
        Llama(str(text), kv_type=kv_type, verbose=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2.read_bytes()[: 3 << 20])  # the header and a few tensors: a download cut short
    with pytest.raises(ValueError, match=r"cut.gguf: tensor '.*' data is not within the file bounds"):
        Llama(str(cut), kv_type=kv_type, verbose=False)


def test_ott_caches_run_without_flash_attention(smollm2: Path) -> None:
    """flash_attn=False is refused only where llama.cpp needs flash attention (stock quantized rows); the ott
    caches run their own attention op and give the same text either way."""
    on = Llama(str(smollm2), kv_type="ott2", n_ctx=256, n_threads=1, verbose=False)
    off = Llama(str(smollm2), kv_type="ott2", n_ctx=256, n_threads=1, flash_attn=False, verbose=False)
    assert off.context_params.flash_attn_type == 0
    assert greedy(off, n=12) == greedy(on, n=12)


@pytest.mark.parametrize(("saved", "into"), [("ott2", "f16"), ("f16", "ott2"), ("f16", "q8_0")])
def test_a_state_of_one_cache_type_loaded_into_another_names_both(smollm2: Path, saved: str, into: str) -> None:
    src = Llama(str(smollm2), kv_type=saved, n_ctx=256, n_threads=1, verbose=False)
    src.eval(src.tokenize(b"The three primary colors are red, yellow and blue."))
    state = src.save_state()
    dst = Llama(str(smollm2), kv_type=into, n_ctx=256, n_threads=1, verbose=False)
    want = greedy(dst, n=6)
    with pytest.raises(ValueError, match=f"this saved state holds a {saved} cache; this Llama's cache is {into}"):
        dst.load_state(state)
    assert greedy(dst, n=6) == want  # nothing was lost


def test_a_refused_stock_state_says_what_llama_cpp_said(smollm2: Path, gemma3: Path) -> None:
    """A state without the types' names (e.g. saved by llama_cpp.Llama) refused by a stock cache: llama.cpp's
    reason, not only "Failed to set llama state data"."""
    import llama_cpp

    src = llama_cpp.Llama(str(gemma3), n_ctx=256, n_threads=1, verbose=False)
    src.eval(src.tokenize(b"Hello"))
    state = src.save_state()
    dst = Llama(str(smollm2), kv_type="f16", n_ctx=256, n_threads=1, verbose=False)
    with pytest.raises(RuntimeError, match=r"Failed to set llama state data: llama.cpp says \S+"):
        dst.load_state(state)


def test_log_captures_from_two_threads_leave_the_logger_as_it_was() -> None:
    """llama.cpp has one logger per process. Thread A captures it (ott_gguf.info.captured_log, used while a model
    loads) and, while it holds it, thread B starts its own capture: B must not take A's collector for the logger to
    restore, or A's collector, freed when A is done, is called by llama.cpp's next log line (two threads creating
    ott Llama objects at once crashed so). After both, the logger is the one before."""
    import ctypes
    import threading

    from ott_gguf import _lib
    from ott_gguf.info import captured_log

    lc = _lib.llama_cpp_module().llama_cpp

    def current() -> int | None:
        cb, ud = lc.llama_log_callback(), ctypes.c_void_p()
        lc.llama_log_get(ctypes.byref(cb), ctypes.byref(ud))
        return ctypes.cast(cb, ctypes.c_void_p).value

    before = current()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with captured_log():
            a_in.set()
            b_in.wait(0.5)  # B either enters now (A's collector is in place) or waits for A to finish
        a_out.set()

    def b() -> None:
        a_in.wait(5)
        with captured_log():
            b_in.set()
            a_out.wait(5)  # B restores its logger after A has restored A's

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert current() == before


def test_log_capture_is_per_thread_and_nests(smollm2: Path) -> None:
    """ott_gguf's log capture (info.captured_log) takes only the lines of its own thread, into the innermost open
    capture: a model another thread loads meanwhile logs where it would have (once, a capture took those lines
    through a callback it freed on exit while that thread was still inside it: a crash)."""
    import threading

    from ott_gguf import _lib
    from ott_gguf.info import captured_log

    lc = _lib.llama_cpp_module().llama_cpp

    def load() -> None:  # llama.cpp logs the model's metadata while it loads
        params = lc.llama_model_default_params()
        params.vocab_only = True
        model = lc.llama_model_load_from_file(str(smollm2).encode(), params)
        assert model
        lc.llama_model_free(model)

    with captured_log() as outer:
        with captured_log() as inner:
            other = threading.Thread(target=load)
            other.start()
            other.join()
        assert inner == [] and outer == []  # another thread's lines are not this thread's
        load()
    assert any("llama_model_loader" in line or "print_info" in line for line in outer), outer[:5]
    assert inner == []
