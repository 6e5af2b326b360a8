"""A GGUF with random weights at a named real shape (issue 47, deliverable 6): decode speed at depth on the shapes
users run (head dim 128, GQA 4:1 and 7:1) without downloading weights. Speed only: random weights say nothing
about quality.

    python -m study.random_gguf --shape llama3-8b|qwen2.5-7b [--layers N] [--vocab V] [--wtype q4_0|q8_0] --out F

Every layer has the real shape (d_model, heads, KV heads, head dim, FFN) and the real architecture's tensors (qwen2:
q/k/v biases); --layers and --vocab shrink the model for a cheap measurement. Keeping vocab/layers at the full
model's ratio (llama3-8b: --layers 4 --vocab 16032) keeps the output projection's share of a decoded token's
weight reads as in the full model, so ratios between cache types stay comparable to the full model's.

Weights are Q4_0 or Q8_0 blocks of random bytes with a random-sign fp16 scale per block: zero-mean weights of
standard deviation 1/sqrt(fan_in), so that RMS-normed activations stay O(1) through any number of layers (the ott
caches refuse non-finite K/V). Norms are ones. The vocabulary is a minimal SentencePiece-style one that llama.cpp
loads for any architecture (<unk>, <s>, </s>, the 256 byte tokens <0xNN>, then filler pieces).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # llama.cpp's architecture name
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    rope_theta: float
    n_ctx: int  # the trained context (llama.cpp warns above it, and runs)
    rms_eps: float
    qkv_bias: bool


# from the models' config.json (meta-llama/Meta-Llama-3-8B, Qwen/Qwen2.5-7B-Instruct)
SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape("llama", 32, 4096, 32, 8, 128, 14336, 128256, 500000.0, 8192, 1e-5, False),
    "qwen2.5-7b": Shape("qwen2", 28, 3584, 28, 4, 128, 18944, 152064, 1000000.0, 32768, 1e-6, True),
}

# ggml's blocks of 32 values: q4_0 is an fp16 scale d and 16 bytes of 4-bit codes (value (code - 8) * d), q8_0 an fp16
# scale and 32 int8 codes; name -> (bytes per block, rms of codes drawn from uniform random bytes, GGMLQuantizationType)
_QK = 32
_WTYPES: dict[str, tuple[int, float, int]] = {
    "q4_0": (18, float(np.sqrt(np.mean((np.arange(16) - 8.0) ** 2))), 2),
    "q8_0": (34, float(np.sqrt(np.mean(np.arange(-128, 128, dtype=np.float64) ** 2))), 8),
}
_FILE_TYPE = {"q4_0": 2, "q8_0": 7}  # llama_ftype: MOSTLY_Q4_0, MOSTLY_Q8_0
N_SPECIAL = 3 + 256  # <unk> <s> </s> and the byte tokens


def random_blocks(rng: np.random.Generator, rows: int, cols: int, wtype: str, std: float) -> np.ndarray:
    """rows x cols weights as ggml blocks (uint8, rows x bytes per row): random codes, each block's fp16 scale
    ±std/code_rms with a random sign (zero mean, the given standard deviation)."""
    nbytes, code_rms, _ = _WTYPES[wtype]
    blocks = rows * (cols // _QK)
    out = np.frombuffer(rng.bytes(blocks * nbytes), dtype=np.uint8).reshape(blocks, nbytes).copy()
    d = np.where(rng.integers(0, 2, blocks, dtype=np.uint8) == 1, std / code_rms, -std / code_rms)
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(blocks, 2)
    return out.reshape(rows, (cols // _QK) * nbytes)


def vocab(n: int) -> tuple[list[str], list[int]]:
    """Tokens and their llama.cpp token types (1 normal, 2 unknown, 3 control, 6 byte)."""
    if n < N_SPECIAL + 1:
        raise ValueError(f"--vocab must be at least {N_SPECIAL + 1}")
    toks = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    toks += [f"\u2581t{i}" for i in range(n - len(toks))]
    return toks, [2, 3, 3, *([6] * 256), *([1] * (n - N_SPECIAL))]


def tensors(s: Shape) -> list[tuple[str, int, int, bool]]:
    """(name, rows, cols, quantized) in file order: rows are ggml's ne[1] (outputs), cols ne[0] (inputs)."""
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out = [("token_embd.weight", s.n_vocab, s.n_embd, True)]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", 1, s.n_embd, False), (b + "attn_q.weight", q, s.n_embd, True),
                (b + "attn_k.weight", kv, s.n_embd, True), (b + "attn_v.weight", kv, s.n_embd, True)]  # fmt: skip
        if s.qkv_bias:
            out += [(b + "attn_q.bias", 1, q, False), (b + "attn_k.bias", 1, kv, False),
                    (b + "attn_v.bias", 1, kv, False)]  # fmt: skip
        out += [(b + "attn_output.weight", s.n_embd, q, True), (b + "ffn_norm.weight", 1, s.n_embd, False),
                (b + "ffn_gate.weight", s.n_ff, s.n_embd, True), (b + "ffn_up.weight", s.n_ff, s.n_embd, True),
                (b + "ffn_down.weight", s.n_embd, s.n_ff, True)]  # fmt: skip
    return out + [("output_norm.weight", 1, s.n_embd, False), ("output.weight", s.n_vocab, s.n_embd, True)]


def write(path: Path, shape: str, *, layers: int | None = None, n_vocab: int | None = None, wtype: str = "q4_0",
          seed: int = 0) -> Shape:  # fmt: skip
    """Writes the model; returns the shape written (layers and vocabulary as asked)."""
    import gguf  # the writer of llama.cpp's gguf-py (pip: gguf)

    base = SHAPES[shape]
    s = Shape(**{**base.__dict__, "n_layer": layers or base.n_layer, "n_vocab": n_vocab or base.n_vocab})
    if wtype not in _WTYPES:
        raise ValueError(f"--wtype is one of {', '.join(_WTYPES)}")
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"random {shape}" + (f" ({s.n_layer} layers)" if s.n_layer != base.n_layer else ""))
    w.add_file_type(_FILE_TYPE[wtype])
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(s.n_vocab)
    toks, types = vocab(s.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * len(toks))
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    qtype = gguf.GGMLQuantizationType(_WTYPES[wtype][2])
    specs = tensors(s)
    for name, rows, cols, quant in specs:
        if quant:
            nbytes = rows * (cols // _QK) * _WTYPES[wtype][0]
            w.add_tensor_info(name, (rows, cols // _QK * _WTYPES[wtype][0]), np.dtype(np.uint8), nbytes, qtype)
        else:
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, rows, cols, quant in specs:
        if not quant:
            ones = name.endswith("norm.weight")
            w.write_tensor_data(np.ones(cols, np.float32) if ones else rng.normal(0, 0.02, cols).astype(np.float32))
        else:
            # embeddings of rms 1 (what RMS norm expects), projections of std 1/sqrt(fan_in)
            std = 1.0 if name == "token_embd.weight" else cols**-0.5
            w.write_tensor_data(random_blocks(rng, rows, cols, wtype, std))
    w.close()
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m study.random_gguf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="fewer layers than the real model's")
    ap.add_argument("--vocab", type=int, help=f"a smaller vocabulary than the real model's (>= {N_SPECIAL + 1})")
    ap.add_argument("--wtype", default="q4_0", choices=sorted(_WTYPES), help="the weights' block format")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    t0 = time.time()
    s = write(a.out, a.shape, layers=a.layers, n_vocab=a.vocab, wtype=a.wtype, seed=a.seed)
    print(f"{a.out}: {a.shape} {s.n_layer} layers, vocab {s.n_vocab}, {a.wtype}, "
          f"{a.out.stat().st_size / 2**20:.0f} MiB in {time.time() - t0:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
