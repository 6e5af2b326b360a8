"""`ott-gguf chat`: an interactive terminal chat on ott_gguf.Llama that shows its K/V cache's size and fill.

The conversation is a list of messages rendered by the GGUF's own chat template on every turn; llama-cpp-python
keeps the K/V cache of the previous turns and evaluates only the new tokens (its prefix match). When the next turn
would not fit in the context, the oldest turns leave the conversation (the system prompt stays), as Ollama does;
the rest is then evaluated again from where it differs, exactly (ott_gguf.Llama cuts an ott cache only where that
is lossless).
"""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Iterator, Sequence
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from . import _lib
from .info import ModelInfo, formula_bytes_per_token, model_info

if TYPE_CHECKING:
    from .llama import Llama

PROMPT = "> "
HELP = "/reset clears the conversation and the K/V cache; /help; /exit or Ctrl-D quits; Ctrl-C stops an answer"
# a paste arrives as one burst: lines already waiting (or arriving within this many seconds) join the first one
PASTE_WAIT_S = 0.02


def padded_n_ctx(n_ctx: int) -> int:
    """n_ctx rounded up to a multiple of 256. llama.cpp pads the context so, but llama-cpp-python sizes its token
    arrays by the n_ctx asked for: a conversation that outgrows the latter fails inside numpy instead of with
    "exceed context window"."""
    return -(-n_ctx // 256) * 256


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


def _fixed(x: float, places: int) -> str:
    """x with `places` decimals, an exact tie rounded up as JavaScript's toFixed and Math.round do (the web page's
    formatBytes shows the same bytes; Python's own format rounds a tie such as 253.125 to even)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{_fixed(n, 0)} {unit}" if unit == "B" else f"{_fixed(n, 2)} {unit}"
        n /= 1024
    return f"{_fixed(n, 2)} GiB"


def cached_positions(llm: Llama) -> int:
    """Positions in the K/V cache: the ott2 cache's own count, else llama-cpp-python's evaluated tokens."""
    info = llm.kv_cache_info()
    positions = info.get("positions")
    return int(positions) if isinstance(positions, int) else int(llm.n_tokens)


def kv_line(llm: Llama, model: ModelInfo, tokens_per_s: float | None = None) -> str:
    """One line on the K/V cache: its size, the positions it holds of n_ctx, the last answer's decoding speed and
    the size of an f16 cache of the same n_ctx, e.g. "[kv ott2: 31.02 MiB, 64/1024 tokens, 85.3 tokens/s; f16:
    180.00 MiB]" (sizes left out where unknown, see kv_bytes; the speed where nothing was decoded)."""
    size = kv_bytes(llm, model)
    f16 = kv_bytes(llm, model, "f16") if llm.kv_type != "f16" else None
    shown = "" if size is None else f"{format_bytes(size)}, "
    speed = "" if tokens_per_s is None else f", {tokens_per_s:.1f} tokens/s"
    compared = "" if f16 is None else f"; f16: {format_bytes(f16)}"
    return f"[kv {llm.kv_type}: {shown}{cached_positions(llm)}/{llm.n_ctx()} tokens{speed}{compared}]"


class _PromptTokens(Exception):
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


class _PromptProbe:
    """The Llama as a chat handler sees it, except that create_completion hands back the prompt's tokens instead of
    evaluating them: the handler renders and tokenizes exactly as it does for the real call."""

    def __init__(self, llm: Llama) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def create_completion(self, prompt: Sequence[int] | str, **_: Any) -> Any:
        if isinstance(prompt, str):
            prompt = self._llm.tokenize(prompt.encode(), add_bos=True, special=True)
        raise _PromptTokens(list(prompt))


def prompt_tokens(llm: Llama, messages: list[dict[str, str]]) -> list[int]:
    """The tokens create_chat_completion(messages) would evaluate as its prompt, through llm's own chat handler."""
    from llama_cpp import llama_chat_format

    handler = (
        llm.chat_handler
        or llm._chat_handlers.get(llm.chat_format)
        or llama_chat_format.get_chat_completion_handler(llm.chat_format)
    )
    try:
        handler(llama=_PromptProbe(llm), messages=messages, stream=False)
    except _PromptTokens as p:
        return p.tokens
    raise RuntimeError(f"the chat handler of format {llm.chat_format!r} did not ask for a completion")


def chat_formats() -> list[str]:
    """The chat formats llama-cpp-python has registered by name (Llama(chat_format=...) takes these)."""
    from llama_cpp import llama_chat_format

    return sorted(llama_chat_format.LlamaChatCompletionHandlerRegistry()._chat_handlers)


def truncation_marker(finish_reason: str | None, n_prompt: int, max_tokens: int, n_ctx: int) -> str:
    """The marker of an answer cut by max_tokens ("[max tokens]") or by the context's end ("[context full]"):
    llama-cpp-python says "length" for both, having shortened max_tokens to what the context has left; "" for an
    answer that ended by itself."""
    if finish_reason != "length":
        return ""
    return "[context full]" if n_prompt + max_tokens >= n_ctx else "[max tokens]"


def decode_speed(llm: Llama) -> float | None:
    """Tokens per second of the token-by-token decoding since llama.cpp's counters were last reset (prompt
    processing not included), as llama.cpp's own "eval time" line counts them; None if nothing was decoded."""
    lc = _lib.llama_cpp_module().llama_cpp
    perf = lc.llama_perf_context(llm._ctx.ctx)
    return perf.n_eval / perf.t_eval_ms * 1e3 if perf.n_eval > 0 and perf.t_eval_ms > 0 else None


def guessed_format_line(llm: Llama) -> str | None:
    """One line saying that a chat format was guessed (the GGUF has no chat template), taking the place of
    ott_gguf.Llama's warning at the first chat; None when the GGUF's own template or a chosen format is used."""
    if not llm._chat_note:
        return None
    llm._chat_note = ""
    return (
        f"ott-gguf: {Path(llm.model_path).name} has no chat template (a base model?): chatting in llama-cpp-python's "
        f"{llm.chat_format!r} format of its architecture; --chat-format chooses another"
    )


class ChatSession:
    """A conversation with an ott_gguf.Llama: the message history, fitting it into the context, and the streaming
    of each answer."""

    def __init__(self, llm: Llama, *, system: str | None, max_tokens: int, temperature: float) -> None:
        self.llm = llm
        self.system = system
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.model = model_info(llm.model_path)  # the attention shape, for the size of a stock cache
        self.messages: list[dict[str, str]] = []
        self.dropped = 0  # oldest turns the last question dropped to fit
        self.marker = ""  # how the last answer was cut: "[max tokens]", "[context full]" or ""
        self.tokens_per_s: float | None = None  # the last answer's decoding speed
        self.n_prompt = 0  # tokens of the last prompt
        self.reset()

    @property
    def reserve(self) -> int:
        """Tokens kept free for the answer when turns are dropped: max_tokens, but at most a quarter of n_ctx (a
        longer answer may still fill the context: it then ends with "[context full]")."""
        return min(self.max_tokens, self.llm.n_ctx() // 4)

    def reset(self) -> None:
        """Forget the conversation and empty the K/V cache (llm.reset() alone keeps the cells until reused)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens_per_s = None
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()

    def _fit(self, text: str) -> int:
        """Append the question; when the prompt would leave less than `reserve` tokens free, first drop the oldest
        turns (question and answer) until it takes at most half the context. Returns how many turns were dropped.
        A question that does not fit even alone raises ValueError and changes nothing."""
        head = self.messages[:1] if self.system else []
        turns = self.messages[len(head) :]
        question = {"role": "user", "content": text}
        n_ctx = self.llm.n_ctx()
        room = n_ctx - self.reserve

        counted: dict[int, int] = {}

        def n_tokens(k: int) -> int:  # the prompt with the oldest k turns dropped
            if k not in counted:
                counted[k] = len(prompt_tokens(self.llm, [*head, *turns[2 * k :], question]))
            return counted[k]

        n_turns = (len(turns) + 1) // 2  # a turn is a question and its answer
        hi = 0  # turns dropped
        if n_tokens(0) > room:
            if n_tokens(n_turns) > room:
                with_system = " with the system prompt" if head else ""
                raise ValueError(
                    f"this message takes {n_tokens(n_turns)} tokens{with_system} and the chat template; n_ctx "
                    f"{n_ctx} keeps {self.reserve} of them free for the answer: shorten the message or use a larger "
                    "--n-ctx"
                )
            # the least k that brings the prompt to half the context (or all turns, if that does not), so that the
            # next turns fit again without evaluating the conversation anew each time (llama.cpp's context shift
            # also discards half); fewer turns, fewer tokens: by bisection
            lo, hi = 0, n_turns
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if n_tokens(mid) <= n_ctx // 2:
                    hi = mid
                else:
                    lo = mid
        self.messages = [*head, *turns[2 * hi :], question]
        self.n_prompt = n_tokens(hi)
        return hi

    def stream(self, text: str) -> Iterator[str]:
        """Ask `text`: first fits the conversation into the context (`dropped` says how many turns left it; a
        message that cannot fit raises ValueError here), then returns the answer's stream. The answer joins the
        history when the stream ends, also when the caller stops it early (Ctrl-C): the part shown is what the model
        said and what its cache holds. After the stream, `marker` says whether max_tokens or the context's end cut
        it and `tokens_per_s` how fast it was decoded."""
        self.dropped = self._fit(text)
        self.marker = ""
        return self._answer()

    def _answer(self) -> Iterator[str]:
        lc = _lib.llama_cpp_module().llama_cpp
        lc.llama_perf_context_reset(self.llm._ctx.ctx)
        pieces: list[str] = []
        finish: str | None = None
        try:
            chunks: Any = self.llm.create_chat_completion(
                messages=self.messages, max_tokens=self.max_tokens, temperature=self.temperature, stream=True
            )
            for chunk in chunks:
                choice = chunk["choices"][0]
                finish = choice.get("finish_reason") or finish
                piece = choice["delta"].get("content") or ""
                if piece:
                    pieces.append(piece)
                    yield piece
        except ValueError:
            # refused before answering (e.g. no chat format): nothing was said, so the question leaves the history
            self.messages.pop()
            raise
        except BaseException:
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
            raise
        finally:
            self.tokens_per_s = decode_speed(self.llm)
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        self.marker = truncation_marker(finish, self.n_prompt, self.max_tokens, self.llm.n_ctx())

    def kv_line(self) -> str:
        return kv_line(self.llm, self.model, self.tokens_per_s)


def _more_input_waiting() -> bool:
    """True when the terminal has more input already: the rest of a paste. readline reads a byte at a time, so a
    pasted burst's later lines are still in the terminal's buffer when input() returns the first."""
    if os.name == "nt" or not sys.stdin.isatty():
        return False  # piped input: each line is a turn, as a script means it
    return bool(select.select([sys.stdin], [], [], PASTE_WAIT_S)[0])


def read_message(prompt: str = PROMPT) -> str:
    """One message from the terminal: a line, or all the lines of a paste joined (not one turn per line)."""
    lines = [input(prompt)]
    while _more_input_waiting():
        try:
            lines.append(input(""))
        except EOFError:
            break
    return "\n".join(lines).strip()


def run(
    model: Path,
    *,
    n_ctx: int,
    system: str | None,
    max_tokens: int,
    temperature: float,
    out: TextIO | None = None,
    **llama_kwargs: Any,
) -> int:
    """The interactive loop on stdin/stdout; llama_kwargs go to ott_gguf.Llama (kv_type, ott_config,
    n_gpu_layers, n_threads, seed, chat_format, verbose, ...). Returns the exit status."""
    from .llama import Llama

    out = out or sys.stdout
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    n_ctx = padded_n_ctx(n_ctx)
    llm = Llama(str(model), n_ctx=n_ctx, **llama_kwargs)
    session = ChatSession(llm, system=system, max_tokens=max_tokens, temperature=temperature)
    note = guessed_format_line(llm)
    if note:
        print(note, file=out)
    ngl = llama_kwargs.get("n_gpu_layers")
    offload = f", -ngl {ngl}" if ngl else ""
    print(f"ott-gguf chat: {model.name}, kv_type={llm.kv_type}, n_ctx={n_ctx}{offload}. {HELP}", file=out, flush=True)
    try:
        while True:
            try:
                text = read_message()
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
            if text == "/help":
                print(HELP, file=out, flush=True)
                continue
            if text == "/reset":
                session.reset()
                print(f"(conversation cleared) {session.kv_line()}", file=out, flush=True)
                continue
            if text.startswith("/"):
                print(f"unknown command {text.split()[0]}: {HELP}", file=out, flush=True)
                continue
            try:
                answer = session.stream(text)
            except ValueError as e:  # the message alone does not fit
                print(f"ott-gguf: {e}", file=out, flush=True)
                continue
            if session.dropped:
                s = "s" if session.dropped > 1 else ""
                print(f"[dropped {session.dropped} oldest turn{s} to fit {n_ctx} tokens]", file=out, flush=True)
            try:
                for piece in answer:
                    out.write(piece)
                    out.flush()
                print(f" {session.marker}" if session.marker else "", file=out)
            except KeyboardInterrupt:
                print(" [stopped]", file=out)
            except ValueError as e:
                print(f"ott-gguf: {e}", file=out)
            finally:
                answer.close()  # an interrupted answer joins the history now, not when the generator is collected
            print(session.kv_line(), file=out, flush=True)
    finally:
        llm.close()
