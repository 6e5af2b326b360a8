"""cffi bindings for what llama-cpp-python does not bind: the generated ott kernels.

Two views of the same generated code:
  * `Kernels`: the stand-alone kernel library (libott_kernels), every (bits, group) config for every ISA
    of this architecture, so tests can check each ISA against the numpy quantizer;
  * `GgmlOtt2`: the ott2 ggml type inside the patched libggml-base/libggml-cpu, reached through ggml's
    own type-traits tables and ggml_quantize_chunk, i.e. the code llama.cpp actually runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from cffi import FFI

from ._lib import GGML_TYPE_OTT2, lib_path

_ffi = FFI()
_ffi.cdef(
    """
    typedef struct {
        int bits;
        int group;
        const char * isa;
        size_t block_bytes;
        void (*quantize)(const float * x, void * y, int64_t k);
        void (*dequantize)(const void * x, float * y, int64_t k);
        void (*vec_dot_q8_1)(int n, float * s, size_t bs, const void * x, size_t bx,
                             const void * y, size_t by, int nrc);
    } ott_kernel;
    const ott_kernel * ott_kernels(int * n);
    int ott_cpu_supports(const char * isa);

    typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
    typedef void (*ggml_from_float_t)(const float * x, void * y, int64_t k);
    typedef void (*ggml_vec_dot_t)(int n, float * s, size_t bs, const void * x, size_t bx,
                                   const void * y, size_t by, int nrc);
    struct ggml_type_traits {
        const char * type_name;
        int64_t blck_size;
        int64_t blck_size_interleave;
        size_t type_size;
        bool is_quantized;
        ggml_to_float_t to_float;
        ggml_from_float_t from_float_ref;
    };
    struct ggml_type_traits_cpu {
        ggml_from_float_t from_float;
        ggml_vec_dot_t vec_dot;
        int vec_dot_type;
        int64_t nrows;
    };
    const struct ggml_type_traits * ggml_get_type_traits(int type);
    const struct ggml_type_traits_cpu * ggml_get_type_traits_cpu(int type);
    size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start, int64_t nrows,
                               int64_t n_per_row, const float * imatrix);
    void ggml_cpu_init(void);
    """
)


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _ptr(a: np.ndarray, ctype: str) -> object:
    return _ffi.cast(ctype, _ffi.from_buffer(a, require_writable=False))


@dataclass(frozen=True)
class KernelSet:
    """One config's quantize/dequantize/vec_dot for one ISA."""

    bits: int
    group: int
    isa: str
    block_bytes: int
    _k: object

    def quantize(self, x: np.ndarray) -> np.ndarray:
        x = _f32(x).reshape(-1)
        if x.size % self.group:
            raise ValueError(f"length {x.size} is not a multiple of the group {self.group}")
        out = np.zeros((x.size // self.group, self.block_bytes), dtype=np.uint8)
        self._k.quantize(_ptr(x, "float *"), _ffi.from_buffer(out), x.size)
        return out

    def dequantize(self, blocks: np.ndarray) -> np.ndarray:
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, self.block_bytes)
        out = np.zeros(blocks.shape[0] * self.group, dtype=np.float32)
        self._k.dequantize(_ffi.from_buffer(blocks), _ffi.cast("float *", _ffi.from_buffer(out)), out.size)
        return out

    def vec_dot_q8_1(self, blocks: np.ndarray, q8: np.ndarray) -> float:
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, self.block_bytes)
        q8 = np.ascontiguousarray(q8, dtype=np.uint8)
        n = blocks.shape[0] * self.group
        if q8.size != n // 32 * 36:
            raise ValueError("q8_1 operand does not match the length of the ott operand")
        s = _ffi.new("float *")
        self._k.vec_dot_q8_1(n, s, 0, _ffi.from_buffer(blocks), 0, _ffi.from_buffer(q8), 0, 1)
        return float(s[0])


class Kernels:
    """The stand-alone generated kernel library."""

    def __init__(self) -> None:
        self._lib = _ffi.dlopen(str(lib_path("ott_kernels")))
        n = _ffi.new("int *")
        table = self._lib.ott_kernels(n)
        self._sets = [
            KernelSet(t.bits, t.group, _ffi.string(t.isa).decode(), int(t.block_bytes), t)
            for t in (table[i] for i in range(n[0]))
        ]

    @property
    def isas(self) -> list[str]:
        return sorted({k.isa for k in self._sets})

    @property
    def configs(self) -> list[tuple[int, int]]:
        return sorted({(k.bits, k.group) for k in self._sets})

    def cpu_supports(self, isa: str) -> bool:
        return bool(self._lib.ott_cpu_supports(isa.encode()))

    def get(self, bits: int, group: int, isa: str) -> KernelSet:
        for k in self._sets:
            if (k.bits, k.group, k.isa) == (bits, group, isa):
                return k
        raise KeyError(f"no kernels for bits={bits}, group={group}, isa={isa}")


class GgmlOtt2:
    """The ott2 ggml type as the patched ggml runs it."""

    def __init__(self) -> None:
        self._base = _ffi.dlopen(str(lib_path("ggml-base")))
        self._cpu = _ffi.dlopen(str(lib_path("ggml-cpu")))
        self._cpu.ggml_cpu_init()
        self.traits = self._base.ggml_get_type_traits(GGML_TYPE_OTT2)
        self.traits_cpu = self._cpu.ggml_get_type_traits_cpu(GGML_TYPE_OTT2)
        self.name = _ffi.string(self.traits.type_name).decode()
        self.group = int(self.traits.blck_size)
        self.block_bytes = int(self.traits.type_size)
        self.vec_dot_type = int(self.traits_cpu.vec_dot_type)

    def _blocks_for(self, n: int) -> np.ndarray:
        if n % self.group:
            raise ValueError(f"length {n} is not a multiple of the block size {self.group}")
        return np.zeros((n // self.group, self.block_bytes), dtype=np.uint8)

    def quantize_ref(self, x: np.ndarray) -> np.ndarray:
        """type_traits[OTT2].from_float_ref (ggml-base)."""
        x = _f32(x).reshape(-1)
        out = self._blocks_for(x.size)
        self.traits.from_float_ref(_ptr(x, "float *"), _ffi.from_buffer(out), x.size)
        return out

    def quantize_cpu(self, x: np.ndarray) -> np.ndarray:
        """type_traits_cpu[OTT2].from_float (ggml-cpu, this machine's ISA): what set_rows runs."""
        x = _f32(x).reshape(-1)
        out = self._blocks_for(x.size)
        self.traits_cpu.from_float(_ptr(x, "float *"), _ffi.from_buffer(out), x.size)
        return out

    def quantize_chunk(self, x: np.ndarray, n_per_row: int) -> np.ndarray:
        """ggml_quantize_chunk(GGML_TYPE_OTT2, ...) over rows of n_per_row values."""
        x = _f32(x).reshape(-1, n_per_row)
        out = self._blocks_for(x.size)
        written = self._base.ggml_quantize_chunk(
            GGML_TYPE_OTT2, _ptr(x, "float *"), _ffi.from_buffer(out), 0, x.shape[0], n_per_row, _ffi.NULL
        )
        if written != out.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
        return out

    def dequantize(self, blocks: np.ndarray) -> np.ndarray:
        """type_traits[OTT2].to_float (ggml-base): what flash attention reads V through."""
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, self.block_bytes)
        out = np.zeros(blocks.shape[0] * self.group, dtype=np.float32)
        self.traits.to_float(_ffi.from_buffer(blocks), _ffi.cast("float *", _ffi.from_buffer(out)), out.size)
        return out

    def vec_dot(self, blocks: np.ndarray, q8: np.ndarray) -> float:
        """type_traits_cpu[OTT2].vec_dot with its vec_dot_type (q8_1) operand."""
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, self.block_bytes)
        q8 = np.ascontiguousarray(q8, dtype=np.uint8)
        s = _ffi.new("float *")
        n = blocks.shape[0] * self.group
        self.traits_cpu.vec_dot(n, s, 0, _ffi.from_buffer(blocks), 0, _ffi.from_buffer(q8), 0, 1)
        return float(s[0])


@cache
def kernels() -> Kernels:
    return Kernels()


@cache
def ggml_ott2() -> GgmlOtt2:
    return GgmlOtt2()
