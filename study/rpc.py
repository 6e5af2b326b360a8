"""llama.cpp's RPC backend on loopback, for the tests (tests/test_rpc.py) and the traffic measurement of the README:
ggml-rpc-server processes of this build, and a relay that counts the bytes each way.

    python -m study.rpc MODEL.gguf    # bytes per decoded token over RPC, f16 and ott2 (llama-bench through the relay)
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ott_gguf._lib import bin_path
from ott_gguf.server import free_port

HOST = "127.0.0.1"
# the HELLO answer: 8 bytes of size, then major, minor, patch (ggml-rpc.cpp's rpc_msg_hello_rsp)
PATCH_BYTE = 8 + 2


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"ggml-rpc-server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection((HOST, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"ggml-rpc-server did not listen on {HOST}:{port} within {timeout} s")


@contextmanager
def rpc_servers(n: int) -> Iterator[list[str]]:
    """n ggml-rpc-server processes of this build on loopback, one thread each (the machine has two cores)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        for _ in range(n):
            port = free_port(HOST)
            cmd = [str(bin_path("ggml-rpc-server")), "-H", HOST, "-p", str(port), "-t", "1"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ports.append(port)
        for port, p in zip(ports, procs, strict=True):
            wait_port(port, p)
        yield [f"{HOST}:{p}" for p in ports]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


class Proxy:
    """A TCP relay to one server that counts the bytes each way; with hide_ott it rewrites the patch version of the
    server's HELLO answer to 0, what a stock ggml-rpc-server of the pinned llama.cpp answers (it has no ott ops)."""

    def __init__(self, target: str, hide_ott: bool = False) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.hide_ott = hide_ott
        self.sent = 0  # client -> server
        self.received = 0  # server -> client
        self.lock = threading.Lock()
        self.listener = socket.create_server((HOST, 0))
        self.endpoint = f"{HOST}:{self.listener.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        self.thread = threading.Thread(target=self.accept, daemon=True)
        self.thread.start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.target)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks += [client, server]
            threading.Thread(target=self.pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self.pipe, args=(server, client, False), daemon=True).start()

    def pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        at = 0  # bytes of this connection's answers so far
        try:
            while data := src.recv(1 << 20):
                if not upstream and self.hide_ott and at <= PATCH_BYTE < at + len(data):
                    b = bytearray(data)
                    b[PATCH_BYTE - at] = 0
                    data = bytes(b)
                at += len(data)
                with self.lock:
                    if upstream:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


@contextmanager
def proxy(target: str, hide_ott: bool = False) -> Iterator[Proxy]:
    p = Proxy(target, hide_ott)
    try:
        yield p
    finally:
        p.close()


def decode_bytes(model: str, kv: str, endpoint: str, n_gen: int) -> tuple[int, int]:
    """Bytes (to the server, from it) of llama-bench generating n_gen tokens with every layer on the server."""
    with proxy(endpoint) as p:
        cmd = [str(bin_path("llama-bench")), "-m", model, "-p", "0", "-n", str(n_gen), "-r", "1", "-t", "1",
               "-ngl", "99", "-fa", "1", "-ctk", kv, "-ctv", kv, "--rpc", p.endpoint]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        return p.sent, p.received


def main(argv: list[str] | None = None) -> None:
    model = (argv or sys.argv[1:])[0]
    lo, hi = 16, 80  # the difference of two runs leaves out the model upload, the warm-up and the setup
    with rpc_servers(1) as (ep,):
        for kv in ("f16", "ott2"):
            s0, r0 = decode_bytes(model, kv, ep, lo)
            s1, r1 = decode_bytes(model, kv, ep, hi)
            n = hi - lo
            print(f"{kv}: {(s1 - s0) / n:.0f} bytes/token to the server, {(r1 - r0) / n:.0f} from it")


if __name__ == "__main__":
    main()
