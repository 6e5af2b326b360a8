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

# the cache's size, the positions it holds of n_ctx, the last answer's decoding speed (none after /reset)
KV_LINE = re.compile(r"\[kv ott2: [0-9.]+ (?:B|KiB|MiB|GiB), (\d+)/(\d+) tokens(?:, [0-9.]+ tokens/s)?; f16: ")
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


# --- a chat that outgrows its context, markers, the terminal (issue 48) ------------------------------------------

# a long system prompt leaves an answer little room in 256 tokens: the story below runs into the context's end
STORY_SYSTEM = (
    "You are a storyteller for children. You write long, detailed stories with many characters, places and "
    "events, and you never stop early. Every story has a beginning, a middle and an end, and each part has several "
    "paragraphs. You describe the weather, the colours, the sounds and the smells of every place. You give every "
    "character a name, a family and a reason for what they do. Your stories take place in old kingdoms, deep "
    "forests, high mountains and small fishing villages by the sea, and they are full of dragons, knights, "
    "wizards, talking animals, brave children and wise old women who know the secrets of the land."
)


def test_chat_says_context_full_then_drops_the_oldest_turn(smollm2: Path, tmp_path: Path) -> None:
    """n_ctx 256: the first answer runs into the context's end and says so; the next question does not fit with the
    history, so the oldest turn leaves (the system prompt stays) and the chat goes on instead of refusing."""
    child = spawn_chat(tmp_path, str(smollm2), "-c", "256", "-t", "1", "--system", STORY_SYSTEM)
    try:
        story, n1 = say(child, "Tell me a story about a dragon.")
        assert story.endswith("[context full]"), story
        assert n1 >= 250 and int(child.match.group(2)) == 256, child.match.group(0)

        child.expect_exact("> ")
        child.sendline("What colour was the dragon?")
        child.expect_exact("[dropped 1 oldest turn to fit 256 tokens]")
        child.expect(KV_LINE)
        answer = ANSI.sub("", child.before).strip()
        assert answer, "no answer after the drop"
        assert int(child.match.group(1)) < 256
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_chat_help_and_a_pasted_paragraph(smollm2: Path, tmp_path: Path) -> None:
    """/help prints the help (and does not call itself unknown); three lines pasted at once are one message, one
    answer, not three turns."""
    child = spawn_chat(tmp_path, str(smollm2), "-c", "256", "-n", "8", "-t", "1")
    try:
        child.expect_exact("> ")
        child.sendline("/help")
        child.expect_exact("> ")
        assert "/reset clears the conversation" in child.before and "unknown" not in child.before, child.before
        child.send("Here is a list.\n1. apples\n2. pears\n")  # one write: what a terminal gets from a paste
        child.expect(KV_LINE)
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        assert not KV_LINE.search(child.before), "a second answer: the paste was sent as several turns"
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_dropping_turns_reprocesses_exactly(smollm2: Path) -> None:
    """ChatSession in a 256-token context: questions until the history no longer fits with room for an answer;
    then the oldest turns leave, the system prompt stays, the prompt takes at most half the context, and the answer
    (the kept turns evaluated again after the reused prefix) is the answer of a fresh cache to the same messages."""
    from ott_gguf import Llama
    from ott_gguf.chat import ChatSession, prompt_tokens

    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False)
    session = ChatSession(llm, system="You answer in one sentence.", max_tokens=16, temperature=0.0)
    try:
        # the counting the drop relies on is the prompt create_chat_completion evaluates
        msgs = [*session.messages, {"role": "user", "content": "Hello there."}]
        usage = llm.create_chat_completion(messages=msgs, max_tokens=1)["usage"]
        assert len(prompt_tokens(llm, msgs)) == usage["prompt_tokens"]
        session.reset()

        turns = 0
        for fruit in ["apples", "pears", "plums", "cherries", "lemons", "figs", "grapes", "melons"]:
            turns += 1
            question = f"Describe {fruit}: their colour, taste, smell, where they grow and how people cook them."
            answer = "".join(session.stream(question))
            assert answer and session.marker in ("", "[max tokens]")
            if session.dropped:
                break
        else:
            pytest.fail("eight turns fitted in 256 tokens: nothing was dropped")
        assert turns >= 3, "dropped before the history was long"
        assert session.messages[0] == {"role": "system", "content": "You answer in one sentence."}
        assert not session.messages[1]["content"].startswith("Describe apples")
        assert len(session.messages) == 1 + 2 * (turns - session.dropped)
        kept = session.messages[:-1]
        assert len(prompt_tokens(llm, kept)) <= 128  # dropped down to half the context: the next turns fit again
        assert session.kv_line().startswith("[kv ott2: ") and "/256 tokens" in session.kv_line()

        session.reset()  # an empty cache: the same messages from scratch
        fresh = llm.create_chat_completion(messages=kept, max_tokens=16, temperature=0.0)
        assert fresh["choices"][0]["message"]["content"] == answer
    finally:
        llm.close()


def test_gemma3_chat_says_its_guessed_format_in_one_line(gemma3: Path, tmp_path: Path) -> None:
    """Gemma 3's GGUF has no chat template: the chat says in one line which format it uses and how to choose
    another, with no Python warning and no llama.cpp log line."""
    res = subprocess.run(chat_command(str(gemma3), "-c", "256", "-n", "4", "-t", "1"), input="Hi\n",
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stderr == "", res.stderr  # no warning, no log line
    assert "UserWarning" not in res.stdout and "control-looking token" not in res.stdout, res.stdout
    notes = [line for line in res.stdout.splitlines() if "has no chat template" in line]
    assert len(notes) == 1 and "'gemma' format" in notes[0] and "--chat-format" in notes[0], res.stdout
    assert "[kv " in res.stdout
