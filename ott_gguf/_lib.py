"""Locate ott-gguf's patched llama.cpp build and make llama-cpp-python load it.

llama-cpp-python is installed without its own native build; it loads libllama from LLAMA_CPP_LIB_PATH,
which this module points at the libraries installed inside this package, before llama_cpp is imported.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from functools import cache
from pathlib import Path

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
            "Import ott_gguf before llama_cpp, or set LLAMA_CPP_LIB_PATH to that directory."
        )
    return llama_cpp


def loaded_library_path() -> str:
    """File name of the libllama that llama_cpp loaded."""
    return str(llama_cpp_module().llama_cpp._lib._name)


def llama_ott_build_info() -> str:
    fn = llama_cpp_module().llama_cpp._lib.llama_ott_build_info
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    return fn().decode()


# native/patches/0001-ggml-ott2-type.patch appends GGML_TYPE_OTT2 = 43 (GGML_TYPE_COUNT becomes 44)
GGML_TYPE_OTT2 = 43


@cache
def ggml_type_ids() -> dict[str, int]:
    """Every ggml type name of the loaded build -> its id, read from the library itself."""
    lib = llama_cpp_module().llama_cpp._lib  # dlsym on it also finds libggml-base's symbols
    fn = lib.ggml_type_name
    fn.restype = ctypes.c_char_p
    fn.argtypes = [ctypes.c_int]
    out: dict[str, int] = {}
    for i in range(GGML_TYPE_OTT2 + 1):  # ggml_type_name does not range-check in release builds
        raw = fn(i)
        name = raw.decode() if raw else ""
        if name and name != "DEPRECATED":
            out[name] = i
    if out.get("ott2") != GGML_TYPE_OTT2:
        raise NativeLibraryError(f"the loaded ggml has no ott2 type at id {GGML_TYPE_OTT2}: not ott-gguf's build")
    return out


# --- ott2 entry points of the patched libllama (native/include/llama-ott.h) ---------------------------------


def _fn(name: str, restype: object, argtypes: list[object]):  # -> ctypes function
    f = getattr(llama_cpp_module().llama_cpp._lib, name)
    f.restype = restype
    f.argtypes = argtypes
    return f


def ott_set_params(G: int, R: int, outlier_num: int, aux_cap: int, no_outlier_layers: int) -> None:
    """Parameters for the ott2 caches created from now on in this process."""
    _fn("llama_ott_set_params", None, [ctypes.c_int32] * 5)(G, R, outlier_num, aux_cap, no_outlier_layers)


def ott_get_params() -> tuple[int, ...]:
    out = (ctypes.c_int32 * 5)()
    _fn("llama_ott_get_params", None, [ctypes.POINTER(ctypes.c_int32)])(out)
    return tuple(out)


OTT_CACHE_INFO_FIELDS = ("positions", "sealed", "quantized_bytes", "tail_bytes", "pool_bytes", "outlier_slots",
                         "aux_slots", "window_bytes", "layers")  # fmt: skip


def ott_cache_info(ctx: object) -> dict[str, int] | None:
    """What a context's ott2 cache holds (see llama_ott_cache_info in native/include/llama-ott.h), or None when
    the context has no ott2 cache."""
    k = len(OTT_CACHE_INFO_FIELDS)
    out = (ctypes.c_int64 * k)()
    n = _fn("llama_ott_cache_info", ctypes.c_int32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int32])(
        ctx, out, k
    )
    return dict(zip(OTT_CACHE_INFO_FIELDS, (int(v) for v in out), strict=True)) if n == k else None


def ott_model_problem(model_path: str) -> str:
    """Why the ott2 cache cannot serve the model at model_path ("" when it can)."""
    lc = llama_cpp_module().llama_cpp
    params = lc.llama_model_default_params()
    params.vocab_only = True  # the architecture and hparams are read before the tensors: no weights needed
    quiet = lc.llama_progress_callback(lambda progress, user_data: True)  # no progress dots on stderr
    params.progress_callback = quiet
    model = lc.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise ValueError(f"could not load the model {model_path}")
    try:
        buf = ctypes.create_string_buffer(512)
        ok = _fn("llama_ott_supports_model", ctypes.c_bool, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t])(
            model, buf, len(buf)
        )
        return "" if ok else buf.value.decode()
    finally:
        lc.llama_model_free(model)
