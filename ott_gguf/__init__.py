"""ott-gguf: 2-bit KV caches with outlier token tracing for GGUF models, on a patched llama.cpp.

The names that need the native build (Llama, build information) load it on first use, so the pure-Python
parts (quantizer, reference, models, kv_types) import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .kv_types import KV_TYPES, OTT_KV_TYPES, OttConfig, resolve_kv_type

if TYPE_CHECKING:
    from ._lib import NativeLibraryError, build_info, llama_ott_build_info, loaded_library_path
    from .llama import Llama

__version__ = "0.1.0"

# the ggml type ids of the ott caches, for llama_cpp.Llama(type_k=..., type_v=...) (read from the loaded build)
_TYPE_IDS = {"GGML_TYPE_OTT2": "ott2", "GGML_TYPE_KIVI2": "kivi2"}

_LAZY = {
    "Llama": ".llama",
    "NativeLibraryError": "._lib",
    "build_info": "._lib",
    "llama_ott_build_info": "._lib",
    "loaded_library_path": "._lib",
}

__all__ = [
    "GGML_TYPE_KIVI2",
    "GGML_TYPE_OTT2",
    "KV_TYPES",
    "OTT_KV_TYPES",
    "Llama",
    "OttConfig",
    "NativeLibraryError",
    "__version__",
    "build_info",
    "llama_ott_build_info",
    "loaded_library_path",
    "resolve_kv_type",
]


def __getattr__(name: str) -> Any:
    if name in _TYPE_IDS:
        from ._lib import ott_kv_type_ids

        return ott_kv_type_ids()[_TYPE_IDS[name]]
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'ott_gguf' has no attribute {name!r}")
