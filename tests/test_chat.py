"""`ott-gguf chat` driven through a pseudo-terminal, as a person uses it, with SmolLM2 and the ott2 cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from ott_gguf import KV_TYPES

KV_LINE = re.compile(r"\[kv ott2: [0-9.]+ (?:B|KiB|MiB|GiB), (\d+) tokens")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def chat_command(*args: str) -> list[str]:
    # `python -m` runs the ott_gguf that this interpreter imports: the installed package, or PYTHONPATH's
    return [sys.executable, "-m", "ott_gguf.cli", "chat", *args]


def spawn_chat(cwd: Path, *args: str) -> pexpect.spawn:
    # TERM=dumb: no bracketed-paste escapes from readline around the echoed input
    env = {**os.environ, "TERM": "dumb"}
    cmd = chat_command(*args)
    child = pexpect.spawn(cmd[0], cmd[1:], env=env, cwd=str(cwd), timeout=120, encoding="utf-8")
    child.expect(r"ott-gguf chat: .*kv_type=\S+, n_ctx=\d+")
    return child


def say(child: pexpect.spawn, text: str) -> tuple[str, int]:
    """Send one line at the prompt; returns the answer printed for it and the token count of the KV line."""
    child.expect_exact("> ")
    child.sendline(text)
    child.expect(r"\r?\n")  # the end of the terminal's echo of the line
    child.expect(KV_LINE)
    return ANSI.sub("", child.before).strip(), int(child.match.group(1))


def test_chat_keeps_the_history_in_the_ott2_cache(smollm2: Path, tmp_path: Path) -> None:
    child = spawn_chat(tmp_path, str(smollm2), "--kv-type", "ott2", "--n-ctx", "1024", "--max-tokens", "40")
    try:
        first, n1 = say(child, "The password is tulip.")
        assert first, "empty answer to the first turn"
        # the word is only in the first turn: SmolLM2 (greedy) answers with it only when it sees the history
        second, n2 = say(child, "What is the password?")
        assert "tulip" in second.lower(), second
        assert 0 < n1 < n2, (n1, n2)

        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect(r"conversation cleared\) " + KV_LINE.pattern)
        assert int(child.match.group(1)) == 0

        # the same question without the history: the answer no longer knows the word
        alone, n3 = say(child, "What is the password?")
        assert alone and "tulip" not in alone.lower(), alone
        assert n3 > 0

        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_chat_exits_on_ctrl_d(smollm2: Path, tmp_path: Path) -> None:
    child = spawn_chat(tmp_path, str(smollm2), "--n-ctx", "512")
    try:
        child.expect_exact("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
        assert "Traceback" not in child.before
    finally:
        child.close()
    assert child.exitstatus == 0


def test_chat_rejects_unknown_kv_type(tmp_path: Path) -> None:
    res = subprocess.run(chat_command("--kv-type", "q9"), capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "unknown kv_type 'q9'" in res.stderr
    for name in KV_TYPES:
        assert name in res.stderr


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0", "ott2"])
def test_kv_bytes_are_what_llama_cpp_allocates(smollm2: Path, kv_type: str, capfd: pytest.CaptureFixture[str]) -> None:
    """The chat's K/V size is what llama.cpp allocates for n_ctx cells, as its log says: a stock type's K and V
    rows, and the ott2 cache's own account of its parts (asked through the C API, not modelled)."""
    from ott_gguf import Llama
    from ott_gguf.chat import kv_bytes
    from ott_gguf.info import model_info

    n_ctx = 1024
    llm = Llama(str(smollm2), kv_type=kv_type, n_ctx=n_ctx, verbose=True)
    log = capfd.readouterr().err
    if kv_type == "ott2":
        m = re.search(r"ott2 cache size = +([0-9.]+) MiB", log)
    else:
        m = re.search(rf"llama_kv_cache: size = +([0-9.]+) MiB \( *{n_ctx} cells", log)
    assert m, log[-3000:]
    size = kv_bytes(llm, model_info(smollm2))
    assert size is not None and size / 2**20 == pytest.approx(float(m.group(1)), abs=0.006)
    if kv_type == "ott2":  # smaller than an f16 cache of the same context, as the chat line shows beside it
        f16 = kv_bytes(llm, model_info(smollm2), "f16")
        assert f16 is not None and size < f16
    llm.close()
