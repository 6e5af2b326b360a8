"""The ott2 KV cache of spec/ott2-algorithm.md in numpy: the oracle the native C/CUDA cache is compared against.

Readable first: this module is the specification in code. Everything is per (sequence, layer, KV head) unless
said otherwise, and mirrors llama.cpp: K/V arrive ubatch by ubatch, are rounded to fp16 (the cache is fp16, like
llama.cpp's f16 cache), the ubatch attends with its own tokens in full precision, then every group that became
eligible is sealed, in order.

Exact definitions where the spec leaves the arithmetic open (the native code must use the same to match
field by field):
- Score: S = sum_c |K_c| over the fp16 key, computed exactly (fp64 is exact for fp16 inputs and D < 8192) and
  rounded once to fp32. The result does not depend on the summation order, so a tree reduction on a GPU and a
  sequential loop on a CPU agree when they also sum exactly (fp64, or integers in units of 2^-24).
- Winners: a stable sort on (score, position); ties go to the earlier position.
- Placeholder value: the per-channel mean of the group's non-outlier tokens (or of all its tokens with
  mean="all"), the exact mean rounded once to fp16, written over the winners' K and V in the fp16 group before
  it is quantized (the group lives in the fp16 tail).
- Quantization: ott_gguf.quantizer, keys channel-wise (one group of G tokens per channel), values token-wise
  (groups of Gv channels).

Semantics chosen where the spec is silent (documented again on the methods):
- Batches (batch invariance): a query at position p sees exactly S(p) = max(0, floor((p - R) / G)) sealed groups,
  the number sealed when p is processed alone, and every other token in fp16. The cache splits a batch of a
  sequence into ubatches that never cross a position R + kG (ubatch_splits; OttCache.process_batch), so a
  ubatch's own tokens, which it sees in fp16, are exactly those the rule serves in fp16: the outputs, and the
  state, do not depend on how a prompt was split into batches or ubatches, token by token included.
- seq_rm(seq, p0) removes positions >= p0 only where the result is what a fresh run over [0, p0) holds: when no
  sealed group would have to be cut or dropped, S(p0) >= groups sealed (can_cut; p0 <= 0, which clears the
  sequence completely with tracing back on, and p0 past the end always can). Any other cut would serve in 2-bit
  tokens that a fresh run holds in fp16: it is refused (False, nothing changes) and the caller processes the
  kept prefix again from position 0 (llama-server and ott_gguf.Llama do).
- Layers with outlier_num = 0 never touch their pools or tracing flag (which stays on).
- Pools are kept sorted by position: a canonical order, so native slot arrays compare after sorting by position.
- Under the identity quantizer a sealed group stores zero codes, scales and mins, and k_hat/v_hat are its fp16
  values (placeholders included, which are never served).
- Rotation (the k_rotate/v_rotate variants): hadamard_rotate; keys fall back to unrotated per group and side
  (quantize_keys), values per token and unit of max(Gv, ROT_BLOCK) channels, flagged in the sign bit of the fp16 V
  scale (quantize_values, dequantize_values).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from .kv_types import ROT_BLOCK, OttConfig
from .quantizer import CLIP_ONE, K_CLIP64, BlockFormat, Quantized, dequantize, quantize

# ----------------------------------------------------------------------------------------------------- state


@dataclass
class Pool:
    """Outlier or aux pool: exact fp16 K and V, position and fp32 score per token, kept sorted by position."""

    pos: np.ndarray  # (n,) int64, ascending
    k: np.ndarray  # (n, D) float16
    v: np.ndarray  # (n, D) float16
    score: np.ndarray  # (n,) float32

    @staticmethod
    def empty(head_dim: int) -> Pool:
        return Pool(
            pos=np.zeros(0, np.int64),
            k=np.zeros((0, head_dim), np.float16),
            v=np.zeros((0, head_dim), np.float16),
            score=np.zeros(0, np.float32),
        )

    def __len__(self) -> int:
        return len(self.pos)

    def take(self, idx: np.ndarray) -> Pool:
        """The entries at idx (indices or a boolean mask), re-sorted by position."""
        pos = self.pos[idx]
        order = np.argsort(pos, kind="stable")
        return Pool(pos=pos[order], k=self.k[idx][order], v=self.v[idx][order], score=self.score[idx][order])

    def merged(self, other: Pool) -> Pool:
        both = Pool(
            pos=np.concatenate([self.pos, other.pos]),
            k=np.concatenate([self.k, other.k]),
            v=np.concatenate([self.v, other.v]),
            score=np.concatenate([self.score, other.score]),
        )
        return both.take(np.arange(len(both)))


@dataclass
class YoungKeys:
    """A sealed group's keys held a second time at the next wider format (keys by age, config.k_young)."""

    k_codes: np.ndarray  # (D, G) uint8
    k_scale: np.ndarray  # (D,) float16
    k_min: np.ndarray  # (D,) float16
    k_hat: np.ndarray  # (G, D) float32
    k_widths: np.ndarray | None = None


@dataclass
class YoungValues:
    """A sealed group's values held a second time at the next wider format (values by age, config.v_young)."""

    v_codes: np.ndarray  # (G, D) uint8
    v_scale: np.ndarray  # (G, D // Gv) float16 (sign bit: rotated)
    v_min: np.ndarray  # (G, D // Gv) float16
    v_hat: np.ndarray  # (G, D) float32


@dataclass
class SealedGroup:
    """Group `index`, positions [index*G, (index+1)*G), as stored after sealing."""

    index: int
    k_codes: np.ndarray  # (D, G) uint8: channel c, token t
    k_scale: np.ndarray  # (D,) float16, per channel
    k_min: np.ndarray  # (D,) float16
    v_codes: np.ndarray  # (G, D) uint8: token t, channel c
    v_scale: np.ndarray  # (G, D // Gv) float16, per (token, Gv channels); sign bit: rotated (see v_rotated)
    v_min: np.ndarray  # (G, D // Gv) float16
    placeholders: np.ndarray  # (n,) int64: positions that won at sealing (served from the pools forever)
    k_hat: np.ndarray  # (G, D) float32: what the codes decode to (derived; the input itself if identity)
    v_hat: np.ndarray  # (G, D) float32
    # whether the key codes are of the rotated keys (config.k_rotate, unless the rotated group would not fit the
    # fp16 scale and min: see quantize_keys)
    k_rotated: bool = False
    # (D,) uint8 code width of each key channel (config.k_mixed: key_widths), None: every channel at config.kbits
    k_widths: np.ndarray | None = None
    # keys by age (config.k_young): the same keys at 3 bits while the group is among the newest k_young sealed
    # groups (None once it is older, or without k_young); attention reads them in place of k_codes
    young: YoungKeys | None = None
    # values by age (config.v_young): the same for the values, at 3 bits
    young_v: YoungValues | None = None

    @property
    def v_rotated(self) -> np.ndarray:
        """(G, D // Gv) bool: whether each V block's codes are of rotated values, i.e. the sign bit of its stored
        scale (see quantize_values)."""
        return np.signbit(self.v_scale)


@dataclass
class HeadState:
    """The complete cache state of one (sequence, layer, KV head)."""

    G: int
    head_dim: int
    groups: list[SealedGroup]
    tail_pos: np.ndarray  # (n,) int64, consecutive, starting at len(groups) * G
    tail_k: np.ndarray  # (n, D) float16
    tail_v: np.ndarray  # (n, D) float16
    pool: Pool  # outlier pool, <= outlier_num entries
    aux: Pool  # aux pool, <= aux_cap entries
    tracing: bool = True

    @staticmethod
    def empty(G: int, head_dim: int) -> HeadState:
        return HeadState(
            G=G,
            head_dim=head_dim,
            groups=[],
            tail_pos=np.zeros(0, np.int64),
            tail_k=np.zeros((0, head_dim), np.float16),
            tail_v=np.zeros((0, head_dim), np.float16),
            pool=Pool.empty(head_dim),
            aux=Pool.empty(head_dim),
        )

    @property
    def n_sealed(self) -> int:
        return len(self.groups)

    @property
    def n_pos(self) -> int:
        """Number of positions held (= pos_max + 1): the next position to append."""
        return self.n_sealed * self.G + len(self.tail_pos)

    def pooled(self) -> Pool:
        """Outlier and aux pool together, sorted by position: every token served exactly."""
        return self.pool.merged(self.aux)

    def served(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pos, K, V) in float32, one row per position 0..n_pos-1: what attention sees for each token.

        Sealed tokens give K_hat/V_hat, except pooled ones, which are covered by their exact K and V (their
        placeholder rows are replaced, so a placeholder never gets weight); tail tokens give their fp16 values.
        """
        n_q = self.n_sealed * self.G
        k = np.empty((self.n_pos, self.head_dim), np.float32)
        v = np.empty((self.n_pos, self.head_dim), np.float32)
        for g in self.groups:
            k[g.index * self.G : (g.index + 1) * self.G] = g.k_hat if g.young is None else g.young.k_hat
            v[g.index * self.G : (g.index + 1) * self.G] = g.v_hat if g.young_v is None else g.young_v.v_hat
        pooled = self.pooled()
        k[pooled.pos] = pooled.k  # cover
        v[pooled.pos] = pooled.v
        k[n_q:] = self.tail_k
        v[n_q:] = self.tail_v
        return np.arange(self.n_pos, dtype=np.int64), k, v


# ------------------------------------------------------------------------------------------ quantize / seal


def l1_scores(k: np.ndarray) -> np.ndarray:
    """S = sum_c |K_c| per row of fp16 keys (n, D): the exact sum rounded once to fp32 (order-independent)."""
    k = np.asarray(k, dtype=np.float16)
    # every fp16 is a multiple of 2^-24 below 2^16, so the fp64 sum of D < 8192 of them is exact
    return np.abs(k.astype(np.float64)).sum(axis=1).astype(np.float32)


def group_mean(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per-channel mean of the selected rows of fp16 x (n, D): the exact mean rounded once to fp16."""
    sel = np.asarray(x, dtype=np.float16)[rows].astype(np.float64)
    # the fp64 sum is exact (see l1_scores) and the fp64 quotient rounds to the same fp16 as the exact one
    return (sel.sum(axis=0) / sel.shape[0]).astype(np.float16)


def hadamard_rotate(x: np.ndarray) -> np.ndarray:
    """The orthonormal Hadamard transform of every block of ROT_BLOCK channels of x (..., D), in fp32.

    Computed as the fast Walsh-Hadamard butterflies (stage h = 1, 2, 4, ...: (a, b) -> (a + b, a - b) for the
    pairs h apart), each stage rounded to fp32, then scaled by 1/sqrt(ROT_BLOCK) = 1/8 (exact): a fixed order of
    operations that a kernel can follow bit for bit. The transform is its own inverse (H = H^T, H H = I); in fp32
    x -> rotate(rotate(x)) is exact up to rounding.
    """
    x = np.asarray(x, dtype=np.float32)
    D = x.shape[-1]
    if D % ROT_BLOCK:
        raise ValueError(f"rotation needs the head dim to be a multiple of {ROT_BLOCK}, got {D}")
    y = x.reshape(*x.shape[:-1], D // ROT_BLOCK, ROT_BLOCK).copy()
    h = 1
    while h < ROT_BLOCK:
        z = y.reshape(*y.shape[:-1], ROT_BLOCK // (2 * h), 2, h)
        a, b = z[..., 0, :].copy(), z[..., 1, :].copy()
        z[..., 0, :] = a + b
        z[..., 1, :] = a - b
        h *= 2
    return (y * np.float32(1.0 / math.sqrt(ROT_BLOCK))).reshape(x.shape).astype(np.float32)


def v_rotation_unit(config: OttConfig) -> int:
    """U = max(Gv, ROT_BLOCK): the channels of one token that v_rotate stores rotated or not together."""
    return max(config.Gv, ROT_BLOCK)


def check_v_rotation(config: OttConfig, head_dim: int) -> None:
    """v_rotate needs whole rotation units: the head dim must be a multiple of U = max(Gv, ROT_BLOCK)."""
    U = v_rotation_unit(config)
    if config.v_rotate and head_dim % U:
        raise ValueError(f"v_rotate needs the head dim to be a multiple of max(Gv, {ROT_BLOCK}) = {U}, got {head_dim}")


def _key_rank(k: np.ndarray) -> np.ndarray:
    """Channels of a group of keys k (G, D), most deserving first: by c = (max - min) * max(|max|, |min|), computed
    in fp32 from the fp16 keys (one rounded product, so every implementation ranks alike), largest first, ties to
    the lower channel."""
    kf = np.asarray(k, dtype=np.float32)
    D = kf.shape[1]
    mx, mn = kf.max(axis=0), kf.min(axis=0)
    crit = ((mx - mn).astype(np.float32) * np.maximum(np.abs(mx), np.abs(mn))).astype(np.float32)
    return np.lexsort((np.arange(D), -crit))  # lexsort's last key is the primary one


def key_widths(k: np.ndarray, config: OttConfig) -> np.ndarray:
    """(D,) uint8 code width of each channel of a group of keys k (G, D) under config.k_mix (config.k_mixed: keys of
    B = config.kbits bits, 3 with k_mix on, 2 too with k_mix=2).

    Channels are ranked by c = (max - min) * max(|max|, |min|) over the group, computed in fp32 from the fp16 keys
    (one rounded product, so every implementation ranks alike), largest first, ties to the lower channel: the first
    D/4 get B + 1 bits, the last D/4 get B - 1, the others B, so the group holds exactly B*D*G code bits. The product
    weighs a channel's quantization step (its range) by its magnitude, a proxy for its share of the scores
    q.k (docs/k-channel-widths.md measures it against allocations that know the queries). For 2-bit keys this is
    KeyMix(bits=2, lo=1, hi=3) (docs/long-context-keys.md).
    """
    return config_key_mix(config).widths(k)


def config_key_mix(config: OttConfig) -> KeyMix:
    """The KeyMix of the cache's k_mix on config's keys: widths kbits - 1 .. kbits + 1 in quarters, the 1-bit
    channels clipped to quantizer.K_CLIP64[1] (full range without config.clip)."""
    return KeyMix(bits=config.kbits, lo=config.kbits - 1, hi=config.kbits + 1)


# ------------------------------------------------------------------- study option: mixed widths for any key width

# Clip of the 1-bit channels of a KeyMix, in sixty-fourths of the group's range (the two levels sit at
# min + range*(1-c)/2 and max - range*(1-c)/2). Measured on the calibration split's captured attention of both
# test models with study.k_widths --two-bit --clip1 (docs/long-context-keys.md), as docs/clipping.md measured
# K_CLIP64: optima 20 (SmolLM2) and 12 (Gemma 3), each within 1% of its optimum at 16, the value between them.
# The cache's 1-bit format (k_mix on 2-bit keys) is quantizer.K_CLIP64[1], this value.
K1_CLIP64 = K_CLIP64[1]


@dataclass(frozen=True)
class KeyMix:
    """k_mix generalised to any key width (issue 51): the cache's k_mix is config_key_mix(config); the others are
    study options no kernel implements.

    Per sealed group, channels are ranked as key_widths ranks them (_key_rank); the first D // hi_div get `hi`
    bits, the last n_lo get `lo` bits, the others `bits`, with n_lo chosen so that the group holds exactly
    bits*D*G code bits: n_lo = n_hi * (hi - bits) / (bits - lo) (must be an integer). KeyMix() is the 2-bit analogue
    of k_mix: widths 1/2/3, a quarter of the channels at 1 bit and a quarter at 3. KeyMix(bits=3, lo=2, hi=4) is
    exactly k_mix (key_widths). Each width has its own clipped range: K_CLIP64 for 2-4 bits, clip1 for 1 bit
    (full range without config.clip); a 0-bit channel (lo = 0) stores no codes, only its fp16 mean (scale 0).
    Byte cost (study.k_widths counts it): fp16 scale and min per channel and group as every key channel, plus a
    2-bit width table per channel and group (as k_mix's).
    """

    bits: int = 2
    lo: int = 1
    hi: int = 3
    hi_div: int = 4
    clip1: int = K1_CLIP64

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.bits < self.hi <= 4:
            raise ValueError(f"KeyMix needs 0 <= lo < bits < hi <= 4, got {self.lo}/{self.bits}/{self.hi}")
        if self.hi_div < 1 or not 1 <= self.clip1 <= CLIP_ONE:
            raise ValueError(f"KeyMix: hi_div must be >= 1 and clip1 in [1, {CLIP_ONE}]")

    def counts(self, D: int) -> tuple[int, int]:
        """(n_hi, n_lo) channels of a group of D channels."""
        n_hi = D // self.hi_div
        n_lo, rem = divmod(n_hi * (self.hi - self.bits), self.bits - self.lo)
        if rem or n_hi + n_lo > D:
            raise ValueError(f"KeyMix {self}: no whole channel count keeps {self.bits} bits on average at D = {D}")
        return n_hi, n_lo

    def widths(self, k: np.ndarray) -> np.ndarray:
        """(D,) uint8 code width of each channel of a group of keys k (G, D)."""
        order = _key_rank(k)
        D = len(order)
        n_hi, n_lo = self.counts(D)
        widths = np.full(D, self.bits, np.uint8)
        widths[order[:n_hi]] = self.hi
        if n_lo:
            widths[order[D - n_lo :]] = self.lo
        return widths

    def format_of(self, bits: int, config: OttConfig) -> BlockFormat:
        """The block format of a channel at `bits` (1 to 4) under config (its G and clip)."""
        if bits == 1:
            return BlockFormat(1, config.G, self.clip1 if config.clip else CLIP_ONE)
        return config.k_format_of(bits)


def _quantize_keys_mixed(
    k: np.ndarray, config: OttConfig, widths: np.ndarray, mix: KeyMix
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Channel c of k (G, D) fp32 at widths[c] bits: codes (D, G), scale (D,), min (D,) fp16, k_hat (G, D)."""
    G, D = k.shape
    codes = np.zeros((D, G), np.uint8)
    d = np.zeros(D, np.float16)
    m = np.zeros(D, np.float16)
    k_hat = np.zeros((G, D), np.float32)
    for bits in np.unique(widths):
        cs = np.flatnonzero(widths == bits)
        if bits == 0:  # no codes: the channel's mean (exact in fp64, rounded once to fp16), scale 0
            m[cs] = k[:, cs].astype(np.float64).mean(axis=0).astype(np.float16)
            k_hat[:, cs] = m[cs].astype(np.float32)[None, :]
            continue
        q = quantize(k.T[cs], mix.format_of(int(bits), config))
        codes[cs], d[cs], m[cs] = q.codes.reshape(len(cs), G), q.d.reshape(-1), q.m.reshape(-1)
        k_hat[:, cs] = dequantize(q).T
    return codes, d, m, k_hat


def quantize_keys(
    k: np.ndarray, config: OttConfig, mix: KeyMix | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool, np.ndarray | None]:
    """Channel-wise: k (G, D) -> codes (D, G) uint8, scale (D,) fp16, min (D,) fp16, k_hat (G, D) fp32, rotated,
    widths ((D,) uint8 under config.k_mixed, else None).

    k_rotate: the channels quantized are those of the rotated keys and k_hat is rotated back, unless a scale or
    min of the rotated group would not fit fp16 (a rotated value can reach 8x the largest input, beyond fp16 for
    inputs above 65504/8): then the whole group is quantized unrotated, and `rotated` (one flag per group) says so.
    k_mixed: channel c is quantized at widths[c] bits (key_widths), each width with its own clipped range.
    mix (study option, KeyMix): the widths of mix.widths instead, whatever config.kbits and k_mix say (the config's
    G and clip still apply; k_rotate is ignored).
    """
    k = np.asarray(k, dtype=np.float32)
    G, D = k.shape
    if config.identity:
        z = np.zeros(D, np.float16)
        return np.zeros((D, G), np.uint8), z, z.copy(), k.copy(), False, None
    if mix is not None:
        widths = mix.widths(k)
        return (*_quantize_keys_mixed(k, config, widths, mix), False, widths)
    if config.k_mixed:
        mix = config_key_mix(config)
        widths = mix.widths(k)
        return (*_quantize_keys_mixed(k, config, widths, mix), False, widths)
    # transposed: the G tokens of a channel form one group, codes (D, 1, G), d and m (D, 1)
    if config.k_rotate:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is what this looks for
            q = quantize(hadamard_rotate(k).T, config.k_format)
        if np.isfinite(q.d).all() and np.isfinite(q.m).all():
            k_hat = hadamard_rotate(dequantize(q).T)
            return q.codes.reshape(D, G), q.d.reshape(D), q.m.reshape(D), k_hat, True, None
    q = quantize(k.T, config.k_format)
    return q.codes.reshape(D, G), q.d.reshape(D), q.m.reshape(D), dequantize(q).T.copy(), False, None


_SIGN16 = np.uint16(0x8000)  # the sign bit of an fp16


def quantize_values(v: np.ndarray, config: OttConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token-wise: v (G, D) -> codes (G, D) uint8, scale (G, D/Gv) fp16, min (G, D/Gv) fp16, v_hat (G, D) fp32.

    v_rotate: every unit of U = max(Gv, ROT_BLOCK) channels of a token (channels [u*U, (u+1)*U) of row t) is
    quantized from its rotated values (hadamard_rotate of the row, which rotates each ROT_BLOCK block) if every one
    of its Gv blocks then gets a finite fp16 scale and min, else from its unrotated values (a rotated value can
    reach 8x the largest input, beyond fp16 for inputs above 65504/8). Units are decided independently.
    The flag is the sign bit of the stored fp16 scale: every block of a rotated unit stores its scale negated (sign
    bit set, a zero scale as -0.0), every other block its scale as is. Scales are >= 0 by construction ((max -
    min)/nlev), so that bit is otherwise always 0: a kernel stores the flag in it for free and the block format does
    not grow. Without v_rotate every sign bit is clear. Decoding: dequantize_values.
    """
    v = np.asarray(v, dtype=np.float32)
    G, D = v.shape
    nv = D // config.Gv
    if config.identity:
        z = np.zeros((G, nv), np.float16)
        return np.zeros((G, D), np.uint8), z, z.copy(), v.copy()
    q = quantize(v, config.v_format)  # codes (G, nv, Gv), d, m (G, nv)
    codes, d, m = q.codes, q.d, q.m
    if config.v_rotate:
        check_v_rotation(config, D)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is what this looks for
            qr = quantize(hadamard_rotate(v), config.vr_format)
        per = v_rotation_unit(config) // config.Gv  # Gv blocks per unit
        fits = (np.isfinite(qr.d) & np.isfinite(qr.m)).reshape(G, nv // per, per).all(axis=2)
        rot = np.repeat(fits, per, axis=1)  # (G, nv): each block carries its unit's flag
        codes = np.where(rot[..., None], qr.codes, codes)
        m = np.where(rot, qr.m, m)
        d = (np.where(rot, qr.d, d).view(np.uint16) | np.where(rot, _SIGN16, np.uint16(0))).view(np.float16)
    codes = codes.reshape(G, D)
    return codes, d, m, dequantize_values(codes, d, m, config)


def dequantize_values(codes: np.ndarray, scale: np.ndarray, mn: np.ndarray, config: OttConfig) -> np.ndarray:
    """V_hat (G, D) fp32 from stored V codes (G, D), scales and mins (G, D/Gv): x = m + |d| * code per block (the
    magnitude of the stored scale, as quantizer.dequantize), then the units whose scale has its sign bit set are
    rotated back (hadamard_rotate is its own inverse). A kernel can accumulate sum_j p_j x_j over the rotated and
    the unrotated units apart and rotate the rotated sum back once per output row (the rotation is linear).
    """
    G, D = codes.shape
    q = Quantized(codes=codes.reshape(G, D // config.Gv, config.Gv), d=np.abs(scale), m=mn)
    x = dequantize(q)
    rot = np.repeat(np.signbit(scale), config.Gv, axis=1)  # (G, D): per channel, its unit's flag
    return np.where(rot, hadamard_rotate(x), x) if rot.any() else x


def dequantize_group(g: SealedGroup, config: OttConfig) -> tuple[np.ndarray, np.ndarray]:
    """K_hat, V_hat (G, D) float32 decoded from a group's stored codes, scales and mins (not its cached k_hat)."""
    if config.identity:
        return g.k_hat.copy(), g.v_hat.copy()
    D, G = g.k_codes.shape
    # x = m + d * code per channel: the same whatever the channel's width (k_widths)
    kq = Quantized(codes=g.k_codes.reshape(D, 1, G), d=g.k_scale.reshape(D, 1), m=g.k_min.reshape(D, 1))
    k_hat = dequantize(kq).T.copy()
    if g.k_rotated:
        k_hat = hadamard_rotate(k_hat)
    return k_hat, dequantize_values(g.v_codes, g.v_scale, g.v_min, config)


def seal_group(state: HeadState, config: OttConfig, outlier_num: int, key_mix: KeyMix | None = None) -> None:
    """Seal the oldest group of the tail (spec 'Sealing', steps 1-5), in place. key_mix: the study option of
    quantize_keys (None: the configuration's keys)."""
    G = state.G
    index = state.n_sealed
    assert len(state.tail_pos) >= G and state.tail_pos[0] == index * G
    gk = state.tail_k[:G].copy()
    gv = state.tail_v[:G].copy()
    gpos = state.tail_pos[:G].copy()
    won = np.zeros(0, np.int64)  # row indices (within the group) of this group's winners

    if outlier_num > 0 and state.tracing:
        # 1. candidates: the current pool members (stored scores) and the group's tokens (fresh scores)
        scores = l1_scores(gk)
        n_pool = len(state.pool)
        cand_score = np.concatenate([state.pool.score, scores])
        cand_pos = np.concatenate([state.pool.pos, gpos])
        # 2. the outlier_num smallest (score, position): lexsort's last key is the primary one
        order = np.lexsort((cand_pos, cand_score))
        is_winner = np.zeros(len(order), bool)
        is_winner[order[:outlier_num]] = True
        pool_lost = ~is_winner[:n_pool]
        # 3. the losing pool members go to the aux pool; if it cannot take them all, no competition at all
        if len(state.aux) + int(pool_lost.sum()) > config.aux_cap:
            state.tracing = False
        else:
            state.aux = state.aux.merged(state.pool.take(pool_lost))
            won = np.flatnonzero(is_winner[n_pool:])
            # 4. copy the winners' exact K and V into the pool ...
            newcomers = Pool(pos=gpos[won], k=gk[won].copy(), v=gv[won].copy(), score=scores[won])
            state.pool = state.pool.take(~pool_lost).merged(newcomers)
            # ... and write the placeholder (mean) over them inside the group
            rows = np.ones(G, bool)
            if config.mean == "non_outlier":
                rows[won] = False
            gk[won] = group_mean(gk, rows)
            gv[won] = group_mean(gv, rows)

    # 5. quantize and drop the group from the tail
    k_codes, k_scale, k_min, k_hat, k_rotated, k_widths = quantize_keys(gk, config, key_mix)
    young = None
    n_young = config.young_for_layer()
    if n_young and key_mix is None:
        # keys by age: the same keys (placeholders written) at 3 bits; the group that ages out drops its copy
        ycodes, yscale, ymin, yhat, _, ywidths = quantize_keys(gk, config.replace(k_bits=config.kbits + 1))
        young = YoungKeys(k_codes=ycodes, k_scale=yscale, k_min=ymin, k_hat=yhat, k_widths=ywidths)
        if len(state.groups) >= n_young:
            state.groups[len(state.groups) - n_young].young = None
    young_v = None
    n_young_v = config.young_values_for_layer()
    if n_young_v and key_mix is None:
        # values by age: the same values (placeholders written) at 3 bits
        vc, vs, vm, vh = quantize_values(gv, config.replace(v_bits=config.vbits + 1))
        young_v = YoungValues(v_codes=vc, v_scale=vs, v_min=vm, v_hat=vh)
        if len(state.groups) >= n_young_v:
            state.groups[len(state.groups) - n_young_v].young_v = None
    v_codes, v_scale, v_min, v_hat = quantize_values(gv, config)
    state.groups.append(
        SealedGroup(
            index=index,
            k_codes=k_codes,
            k_scale=k_scale,
            k_min=k_min,
            v_codes=v_codes,
            v_scale=v_scale,
            v_min=v_min,
            placeholders=gpos[won],
            k_hat=k_hat,
            v_hat=v_hat,
            k_rotated=k_rotated,
            k_widths=k_widths,
            young=young,
            young_v=young_v,
        )
    )
    state.tail_pos = state.tail_pos[G:]
    state.tail_k = state.tail_k[G:]
    state.tail_v = state.tail_v[G:]


def seal_eligible(state: HeadState, config: OttConfig, outlier_num: int) -> None:
    """Seal, in order, every group g with pos_max + 1 - (g+1)G >= R."""
    while state.n_pos - (state.n_sealed + 1) * state.G >= config.R:
        seal_group(state, config, outlier_num)


def sealed_at(p: int, config: OttConfig) -> int:
    """S(p): the groups sealed when position p is processed alone (and so the groups a query at p sees sealed)."""
    return max(0, (p - config.R) // config.G)


def ubatch_splits(start: int, n: int, config: OttConfig, n_ubatch: int) -> list[tuple[int, int]]:
    """Positions [start, start + n) of one sequence as ubatches [a, b) of at most n_ubatch positions that never
    cross a position R + kG, where one more group is sealed for the queries after it (batch invariance)."""
    if n_ubatch <= 0:
        raise ValueError("n_ubatch must be positive")
    out, a = [], start
    while a < start + n:
        headroom = config.R + (sealed_at(a, config) + 1) * config.G - a
        b = min(start + n, a + n_ubatch, a + headroom)
        out.append((a, b))
        a = b
    return out


def can_cut(state: HeadState, p0: int, config: OttConfig) -> bool:
    """Whether removing positions >= p0 leaves what a fresh run over [0, p0) holds (see the module docstring)."""
    return p0 <= 0 or p0 >= state.n_pos or sealed_at(p0, config) >= state.n_sealed


def truncate(state: HeadState, p0: int, config: OttConfig) -> bool:
    """Remove positions >= p0 in place where can_cut allows it (True); else change nothing (False)."""
    if not can_cut(state, p0, config):
        return False
    if p0 <= 0:
        # nothing left: a fresh state (tracing on again), in place so that holders of `state` see it
        state.__dict__.update(HeadState.empty(state.G, state.head_dim).__dict__)
        return True
    keep = state.tail_pos < p0
    state.tail_pos = state.tail_pos[keep]
    state.tail_k = state.tail_k[keep]
    state.tail_v = state.tail_v[keep]
    return True


# ----------------------------------------------------------------------------------------------- attention


def attend(
    state: HeadState,
    q: np.ndarray,
    q_pos: np.ndarray,
    scale: float | None = None,
    int8_query: bool = False,
    int_values: int = 0,
    v_rotate: bool = False,
) -> np.ndarray:
    """Attention of query rows q (n, D) at positions q_pos (n,) over one head's cache, with cover semantics.

    Causal: a query at position p sees the positions <= p. Scores q.K * scale (default 1/sqrt(D)), softmax and
    accumulation in fp32; every position appears exactly once (see HeadState.served).

    int8_query: score the sealed (not pooled) tokens as the native multi-row kernel does, reading the codes with
    the query quantized per row and group: s = scale*(q.m + a*sum_c qi_c code_c), qi = rint(q*d/a),
    a = max|q*d|/127, in fp32 (the integer sums are exact).

    int_values: the bits B of the integer weights with which the integer V pass weighs the sealed tokens' V codes
    (16: the AVX-512 VNNI kernels, 8: AVX2; 0: fp32). Per row, group and V block, the weights w_j = p_j d_j of the
    tokens read from their codes are quantized to q_j = rint(w_j*(2^B - 1)/wmax), wmax = max_j w_j, and the codes
    weighed by q_j*wmax/(2^B - 1) (the mins keep p_j). The quantization is scale free, so the normalized p gives the
    kernel's q_j. Tokens read from codes: not pooled and, with v_rotate (the state's config), with every V block
    rotated (the others are served exactly).
    """
    if isinstance(int_values, bool) or int_values not in (0, 8, 16):
        raise ValueError(f"int_values must be 0, 8 or 16 (the integer weights' bits), not {int_values!r}")
    q = np.asarray(q, dtype=np.float32)
    q_pos = np.asarray(q_pos, dtype=np.int64)
    pos, k, v = state.served()
    scale = np.float32(1.0 / math.sqrt(state.head_dim) if scale is None else scale)
    s = (q @ k.T).astype(np.float32) * scale
    if int8_query:
        pooled = set(state.pooled().pos.tolist())
        for g in state.groups:
            keys = g if g.young is None else g.young  # keys by age: a young group's codes are its 3-bit ones
            d = keys.k_scale.astype(np.float32)
            qd = q * d[None, :]
            amax = np.abs(qd).max(axis=1)
            ia = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
            qi = np.rint(qd * ia[:, None]).astype(np.int64)
            isum = qi @ keys.k_codes.astype(np.int64)  # (n, G), exact
            base = q @ keys.k_min.astype(np.float32)
            sg = base[:, None] * scale + (amax / np.float32(127.0) * scale)[:, None] * isum.astype(np.float32)
            cols = [j for j in range(state.G) if g.index * state.G + j not in pooled]
            s[:, [g.index * state.G + j for j in cols]] = sg[:, cols]
    s = np.where(pos[None, :] <= q_pos[:, None], s, np.float32(-np.inf))
    s = s - s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    out = (p @ v).astype(np.float32)
    if int_values:
        out += _int_values_error(state, p, v_rotate, int_values)
    return out


def _int_values_error(state: HeadState, p: np.ndarray, v_rotate: bool, bits: int) -> np.ndarray:
    """What the integer V pass adds to p @ v: sum_j (q_j*wmax/(2^bits - 1) - w_j) code_j per group and V block (see
    attend), in the stored basis, turned back with v_rotate."""
    n, D, G = p.shape[0], state.head_dim, state.G
    pooled = set(state.pooled().pos.tolist())
    err = np.zeros((n, D), np.float32)
    one = np.float32((1 << bits) - 1)
    for g in state.groups:
        if g.young_v is not None:
            continue  # young values are weighed in fp32 here (not modeled: the integer pass of their kernels)
        rot = g.v_rotated.all(axis=1)
        cols = np.array([j for j in range(G) if g.index * G + j not in pooled and (rot[j] or not v_rotate)], np.int64)
        if len(cols) == 0:
            continue
        d = np.abs(g.v_scale.astype(np.float32))  # (G, NB): the sign bit is the rotation flag
        NB = d.shape[1]
        Gv = D // NB
        e = np.zeros((n, D), np.float32)
        for b in range(NB):
            w = (p[:, g.index * G + cols] * d[cols, b][None, :]).astype(np.float32)
            wmax = w.max(axis=1)
            inv = np.where(wmax > 0, one / np.where(wmax > 0, wmax, 1), 0).astype(np.float32)
            wq = np.rint(w * inv[:, None]).astype(np.float32) * (wmax / one)[:, None]
            codes = g.v_codes[cols, b * Gv : (b + 1) * Gv].astype(np.float32)
            e[:, b * Gv : (b + 1) * Gv] = (wq - w) @ codes
        err += hadamard_rotate(e) if v_rotate else e
    return err


# ------------------------------------------------------------------------------------------------- the cache


class OttCache:
    """ott2 cache for several sequences, n_layer layers and n_kv_head KV heads of dimension head_dim."""

    def __init__(self, config: OttConfig, n_layer: int, n_kv_head: int, head_dim: int) -> None:
        if head_dim % config.Gv:
            raise ValueError(f"Gv ({config.Gv}) must divide head_dim ({head_dim})")
        check_v_rotation(config, head_dim)
        if n_layer <= 0 or n_kv_head <= 0:
            raise ValueError("n_layer and n_kv_head must be positive")
        self.config = config
        self.n_layer = n_layer
        self.n_kv_head = n_kv_head
        self.head_dim = head_dim
        self._seqs: dict[int, list[list[HeadState]]] = {}

    def _heads(self, seq_id: int, layer: int) -> list[HeadState]:
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} out of range")
        if seq_id not in self._seqs:
            self._seqs[seq_id] = [
                [HeadState.empty(self.config.G, self.head_dim) for _ in range(self.n_kv_head)]
                for _ in range(self.n_layer)
            ]
        return self._seqs[seq_id][layer]

    def n_pos(self, seq_id: int, layer: int = 0) -> int:
        """Positions held by (seq_id, layer): pos_max + 1."""
        return self._heads(seq_id, layer)[0].n_pos

    def state(self, seq_id: int, layer: int, head: int) -> HeadState:
        """A deep copy of the exact state of (seq_id, layer, KV head)."""
        return copy.deepcopy(self._heads(seq_id, layer)[head])

    def process_ubatch(
        self,
        seq_id: int,
        layer: int,
        q: np.ndarray | None,
        k: np.ndarray,
        v: np.ndarray,
        pos: np.ndarray,
        kq_scale: float | None = None,
        int8_query: bool = False,
    ) -> np.ndarray | None:
        """Append a ubatch of one sequence to one layer, attend, then seal what became eligible.

        q (n, n_q_head, D) or None (append and seal only); k, v (n, n_kv_head, D), keys post-RoPE; pos (n,)
        consecutive, starting at n_pos(seq_id, layer). K and V are rounded to fp16 on append and must stay finite.
        Returns the attention output (n, n_q_head, D) float32: query head h reads KV head h // (n_q_head //
        n_kv_head), the ubatch sees its own tokens in full precision (causally). int8_query: as `attend`.
        """
        heads = self._heads(seq_id, layer)
        H, D = self.n_kv_head, self.head_dim
        with np.errstate(over="ignore"):  # out-of-range values become inf and are refused below
            k16 = np.asarray(k, dtype=np.float32).astype(np.float16)
            v16 = np.asarray(v, dtype=np.float32).astype(np.float16)
        pos = np.asarray(pos, dtype=np.int64).reshape(-1)
        n = len(pos)
        if k16.shape != (n, H, D) or v16.shape != (n, H, D):
            raise ValueError(f"k and v must have shape {(n, H, D)}, got {k16.shape} and {v16.shape}")
        if not (np.isfinite(k16).all() and np.isfinite(v16).all()):
            raise ValueError("K and V must be finite in fp16")
        start = heads[0].n_pos
        if n == 0 or not np.array_equal(pos, np.arange(start, start + n)):
            raise ValueError(f"positions must be consecutive and start at {start}")
        if q is not None:
            self._check_q(q, n)
        for h, hs in enumerate(heads):
            hs.tail_pos = np.concatenate([hs.tail_pos, pos])
            hs.tail_k = np.concatenate([hs.tail_k, k16[:, h]])
            hs.tail_v = np.concatenate([hs.tail_v, v16[:, h]])
        out = None if q is None else self._attend(heads, q, pos, kq_scale, int8_query)
        on = self.config.outliers_for_layer(layer)
        cfg = self.config.for_layer(layer)  # the layer's own code widths (layer_widths)
        for hs in heads:
            seal_eligible(hs, cfg, on)
        return out

    def attend(
        self, seq_id: int, layer: int, q: np.ndarray, q_pos: np.ndarray, kq_scale: float | None = None
    ) -> np.ndarray:
        """Evaluate queries (n, n_q_head, D) at positions q_pos against the current cache, changing nothing."""
        return self._attend(self._heads(seq_id, layer), q, np.asarray(q_pos, np.int64).reshape(-1), kq_scale)

    def _check_q(self, q: np.ndarray, n: int) -> None:
        shape = np.shape(q)
        if len(shape) != 3 or shape[0] != n or shape[1] % self.n_kv_head or shape[2] != self.head_dim:
            raise ValueError(f"q must be ({n}, a multiple of {self.n_kv_head}, {self.head_dim}), got {shape}")

    def _attend(
        self, heads: list[HeadState], q: np.ndarray, q_pos: np.ndarray, scale: float | None, int8_query: bool = False
    ) -> np.ndarray:
        self._check_q(q, len(q_pos))
        if int8_query and self.config.k_rotate:
            raise NotImplementedError("the int8-query model of the kernel reads unrotated keys (k_rotate=False)")
        q = np.asarray(q, dtype=np.float32)
        n, n_q_head, D = q.shape
        per_kv = n_q_head // self.n_kv_head
        out = np.empty_like(q)
        for h, hs in enumerate(heads):
            # the per_kv query heads of KV head h, as n*per_kv rows
            rows = q[:, h * per_kv : (h + 1) * per_kv].reshape(n * per_kv, D)
            res = attend(hs, rows, np.repeat(q_pos, per_kv), scale, int8_query)
            out[:, h * per_kv : (h + 1) * per_kv] = res.reshape(n, per_kv, D)
        return out

    def process_batch(
        self,
        seq_id: int,
        layer: int,
        q: np.ndarray | None,
        k: np.ndarray,
        v: np.ndarray,
        pos: np.ndarray,
        n_ubatch: int,
        kq_scale: float | None = None,
        int8_query: bool = False,
    ) -> np.ndarray | None:
        """process_ubatch over the ubatches the native cache splits a batch into (ubatch_splits): the outputs
        are those of processing the positions one at a time."""
        pos = np.asarray(pos, dtype=np.int64).reshape(-1)
        if len(pos) == 0:
            raise ValueError("an empty batch")
        outs = []
        for a, b in ubatch_splits(int(pos[0]), len(pos), self.config, n_ubatch):
            i, j = a - int(pos[0]), b - int(pos[0])
            out = self.process_ubatch(seq_id, layer, None if q is None else q[i:j], k[i:j], v[i:j], pos[i:j],
                                      kq_scale, int8_query)  # fmt: skip
            outs.append(out)
        return None if q is None else np.concatenate(outs)  # type: ignore[arg-type]

    def seq_rm(self, seq_id: int, p0: int) -> bool:
        """Remove positions >= p0 of a sequence in every layer where that leaves what a fresh run over [0, p0)
        holds (True); otherwise change nothing (False, see the module docstring). p0 <= 0 clears the sequence
        (tracing on again)."""
        if seq_id not in self._seqs:
            return True
        heads = [hs for layer in self._seqs[seq_id] for hs in layer]
        if not all(can_cut(hs, p0, self.config) for hs in heads):
            return False
        for hs in heads:
            truncate(hs, p0, self.config)
        if p0 <= 0:
            del self._seqs[seq_id]
        return True


# -------------------------------------------------------------------------------------------------- memory


def memory_bits(config: OttConfig, head_dim: int, n_tokens: int, layer: int | None = None) -> dict[str, float]:
    """Bits held by one (layer, sequence, KV head) after n_tokens positions of steady decoding (spec 'Memory').

    T_q = G * floor((n - R) / G) sealed positions (0 while n < R + G) and T_tail = n - T_q. The spec's
    `T_q*D*bits` term counts the codes of K and V together here (T_q*D*(k_bits + v_bits)): that is what makes
    G = Gv = 128, bits = 2 tend to the 2.25 bits per element it states. Pools count their capacity (outlier_num +
    aux_cap slots, none for a layer without outliers): exact fp16 K and V, plus 32 bits of position and 32 bits of fp32
    score per slot. Tail and sealed positions are implicit (group index, consecutive positions): no bits.
    layer: None for a layer with outliers (config.outlier_num) and the configuration's widths, else that layer's
    (config.outliers_for_layer, config.widths_for_layer).
    """
    if n_tokens <= 0:
        raise ValueError("n_tokens must be positive")
    kbits, vbits = (config.kbits, config.vbits) if layer is None else config.widths_for_layer(layer)
    lc = config if layer is None else config.for_layer(layer)
    mixed = lc.k_mixed
    D = head_dim
    t_q = config.G * max(0, (n_tokens - config.R) // config.G)
    t_tail = n_tokens - t_q
    on = config.outlier_num if layer is None else config.outliers_for_layer(layer)
    slots = on + config.aux_cap if on > 0 else 0
    return {
        "codes": t_q * D * (kbits + vbits),
        "k_scale_min": 32 * D * t_q / config.G,
        "k_widths": 2 * D * t_q / config.G if mixed else 0,  # 2 bits per channel and group
        # keys and values by age: k_young (v_young) groups' keys (values) again at 3 bits (as allocated: the rings
        # are there from the start)
        "young": _young_bits(lc, D),
        "v_scale_min": (16 if lc.v_symmetric else 32) * t_q * D / config.Gv,  # v_sym: a scale, no min
        "tail": 2 * 16 * D * t_tail,
        "pools": 2 * 16 * D * slots,
        "pool_positions": 32 * slots,
        "pool_scores": 32 * slots,
    }


def _young_bits(lc: OttConfig, D: int) -> float:
    """Bits of a layer's rings of young keys and values (config.k_young / v_young groups at kbits + 1 / vbits + 1;
    0 without)."""
    bits = 0
    if n := lc.young_for_layer():
        yc = lc.replace(k_bits=lc.kbits + 1)
        bits += n * (D * yc.kbits * lc.G + 32 * D + (2 * D if yc.k_mixed else 0))
    if n := lc.young_values_for_layer():
        # a token's D // Gv blocks of vbits + 1 codes, fp16 scale and min each (young values are never symmetric)
        bits += n * lc.G * (D * (lc.vbits + 1) + 32 * D // lc.Gv)
    return bits


def effective_bits(config: OttConfig, head_dim: int, n_tokens: int, n_layer: int | None = None) -> float:
    """Bits per cached K or V element (total bits / (2 * n_tokens * head_dim)), see memory_bits.

    n_layer: average over a model of n_layer layers (the first no_outlier_layers without pools); None: one layer
    with outliers.
    """
    layers: list[int | None] = [None] if n_layer is None else list(range(n_layer))
    total = sum(sum(memory_bits(config, head_dim, n_tokens, layer).values()) for layer in layers)
    return total / (len(layers) * 2 * n_tokens * head_dim)
