"""The chat page `ott-gguf serve` serves at its root URL (ott_gguf/web), driven in headless Chromium."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ott_gguf.chat import format_bytes  # the terminal chat's units, which app.js's formatBytes follows
from ott_gguf.info import formula_bytes_per_token, model_info
from ott_gguf.server import WEB_DIR, server_command

from helpers import require_tool, serving


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    JSON messages ending in a NUL byte, Chromium reading fd 3 and writing fd 4): no websocket client needed."""

    def __init__(self, profile: Path, log: Path, size: tuple[int, int] = (900, 700)) -> None:
        chromium = shutil.which("chromium")
        assert chromium
        # the pipes' child ends are moved to fds >= 10 first, so that bash's 3<& 4>& cannot overwrite them (dash takes
        # no fd above 9)
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        hi_r, hi_w = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)
        os.close(cmd_r)
        os.close(out_w)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--mute-audio", "--no-proxy-server",
                f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]  # fmt: skip
        self._log = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{hi_r} 4>&{hi_w}', chromium, *args],
                                     pass_fds=(hi_r, hi_w), stdout=self._log, stderr=subprocess.STDOUT)  # fmt: skip
        os.close(hi_r)
        os.close(hi_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None
        self.errors: list[str] = []  # the page's uncaught exceptions and console errors
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1,
                  mobile=False)  # fmt: skip

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._cmd_w, data) :]
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._out_r], [], [], left)[0]:
                    raise TimeoutError(f"no answer from Chromium to {method} within {timeout:.0f} s")
                chunk = os.read(self._out_r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed its DevTools pipe (exit status {self.proc.poll()})")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply["result"])
            if reply.get("method") == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(reply["params"]["exceptionDetails"])[:500])
            elif reply.get("method") == "Runtime.consoleAPICalled" and reply["params"]["type"] == "error":
                self.errors.append(json.dumps(reply["params"]["args"])[:500])

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"still false after {timeout:.0f} s: {expression}")

    def screenshot(self, path: Path) -> None:
        import base64

        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)
        self._log.close()


LAST_ANSWER = "document.querySelector('.msg.assistant:last-of-type')"


def ask(b: Browser, text: str, max_tokens: int) -> None:
    """Type a message and press Send, as a user would."""
    b.eval(f"document.getElementById('max-tokens').value = '{max_tokens}';"
           f"document.getElementById('input').value = {json.dumps(text)};"
           "document.getElementById('send').click()")  # fmt: skip


def answer(b: Browser) -> dict[str, Any]:
    """The last answer on the page: its text, the SSE deltas it came in, its marker, whether it is an error."""
    js = (f"(() => {{ const m = {LAST_ANSWER}; const k = m.querySelector('.marker');"
          "return {text: m.firstChild.data, pieces: Number(m.dataset.pieces), marker: k ? k.textContent.trim() : '',"
          " error: m.classList.contains('error')}; })()")  # fmt: skip
    return dict(b.eval(js))


def cache_line(facts: dict[str, Any], used: int, n_ctx: int, stale: bool = False) -> str:
    """The page's cache line without its tokens/s, from the facts `ott-gguf serve` gave it (app.js renderCache)."""

    def all_types(n: int) -> str:
        return ", ".join(f"{t} {format_bytes(b['fixed'] + b['per_token'] * n)}" for t, b in facts["bytes"].items())

    shown = f"{'≥' if stale else ''}{used}"
    line = f"kv {facts['kv_type']} · context {shown}/{n_ctx} tokens"
    if used:
        line += f" · cache for {shown}: {all_types(used)}"
    return line + f" · for {n_ctx}: {all_types(n_ctx)}"


def test_byte_counts_round_a_tie_as_the_page_does() -> None:
    """app.js's formatBytes (toFixed, Math.round) rounds an exact tie up; format_bytes, which the terminal chat shows
    and the page test compares with, does too (40 tokens of SmolLM2's q4_0 cache are 253.125 KiB: the page said
    253.13, Python's format 253.12)."""
    assert format_bytes(253.125 * 1024) == "253.13 KiB" and format_bytes(1.005 * 1024) == "1.00 KiB"  # 1.005: below
    assert format_bytes(2.5) == "3 B" and format_bytes(900 * 1024) == "900.00 KiB"
    assert format_bytes(5.57 * 1024**2) == "5.57 MiB" and format_bytes(3 * 1024**3) == "3.00 GiB"


def test_chat_page_streams_an_answer_in_chromium(smollm2: Path, tmp_path: Path) -> None:
    """`ott-gguf serve` answers / with the page; Chromium sends a message, the answer streams in (several SSE
    deltas), Stop ends a long answer, the cache line counts the context and the bytes, New chat clears it; a
    screenshot is written to tmp_path."""
    require_tool("chromium", hint="Debian package chromium (make apt-test)")
    with serving(smollm2, "ott2", 2048, tmp_path / "server.log") as srv:
        with urllib.request.urlopen(srv.url + "/", timeout=10) as r:
            assert r.read() == (WEB_DIR / "index.html").read_bytes()
        with urllib.request.urlopen(srv.url + "/props", timeout=10) as r:
            props = json.loads(r.read())
        facts = props["ui_settings"]["ott_gguf"]
        assert facts["kv_type"] == "ott2" and set(facts["bytes"]) == {"ott2", "f16", "q4_0"}, facts
        # ott2 measured (a fixed part: the fp16 tail and the pools), the stock types in llama.cpp's closed form
        shape = model_info(smollm2)
        for t in ("f16", "q4_0"):
            assert facts["bytes"][t] == {"per_token": formula_bytes_per_token(shape, t), "fixed": 0.0}, (t, facts)
        ott2 = facts["bytes"]["ott2"]
        assert 0 < ott2["per_token"] < facts["bytes"]["q4_0"]["per_token"] and ott2["fixed"] > 0, facts
        assert "ott2: measured at serve start" in facts["source"], facts
        n_ctx = props["default_generation_settings"]["n_ctx"]
        assert n_ctx == 512  # 2048 over ott2's 4 slots

        b = Browser(tmp_path / "profile", tmp_path / "chromium.log")
        try:
            b.call("Page.navigate", url=srv.url + "/")
            b.wait_for("document.body && document.body.dataset.state === 'idle'", timeout=20)
            assert b.eval("document.title") == "ott-gguf chat"
            assert b.eval("document.getElementById('cache').textContent") == cache_line(facts, 0, n_ctx)

            ask(b, "Name a fruit.", 16)
            b.wait_for(f"{LAST_ANSWER}?.dataset.done === 'true'")
            first = answer(b)
            assert not first["error"] and first["text"].strip() and first["marker"] in ("", "[max tokens]"), first
            assert first["pieces"] >= 2, first  # streamed: the text came in several SSE deltas
            line = b.eval("document.getElementById('cache').textContent")
            used = int(line.split("context ", 1)[1].split("/", 1)[0])
            assert 0 < used < n_ctx, line
            assert line.startswith(cache_line(facts, used, n_ctx) + " · ") and line.endswith(" tokens/s"), line

            # Stop: a long answer ends where it got, marked, and the page takes the next message
            ask(b, "Count from 1 to 100, one number per line.", 400)
            b.wait_for(f"Number({LAST_ANSWER}?.dataset.pieces) >= 2")
            b.eval("document.getElementById('stop').click()")
            b.wait_for(f"{LAST_ANSWER}.dataset.done === 'true' && document.body.dataset.state === 'idle'", 10)
            stopped = answer(b)
            assert stopped["marker"] == "[stopped]" and not stopped["error"], stopped
            assert 2 <= stopped["pieces"] < 400, stopped
            assert b.eval("document.querySelectorAll('.msg').length") == 4
            # no usage comes for a stopped answer: the count is the last one's, marked as a lower bound
            line = b.eval("document.getElementById('cache').textContent")
            assert line.startswith(cache_line(facts, used, n_ctx, stale=True) + " · "), line
            b.screenshot(tmp_path / "chat.png")

            b.eval("document.getElementById('new-chat').click()")
            assert b.eval("document.querySelectorAll('.msg').length") == 0
            assert b.eval("document.getElementById('cache').textContent") == cache_line(facts, 0, n_ctx)
            assert not b.errors, b.errors
        finally:
            b.close()
    png = (tmp_path / "chat.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000, len(png)


def test_page_options_of_server_command(smollm2: Path) -> None:
    """The page's flags only where asked for; the user's own --path or --no-ui wins; --ui-config is refused (the
    page's cache facts travel in it)."""
    assert "--path" not in server_command(smollm2, kv_type="ott2")
    for own in (["--path", "/srv/www"], ["--no-ui"]):
        cmd = server_command(smollm2, kv_type="q8_0", extra=own, page=True)
        assert "--ui-config" not in cmd and str(WEB_DIR) not in cmd, cmd
    with pytest.raises(ValueError, match="--ui-config is set by `ott-gguf serve`"):
        server_command(smollm2, kv_type="ott2", extra=["--ui-config", "{}"], page=True)
