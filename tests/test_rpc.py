"""ott caches on llama.cpp's RPC backend, on loopback: two ggml-rpc-server processes of this build hold most layers
(their caches and the ott ops with them), the client's CPU the first ones. Every process a test starts is stopped
in a finally block."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ott_gguf._lib import BIN_DIR, bin_path, build_info
from ott_gguf.calibrate import perplexity_numbers
from ott_gguf.corpus import docs_text
from ott_gguf.llama import Llama
from ott_gguf.server import Server
from study.rpc import proxy, rpc_servers

from helpers import serving

N_CTX = 512  # R + G = 160 tokens stay fp16: 512 seals groups in every layer
CHUNKS = 2
NGL = 24  # of SmolLM2's 30 layers: 0-5 stay on the client's CPU, the rest are split between the two servers

pytestmark = pytest.mark.skipif(build_info().get("rpc") != "ON", reason="built without OTT_GGUF_RPC")


def perplexity(model: Path, text: Path, kv: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [str(bin_path("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(N_CTX), "-b", str(N_CTX),
           "--chunks", str(CHUNKS), "-t", "2", "-fa", "on", "-ctk", kv, "-ctv", kv, *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("rpc") / "text.txt"
    p.write_text(docs_text(CHUNKS * N_CTX * 8))
    return p


def test_rpc_server_is_installed() -> None:
    exe = BIN_DIR / "ggml-rpc-server"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=30)
    assert "--port" in r.stdout + r.stderr


def test_split_over_two_servers_and_the_cpu_gives_the_single_host_logits(
    smollm2: Path, text: Path, tmp_path: Path
) -> None:
    base = tmp_path / "single.kld"
    r = perplexity(smollm2, text, "ott2", "--kl-divergence-base", str(base))
    assert r.returncode == 0, r.stderr[-3000:]
    with rpc_servers(2) as endpoints:
        r = perplexity(smollm2, text, "ott2", "-ngl", str(NGL), "--rpc", ",".join(endpoints),
                       "--kl-divergence-base", str(base), "--kl-divergence", "-lv", "4")  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    # the caches of the offloaded layers live in the servers' buffers (so their ops run there), the rest here
    for ep in endpoints:
        assert re.search(rf"ott2 cache on RPC\d+\[{re.escape(ep)}\]", log), log[-3000:]
    assert "ott2 cache on CPU" in log
    num = perplexity_numbers(log)
    # not bit for bit (presumably another summation order in the servers' matmuls; not checked). Measured: mean
    # KLD 0.000000 (6 decimals), 99.9% 0.000049, top-1 100%; ott2 against f16 is about 0.05 on this model, so these
    # bounds leave a wrong op no room
    assert num["mean_kld"] <= 1e-5 and num["kld_999"] <= 1e-3 and num["top1"] >= 99.0, num


def test_a_server_without_the_ott_ops_is_refused_naming_it(smollm2: Path, text: Path) -> None:
    with rpc_servers(1) as (ep,), proxy(ep, hide_ott=True) as stock:
        r = perplexity(smollm2, text, "ott2", "-ngl", "99", "--rpc", stock.endpoint, timeout=120)
        log = r.stdout + r.stderr
        assert r.returncode != 0
        assert f"at {stock.endpoint}, whose rpc-server has no ott ops" in log, log[-3000:]
        assert "protocol 7.0.0" in log
        # the same server is fine for the stock cache types: the refusal is the ott ops', not the relay's
        r = perplexity(smollm2, text, "f16", "-ngl", "99", "--rpc", stock.endpoint, "--chunks", "1", timeout=120)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def complete(srv: Server, tokens: list[int], slot: int) -> tuple[str, int]:
    """Greedy /completion of a token prompt on one slot: (text, prompt tokens taken from the slot's cache)."""
    body = {"prompt": tokens, "n_predict": 16, "temperature": 0.0, "id_slot": slot, "cache_prompt": True}
    req = urllib.request.Request(srv.url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return str(out["content"]), int(out["timings"]["cache_n"])


def slot_action(srv: Server, slot: int, action: str, filename: str) -> None:
    body = json.dumps({"filename": filename}).encode()
    req = urllib.request.Request(f"{srv.url}/slots/{slot}?action={action}", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_server_with_two_slots_over_rpc_answers_as_one_host_and_its_slot_state_moves_to_one_host(
    smollm2: Path, tmp_path: Path
) -> None:
    """llama-server with 2 slots, every layer on one loopback rpc-server: concurrent requests answer as on a single
    host; slot 0's saved state (sealed groups computed remotely) restored into a single-host server serves the
    same prompt from its cache with the same answer."""
    vocab = Llama(str(smollm2), vocab_only=True, verbose=False)
    toks = vocab.tokenize(docs_text(12_000).encode(), add_bos=False)
    vocab.close()
    # 564 = R + 4 groups + 20: after 16 generated tokens the slot still has 4 sealed groups, so reusing the prompt
    # without its answer is a cut in the fp16 tail, which the ott cache allows
    a, b = toks[:564], toks[1000:1400]
    flags = ["-np", "2", "--slot-save-path", str(tmp_path / "slots")]
    (tmp_path / "slots").mkdir()
    with rpc_servers(1) as (ep,):
        with serving(
            smollm2, "ott2", 2048, tmp_path / "rpc.log", extra=[*flags, "-ngl", "99", "--rpc", ep, "-lv", "4"]
        ) as srv:
            with ThreadPoolExecutor(2) as pool:
                remote = list(pool.map(lambda job: complete(srv, *job), [(a, 0), (b, 1)]))
            slot_action(srv, 0, "save", "a.bin")
    log = (tmp_path / "rpc.log").read_text()
    assert re.search(rf"ott2 cache on RPC\d+\[{re.escape(ep)}\]", log), log[-3000:]
    shutil.copy(tmp_path / "slots" / "a.bin", tmp_path / "slots" / "moved.bin")
    with serving(smollm2, "ott2", 2048, tmp_path / "single.log", extra=flags) as srv:
        slot_action(srv, 0, "restore", "moved.bin")
        text_a, cached = complete(srv, a, 0)
        assert cached >= len(a) - 1 - 16, cached  # served from the restored state, not recomputed
        assert text_a == remote[0][0]
        assert complete(srv, b, 1)[0] == remote[1][0]
    assert all(t.strip() for t, _ in remote)
