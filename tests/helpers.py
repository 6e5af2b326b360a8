"""Helpers shared by the tests (tests/ is on sys.path: pytest's default import mode)."""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
import pytest
from native_kernels import PoolArrays, SealResult

from ott_gguf import quantizer as Q
from ott_gguf import reference as ref
from ott_gguf.cli import main
from ott_gguf.evaluate import eval_logits, kl_divergence  # noqa: F401 (the K/V quality tests import them from here)
from ott_gguf.kv_types import resolve_kv_types
from ott_gguf.server import Server, free_port

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
OTT_GGUF = Path(sys.executable).with_name("ott-gguf")


# The test matrix (issue 50): kinds of checks whose every case is slow (an nvcc build per GPU architecture, ...)
# run one case per kind in a normal run, chosen by a rotation that moves with every commit, so that consecutive
# commits cover the whole matrix; `make test-all` (OTT_TEST_ALL=1) runs every case. OTT_TEST_ROTATION=N repeats a
# run's choice (each run prints its rotation at the end).
_T = TypeVar("_T")
TEST_ALL = os.environ.get("OTT_TEST_ALL", "").lower() in ("1", "true", "yes")


@functools.cache
def rotation() -> int:
    """The run's rotation: OTT_TEST_ROTATION, else the number of commits of the checkout (0 without git)."""
    if "OTT_TEST_ROTATION" in os.environ:
        return int(os.environ["OTT_TEST_ROTATION"])
    import subprocess

    r = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--count", "HEAD"], capture_output=True, text=True)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0


def rotate(cases: Sequence[_T], n: int = 1) -> list[_T]:
    """n of the cases (all of them under OTT_TEST_ALL), taken in turn by the rotation."""
    if TEST_ALL or n >= len(cases):
        return list(cases)
    r = rotation()
    return [cases[(r * n + i) % len(cases)] for i in range(n)]


def require_tool(*names: str, hint: str) -> None:
    """Skip when a tool is missing on a developer machine; in CI a missing tool is a failure."""
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        msg = f"missing {', '.join(missing)} ({hint})"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def make_inputs(rng: np.random.Generator, group: int, nblocks: int = 64) -> np.ndarray:
    """Blocks of varied scale and shape, with the adversarial ones every run: constant, +-0, huge, tiny,
    exact ties at code midpoints, one outlier among small values."""
    x = rng.standard_normal((nblocks, group)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-4, 3, size=(nblocks, 1)).astype(np.float32)
    x[:, :] += rng.uniform(-5, 5, size=(nblocks, 1)).astype(np.float32)
    x[0] = 1.25  # constant group: range 0
    x[1] = 0.0
    x[1, ::2] = -0.0  # min of +0/-0 mixes
    x[2] = rng.uniform(-20000, 20000, group)  # large magnitudes (fp16 scale still finite)
    x[3] = rng.uniform(-1e-6, 1e-6, group)  # scale underflows to an fp16 subnormal
    x[4] = np.linspace(0, 3, group)  # 0, ..., 3 with scale 1: many values land exactly on .5 ties
    x[4, : group // 4] = np.array([0.5, 1.5, 2.5, 0.0] * (group // 16))[: group // 4]
    x[5] = 1e-3
    x[5, 7] = 50.0  # one outlier
    x[6] = rng.integers(-3, 4, group).astype(np.float32) * np.float32(0.25)
    x[7] = -7.0
    x[7, 3] = -7.0 + 1e-7  # range below fp16 resolution of the scale: scale 0
    return x.reshape(-1)


# --- per-head kernels of the ott2 cache vs the numpy reference ---------------------------------------------


class HeadKernels(Protocol):
    """What the head-kernel tests drive: the cffi kernels, or the aarch64 driver under qemu."""

    k_block_bytes: int
    v_block_bytes: int
    vrot: bool  # V stored rotated
    vint: int  # bits of the integer V weights, 0: fp32 (reference.attend int_values)

    def seal(self, gk: np.ndarray, gv: np.ndarray, pos0: int, outlier_num: int, aux_cap: int, pool: PoolArrays,
             aux: PoolArrays, tracing: bool) -> SealResult: ...  # fmt: skip

    def attn(self, q: np.ndarray, q_pos: int, scale: float, kq: np.ndarray, vq: np.ndarray, n_sealed: int,
             pooled_pos: np.ndarray, pooled_k: np.ndarray, pooled_v: np.ndarray, tail_pos0: int,
             tail_k: np.ndarray, tail_v: np.ndarray) -> np.ndarray: ...  # fmt: skip

    def attn_rows(self, q: np.ndarray, q_pos: np.ndarray, scale: float, kq: np.ndarray, vq: np.ndarray,
                  n_sealed: int, pooled_pos: np.ndarray, pooled_k: np.ndarray, pooled_v: np.ndarray, tail_pos0: int,
                  tail_k: np.ndarray, tail_v: np.ndarray) -> np.ndarray: ...  # fmt: skip


def k_mix_of(kbits: int, kmix: bool) -> bool | int:
    """OttConfig.k_mix for a head config with (kmix) or without mixed K widths: level 2 for 2-bit keys (1/2/3 bits),
    the flag itself otherwise (kv_types.K_MIX_WIDTHS)."""
    return 2 if kmix and kbits == 2 else kmix


def mixed_width_counts(g: ref.SealedGroup, kbits: int) -> list[int]:
    """How many channels of a k_mix group sit at kbits - 1, kbits and kbits + 1 bits."""
    assert g.k_widths is not None
    return np.bincount(g.k_widths, minlength=kbits + 2)[kbits - 1 : kbits + 2].tolist()


def as_arrays(p: ref.Pool) -> PoolArrays:
    return PoolArrays(pos=p.pos.astype(np.int32), score=p.score.astype(np.float32), k=p.k, v=p.v)


def pack_group(g: ref.SealedGroup, cfg: ref.OttConfig) -> tuple[np.ndarray, np.ndarray]:
    """A reference group in the kernels' layout: (the head's K region as flat bytes, V blocks (G*D/Gv, VB))."""
    D, G = g.k_codes.shape
    if g.k_widths is None:
        kq = Q.pack(Q.Quantized(g.k_codes.reshape(D, 1, G), g.k_scale.reshape(D, 1), g.k_min.reshape(D, 1)),
                    cfg.k_format)  # fmt: skip
        kq = kq.reshape(-1)
    else:
        # k_mix: channel blocks in channel order, each at its width, then the 2-bit width table (width - kbits + 1,
        # channel c at bits 2*(c % 4) of byte c // 4): gen/templates/ott_head.c.j2
        blocks = [
            Q.pack(Q.Quantized(g.k_codes[c].reshape(1, 1, G), g.k_scale[c : c + 1].reshape(1, 1),
                               g.k_min[c : c + 1].reshape(1, 1)), cfg.k_format_of(int(g.k_widths[c]))).reshape(-1)
            for c in range(D)
        ]  # fmt: skip
        w = (g.k_widths.astype(np.uint8) - (cfg.kbits - 1)).reshape(D // 4, 4)
        table = (w[:, 0] | (w[:, 1] << 2) | (w[:, 2] << 4) | (w[:, 3] << 6)).astype(np.uint8)
        kq = np.concatenate([*blocks, table])
    vq = Q.pack(Q.Quantized(g.v_codes.reshape(G, D // cfg.Gv, cfg.Gv), g.v_scale, g.v_min), cfg.v_format)
    return kq, vq


def assert_pool_equal(got: PoolArrays, want: ref.Pool, what: str) -> None:
    assert got.pos.tolist() == want.pos.tolist(), what
    np.testing.assert_array_equal(got.score, want.score.astype(np.float32), err_msg=what)
    np.testing.assert_array_equal(got.k.view(np.uint16), want.k.view(np.uint16), err_msg=what)
    np.testing.assert_array_equal(got.v.view(np.uint16), want.v.view(np.uint16), err_msg=what)


@dataclass
class Native:
    """The native side's state of one head, advanced only by the native seal kernel."""

    D: int
    pool: PoolArrays = field(init=False)
    aux: PoolArrays = field(init=False)
    tracing: bool = True
    kq: list[np.ndarray] = field(default_factory=list)
    vq: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        e = np.zeros((0, self.D), np.float16)
        self.pool = PoolArrays(np.zeros(0, np.int32), np.zeros(0, np.float32), e, e)
        self.aux = PoolArrays(np.zeros(0, np.int32), np.zeros(0, np.float32), e, e)


def lockstep(hk: HeadKernels, cfg: ref.OttConfig, outlier_num: int, k: np.ndarray, v: np.ndarray,
             ubatches: list[int]) -> tuple[ref.HeadState, Native]:  # fmt: skip
    """Feed the same tokens to the reference and to the native seal kernel; compare after every seal."""
    D = k.shape[1]
    st = ref.HeadState.empty(cfg.G, D)
    nat = Native(D)
    start = 0
    for n in ubatches:
        sl = slice(start, start + n)
        st.tail_pos = np.concatenate([st.tail_pos, np.arange(start, start + n)])
        st.tail_k = np.concatenate([st.tail_k, k[sl].astype(np.float16)])
        st.tail_v = np.concatenate([st.tail_v, v[sl].astype(np.float16)])
        start += n
        while st.n_pos - (st.n_sealed + 1) * cfg.G >= cfg.R:
            g = st.n_sealed
            res = hk.seal(st.tail_k[: cfg.G], st.tail_v[: cfg.G], g * cfg.G, outlier_num, cfg.aux_cap,
                          nat.pool, nat.aux, nat.tracing)  # fmt: skip
            ref.seal_group(st, cfg, outlier_num)
            kq, vq = pack_group(st.groups[-1], cfg)
            np.testing.assert_array_equal(res.kq, kq, err_msg=f"K blocks of group {g}")
            np.testing.assert_array_equal(res.vq, vq, err_msg=f"V blocks of group {g}")
            assert_pool_equal(res.pool, st.pool, f"outlier pool after group {g}")
            assert_pool_equal(res.aux, st.aux, f"aux pool after group {g}")
            assert res.tracing == st.tracing
            assert res.n_won == len(st.groups[-1].placeholders)
            nat.pool, nat.aux, nat.tracing = res.pool, res.aux, res.tracing
            nat.kq.append(res.kq)
            nat.vq.append(res.vq)
    return st, nat


def check_attention(hk: HeadKernels, st: ref.HeadState, nat: Native, rng: np.random.Generator) -> None:
    """Both attention kernels against the reference: the single-row one (fp32 scores) within fp32 tolerance; the
    multi-row ones the cache's op uses equal within fp32 rounding to the reference with the int8 query they
    specify, and close to exact attention (the int8 query is their only approximation)."""
    D = st.head_dim
    scale = 1.0 / math.sqrt(D)
    pooled = st.pooled()
    kq = np.concatenate(nat.kq) if nat.kq else np.zeros(0, np.uint8)
    vq = np.concatenate(nat.vq) if nat.vq else np.zeros((0, hk.v_block_bytes), np.uint8)
    lo = st.n_sealed * st.G
    vmax = float(np.abs(st.served()[2]).max())
    for q_pos in sorted({st.n_pos - 1, max(lo, st.n_pos - 5), lo}):
        q = (rng.standard_normal(D) * 0.5).astype(np.float32)
        want = ref.attend(st, q[None], np.array([q_pos]), scale)[0]
        got = hk.attn(q, q_pos, scale, kq, vq, st.n_sealed, pooled.pos, pooled.k, pooled.v, lo, st.tail_k, st.tail_v)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * vmax)

    q_pos_all = np.array(sorted({st.n_pos - 1, max(lo, st.n_pos - 5), lo, (lo + st.n_pos) // 2}), np.int32)
    q_all = (rng.standard_normal((len(q_pos_all), D)) * 0.5).astype(np.float32)
    # every row count a block of the kernel takes a different path for (AVX2: 2-bit keys left packed up to 3 rows)
    for n_rows in sorted({len(q_pos_all), min(3, len(q_pos_all)), 1}):
        q_pos, q = q_pos_all[:n_rows], q_all[:n_rows]
        got = hk.attn_rows(q, q_pos, scale, kq, vq, st.n_sealed, pooled.pos, pooled.k, pooled.v, lo, st.tail_k,
                           st.tail_v)  # fmt: skip
        want = ref.attend(st, q, q_pos, scale, int8_query=True, int_values=hk.vint, v_rotate=hk.vrot)
        if hk.vint == 8:
            # a weight whose rint sits within rounding of a tie may round the other way in the kernel (its exp is not
            # numpy's): that row moves by one weight step, wmax/255 of a token's codes, at most 2*vmax/255. One such
            # row of the four is allowed; every other element equals the model within fp32 rounding
            err = np.abs(got - want)
            off = (err > 2e-4 * np.abs(want) + 5e-5 * vmax).any(axis=1)
            assert int(off.sum()) <= 1 and float(err.max()) <= 2 * vmax / 255, (off, float(err.max()) / vmax)
        else:
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=5e-5 * vmax)
        exact = ref.attend(st, q, q_pos, scale)
        assert float(np.abs(got - exact).max()) <= 0.05 * vmax


def keys_values(rng: np.random.Generator, n: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys with a few large channels (as post-RoPE keys have), a few planted tiny-key tokens; plain values."""
    ch = np.exp(rng.normal(0, 1.0, D)).astype(np.float32)
    k = (rng.standard_normal((n, D)) * ch).astype(np.float32)
    for t in rng.choice(n, size=max(1, n // 50), replace=False):
        k[t] *= 0.01
    v = rng.standard_normal((n, D)).astype(np.float32)
    return k, v


# --- the `ott-gguf` command line, in-process ------------------------------------------------------------------
# one thread: on this 2-core machine, shared with other work, llama.cpp's two spinning threads slow down badly
THREADS = "1"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int | str | None, str, str]:
    """main(argv) in-process: (exit code or SystemExit's message, stdout, stderr)."""
    try:
        code: int | str | None = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def is_kv_type(cell: str) -> bool:
    """A type name, a K/V pair of them (ott3/ott2) or a tier (quality)."""
    from ott_gguf.tiers import KV_TIERS

    if cell in KV_TIERS:
        return True
    try:
        resolve_kv_types(cell)
    except ValueError:
        return False
    return True


def table(out: str) -> dict[str, dict[str, str]]:
    """The printed table (header line starting with kv_type, columns 2+ spaces apart): kv_type -> column -> cell."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kv_type "))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 1 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if not line.strip() or not is_kv_type(cells[0]):
            break
        rows[cells[0]] = dict(zip(header, cells, strict=False))
    return rows


# --- the `ott-gguf serve` console command --------------------------------------------------------------------


@contextmanager
def serving(model: Path, kv_type: str, n_ctx: int, log: Path, extra: Sequence[str] = (),
            options: Sequence[str] = ()) -> Iterator[Server]:  # fmt: skip
    """`ott-gguf serve` on a free port, waited for until healthy, stopped when the block ends; options go to
    `ott-gguf serve`, extra to llama-server."""
    port = free_port()
    cmd = [str(OTT_GGUF), "serve", str(model), "--kv-type", kv_type, "--port", str(port), *options,
           "--", "-c", str(n_ctx), "-t", "2", *extra]  # fmt: skip
    srv = Server(cmd, "127.0.0.1", port, log=log)
    try:
        srv.wait_healthy(timeout=120)
        yield srv
    finally:
        srv.stop()


# --- a Llama driven token by token (the per-side and per-layer width tests) -----------------------------------------


def doc_prefix(model: Path, n: int) -> list[int]:
    """The first n tokens of the packaged docs in the model's vocabulary."""
    from ott_gguf import Llama
    from ott_gguf.corpus import docs_text

    vocab = Llama(str(model), vocab_only=True, verbose=False)
    toks = vocab.tokenize(docs_text(40 * n).encode())
    vocab.close()
    assert len(toks) >= n
    return toks[:n]


@functools.cache
def f16_logits(model: Path, n: int, first: int = 0) -> np.ndarray:
    """The f16 cache's logits of positions first..n-1 of doc_prefix(model, n) (ott_gguf.evaluate.eval_logits'
    defaults), computed once per session: the quality tests of several files compare against the same reference.
    Read-only: every caller gets the same array."""
    out = eval_logits(model, "f16", doc_prefix(model, n), first=first)
    out.flags.writeable = False
    return out


def last_logits(llm: object) -> np.ndarray:
    """The logits of the last evaluated position."""
    from ott_gguf import _lib

    lc = _lib.llama_cpp_module().llama_cpp
    n_vocab = llm.n_vocab()  # type: ignore[attr-defined]
    return np.ctypeslib.as_array(lc.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()  # type: ignore[attr-defined]


def greedy(llm: object, first: int, n: int) -> list[int]:
    """first, then n tokens chosen greedily, each evaluated alone."""
    out = [first]
    llm.eval(out)  # type: ignore[attr-defined]
    for _ in range(n):
        out.append(int(np.argmax(last_logits(llm))))
        llm.eval(out[-1:])  # type: ignore[attr-defined]
    return out
