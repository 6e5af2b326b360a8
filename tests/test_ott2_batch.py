"""Several sequences decoded in one batch with the ott2 cache (one stream each) match decoding them alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ott_gguf import _lib
from ott_gguf.corpus import docs_text

LLAMA_FLASH_ATTN_TYPE_ENABLED = 1


class Ctx:
    """A bare llama.cpp context with the ott2 cache and n_seq streams (llama_cpp.Llama has one sequence)."""

    def __init__(self, model: object, n_seq: int, n_ctx_seq: int) -> None:
        self.lc = _lib.llama_cpp_module().llama_cpp
        p = self.lc.llama_context_default_params()
        p.n_ctx = n_ctx_seq * n_seq
        p.n_batch = p.n_ubatch = 512
        p.n_seq_max = n_seq
        p.kv_unified = False
        p.type_k = p.type_v = _lib.ott_kv_type_ids()["ott2"]
        p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.n_threads = p.n_threads_batch = 2
        self.ctx = self.lc.llama_init_from_model(model, p)  # the default configuration
        assert self.ctx, "could not create the context"
        self.n_vocab = self.lc.llama_vocab_n_tokens(self.lc.llama_model_get_vocab(model))
        self.batch = self.lc.llama_batch_init(512, 0, n_seq)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """items: (token, pos, seq, want_logits); returns the logits of the rows that asked for them."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        assert self.lc.llama_decode(self.ctx, b) == 0
        out = []
        for i, (*_, logits) in enumerate(items):
            if logits:
                ptr = self.lc.llama_get_logits_ith(self.ctx, i)
                out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return out

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)


def doc_tokens(model: object, n: int) -> list[int]:
    """The first n tokens (at most) of the docs text."""
    lc = _lib.llama_cpp_module().llama_cpp
    text = docs_text(4000).encode()
    buf = (lc.llama_token * 4096)()
    got = lc.llama_tokenize(lc.llama_model_get_vocab(model), text, len(text), buf, 4096, False, False)
    return list(buf[: min(got, n)])


def test_three_sequences_in_one_batch_match_each_alone(smollm2: Path) -> None:
    lc = _lib.llama_cpp_module().llama_cpp
    mp = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(smollm2).encode(), mp)
    try:
        vocab = lc.llama_model_get_vocab(model)
        text = docs_text(30_000).encode()
        buf = (lc.llama_token * 16384)()
        n = lc.llama_tokenize(vocab, text, len(text), buf, 16384, False, False)
        assert n >= 2400, n
        toks = list(buf[:n])
        # three prompts of different lengths, all long enough to seal groups (G=128, R=32) while decoding
        prompts = [toks[0:300], toks[1000:1230], toks[2000:2400]]
        steps = 24

        def run_alone(prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
            c = Ctx(model, 1, 1024)
            try:
                for s in range(0, len(prompt), 256):
                    chunk = prompt[s : s + 256]
                    last = s + len(chunk) == len(prompt)
                    logits = c.decode([(t, s + i, 0, last and i == len(chunk) - 1) for i, t in enumerate(chunk)])
                out, rows = [], []
                for k in range(steps):
                    tok = int(np.argmax(logits[-1]))
                    out.append(tok)
                    rows.append(logits[-1])
                    logits = c.decode([(tok, len(prompt) + k, 0, True)])
                return out, rows
            finally:
                c.close()

        alone = [run_alone(p) for p in prompts]

        c = Ctx(model, 3, 1024)
        try:
            last: list[np.ndarray] = []
            for seq, prompt in enumerate(prompts):  # prompts one sequence at a time, like server slots
                for s in range(0, len(prompt), 256):
                    chunk = prompt[s : s + 256]
                    end = s + len(chunk) == len(prompt)
                    got = c.decode([(t, s + i, seq, end and i == len(chunk) - 1) for i, t in enumerate(chunk)])
                    if end:
                        last.append(got[-1])
            outs: list[list[int]] = [[], [], []]
            rows: list[list[np.ndarray]] = [[], [], []]
            for k in range(steps):  # then every step decodes one token of each sequence in one batch
                items = []
                for seq in range(3):
                    tok = int(np.argmax(last[seq]))
                    outs[seq].append(tok)
                    rows[seq].append(last[seq])
                    items.append((tok, len(prompts[seq]) + k, seq, True))
                last = c.decode(items)
        finally:
            c.close()
        for seq in range(3):
            assert outs[seq] == alone[seq][0], f"sequence {seq} diverged"
            np.testing.assert_allclose(np.array(rows[seq]), np.array(alone[seq][1]), rtol=1e-4, atol=1e-3)
    finally:
        lc.llama_model_free(model)


def test_seq_cp_copies_a_whole_sequence(smollm2: Path) -> None:
    """llama_memory_seq_cp to another stream gives a sequence that continues exactly like the original."""
    lc = _lib.llama_cpp_module().llama_cpp
    model = lc.llama_model_load_from_file(str(smollm2).encode(), lc.llama_model_default_params())
    try:
        prompt = doc_tokens(model, 420)
        assert len(prompt) == 420  # seals groups 0 and 1 (G=128, R=32) in the source stream
        c = Ctx(model, 2, 1024)
        try:
            for s in range(0, len(prompt), 210):
                c.decode([(t, s + i, 0, False) for i, t in enumerate(prompt[s : s + 210])])
            lc.llama_memory_seq_cp(lc.llama_get_memory(c.ctx), 0, 1, -1, -1)
            assert lc.llama_memory_seq_pos_max(lc.llama_get_memory(c.ctx), 1) == len(prompt) - 1
            a, b = c.decode([(prompt[-1], len(prompt), 0, True), (prompt[-1], len(prompt), 1, True)])
            np.testing.assert_array_equal(a, b)
        finally:
            c.close()
    finally:
        lc.llama_model_free(model)


def test_seq_keep_clears_the_other_sequences(smollm2: Path) -> None:
    """llama_memory_seq_keep keeps one sequence exactly (it continues as before) and empties the others, which
    then start again from position 0."""
    lc = _lib.llama_cpp_module().llama_cpp
    model = lc.llama_model_load_from_file(str(smollm2).encode(), lc.llama_model_default_params())
    try:
        prompt = doc_tokens(model, 300)
        assert len(prompt) == 300
        c = Ctx(model, 2, 1024)
        try:
            for seq in (0, 1):
                c.decode([(t, i, seq, False) for i, t in enumerate(prompt)])
            mem = lc.llama_get_memory(c.ctx)
            lc.llama_memory_seq_keep(mem, 1)
            assert lc.llama_memory_seq_pos_max(mem, 0) == -1
            assert lc.llama_memory_seq_pos_max(mem, 1) == len(prompt) - 1
            # the kept sequence continues like a fresh sequence 0 with the same prompt
            (kept,) = c.decode([(prompt[-1], len(prompt), 1, True)])
            c.decode([(t, i, 0, False) for i, t in enumerate(prompt)])  # the same ubatches as before
            (fresh,) = c.decode([(prompt[-1], len(prompt), 0, True)])
            np.testing.assert_allclose(kept, fresh, rtol=1e-4, atol=1e-3)
        finally:
            c.close()
    finally:
        lc.llama_model_free(model)
