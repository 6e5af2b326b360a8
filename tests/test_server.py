"""The patched llama-server, started by the `ott-gguf serve` console command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ott_gguf.server import Server, free_port


def test_serve_answers_a_chat_completion(smollm2: Path, tmp_path: Path) -> None:
    port = free_port()
    exe = Path(sys.executable).with_name("ott-gguf")
    cmd = [str(exe), "serve", str(smollm2), "--kv-type", "q8_0", "--port", str(port), "--", "-c", "1024", "-t", "2"]
    log = tmp_path / "server.log"
    srv = Server(cmd, "127.0.0.1", port, log=log)
    try:
        srv.wait_healthy(timeout=120)
        out = srv.chat([{"role": "user", "content": "Name a fruit."}], max_tokens=16, temperature=0.0)
        text = out["choices"][0]["message"]["content"]  # type: ignore[index]
        assert isinstance(text, str) and text.strip(), out
    finally:
        srv.stop()
    assert srv.proc.returncode is not None
    # the server really ran with the requested cache type
    assert "q8_0" in log.read_text(errors="replace")


def test_serve_rejects_unknown_kv_type(smollm2: Path) -> None:
    exe = Path(sys.executable).with_name("ott-gguf")
    res = subprocess.run([str(exe), "serve", str(smollm2), "--kv-type", "q9"], capture_output=True, text=True)
    assert res.returncode == 2
    assert "unknown kv_type" in res.stderr and "q8_0" in res.stderr


def test_serve_with_the_ott2_cache(smollm2: Path, tmp_path: Path) -> None:
    """llama-server with -ctk/-ctv ott2 and 4 slots (one stream per slot) answers, and says it uses ott2."""
    port = free_port()
    exe = Path(sys.executable).with_name("ott-gguf")
    cmd = [str(exe), "serve", str(smollm2), "--kv-type", "ott2", "--port", str(port), "--", "-c", "4096", "-t", "2"]
    log = tmp_path / "server.log"
    srv = Server(cmd, "127.0.0.1", port, log=log)
    try:
        srv.wait_healthy(timeout=120)
        for question in ("Name a fruit.", "Name a color."):
            out = srv.chat([{"role": "user", "content": question}], max_tokens=16, temperature=0.0)
            assert str(out["choices"][0]["message"]["content"]).strip(), out  # type: ignore[index]
    finally:
        srv.stop()
    text = log.read_text(errors="replace")
    assert "n_slots = 4, n_ctx_slot = 1024, kv_unified = 'false'" in text, text[-2000:]
