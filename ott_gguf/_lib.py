"""Locate ott-gguf's patched llama.cpp build and make llama-cpp-python load it.

llama-cpp-python is installed without its own native build; it loads libllama from LLAMA_CPP_LIB_PATH,
which this module points at the libraries installed inside this package, before llama_cpp is imported.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from .kv_types import MAX_LAYERS, OttConfig, format_layer_widths, parse_layer_widths

PKG_DIR = Path(__file__).resolve().parent
# OTT_GGUF_NATIVE_DIR: use the native build installed elsewhere (an installed ott_gguf package directory),
# e.g. to run the source tree's Python against the venv's build while developing
NATIVE_DIR = Path(os.environ.get("OTT_GGUF_NATIVE_DIR") or PKG_DIR).resolve()
LIB_DIR = NATIVE_DIR / "lib"
BIN_DIR = NATIVE_DIR / "bin"
_SUFFIX = ".dylib" if sys.platform == "darwin" else ".so"


class NativeLibraryError(ImportError):
    """The patched native build is missing, or a different libllama was loaded."""


def lib_path(name: str) -> Path:
    """Path of an installed shared library, e.g. lib_path('ggml-base')."""
    p = LIB_DIR / f"lib{name}{_SUFFIX}"
    if not p.exists():
        raise NativeLibraryError(
            f"{p} is missing: ott_gguf's native build is not installed. Install the project with "
            "`make install` (or see README.md), which compiles the patched llama.cpp into the package."
        )
    return p


def bin_path(name: str) -> Path:
    p = BIN_DIR / name
    if not p.exists():
        raise NativeLibraryError(f"{p} is missing: reinstall ott-gguf (`make install`)")
    return p


def build_info() -> dict[str, object]:
    """What the native build was made from (written by CMakeLists.txt)."""
    return json.loads((NATIVE_DIR / "ott-build.json").read_text())


@cache
def llama_cpp_module():  # -> module
    """Import llama_cpp bound to our libllama; refuse a stock libllama loaded earlier."""
    ours = lib_path("llama")
    if "llama_cpp" not in sys.modules:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    import llama_cpp
    import llama_cpp.llama_cpp as raw

    if not hasattr(raw._lib, "llama_ott_build_info"):
        loaded = getattr(raw._lib, "_name", "?")
        raise NativeLibraryError(
            f"llama_cpp has loaded a libllama without ott-gguf's patches ({loaded}); ours is {ours}. "
            f"LLAMA_CPP_LIB_PATH={os.environ.get('LLAMA_CPP_LIB_PATH')!r} points elsewhere: unset it (the "
            "installed ott_gguf_llama_cpp.pth then selects this build) or set it to that directory."
        )
    import logging

    from llama_cpp import _logger

    # llama-cpp-python 0.3.36 maps ggml's log levels by an older enum (INFO=1, WARN=2, ERROR=3), so llama.cpp's
    # warnings (level 3) pass its verbose=False filter as errors, e.g. Gemma 3's "control-looking token" line;
    # ggml.h today: DEBUG=1, INFO=2, WARN=3, ERROR=4 (the callback reads this table on every line)
    _logger.GGML_LOG_LEVEL_TO_LOGGING_LEVEL.update(
        {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
    )
    return llama_cpp


def loaded_library_path() -> str:
    """File name of the libllama that llama_cpp loaded."""
    return str(llama_cpp_module().llama_cpp._lib._name)


# --- the entry points of the patched libllama that llama-cpp-python does not bind (native/include/llama-ott.h),
# declared once, on first use ------------------------------------------------------------------------------------


class LlamaOttConfig(ctypes.Structure):
    """struct llama_ott_config: int32 fields (v_rotate, v_sym 0 or 1, k_mix 0, 1 or 2), then layer_widths, one byte
    per layer
    (0: the K/V types' widths, else K bits * 16 + V bits)."""

    _fields_ = [(name, ctypes.c_int32) for name in OttConfig.NATIVE_FIELDS] + [
        ("layer_widths", ctypes.c_uint8 * MAX_LAYERS)
    ]

    @classmethod
    def of(cls, cfg: OttConfig) -> LlamaOttConfig:
        c = cls(*cfg.native())
        for il, (k, v) in parse_layer_widths(cfg.layer_widths).items():
            c.layer_widths[il] = k * 16 + v
        return c

    def to_config(self) -> OttConfig:
        """The OttConfig of these values (v_rotate, v_sym as bools, k_mix as a bool for 0 and 1; Gv: the build's)."""
        values: dict[str, Any] = {name: int(getattr(self, name)) for name in OttConfig.NATIVE_FIELDS}
        values["v_rotate"] = bool(values["v_rotate"])
        values["k_mix"] = bool(values["k_mix"]) if values["k_mix"] in (0, 1) else values["k_mix"]
        values["v_sym"] = bool(values["v_sym"])
        widths = {il: (w >> 4, w & 15) for il, w in enumerate(self.layer_widths) if w}
        return OttConfig(**values, Gv=int(str(build_info()["ott2_group"])), layer_widths=format_layer_widths(widths))


_PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "llama_ott_build_info": (ctypes.c_char_p, []),
    "llama_ott_config_default": (LlamaOttConfig, []),
    "llama_ott_config_check": (ctypes.c_bool, [ctypes.POINTER(LlamaOttConfig), ctypes.c_char_p, ctypes.c_size_t]),
    "llama_ott_config_set_layer_widths": (
        ctypes.c_bool,
        [ctypes.POINTER(LlamaOttConfig), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t],
    ),
    "llama_ott_set_thread_config": (None, [ctypes.POINTER(LlamaOttConfig)]),
    "llama_ott_kv_types": (ctypes.c_int32, [ctypes.POINTER(ctypes.c_int), ctypes.c_int32]),
    "llama_ott_supports_model": (ctypes.c_bool, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]),
    "llama_ott_context_config": (ctypes.c_bool, [ctypes.c_void_p, ctypes.POINTER(LlamaOttConfig)]),
    "llama_ott_cache_info": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int32]),
    "llama_ott_kv_cache_bytes": (ctypes.c_int64, [ctypes.c_void_p]),
    "llama_ott_cache_layers": (ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
    "llama_ott_last_error": (ctypes.c_char_p, []),
    # ggml-base's, reached through libllama (dlsym follows its dependencies)
    "ggml_type_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ggml_type_size": (ctypes.c_size_t, [ctypes.c_int]),
    "ggml_blck_size": (ctypes.c_int64, [ctypes.c_int]),
}


@cache
def native() -> ctypes.CDLL:
    """The loaded libllama with the prototypes above declared."""
    lib = llama_cpp_module().llama_cpp._lib
    for name, (restype, argtypes) in _PROTOTYPES.items():
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes
    return lib


def llama_ott_build_info() -> str:
    return native().llama_ott_build_info().decode()


@cache
def ott_kv_type_ids() -> dict[str, int]:
    """The ott cache types of the loaded build (name -> ggml type id), as its C table lists them."""
    lib = native()
    n = lib.llama_ott_kv_types(None, 0)
    ids = (ctypes.c_int * n)()
    lib.llama_ott_kv_types(ids, n)
    return {lib.ggml_type_name(t).decode(): int(t) for t in ids}


@cache
def ggml_type_ids() -> dict[str, int]:
    """Every ggml type name of the loaded build -> its id, read from the library itself."""
    lib = native()
    ott = ott_kv_type_ids()
    out: dict[str, int] = {}
    for i in range(max(ott.values()) + 1):  # the ott ids close ggml's type enum (patch 0001)
        raw = lib.ggml_type_name(i)
        name = raw.decode() if raw else ""
        if name and name != "DEPRECATED":
            out[name] = i
    return out


def type_bytes(name: str, n: int) -> float:
    """Bytes of n values of a stock ggml type (ggml_row_size: blocks of blck_size values)."""
    lib = native()
    t = ggml_type_ids()[name]
    return n * lib.ggml_type_size(t) / lib.ggml_blck_size(t)


def config_problem(cfg: OttConfig) -> str:
    """Why this build's ott caches refuse cfg ("" when they accept it)."""
    buf = ctypes.create_string_buffer(256)
    ok = native().llama_ott_config_check(ctypes.byref(LlamaOttConfig.of(cfg)), buf, len(buf))
    return "" if ok else buf.value.decode()


@contextmanager
def thread_config(cfg: OttConfig) -> Iterator[None]:
    """The configuration of the ott caches that llama_init_from_model creates on this thread inside the block."""
    lib = native()
    lib.llama_ott_set_thread_config(ctypes.byref(LlamaOttConfig.of(cfg)))
    try:
        yield
    finally:
        lib.llama_ott_set_thread_config(None)


def context_config(ctx: object) -> OttConfig | None:
    """The configuration a context's ott cache runs (kivi types: no outliers), or None without one."""
    out = LlamaOttConfig()
    if not native().llama_ott_context_config(ctx, ctypes.byref(out)):
        return None
    return out.to_config()


OTT_CACHE_INFO_FIELDS = ("positions", "sealed", "quantized_bytes", "tail_bytes", "pool_bytes", "outlier_slots",
                         "aux_slots", "window_bytes", "layers")  # fmt: skip


def ott_cache_info(ctx: object) -> dict[str, int] | None:
    """What a context's ott cache holds (see llama_ott_cache_info in native/include/llama-ott.h), or None when
    the context has no ott cache."""
    k = len(OTT_CACHE_INFO_FIELDS)
    out = (ctypes.c_int64 * k)()
    n = native().llama_ott_cache_info(ctx, out, k)
    return dict(zip(OTT_CACHE_INFO_FIELDS, (int(v) for v in out), strict=True)) if n == k else None


def ott_cache_layers(ctx: object) -> list[int]:
    """The model layers a context's ott cache serves, ascending ([] without one)."""
    out = (ctypes.c_int32 * MAX_LAYERS)()
    n = native().llama_ott_cache_layers(ctx, out, MAX_LAYERS)
    return [int(out[i]) for i in range(min(n, MAX_LAYERS))]


def last_error() -> str:
    """Why the last state load on this thread was refused by an ott cache ("" when it was not)."""
    return (native().llama_ott_last_error() or b"").decode()


def kv_cache_bytes(ctx: object) -> int:
    """Bytes a context's K/V cache allocated, for any cache type (llama_ott_kv_cache_bytes)."""
    return int(native().llama_ott_kv_cache_bytes(ctx))


def ott_model_problem(model_path: str) -> str:
    """Why the ott caches cannot serve the model at model_path ("" when they can)."""
    from .info import captured_log

    lc = llama_cpp_module().llama_cpp
    if not os.path.exists(model_path):
        raise ValueError(f"Model path does not exist: {model_path}")  # llama_cpp.Llama's words
    params = lc.llama_model_default_params()
    params.vocab_only = True  # the architecture and hparams are read before the tensors: no weights needed
    quiet = lc.llama_progress_callback(lambda progress, user_data: True)  # no progress dots on stderr
    params.progress_callback = quiet
    with captured_log() as lines:
        model = lc.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise ValueError(f"could not load the model {model_path}: {load_failure_reason(lines)}")
    try:
        buf = ctypes.create_string_buffer(512)
        ok = native().llama_ott_supports_model(model, buf, len(buf))
        return "" if ok else buf.value.decode()
    finally:
        lc.llama_model_free(model)


def load_failure_reason(log_lines: list[str]) -> str:
    """Why llama.cpp failed to load a model, from its log: the GGUF reader's complaint (a file that is not a GGUF)
    or the loader's (a truncated file: tensor data past the end), without the function names."""
    errors = [ln.strip() for ln in log_lines if ("error" in ln or "invalid" in ln or "failed" in ln)]
    errors = [ln for ln in errors if not ln.endswith("failed to load model")]  # the generic last line
    gguf = [ln for ln in errors if ln.startswith("gguf_")]
    pick = gguf[0] if gguf else errors[0] if errors else ""
    pick = pick.split(": ", 1)[1] if ": " in pick else pick  # "func: text" -> "text"
    pick = pick.removeprefix("error loading model: ")
    return pick or "llama.cpp gave no reason (run with verbose=True to see its log)"


def gpu_devices() -> list[str]:
    """The GPU devices llama.cpp's backends found ("Vulkan0: NVIDIA H100 ..."): where n_gpu_layers offloads to.
    Empty on a CPU-only build or machine (llama.cpp then runs every layer on the CPU and only logs a warning)."""
    llama_cpp_module()  # libllama brings libggml and registers the backends built in
    ggml = ctypes.CDLL(str(lib_path("ggml")))
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_type.restype = ctypes.c_int
    for fn in (ggml.ggml_backend_dev_name, ggml.ggml_backend_dev_description):
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_char_p
    gpu_types = (1, 2)  # enum ggml_backend_dev_type: GPU, IGPU
    out = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        if ggml.ggml_backend_dev_type(dev) in gpu_types:
            out.append(f"{ggml.ggml_backend_dev_name(dev).decode()}: {ggml.ggml_backend_dev_description(dev).decode()}")
    return out
