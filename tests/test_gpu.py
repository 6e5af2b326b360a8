"""Where the ott2 ops run, and the CUDA path against the CPU path on real models.

The placement check runs everywhere: llama-perplexity with the scheduler's debug listing (GGML_SCHED_DEBUG=2)
shows the backend of every node, and every GGML_OP_OTT_* node must run where the cache lives: the CPU in a
CPU build, CUDA0 for a fully offloaded model in a CUDA build (no ott2 op may fall back to the CPU there).

The GPU tests need a CUDA build (`make gpu-test` builds one) and an NVIDIA GPU; they are skipped otherwise
and CI (no GPU) reports them as skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from ott_gguf import build_info
from ott_gguf._lib import bin_path
from ott_gguf.corpus import docs_text

from helpers import eval_logits, kl_divergence

# "node # 14 (OTT_ATTN_P):      ott_attn_part-0 ( 334K) [  CPU  cause]": op (cut to 10), name, backend
NODE = re.compile(r"node #\s*\d+ \(\s*(OTT_[A-Z_]*)\):\s+(ott_[a-z_]+)-\d+ \([^)]*\) \[\s*(\S+)")
OPS = {"ott_attn_part", "ott_attn", "ott_seal"}


def cuda_build() -> bool:
    return str(build_info().get("cuda", "OFF")).upper() in ("ON", "TRUE", "1")


def gpu_present() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"],
                                                                     capture_output=True).returncode == 0  # fmt: skip


needs_gpu = pytest.mark.skipif(not (cuda_build() and gpu_present()),
                               reason="needs a CUDA build of ott-gguf and an NVIDIA GPU (make gpu-test)")  # fmt: skip


def ott_op_backends(model: Path, ngl: int, tmp_path: Path) -> dict[str, set[str]]:
    """{node name: backends its nodes ran on} from one llama-perplexity run with the scheduler's debug listing."""
    text = tmp_path / "text.txt"
    text.write_text(docs_text()[:20000])
    env = dict(os.environ, GGML_SCHED_DEBUG="2")
    res = subprocess.run(
        [str(bin_path("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "128", "--chunks", "1",
         "-ctk", "ott2", "-ctv", "ott2", "-ngl", str(ngl), "-lv", "5", "-t", "2"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, set[str]] = defaultdict(set)
    for _op, name, backend in NODE.findall(res.stderr + res.stdout):
        out[name].add(backend)
    return dict(out)


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
@pytest.mark.parametrize(("ngl", "backend"), [(0, "CPU"), pytest.param(99, "CUDA0", marks=needs_gpu)],
                         ids=["cpu", "gpu-offloaded"])  # fmt: skip
def test_ott_ops_run_where_the_cache_is(model_name: str, ngl: int, backend: str, request: pytest.FixtureRequest,
                                        tmp_path: Path) -> None:  # fmt: skip
    """CPU build or -ngl 0: every ott2 op on the CPU; CUDA build with the model offloaded: every one on CUDA0."""
    placed = ott_op_backends(request.getfixturevalue(model_name), ngl, tmp_path)
    assert set(placed) == OPS, placed
    assert all(b == {backend} for b in placed.values()), placed


@needs_gpu
@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0", "ott2"])
def test_gpu_logits_match_the_cpu_path(smollm2: Path, kv_type: str) -> None:
    """The same tokens through the fully offloaded model and through the CPU: the GPU path of every cache
    type agrees with its CPU path (ott2: the same state bit for bit, attention within fp32 rounding; the rest of
    the model differs by the GPU's matmul rounding, which the f16 row measures)."""
    from ott_gguf import Llama

    llm = Llama(str(smollm2), vocab_only=True, verbose=False)
    tokens = llm.tokenize(docs_text(40_000).encode())[:1200]
    llm.close()
    cpu = eval_logits(smollm2, kv_type, tokens, n_ctx=2048, n_gpu_layers=0)
    gpu = eval_logits(smollm2, kv_type, tokens, n_ctx=2048, n_gpu_layers=99)
    kld = kl_divergence(cpu, gpu)
    top1 = float(np.mean(cpu.argmax(1) == gpu.argmax(1)))
    print(f"{kv_type}: KLD(cpu || gpu) mean {kld.mean():.5f} max {kld.max():.5f}, top-1 agreement {top1:.4f}")
    assert kld.mean() < 0.01 and top1 > 0.95


@needs_gpu
def test_gpu_greedy_generation(smollm2: Path) -> None:
    """Greedy generation with the model fully offloaded, per cache type: ott2's text is close to f16's on the GPU."""
    from ott_gguf import Llama

    prompt = docs_text()[:3000]
    outs = {}
    for kv in ("f16", "q8_0", "q4_0", "ott2"):
        llm = Llama(str(smollm2), kv_type=kv, n_ctx=4096, n_gpu_layers=99, verbose=False)
        try:
            outs[kv] = llm(prompt, max_tokens=48, temperature=0.0)["choices"][0]["text"]
        finally:
            llm.close()
        print(f"{kv}: {outs[kv]!r}")
    assert all(outs.values())


@needs_gpu
def test_keys_by_age_refuse_a_cache_on_the_gpu_by_name(smollm2: Path) -> None:
    """Young keys (k_young) have CPU kernels only: with the cache offloaded to CUDA0 the context is refused, naming
    k_young (not run elsewhere), and with no_kv_offload it runs."""
    from ott_gguf import Llama

    with pytest.raises(ValueError, match=r"keeps its cache on CUDA0, but keys by age \(k_young=4\) run on the CPU"):
        Llama(str(smollm2), kv_type="ott2", n_ctx=1024, n_gpu_layers=99, ott_config={"k_young": 4}, verbose=False)
    llm = Llama(str(smollm2), kv_type="ott2", n_ctx=1024, n_gpu_layers=99, offload_kqv=False,
                ott_config={"k_young": 4}, verbose=False)  # fmt: skip
    assert llm(docs_text()[:2000], max_tokens=4, temperature=0.0)["choices"][0]["text"]
    llm.close()
