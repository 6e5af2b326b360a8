"""The ott ops' Vulkan kernels, run by ggml-vulkan on a Vulkan device (lavapipe, Mesa's Vulkan on the CPU, where
there is no GPU), against the numpy reference.

gen/templates/ott_cuda_ops.j2 renders the CUDA kernels, their CPU emulation and, kernel by kernel, the same phases
as GLSL compute shaders (mode glsl), which the build compiles to SPIR-V for ggml-vulkan (patch 0006,
native/ggml/ggml-vulkan-ott.cpp): the attention, partials (OTT_ATTN_PART) and merge (OTT_ATTN), and the seal
(OTT_SEAL). The scenarios of test_cuda_emu.py run with every op on the Vulkan device and in the emulation on the same
inputs: after every ubatch the state the device sealed must equal the emulation's bit for bit, and then (as the
scenario checks) the reference's; the device's attention output must match the reference within the emulation's
bounds, and the emulation's own output within fp32 rounding (the device's expf differs by ulps).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda_ops import ROOT, LayerState, OpsLib, build_emu, generate, head_spec, head_tag
from native_build import built_lib
from test_cuda_emu import CASES, HEADS, SCHEDULE, TAGS, case_id, head_config, run_scenario, scenario_kv
from vk_ops import SCALARS, VkWorker

from ott_gguf import build_info
from ott_gguf import reference as ref

from helpers import rotate

pytestmark = pytest.mark.skipif(build_info().get("vulkan") != "ON", reason="built without the Vulkan backend")

# lavapipe's time goes to the attention of the scenario's two longest prefill ubatches (200 and 150 tokens at
# positions 176-528: 18 of 27 s in a D 64 case, issue 50): the device computes the attention of the others (prefill
# of 70, 100 and 40 tokens, the last across a seal boundary in 2 slices over 3 sealed groups, and every decode), the
# emulation alone those two (checked against the reference as every ubatch is); the device seals every ubatch
VK_ATTN_MAX_TOKENS = 100

GGML_OTT_V_ROTATE, GGML_OTT_K_MIX, GGML_OTT_V_SYM = 1, 2, 4  # ggml-ott.h


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> OpsLib:
    src = generate(tmp_path_factory.mktemp("cuda-gen"), ",".join(head_spec(*h) for h in HEADS))
    return OpsLib(build_emu(src, TAGS, src), "emu", TAGS)


@pytest.fixture(scope="module")
def vk() -> Iterator[VkWorker]:
    env = dict(os.environ)
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")  # lavapipe is a CPU device: ggml-vulkan lists it only if named
    env.pop("GGML_VK_OTT_FUSED_BLOCKS", None)  # the device's own bound
    w = VkWorker(built_lib("ott_vk_test"), env)
    try:
        assert w.device, "the build has the Vulkan backend but no Vulkan device (lavapipe: mesa-vulkan-drivers)"
        yield w
    finally:
        w.close()


class VulkanOps:
    """An OpsLib whose ops run on the Vulkan device. The emulation runs them too, on the same inputs, for the
    comparison: the device's attention output (within fp32 rounding of the emulation's) and the state the device's
    seal wrote (bit for bit the emulation's) are what the scenario then checks against the reference. attn=False
    or seal=False leave that op to the emulation alone."""

    def __init__(self, emu: OpsLib, vk: VkWorker, attn: bool = True, seal: bool = True) -> None:
        self.emu, self.vk, self.ffi, self.attn, self.seal = emu, vk, emu.ffi, attn, seal
        self.heads = {head_tag(*h): h for h in HEADS}
        self.max_rel = 0.0  # largest |vulkan - emulation| / max |emulation| over the ubatches
        self.runs = 0
        self.seals = 0

    def _array(self, ptr: Any, dtype: type, n: int) -> np.ndarray:
        return np.frombuffer(self.ffi.buffer(ptr, np.dtype(dtype).itemsize * n), dtype)

    def _head(self, tag: str, a: Any) -> dict[str, int]:
        kbits, vbits, G, Gv, *rest = self.heads[tag]
        k_mix, v_sym = (bool(f) for f in (*rest, False, False)[:2])
        c = ref.OttConfig(k_bits=kbits, v_bits=vbits, G=G, Gv=Gv, k_mix=k_mix, v_sym=v_sym)
        return {
            "kbits": kbits, "vbits": vbits, "G": G, "Gv": Gv,
            "flags": (GGML_OTT_V_ROTATE if a.v_rotate else 0) | (GGML_OTT_K_MIX if k_mix else 0)
            | (GGML_OTT_V_SYM if v_sym else 0),
            "kgb": a.D * c.k_format.block_bytes + (a.D // 4 if k_mix else 0),
            "vgb": G * (a.D // Gv) * c.v_format.block_bytes,
        }  # fmt: skip

    def _views(self, a: Any, head: dict[str, int], names: tuple[str, ...]) -> dict[str, np.ndarray]:
        rows, hs = a.ns * a.n_tok, a.H * a.n_stream
        sizes = {
            "q": (np.float32, rows * a.n_head * a.D), "k": (np.float32, rows * a.H * a.D),
            "v": (np.float32, rows * a.H * a.D), "ring": (np.uint16, a.D * a.H * a.T * 2 * a.n_stream),
            "sk": (np.uint8, head["kgb"] * a.NG * hs), "sv": (np.uint8, head["vgb"] * a.NG * hs),
            "pkv": (np.uint16, a.D * a.S * 2 * hs), "pmeta": (np.int32, (2 * a.S + 3) * hs),
            "plan": (np.int32, 4 * a.ns), "flags": (np.int32, a.n_stream),
        }  # fmt: skip
        return {k: self._array(getattr(a, k), *sizes[k]) for k in names}

    def run(self, tag: str, op: str, a: Any) -> None:
        """op as OpsLib.run; "attn_seal" runs the layer's three ops in one graph on the device (ggml-vulkan runs the
        merge and the seal in one dispatch where it fuses them: ggml-vulkan-ott.cpp)."""
        head = self._head(tag, a)
        scalars = {k: getattr(a, k) for k in SCALARS}
        attn = op in ("attn", "attn_seal") and self.attn and a.n_tok <= VK_ATTN_MAX_TOKENS
        seal = op in ("seal", "attn_seal") and self.seal
        views = self._views(a, head, ("q", "k", "v", "ring", "sk", "sv", "pkv", "pmeta", "plan", "flags"))
        inputs = {k: x.copy() for k, x in views.items()}  # before the emulation changes the state in place
        self.emu.run(tag, op, a)
        gq = a.n_head // a.H
        part_shape = (a.ns * (a.NS + 1), a.H, gq * a.n_tok, a.D + 2)
        out_shape = (a.ns, a.n_tok, a.n_head, a.D)
        got_out = state = None
        if attn and op == "attn_seal" and seal:
            _, got_out, state = self.vk.attn_seal(scalars, head, inputs, part_shape, out_shape)
        elif attn:
            names = ("q", "k", "v", "ring", "sk", "sv", "pkv", "pmeta", "plan")
            _, got_out = self.vk.attn(scalars, head, {k: inputs[k] for k in names}, part_shape, out_shape)
        if seal and state is None:
            names = ("k", "v", "ring", "sk", "sv", "pkv", "pmeta", "plan", "flags")
            state = self.vk.seal(scalars, head, {k: inputs[k] for k in names})
        if state is not None:
            for k, x in state.items():
                diff = np.flatnonzero(x != views[k])
                assert diff.size == 0, f"{k}: the device's seal differs from the emulation's at {diff[:8]} of {x.size}"
                views[k][...] = x
            self.seals += 1
        if got_out is not None:
            out = self._array(a.out, np.float32, a.ns * a.n_tok * a.n_head * a.D).reshape(out_shape)
            scale = max(float(np.abs(out).max()), 1e-30)
            self.max_rel = max(self.max_rel, float(np.abs(got_out - out).max()) / scale)
            self.runs += 1
            out[...] = got_out  # the scenario checks the device's output against the reference


# the build's head configs (G 128, Gv 64): SmolLM2's head shape, Gemma 3's (D 256, one KV head), kivi2 (no pools),
# 4-bit, ott3 K with ott2 V stored rotated, mixed-width keys with rotated V, those with symmetric V at D 256, D 256
# with two KV heads of one query head each, eight query heads per KV head (a workgroup's longest row loop), and
# 2-bit keys of mixed widths (k_mix 2: 1, 2 and 3-bit blocks). The two plain 2-bit cases at D 256 (one KV head of
# four query heads, two of one; 46 s and 28 s on lavapipe) take turns: D 256 also runs every time with mixed keys
# and symmetric V (CASES[12]), and many query heads per KV head at D 64. The k_mix 2 cases with rotated and with
# symmetric V take turns too: each head config's pipelines cost lavapipe 28-55 s to compile on a machine without
# a shader cache (CI's), those two the most, and symmetric V runs every time with mixed 3-bit keys (CASES[12])
VK_CASES = [CASES[i] for i in (0, 2, 4, 7, 9, 12)] + [
    *rotate([CASES[1], ((2, 2, 128, 64), 256, 2, 2, 3, 32, False)]),
    *rotate([CASES[14], CASES[16]]),
    ((2, 2, 128, 64), 64, 1, 8, 3, 32, False),
]


@pytest.mark.parametrize("case", VK_CASES, ids=case_id)
def test_vulkan_ops_match_reference(emu: OpsLib, vk: VkWorker, case: tuple) -> None:
    """The layer's three ops in one graph per ubatch, as a model runs them: the decode steps' merge and seal in one
    dispatch, the prefill ubatches' as two (ggml-vulkan-ott.cpp: 64 workgroups at most on a device that does not
    say its core count); the longest ubatches' seal alone (VK_ATTN_MAX_TOKENS)."""
    lib = VulkanOps(emu, vk)
    run_scenario(lib, case, fused=True)  # type: ignore[arg-type]
    print(f"{vk.device}: {lib.runs} ubatches, {lib.seals} seals bit for bit, "
          f"max |vulkan - emulation| / max |out| = {lib.max_rel:.2e}")  # fmt: skip
    assert lib.seals == len(SCHEDULE) and lib.runs == sum(n <= VK_ATTN_MAX_TOKENS for n in SCHEDULE) > 10
    # the same fp32 operations in the same order; only exp differs (Vulkan allows a few ulps)
    assert lib.max_rel <= 1e-5


def _worker(**env: str) -> VkWorker:
    return VkWorker(built_lib("ott_vk_test"), dict(os.environ, GGML_VK_VISIBLE_DEVICES="0", **env))


@pytest.fixture(scope="module")
def vk_fused() -> Iterator[VkWorker]:
    """A worker whose merges run their layer's seal at any size (GGML_VK_OTT_FUSED_BLOCKS)."""
    w = _worker(GGML_VK_OTT_FUSED_BLOCKS=str(1 << 30))
    try:
        yield w
    finally:
        w.close()


# prefill ubatches that seal fused: the 100- and 40-token ones seal a group each (the decode steps of SCHEDULE seal
# none); the 150- and 200-token ones seal alone on the device (VK_ATTN_MAX_TOKENS)
@pytest.mark.parametrize("case", [CASES[0], CASES[12]], ids=case_id)
def test_vulkan_merge_and_seal_in_one_dispatch_match_reference(emu: OpsLib, vk_fused: VkWorker, case: tuple) -> None:
    lib = VulkanOps(emu, vk_fused)
    run_scenario(lib, case, fused=True)  # type: ignore[arg-type]
    print(f"{vk_fused.device}, every merge with its seal: {lib.runs} ubatches, {lib.seals} seals bit for bit, "
          f"max |vulkan - emulation| / max |out| = {lib.max_rel:.2e}")  # fmt: skip
    assert lib.seals == len(SCHEDULE) and lib.runs == sum(n <= VK_ATTN_MAX_TOKENS for n in SCHEDULE)
    assert lib.max_rel <= 1e-5


class FlagsOnlyProbe(VulkanOps):
    """Runs an "attn_seal" ubatch's partials and merge, given the layer's flags, on the device with no seal node
    after them (and the whole op in the emulation): `fused` says whether the merge's dispatch sealed. The state
    afterwards must be the emulation's sealed one (then the merge ran the seal) or the one before; the output is
    checked either way."""

    fused: bool | None = None

    def run(self, tag: str, op: str, a: Any) -> None:
        assert op == "attn_seal"
        head = self._head(tag, a)
        views = self._views(a, head, ("q", "k", "v", "ring", "sk", "sv", "pkv", "pmeta", "plan", "flags"))
        inputs = {k: x.copy() for k, x in views.items()}
        self.emu.run(tag, op, a)
        out_shape = (a.ns, a.n_tok, a.n_head, a.D)
        part_shape = (a.ns * (a.NS + 1), a.H, a.n_head // a.H * a.n_tok, a.D + 2)
        scalars = {k: getattr(a, k) for k in SCALARS}
        _, out, state = self.vk.attn_seal(scalars, head, inputs, part_shape, out_shape, flags_only=True)
        sealed = {k: views[k] for k in state}
        assert any((sealed[k] != inputs[k]).any() for k in ("sk", "sv")), "the ubatch seals nothing: no probe"
        self.fused = all((state[k] == sealed[k]).all() for k in state)
        if not self.fused:
            assert all((state[k] == inputs[k]).all() for k in state), "the merge wrote part of the state"
        want = self._array(a.out, np.float32, a.ns * a.n_tok * a.n_head * a.D).reshape(out_shape)
        assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()


def _merge_seals(emu: OpsLib, w: VkWorker, n_tok: int) -> bool:
    """Whether the merge's dispatch on `w` seals (FlagsOnlyProbe): a layer (D 64, one KV head of 3 query heads, one
    stream) filled through the emulation up to the ubatch of n_tok tokens that seals its first group, then that
    ubatch."""
    head = (2, 2, 128, 64)
    cfg = head_config(head, 3, 32, False)
    st = LayerState(cfg, 3, 64, 1, 3, n_stream=1, n_ctx=512)
    rng = np.random.default_rng(5)
    n0 = cfg.R + cfg.G - n_tok  # the ubatch reaches the point where the first group seals
    k_all, v_all = scenario_kv(rng, 1, n0 + n_tok, 1, 64)  # [stream, token, KV head, D]
    q = (rng.standard_normal((1, n0 + n_tok, 3, 64)) * 0.5).astype(np.float32)
    st.step(emu, head_tag(*head), [0], q[:, :n0], k_all[:, :n0], v_all[:, :n0], NS=1)
    assert st.n_sealed == [0] and st.sealed_after(n0 + n_tok) == 1
    probe = FlagsOnlyProbe(emu, w)
    st.step(probe, head_tag(*head), [0], q[:, n0:], k_all[:, n0:], v_all[:, n0:], NS=1, fused=True)  # type: ignore[arg-type]
    assert probe.fused is not None
    return probe.fused


def test_the_merge_runs_the_seal_where_its_dispatch_is_small(emu: OpsLib, vk: VkWorker) -> None:
    """ggml-vulkan-ott.cpp's rule: the merge runs its layer's seal in its own dispatch when both together are at most
    a bound of workgroups (twice the device's cores, 64 where the device does not say, as lavapipe): a decoded token
    (3 + 1 workgroups here) fuses on any device; a 30-token ubatch (90 + 1) fuses at a bound of 91, not at 90;
    GGML_VK_OTT_FUSED_BLOCKS=0 never fuses (the A/B on a GPU)."""
    assert _merge_seals(emu, vk, 1)
    for bound, n_tok, fused in (("0", 1, False), ("90", 30, False), ("91", 30, True)):
        w = _worker(GGML_VK_OTT_FUSED_BLOCKS=bound)
        try:
            assert _merge_seals(emu, w, n_tok) == fused, (bound, n_tok)
        finally:
            w.close()


def test_vulkan_seal_flags_nonfinite_values_of_one_stream(emu: OpsLib, vk: VkWorker) -> None:
    """A ubatch for stream 1 alone (the plan maps ubatch streams to cache streams); a NaN in K marks only that
    stream, and its tokens are still written where the emulation writes them (bit for bit, VulkanOps)."""
    cfg = ref.OttConfig(no_outlier_layers=0)
    D, H, n_head = 64, 2, 4
    lib = VulkanOps(emu, vk)
    st = LayerState(cfg, 3, D, H, n_head, n_stream=3, n_ctx=512)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 5, n_head, D)).astype(np.float32)
    k = rng.standard_normal((1, 5, H, D)).astype(np.float32)
    v = rng.standard_normal((1, 5, H, D)).astype(np.float32)
    out = st.step(lib, TAGS[0], [1], q, k, v, NS=1)  # type: ignore[arg-type]
    assert np.isfinite(out).all()
    assert st.n_pos == [0, 5, 0] and st.arrays["flags"].tolist() == [0, 0, 0]
    k[0, 2, 1, 7] = np.nan
    st.step(lib, TAGS[0], [1], q, k, v, NS=1)  # type: ignore[arg-type]
    assert st.arrays["flags"].tolist() == [0, 1, 0] and lib.seals == 2


def test_a_head_config_without_vulkan_kernels_is_refused(emu: OpsLib, vk: VkWorker) -> None:
    """G 64 is not the build's group: the device refuses the ops (the cache is then refused), it neither runs a
    wrong kernel nor hands the op to another backend."""
    case = CASES[5]
    assert case[0][2:4] == (64, 32)
    with pytest.raises(RuntimeError, match="returned -2"):
        run_scenario(VulkanOps(emu, vk, seal=False), case)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="ott_vktest_seal returned -2"):
        run_scenario(VulkanOps(emu, vk, attn=False), case)  # type: ignore[arg-type]


# The attention partials run a CUDA warp's 32 lanes on a subgroup of W invocations, 32/W lanes each (the butterflies
# pair lanes across invocations with shuffles below W, inside one above it). llvmpipe's vector width sets W:
# LP_NATIVE_VECTOR_WIDTH 128 gives subgroups of 4, 512 of 16 (256, the default above, 8; read with
# vkGetPhysicalDeviceProperties2 on llvmpipe, LLVM 15.0.6). Mixed-width keys (their width table's prefix sums are
# the one scan across lanes) at W 4, SmolLM2's shape at W 16. A unit takes 1 ubatch token on lavapipe and 8 on a
# GPU (ggml_vk_ott_tc: llvmpipe ends a shader's loops after 65535 iterations in all, which 8 tokens' rows pass at
# D 256 in this scenario); SmolLM2's shape stays under it with 8, the GPUs' path (GGML_VK_OTT_TC=8). The seal does
# not use subgroups and stays in the emulation here.
@pytest.mark.parametrize(
    "bits, tc, case", [(128, 1, CASES[11]), (512, 1, CASES[0]), (256, 8, CASES[0])], ids=["W4-kmix", "W16", "W8-TC8"]
)
def test_vulkan_attention_at_other_subgroup_sizes(emu: OpsLib, bits: int, tc: int, case: tuple) -> None:
    env = dict(os.environ, GGML_VK_VISIBLE_DEVICES="0", LP_NATIVE_VECTOR_WIDTH=str(bits), GGML_VK_OTT_TC=str(tc))
    w = VkWorker(built_lib("ott_vk_test"), env)
    try:
        assert w.device and f"{bits} bits" in w.device, w.device
        lib = VulkanOps(emu, w, seal=False)
        run_scenario(lib, case)  # type: ignore[arg-type]
        print(f"{w.device}, {tc} tokens a unit: {lib.runs} ubatches, max |vulkan - emulation| / max |out| = "
              f"{lib.max_rel:.2e}")  # fmt: skip
        assert lib.runs == sum(n <= VK_ATTN_MAX_TOKENS for n in SCHEDULE) and lib.max_rel <= 1e-5
    finally:
        w.close()


def test_a_device_that_cannot_require_subgroups_refuses_the_attention(emu: OpsLib) -> None:
    """GGML_VK_OTT_DISABLE_SUBGROUPS makes lavapipe answer as a device without shuffles or a subgroup size it can
    require: the partials are refused (the cache is then refused, naming the op), the seal still runs."""
    w = _worker(GGML_VK_OTT_DISABLE_SUBGROUPS="1")
    try:
        with pytest.raises(RuntimeError, match="ott_vktest_attn returned -2"):
            run_scenario(VulkanOps(emu, w, seal=False), CASES[0])  # type: ignore[arg-type]
    finally:
        w.close()


def _shared_floats(comp: str, consts: dict[str, int]) -> int:
    """The 4-byte words of a shader's global shared arrays (each declared `SHARED float|int name[dims]...;`),
    its specialization constants at consts."""
    words = 0
    for m in re.finditer(r"^ {4}SHARED (\w+)\s+(.*?);", comp, re.M):
        assert m.group(1) in ("float", "int"), m.group(0)
        for decl in re.findall(r"\w+((?:\[[^]]+\])*)", m.group(2)):
            n = 1
            for dim in re.findall(r"\[([^]]+)\]", decl):
                n *= int(eval(dim.replace("/", "//"), {}, dict(consts)))  # noqa: S307 - the shader's own sizes
            words += n
    return words


def test_the_partials_shared_memory_is_what_the_host_counts(tmp_path: Path) -> None:
    """ggml-vulkan-ott.cpp picks each instance's NW and RP so that its shared memory fits the device's limit (llvmpipe
    has 32 KiB, CUDA's D 64 instance takes 38): by ott2_vk_part_shared_bytes (ott_vk.h.j2), which must count what
    the GLSL declares. Read from the generated shaders at every instance, with and without mixed-width keys."""
    subprocess.run([sys.executable, str(ROOT / "gen" / "generate.py"), "ggml", "--out", str(tmp_path)], check=True)
    comps = sorted(tmp_path.glob("ott2-vk-*-attn_part.comp"))
    assert len(comps) >= 16
    for c in tmp_path.glob("ott2-vk-*.comp"):
        (tmp_path / f"{c.stem}.spv.inc").write_text("{0}")  # the SPIR-V, which only the build compiles
    (tmp_path / "bytes.c").write_text(
        '#include <stdio.h>\n#include "ott2-vk.h"\nint main(void) {\n'
        "    for (int k = 0; k < 2; ++k)\n"
        "    for (int j = 0; j < OTT2_VK_VEC_COUNT; ++j)\n"
        "    for (int nw = 1; nw <= 16; nw *= 2)\n"
        "    for (int rp = 1; rp <= 4; rp *= 2) {\n"
        "        const int cpl = ott2_vk_vecs[j].cpl;\n"
        '        printf("%d %d %d %d %u\\n", k, cpl, rp, nw, ott2_vk_part_shared_bytes(cpl, rp, nw, k != 0));\n'
        "    }\n    return 0;\n}\n"
    )
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc
    exe = tmp_path / "bytes"
    subprocess.run([cc, "-O0", "-I", str(tmp_path), str(tmp_path / "bytes.c"), "-o", str(exe)], check=True)
    host = {tuple(int(x) for x in line.split()[:4]): int(line.split()[4]) for line in
            subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()}  # fmt: skip
    for kmix in (0, 1):
        comp = next(c for c in comps if ("m" in c.name.split("-")[2].split("v")[0]) == bool(kmix)).read_text()
        for (kk, cpl, rp, nw), nbytes in host.items():
            if kk == kmix:
                consts = {"CPL": cpl, "RP": rp, "NW": nw, "DW": 32 * cpl, "WSZ": 2 * rp * 32 * cpl,
                          "KTC": (cpl + 3) // 4, "OTT_MAXPOOL": 128}  # fmt: skip
                assert 4 * _shared_floats(comp, consts) == nbytes, (kmix, cpl, rp, nw)
