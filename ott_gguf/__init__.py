"""ott-gguf: 2-, 3- and 4-bit KV caches with outlier token tracing for GGUF models, on a patched llama.cpp.

The names that need the native build (Llama, build information) load it on first use, so the pure-Python
parts (quantizer, reference, models, kv_types) import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .kv_types import (
    KV_TYPES,
    OTT_KV_TYPES,
    OttConfig,
    kv_pair_name,
    resolve_kv_pair,
    resolve_kv_type,
    resolve_kv_types,
)

if TYPE_CHECKING:
    from ._lib import NativeLibraryError, build_info, llama_ott_build_info, loaded_library_path
    from .llama import Llama

__version__ = "0.1.0"

# the ggml type ids of the ott caches, for llama_cpp.Llama(type_k=..., type_v=...) (read from the loaded build)
_TYPE_IDS = {f"GGML_TYPE_{name.upper()}": name for name in OTT_KV_TYPES}

_LAZY = {
    "Llama": ".llama",
    "NativeLibraryError": "._lib",
    "build_info": "._lib",
    "llama_ott_build_info": "._lib",
    "loaded_library_path": "._lib",
}

__all__ = [
    "GGML_TYPE_KIVI2",
    "GGML_TYPE_KIVI3",
    "GGML_TYPE_KIVI4",
    "GGML_TYPE_OTT2",
    "GGML_TYPE_OTT3",
    "GGML_TYPE_OTT4",
    "KV_TYPES",
    "OTT_KV_TYPES",
    "Llama",
    "OttConfig",
    "NativeLibraryError",
    "__version__",
    "build_info",
    "llama_ott_build_info",
    "kv_pair_name",
    "loaded_library_path",
    "resolve_kv_pair",
    "resolve_kv_type",
    "resolve_kv_types",
]


def __getattr__(name: str) -> Any:
    if name in _TYPE_IDS:
        from ._lib import ott_kv_type_ids

        return ott_kv_type_ids()[_TYPE_IDS[name]]
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'ott_gguf' has no attribute {name!r}")
