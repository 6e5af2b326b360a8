"""Start ott-gguf's patched llama-server (installed in this package) with K/V cache types by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ._lib import bin_path
from .kv_types import OTT_KV_TYPES, OttConfig, kv_pair_name, resolve_kv_types


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(
    model: str | Path,
    *,
    kv_type: str = "f16",
    type_k: str | None = None,
    type_v: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    extra: Sequence[str] = (),
    ott_config: OttConfig | None = None,
) -> list[str]:
    """The llama-server command line: kv_type (one type, or "K/V"), with type_k/type_v over one side each, maps to
    -ctk/-ctv (and flash attention on). With ott types, --ott-params carries ott_config (None: OttConfig(), the
    configuration ott_gguf.Llama runs by default) unless extra sets --ott-params itself."""
    k, v = resolve_kv_types(kv_type, type_k, type_v)
    name = kv_pair_name(k, v)
    ott = k in OTT_KV_TYPES
    if not Path(model).exists():
        raise FileNotFoundError(f"model file not found: {model}")
    for flag in ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"):
        if flag in extra:
            raise ValueError(f"{flag} is set by --kv-type/--type-k/--type-v; do not pass it too")
    if ott_config is not None and "--ott-params" in extra:
        raise ValueError("--ott-params is set by ott_config; do not pass it too")
    if ott_config is not None and not ott:
        raise ValueError(f"ott_config applies to the ott cache types ({', '.join(OTT_KV_TYPES)}), not {name!r}")
    cmd = [str(bin_path("llama-server")), "-m", str(model), "--host", host, "--port", str(port),
           "-ctk", k, "-ctv", v, "-fa", "on"]  # fmt: skip
    if ott and (ott_config is not None or "--ott-params" not in extra):
        # G,R,OUTLIERS,AUX,NO_OUTLIER_LAYERS,V_ROTATE: Python's defaults, not the C ones, when none is given
        cfg = ott_config or OttConfig()
        cmd += ["--ott-params", ",".join(str(x) for x in cfg.native())]
        if cfg.layer_widths:
            cmd += ["--ott-layers", cfg.layer_widths]
    if ott and not {"-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"} & set(extra):
        # the ott cache keeps one stream per sequence: tell the server, so each slot's context is n_ctx / n_slots
        # (llama-server forces a unified cache when the slot count is left on auto, so name it: 4, its auto value)
        cmd.append("--no-kv-unified")
        if not {"-np", "--parallel"} & set(extra):
            cmd += ["-np", "4"]
    return cmd + list(extra)


class Server:
    """A running llama-server child process; a context manager that stops it."""

    def __init__(
        self, cmd: list[str], host: str, port: int, log: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.cmd, self.host, self.port = cmd, host, port
        self._log = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env or os.environ.copy())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with status {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"llama-server did not become healthy within {timeout:.0f} s")

    def chat(self, messages: list[dict[str, str]], **params: object) -> dict[str, object]:
        body = json.dumps({"messages": messages, **params}).encode()
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(
    model: str | Path,
    *,
    kv_type: str = "f16",
    type_k: str | None = None,
    type_v: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra: Sequence[str] = (),
    log: Path | None = None,
) -> Server:
    """Start llama-server on host:port (a free port when None) and return without waiting for health."""
    port = free_port(host) if port is None else port
    cmd = server_command(model, kv_type=kv_type, type_k=type_k, type_v=type_v, host=host, port=port, extra=extra)
    return Server(cmd, host, port, log)
