"""`ott-gguf chat`: an interactive terminal chat on ott_gguf.Llama that shows its K/V cache's size and fill.

The conversation is a list of messages rendered by the GGUF's own chat template on every turn; llama-cpp-python
keeps the K/V cache of the previous turns and evaluates only the new tokens (its prefix match).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from . import _lib
from .info import ModelInfo, formula_bytes_per_token, model_info

if TYPE_CHECKING:
    from .kv_types import OttConfig
    from .llama import Llama

PROMPT = "> "
HELP = "/reset clears the conversation and the K/V cache; /exit or Ctrl-D quits; Ctrl-C stops an answer"


def kv_bytes(llm: Llama, model: ModelInfo, kv_type: str | None = None) -> float | None:
    """Bytes of the K/V cache of llm's context (n_ctx cells), or of a kv_type cache of that size for comparison.

    llm's own cache, whatever its type, is asked (`llama_ott_kv_cache_bytes`: its bytes as allocated). Another
    type's cache is n_ctx cells of K and V rows of its ggml type, which is what llama.cpp would allocate; None for
    an ott type or a sliding-window model, whose window layers hold only the window.
    """
    kv_type = kv_type or llm.kv_type
    if kv_type == llm.kv_type:
        return float(_lib.kv_cache_bytes(llm._ctx.ctx))
    per_token = formula_bytes_per_token(model, kv_type)
    return None if per_token is None else per_token * llm.n_ctx()


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


def kv_line(llm: Llama, model: ModelInfo) -> str:
    """One line on the K/V cache: its size, the positions it holds and the size of an f16 cache of the same n_ctx,
    e.g. "[kv ott2: 31.02 MiB, 64 tokens; f16: 180.00 MiB]" (sizes left out where unknown, see kv_bytes)."""
    size = kv_bytes(llm, model)
    f16 = kv_bytes(llm, model, "f16") if llm.kv_type != "f16" else None
    shown = "" if size is None else f"{format_bytes(size)}, "
    compared = "" if f16 is None else f"; f16: {format_bytes(f16)}"
    return f"[kv {llm.kv_type}: {shown}{cached_positions(llm)} tokens{compared}]"


class ChatSession:
    """A conversation with an ott_gguf.Llama: the message history and the streaming of each answer."""

    def __init__(self, llm: Llama, *, system: str | None, max_tokens: int, temperature: float) -> None:
        self.llm = llm
        self.system = system
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.model = model_info(llm.model_path)  # the attention shape, for the size of a stock cache
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
        return kv_line(self.llm, self.model)


def run(
    model: Path,
    *,
    kv_type: str,
    ott_config: OttConfig | None = None,
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
    llm = Llama(str(model), kv_type=kv_type, ott_config=ott_config, n_ctx=n_ctx, seed=0, verbose=verbose)
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
