"""The ott ops' Vulkan kernels, run by ggml-vulkan on a Vulkan device (lavapipe, Mesa's Vulkan on the CPU, where
there is no GPU), against the numpy reference.

gen/templates/ott_cuda_ops.j2 renders the CUDA kernels, their CPU emulation and, kernel by kernel, the same phases
as GLSL compute shaders (mode glsl), which the build compiles to SPIR-V for ggml-vulkan (patch 0006,
native/ggml/ggml-vulkan-ott.cpp). Ported so far: the attention, partials (OTT_ATTN_PART) and merge (OTT_ATTN). The
scenarios of test_cuda_emu.py run with the attention on the Vulkan device and the seal in the emulation: after every
ubatch the Vulkan output must match the reference within the emulation's bounds, and the emulation's own output
within fp32 rounding (the device's expf differs by ulps). The seal has no Vulkan kernel yet: the device refuses it,
so an ott cache on a Vulkan layer is refused (test_vulkan.py), never moved to the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from cuda_ops import OpsLib, build_emu, generate, head_spec, head_tag
from native_build import built_lib
from test_cuda_emu import CASES, HEADS, TAGS, case_id, run_scenario
from vk_ops import SCALARS, VkWorker

from ott_gguf import build_info
from ott_gguf import reference as ref

pytestmark = pytest.mark.skipif(build_info().get("vulkan") != "ON", reason="built without the Vulkan backend")

GGML_OTT_V_ROTATE, GGML_OTT_K_MIX, GGML_OTT_V_SYM = 1, 2, 4  # ggml-ott.h


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> OpsLib:
    src = generate(tmp_path_factory.mktemp("cuda-gen"), ",".join(head_spec(*h) for h in HEADS))
    return OpsLib(build_emu(src, TAGS, src), "emu", TAGS)


@pytest.fixture(scope="module")
def vk() -> Iterator[VkWorker]:
    env = dict(os.environ)
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")  # lavapipe is a CPU device: ggml-vulkan lists it only if named
    w = VkWorker(built_lib("ott_vk_test"), env)
    try:
        assert w.device, "the build has the Vulkan backend but no Vulkan device (lavapipe: mesa-vulkan-drivers)"
        yield w
    finally:
        w.close()


class VulkanAttention:
    """An OpsLib whose attention runs on the Vulkan device: the emulation seals (and computes its own attention,
    kept for the comparison); the device computes the partials and their merge from the same state, and its output
    is what the scenario checks against the reference."""

    def __init__(self, emu: OpsLib, vk: VkWorker) -> None:
        self.emu, self.vk, self.ffi = emu, vk, emu.ffi
        self.heads = {head_tag(*h): h for h in HEADS}
        self.max_rel = 0.0  # largest |vulkan - emulation| / max |emulation| over the ubatches
        self.runs = 0

    def _array(self, ptr: Any, dtype: type, n: int) -> np.ndarray:
        return np.frombuffer(self.ffi.buffer(ptr, np.dtype(dtype).itemsize * n), dtype)

    def run(self, tag: str, op: str, a: Any) -> None:
        self.emu.run(tag, op, a)
        if op != "attn":
            return
        kbits, vbits, G, Gv, *rest = self.heads[tag]
        k_mix, v_sym = (bool(f) for f in (*rest, False, False)[:2])
        c = ref.OttConfig(k_bits=kbits, v_bits=vbits, G=G, Gv=Gv, k_mix=k_mix, v_sym=v_sym)
        head = {
            "kbits": kbits, "vbits": vbits, "G": G, "Gv": Gv,
            "flags": (GGML_OTT_V_ROTATE if a.v_rotate else 0) | (GGML_OTT_K_MIX if k_mix else 0)
            | (GGML_OTT_V_SYM if v_sym else 0),
            "kgb": a.D * c.k_format.block_bytes + (a.D // 4 if k_mix else 0),
            "vgb": G * (a.D // Gv) * c.v_format.block_bytes,
        }  # fmt: skip
        rows, hs = a.ns * a.n_tok, a.H * a.n_stream
        sizes = {
            "q": (np.float32, rows * a.n_head * a.D), "k": (np.float32, rows * a.H * a.D),
            "v": (np.float32, rows * a.H * a.D), "ring": (np.uint16, a.D * a.H * a.T * 2 * a.n_stream),
            "sk": (np.uint8, head["kgb"] * a.NG * hs), "sv": (np.uint8, head["vgb"] * a.NG * hs),
            "pkv": (np.uint16, a.D * a.S * 2 * hs), "pmeta": (np.int32, (2 * a.S + 3) * hs),
            "plan": (np.int32, 4 * a.ns),
        }  # fmt: skip
        inputs = {k: self._array(getattr(a, k), t, n).copy() for k, (t, n) in sizes.items()}
        gq = a.n_head // a.H
        part_shape = (a.ns * (a.NS + 1), a.H, gq * a.n_tok, a.D + 2)
        out_shape = (a.ns, a.n_tok, a.n_head, a.D)
        out = self._array(a.out, np.float32, rows * a.n_head * a.D).reshape(out_shape)
        _, got = self.vk.attn({k: getattr(a, k) for k in SCALARS}, head, inputs, part_shape, out_shape)
        scale = max(float(np.abs(out).max()), 1e-30)
        self.max_rel = max(self.max_rel, float(np.abs(got - out).max()) / scale)
        self.runs += 1
        out[...] = got  # the scenario checks the device's output against the reference


# the build's head configs (G 128, Gv 64): SmolLM2's head shape, Gemma 3's (D 256, one KV head), kivi2 (no pools),
# 4-bit, ott3 K with ott2 V stored rotated, mixed-width keys with rotated V, those with symmetric V at D 256, D 256
# with two KV heads of one query head each, and eight query heads per KV head (a workgroup's longest row loop)
VK_CASES = [CASES[i] for i in (0, 1, 2, 4, 7, 9, 12)] + [
    ((2, 2, 128, 64), 256, 2, 2, 3, 32, False),
    ((2, 2, 128, 64), 64, 1, 8, 3, 32, False),
]


@pytest.mark.parametrize("case", VK_CASES, ids=case_id)
def test_vulkan_attention_matches_reference(emu: OpsLib, vk: VkWorker, case: tuple) -> None:
    lib = VulkanAttention(emu, vk)
    run_scenario(lib, case)  # type: ignore[arg-type]
    print(f"{vk.device}: {lib.runs} ubatches, max |vulkan - emulation| / max |out| = {lib.max_rel:.2e}")
    assert lib.runs > 10
    # the same fp32 operations in the same order; only exp differs (Vulkan allows a few ulps)
    assert lib.max_rel <= 1e-5


def test_a_head_config_without_vulkan_kernels_is_refused(emu: OpsLib, vk: VkWorker) -> None:
    """G 64 is not the build's group: the device refuses the op (the scheduler would then refuse the cache), it
    neither runs a wrong kernel nor hands the op to another backend."""
    case = CASES[5]
    assert case[0][2:4] == (64, 32)
    with pytest.raises(RuntimeError, match="returned -2"):
        run_scenario(VulkanAttention(emu, vk), case)  # type: ignore[arg-type]
