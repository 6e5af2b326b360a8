"""cffi bindings of the tests: the generated ott kernels and ggml's quantizers.

* `Kernels`: the test-only kernel library (libott_kernels, built by native_build.py, never installed), every
  (bits, group) config for every ISA of this architecture, so tests can check each ISA against the numpy
  quantizer;
* `ggml_quantize_rows`: a stock ggml type through the installed libggml-base (ggml_quantize_chunk and the
  type's to_float).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

import numpy as np
from cffi import FFI
from native_build import built_lib

from ott_gguf._lib import lib_path

_ffi = FFI()
_ffi.cdef(
    """
    typedef struct {
        int bits;
        int group;
        int clip;
        int sym;
        const char * isa;
        size_t block_bytes;
        void (*quantize)(const float * x, void * y, int64_t k);
        void (*dequantize)(const void * x, float * y, int64_t k);
        void (*vec_dot_q8_1)(int n, float * s, size_t bs, const void * x, size_t bx,
                             const void * y, size_t by, int nrc);
    } ott_kernel;
    const ott_kernel * ott_kernels(int * n);

    typedef struct { int32_t pos; float score; } ott_slot_meta;
    typedef int (*ott_seal_fn)(int D, uint16_t * gk, uint16_t * gv, int32_t pos0, int outlier_num, int aux_cap,
            ott_slot_meta * pool_meta, uint16_t * pool_k, uint16_t * pool_v, int * n_pool,
            ott_slot_meta * aux_meta, uint16_t * aux_k, uint16_t * aux_v, int * n_aux, int * tracing,
            int vrot, void * kq, void * vq);
    typedef void (*ott_attn_fn)(int D, const float * q, int32_t q_pos, float scale,
            int n_sealed, const void * kq, const void * vq,
            int n_pooled, const int32_t * pooled_pos, const uint16_t * pooled_k, const uint16_t * pooled_v,
            int n_tail, int32_t tail_pos0, const uint16_t * tail_k, const uint16_t * tail_v, int tail_stride,
            int vrot, float * out);
    typedef void (*ott_attn_group_fn)(int D, int n_rows, const float * q, float scale, const void * kq,
            const void * vq, int n_cover, const int32_t * cover_j, const uint16_t * cover_k, const uint16_t * cover_v,
            int vrot, float * M, float * L, float * acc, void * scratch);
    typedef void (*ott_attn_tail_fn)(int D, int n_rows, const float * q, const int32_t * q_pos, float scale,
            int n_t, int32_t pos0, const uint16_t * tk, const uint16_t * tv, int stride,
            float * M, float * L, float * acc, void * scratch);
    typedef struct {
        int kbits;
        int vbits;
        int G;
        int Gv;
        int kmix;
        int vsym;
        const char * isa;
        size_t k_block_bytes;
        size_t v_block_bytes;
        ott_seal_fn seal;
        ott_attn_fn attn;
        ott_attn_group_fn attn_group;
        ott_attn_tail_fn attn_tail;
        void (*unrotate)(int D, float * x);
        int (*vint)(void);
    } ott_head_kernel;
    const ott_head_kernel * ott_head_kernels(int * n);
    int ott_cpu_supports(const char * isa);

    typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
    typedef void (*ggml_from_float_t)(const float * x, void * y, int64_t k);
    struct ggml_type_traits {
        const char * type_name;
        int64_t blck_size;
        int64_t blck_size_interleave;
        size_t type_size;
        bool is_quantized;
        ggml_to_float_t to_float;
        ggml_from_float_t from_float_ref;
    };
    const struct ggml_type_traits * ggml_get_type_traits(int type);
    size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start, int64_t nrows,
                               int64_t n_per_row, const float * imatrix);
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
    clip: int = 64
    sym: bool = False  # one scale, no min (quantizer.BlockFormat.sym)

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


@dataclass
class PoolArrays:
    """An outlier or aux pool as the native seal kernel keeps it (sorted by position)."""

    pos: np.ndarray  # (n,) int32
    score: np.ndarray  # (n,) float32
    k: np.ndarray  # (n, D) float16
    v: np.ndarray  # (n, D) float16


@dataclass
class SealResult:
    kq: np.ndarray  # (k_group_bytes(D),) uint8: channel c's block over the group's G tokens (k_mix: + width table)
    vq: np.ndarray  # (G * D/Gv, v_block_bytes) uint8
    pool: PoolArrays
    aux: PoolArrays
    tracing: bool
    n_won: int


def _u16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float16)).view(np.uint16)


@dataclass(frozen=True)
class HeadKernelSet:
    """The per-head seal and attention kernels of the ott caches for one (K bits, V bits, G, Gv) and ISA; vrot:
    V stored rotated (docs/design-ott2-cache.md, "Rotated values")."""

    kbits: int
    vbits: int
    G: int
    Gv: int
    isa: str
    k_block_bytes: int
    v_block_bytes: int
    _k: object
    vrot: bool = False
    kmix: bool = False
    vsym: bool = False  # symmetric V blocks (v_sym)
    vint: int = 0  # bits of the integer V weights, 0: fp32 (reference.attend int_values)

    def k_group_bytes(self, D: int) -> int:
        """Bytes of one sealed K group of the head (k_mix: the D channel blocks plus their 2-bit width table)."""
        return D * self.k_block_bytes + (D // 4 if self.kmix else 0)

    def with_vrot(self, vrot: bool) -> HeadKernelSet:
        return dataclasses.replace(self, vrot=vrot)

    def seal(
        self,
        gk: np.ndarray,
        gv: np.ndarray,
        pos0: int,
        outlier_num: int,
        aux_cap: int,
        pool: PoolArrays,
        aux: PoolArrays,
        tracing: bool,
    ) -> SealResult:
        """Seal one group (gk, gv: (G, D) fp16 as cached) given the head's pools; inputs are not modified."""
        G, D = np.shape(gk)
        if G != self.G or D % self.Gv:
            raise ValueError(f"group must be ({self.G}, multiple of {self.Gv}), got {(G, D)}")
        gk16 = _u16(gk).copy()
        gv16 = _u16(gv).copy()

        def slots(p: PoolArrays, cap: int) -> tuple[object, np.ndarray, np.ndarray, object]:
            meta = _ffi.new("ott_slot_meta[]", max(cap, 1))
            for i in range(len(p.pos)):
                meta[i].pos = int(p.pos[i])
                meta[i].score = float(p.score[i])
            k = np.zeros((max(cap, 1), D), np.uint16)
            v = np.zeros((max(cap, 1), D), np.uint16)
            k[: len(p.pos)] = _u16(p.k)
            v[: len(p.pos)] = _u16(p.v)
            n = _ffi.new("int *", len(p.pos))
            return meta, k, v, n

        pm, pk, pv, pn = slots(pool, outlier_num)
        am, ak, av, an = slots(aux, aux_cap)
        tr = _ffi.new("int *", int(tracing))
        kq = np.zeros(self.k_group_bytes(D), np.uint8)
        vq = np.zeros((G * D // self.Gv, self.v_block_bytes), np.uint8)
        u16 = "uint16_t *"
        n_won = self._k.seal(
            D, _ffi.cast(u16, _ffi.from_buffer(gk16)), _ffi.cast(u16, _ffi.from_buffer(gv16)), pos0, outlier_num,
            aux_cap, pm, _ffi.cast(u16, _ffi.from_buffer(pk)), _ffi.cast(u16, _ffi.from_buffer(pv)), pn,
            am, _ffi.cast(u16, _ffi.from_buffer(ak)), _ffi.cast(u16, _ffi.from_buffer(av)), an, tr,
            int(self.vrot), _ffi.from_buffer(kq), _ffi.from_buffer(vq),
        )  # fmt: skip

        def back(meta: object, k: np.ndarray, v: np.ndarray, n: object) -> PoolArrays:
            m = int(n[0])  # type: ignore[index]
            return PoolArrays(
                pos=np.array([meta[i].pos for i in range(m)], np.int32),  # type: ignore[index]
                score=np.array([meta[i].score for i in range(m)], np.float32),  # type: ignore[index]
                k=k[:m].view(np.float16).copy(),
                v=v[:m].view(np.float16).copy(),
            )

        return SealResult(kq, vq, back(pm, pk, pv, pn), back(am, ak, av, an), bool(tr[0]), int(n_won))

    def attn(
        self,
        q: np.ndarray,
        q_pos: int,
        scale: float,
        kq: np.ndarray,
        vq: np.ndarray,
        n_sealed: int,
        pooled_pos: np.ndarray,
        pooled_k: np.ndarray,
        pooled_v: np.ndarray,
        tail_pos0: int,
        tail_k: np.ndarray,
        tail_v: np.ndarray,
    ) -> np.ndarray:
        """One query row (D,) over one head's state; kq/vq hold n_sealed groups back to back."""
        q = _f32(q).reshape(-1)
        D = q.size
        out = np.zeros(D, np.float32)
        kq = np.ascontiguousarray(kq, np.uint8)
        vq = np.ascontiguousarray(vq, np.uint8)
        ppos = np.ascontiguousarray(pooled_pos, np.int32)
        pk, pv = _u16(pooled_k).reshape(-1, D), _u16(pooled_v).reshape(-1, D)
        tk, tv = _u16(tail_k).reshape(-1, D), _u16(tail_v).reshape(-1, D)
        u16 = "uint16_t *"
        self._k.attn(
            D, _ptr(q, "float *"), q_pos, scale, n_sealed, _ffi.from_buffer(kq), _ffi.from_buffer(vq),
            len(ppos), _ffi.cast("int32_t *", _ffi.from_buffer(ppos)), _ffi.cast(u16, _ffi.from_buffer(pk)),
            _ffi.cast(u16, _ffi.from_buffer(pv)), tk.shape[0], tail_pos0, _ffi.cast(u16, _ffi.from_buffer(tk)),
            _ffi.cast(u16, _ffi.from_buffer(tv)), D, int(self.vrot), _ffi.cast("float *", _ffi.from_buffer(out)),
        )  # fmt: skip
        return out

    def attn_rows(
        self,
        q: np.ndarray,
        q_pos: np.ndarray,
        scale: float,
        kq: np.ndarray,
        vq: np.ndarray,
        n_sealed: int,
        pooled_pos: np.ndarray,
        pooled_k: np.ndarray,
        pooled_v: np.ndarray,
        tail_pos0: int,
        tail_k: np.ndarray,
        tail_v: np.ndarray,
    ) -> np.ndarray:
        """Query rows (n, D) at positions q_pos over one head's state with the multi-row kernels the cache's
        attention op uses (int8 query on the codes, one online-softmax state per row), driven group by group
        and then tail tile by tail tile as the op drives them (rotated V: turned back between the two)."""
        q = np.ascontiguousarray(q, np.float32)
        n_rows, D = q.shape
        qp = np.ascontiguousarray(q_pos, np.int32)
        M = np.full(n_rows, -np.inf, np.float32)
        L = np.zeros(n_rows, np.float32)
        acc = np.zeros((n_rows, D), np.float32)
        scratch = np.zeros(2 * self.G * D, np.float32)
        kq = np.ascontiguousarray(kq, np.uint8).reshape(-1)
        vq = np.ascontiguousarray(vq, np.uint8).reshape(-1)
        kbytes, vbytes = self.k_group_bytes(D), self.G * (D // self.Gv) * self.v_block_bytes
        ppos = np.asarray(pooled_pos, np.int32)
        pk, pv = _u16(pooled_k).reshape(-1, D), _u16(pooled_v).reshape(-1, D)
        u16, f32 = "uint16_t *", "float *"
        state = (_ptr(M, f32), _ptr(L, f32), _ptr(acc, f32), _ffi.from_buffer(scratch))
        for g in range(n_sealed):
            sel = np.flatnonzero((ppos >= g * self.G) & (ppos < (g + 1) * self.G))
            cj = np.ascontiguousarray(ppos[sel] - g * self.G, np.int32)
            ck, cv = np.ascontiguousarray(pk[sel]), np.ascontiguousarray(pv[sel])
            self._k.attn_group(
                D, n_rows, _ptr(q, f32), scale, _ffi.from_buffer(kq[g * kbytes : (g + 1) * kbytes]),
                _ffi.from_buffer(vq[g * vbytes : (g + 1) * vbytes]), len(sel),
                _ffi.cast("int32_t *", _ffi.from_buffer(cj)), _ffi.cast(u16, _ffi.from_buffer(ck)),
                _ffi.cast(u16, _ffi.from_buffer(cv)), int(self.vrot), *state,
            )  # fmt: skip
        if self.vrot:  # the sealed groups' states are in the rotated basis: turned back once per row (the merge)
            for r in range(n_rows):
                self._k.unrotate(D, _ffi.cast(f32, _ffi.from_buffer(acc[r])))
        tk, tv = _u16(tail_k).reshape(-1, D), _u16(tail_v).reshape(-1, D)
        for t0 in range(0, tk.shape[0], self.G):
            k_t, v_t = np.ascontiguousarray(tk[t0 : t0 + self.G]), np.ascontiguousarray(tv[t0 : t0 + self.G])
            self._k.attn_tail(
                D, n_rows, _ptr(q, f32), _ffi.cast("int32_t *", _ffi.from_buffer(qp)), scale, k_t.shape[0],
                tail_pos0 + t0, _ffi.cast(u16, _ffi.from_buffer(k_t)), _ffi.cast(u16, _ffi.from_buffer(v_t)), D,
                *state,
            )  # fmt: skip
        return acc / L[:, None]


class Kernels:
    """The stand-alone generated kernel library."""

    def __init__(self) -> None:
        self._lib = _ffi.dlopen(str(built_lib("ott_kernels")))
        n = _ffi.new("int *")
        table = self._lib.ott_kernels(n)
        self._sets = [
            KernelSet(t.bits, t.group, _ffi.string(t.isa).decode(), int(t.block_bytes), t, t.clip, bool(t.sym))
            for t in (table[i] for i in range(n[0]))
        ]
        heads = self._lib.ott_head_kernels(n)
        self._heads = [
            HeadKernelSet(
                t.kbits,
                t.vbits,
                t.G,
                t.Gv,
                _ffi.string(t.isa).decode(),
                int(t.k_block_bytes),
                int(t.v_block_bytes),
                t,
                kmix=bool(t.kmix),
                vsym=bool(t.vsym),
                vint=int(t.vint()),
            )
            for t in (heads[i] for i in range(n[0]))
        ]

    @property
    def isas(self) -> list[str]:
        return sorted({k.isa for k in self._sets})

    @property
    def configs(self) -> list[tuple[int, int]]:
        """(bits, group) of every full-range asymmetric config."""
        return sorted({(k.bits, k.group) for k in self._sets if k.clip == 64 and not k.sym})

    @property
    def clipped_configs(self) -> list[tuple[int, int, int]]:
        """(bits, group, clip) of every clipped asymmetric config (the head configs' keys and rotated values)."""
        return sorted({(k.bits, k.group, k.clip) for k in self._sets if k.clip != 64 and not k.sym})

    @property
    def sym_configs(self) -> list[tuple[int, int, int]]:
        """(bits, group, clip) of every symmetric config (the v_sym heads' values)."""
        return sorted({(k.bits, k.group, k.clip) for k in self._sets if k.sym})

    @property
    def head_configs(self) -> list[tuple[int, int, int, int, bool, bool]]:
        """(K bits, V bits, G, Gv, k_mix, v_sym) of every generated head config."""
        return sorted({(h.kbits, h.vbits, h.G, h.Gv, h.kmix, h.vsym) for h in self._heads})

    def head(self, kbits: int, vbits: int, G: int, Gv: int, isa: str, vrot: bool = False,
             kmix: bool = False, vsym: bool = False) -> HeadKernelSet:  # fmt: skip
        for h in self._heads:
            if (h.kbits, h.vbits, h.G, h.Gv, h.kmix, h.vsym, h.isa) == (kbits, vbits, G, Gv, kmix, vsym, isa):
                return h.with_vrot(vrot)
        raise KeyError(f"no head kernels for K {kbits} bits{' mixed' if kmix else ''}, V {vbits} bits"
                       f"{' symmetric' if vsym else ''}, G={G}, Gv={Gv}, isa={isa}")  # fmt: skip

    def cpu_supports(self, isa: str) -> bool:
        return bool(self._lib.ott_cpu_supports(isa.encode()))

    def get(self, bits: int, group: int, isa: str, clip: int = 64, sym: bool = False) -> KernelSet:
        for k in self._sets:
            if (k.bits, k.group, k.clip, k.sym, k.isa) == (bits, group, clip, sym, isa):
                return k
        raise KeyError(f"no kernels for bits={bits}, group={group}, clip={clip}, sym={sym}, isa={isa}")


def ggml_quantize_rows(type_id: int, x: np.ndarray, n_per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """Any ggml type through the patched ggml: (blocks from ggml_quantize_chunk as bytes, their to_float)."""
    base = _ggml_base()
    traits = base.ggml_get_type_traits(type_id)
    x = _f32(x).reshape(-1, n_per_row)
    nbytes = x.size // int(traits.blck_size) * int(traits.type_size)
    out = np.zeros(nbytes, dtype=np.uint8)
    written = base.ggml_quantize_chunk(type_id, _ptr(x, "float *"), _ffi.from_buffer(out), 0, x.shape[0], n_per_row,
                                       _ffi.NULL)  # fmt: skip
    if written != nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {nbytes}")
    back = np.zeros(x.size, dtype=np.float32)
    traits.to_float(_ffi.from_buffer(out), _ffi.cast("float *", _ffi.from_buffer(back)), x.size)
    return out.reshape(-1, int(traits.type_size)), back


@cache
def kernels() -> Kernels:
    return Kernels()


@cache
def _ggml_base() -> object:
    return _ffi.dlopen(str(lib_path("ggml-base")))
