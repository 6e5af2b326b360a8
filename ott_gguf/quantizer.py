"""The ott quantizer of spec/ott2-algorithm.md in numpy: the oracle for every generated kernel.

Arithmetic (float32 throughout, the same operations in the same order as gen/templates/ott_arith.j2):
    dh = fp16((max - min) / nlev)        mh = fp16(min + 0)                       (clip = 64: the full range)
    dh = fp16(((max - min) * c) / nlev)  mh = fp16(min + (max - min) * o)         (clip < 64: c = clip/64,
                                                                                   o = (1 - c)/2, both exact)
    d, m = float32(dh), float32(mh)      id = 1/d if d != 0 else 0
    code = clip(round_half_even((x - m) * id), 0, nlev)
    x_hat = m + d * code                 (two roundings: a multiply, then an add)
Codes are chosen against the stored fp16 scale and min, so x_hat is what the code aimed at. A group whose
range is 0 (or rounds to a zero fp16 scale) gets scale 0 and codes 0, never NaN.

Clipping (docs/clipping.md): a format may quantize to the central fraction c of its group's range, the values
beyond it taking the end codes. With few levels the rounding error of the many inner values costs more than the
clipping error of the few extreme ones, so the mean squared error falls (a 2-bit block of 64 Gaussian values:
-43% at c = 0.65). Keys use K_CLIP64 by width, values V_ROT_CLIP64 by (width, Gv) on their rotated units only
(the rotation makes a token's values near-Gaussian, where the optimum is known); unrotated values keep the full
range. Constants are sixty-fourths, so c and o are exact in fp32 and a kernel writes them as literals.

Symmetric blocks (sym, the v_sym option for 2-bit rotated values; docs/v-blocks.md): one fp16 scale and no min,
the levels centred on zero. With a = max(-min, max) + 0 of the group (max |x|, exact and order-independent):
    dh = fp16(((a * 2) * c) / nlev)      m = -(nlev/2) * d in fp32 (exact: d is an fp16, nlev/2 = 1.5 for 2 bits)
and codes, reconstruction and dot products as above with that m. Rotated values are centred (their block mean is
one of Gv coefficients), so the min costs 16 bits for little: +1-5% error for 0.25 bits per value less at 2 bits.

Block layout (bytes): fp16 d, fp16 m (absent in symmetric blocks), then the code planes. Codes of `bits` bits are
split into planes of 2+1 (3-bit) or one plane (1-, 2- and 4-bit; 1-bit blocks exist only as the narrowest channels of
k_mix on 2-bit keys); plane p of width w packs 8/w codes per byte, strided:
element j is in byte j % nbytes at bit w * (j // nbytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PLANE_WIDTHS = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,)}
QK8_1 = 32
CLIP_ONE = 64  # clip is in sixty-fourths of the range: 64 is the full range (min-max)
# keys, channel-wise over G tokens, by width: measured on both test models' captured attention (docs/clipping.md;
# 1 bit, k_mix's narrowest channels of 2-bit keys: docs/long-context-keys.md)
K_CLIP64 = {1: 16, 2: 48, 3: 58, 4: 64}
# rotated values, token-wise over Gv channels, by (width, Gv): the clip that minimises the mean squared error of
# Gv Gaussian values (study/clipping.py derives them; docs/clipping.md)
V_ROT_CLIP64 = {
    (2, 32): 47, (3, 32): 58, (4, 32): 63,
    (2, 64): 42, (3, 64): 55, (4, 64): 61,
    (2, 128): 38, (3, 128): 51, (4, 128): 59,
    (2, 256): 35, (3, 256): 48, (4, 256): 57,
}  # fmt: skip
# symmetric rotated values (sym), by (width, Gv): the clip of max(|x|) that minimises the mean squared error of Gv
# Gaussian values (study/clipping.py); 2-bit values only (at 3 bits the min pays for itself: docs/v-blocks.md)
V_SYM_CLIP64 = {(2, 32): 41, (2, 64): 37, (2, 128): 34, (2, 256): 32}


@dataclass(frozen=True)
class Plane:
    width: int
    shift: int
    nbytes: int


@dataclass(frozen=True)
class BlockFormat:
    bits: int
    group: int
    clip: int = CLIP_ONE  # sixty-fourths of the group's range the codes span (see the module docstring)
    sym: bool = False  # one scale, levels centred on zero (the module docstring); the range is [-a, a], a = max|x|

    def __post_init__(self) -> None:
        if self.bits not in PLANE_WIDTHS:
            raise ValueError(f"bits must be one of {sorted(PLANE_WIDTHS)}, got {self.bits}")
        if self.group <= 0 or self.group % QK8_1:
            raise ValueError(f"group must be a positive multiple of {QK8_1}, got {self.group}")
        if not 1 <= self.clip <= CLIP_ONE:
            raise ValueError(f"clip must be in [1, {CLIP_ONE}] sixty-fourths, got {self.clip}")

    @property
    def clip_scale(self) -> float:
        """c: the fraction of the range the codes span (exact in fp32)."""
        return self.clip / CLIP_ONE

    @property
    def clip_offset(self) -> float:
        """o = (1 - c)/2: where the clipped range starts, as a fraction of the range (exact in fp32)."""
        return (CLIP_ONE - self.clip) / (2 * CLIP_ONE)

    @property
    def nlev(self) -> int:
        return (1 << self.bits) - 1

    @property
    def planes(self) -> tuple[Plane, ...]:
        out, shift = [], 0
        for w in PLANE_WIDTHS[self.bits]:
            out.append(Plane(w, shift, self.group * w // 8))
            shift += w
        return tuple(out)

    @property
    def block_bytes(self) -> int:
        return (2 if self.sym else 4) + sum(p.nbytes for p in self.planes)

    def sym_min(self, d: np.ndarray) -> np.ndarray:
        """m of symmetric blocks from their fp16 scales (magnitude: a rotated block flags its sign bit), fp32."""
        return (np.float32(-self.nlev / 2) * np.abs(np.asarray(d).astype(np.float32))).astype(np.float32)


@dataclass
class Quantized:
    """Groups along the last axis: codes (..., group) uint8, d and m (...,) float16."""

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray


def quantize(x: np.ndarray, fmt: BlockFormat) -> Quantized:
    """Quantize float32 values in groups of fmt.group along the last axis (its length must divide)."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % fmt.group:
        raise ValueError(f"last axis ({x.shape[-1]}) is not a multiple of the group ({fmt.group})")
    g = x.reshape(*x.shape[:-1], x.shape[-1] // fmt.group, fmt.group)
    mn = g.min(axis=-1)
    mx = g.max(axis=-1)
    if fmt.sym:
        a = (np.where(-mn > mx, -mn, mx) + np.float32(0.0)).astype(np.float32)  # + 0: never -0 (as the kernels)
        dh = (((a * np.float32(2.0)) * np.float32(fmt.clip_scale)) / np.float32(fmt.nlev)).astype(np.float16)
        mh = fmt.sym_min(dh)  # fp32: not stored
    elif fmt.clip == CLIP_ONE:
        dh = ((mx - mn) / np.float32(fmt.nlev)).astype(np.float16)
        mh = (mn + np.float32(0.0)).astype(np.float16)
    else:
        w = (mx - mn).astype(np.float32)
        dh = ((w * np.float32(fmt.clip_scale)) / np.float32(fmt.nlev)).astype(np.float16)
        mh = (mn + w * np.float32(fmt.clip_offset)).astype(np.float16)
    d = dh.astype(np.float32)
    m = mh.astype(np.float32)
    safe = np.where(d != 0, d, np.float32(1.0))
    inv = np.where(d != 0, np.float32(1.0) / safe, np.float32(0.0)).astype(np.float32)
    v = (g - m[..., None]) * inv[..., None]
    codes = np.clip(np.rint(v), 0, fmt.nlev).astype(np.uint8)
    return Quantized(codes=codes, d=dh, m=mh)  # sym: m is the fp32 min the codes were chosen against


def dequantize(q: Quantized) -> np.ndarray:
    """x_hat = m + d * code in float32, flattened back to the input's last axis."""
    d = q.d.astype(np.float32)[..., None]
    m = q.m.astype(np.float32)[..., None]
    prod = (d * q.codes.astype(np.float32)).astype(np.float32)
    out = (m + prod).astype(np.float32)
    return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])


def pack(q: Quantized, fmt: BlockFormat) -> np.ndarray:
    """Blocks as bytes, shape (n_blocks, block_bytes), in the generated C layout."""
    codes = q.codes.reshape(-1, fmt.group)
    nb = codes.shape[0]
    parts = [q.d.reshape(nb, 1).view(np.uint8)]
    if not fmt.sym:
        parts.append(q.m.reshape(nb, 1).view(np.uint8))
    for p in fmt.planes:
        per = 8 // p.width
        vals = ((codes >> p.shift) & ((1 << p.width) - 1)).reshape(nb, per, p.nbytes).astype(np.uint16)
        byte = np.zeros((nb, p.nbytes), dtype=np.uint16)
        for k in range(per):
            byte |= vals[:, k, :] << (p.width * k)
        parts.append(byte.astype(np.uint8))
    return np.concatenate([a.reshape(nb, -1) for a in parts], axis=1)


def unpack(blocks: np.ndarray, fmt: BlockFormat) -> Quantized:
    """Inverse of pack: (n_blocks, block_bytes) uint8 -> Quantized with (n_blocks, group) codes."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, fmt.block_bytes)
    nb = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).reshape(nb)
    m = fmt.sym_min(d) if fmt.sym else blocks[:, 2:4].copy().view(np.float16).reshape(nb)
    codes = np.zeros((nb, fmt.group), dtype=np.uint8)
    off = 2 if fmt.sym else 4
    for p in fmt.planes:
        raw = blocks[:, off : off + p.nbytes]
        per = 8 // p.width
        for k in range(per):
            vals = (raw >> (p.width * k)) & ((1 << p.width) - 1)
            codes[:, k * p.nbytes : (k + 1) * p.nbytes] |= (vals << p.shift).astype(np.uint8)
        off += p.nbytes
    return Quantized(codes=codes, d=d, m=m)


def quantize_q8_1(y: np.ndarray) -> np.ndarray:
    """Blocks in ggml's q8_1 layout (fp16 d, fp16 s = d*sum(qs), 32 int8), shape (n/32, 36). Ties round to even
    here (ggml rounds them away from zero); the dot kernels take whatever blocks they are given."""
    y = np.asarray(y, dtype=np.float32).reshape(-1, QK8_1)
    amax = np.abs(y).max(axis=1)
    d = amax / np.float32(127.0)
    inv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, 1), 0).astype(np.float32)
    qs = np.clip(np.round(y * inv[:, None]), -127, 127).astype(np.int8)
    s = (qs.astype(np.int32).sum(axis=1).astype(np.float32) * d).astype(np.float16)
    out = np.zeros((y.shape[0], 4 + QK8_1), dtype=np.uint8)
    out[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = s.reshape(-1, 1).view(np.uint8)
    out[:, 4:] = qs.view(np.uint8)
    return out


def vec_dot_q8_1(blocks: np.ndarray, q8: np.ndarray, fmt: BlockFormat) -> tuple[float, float]:
    """Exact (float64) value of what the kernels compute for a dot with q8_1 blocks, and the sum of the
    magnitudes of its terms (the scale for an fp32 tolerance): per q8_1 block, d*dy*sum(c*q) + m*s."""
    q = unpack(blocks, fmt)
    q8 = np.ascontiguousarray(q8, dtype=np.uint8).reshape(-1, 4 + QK8_1)
    dy = q8[:, 0:2].copy().view(np.float16).astype(np.float64).reshape(-1)
    sy = q8[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(-1)
    qs = q8[:, 4:].copy().view(np.int8).astype(np.int64)
    sub = fmt.group // QK8_1
    codes = q.codes.reshape(-1, QK8_1).astype(np.int64)
    isum = (codes * qs).sum(axis=1).astype(np.float64)
    d = np.repeat(q.d.astype(np.float64), sub)
    m = np.repeat(q.m.astype(np.float64), sub)
    terms = np.concatenate([d * dy * isum, m * sy])
    return float(terms.sum()), float(np.abs(terms).sum())
