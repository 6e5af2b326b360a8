"""The ott caches' CUDA ops (gen/templates/ott_cuda_ops.j2) driven from Python, for the tests.

Two builds of the same template: the CPU emulation (C++, blocks and threads as loops; runs everywhere) and the
CUDA rendering with its test entry points (needs nvcc to build and a GPU to run). Both take one layer's tensors
as numpy arrays in the cache's layouts; `LayerState` holds them and runs the ops as the graph does: attention
(partials, then merge), then the seal; or, as ggml-cuda runs a layer whose seal follows its merge, the partials,
then the merge and the seal in one launch (`fused`).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cffi
import numpy as np
import tool_cache

from ott_gguf import reference as ref

ROOT = Path(__file__).resolve().parents[1]

CDEF = """
typedef struct {
    int32_t D, H, n_head, T, S, NG, NS, ns, n_tok, n_stream, outlier_num, aux_cap;
    float scale;
    int32_t v_rotate;
    const float * q; const float * k; const float * v;
    uint16_t * ring; uint8_t * sk; uint8_t * sv; uint16_t * pkv; int32_t * pmeta; const int32_t * plan;
    int32_t * flags; float * part; float * out; uint16_t * scratch;
} ott_cu_args;
"""


def head_tag(kbits: int, vbits: int, G: int, Gv: int, kmix: bool = False, vsym: bool = False) -> str:
    """The generator's name of a head config (gen/generate.py HeadConfig.tag); kmix: K widths per channel, vsym:
    symmetric V blocks (one scale, no min)."""
    return f"k{kbits}{'m' if kmix else ''}v{vbits}{'s' if vsym else ''}g{G}x{Gv}"


def head_spec(kbits: int, vbits: int, G: int, Gv: int, kmix: bool = False, vsym: bool = False) -> str:
    """A head config as the generator's --cuda-heads item."""
    return f"{kbits}{'m' if kmix else ''}/{vbits}{'s' if vsym else ''}:{G}:{Gv}"


def generate(out: Path, heads: str) -> Path:
    subprocess.run([sys.executable, str(ROOT / "gen" / "generate.py"), "cuda", "--out", str(out),
                    "--cuda-heads", heads], check=True)  # fmt: skip
    return out


class OpsLib:
    """One build of the ops (emulation or CUDA test library) and its entry points."""

    def __init__(self, path: Path, kind: str, tags: list[str]) -> None:
        self.ffi = cffi.FFI()
        self.ffi.cdef(CDEF)
        for t in tags:
            if kind == "emu":
                for op in ("attn", "seal", "attn_part", "attn_merge_seal"):
                    self.ffi.cdef(f"void ott2_emu_{t}_{op}(const ott_cu_args *, void *);")
                self.ffi.cdef(f"void ott2_emu_{t}_emu_order(int);")
            else:
                for op in ("attn", "seal", "attn_seal"):
                    self.ffi.cdef(f"int ott2_cudatest_{t}_{op}(const ott_cu_args *);")
        self.lib: Any = self.ffi.dlopen(str(path))
        self.kind = kind
        self.tags = tags

    def emu_order(self, reverse: bool) -> None:
        """The emulation's order of blocks, threads, warps and lanes: ascending, or all descending (a race on the
        GPU shows as bits that depend on it)."""
        assert self.kind == "emu"
        for t in self.tags:
            getattr(self.lib, f"ott2_emu_{t}_emu_order")(int(reverse))

    def run(self, tag: str, op: str, args: Any) -> None:
        """op: "attn" (partials, merge), "seal", or "attn_seal" (partials, then merge and seal in one launch)."""
        if self.kind == "emu":
            if op == "attn_seal":
                getattr(self.lib, f"ott2_emu_{tag}_attn_part")(args, self.ffi.NULL)
                op = "attn_merge_seal"
            getattr(self.lib, f"ott2_emu_{tag}_{op}")(args, self.ffi.NULL)
        else:
            rc = getattr(self.lib, f"ott2_cudatest_{tag}_{op}")(args)
            if rc != 0:
                raise RuntimeError(f"CUDA error {rc} in {op}")


SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def build_emu(src: Path, tags: list[str], out: Path, sanitize: bool = False) -> Path:
    """The emulation as a shared library: the CUDA kernels' bodies compiled as C++ for this CPU (sanitize: with
    AddressSanitizer and UndefinedBehaviorSanitizer, whose runtimes a process must preload: sanitizer_env)."""
    lib = out / ("libott_cuda_emu_asan.so" if sanitize else "libott_cuda_emu_ops.so")
    srcs = [str(src / f"ott2-emu-{t}.cpp") for t in tags]
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed to build the CUDA emulation"
    # -ffp-contract=off: the CUDA kernels' __f*_rn arithmetic is never fused
    res = tool_cache.run([cxx, "-std=c++17", *(SANITIZE if sanitize else ["-O2"]), "-ffp-contract=off", "-Wall",
                          "-Werror", "-fPIC", "-shared", "-I", str(src), *srcs, "-o", str(lib)])  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    return lib


def nvcc_flags() -> list[str]:
    """The floating-point flags the CUDA build compiles the ott units with: ggml-cuda's -use_fast_math, then
    CMakeLists.txt's OTT_CUDA_FLAGS (IEEE division, square root and subnormals again), so that what the tests
    compile and run on a GPU is what users run."""
    m = re.search(r"^set\(OTT_CUDA_FLAGS ([^)]*)\)", (ROOT / "CMakeLists.txt").read_text(), re.M)
    assert m, "CMakeLists.txt sets no OTT_CUDA_FLAGS"
    return ["-use_fast_math", *m.group(1).split()]


def sanitizer_env() -> dict[str, str]:
    """The environment of a process that loads a library built with SANITIZE (g++'s runtimes preloaded, the first
    error fatal, leaks not counted: the interpreter's own are not the kernels')."""
    gcc = shutil.which("g++") or "g++"
    rt = [subprocess.run([gcc, f"-print-file-name={n}"], capture_output=True, text=True).stdout.strip()
          for n in ("libasan.so", "libubsan.so")]  # fmt: skip
    assert all(os.path.isabs(p) and os.path.exists(p) for p in rt), f"the sanitizer runtimes are missing: {rt}"
    return {**os.environ, "LD_PRELOAD": " ".join(rt), "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}  # fmt: skip


def build_cuda_testlib(src: Path, tags: list[str], out: Path, arch: str = "native") -> Path:
    lib = out / "libott_cuda_test.so"
    srcs = [str(src / f"ott2-cuda-{t}.cu") for t in tags]
    res = tool_cache.run(["nvcc", "-O3", "-std=c++17", *nvcc_flags(), f"-arch={arch}", "-DOTT_CU_TEST_API",
                          "-shared", "-Xcompiler", "-fPIC", "-I", str(src), *srcs, "-o", str(lib)])  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    return lib


@dataclass
class LayerState:
    """One layer's ott tensors for n_stream streams, H KV heads of dimension D (the cache's layouts); the K/V
    widths, k_mix, v_rotate and v_sym come from cfg."""

    cfg: ref.OttConfig
    outlier_num: int
    D: int
    H: int
    n_head: int
    n_stream: int
    n_ctx: int
    arrays: dict[str, np.ndarray] = field(init=False)
    n_pos: list[int] = field(init=False)
    n_sealed: list[int] = field(init=False)

    def __post_init__(self) -> None:
        c, D, H, ns = self.cfg, self.D, self.H, self.n_stream
        self.T = c.R + c.G
        self.S = self.outlier_num + c.aux_cap
        self.NG = (self.n_ctx + c.G - 1) // c.G
        self.KB = c.k_format.block_bytes
        # one head's sealed K group (gen/generate.py HeadConfig.k_group_bytes): with k_mix the blocks of mixed
        # widths take D nominal blocks, then the table of the D 2-bit widths
        self.KGB = D * self.KB + (D // 4 if c.k_mixed else 0)
        self.VB = c.v_format.block_bytes  # v_sym: a scale and the codes (no min)
        self.arrays = {
            "ring": np.zeros((2 * ns, self.T, H, D), np.uint16),
            "sk": np.zeros((ns, H, self.NG, self.KGB), np.uint8),
            "sv": np.zeros((ns, H, self.NG, c.G * (D // c.Gv) * self.VB), np.uint8),
            "pkv": np.zeros((H * ns, 2, self.S, D), np.uint16),
            "pmeta": np.zeros((ns, H, 2 * self.S + 3), np.int32),
            "flags": np.zeros(ns, np.int32),
        }
        self.arrays["pmeta"][:, :, 2 * self.S + 2] = 1  # tracing on
        self.n_pos = [0] * ns
        self.n_sealed = [0] * ns

    def sealed_after(self, n_pos: int) -> int:
        return (n_pos - self.cfg.R) // self.cfg.G if n_pos >= self.cfg.R else 0

    def _args(self, ffi: cffi.FFI, keep: list[Any], q: np.ndarray, k: np.ndarray, v: np.ndarray,
              plan: np.ndarray, NS: int, n_tok: int) -> Any:  # fmt: skip
        def ptr(t: str, a: np.ndarray) -> Any:
            assert a.flags.c_contiguous
            keep.append(a)
            return ffi.cast(t, ffi.from_buffer(a))

        a = ffi.new("ott_cu_args *")
        a.D, a.H, a.n_head, a.T, a.S, a.NG = self.D, self.H, self.n_head, self.T, self.S, self.NG
        a.NS, a.ns, a.n_tok, a.n_stream = NS, plan.shape[0], n_tok, self.n_stream
        a.outlier_num, a.aux_cap, a.scale = self.outlier_num, self.cfg.aux_cap, 1.0 / math.sqrt(self.D)
        a.v_rotate = int(self.cfg.v_rotate)
        a.q, a.k, a.v = ptr("float *", q), ptr("float *", k), ptr("float *", v)
        A = self.arrays
        a.ring, a.sk, a.sv = ptr("uint16_t *", A["ring"]), ptr("uint8_t *", A["sk"]), ptr("uint8_t *", A["sv"])
        a.pkv, a.pmeta = ptr("uint16_t *", A["pkv"]), ptr("int32_t *", A["pmeta"])
        a.flags = ptr("int32_t *", A["flags"])
        a.plan = ptr("int32_t *", plan)
        return a

    def step(self, lib: OpsLib, tag: str, streams: list[int], q: np.ndarray, k: np.ndarray, v: np.ndarray,
             NS: int, fused: bool = False) -> np.ndarray:  # fmt: skip
        """One ubatch: n_tok tokens for each stream in `streams` (q (ns, n_tok, n_head, D), k and v
        (ns, n_tok, H, D)); returns the attention output (ns, n_tok, n_head, D). fused: the merge and the seal in
        one launch."""
        ns, n_tok = q.shape[0], q.shape[1]
        plan = np.array([[s, self.n_pos[s], self.n_sealed[s], max(self.n_sealed[s], self.sealed_after(
            self.n_pos[s] + n_tok))] for s in streams], np.int32)  # fmt: skip
        q = np.ascontiguousarray(q, np.float32)
        k = np.ascontiguousarray(k, np.float32)
        v = np.ascontiguousarray(v, np.float32)
        gq = self.n_head // self.H
        keep: list[Any] = []
        a = self._args(lib.ffi, keep, q, k, v, plan, NS, n_tok)
        part = np.full((ns * (NS + 1), self.H, gq * n_tok, self.D + 2), np.nan, np.float32)
        out = np.full((ns, n_tok, self.n_head, self.D), np.nan, np.float32)
        a.part = lib.ffi.cast("float *", lib.ffi.from_buffer(part))
        a.out = lib.ffi.cast("float *", lib.ffi.from_buffer(out))
        scratch = np.zeros(ns * self.H * 2 * self.cfg.G * self.D, np.uint16)
        a.scratch = lib.ffi.cast("uint16_t *", lib.ffi.from_buffer(scratch))
        if fused:
            lib.run(tag, "attn_seal", a)
        else:
            lib.run(tag, "attn", a)
            lib.run(tag, "seal", a)
        for row in plan:
            self.n_pos[row[0]] += n_tok
            self.n_sealed[row[0]] = int(row[3])
        return out

    # --- reading the state back, in the reference's terms

    def pools(self, s: int, h: int) -> tuple[ref.Pool, ref.Pool, bool]:
        meta = self.arrays["pmeta"][s, h]
        S, n_out = self.S, self.outlier_num
        n_pool, n_aux, tracing = int(meta[2 * S]), int(meta[2 * S + 1]), bool(meta[2 * S + 2])
        kv = self.arrays["pkv"][h + self.H * s]

        def pool(slots: range) -> ref.Pool:
            idx = np.array(list(slots), np.int64)
            return ref.Pool(
                pos=meta[2 * idx].astype(np.int64),
                k=kv[0, idx].view(np.float16),
                v=kv[1, idx].view(np.float16),
                score=meta[2 * idx + 1].view(np.float32),
            )

        return pool(range(n_pool)), pool(range(n_out, n_out + n_aux)), tracing

    def ring_rows(self, s: int, h: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r = self.arrays["ring"]
        return r[2 * s, pos % self.T, h].view(np.float16), r[2 * s + 1, pos % self.T, h].view(np.float16)
