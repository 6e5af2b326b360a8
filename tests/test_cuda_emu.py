"""The CUDA ops' logic, run on the CPU (and on a GPU where there is one), against the numpy reference.

gen/templates/ott_cuda_ops.j2 is rendered as CUDA and a second time as C++ in which a launch loops over the
blocks and each barrier phase over the threads, with the shared-memory tree reductions the GPU runs. Several
streams of ubatches (prefill and decode sizes) go through attention and seal exactly as the graph runs them;
after each ubatch the attention output must match the reference with the int8 query within fp32 rounding, and
the state (codes, scales, mins, pools, scores, the tracing flag, the ring) must equal the reference's bit for bit.

Races without a GPU: the emulation runs a launch's blocks, a block's threads and warps and a warp's lanes one
after another, ascending or (emu_order) all descending; a read of what another thread, warp or block writes
without a barrier between makes the bits depend on that order, and the order test compares them bit for bit.
Reads past a shared array or a buffer, which a GPU answers with whatever lies there, and undefined arithmetic:
the sanitizer test (AddressSanitizer, UndefinedBehaviorSanitizer). What this still cannot prove: barriers the
GPU needs where the emulation's phases already run in sequence (code between phases is run once here, by every
thread there), warp scheduling, occupancy, and the exact ulps of the GPU's expf. The GPU test
(`test_cuda_ops_on_gpu`, run by `make gpu-test` on a CUDA machine) runs the same comparison on the device.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda_ops import (
    CDEF,
    LayerState,
    OpsLib,
    build_cuda_testlib,
    build_emu,
    generate,
    head_spec,
    head_tag,
    sanitizer_env,
)
from native_build import built_lib

from ott_gguf import reference as ref

from helpers import k_mix_of, keys_values, mixed_width_counts, pack_group, rotate

# (K bits, V bits, G, Gv[, k_mix[, v_sym]]) of the rendered head configs
HEADS = [(2, 2, 128, 64), (2, 2, 64, 32), (4, 4, 128, 64), (3, 2, 128, 64), (3, 2, 128, 64, True),
         (3, 2, 128, 64, True, True), (2, 2, 64, 32, False, True), (2, 2, 128, 64, True),
         (2, 2, 128, 64, True, True)]  # fmt: skip
TAGS = [head_tag(*h) for h in HEADS]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("cuda-gen"), ",".join(head_spec(*h) for h in HEADS))


@pytest.fixture(scope="module")
def emu(sources: Path) -> OpsLib:
    return OpsLib(build_emu(sources, TAGS, sources), "emu", TAGS)


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None or shutil.which("nvcc") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


# (K bits, V bits, G, Gv[, k_mix[, v_sym]]), D, H, n_head, outlier_num, aux_cap, v_rotate: SmolLM2's head shape,
# Gemma 3's (D 256, one KV head), kivi2 (no pools), a tiny aux pool (tracing stops), 4-bit, a smaller group, K and V
# of different widths (ott3 K with ott2 V), plain and with V stored rotated (one rotation unit per token at D 64,
# four at D 256), 3-bit keys with widths per channel (k_mix: 2, 3 and 4-bit blocks and the width table), and
# symmetric 2-bit V blocks (v_sym: one scale, no min; rotated V only) with mixed keys and with 2-bit keys at Gv 32
CASES = [
    ((2, 2, 128, 64), 64, 3, 9, 3, 32, False),
    ((2, 2, 128, 64), 256, 1, 4, 3, 32, False),
    ((2, 2, 128, 64), 64, 2, 4, 0, 32, False),
    ((2, 2, 128, 64), 64, 2, 4, 3, 1, False),
    ((4, 4, 128, 64), 64, 2, 4, 3, 32, False),
    ((2, 2, 64, 32), 64, 2, 6, 2, 8, False),
    ((3, 2, 128, 64), 64, 2, 4, 3, 32, False),
    ((3, 2, 128, 64), 64, 2, 4, 3, 32, True),
    ((3, 2, 128, 64), 256, 1, 2, 3, 32, True),
    ((3, 2, 128, 64, True), 64, 2, 4, 3, 32, True),
    ((3, 2, 128, 64, True), 256, 1, 2, 3, 8, False),
    ((3, 2, 128, 64, True, True), 64, 2, 4, 3, 32, True),
    ((3, 2, 128, 64, True, True), 256, 1, 2, 3, 8, True),
    ((2, 2, 64, 32, False, True), 64, 2, 6, 2, 8, True),
    ((2, 2, 128, 64, True), 64, 2, 4, 3, 32, True),
    ((2, 2, 128, 64, True), 256, 1, 2, 3, 8, False),
    ((2, 2, 128, 64, True, True), 64, 2, 4, 3, 32, True),
]


def case_id(c: tuple) -> str:
    return f"{head_tag(*c[0])}-D{c[1]}-H{c[2]}x{c[3]}-o{c[4]}a{c[5]}" + ("-vrot" if c[6] else "")


# ubatch sizes; each step feeds both streams, "1" steps are decode (NS = 8 slices, as the cache uses)
SCHEDULE = [70, 1, 1, 100, 1, 3, 200, 1, 1, 1, 150, 2, 1, 40, 1]


def scenario_kv(rng: np.random.Generator, n_stream: int, n_total: int, H: int, D: int) -> tuple[np.ndarray, ...]:
    """Keys and values [stream, token, KV head, D] of a scenario (helpers.keys_values per stream and head)."""
    kv = [[keys_values(rng, n_total, D) for _ in range(H)] for _ in range(n_stream)]
    return tuple(np.stack([np.stack([p[i] for p in per_head], 1) for per_head in kv]) for i in (0, 1))


def run_scenario(lib: OpsLib, case: tuple, seed: int = 0, fused: bool = False) -> list[ref.OttCache]:
    """SCHEDULE's ubatches through the ops (fused: the merge and the seal in one launch, as ggml-cuda runs them),
    attention and the whole state checked against the reference after each."""
    head, D, H, n_head, outlier_num, aux_cap, v_rotate = case
    tag = head_tag(*head)
    cfg = head_config(head, outlier_num, aux_cap, v_rotate)
    k_mix, v_sym = cfg.k_mixed, cfg.v_symmetric
    rng = np.random.default_rng(seed)
    n_total = sum(SCHEDULE)
    n_stream = 2
    st = LayerState(cfg, outlier_num, D, H, n_head, n_stream, n_ctx=n_total + 8)
    caches = [ref.OttCache(cfg, 1, H, D) for _ in range(n_stream)]
    k_all, v_all = scenario_kv(rng, n_stream, n_total, H, D)
    scale = 1.0 / math.sqrt(D)
    start = 0
    for n in SCHEDULE:
        q = (rng.standard_normal((n_stream, n, n_head, D)) * 0.5).astype(np.float32)
        k, v = k_all[:, start : start + n], v_all[:, start : start + n]
        # slices as the cache picks them: 8 (CPU) or many (GPU, most of them empty early on) when decoding
        ns_decode = 8 if start % 2 else 64
        got = st.step(lib, tag, list(range(n_stream)), q, k, v, NS=ns_decode if n <= 4 else 1 + start % 3, fused=fused)
        for s in range(n_stream):
            want = caches[s].process_ubatch(0, 0, q[s], k[s], v[s], np.arange(start, start + n), scale, int8_query=True)
            assert want is not None
            vmax = max(float(np.abs(caches[s].state(0, 0, h).served()[2]).max()) for h in range(H))
            np.testing.assert_allclose(got[s], want, rtol=2e-4, atol=5e-5 * vmax, err_msg=f"stream {s} at {start}")
        start += n
        for s in range(n_stream):
            for h in range(H):
                check_state(st, caches[s].state(0, 0, h), cfg, s, h)
    # every path ran: groups were sealed, outliers traced (where configured)
    s0 = caches[0].state(0, 0, 0)
    assert s0.n_sealed >= 4
    if outlier_num:
        assert len(s0.pooled()) > 0
    # the scales' sign bits (compared bit for bit above) flag rotated V: every unit here, or none
    assert all(np.signbit(g.v_scale).all() == v_rotate and np.signbit(g.v_scale).any() == v_rotate
               for g in s0.groups)  # fmt: skip
    # k_mix: every group holds each width on its quota of channels (and so the table, compared above)
    for g in s0.groups:
        assert (g.k_widths is not None) == k_mix
        if k_mix:
            assert mixed_width_counts(g, cfg.kbits) == [D // 4, D // 2, D // 4]
    # v_sym: V blocks of a scale and the codes (the state compared above holds no min); the reference's mins are
    # -1.5 times the scales' magnitudes
    assert st.VB == (2 if v_sym else 4) + cfg.Gv * cfg.vbits // 8
    if v_sym:
        for g in s0.groups:
            want_m = np.float32(-1.5) * np.abs(g.v_scale.astype(np.float32))
            np.testing.assert_array_equal(np.asarray(g.v_min, np.float32), want_m)
    return caches


def head_config(head: tuple, outlier_num: int, aux_cap: int, v_rotate: bool) -> ref.OttConfig:
    """The reference's config of a (K bits, V bits, G, Gv[, k_mix[, v_sym]]) head."""
    kbits, vbits, G, Gv, *flags = head
    k_mix, v_sym = (bool(f) for f in (*flags, False, False)[:2])
    return ref.OttConfig(k_bits=kbits, v_bits=vbits, G=G, Gv=Gv, R=32, outlier_num=outlier_num, aux_cap=aux_cap,
                         no_outlier_layers=0, v_rotate=v_rotate, k_mix=k_mix_of(kbits, k_mix), v_sym=v_sym)  # fmt: skip


def check_state(st: LayerState, want: ref.HeadState, cfg: ref.OttConfig, s: int, h: int) -> None:
    assert st.n_sealed[s] == want.n_sealed and st.n_pos[s] == want.n_pos
    for g in want.groups:
        kq, vq = pack_group(g, cfg)
        np.testing.assert_array_equal(st.arrays["sk"][s, h, g.index], kq.reshape(-1), err_msg=f"K of group {g.index}")
        np.testing.assert_array_equal(st.arrays["sv"][s, h, g.index], vq.reshape(-1), err_msg=f"V of group {g.index}")
    pool, aux, tracing = st.pools(s, h)
    for got, exp, what in ((pool, want.pool, "outlier pool"), (aux, want.aux, "aux pool")):
        assert got.pos.tolist() == exp.pos.tolist(), what
        np.testing.assert_array_equal(got.score, exp.score.astype(np.float32), err_msg=what)
        np.testing.assert_array_equal(got.k.view(np.uint16), exp.k.view(np.uint16), err_msg=what)
        np.testing.assert_array_equal(got.v.view(np.uint16), exp.v.view(np.uint16), err_msg=what)
    assert tracing == want.tracing
    rk, rv = st.ring_rows(s, h, want.tail_pos)
    np.testing.assert_array_equal(rk.view(np.uint16), want.tail_k.view(np.uint16), err_msg="ring K")
    np.testing.assert_array_equal(rv.view(np.uint16), want.tail_v.view(np.uint16), err_msg="ring V")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_cuda_ops_match_reference(emu: OpsLib, case: tuple) -> None:
    run_scenario(emu, case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_fused_merge_and_seal_match_reference(emu: OpsLib, case: tuple) -> None:
    """The merge and the seal in one launch (what ggml-cuda runs when a layer's seal follows its merge), its
    blocks emulated last first, so every seal block runs before the merge blocks: the same attention and the
    same state, bit for bit, as the reference."""
    run_scenario(emu, case, fused=True)


def test_fused_launch_gives_the_unfused_bits(emu: OpsLib) -> None:
    """Two copies of a layer, one run with the merge and the seal as two launches and one with them fused: the
    attention outputs and every state tensor equal bit for bit after each ubatch (the merge's summation order
    is unchanged, so batch invariance carries over)."""
    head, D, H, n_head, outlier_num, aux_cap, v_rotate = CASES[0]
    cfg = head_config(head, outlier_num, aux_cap, v_rotate)
    tag = head_tag(*head)
    rng = np.random.default_rng(5)
    n_stream, n_total = 2, sum(SCHEDULE)
    two = [LayerState(cfg, outlier_num, D, H, n_head, n_stream, n_ctx=n_total + 8) for _ in range(2)]
    kv = rng.standard_normal((2, n_stream, n_total, H, D)).astype(np.float32)
    start = 0
    for n in SCHEDULE:
        q = (rng.standard_normal((n_stream, n, n_head, D)) * 0.5).astype(np.float32)
        k, v = kv[0, :, start : start + n], kv[1, :, start : start + n]
        NS = 8 if n <= 4 else 2
        outs = [two[f].step(emu, tag, list(range(n_stream)), q, k, v, NS=NS, fused=bool(f)) for f in (0, 1)]
        np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32), err_msg=f"output at {start}")
        for name, arr in two[0].arrays.items():
            np.testing.assert_array_equal(arr, two[1].arrays[name], err_msg=f"{name} at {start}")
        start += n
    assert two[1].n_sealed[0] >= 4 and int(two[1].arrays["pmeta"][0, 0, 2 * two[1].S]) == outlier_num


@pytest.mark.parametrize("case", rotate(CASES, 5), ids=case_id)
def test_emulated_ops_do_not_depend_on_the_order_of_threads(emu: OpsLib, case: tuple) -> None:
    """A race finder without a GPU: two copies of a layer through SCHEDULE, one emulated with blocks, threads,
    warps and lanes in ascending order, one with all of them descending (the fused merge and seal then runs its
    merge blocks first). A GPU runs them at once, so where the bits depend on the order (a thread reading what
    another writes in the same phase, a warp what another warp writes before a barrier, a block another block's
    output) the kernels race; here the attention outputs and every state tensor must be equal bit for bit after
    each ubatch. Decode ubatches run with many slices (most of them empty), prefill ubatches fused. Five cases
    per run in turn (every case under make test-all; the sanitizer test runs both orders of its head config)."""
    head, D, H, n_head, outlier_num, aux_cap, v_rotate = case
    cfg = head_config(head, outlier_num, aux_cap, v_rotate)
    tag = head_tag(*head)
    rng = np.random.default_rng(11)
    n_stream, n_total = 2, sum(SCHEDULE)
    two = [LayerState(cfg, outlier_num, D, H, n_head, n_stream, n_ctx=n_total + 8) for _ in range(2)]
    k_all, v_all = scenario_kv(rng, n_stream, n_total, H, D)
    start = 0
    try:
        for n in SCHEDULE:
            q = (rng.standard_normal((n_stream, n, n_head, D)) * 0.5).astype(np.float32)
            k, v = k_all[:, start : start + n], v_all[:, start : start + n]
            NS = 64 if n <= 4 else 1 + start % 3
            outs = []
            for reverse in (False, True):
                emu.emu_order(reverse)
                outs.append(two[reverse].step(emu, tag, list(range(n_stream)), q, k, v, NS=NS, fused=n > 4))
            np.testing.assert_array_equal(
                outs[0].view(np.uint32), outs[1].view(np.uint32), err_msg=f"output at {start}"
            )
            for name, arr in two[0].arrays.items():
                np.testing.assert_array_equal(arr, two[1].arrays[name], err_msg=f"{name} at {start}")
            start += n
    finally:
        emu.emu_order(False)
    assert two[1].n_sealed[0] >= 4


SANITIZED_RUN = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import test_cuda_emu as t
from cuda_ops import OpsLib
lib = OpsLib(Path(sys.argv[2]), "emu", [sys.argv[3]])
cases = [c for c in t.CASES if t.head_tag(*c[0]) == sys.argv[3]]
for case in cases:
    for reverse in (False, True):
        lib.emu_order(reverse)
        t.run_scenario(lib, case, fused=reverse)
if sys.argv[3] == t.head_tag(2, 2, 64, 32):
    t.run_scenario(lib, ((2, 2, 64, 32), 64, 1, 2, 60, 100, False), fused=True)
print("sanitized", len(cases), flush=True)
"""


@pytest.mark.parametrize("head", rotate(HEADS), ids=lambda h: head_tag(*h))
def test_emulated_ops_under_address_and_undefined_behaviour_sanitizers(sources: Path, head: tuple,
                                                                       tmp_path: Path) -> None:  # fmt: skip
    """What a GPU does not report: a read past a shared array or a buffer (the GPU reads whatever lies there), an
    integer overflow, a shift past the width. The head config's emulation built with AddressSanitizer and
    UndefinedBehaviorSanitizer runs its cases (ascending unfused, then descending fused; the pool-heavy case for G 64)
    against the reference in a process of its own; the first report fails it. One head config per run in turn
    (build ~25 s), all of them under make test-all."""
    tag = head_tag(*head)
    lib = build_emu(sources, [tag], tmp_path, sanitize=True)
    res = subprocess.run([sys.executable, "-c", SANITIZED_RUN, str(Path(__file__).parent), str(lib), tag],
                         capture_output=True, text=True, env=sanitizer_env(), timeout=900)  # fmt: skip
    n = sum(head_tag(*c[0]) == tag for c in CASES)
    assert res.returncode == 0 and f"sanitized {n}" in res.stdout, (res.stdout + res.stderr)[-6000:]


def one_stream_lockstep(lib: OpsLib, tag: str, st: LayerState, cache: ref.OttCache, cfg: ref.OttConfig,
                        rng: np.random.Generator, k: np.ndarray, v: np.ndarray, n_head: int) -> None:  # fmt: skip
    """Stream 0, head 0: all but 3 tokens as one ubatch, then 1 and 2 (decode with 8 slices); attention and the
    whole state against the reference after each."""
    n, D = k.shape
    scale = 1.0 / math.sqrt(D)
    start = 0
    for m in (n - 3, 1, 2):
        q = (rng.standard_normal((1, m, n_head, D)) * 0.5).astype(np.float32)
        kk, vv = k[None, start : start + m, None], v[None, start : start + m, None]
        got = st.step(lib, tag, [0], q, kk, vv, NS=8 if m == 1 else 1)
        want = cache.process_ubatch(0, 0, q[0], kk[0], vv[0], np.arange(start, start + m), scale, int8_query=True)
        assert want is not None
        vmax = float(np.abs(cache.state(0, 0, 0).served()[2]).max())
        np.testing.assert_allclose(got[0], want, rtol=2e-4, atol=5e-5 * vmax, err_msg=f"at {start}")
        start += m
        check_state(st, cache.state(0, 0, 0), cfg, 0, 0)


@pytest.mark.parametrize("fused", [False, True], ids=["seal", "merge_seal"])
def test_emulated_seal_moves_many_pool_rows(emu: OpsLib, fused: bool) -> None:
    """The seal's pool bookkeeping (all threads: ranks, slots from counts, rows staged in shared memory by tiles
    of 64) at sizes the cases above do not reach: 60 pool members among 124 candidates, up to 36 losers per
    sealing event, an aux pool past 64 rows whose members move up in more than one tile, and the stop rule,
    bit for bit against the reference after every ubatch; alone and in the merge's launch."""
    caches = run_scenario(emu, ((2, 2, 64, 32), 64, 1, 2, 60, 100, False), fused=fused)
    for c in caches:
        st = c.state(0, 0, 0)
        assert len(st.pool) == 60 and len(st.aux) > 64 and not st.tracing


@pytest.mark.parametrize("head", [(3, 2, 128, 64), (3, 2, 128, 64, True, True), (2, 2, 64, 32, False, True)],
                         ids=lambda h: head_tag(*h))  # fmt: skip
def test_emulated_rotated_values_fall_back_per_unit(emu: OpsLib, head: tuple) -> None:
    """v_rotate with a token whose rotated values overflow the fp16 scale: that unit alone is stored unrotated
    (sign bits clear there, set everywhere else), bit for bit as the reference, and attention still matches; with
    v_sym the unrotated unit is a symmetric block too (full range: max |x| spans the levels)."""
    cfg = head_config(head, 3, 8, True)
    G, Gv = cfg.G, cfg.Gv
    D, H, n_head, n = 128, 1, 2, 2 * G + 40
    st = LayerState(cfg, 3, D, H, n_head, n_stream=1, n_ctx=n + 8)
    cache = ref.OttCache(cfg, 1, H, D)
    rng = np.random.default_rng(7)
    k, v = keys_values(rng, n, D)
    v[5, :64] = 60000.0  # unit 0 of token 5: rotated, 8 x 60000 does not fit fp16, even clipped
    v[9, 64:] = 0.5  # a constant unit: scale 0, flagged as -0.0
    one_stream_lockstep(emu, head_tag(*head), st, cache, cfg, rng, k, v, n_head)
    groups = cache.state(0, 0, 0).groups
    assert len(groups) == 2
    per_unit = 64 // Gv  # blocks per rotation unit
    flags = np.signbit(groups[0].v_scale)  # (G, D/Gv)
    assert not flags[5, :per_unit].any() and flags[5, per_unit:].all() and flags[np.arange(G) != 5].all()
    assert np.signbit(groups[1].v_scale).all()


def test_emulated_mixed_key_widths_break_ties_to_the_lower_channel(emu: OpsLib) -> None:
    """k_mix ranks channels by (max - min)*max(|max|, |min|), ties to the lower channel: a criterion shared by
    three channels across the 4-bit quota's edge, and constant channels (criterion 0) across the 2-bit quota's,
    give the widths the reference gives, bit for bit (codes, scales, mins and the width table)."""
    cfg = ref.OttConfig(k_bits=3, v_bits=2, R=32, outlier_num=3, aux_cap=8, no_outlier_layers=0, k_mix=True)
    D, H, n_head, n = 64, 1, 2, 2 * cfg.G + 40
    st = LayerState(cfg, 3, D, H, n_head, n_stream=1, n_ctx=n + 8)
    cache = ref.OttCache(cfg, 1, H, D)
    rng = np.random.default_rng(11)
    k = rng.standard_normal((n, D)).astype(np.float32)
    v = rng.standard_normal((n, D)).astype(np.float32)
    k[:, 1:16] *= np.float32(100.0)  # ranks 0..14: 4 bits
    k[:, 40] = k[:, 0] * np.float32(30.0)  # ranks 15..17, one criterion (a negated copy has the same range and max)
    k[:, 20], k[:, 50] = -k[:, 40], k[:, 40]
    const = 2 * np.arange(12, 31) + 1  # 19 constant channels (criterion 0) at ranks 45..63
    k[:, const] = np.float32(0.25)
    one_stream_lockstep(emu, head_tag(3, 2, cfg.G, cfg.Gv, True), st, cache, cfg, rng, k, v, n_head)
    groups = cache.state(0, 0, 0).groups
    assert len(groups) == 2
    for g in groups:
        w = g.k_widths
        assert w is not None
        assert (w[1:16] == 4).all() and w[20] == 4 and w[40] == 3 and w[50] == 3  # the tie across ranks 15, 16
        assert (w[const[:3]] == 3).all() and (w[const[3:]] == 2).all()  # and across ranks 47, 48


def test_cdef_matches_the_generated_header(sources: Path) -> None:
    """cuda_ops.CDEF declares ott_cu_args field for field as the generated header (cffi would not notice)."""
    text = (sources / "ott2-cuda.h").read_text()
    m = re.search(r"typedef struct \{(.*?)\} ott_cu_args;", text, re.S)
    assert m

    def fields(body: str) -> list[str]:
        body = re.sub(r"//[^\n]*", "", body)
        return [" ".join(f.split()) for f in body.split(";") if f.strip()]

    want = fields(m.group(1))
    cdef = re.search(r"typedef struct \{(.*?)\} ott_cu_args;", CDEF, re.S)
    assert cdef and fields(cdef.group(1)) == want


def test_one_stream_of_several_and_nonfinite_flag(emu: OpsLib) -> None:
    """A ubatch for stream 1 alone (the plan maps ubatch streams to cache streams); a NaN in K marks only
    that stream, and its tokens are still written where the CPU op writes them."""
    cfg = ref.OttConfig(no_outlier_layers=0)
    D, H, n_head = 64, 2, 4
    st = LayerState(cfg, 3, D, H, n_head, n_stream=3, n_ctx=512)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 5, n_head, D)).astype(np.float32)
    k = rng.standard_normal((1, 5, H, D)).astype(np.float32)
    v = rng.standard_normal((1, 5, H, D)).astype(np.float32)
    out = st.step(emu, TAGS[0], [1], q, k, v, NS=1)
    assert np.isfinite(out).all()
    assert st.n_pos == [0, 5, 0] and st.arrays["flags"].tolist() == [0, 0, 0]
    k[0, 2, 1, 7] = np.nan
    st.step(emu, TAGS[0], [1], q, k, v, NS=1)
    assert st.arrays["flags"].tolist() == [0, 1, 0]


@pytest.fixture(scope="module")
def cuda_lib(sources: Path) -> OpsLib:
    # OTT_CUDA_TESTLIB: the same library built elsewhere from these templates (study/gpu_offline/bundle.sh builds
    # it for the GPU machine, where the nvcc of 9 head configs would take minutes of a short lease)
    if prebuilt := os.environ.get("OTT_CUDA_TESTLIB"):
        return OpsLib(Path(prebuilt), "cuda", TAGS)
    # one nvcc build (about 40 s) for every case
    return OpsLib(build_cuda_testlib(sources, TAGS, sources), "cuda", TAGS)


@pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU and nvcc (run on a CUDA machine: make gpu-test)")
@pytest.mark.parametrize("fused", [False, True], ids=["seal", "merge_seal"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_ops_on_gpu(cuda_lib: OpsLib, case: tuple, fused: bool) -> None:
    run_scenario(cuda_lib, case, fused=fused)


def perplexity_kld(model: Path, text: Path, base: Path, kv: str, env: dict[str, str]) -> tuple[float, float, str]:
    """Mean KLD against the saved base logits, same-top-1 rate and the output, from llama-perplexity (-ngl 0: the
    CPU ops, also in a CUDA build)."""
    from ott_gguf._lib import bin_path

    cmd = [str(bin_path("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "512", "--chunks", "2",
           "-t", "2", "-b", "512", "-ub", "128", "-ctk", kv, "-ctv", kv, "--kl-divergence-base", str(base),
           "-ngl", "0"]  # fmt: skip
    if kv == "f16":
        res = subprocess.run([*cmd, "-fa", "0"], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return 0.0, 1.0, res.stdout + res.stderr
    res = subprocess.run([*cmd, "--kl-divergence"], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    kld = re.search(r"Mean\s+KLD:\s+([0-9.]+)", out)
    top = re.search(r"Same top p:\s+([0-9.]+)", out)
    assert kld and top, out[-2000:]
    return float(kld.group(1)), float(top.group(1)) / 100, out


# one model per run, in turn (helpers.rotate; make test-all: both): each run checks the emulated CUDA path through a
# whole model; SmolLM2 (D 64, GQA) and Gemma 3 (D 256, sliding-window layers beside) alternate
@pytest.mark.parametrize("model_name", rotate(["smollm2", "gemma3"]))
def test_emulated_cuda_path_inside_the_model(model_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The whole CUDA path's logic in the real graph: the test library ott_cuda_emu, preloaded into
    llama-perplexity, makes ggml-cpu run the CUDA kernels' emulation (its ott2 ops hook, ggml_ott_cpu_set_impl)
    with the arguments the CUDA dispatch builds (ggml-ott-args.h) and the GPU's slicing, on
    real text through SmolLM2 (D 64, GQA) and Gemma 3 (D 256, ott2 beside the f16 window layers), every layer's
    seal run in its merge's launch (the fused launcher, as ggml-cuda runs it at decode). Logits cannot
    be equal (fp32 summation order differs, and this model amplifies one-ulp differences through fp16 and 2-bit
    rounding), so the check is quality parity with the CPU path against f16 (a wrong row, slot or cover would
    show as a kivi2-like KLD or worse)."""
    from ott_gguf.corpus import docs_text

    model = request.getfixturevalue(model_name)
    text = tmp_path / "docs.txt"
    text.write_text(docs_text(60_000))
    base = tmp_path / "f16.kld"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    perplexity_kld(model, text, base, "f16", env)
    cpu = perplexity_kld(model, text, base, "ott2", env)
    emu = perplexity_kld(model, text, base, "ott2", {**env, "LD_PRELOAD": str(built_lib("ott_cuda_emu"))})
    # the emulation ran the graph's ott2 ops (the library counts them and says so on unload)
    # the merges ran their layers' seals in their launches, as ggml-cuda's at decode
    ran = re.search(r"ott-cuda-emu: (\d+) emulated ott2 ops, (\d+) merges with their seal", emu[2])
    assert "ott-cuda-emu: ggml-cpu runs" in emu[2] and ran and int(ran.group(2)) > 0, emu[2][-2000:]
    print(f"{model_name}: KLD vs f16: cpu {cpu[0]:.4f} (top-1 {cpu[1]:.3f}), emulated cuda {emu[0]:.4f} ({emu[1]:.3f})")
    assert abs(emu[0] - cpu[0]) <= 0.25 * cpu[0] + 0.003
    assert abs(emu[1] - cpu[1]) <= 0.04


def test_the_package_ships_no_test_code() -> None:
    """The test libraries (the emulation, the kernel library) are built for the tests only: the installed package
    holds neither, and no installed library reads the environment to switch to the emulation."""
    from ott_gguf._lib import LIB_DIR, lib_path

    names = sorted(p.name for p in LIB_DIR.iterdir())
    assert not [n for n in names if "ott_kernels" in n or "cuda_emu" in n], names
    for lib in ("ggml-cpu", "ggml-base", "llama"):
        data = lib_path(lib).read_bytes()
        assert b"OTT_GGUF_EMULATE" not in data and b"ott2_emu" not in data, lib
    syms = subprocess.run(["nm", "-D", str(lib_path("ggml-cpu"))], capture_output=True, text=True, check=True).stdout
    assert "ggml_ott_cpu_set_impl" in syms  # the hook the test library registers through


# in a subprocess: the emulation, once loaded, replaces ggml-cpu's ott2 ops for the rest of its process
BATCHING_SCRIPT = r"""
import ctypes, sys
import numpy as np
from ott_gguf import Llama
from ott_gguf.corpus import docs_text

model, emu, n, k, save = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = Llama(model, vocab_only=True, verbose=False)  # loads ggml: the emulation registers with it on load
tokens = llm.tokenize(docs_text(40_000).encode())[:n]
llm.close()
ctypes.CDLL(emu, mode=ctypes.RTLD_GLOBAL)


def last(chunks, n_ubatch):
    llm = Llama(model, kv_type="ott2", n_ctx=512, n_batch=512, n_ubatch=n_ubatch, verbose=False)
    i = 0
    for c in chunks:
        llm.eval(tokens[i : i + c])
        i += c
    out = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
    llm.close()
    return out


base = last([n], 512)
np.save(save, base)
modes = {"token by token": ([n - k] + [1] * k, 512), "ubatches of 64": ([n], 64)}
for name, (chunks, ub) in modes.items():
    print(name, float(np.abs(last(chunks, ub) - base).max()), flush=True)
"""


# the tuning knobs of a GPU session (docs/cuda-harness.md "Tuning builds"): another instance of the partials (4
# warps where the launcher takes 16 at D 64) and 1 sealed group per slice instead of 4. Both change bits with the
# prompt's 2 sealed groups (8 items of 32 tokens): 4 warps take 2 items each where 16 take 1, and the groups fall in
# 2 slices where the context's 3 make 1 (with 8 warps or 2 groups per slice the bits would be the launcher's here)
TUNED = {"OTT_CUDA_PART": "2,4,4", "OTT_SLICE_GROUPS": "1"}


def test_emulated_cuda_path_is_batch_invariant(smollm2: Path, tmp_path: Path) -> None:
    """The CUDA kernels' logic (the emulation in ggml-cpu's place) gives a prompt's last logits bit for bit
    whether the prompt runs as one ubatch, in ubatches of 64, or with its last 40 tokens decoded one at a time (a
    decoded token's partials run with one row per query head, across the seal of group 1 at position 287): the
    attention partials' instance, which fixes the order a row's items are summed in, must not depend on the
    ubatch. (A version that ran decoded tokens with 16 warps and prefill blocks with 4 moved them by 0.33 token by
    token, measured with that library built by hand; 0.0 in both modes now.) The same with the tuning knobs set
    (TUNED: another instance and slice count, as a GPU session times them), whose last logits must differ from
    the launcher's (the knobs took effect) by no more than a summation order explains (KL below 0.1)."""
    env = {k: v for k, v in os.environ.items() if k not in TUNED}
    bases = []
    for tuned in (False, True):
        save = tmp_path / f"base{int(tuned)}.npy"
        res = subprocess.run([sys.executable, "-c", BATCHING_SCRIPT, str(smollm2), str(built_lib("ott_cuda_emu")),
                              "300", "40", str(save)], capture_output=True, text=True, timeout=900,
                             env={**env, **TUNED} if tuned else env)  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        assert "ott-cuda-emu: ggml-cpu runs the CUDA kernels' emulation" in res.stderr, res.stderr[-2000:]
        diffs = dict(re.findall(r"^(token by token|ubatches of 64) (\S+)$", res.stdout, re.M))
        print("tuned" if tuned else "launcher", diffs)
        assert set(diffs) == {"token by token", "ubatches of 64"}, diffs
        assert all(float(d) == 0.0 for d in diffs.values()), diffs
        bases.append(np.load(save))
    moved = float(np.abs(bases[1] - bases[0]).max())
    p0, p1 = (np.exp(b.astype(np.float64) - b.max()) for b in bases)
    p0, p1 = p0 / p0.sum(), p1 / p1.sum()
    kl = float(np.sum(p0 * (np.log(p0) - np.log(p1))))
    # measured: max 1.42, KL 0.021 (OTT_CUDA_PART alone 1.34 / 0.030, OTT_SLICE_GROUPS alone 0.45 / 0.0022): a
    # summation order amplified through 2-bit codes over 30 layers; a wrong instance's attention would be far off
    print(f"tuned vs launcher: max |logit difference| {moved:.3g}, KL {kl:.3g}")
    assert moved > 0.0 and kl < 0.1, (moved, kl)


@pytest.mark.parametrize(("var", "value", "said"), [
    ("OTT_CUDA_PART", "3,4,8", "OTT_CUDA_PART=3,4,8 is not an instance of the attention partials at head dimension 64"),
    ("OTT_CUDA_PART", "2x4x8", "OTT_CUDA_PART=2x4x8: expected <channels per lane>,<rows per pass>,<warps>"),
    ("OTT_SLICE_GROUPS", "0", "OTT_SLICE_GROUPS=0: expected the sealed groups per slice"),
])  # fmt: skip
def test_tuning_knobs_refuse_what_does_not_exist(smollm2: Path, var: str, value: str, said: str) -> None:
    """A knob set to an instance the build lacks, or to something unreadable, ends the process with a message that
    names it, before any token is computed (never the launcher's kernel in its place)."""
    script = (
        "import ctypes, sys\nfrom ott_gguf import Llama\n"
        "Llama(sys.argv[1], vocab_only=True, verbose=False).close()\n"
        "ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)\n"
        "llm = Llama(sys.argv[1], kv_type='ott2', n_ctx=256, verbose=False)\nllm.eval(llm.tokenize(b'Hello there'))\n"
        "print('evaluated')\n"
    )
    env = {**{k: v for k, v in os.environ.items() if k not in TUNED}, var: value}
    res = subprocess.run([sys.executable, "-c", script, str(smollm2), str(built_lib("ott_cuda_emu"))],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert res.returncode != 0 and "evaluated" not in res.stdout, res.stdout[-2000:]
    assert said in res.stderr, res.stderr[-2000:]
