"""ott-gguf: 2-bit KV caches with outlier token tracing for GGUF models, on a patched llama.cpp."""

from __future__ import annotations

from ._lib import NativeLibraryError, build_info, llama_ott_build_info, loaded_library_path
from .kv_types import KV_TYPES, OTT_KV_TYPES, resolve_kv_type
from .llama import Llama

__version__ = "0.1.0"

__all__ = [
    "KV_TYPES",
    "OTT_KV_TYPES",
    "Llama",
    "NativeLibraryError",
    "__version__",
    "build_info",
    "llama_ott_build_info",
    "loaded_library_path",
    "resolve_kv_type",
]
