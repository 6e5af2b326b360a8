"""llama.cpp's Vulkan backend in this build, run on lavapipe (Mesa's Vulkan on the CPU, installed by the Makefile)
where no GPU is present: AUTO builds it when its build dependencies are there, SmolLM2 with an f16 cache runs fully
offloaded to Vulkan0 with the CPU's logits, and an ott cache on a Vulkan layer is refused with a clear error (the
seal has no Vulkan kernel yet; the attention ops do: test_vulkan_ops.py), never a crash or a silent move to the
CPU; with -nkvo the ott cache stays on the CPU, by the user's choice, while the layers' weights run on Vulkan0
(llama-perplexity, and ott_gguf.Llama)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ott_gguf._lib import bin_path, build_info
from ott_gguf.calibrate import perplexity_numbers
from ott_gguf.corpus import docs_text

N_CTX = 256  # 160 tokens (R + G) stay fp16: 256 seals a group in every layer
CHUNKS = 1
LAYERS = 31  # SmolLM2-135M: 30 blocks and the output layer

# what OTT_GGUF_VULKAN=AUTO looks for (Debian: libvulkan-dev, glslc, spirv-headers)
VK_BUILD_DEPS = {
    "libvulkan-dev": Path("/usr/include/vulkan/vulkan.hpp").exists(),
    "glslc": shutil.which("glslc") is not None,
    "spirv-headers": Path("/usr/include/spirv/unified1/spirv.hpp").exists(),
}


def test_auto_builds_vulkan_when_its_build_dependencies_are_present() -> None:
    info = build_info()
    if info.get("vulkan_option") == "AUTO" and all(VK_BUILD_DEPS.values()):
        assert info["vulkan"] == "ON", info
    elif info.get("vulkan_option") == "ON":
        assert info["vulkan"] == "ON", info
    else:
        # a developer build without the packages (the Makefile installs them, so CI never gets here)
        assert info["vulkan"] == "OFF", (info, VK_BUILD_DEPS)


needs_vulkan = pytest.mark.skipif(build_info().get("vulkan") != "ON", reason="built without the Vulkan backend")


def run(
    tool: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_path(tool)), *args], capture_output=True, text=True, timeout=timeout, env=env)


def perplexity(env: dict[str, str], model: Path, text: Path, kv: str, *args: str) -> subprocess.CompletedProcess[str]:
    # -lv 4: the info lines the tests read (layers offloaded, where each buffer and cache lives)
    return run("llama-perplexity", "-m", str(model), "-f", str(text), "-c", str(N_CTX), "-b", str(N_CTX),
               "--chunks", str(CHUNKS), "-t", "2", "-fa", "on", "-ctk", kv, "-ctv", kv, "-lv", "4", *args,
               env=env)  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("vulkan") / "text.txt"
    p.write_text(docs_text(CHUNKS * N_CTX * 8))
    return p


@pytest.fixture(scope="module")
def vk_env() -> dict[str, str]:
    """The environment that makes a Vulkan device Vulkan0: ggml-vulkan hides CPU-type devices (lavapipe's llvmpipe)
    unless GGML_VK_VISIBLE_DEVICES names them, so without a GPU the tests name device 0. No device is a failure."""

    def vulkan0(env: dict[str, str]) -> str | None:
        r = run("llama-cli", "--list-devices", env=env, timeout=60)
        m = re.search(r"^\s*Vulkan0: (.+)$", r.stdout + r.stderr, re.M)
        return m.group(1) if m else None

    env = dict(os.environ)
    if vulkan0(env) is None and "GGML_VK_VISIBLE_DEVICES" not in env:
        env["GGML_VK_VISIBLE_DEVICES"] = "0"
    assert vulkan0(env), (
        "the build has the Vulkan backend but no Vulkan device was found: install a Vulkan driver "
        "(lavapipe: Debian's mesa-vulkan-drivers)"
    )
    return env


def vulkan0_against_cpu(env: dict[str, str], model: Path, text: Path, kv: str, tmp_path: Path, *extra: str) -> str:
    """llama-perplexity's log of every layer on Vulkan0 (plus `extra` flags), KL divergence against the CPU-only
    run of the same cache type."""
    base = tmp_path / "cpu.kld"
    r = perplexity(env, model, text, kv, "-ngl", "0", "-dev", "none", "--kl-divergence-base", str(base))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    r = perplexity(env, model, text, kv, "-ngl", "99", "-dev", "Vulkan0", *extra, "--kl-divergence-base", str(base),
                   "--kl-divergence")  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert f"offloaded {LAYERS}/{LAYERS} layers to GPU" in log, log[-3000:]
    return log


@needs_vulkan
def test_f16_cache_fully_offloaded_to_vulkan0_gives_the_cpu_logits(
    smollm2: Path, text: Path, vk_env: dict[str, str], tmp_path: Path
) -> None:
    log = vulkan0_against_cpu(vk_env, smollm2, text, "f16", tmp_path)
    assert re.search(r"Vulkan0 KV buffer size", log), log[-3000:]
    num = perplexity_numbers(log)
    # other kernels (ggml-vulkan's matmuls and flash attention against ggml-cpu's, which quantizes the activations
    # to q8_1 for Q4_1 weights): close, not bit for bit. Measured on lavapipe (llvmpipe, LLVM 15.0.6): mean KLD
    # 0.0055, top-1 93.7% (255 tokens); ott2 against f16 is about 0.05 on this model, a wrong op far more
    assert num["mean_kld"] <= 0.02 and num["top1"] >= 85.0, num


@needs_vulkan
def test_ott_cache_on_a_vulkan_layer_is_refused_with_a_clear_error(
    smollm2: Path, text: Path, vk_env: dict[str, str]
) -> None:
    r = perplexity(vk_env, smollm2, text, "ott2", "-ngl", "99", "-dev", "Vulkan0")
    log = r.stdout + r.stderr
    # an error exit, not a signal (abort, segfault) and not a run that moved the cache to the CPU
    assert r.returncode == 1, (r.returncode, log[-3000:])
    assert "ott2: layer 0 is offloaded to Vulkan, which has no ott ops" in log, log[-3000:]
    assert "-nkvo" in log
    assert "ott2 cache on" not in log


@needs_vulkan
def test_ott_cache_kept_on_the_cpu_with_nkvo_while_the_layers_run_on_vulkan0(
    smollm2: Path, text: Path, vk_env: dict[str, str], tmp_path: Path
) -> None:
    log = vulkan0_against_cpu(vk_env, smollm2, text, "ott2", tmp_path, "-nkvo")
    assert "ott2 cache on CPU" in log and "ott2 cache on Vulkan" not in log, log[-3000:]
    num = perplexity_numbers(log)
    # the same cache and ops on the CPU, the rest on Vulkan0: measured mean KLD 0.0099, top-1 93.7%
    assert num["mean_kld"] <= 0.03 and num["top1"] >= 85.0, num


# ott_gguf.Llama in a process of its own: GGML_VK_VISIBLE_DEVICES must be set before ggml registers its backends
LLAMA_SCRIPT = """
import json, sys
from ott_gguf import Llama
out = {}
try:
    Llama(sys.argv[1], kv_type="ott2", n_gpu_layers=-1, n_ctx=512, verbose=False)
    out["refused"] = None
except ValueError as e:
    out["refused"] = str(e)
llm = Llama(sys.argv[1], kv_type="ott2", n_gpu_layers=-1, offload_kqv=False, n_ctx=512, verbose=False)
msg = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
r = llm.create_chat_completion(msg, max_tokens=32, temperature=0.0)
out["answer"] = r["choices"][0]["message"]["content"]
llm.close()
print(json.dumps(out))
"""


@needs_vulkan
def test_python_llama_refuses_ott_on_vulkan_and_answers_with_the_cache_on_the_cpu(
    smollm2: Path, vk_env: dict[str, str]
) -> None:
    r = subprocess.run([sys.executable, "-c", LLAMA_SCRIPT, str(smollm2)], capture_output=True, text=True, timeout=600,
                       env=vk_env)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["refused"] is not None and "ott2: layer 0 is offloaded to Vulkan, which has no ott ops" in out["refused"]
    # greedy, weights on Vulkan0 and the ott2 cache on the CPU (offload_kqv=False); measured: "The capital of
    # France is Paris.", as on the CPU alone
    assert "Paris" in out["answer"], out
