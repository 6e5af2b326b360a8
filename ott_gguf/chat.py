"""`ott-gguf chat`: an interactive terminal chat on ott_gguf.Llama that shows what its K/V cache holds.

The conversation is a list of messages rendered by the GGUF's own chat template on every turn; llama-cpp-python
keeps the K/V cache of the previous turns and evaluates only the new tokens (its prefix match).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .kv_types import OTT_KV_TYPES

if TYPE_CHECKING:
    from .llama import Llama

PROMPT = "> "
HELP = "/reset clears the conversation and the K/V cache; /exit or Ctrl-D quits; Ctrl-C stops an answer"


@dataclass(frozen=True)
class KvShape:
    """The K/V geometry of a model: every cached position holds K and V rows of n_head_kv * head_dim in
    each of n_layer layers."""

    n_layer: int
    n_head_kv: int
    head_dim: int

    @classmethod
    def of(cls, llm: Llama) -> KvShape:
        from ._lib import llama_cpp_module

        lc = llama_cpp_module().llama_cpp
        n_head = int(lc.llama_model_n_head(llm.model))
        arch = llm.metadata.get("general.architecture", "")
        # models whose head size is not n_embd / n_head say so in their metadata
        key_length = llm.metadata.get(f"{arch}.attention.key_length")
        head_dim = int(key_length) if key_length else int(lc.llama_model_n_embd(llm.model)) // n_head
        return cls(int(lc.llama_model_n_layer(llm.model)), int(lc.llama_model_n_head_kv(llm.model)), head_dim)


def _stock_bytes_per_element(kv_type: str) -> float:
    """Bytes per K or V element of a stock ggml type, read from the loaded ggml (block size / values per block)."""
    import ctypes

    from ._lib import ggml_type_ids, llama_cpp_module

    lib = llama_cpp_module().llama_cpp._lib
    type_size, blck_size = lib.ggml_type_size, lib.ggml_blck_size
    type_size.restype, type_size.argtypes = ctypes.c_size_t, [ctypes.c_int]
    blck_size.restype, blck_size.argtypes = ctypes.c_int64, [ctypes.c_int]
    tid = ggml_type_ids()[kv_type]
    return float(type_size(tid)) / float(blck_size(tid))


def kv_bytes(llm: Llama, shape: KvShape, positions: int, kv_type: str | None = None) -> float:
    """Bytes that `positions` cached positions of one sequence take in a K/V cache of kv_type (default: llm's).

    Stock types: K and V rows of their ggml type. ott2/kivi2: the accounting of `reference.memory_bits` (2-bit
    codes and their scales of the sealed groups, the fp16 tail, the outlier and aux pools at capacity) with the
    build's V block size.
    """
    kv_type = kv_type or llm.kv_type
    if positions <= 0:
        return 0.0
    if kv_type not in OTT_KV_TYPES:
        elements = 2 * positions * shape.n_layer * shape.n_head_kv * shape.head_dim
        return elements * _stock_bytes_per_element(kv_type)
    from . import reference
    from ._lib import build_info

    cfg = llm.ott_config
    assert cfg is not None, "an ott2/kivi2 Llama has its OttConfig"
    ref_cfg = reference.OttConfig(G=cfg.G, R=cfg.R, Gv=int(str(build_info()["ott2_group"])),
                                  outlier_num=cfg.outlier_num, aux_cap=cfg.aux_cap,
                                  no_outlier_layers=cfg.no_outlier_layers)  # fmt: skip
    bits = sum(
        sum(reference.memory_bits(ref_cfg, shape.head_dim, positions, layer).values()) for layer in range(shape.n_layer)
    )
    return bits * shape.n_head_kv / 8


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def cached_positions(llm: Llama) -> int:
    """Positions in the K/V cache: the ott2 cache's own count, else llama-cpp-python's evaluated tokens."""
    info = llm.kv_cache_info()
    positions = info.get("positions")
    return int(positions) if isinstance(positions, int) else int(llm.n_tokens)


def kv_line(llm: Llama, shape: KvShape) -> str:
    """One line on the K/V cache, e.g. "[kv ott2: 2.15 MiB, 64 tokens; f16: 1.41 MiB]" (ott2 adds its pools)."""
    n = cached_positions(llm)
    line = f"[kv {llm.kv_type}: {format_bytes(kv_bytes(llm, shape, n))}, {n} tokens"
    if llm.kv_type != "f16":
        line += f"; f16: {format_bytes(kv_bytes(llm, shape, n, 'f16'))}"
    return line + "]"


class ChatSession:
    """A conversation with an ott_gguf.Llama: the message history and the streaming of each answer."""

    def __init__(self, llm: Llama, *, system: str | None, max_tokens: int, temperature: float) -> None:
        self.llm = llm
        self.system = system
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.shape = KvShape.of(llm)
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and empty the K/V cache (llm.reset() alone keeps the cells until reused)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()

    def stream(self, text: str) -> Iterator[str]:
        """Ask `text`; yields the answer piece by piece. The answer joins the history when the stream ends, also
        when the caller stops it early (Ctrl-C): the part shown is what the model said and what its cache holds."""
        self.messages.append({"role": "user", "content": text})
        pieces: list[str] = []
        try:
            chunks: Any = self.llm.create_chat_completion(
                messages=self.messages, max_tokens=self.max_tokens, temperature=self.temperature, stream=True
            )
            for chunk in chunks:
                piece = chunk["choices"][0]["delta"].get("content") or ""
                if piece:
                    pieces.append(piece)
                    yield piece
        except ValueError:
            # the prompt does not fit in the context: nothing was answered, so the question leaves the history
            self.messages.pop()
            raise
        except BaseException:
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
            raise
        self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def kv_line(self) -> str:
        return kv_line(self.llm, self.shape)


def run(
    model: Path,
    *,
    kv_type: str,
    n_ctx: int,
    system: str | None,
    max_tokens: int,
    temperature: float,
    verbose: bool = False,
    out: TextIO | None = None,
) -> int:
    """The interactive loop on stdin/stdout; returns the exit status."""
    from .llama import Llama

    out = out or sys.stdout
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    # llama.cpp pads the context to a multiple of 256 but llama-cpp-python sizes its token arrays by the n_ctx asked
    # for: a conversation that outgrows the latter fails inside numpy instead of with "exceed context window"
    n_ctx = -(-n_ctx // 256) * 256
    llm = Llama(str(model), kv_type=kv_type, n_ctx=n_ctx, seed=0, verbose=verbose)
    session = ChatSession(llm, system=system, max_tokens=max_tokens, temperature=temperature)
    print(f"ott-gguf chat: {model.name}, kv_type={llm.kv_type}, n_ctx={n_ctx}. {HELP}", file=out, flush=True)
    try:
        while True:
            try:
                text = input(PROMPT).strip()
            except EOFError:  # Ctrl-D
                print(file=out)
                return 0
            except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line, as Python's REPL does
                print(file=out)
                continue
            if not text:
                continue
            if text == "/exit":
                return 0
            if text == "/reset":
                session.reset()
                print(f"(conversation cleared) {session.kv_line()}", file=out, flush=True)
                continue
            if text.startswith("/"):
                print(f"unknown command {text.split()[0]}: {HELP}", file=out, flush=True)
                continue
            answer = session.stream(text)
            try:
                for piece in answer:
                    out.write(piece)
                    out.flush()
                print(file=out)
            except KeyboardInterrupt:
                print(" [stopped]", file=out)
            except ValueError as e:  # the conversation outgrew n_ctx
                print(f"ott-gguf: {e}; /reset starts a new conversation", file=out)
            finally:
                answer.close()  # an interrupted answer joins the history now, not when the generator is collected
            print(session.kv_line(), file=out, flush=True)
    finally:
        llm.close()
