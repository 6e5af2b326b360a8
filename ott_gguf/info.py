"""What a GGUF model's K/V cache costs per cache type, measured from what llama.cpp allocates.

`ott-gguf info MODEL` prints the attention shape from the GGUF metadata, whether the ott caches support the
model, and per K/V type (or "K/V" pair, such as "ott3/ott2") the bytes per token and fixed bytes of the cache and
the longest context that fits a memory budget.

The bytes come from the caches themselves: a context is created at two sizes and what each cache allocated
(`llama_ott_kv_cache_bytes`: the memory module's own breakdown, for any cache type) gives a line: slope = bytes
per token, intercept = fixed part (ott2's fp16 tail ring and outlier pools). The ott caches (ott*, kivi*) also
report their bytes by part (`llama_ott_cache_info`, as `Llama.kv_cache_info`). For the stock types the closed
form from ggml's type sizes is printed beside the measurement as a check.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import _lib
from .kv_types import OTT_KV_TYPES, OttConfig, is_ott_kv_type, kv_pair_name, resolve_kv_type, resolve_kv_types

__all__ = [
    "INFO_KV_TYPES",
    "KvBytes",
    "ModelInfo",
    "captured_log",
    "formula_bytes_per_token",
    "measure_kv_bytes",
    "model_info",
    "require_ott_support",
]

INFO_KV_TYPES: tuple[str, ...] = ("f16", "q8_0", "q4_0", "kivi2", "ott2")
MEASURE_CTX: tuple[int, int] = (2048, 8192)  # multiples of ott2's group (128): its allocation is linear there
CTX_STEP = 256  # the longest context is rounded down to this (a multiple of ott2's group of 128)
MIB = 1 << 20


_LOG_LOCK = threading.Lock()
# thread id -> the line lists of its open captures (innermost last)
_CAPTURES: dict[int, list[list[str]]] = {}
# the one log callback this module installs, with the one it forwards to: installed once and never freed, since
# llama.cpp may be inside a call to it on another thread at any time (a callback swapped in per capture and freed
# after it crashed two threads creating ott Llama objects at once: one was still logging through the other's)
_DISPATCH: list[object] = []


def _dispatcher() -> None:
    lc = _lib.llama_cpp_module().llama_cpp
    with _LOG_LOCK:
        if _DISPATCH:
            return
        old_cb = lc.llama_log_callback()
        old_ud = ctypes.c_void_p()
        lc.llama_log_get(ctypes.byref(old_cb), ctypes.byref(old_ud))

        @lc.llama_log_callback
        def dispatch(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            stack = _CAPTURES.get(threading.get_ident())
            if stack:
                stack[-1].append(text.decode("utf-8", errors="replace"))
            elif old_cb:
                old_cb(level, text, old_ud)

        _DISPATCH.extend([dispatch, old_cb, old_ud])
        lc.llama_log_set(dispatch, ctypes.c_void_p(0))


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """Collect the llama.cpp/ggml log text this thread produces (instead of printing it) while the block runs; other
    threads' lines go where they went before (llama-cpp-python's logger). The logger is one per process: one
    dispatching callback is installed once and routes each line by the thread that logs it."""
    _dispatcher()
    lines: list[str] = []
    tid = threading.get_ident()
    with _LOG_LOCK:
        _CAPTURES.setdefault(tid, []).append(lines)
    try:
        yield lines
    finally:
        with _LOG_LOCK:
            stack = _CAPTURES[tid]
            del stack[max(i for i, x in enumerate(stack) if x is lines)]  # by identity: equal lists are not it
            if not stack:
                del _CAPTURES[tid]


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    architecture: str
    n_layer: int
    n_head: int
    n_head_kv: int | None  # None when the GGUF gives a per-layer array
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int | None
    sliding_window: int | None
    ott2_problem: str  # "" when the ott2 cache supports the model


def _int(meta: dict[str, str], key: str) -> int | None:
    try:
        return int(meta[key])
    except (KeyError, ValueError):
        return None


def model_info(path: str | Path) -> ModelInfo:
    """The attention shape from the GGUF metadata (a vocab-only load: no weights, no cache)."""
    from .llama import Llama

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    with captured_log():
        problem = _lib.ott_model_problem(str(path))  # raises ValueError on a file llama.cpp cannot load
        llm = Llama(str(path), vocab_only=True, verbose=False)
        meta = dict(llm.metadata)
        llm.close()
    arch = meta.get("general.architecture", "?")
    n_layer = _int(meta, f"{arch}.block_count") or 0
    n_head = _int(meta, f"{arch}.attention.head_count") or 0
    n_embd = _int(meta, f"{arch}.embedding_length") or 0
    dk = _int(meta, f"{arch}.attention.key_length") or (n_embd // n_head if n_head else 0)
    dv = _int(meta, f"{arch}.attention.value_length") or dk
    kv_key = f"{arch}.attention.head_count_kv"
    return ModelInfo(
        path=path,
        architecture=arch,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=_int(meta, kv_key) if kv_key in meta else n_head,  # absent: llama.cpp's default, n_head
        head_dim_k=dk,
        head_dim_v=dv,
        n_ctx_train=_int(meta, f"{arch}.context_length"),
        sliding_window=_int(meta, f"{arch}.attention.sliding_window"),
        ott2_problem=problem,
    )


def require_ott_support(path: str | Path, kv_types: Sequence[str]) -> None:
    """Raise ValueError naming the reason when an ott type (ott*, kivi*) is among kv_types and cannot serve the
    model."""
    ott = [t for t in kv_types if is_ott_kv_type(t)]
    if ott:
        problem = _lib.ott_model_problem(str(path))
        if problem:
            raise ValueError(f"{', '.join(ott)} cannot be used with {Path(path).name}: {problem}")


@dataclass(frozen=True)
class KvBytes:
    """One cache type's allocation as a line in the context length: fixed + per_token * n_ctx bytes."""

    kv_type: str  # "ott2", or "ott3/ott2" for K/V types that differ
    per_token: float
    fixed: float
    measured: tuple[tuple[int, float], ...]  # (n_ctx, bytes) as the cache reported them
    parts: dict[str, float]  # ott2: bytes of quantized / fp16 tail / pools at the larger n_ctx

    def at(self, n_ctx: int) -> float:
        return self.fixed + self.per_token * n_ctx

    def longest_context(self, budget_bytes: float) -> int:
        """The longest n_ctx (a multiple of CTX_STEP) whose cache fits budget_bytes; 0 when none does."""
        if self.per_token <= 0 or budget_bytes < self.fixed:
            return 0
        return int((budget_bytes - self.fixed) / self.per_token) // CTX_STEP * CTX_STEP


def _allocated_bytes(path: Path, kv_type: str, n_ctx: int, ott_config: OttConfig | None = None,
                     swa_full: bool | None = False) -> tuple[float, dict[str, float]]:  # fmt: skip
    """Bytes the cache of kv_type (a name or "K/V") allocates for n_ctx, and for the ott caches the bytes by
    part. swa_full: False, window layers keep only their window, as llama.cpp's tools do by default; None,
    llama-cpp-python's default (True: window layers as large as the others)."""
    from .llama import Llama

    # the default batch of Llama and of llama.cpp's tools (512): a sliding-window model's window layers hold the
    # window plus one ubatch, so a smaller batch would measure a smaller cache than the tools allocate
    swa = {} if swa_full is None else {"swa_full": swa_full}
    llm = Llama(str(path), kv_type=kv_type, ott_config=ott_config, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                verbose=False, **swa)  # fmt: skip
    try:
        parts: dict[str, float] = {}
        if is_ott_kv_type(kv_type):
            # the cache's own account by part, a sliding-window model's f16 window layers included
            info = llm.kv_cache_info()
            parts = {name: float(b) for name, b in info["bytes"].items()}  # type: ignore[attr-defined]
        return float(_lib.kv_cache_bytes(llm._ctx.ctx)), parts
    finally:
        llm.close()


def measure_kv_bytes(path: str | Path, kv_types: Sequence[str] = INFO_KV_TYPES,
                     n_ctx: tuple[int, int] = MEASURE_CTX,
                     tiers: dict[str, tuple[str, OttConfig]] | None = None,
                     swa_full: bool | None = False) -> list[KvBytes]:  # fmt: skip
    """Bytes per token and fixed bytes of each type's cache, from contexts created at the two sizes n_ctx; an entry
    of kv_types that `tiers` names is its K/V pair with its configuration, under that label. swa_full: a
    sliding-window model's window layers as llama.cpp's tools allocate them (False, the default: the window only)
    or as ott_gguf.Llama does (None: llama-cpp-python's default, full size)."""
    path = Path(path)
    small, large = n_ctx
    if not 0 < small < large:
        raise ValueError(f"need two increasing context sizes, got {n_ctx}")
    tiers = tiers or {}
    out = []
    for t in (t if t in tiers else kv_pair_name(*resolve_kv_types(t)) for t in kv_types):
        pair, cfg = tiers.get(t, (t, None))
        b_small, _ = _allocated_bytes(path, pair, small, cfg, swa_full)
        b_large, parts = _allocated_bytes(path, pair, large, cfg, swa_full)
        slope = (b_large - b_small) / (large - small)
        out.append(KvBytes(t, slope, b_small - slope * small, ((small, b_small), (large, b_large)), parts))
    return out


def ggml_type_size(kv_type: str) -> float:
    """Bytes per element of a stock ggml type: bytes per block / elements per block."""
    return _lib.type_bytes(resolve_kv_type(kv_type), 1)


def formula_bytes_per_token(info: ModelInfo, kv_type: str) -> float | None:
    """n_layer x n_head_kv x (head_dim_k x K bytes per element + head_dim_v x V bytes per element), kv_type a
    name or "K/V"; None for the ott caches, per-layer head counts and sliding-window models (their window layers
    hold only the window, and which layers those are is the architecture's, not the GGUF's)."""
    k, v = resolve_kv_types(kv_type)
    if k in OTT_KV_TYPES or info.n_head_kv is None or info.sliding_window:
        return None
    return info.n_layer * info.n_head_kv * (info.head_dim_k * ggml_type_size(k) + info.head_dim_v * ggml_type_size(v))
