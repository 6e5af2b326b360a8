"""`ott_gguf.Llama`: llama-cpp-python's Llama with a `kv_type` keyword, on ott-gguf's patched llama.cpp."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _lib
from .kv_types import (
    KV_TYPES,
    OTT_KV_TYPES,
    STOCK_KV_TYPES,
    OttConfig,
    kv_pair_name,
    resolve_kv_type,
    resolve_kv_types,
)

__all__ = ["KV_TYPES", "OTT_KV_TYPES", "Llama", "OttConfig", "resolve_kv_type", "resolve_kv_types"]

_llama_cpp = _lib.llama_cpp_module()

# stock types llama.cpp can only store with flash attention (quantized rows); the ott caches run their own
# attention op with flash attention on or off (the same text either way: test_llama.py)
_NEEDS_FLASH_ATTN = frozenset(t for t in STOCK_KV_TYPES if t not in ("f16", "bf16"))
# A GGUF without a chat template gets llama-cpp-python's "llama-2" format, which other families answer with an
# empty string: their own format by architecture, else a clear error when a chat is asked for.
_CHAT_FORMAT_BY_ARCH = {"llama": "llama-2", "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma"}

_STOCK_PARAMS = frozenset(
    name
    for name, p in inspect.signature(_llama_cpp.Llama.__init__).parameters.items()
    if p.kind is not inspect.Parameter.VAR_KEYWORD and name != "self"
)


class Llama(_llama_cpp.Llama):  # type: ignore[misc, name-defined]
    """A llama_cpp.Llama whose K/V cache types are chosen by name.

    Llama(model_path, kv_type="ott2", n_ctx=8192, ...) takes every keyword of llama_cpp.Llama; unknown keywords
    raise TypeError instead of being ignored. kv_type sets both sides ("ott2"; "ott3/ott2" is K/V); type_k and
    type_v (names, or ggml type ids as llama_cpp.Llama takes them) set one side each over it: type_k="ott3",
    type_v="ott2" keeps 3-bit keys and 2-bit values. Both sides must be ott* types or both kivi* types (kivi: the
    same cache without outlier tokens), in any widths; stock types mix freely.
    kv_tier ("compact" or "quality", ott_gguf.tiers, docs/kv-tiers.md) chooses the pair and its configuration by
    name instead, the quality tier with the model's calibration when one is found; it says what it chose in one
    line on stderr (unless verbose=False) and in `kv_tier_line`. It excludes kv_type, type_k, type_v, ott_config.
    Flash attention is on by default; the stock quantized types need it (the ott caches run either way).
    ott_config (OttConfig or dict: G, R, outlier_num, aux_cap, no_outlier_layers, v_rotate, k_mix) tunes the ott
    caches of this Llama only (other Llama objects, in this thread or another, keep theirs). After creation,
    `kv_type` is the pair's name ("ott3/ott2", or "ott2" when both sides agree), `kv_type_k`/`kv_type_v` the sides,
    and `ott_config` the configuration the cache runs, read back from it.
    """

    def __init__(
        self,
        model_path: str,
        *,
        kv_type: str | None = None,
        type_k: str | int | None = None,
        type_v: str | int | None = None,
        ott_config: OttConfig | dict[str, Any] | None = None,
        kv_tier: str | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _STOCK_PARAMS)
        if unknown:
            raise TypeError(f"Llama() got unexpected keyword argument(s): {', '.join(unknown)}")
        self.kv_tier, self.kv_tier_line = kv_tier, ""
        if kv_tier is not None:
            given = [n for n, x in (("kv_type", kv_type), ("type_k", type_k), ("type_v", type_v),
                                    ("ott_config", ott_config)) if x is not None]  # fmt: skip
            if given:
                raise ValueError(f"kv_tier={kv_tier!r} chooses the K/V types and their configuration; "
                                 f"{', '.join(given)} would override it: give kv_tier alone, or the explicit "
                                 "options alone")  # fmt: skip
            from .tiers import resolve_tier

            if not Path(model_path).exists():
                raise ValueError(f"Model path does not exist: {model_path}")
            tier = resolve_tier(kv_tier, model_path)
            kv_type, ott_config, self.kv_tier_line = tier.kv_type, tier.ott_config, tier.line
            if kwargs.get("verbose", True):
                print(tier.line, file=sys.stderr)
        k, v = resolve_kv_types("f16" if kv_type is None else kv_type, type_k, type_v)
        name = kv_pair_name(k, v)
        what = f"kv_type={name!r}" if k == v else f"type_k={k!r}, type_v={v!r}"
        ott = k in OTT_KV_TYPES  # then v is one too (resolve_kv_types)
        flash_attn = kwargs.pop("flash_attn", None)
        if flash_attn is False and (k in _NEEDS_FLASH_ATTN or v in _NEEDS_FLASH_ATTN):
            raise ValueError(
                f"{what} stores quantized K/V rows, which llama.cpp supports only with flash attention; "
                "leave flash_attn at its default (on)"
            )
        if kwargs.get("embedding") and ott:
            # llama-cpp-python embeds up to n_batch texts per decode, one sequence each, sharing n_ctx: the ott
            # cache's per-sequence streams would get a few tokens each, and an embedding pass keeps nothing anyway
            raise ValueError(
                f"{what} with embedding=True: embeddings evaluate each text once and keep nothing in the "
                "K/V cache, so an ott cache saves nothing there; use kv_type='f16' (or 'q8_0') for embeddings"
            )
        if ott_config is not None and not ott:
            raise ValueError(f"ott_config applies to the ott cache types ({', '.join(OTT_KV_TYPES)}), not {name!r}")
        self.kv_type = name
        self.kv_type_k, self.kv_type_v = k, v
        self.ott_config: OttConfig | None = None
        scope: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if ott:
            cfg = OttConfig.of(ott_config)
            self._check_ott_config(cfg)
            # the check loads the model before the stock __init__ applies `verbose` to llama.cpp's log: apply it now
            _llama_cpp._logger.set_verbose(bool(kwargs.get("verbose", True)))
            problem = _lib.ott_model_problem(str(model_path))
            if problem:
                raise ValueError(f"{what} cannot be used with {model_path}: {problem}")
            ids = _lib.ott_kv_type_ids()
            # this context's configuration, on this thread only while the stock __init__ creates the context
            scope = _lib.thread_config(cfg)
        else:
            ids = _lib.ggml_type_ids()
        try:
            with scope:
                super().__init__(
                    model_path=model_path,
                    type_k=ids[k],
                    type_v=ids[v],
                    flash_attn=True if flash_attn is None else bool(flash_attn),
                    **kwargs,
                )
        except ValueError as e:
            if str(e).startswith("Failed to load model from file"):
                # llama-cpp-python hides llama.cpp's log (verbose=False) and keeps none of it: load the file's
                # header again with the log captured, for the reason (not a GGUF, truncated, ...)
                try:
                    _lib.ott_model_problem(str(model_path))
                except ValueError as why:
                    raise ValueError(str(why)) from e
                raise
            # llama-cpp-python says only "Failed to create llama_context": the cache says why
            reason = _lib.last_error() if ott else ""
            if reason:
                raise ValueError(f"{what}: the context could not be created: {reason}") from e
            raise
        if "chat_format" not in kwargs and "chat_handler" not in kwargs:
            self._choose_chat_format()
        if ott:
            # what the cache runs (kivi types: no outliers), read back from it
            self.ott_config = _lib.context_config(self._ctx.ctx)
            if self.ott_config is None:
                raise RuntimeError(f"{what} was requested but the context has no ott cache")

    _chat_note = ""  # said once, at the first chat

    def create_chat_completion(self, *args: Any, **kwargs: Any) -> Any:
        if self._chat_note:
            warnings.warn(self._chat_note, stacklevel=2)
            self._chat_note = ""
        return super().create_chat_completion(*args, **kwargs)

    def _choose_chat_format(self) -> None:
        if "tokenizer.chat_template" in self.metadata or self.chat_format != "llama-2":
            return  # the GGUF's own template, or a format llama-cpp-python recognised
        arch = self.metadata.get("general.architecture", "?")
        fmt = _CHAT_FORMAT_BY_ARCH.get(arch)
        if fmt is not None:
            if fmt != self.chat_format:
                self._chat_note = (
                    f"{Path(self.model_path).name} has no chat template (a base model?): chatting in the "
                    f"{fmt!r} format of its architecture {arch!r}; pass chat_format=... to choose another"
                )
            self.chat_format = fmt
            return

        def refuse(**_: Any) -> Any:
            raise ValueError(
                f"{self.model_path} has no chat template and no known chat format for its architecture {arch!r}: "
                "pass chat_format=... (e.g. 'chatml') or chat_handler=... to Llama(), or use the completion API"
            )

        self.chat_handler = refuse

    @staticmethod
    def _check_ott_config(cfg: OttConfig) -> None:
        """What the native cache cannot take, with the build's own reason."""
        default = OttConfig()
        for field in ("bits", "k_bits", "v_bits"):
            if getattr(cfg, field) != getattr(default, field):
                raise ValueError(
                    f"ott_config.{field}={getattr(cfg, field)!r}: the native cache takes its code widths from the "
                    "K and V types, one per side: choose them with type_k/type_v (e.g. type_k='ott3', "
                    "type_v='ott2'), or kv_type='ott3' for both"
                )
        for field in ("k_rotate", "mean", "identity"):
            if getattr(cfg, field) != getattr(default, field):
                raise ValueError(
                    f"ott_config.{field}={getattr(cfg, field)!r} is a variant of the numpy reference only; the "
                    f"native cache runs {field}={getattr(default, field)!r}"
                )
        gv = int(str(_lib.build_info()["ott2_group"]))
        if cfg.Gv != gv:
            raise ValueError(f"ott_config.Gv must be {gv} in this build (-DOTT_GGUF_V_GROUP), got {cfg.Gv}")
        problem = _lib.config_problem(cfg)
        if problem:
            raise ValueError(f"ott_config: {problem}")

    def _live_ctx(self) -> object:
        """The llama_context, or a clear error once close() has freed it (NULL would read as "no cache")."""
        ctx = getattr(self.__dict__.get("_ctx"), "ctx", None)
        if ctx is None:
            raise RuntimeError(f"this Llama is closed (close() freed its {self.kv_type} cache); create a new one")
        return ctx

    def kv_cache_info(self) -> dict[str, object]:
        """The K/V cache types (kv_type: the pair's name, type_k, type_v), the tier when one chose them, and the
        bytes the cache allocated (total_bytes, and bytes by part) for every cache type; for the ott caches the
        parts are quantized groups, fp16 tail, pools and a sliding-window model's f16 window layers, and they add
        positions held and sealed, outlier and aux pool slots in use (summed over layers and KV heads), and the
        configuration."""
        ctx = self._live_ctx()
        info: dict[str, object] = {"kv_type": self.kv_type, "type_k": self.kv_type_k, "type_v": self.kv_type_v}
        if self.kv_tier is not None:
            info["kv_tier"] = self.kv_tier
        if self.ott_config is None:
            # the memory module's own account (llama_ott_kv_cache_bytes works for every cache type)
            total = _lib.kv_cache_bytes(ctx)
            info.update(bytes={"K and V": total}, total_bytes=total)
        else:
            c = _lib.ott_cache_info(ctx)
            if c is None:
                raise RuntimeError("this context has no ott cache")
            parts = {"quantized": c["quantized_bytes"], "fp16 tail": c["tail_bytes"], "pools": c["pool_bytes"]}
            if c["window_bytes"]:
                parts["f16 window layers"] = c["window_bytes"]
            info.update(positions=c["positions"], sealed=c["sealed"], bytes=parts, total_bytes=sum(parts.values()),
                        outlier_slots=c["outlier_slots"], aux_slots=c["aux_slots"], ott_layers=c["layers"],
                        config=self.ott_config)  # fmt: skip
        return info

    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate tokens after the first n_tokens, as the stock method does. An ott cache cuts a sequence only
        where it then holds what a fresh run would (seq_rm refuses other cuts: a fresh run would hold in fp16
        tokens it has sealed); there the kept prefix is evaluated again from position 0, so the result is always
        that of a fresh run over the same tokens (docs/design-ott2-cache.md, "Batches")."""
        if self.ott_config is not None and self.n_tokens > 0 and not self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1):
            prefix = [int(t) for t in self._input_ids[: self.n_tokens]]
            self._ctx.kv_cache_seq_rm(-1, -1, -1)
            self.n_tokens = 0
            tokens = prefix + list(tokens)
        super().eval(tokens)

    def save_state(self) -> Any:
        """The stock method; the state also names the K/V types it was saved from (load_state checks them)."""
        state = super().save_state()
        state.ott_kv_type = self.kv_type
        return state

    def load_state(self, state: Any) -> None:
        """The stock method, but a refused state loses nothing: llama.cpp may have overwritten the logits and
        cleared the cache, and the stock method the token history, before the refusal; all of it is put back, so
        generation goes on as if no load had been tried. An ott cache's refusal raises ValueError with its reason."""
        lc = _llama_cpp.llama_cpp
        ctx = self._live_ctx()
        saved = getattr(state, "ott_kv_type", None)
        both_ott = saved is not None and resolve_kv_types(saved)[0] in OTT_KV_TYPES and self.ott_config is not None
        # between two ott caches the cache's own check names the field that differs (K bits=3, ...)
        if saved is not None and saved != self.kv_type and not both_ott:
            raise ValueError(f"this saved state holds a {saved} cache; this Llama's cache is {self.kv_type}: load "
                             f"it into a Llama with the types it was saved from (kv_type={saved!r})")  # fmt: skip
        size = int(state.llama_state_size)
        data = (ctypes.c_uint8 * size).from_buffer_copy(state.llama_state)
        before = (ctypes.c_uint8 * lc.llama_state_get_size(ctx))()
        n_before = lc.llama_state_get_data(ctx, before, len(before))
        from .info import captured_log

        with captured_log() as log:
            loaded = lc.llama_state_set_data(ctx, data, size)
        if loaded != size:
            reason = _lib.last_error() if self.ott_config is not None else ""
            if lc.llama_state_set_data(ctx, before, n_before) != n_before:
                raise RuntimeError("a refused state load could not restore the context's own state")
            if self.ott_config is not None:
                reason = reason or "llama.cpp refused it before the K/V cache part (another model?)"
                raise ValueError(f"this saved state cannot be loaded into a {self.kv_type} cache: {reason}")
            said = [ln.strip().split("error loading state: ", 1)[1] for ln in log if "error loading state: " in ln]
            raise RuntimeError("Failed to set llama state data" + (f": llama.cpp says {said[0]} (a state saved from "
                               "another model, or from other K/V cache types?)" if said else ""))  # fmt: skip
        # the stock method's Python part (its native part has just run, once)
        self.scores[: state.n_tokens, :] = state.scores.copy()
        rest = self.scores[state.n_tokens :, :]
        rest[rest > 0] = 0.0
        self.input_ids = state.input_ids.copy()
        self.n_tokens = state.n_tokens
        self._requires_eval = True
        self._seed = state.seed

    def close(self) -> None:
        # __init__ may have refused the arguments before the stock class set anything up
        if "_stack" in self.__dict__:
            super().close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        # the sides by name (the stock state has their ggml ids, which type_k/type_v would take too)
        state["type_k"], state["type_v"] = self.kv_type_k, self.kv_type_v
        if self.ott_config is not None:
            state["ott_config"] = self.ott_config
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.__init__(**state)
