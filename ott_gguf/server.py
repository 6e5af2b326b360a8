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

# the chat page (index.html, app.js, style.css) that `ott-gguf serve` has llama-server serve at its root URL
WEB_DIR = Path(__file__).resolve().with_name("web")
PAGE_COMPARED = ("f16", "q4_0")  # the cache types the page sets the served one against
PAGE_MEASURE_CTX = (512, 1024)  # context sizes the page's bytes are measured at (multiples of ott2's group)


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
    page: bool = False,
) -> list[str]:
    """The llama-server command line: kv_type (one type, or "K/V"), with type_k/type_v over one side each, maps to
    -ctk/-ctv (and flash attention on). With ott types, --ott-params carries ott_config (None: OttConfig(), the
    configuration ott_gguf.Llama runs by default) unless extra sets --ott-params itself. page: serve the chat page
    (WEB_DIR) at the root URL, with the cache's bytes for it (page_settings) in --ui-config, unless extra chooses
    its own static files (--path) or no UI (--no-ui)."""
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
        cmd += ["--ott-params", cfg.params_text()]
        if cfg.layer_widths:
            cmd += ["--ott-layers", cfg.layer_widths]
    if ott and not {"-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"} & set(extra):
        # the ott cache keeps one stream per sequence: tell the server, so each slot's context is n_ctx / n_slots
        # (llama-server forces a unified cache when the slot count is left on auto, so name it: 4, its auto value)
        cmd.append("--no-kv-unified")
        if not {"-np", "--parallel"} & set(extra):
            cmd += ["-np", "4"]
    if page and not {"--path", "--no-ui", "--no-webui"} & set(extra):
        for flag in ("--ui-config", "--webui-config", "--ui-config-file", "--webui-config-file"):
            if flag in extra:
                raise ValueError(f"{flag} is set by `ott-gguf serve` for its chat page; do not pass it too")
        if not (WEB_DIR / "index.html").is_file():
            raise FileNotFoundError(f"the chat page is missing from the installed package: {WEB_DIR / 'index.html'}")
        own_params = not ott or ott_config is not None or not {"--ott-params", "--ott-layers"} & set(extra)
        settings = cached_page_settings(model, k, v, ott_config if own_params else None, measure_own=own_params)
        cmd += ["--path", str(WEB_DIR), "--ui-config", json.dumps({"ott_gguf": settings})]
    return cmd + list(extra)


def page_settings(model: str | Path, type_k: str, type_v: str, ott_config: OttConfig | None = None,
                  measure_own: bool = True) -> dict[str, object]:  # fmt: skip
    """What the chat page shows of the cache and cannot ask llama-server: the served K/V type and, per type (it and
    PAGE_COMPARED), the bytes llama.cpp allocates for a cache of that type holding n tokens, a line fixed +
    per_token x n. A stock type's line is llama.cpp's closed form (n_layer x n_head_kv x head dims x the type's
    bytes per element, nothing fixed; `ott-gguf info` prints it beside the allocation); an ott type's, or any type's
    on a sliding-window model, is measured as `ott-gguf info` does, from what contexts of PAGE_MEASURE_CTX cells
    allocate. measure_own=False: the served type is left out (its parameters went to llama-server as they were)."""
    from .info import formula_bytes_per_token, measure_kv_bytes, model_info

    name = kv_pair_name(type_k, type_v)
    types = ([name] if measure_own else []) + [t for t in PAGE_COMPARED if t != name]
    shape = model_info(model)
    lines: dict[str, dict[str, float]] = {}
    how: dict[str, str] = {}
    for t in types:
        per_token = formula_bytes_per_token(shape, t)  # None for the ott types and sliding-window models
        if per_token is not None:
            lines[t], how[t] = {"per_token": per_token, "fixed": 0.0}, "closed form"
    tiers = {name: (name, ott_config)} if ott_config is not None else {}  # None: ott_gguf.Llama's default
    small, large = PAGE_MEASURE_CTX
    for b in measure_kv_bytes(model, [t for t in types if t not in lines], PAGE_MEASURE_CTX, tiers):
        lines[b.kv_type] = {"per_token": b.per_token, "fixed": b.fixed}
        how[b.kv_type] = f"measured at serve start from contexts of {small} and {large} cells"
    return {
        "kv_type": name,
        "bytes": {t: lines[t] for t in types},
        "note": "" if measure_own else "--ott-params/--ott-layers went to llama-server as given",
        "source": "bytes: what llama.cpp allocates for a cache of each type holding the context's tokens ("
        + "; ".join(f"{t}: {how[t]}" for t in types)
        + "); context: the last answer's prompt + completion tokens, of one slot's n_ctx (/props)",
    }


def cached_page_settings(model: str | Path, type_k: str, type_v: str, ott_config: OttConfig | None = None,
                         measure_own: bool = True) -> dict[str, object]:  # fmt: skip
    """page_settings, kept in the cache folder (models.cache_dir()/page) per model file, types, configuration and
    native build: measuring loads the model for its shape and two contexts (seconds), and only those change it."""
    import hashlib

    from ._lib import lib_path
    from .models import cache_dir

    model_stat, lib_stat = Path(model).resolve().stat(), lib_path("llama").stat()
    key = json.dumps([str(Path(model).resolve()), model_stat.st_size, model_stat.st_mtime_ns, type_k, type_v,
                      None if ott_config is None else [*ott_config.native(), ott_config.layer_widths], measure_own,
                      PAGE_COMPARED, PAGE_MEASURE_CTX, lib_stat.st_size, lib_stat.st_mtime_ns])  # fmt: skip
    path = cache_dir() / "page" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        return dict(json.loads(path.read_text()))
    settings = page_settings(model, type_k, type_v, ott_config, measure_own)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(settings))
    tmp.replace(path)  # whole or not at all, also with two servers starting at once
    return settings


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
