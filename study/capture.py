"""Record a real model's per-layer queries, keys and values, as llama.cpp computes them, into an .npz file.

A GGUF model runs in the patched build through llama-cpp-python's low-level API (flash attention, f16 K/V,
one sequence, ubatch by ubatch); llama.cpp's eval callback (`llama_context_params.cb_eval`) hands over each
graph node after it is computed, and the 3-d `Qcur-<il>`, `Kcur-<il>` and `Vcur-<il>` tensors
`[head_dim, n_head, n_tokens]` are copied out: queries and keys after RoPE (what attention and the K cache
see), values as projected. They are stored as float16 by default, which for K and V is exactly what the f16
cache holds (the same round-to-nearest-even conversion).

    capture("smollm2-135m", None, 4096, "smollm2.npz")        # None: the llama.cpp docs corpus
    python -m study.capture --model gemma3-270m --tokens 4096 --out gemma3.npz

The .npz holds q{il} [n_tokens, n_head, head_dim], k{il} and v{il} [n_tokens, n_head_kv, head_dim] (float16),
any requested extra per-layer tensors as float32 [n_tokens, elements per token] (e.g. kqv_out{il}, the attention
output before the output projection, [n_tokens, n_head * head_dim_v]) and the metadata listed in `read_meta`.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from ott_gguf import corpus
from ott_gguf._lib import lib_path, llama_cpp_module
from ott_gguf.models import MODELS, fetch

__all__ = ["QKV", "capture", "main", "read_meta"]

QKV = ("Qcur", "Kcur", "Vcur")
_KEY = {"Qcur": "q", "Kcur": "k", "Vcur": "v"}

# enum ggml_type values (ggml/include/ggml.h)
_GGML_TYPE_F32 = 0
_GGML_TYPE_F16 = 1
_NP_DTYPE = {_GGML_TYPE_F32: np.dtype(np.float32), _GGML_TYPE_F16: np.dtype(np.float16)}

# GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME of the pinned ggml/include/ggml.h
_MAX_DIMS, _MAX_SRC, _MAX_OP_PARAMS, _MAX_NAME = 4, 10, 64, 64


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor, field for field as in the pinned ggml/include/ggml.h (checked by _check_layout)."""

    _fields_ = [
        ("type", ctypes.c_int),  # enum ggml_type
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _MAX_DIMS),
        ("nb", ctypes.c_size_t * _MAX_DIMS),
        ("op", ctypes.c_int),  # enum ggml_op
        ("op_params", ctypes.c_int32 * (_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class _GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@cache
def _ggml() -> ctypes.CDLL:
    """libggml-base of the build llama_cpp loaded (same file, so the same already-loaded library)."""
    llama_cpp_module()
    g = ctypes.CDLL(str(lib_path("ggml-base")))
    vp, sz, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    sigs: dict[str, tuple[list[Any], Any]] = {
        "ggml_backend_tensor_get": ([vp, vp, sz, sz], None),
        "ggml_nbytes": ([vp], sz),
        "ggml_n_dims": ([vp], ctypes.c_int),
        "ggml_get_name": ([vp], vp),
        "ggml_get_data": ([vp], vp),
        "ggml_op_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_tensor_overhead": ([], sz),
        "ggml_init": ([_GgmlInitParams], vp),
        "ggml_free": ([vp], None),
        "ggml_new_tensor_3d": ([vp, ctypes.c_int, i64, i64, i64], vp),
        "ggml_view_2d": ([vp, vp, i64, i64, sz, sz], vp),
        "ggml_set_name": ([vp, ctypes.c_char_p], vp),
        "ggml_set_input": ([vp], None),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(g, name)
        fn.argtypes, fn.restype = args, res
    _check_layout(g)
    return g


def _check_layout(g: ctypes.CDLL) -> None:
    """Refuse to read graph tensors unless GgmlTensor matches the loaded ggml: build two probe tensors and compare
    every field we use with what ggml's exported functions report for them."""
    # ggml_tensor_overhead() = sizeof(struct ggml_object) (32 bytes, ggml.c) + sizeof(struct ggml_tensor)
    if ctypes.sizeof(GgmlTensor) + 32 != g.ggml_tensor_overhead():
        raise RuntimeError(f"struct ggml_tensor size mismatch: ggml_tensor_overhead() = {g.ggml_tensor_overhead()}")
    ctx = g.ggml_init(_GgmlInitParams(1 << 16, None, False))
    if not ctx:
        raise RuntimeError("ggml_init failed")
    try:
        a = g.ggml_new_tensor_3d(ctx, _GGML_TYPE_F16, 5, 7, 11)
        g.ggml_set_name(a, b"ott-probe")
        g.ggml_set_input(a)
        v = g.ggml_view_2d(ctx, a, 5, 7, 10, 140)
        ta, tv = GgmlTensor.from_address(a), GgmlTensor.from_address(v)
        checks = {
            "type": ta.type == _GGML_TYPE_F16 and g.ggml_nbytes(a) == 5 * 7 * 11 * 2,
            "ne": list(ta.ne) == [5, 7, 11, 1] and g.ggml_n_dims(a) == 3,
            "nb": list(ta.nb) == [2, 10, 70, 770],
            "name": g.ggml_get_name(a) == a + GgmlTensor.name.offset and ta.name == b"ott-probe",
            "data": ta.data is not None and ta.data == g.ggml_get_data(a),
            "flags": ta.flags == 1,  # GGML_TENSOR_FLAG_INPUT
            "op": g.ggml_op_name(tv.op) == b"VIEW" and g.ggml_op_name(ta.op) == b"NONE",
            "op_params": tv.op_params[0] == 140 and tv.op_params[1] == 0,  # the view offset (a size_t)
            "src/view": tv.src[0] == a and tv.view_src == a and tv.view_offs == 140 and tv.data == ta.data + 140,
        }
    finally:
        g.ggml_free(ctx)
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise RuntimeError(f"struct ggml_tensor does not match the loaded ggml (fields: {', '.join(bad)})")


def _read_tensor(g: ctypes.CDLL, t: int, tt: GgmlTensor) -> np.ndarray:
    """A graph tensor's elements as a new numpy array, axes reversed (numpy order: ne[n-1], ..., ne[0]).

    ggml_backend_tensor_get copies from whatever backend holds the data (host or device) and covers views: it
    reads the byte span [data, data + ggml_nbytes) that the strides address."""
    dtype = _NP_DTYPE.get(tt.type)
    if dtype is None:
        raise RuntimeError(f"{tt.name.decode()}: unsupported ggml type {tt.type}")
    nbytes = g.ggml_nbytes(t)
    raw = np.empty(nbytes, dtype=np.uint8)
    g.ggml_backend_tensor_get(t, raw.ctypes.data, 0, nbytes)
    shape = tuple(int(x) for x in reversed(tt.ne))
    strides = tuple(int(x) for x in reversed(tt.nb))
    # np.ndarray checks that the strided view stays inside the buffer
    return np.ndarray(shape, dtype=dtype, buffer=raw, strides=strides).copy()


@dataclass
class _Recorder:
    """The cb_eval state: which tensors to copy for the ubatch being computed, and what was copied."""

    g: ctypes.CDLL
    n_layer: int
    n_head: int
    n_head_kv: int
    extra: tuple[str, ...]
    n_ub: int = 0  # tokens in the ubatch being computed
    wanted: dict[bytes, tuple[str, int]] = field(default_factory=dict)
    # (base name, layer) -> (array, produced by a view op) for the current ubatch
    got: dict[tuple[str, int], tuple[np.ndarray, bool]] = field(default_factory=dict)
    ub_ops: dict[str, str] = field(default_factory=dict)  # base name -> the ggml op of the tensor kept
    ops: dict[str, str] = field(default_factory=dict)  # the same, as reported (from a ubatch of > 1 token)
    # base names whose kept tensor was computed (not a view) in an earlier ubatch: every ubatch builds the same
    # graph, so their views need not be copied again, which saves a graph split and a sync per view
    computed: set[str] = field(default_factory=set)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        for il in range(self.n_layer):
            for base in (*QKV, *self.extra):
                self.wanted[f"{base}-{il}".encode()] = (base, il)

    def _matches(self, base: str, tt: GgmlTensor) -> bool:
        if base in self.computed and tt.view_src:
            return False
        if base in QKV:
            # only the 3-d [head_dim, heads, n_tokens] tensor: the same name also marks the 2-d projection
            heads = self.n_head if base == "Qcur" else self.n_head_kv
            return tt.type == _GGML_TYPE_F32 and tt.ne[1] == heads and tt.ne[2] == self.n_ub and tt.ne[3] == 1
        return True

    def __call__(self, t: int, ask: bool, _user_data: int | None) -> bool:
        try:
            tt = GgmlTensor.from_address(t)
            key = self.wanted.get(tt.name)
            if key is None or not self._matches(key[0], tt):
                return not ask  # ask: "not needed"; after compute: "continue"
            if ask:
                return True
            is_view = bool(tt.view_src)
            prev = self.got.get(key)
            # later nodes of a name win (RESHAPE -> ROPE), but a view never replaces a computed tensor
            if prev is None or not is_view or prev[1]:
                self.got[key] = (_read_tensor(self.g, t, tt), is_view)
                self.ub_ops[key[0]] = self.g.ggml_op_name(tt.op).decode()
            return True
        except BaseException as e:  # an exception must not cross the C boundary: stop the graph, raise later
            self.error = e
            return False


def _meta_str(lc: Any, model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(1024)
    n = lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


# llama.cpp's default sliding-window pattern per architecture when the GGUF has no
# <arch>.attention.sliding_window_pattern (src/models/<arch>.cpp: load_swa_pattern(ml, n), not dense-first)
_SWA_PATTERN_DEFAULT = {"gemma2": 2, "gemma3": 6, "cohere2": 4}


def _swa_layers(lc: Any, model: Any, arch: str, n_layer: int, n_swa: int) -> tuple[list[int], str]:
    """Sliding-window layers as llama.cpp's llama_hparams::set_swa_pattern derives them, and where from."""
    if n_swa <= 0:
        return [], "none"
    raw = _meta_str(lc, model, f"{arch}.attention.sliding_window_pattern")
    if raw is not None and raw.strip().startswith("["):  # a per-layer bool array
        vals = re.findall(r"true|false|\d+", raw.lower())
        flags = [v in ("true", "1") for v in vals]
        if len(flags) >= n_layer:
            return [il for il in range(n_layer) if flags[il]], "gguf"
    if arch not in _SWA_PATTERN_DEFAULT:  # other architectures may lay an int pattern out dense-first
        return [], "unknown"
    if raw is not None and raw.strip().isdigit():
        n_pattern, source = int(raw), "gguf"
    else:
        n_pattern, source = _SWA_PATTERN_DEFAULT[arch], f"llama.cpp default for {arch}"
    return [il for il in range(n_layer) if n_pattern == 0 or il % n_pattern < n_pattern - 1], source


def _attn_scale(lc: Any, model: Any, arch: str, n_layer: int, n_embd: int, n_head: int, head_dim: int) -> float:
    """The factor the attention applies to q·k for the captured q (llama and gemma3 graphs).

    gemma3 multiplies Qcur by hparams.f_attention_scale after naming it and attends with kq_scale 1
    (src/models/gemma3.cpp): 1/sqrt(n_embd/n_head) for the 27B (62 layers), else 1/sqrt(head_dim). llama uses
    <arch>.attention.scale when set, else 1/sqrt(head_dim)."""
    if arch == "gemma3":
        return 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_dim)
    raw = _meta_str(lc, model, f"{arch}.attention.scale")
    if raw is not None and float(raw) != 0.0:
        return float(raw)
    return 1.0 / math.sqrt(head_dim)


def _tokenize(lc: Any, model: Any, text: str, n_tokens: int, add_special: bool) -> list[int]:
    """The first n_tokens tokens of text. Only a prefix is tokenized (grown until it is long enough, with a margin
    so that no token near the cut depends on where the prefix ends), which keeps the result deterministic."""
    vocab = lc.llama_model_get_vocab(model)
    n_chars = max(256, n_tokens * 6)
    while True:
        data = text[:n_chars].encode("utf-8")
        cap = len(data) + 16
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(vocab, data, len(data), buf, cap, add_special, False)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed ({n})")
        if n >= n_tokens + 64 or n_chars >= len(text):
            break
        n_chars *= 2
    if n < n_tokens:
        raise ValueError(f"the text has only {n} tokens, {n_tokens} requested")
    return list(buf[:n_tokens])


def _resolve_model(model: str | os.PathLike[str]) -> tuple[Path, str]:
    name = str(model)
    if name in MODELS:
        return fetch(name, quiet=True), name
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"{model}: neither a known model ({', '.join(MODELS)}) nor a GGUF file")
    return path, path.stem


def _default_threads() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _token_major(arr: np.ndarray, n_ub: int, what: str) -> np.ndarray:
    """An extra tensor as [n_ub, elements per token]: its outermost non-trivial ggml dimension must be the tokens."""
    lead = [d for d in arr.shape if d != 1][:1]
    if n_ub != 1 and lead != [n_ub]:
        raise RuntimeError(f"{what} has shape {arr.shape}: its outermost dimension is not the {n_ub} tokens")
    return arr.reshape(n_ub, -1).astype(np.float32)


def capture(
    model: str | os.PathLike[str],
    source: str | Sequence[int] | None,
    n_tokens: int,
    out_path: str | os.PathLike[str],
    *,
    n_ubatch: int = 512,
    n_threads: int | None = None,
    extra: Sequence[str] = (),
    dtype: str = "float16",
    add_special: bool = True,
    verbose: bool = False,
) -> Path:
    """Run n_tokens tokens through the model and save every layer's q, k (post-RoPE) and v to out_path (.npz).

    model: a known model name (ott_gguf.models.MODELS) or a GGUF path. source: text (tokenized by the model,
    with its BOS when add_special), token ids, or None for corpus.docs_text(). The tokens go through llama_decode
    n_ubatch at a time (n_batch = n_ubatch, so each call is one ubatch). extra: more per-layer tensor names to
    record as float32 [n_tokens, elements per token] (e.g. "kqv_out"): nodes named "<name>-<il>" in every layer
    whose outermost dimension is the ubatch's tokens; the last node of that name in the graph is kept.
    dtype: how q/k/v are stored. "float16" (the default) is what the f16 cache holds for k and v; "float32" keeps
    the graph's exact values (flash attention reads q in f32, k and v after the cache rounds them to f16).
    """
    if n_tokens <= 0 or n_ubatch <= 0:
        raise ValueError("n_tokens and n_ubatch must be positive")
    extra = tuple(extra)
    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be 'float16' or 'float32', got {dtype!r}")
    qkv_dtype = np.dtype(dtype)
    if any(e in QKV for e in extra):
        raise ValueError(f"{QKV} are always captured")
    path, name = _resolve_model(model)
    out = Path(out_path)
    lc = llama_cpp_module().llama_cpp
    g = _ggml()
    from llama_cpp import _logger  # llama-cpp-python's process-wide log filter: quiet unless verbose

    prev_level = _logger.logger.level
    _logger.set_verbose(verbose)
    llm = ctx = batch = None
    try:
        lc.llama_backend_init()
        llm = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not llm:
            raise RuntimeError(f"llama.cpp could not load {path}")
        arch = _meta_str(lc, llm, "general.architecture") or "?"
        n_layer = lc.llama_model_n_layer(llm)
        n_head = lc.llama_model_n_head(llm)
        n_head_kv = lc.llama_model_n_head_kv(llm)
        n_embd = lc.llama_model_n_embd(llm)
        key_length = _meta_str(lc, llm, f"{arch}.attention.key_length")
        head_dim = int(key_length) if key_length else n_embd // n_head
        n_swa = max(0, lc.llama_model_n_swa(llm))
        swa_layers, swa_source = _swa_layers(lc, llm, arch, n_layer, n_swa)
        attn_scale = _attn_scale(lc, llm, arch, n_layer, n_embd, n_head, head_dim)
        if isinstance(source, str) or source is None:
            text = corpus.docs_text() if source is None else source
            tokens = _tokenize(lc, llm, text, n_tokens, add_special)
            source_desc = "llama.cpp docs/**/*.md (corpus.docs_text)" if source is None else "text"
        else:
            tokens = [int(x) for x in source][:n_tokens]
            if len(tokens) < n_tokens:
                raise ValueError(f"{len(tokens)} token ids given, {n_tokens} requested")
            source_desc = "token ids"

        rec = _Recorder(g, n_layer, n_head, n_head_kv, extra)
        cb = lc.ggml_backend_sched_eval_callback(rec)  # referenced until the context is freed
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = -(-max(n_tokens, n_ubatch) // 256) * 256
        cparams.n_batch = cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = n_threads or _default_threads()
        cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.type_k = cparams.type_v = _GGML_TYPE_F16
        cparams.cb_eval = cb
        cparams.cb_eval_user_data = None
        ctx = lc.llama_init_from_model(llm, cparams)
        if not ctx:
            raise RuntimeError("llama_init_from_model failed")

        chunks: dict[tuple[str, int], list[np.ndarray]] = {}
        batch = lc.llama_batch_init(n_ubatch, 0, 1)
        for start in range(0, n_tokens, n_ubatch):
            ub = tokens[start : start + n_ubatch]
            batch.n_tokens = len(ub)
            for i, tok in enumerate(ub):
                batch.token[i] = tok
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(ub) - 1  # logits are not used: one output keeps that part minimal
            rec.n_ub = len(ub)
            rec.got.clear()
            rec.ub_ops.clear()
            rc = lc.llama_decode(ctx, batch)
            if rec.error is not None:
                raise RuntimeError(f"eval callback failed at token {start}") from rec.error
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} at token {start}")
            for il in range(n_layer):
                for base in (*QKV, *extra):
                    got = rec.got.get((base, il))
                    if got is None:
                        raise RuntimeError(
                            f"no {base}-{il} tensor of the expected shape in the {arch} graph "
                            f"(ubatch at token {start}, {len(ub)} tokens)"
                        )
                    arr, is_view = got
                    # with one token the 2-d projection can pass for the 3-d tensor (same data, other op)
                    if len(ub) > 1 or base not in rec.ops:
                        rec.ops[base] = rec.ub_ops[base]
                    if not is_view and len(ub) > 1:
                        rec.computed.add(base)
                    if base in QKV:
                        arr = arr.reshape(arr.shape[-3:]).astype(qkv_dtype)  # [n_ub, heads, head_dim]
                    else:
                        arr = _token_major(arr, len(ub), f"{base}-{il}")
                    chunks.setdefault((base, il), []).append(arr)
    finally:
        if batch is not None:
            lc.llama_batch_free(batch)
        if ctx:
            lc.llama_free(ctx)
        if llm:
            lc.llama_model_free(llm)
        _logger.logger.setLevel(prev_level)

    arrays: dict[str, np.ndarray] = {}
    for (base, il), parts in chunks.items():
        arrays[f"{_KEY.get(base, base)}{il}"] = np.concatenate(parts, axis=0)
        parts.clear()
    if arrays["q0"].shape[-1] != head_dim or arrays["k0"].shape[-1] != head_dim:
        raise RuntimeError(f"captured head dim {arrays['q0'].shape[-1]} != model's {head_dim}")
    meta: dict[str, Any] = {
        "model": name,
        "model_file": path.name,
        "arch": arch,
        "n_layer": n_layer,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim": head_dim,
        "head_dim_v": int(arrays["v0"].shape[-1]),
        "n_embd": n_embd,
        "n_tokens": n_tokens,
        "n_ubatch": n_ubatch,
        "dtype": dtype,
        "tokens": np.asarray(tokens, dtype=np.int32),
        "n_swa": n_swa,
        "swa_layers": np.asarray(swa_layers, dtype=np.int32),
        "swa_source": swa_source,
        "attn_scale": np.float64(attn_scale),
        "source": source_desc,
        "source_ops": " ".join(f"{b}={rec.ops.get(b, '?')}" for b in (*QKV, *extra)),
        "extra": " ".join(extra),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")  # savez appends .npz to names without it
    try:
        np.savez_compressed(tmp, **arrays, **{f"meta_{k}": np.asarray(v) for k, v in meta.items()})
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


_META_INT = ("n_layer", "n_head", "n_head_kv", "head_dim", "head_dim_v", "n_embd", "n_tokens", "n_ubatch", "n_swa")
_META_STR = ("model", "model_file", "arch", "dtype", "swa_source", "source", "source_ops", "extra")


def read_meta(npz: str | os.PathLike[str] | Any) -> dict[str, Any]:
    """The metadata of a capture (a path or an open np.load result) as Python values.

    model, model_file, arch, n_layer, n_head, n_head_kv, head_dim, head_dim_v, n_embd, n_tokens, n_ubatch,
    dtype (of q/k/v), tokens (int32 array), n_swa (the sliding window; 0: none), swa_layers (list of the
    sliding-window layers), swa_source ("gguf", "llama.cpp default for <arch>", "none" or "unknown"), attn_scale
    (the factor on q·k for the captured q), source (of the tokens), source_ops (the ggml op of each kept tensor),
    extra (names of the extra tensors).
    """
    if isinstance(npz, (str, os.PathLike)):
        with np.load(npz) as f:
            return read_meta(f)
    out: dict[str, Any] = {k: int(npz[f"meta_{k}"]) for k in _META_INT}
    out.update({k: str(npz[f"meta_{k}"]) for k in _META_STR})
    out["attn_scale"] = float(npz["meta_attn_scale"])
    out["tokens"] = np.asarray(npz["meta_tokens"])
    out["swa_layers"] = [int(x) for x in npz["meta_swa_layers"]]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m study.capture",
        description="Record a GGUF model's per-layer post-RoPE queries/keys and values on real text (.npz).",
    )
    ap.add_argument("--model", default="smollm2-135m", help=f"{' | '.join(MODELS)} | PATH to a GGUF file")
    ap.add_argument("--tokens", type=int, default=4096, help="number of tokens (default 4096)")
    ap.add_argument("--out", type=Path, required=True, help="output .npz")
    ap.add_argument("--text-file", type=Path, help="UTF-8 text to use instead of the llama.cpp docs corpus")
    ap.add_argument("--ubatch", type=int, default=512, help="tokens per llama_decode / ubatch (default 512)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--extra", action="append", default=[], help="also record <NAME>-<il> (e.g. kqv_out)")
    ap.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="storage of q/k/v")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    args = ap.parse_args(argv)
    text = args.text_file.read_text(encoding="utf-8") if args.text_file else None
    t0 = time.perf_counter()
    out = capture(
        args.model,
        text,
        args.tokens,
        args.out,
        n_ubatch=args.ubatch,
        n_threads=args.threads,
        extra=args.extra,
        dtype=args.dtype,
        verbose=args.verbose,
    )
    dt = time.perf_counter() - t0
    meta = read_meta(out)
    print(
        f"{out}: {meta['model']} ({meta['arch']}), {meta['n_tokens']} tokens, {meta['n_layer']} layers, "
        f"q {meta['n_head']}x{meta['head_dim']}, k/v {meta['n_head_kv']}x{meta['head_dim']}, "
        f"sliding-window layers {meta['swa_layers'] or 'none'}; {out.stat().st_size / 2**20:.1f} MiB in {dt:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
