"""The patched llama-server, started by the `ott-gguf serve` console command."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ott_gguf.server import Server

from helpers import OTT_GGUF, serving


def serve_and_ask(model: Path, kv_type: str, n_ctx: int, questions: list[str], log: Path) -> Server:
    """Start `ott-gguf serve`, ask each question (a non-empty answer each), stop; returns the stopped server."""
    with serving(model, kv_type, n_ctx, log) as srv:
        for question in questions:
            out = srv.chat([{"role": "user", "content": question}], max_tokens=16, temperature=0.0)
            text = out["choices"][0]["message"]["content"]  # type: ignore[index]
            assert isinstance(text, str) and text.strip(), out
    return srv


def test_serve_answers_a_chat_completion(smollm2: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    srv = serve_and_ask(smollm2, "q8_0", 1024, ["Name a fruit."], log)
    assert srv.proc.returncode is not None
    # the server really ran with the requested cache type
    assert "q8_0" in log.read_text(errors="replace")


def test_serve_rejects_unknown_kv_type(smollm2: Path) -> None:
    res = subprocess.run([str(OTT_GGUF), "serve", str(smollm2), "--kv-type", "q9"], capture_output=True, text=True)
    assert res.returncode == 2
    assert "unknown kv_type" in res.stderr and "q8_0" in res.stderr


def test_serve_with_the_ott2_cache(smollm2: Path, tmp_path: Path) -> None:
    """llama-server with -ctk/-ctv ott2 and 4 slots (one stream per slot) answers several requests."""
    log = tmp_path / "server.log"
    serve_and_ask(smollm2, "ott2", 4096, ["Name a fruit.", "Name a color."], log)
    text = log.read_text(errors="replace")
    assert "n_slots = 4, n_ctx_slot = 1024, kv_unified = 'false'" in text, text[-2000:]
