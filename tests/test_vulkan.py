"""llama.cpp's Vulkan backend in this build, run on lavapipe (Mesa's Vulkan on the CPU, installed by the Makefile)
where no GPU is present: AUTO builds it when its build dependencies are there, SmolLM2 with an f16 cache and with
an ott2 cache runs offloaded to Vulkan0 with the CPU's logits (llama-perplexity on three layers, ott_gguf.Llama on
all; the ott ops on Vulkan: test_vulkan_ops.py checks each against the reference); with -nkvo the ott cache stays on
the CPU, by the user's choice, while the layers' weights run on Vulkan0."""

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

# lavapipe runs SmolLM2's layers at about 2 tokens/s on 2 cores: each run is as short as llama-perplexity allows
# (its KL divergence statistics need 100 scored tokens: the second half of a 208-token chunk). The ott runs keep
# R = 0 (OTT_PARAMS): the first group is sealed after 128 tokens, and the last three of seven 32-token ubatches attend
# to it
N_CTX = 208
OTT_PARAMS = ("--ott-params", "128,0,3,32,2")
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


def perplexity(env: dict[str, str], model: Path, text: Path, kv: str, *args: str,
               n_ctx: int = N_CTX) -> subprocess.CompletedProcess[str]:  # fmt: skip
    # -lv 4: the info lines the tests read (layers offloaded, where each buffer and cache lives)
    return run("llama-perplexity", "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-b", str(n_ctx),
               "--chunks", str(CHUNKS), "-t", "2", "-fa", "on", "-ctk", kv, "-ctv", kv, "-lv", "4", *args,
               env=env)  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("vulkan") / "text.txt"
    p.write_text(docs_text(CHUNKS * N_CTX * 16))  # llama-perplexity wants 2 * n_ctx tokens
    return p


def vulkan0(env: dict[str, str]) -> str | None:
    """Vulkan0's description in this environment (llama.cpp's device list), None if there is none."""
    r = run("llama-cli", "--list-devices", env=env, timeout=60)
    m = re.search(r"^\s*Vulkan0: (.+)$", r.stdout + r.stderr, re.M)
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def vk_env() -> dict[str, str]:
    """The environment that makes a Vulkan device Vulkan0: ggml-vulkan hides CPU-type devices (lavapipe's llvmpipe)
    unless GGML_VK_VISIBLE_DEVICES names them, so without a GPU the tests name device 0. No device is a failure."""
    env = dict(os.environ)
    if vulkan0(env) is None and "GGML_VK_VISIBLE_DEVICES" not in env:
        env["GGML_VK_VISIBLE_DEVICES"] = "0"
    assert vulkan0(env), (
        "the build has the Vulkan backend but no Vulkan device was found: install a Vulkan driver "
        "(lavapipe: Debian's mesa-vulkan-drivers)"
    )
    return env


@pytest.fixture(scope="module")
def cpu_logits(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], Path]:
    """The logits of llama-perplexity runs kept as KL-divergence bases, by their flags (each run once per module)."""
    return {}


def logits_of(bases: dict[tuple[str, ...], Path], env: dict[str, str], model: Path, text: Path, kv: str,
              tmp_path: Path, *flags: str, n_ctx: int = N_CTX) -> Path:  # fmt: skip
    key = (kv, str(n_ctx), *flags)
    if key not in bases:
        base = tmp_path / f"base-{len(bases)}.kld"
        r = perplexity(env, model, text, kv, *flags, "--kl-divergence-base", str(base), n_ctx=n_ctx)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        bases[key] = base
    return bases[key]


# every layer on the CPU; the last three blocks and their caches on Vulkan0 (unless -nkvo), the rest on the CPU, with
# llama.cpp's op offload off: by default ggml-vulkan also takes the CPU layers' matrix products of batches of 32 or
# more tokens (their weights copied to the device each time), so every run put the whole model's prompt work on
# lavapipe, which runs it on one thread (measured: 84 s with every layer there, 114 s with one; with three and no
# op offload 17 s for f16, 30 s for ott2). Three layers show what the tests check: placement per layer (a layer's
# ott op run elsewhere adds splits), sealing on the device, the logits of the CPU. ott_gguf.Llama below runs every
# layer on Vulkan0
CPU_ONLY = ("-ngl", "0", "-dev", "none")
LAST3_VULKAN0 = ("-ngl", "3", "-dev", "Vulkan0", "--no-op-offload")
# the ott tests' ubatches: seven per chunk, so that the last three attend to the group sealed after the fourth
OTT_UB = ("-ub", "32")


def vulkan0_against(bases: dict[tuple[str, ...], Path], env: dict[str, str], model: Path, text: Path, kv: str,
                    tmp_path: Path, base_flags: tuple[str, ...], *extra: str, n_ctx: int = N_CTX) -> str:  # fmt: skip
    """llama-perplexity's log of three layers on Vulkan0 (plus `extra` flags), KL divergence against the run with
    base_flags (plus the same `extra`) of the same cache type."""
    base = logits_of(bases, env, model, text, kv, tmp_path, *base_flags, *extra, n_ctx=n_ctx)
    r = perplexity(env, model, text, kv, *LAST3_VULKAN0, *extra, "--kl-divergence-base", str(base), "--kl-divergence",
                   n_ctx=n_ctx)  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert f"offloaded 3/{LAYERS} layers to GPU" in log, log[-3000:]
    return log


@needs_vulkan
def test_f16_cache_offloaded_to_vulkan0_gives_the_cpu_logits(
    smollm2: Path, text: Path, vk_env: dict[str, str], cpu_logits: dict, tmp_path: Path
) -> None:
    """The stock path, the control for the ott runs: three layers and their f16 cache on Vulkan0."""
    log = vulkan0_against(cpu_logits, vk_env, smollm2, text, "f16", tmp_path, CPU_ONLY)
    assert re.search(r"Vulkan0 KV buffer size", log), log[-3000:]
    num = perplexity_numbers(log)
    # other kernels (ggml-vulkan's matmuls and flash attention against ggml-cpu's, which quantizes the activations
    # to q8_1 for Q4_1 weights): close, not bit for bit. Measured on lavapipe (llvmpipe, LLVM 15.0.6), every layer
    # there: mean KLD 0.0055, top-1 93.7% (255 tokens); ott2 against f16 is about 0.05 on this model, a wrong op
    # far more
    assert num["mean_kld"] <= 0.02 and num["top1"] >= 85.0, num


@needs_vulkan
def test_ott_cache_kept_on_the_cpu_with_nkvo_while_the_layers_run_on_vulkan0(
    smollm2: Path, text: Path, vk_env: dict[str, str], cpu_logits: dict, tmp_path: Path
) -> None:
    log = vulkan0_against(cpu_logits, vk_env, smollm2, text, "ott2", tmp_path, CPU_ONLY, *OTT_UB, "-nkvo")
    assert "ott2 cache on CPU" in log and "ott2 cache on Vulkan" not in log, log[-3000:]
    num = perplexity_numbers(log)
    print(f"ott2 on the CPU, the layers on Vulkan0, against all on the CPU: {num}")
    # the same cache and ops on the CPU, the rest on Vulkan0: measured mean KLD 0.0094, top-1 94.2% (103 tokens)
    assert num["mean_kld"] <= 0.03 and num["top1"] >= 85.0, num


@needs_vulkan
def test_ott_cache_offloaded_to_vulkan0_gives_the_cpu_logits(
    smollm2: Path, text: Path, vk_env: dict[str, str], cpu_logits: dict, tmp_path: Path
) -> None:
    """Three layers and their ott2 caches on Vulkan0: the three ott ops run there (placed by ggml-vulkan's
    supports_op with the state in its buffer, never on a copy; a seal on a copy would leave the cache unsealed),
    against all on the CPU. Each op is checked alone in test_vulkan_ops.py (the state bit for bit); here the graph:
    placement, barriers, ubatches that attend to groups sealed by earlier ones."""
    log = vulkan0_against(cpu_logits, vk_env, smollm2, text, "ott2", tmp_path, CPU_ONLY, *OTT_UB, *OTT_PARAMS)
    assert "ott2 cache on Vulkan0" in log, log[-3000:]
    assert re.search(r"n_ubatch\s+= 32", log), log[-3000:]
    # the ops' placement: the graph is cut in two (the CPU's layers and Vulkan0's), as with f16; an ott op of a
    # layer run elsewhere would add splits per layer and copies of the state (measured: splits = 2)
    splits = [int(n) for n in re.findall(r"graph: nodes = \d+, splits = (\d+)", log)]
    assert splits and max(splits) <= 2, splits
    num = perplexity_numbers(log)
    print(f"ott2 on Vulkan0 against all on the CPU: {num}")
    # measured on lavapipe (llvmpipe, LLVM 15.0.6), every layer there: mean KLD 0.0127, top-1 93.2% (103 tokens,
    # R 0), as f16's difference above (the weights' kernels); a wrong op costs far more (ott2 against f16: ~0.05)
    assert num["mean_kld"] <= 0.02 and num["top1"] >= 85.0, num


# ott_gguf.Llama in a process of its own: GGML_VK_VISIBLE_DEVICES must be set before ggml registers its backends.
# (Every layer on Vulkan0 with the ott2 cache on the CPU, offload_kqv=False, answers in the refusal test below.)
# lavapipe takes seconds per llama_decode (ggml-vulkan's shaders on the CPU), so the answer is one greedy token after
# a short prompt, one decode: a chat answer (42 prompt tokens, 7 answered) took about 50 s of the CI's time each
PROMPT = "The capital of France is"  # the scripts' second argument
LLAMA_SCRIPT = """
import json, sys
from ott_gguf import Llama
out = {}
llm = Llama(sys.argv[1], kv_type="ott2", n_gpu_layers=-1, n_ctx=512, verbose=False)
out["vulkan"] = llm.create_completion(sys.argv[2], max_tokens=1, temperature=0.0)["choices"][0]["text"]
llm.close()
print(json.dumps(out))
"""


@needs_vulkan
def test_python_llama_answers_with_the_ott_cache_on_vulkan0(smollm2: Path, vk_env: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-c", LLAMA_SCRIPT, str(smollm2), PROMPT], capture_output=True, text=True,
                       timeout=900, env=vk_env)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out)
    # greedy, weights and the ott2 cache on Vulkan0; measured: " Paris", as on the CPU alone
    assert out["vulkan"] == " Paris", out


# A device without fp64 (Intel Arc) cannot run the ott ops (the seal sums in it, both divide in it):
# GGML_VK_OTT_DISABLE_F64 makes lavapipe answer as one
REFUSAL_SCRIPT = """
import json, sys
from ott_gguf import Llama

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))

out = {"errors": [], "rss": []}
for _ in range(4):
    try:
        Llama(sys.argv[1], kv_type="ott2", n_gpu_layers=-1, n_ctx=32768, verbose=False)
        out["errors"].append(None)
    except ValueError as e:
        out["errors"].append(str(e))
    out["rss"].append(rss_mib())
llm = Llama(sys.argv[1], kv_type="ott2", n_gpu_layers=-1, n_ctx=512, offload_kqv=False, verbose=False)
out["answer"] = llm.create_completion(sys.argv[2], max_tokens=1, temperature=0.0)["choices"][0]["text"]
print(json.dumps(out))
"""


@needs_vulkan
def test_a_device_without_fp64_refuses_the_cache_and_gives_its_memory_back(
    smollm2: Path, vk_env: dict[str, str]
) -> None:
    """The refusal is made after the cache's buffers exist on the device (supports_op asks of the state where it
    lives): it names the layer, the device and the op, frees those buffers (an ott2 cache of 32768 tokens is 111 MiB,
    which every refusal kept before: measured 147 -> 258 -> 369 -> 480 -> 591 MiB), and the same process then runs
    with the cache on the CPU, as the message advises."""
    env = dict(vk_env, GGML_VK_OTT_DISABLE_F64="1")
    r = subprocess.run([sys.executable, "-c", REFUSAL_SCRIPT, str(smollm2), PROMPT], capture_output=True, text=True,
                       timeout=900, env=env)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out["rss"], out["answer"])
    for e in out["errors"]:
        assert e is not None, out
        assert "layer 0 is offloaded to Vulkan0" in e and "cannot run its ott attention" in e and "-nkvo" in e, e
    # measured with the buffers freed: 147.0 MiB after each refusal
    assert out["rss"][-1] - out["rss"][0] < 50, out["rss"]
    assert out["answer"] == " Paris", out


YOUNG_SCRIPT = """
import sys
from ott_gguf import Llama
try:
    Llama(sys.argv[1], kv_type="ott2", n_gpu_layers=-1, n_ctx=512, ott_config={"k_young": 4}, verbose=False)
    print("made")
except ValueError as e:
    print("refused:", e)
"""


@needs_vulkan
def test_keys_by_age_refuse_a_cache_on_vulkan0_by_name(smollm2: Path, vk_env: dict[str, str]) -> None:
    """Young keys (k_young) have CPU kernels only: a cache offloaded to Vulkan0 with them is refused, naming the
    layer, the device and k_young, rather than running their ops elsewhere."""
    r = subprocess.run([sys.executable, "-c", YOUNG_SCRIPT, str(smollm2)], capture_output=True, text=True,
                       timeout=600, env=vk_env)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = r.stdout.strip().splitlines()[-1]
    assert out.startswith("refused:") and "layer 0 keeps its cache on Vulkan0" in out, out
    assert "k_young=4" in out and "-nkvo" in out, out


# What a decoded token records on Vulkan0, counted by a Vulkan layer (tests/vk_count_layer.c) between two
# single-token llama_decode calls: compute dispatches and pipeline barriers. -ngl 4 (lavapipe is slow): the last 3
# blocks and the output layer; the difference between two ott2 runs is the ott ops' (the rest is the same graph).
COUNT_SCRIPT = """
import ctypes, json, sys
from ott_gguf import Llama
llm = Llama(sys.argv[1], kv_type=sys.argv[2], n_gpu_layers=int(sys.argv[4]), n_ctx=256, verbose=False)
layer = ctypes.CDLL(sys.argv[3])  # the loader's copy: the same library
def counts():
    d, b = ctypes.c_int64(), ctypes.c_int64()
    layer.ott_vkcount_get(ctypes.byref(d), ctypes.byref(b))
    return [d.value, b.value]
toks = llm.tokenize(b"The capital of France is")
llm.eval(toks)
seen = [counts()]
for t in toks[1:3]:
    llm.eval([t])
    seen.append(counts())
print(json.dumps(seen))
"""
VK_NGL, VK_BLOCKS = 4, 3
LAYER_JSON = """{"file_format_version": "1.1.2", "layer": {"name": "VK_LAYER_OTT_count", "type": "GLOBAL",
 "library_path": "%s", "api_version": "1.3.0", "implementation_version": "1",
 "description": "ott-gguf tests: counts dispatches and barriers",
 "functions": {"vkGetInstanceProcAddr": "ott_vkcount_GetInstanceProcAddr",
               "vkGetDeviceProcAddr": "ott_vkcount_GetDeviceProcAddr"}}}"""


@needs_vulkan
def test_a_decoded_token_runs_each_layers_merge_and_seal_in_one_dispatch(
    smollm2: Path, vk_env: dict[str, str], tmp_path: Path
) -> None:
    """ggml-vulkan-ott.cpp runs a decoded token's merge and seal in one dispatch with one barrier after it; with the
    fusion off (GGML_VK_OTT_FUSED_BLOCKS=0) they take one more dispatch and one more barrier per block (the seal's
    barrier before it is ggml-vulkan's own, which it had just put there). Counted, not timed. Measured on lavapipe
    (2026-12-02), per decoded token: f16 51 dispatches and 37 barriers, ott2 48 and 40, ott2 unfused 51 and 43
    (at 15a7d10, before the fusion and the seal's barrier rules: 51 and 49); ott2's extra barrier per block against
    f16 is ggml-vulkan's between the two ropes (their buffers overlap; f16's cache write fuses K's rope)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc
    so = tmp_path / "libvk_count_layer.so"
    src = Path(__file__).with_name("vk_count_layer.c")
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-fvisibility=hidden", str(src), "-o", str(so)], check=True)
    (tmp_path / "vk_count_layer.json").write_text(LAYER_JSON % so)
    per_token = {}
    for name, kv, extra in (("f16", "f16", {}), ("ott2", "ott2", {}),
                            ("ott2 unfused", "ott2", {"GGML_VK_OTT_FUSED_BLOCKS": "0"})):  # fmt: skip
        env = {k: x for k, x in vk_env.items() if k != "GGML_VK_OTT_FUSED_BLOCKS"}  # the device's own bound
        env.update(VK_LAYER_PATH=str(tmp_path), VK_INSTANCE_LAYERS="VK_LAYER_OTT_count", **extra)
        r = subprocess.run([sys.executable, "-c", COUNT_SCRIPT, str(smollm2), kv, str(so), str(VK_NGL)],
                           capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(seen, seen[1:], strict=False)]
        assert steps[0] == steps[1] and steps[0][0] > 0, (name, seen)  # every decoded token records the same
        per_token[name] = steps[0]
    print(f"dispatches, barriers per decoded token, -ngl {VK_NGL} on Vulkan0: {per_token}")
    fused, unfused = per_token["ott2"], per_token["ott2 unfused"]
    assert (unfused[0] - fused[0], unfused[1] - fused[1]) == (VK_BLOCKS, VK_BLOCKS), per_token
    if "llvmpipe" in (vulkan0(vk_env) or ""):
        # on lavapipe, as measured: ott2 records no more dispatches than f16 and one barrier more per block (a GPU's
        # ggml-vulkan may run f16's attention with other kernels)
        assert fused[0] <= per_token["f16"][0] and fused[1] <= per_token["f16"][1] + VK_BLOCKS, per_token
