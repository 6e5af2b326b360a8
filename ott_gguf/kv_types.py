"""K/V cache type names (no native library needed to import this)."""

from __future__ import annotations

# K/V cache types the pinned llama.cpp accepts (common/arg.cpp kv_cache_types, less f32)
KV_TYPES: tuple[str, ...] = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# the OTT caches of this project; selectable once the ott2 memory module exists
OTT_KV_TYPES: tuple[str, ...] = ("ott2", "kivi2")


def resolve_kv_type(kv_type: object) -> str:
    """Validate a kv_type name; raise ValueError (unknown) or NotImplementedError (not available yet)."""
    if not isinstance(kv_type, str):
        raise ValueError(f"kv_type must be a string, one of {', '.join(KV_TYPES)}; got {kv_type!r}")
    name = kv_type.strip().lower()
    if name in KV_TYPES:
        return name
    if name in OTT_KV_TYPES:
        raise NotImplementedError(
            f"kv_type={kv_type!r}: the OTT KV cache is not in this build yet (the ott2 memory module is still "
            f"being written); nothing was loaded. Use one of {', '.join(KV_TYPES)} for now."
        )
    raise ValueError(f"unknown kv_type {kv_type!r}; valid choices: {', '.join(KV_TYPES)}")
