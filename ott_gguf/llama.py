"""`ott_gguf.Llama`: llama-cpp-python's Llama with a `kv_type` keyword, on ott-gguf's patched llama.cpp."""

from __future__ import annotations

import inspect
from typing import Any

from ._lib import ggml_type_ids, llama_cpp_module
from .kv_types import KV_TYPES, OTT_KV_TYPES, resolve_kv_type

__all__ = ["KV_TYPES", "OTT_KV_TYPES", "Llama", "resolve_kv_type"]

_llama_cpp = llama_cpp_module()

# types llama.cpp can only store with flash attention (quantized V rows)
_NEEDS_FLASH_ATTN = frozenset(t for t in KV_TYPES if t not in ("f16", "bf16"))
_STOCK_PARAMS = frozenset(
    name
    for name, p in inspect.signature(_llama_cpp.Llama.__init__).parameters.items()
    if p.kind is not inspect.Parameter.VAR_KEYWORD and name != "self"
)


class Llama(_llama_cpp.Llama):  # type: ignore[misc, name-defined]
    """A llama_cpp.Llama whose K/V cache type is chosen by name.

    Llama(model_path, kv_type="q8_0", n_ctx=4096, ...) takes every keyword of llama_cpp.Llama except
    type_k/type_v (kv_type replaces them); unknown keywords raise TypeError instead of being ignored.
    Quantized cache types need flash attention, which is switched on for them (and by default for all).
    """

    def __init__(self, model_path: str, *, kv_type: str = "f16", **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _STOCK_PARAMS)
        if unknown:
            raise TypeError(f"Llama() got unexpected keyword argument(s): {', '.join(unknown)}")
        if "type_k" in kwargs or "type_v" in kwargs:
            raise ValueError("pass kv_type='<name>' instead of type_k/type_v; valid: " + ", ".join(KV_TYPES))
        name = resolve_kv_type(kv_type)
        flash_attn = kwargs.pop("flash_attn", None)
        if flash_attn is False and name in _NEEDS_FLASH_ATTN:
            raise ValueError(
                f"kv_type={name!r} stores quantized V rows, which llama.cpp supports only with flash attention; "
                "leave flash_attn at its default (on)"
            )
        type_id = ggml_type_ids()[name]
        self.kv_type = name
        super().__init__(
            model_path=model_path,
            type_k=type_id,
            type_v=type_id,
            flash_attn=True if flash_attn is None else bool(flash_attn),
            **kwargs,
        )

    def close(self) -> None:
        # __init__ may have refused the arguments before the stock class set anything up
        if "_stack" in self.__dict__:
            super().close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state.pop("type_k", None)
        state.pop("type_v", None)
        state["kv_type"] = self.kv_type
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.__init__(**state)
