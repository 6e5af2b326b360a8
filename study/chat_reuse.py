"""What lossless-only prefix reuse costs on a realistic chat (issue 13): prompt tokens processed per turn by
llama-server with ott2 and with f16, same conversation, same slot, greedy answers.

    python -m study.chat_reuse --out docs/prefix-reuse.md

The conversation: a system message with a page of the pinned llama.cpp docs, then user turns asking about it,
each turn sent with the whole history (as chat clients do), then one unrelated question in the same slot. The
server reports per request how many prompt tokens it took from its cache (cache_n) and how many it processed
(prompt_n).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ott_gguf import models
from ott_gguf.corpus import docs_text
from ott_gguf.server import Server, free_port, server_command

TURNS = [
    "What is this document about? One sentence.",
    "Which command-line options does it mention?",
    "Summarize the second paragraph.",
    "What would a beginner need to install first?",
    "Give one example command from the text.",
    "Is there anything about GPUs? Answer briefly.",
]
UNRELATED = "Name three colors."


def run_chat(model: Path, kv_type: str, max_tokens: int) -> list[tuple[str, int, int, int]]:
    """(label, prompt tokens, cached, processed) per request."""
    port = free_port()
    cmd = server_command(model, kv_type=kv_type, port=port, extra=["-c", "8192", "-np", "1", "-t", "2"])
    rows = []
    with Server(cmd, "127.0.0.1", port) as srv:
        srv.wait_healthy()
        msgs = [{"role": "system", "content": "Answer from this text:\n\n" + docs_text(20_000)[:3000]}]
        for i, q in enumerate([*TURNS, None]):
            if q is None:
                send = [{"role": "user", "content": UNRELATED}]
                label = "unrelated question"
            else:
                msgs.append({"role": "user", "content": q})
                send = msgs
                label = f"turn {i + 1}"
            out = srv.chat(send, max_tokens=max_tokens, temperature=0.0, top_k=1)
            t = out["timings"]  # type: ignore[index]
            cached, processed = int(t["cache_n"]), int(t["prompt_n"])  # type: ignore[index]
            rows.append((label, cached + processed, cached, processed))
            if q is not None:
                msgs.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})  # type: ignore[index]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    path = models.fetch(a.model, quiet=True)
    t0 = time.time()
    res = {t: run_chat(path, t, a.max_tokens) for t in ("f16", "ott2")}
    lines = [
        "# Prefix reuse on a realistic chat: f16 vs ott2",
        "",
        f"Measured {time.ctime()} in {time.time() - t0:.0f} s (`python -m study.chat_reuse --out "
        f"docs/prefix-reuse.md`): llama-server, {a.model}, one slot, a system message with 3000 characters of the "
        f"pinned llama.cpp docs, {len(TURNS)} user turns with the whole history each, then an unrelated question; "
        f"greedy answers of up to {a.max_tokens} tokens. Prompt tokens: cached (reused from the slot) + processed.",
        "",
        "| request | prompt tokens | f16 cached | f16 processed | ott2 cached | ott2 processed |",
        "|---|---|---|---|---|---|",
    ]
    for (label, n, c16, p16), (_, n2, c2, p2) in zip(res["f16"], res["ott2"], strict=True):
        lines.append(f"| {label} | {n} / {n2} | {c16} | {p16} | {c2} | {p2} |")
    tot16 = sum(r[3] for r in res["f16"])
    tot2 = sum(r[3] for r in res["ott2"])
    lines += ["", f"Processed in total: f16 {tot16}, ott2 {tot2} tokens ({tot2 / tot16:.2f}x)."]
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
