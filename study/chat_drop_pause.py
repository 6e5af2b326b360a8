"""What it costs a long chat to drop its oldest turns (issue 48): `ott-gguf chat`'s ChatSession on SmolLM2, greedy,
user turns of a few hundred tokens of the pinned llama.cpp docs, each asking for a one-sentence summary, until the
conversation has outgrown the context once. Per turn: the seconds from the question to the first answer token (the
pause a person sees) and the prompt tokens llama.cpp evaluated for it (the rest came from the cache by prefix
reuse). The turn that drops evaluates again what it keeps of the conversation, up to half the context.

    python -m study.chat_drop_pause --out docs/chat-drop-pause.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ott_gguf import Llama, _lib, models
from ott_gguf.chat import ChatSession
from ott_gguf.corpus import docs_text


@dataclass
class Turn:
    prompt: int  # tokens of the whole prompt
    evaluated: int  # prompt tokens llama.cpp evaluated (the rest was reused)
    first_s: float  # question to first answer token
    dropped: int


def run_chat(model: Path, kv_type: str, n_ctx: int, turn_tokens: int, max_tokens: int, threads: int) -> list[Turn]:
    """Turns until the first drop, and two after it."""
    llm = Llama(str(model), kv_type=kv_type, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    session = ChatSession(llm, system="You summarize text in one sentence.", max_tokens=max_tokens, temperature=0.0)
    text = llm.tokenize(docs_text(8 * n_ctx).encode(), add_bos=False)
    chunks = [llm.detokenize(text[i : i + turn_tokens]).decode(errors="replace")
              for i in range(0, len(text) - turn_tokens, turn_tokens)]  # fmt: skip
    perf = _lib.llama_cpp_module().llama_cpp.llama_perf_context
    turns: list[Turn] = []
    after = 0
    try:
        for chunk in chunks:
            t0 = time.perf_counter()
            answer = session.stream(f"Summarize this in one sentence:\n\n{chunk}")
            next(answer, None)
            first = time.perf_counter() - t0
            for _ in answer:
                pass
            turns.append(Turn(session.n_prompt, int(perf(llm._ctx.ctx).n_p_eval), first, session.dropped))
            print(f"  {kv_type} n_ctx {n_ctx} turn {len(turns)}: {turns[-1]}", flush=True)
            after += 1 if any(t.dropped for t in turns) else 0
            if after == 3:
                return turns
        raise RuntimeError(f"the docs ran out before a drop at n_ctx {n_ctx}")
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-ctx", default="4096,16384", help="comma-separated context lengths")
    ap.add_argument("--kv-types", default="ott2,f16")
    ap.add_argument("--turn-tokens", type=int, default=400, help="docs tokens per question")
    ap.add_argument("--max-tokens", type=int, default=64, help="longest answer (the chat's reserve)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    path = models.fetch(a.model, quiet=True)
    t0 = time.time()
    rows = []
    for n_ctx in [int(x) for x in a.n_ctx.split(",")]:
        for kv_type in a.kv_types.split(","):
            turns = run_chat(path, kv_type, n_ctx, a.turn_tokens, a.max_tokens, a.threads)
            i = next(k for k, t in enumerate(turns) if t.dropped)
            before = turns[max(1, i - 4) : i]  # full-context turns before the drop (not the first, from empty)
            normal = statistics.median(t.first_s for t in before)
            drop, nxt = turns[i], turns[i + 1]
            rows.append(f"| {n_ctx} | {kv_type} | {i} | {statistics.median(t.evaluated for t in before):.0f} | "
                        f"{normal:.2f} | {drop.dropped} of {i} | {drop.evaluated} | {drop.first_s:.2f} | "
                        f"{drop.first_s - normal:.2f} | {nxt.evaluated} | {nxt.first_s:.2f} |")  # fmt: skip
    lines = [
        "| n_ctx | kv_type | turns before the drop | normal turn: tokens evaluated | normal turn: s to first token | "
        "turns dropped | drop turn: tokens evaluated | drop turn: s to first token | pause (s) | next turn: tokens "
        "evaluated | next turn: s to first token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    head = (
        "# The pause when a long chat drops its oldest turns\n\n"
        "`ott-gguf chat` keeps a conversation going past its context as Ollama does: when the next question would "
        "leave less than the answer's reserve (max_tokens, at most a quarter of n_ctx) free, the oldest turns leave "
        "until the prompt takes at most half the context; the system prompt stays. llama-cpp-python then reuses the "
        "cached prefix up to the first dropped token and evaluates the rest again (an ott cache is cut only where "
        "that is lossless, else evaluated from the start): that evaluation is the pause, once per half context.\n\n"
        f"Measured {time.ctime()} in {time.time() - t0:.0f} s: `python -m study.chat_drop_pause "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}` ({a.model}, {a.threads} thread(s) on "
        f"{os.cpu_count()} cores, questions of {a.turn_tokens} docs tokens, answers of up to {a.max_tokens} tokens, "
        "greedy). Normal "
        "turn: the median of the four before the drop (the first turn, from an empty cache, left out)."
    )
    text = head + "\n\n" + "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
