"""End to end, a served-keys scheme without kernels: the model's attention replaced by numpy's over keys (and
values) served the way a cache scheme would serve them, KL divergence against the same harness with exact keys.

    python -m study.served_attention --model smollm2-135m --n-ctx 8192 --chunks 1 --schemes ott2,age4 [--threads 2]

llama.cpp's eval callback (as study.k_widths part 2) records each full-attention layer's Qcur/Kcur/Vcur (after
RoPE, f16-rounded K and V as the f16 cache holds them) and overwrites its `kqv_out` (the attention output before
the output projection) with numpy's attention of the ubatch's queries over every position so far, causal, each
query row seeing:
- the newest R tokens and the open group exact (a query at p sees n_sealed(p) = (p + 1 - R) // G sealed groups),
  position 0 exact (the outlier pool holds BOS in most heads; the pools' other tokens are not modelled);
- sealed groups' keys from the reference's sealing quantizer (quantize_keys: k_mix, clipped ranges), at 3 bits
  for the newest `age` sealed groups and 2 bits for older ones (the 2-bit codes narrowed from the 3-bit keys when
  narrowed), values exact or (values=True) token-wise 2-bit rotated as ott2 stores them.
Sliding-window layers keep llama.cpp's own attention. The base is the same harness with every key exact (not
llama.cpp's flash attention, whose f16 query rounding would count as error), so the KLD is the scheme's alone.
Slow: numpy attention over the whole context for every ubatch (minutes per 8k chunk); a study, not a cache.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ott_gguf import corpus, models
from ott_gguf._lib import llama_cpp_module
from ott_gguf.evaluate import kl_divergence
from ott_gguf.kv_types import OttConfig
from ott_gguf.reference import group_mean, hadamard_rotate, l1_scores, quantize_values

from .capture import GgmlTensor, _attn_scale, _ggml, _meta_str, _swa_layers, _tokenize
from .k_widths import _quantize_keys_with

G = 128
PROBE = 32  # kg_attn's probe queries before a group's seal
_F32 = 0


@dataclass(frozen=True)
class Scheme:
    """How sealed keys are served (see the module docstring). exact: nothing quantized (the base)."""

    exact: bool = False
    R: int = 32
    age: int = 0
    narrowed: bool = True
    values: bool = False
    v_bits: int = 2  # sealed values' width (token-wise, rotated) when values
    v_top: int = 0  # oracle: per query row, its v_top most attended sealed tokens' values exact
    v_h2o: int = 0  # causal: per sealed group and KV head, the v_h2o tokens that received the most attention
    #                 from the queries before the group sealed (their probabilities, summed) served with...
    v_h2o_bits: int = 16  # ...exact values (16) or values at this width
    v_h2o_mean: bool = False  # rank by the mean attention per query that saw the token (ZipCache) instead of the sum
    v_age: int = 0  # the newest v_age sealed groups' values at v_bits + 1 (v_young)
    v_rd: int = 0  # an ideal value code instead of v_bits' quantizer: rd_values at v_rd bits per value
    v_h2o_random: bool = False  # the control: v_h2o tokens per group drawn at random (seeded by the group)
    # salient keys (causal, chosen at the seal as v_h2o's tokens are): per sealed group and KV head, k_h2o tokens'
    # keys served exact (16) or token-wise at k_h2o_bits, their slots in the group's channel-wise quantization
    # written with the mean of the other tokens (OTT's placeholder) unless not k_ph; their values served at
    # v_h2o_bits (v_bits: as the group's). k_choose: by the attention received ("attn", v_h2o_mean applies), by the
    # smallest key L1 norm (OTT's outlier criterion, per group: "l1") or at random ("random", the control).
    k_h2o: int = 0
    k_h2o_bits: int = 16
    k_ph: bool = True
    k_choose: str = "attn"
    # attn: count only the attention from the last `probe` queries before the group's seal (positions
    # [(g + 1) G + R - 1 - probe, (g + 1) G + R - 1), every one of which sees every token of the group), not from
    # every query since the token arrived: what a cache can keep exact under a cut of the sequence (0: every query)
    probe: int = 0
    # keys by attention, not age: the kg_attn sealed groups (per KV head) whose tokens drew the most attention from
    # the PROBE queries before their seal hold 3-bit keys, the others 2-bit: at a seal the new group enters the
    # set when it is not full or when its mass beats the set's smallest, which then drops its 3-bit copy for good
    kg_attn: int = 0


SCHEMES = {
    "exact": Scheme(exact=True),
    "ott2": Scheme(narrowed=False),
    "ott2+V": Scheme(narrowed=False, values=True),
    "age2": Scheme(age=2),
    "age4": Scheme(age=4),
    "age4+V": Scheme(age=4, values=True),
    "R64": Scheme(R=64, narrowed=False),
}
# the quality tier's wide layers: every sealed group's keys at 3 bits (k_mix 2/3/4), values at 2 (rotated), R 64
_Q = {"age": 1 << 30, "narrowed": False, "values": True, "R": 64}
SCHEMES |= {
    "q32": Scheme(**_Q),
    "q32-keys": Scheme(**{**_Q, "values": False}),
    "q33": Scheme(**_Q, v_bits=3),
    "q32+top8": Scheme(**_Q, v_top=8),
    "q32+h2o2": Scheme(**_Q, v_h2o=2),
    "q32+h2o8@4": Scheme(**_Q, v_h2o=8, v_h2o_bits=4),
    "q32+vage4": Scheme(**_Q, v_age=4),
    "q32+h2o32m@4": Scheme(**_Q, v_h2o=32, v_h2o_bits=4, v_h2o_mean=True),
    "q32+rnd8@4": Scheme(**_Q, v_h2o=8, v_h2o_bits=4, v_h2o_random=True),
    "q32+rnd32@4": Scheme(**_Q, v_h2o=32, v_h2o_bits=4, v_h2o_random=True),
    "q32+h2o2m": Scheme(**_Q, v_h2o=2, v_h2o_mean=True),
    "q32+h2o8m@4": Scheme(**_Q, v_h2o=8, v_h2o_bits=4, v_h2o_mean=True),
    "q32+rd2": Scheme(**_Q, v_rd=2),  # the best any 2-bit value code could do (rd_values)
}
_K8 = {**_Q, "k_h2o": 8, "v_h2o_mean": True, "v_h2o_bits": 2}
SCHEMES |= {
    "q32+kh8m": Scheme(**_K8),
    "q32+kh8m-ph": Scheme(**_K8, k_ph=False),
    "q32+kh8m@8": Scheme(**{**_K8, "k_h2o_bits": 8}),
    "q32+kvh8m@8/4": Scheme(**{**_K8, "k_h2o_bits": 8, "v_h2o_bits": 4}),
    "q32+kl1_8": Scheme(**_K8, k_choose="l1"),
    "q32+krnd8": Scheme(**_K8, k_choose="random"),
    "q32+kh32m@8": Scheme(**{**_K8, "k_h2o": 32, "k_h2o_bits": 8}),
    # 2-bit keys (unnarrowed, as ott2 seals them), values 2-bit, R 64: does a salient-keys budget make them enough?
    "q22": Scheme(R=64, narrowed=False, values=True),
    "q22+kvh8m@8/4": Scheme(**{**_K8, "age": 0, "k_h2o_bits": 8, "v_h2o_bits": 4}),
    "q22+kvrnd8@8/4": Scheme(**{**_K8, "age": 0, "k_h2o_bits": 8, "v_h2o_bits": 4, "k_choose": "random"}),
    "q22+kh8m@8": Scheme(**{**_K8, "age": 0, "k_h2o_bits": 8}),
    "q22+kvh16m@8/4": Scheme(**{**_K8, "age": 0, "k_h2o": 16, "k_h2o_bits": 8, "v_h2o_bits": 4}),
    "q22+kvp32_8@8/4": Scheme(**{**_K8, "age": 0, "k_h2o_bits": 8, "v_h2o_bits": 4, "probe": 32}),
    "q22+kvp64_8@8/4": Scheme(**{**_K8, "age": 0, "k_h2o_bits": 8, "v_h2o_bits": 4, "probe": 64}),
    "q32+kvp32_8@8/4": Scheme(**{**_K8, "k_h2o_bits": 8, "v_h2o_bits": 4, "probe": 32}),
    # keys by age (the newest 4 sealed groups at 3 bits) against keys by attention (the 4 groups with the most)
    "q22+age4": Scheme(R=64, narrowed=False, values=True, age=4),
    "q22+ga4": Scheme(R=64, narrowed=False, values=True, kg_attn=4),
    "q22+ga8": Scheme(R=64, narrowed=False, values=True, kg_attn=8),
}


def rd_values(v: np.ndarray, bits: int, rng: np.random.Generator) -> np.ndarray:
    """Values (G, D) as an ideal code at `bits` per value would serve them: each token's Hadamard-rotated 64-channel
    block, its mean removed (side information, as a stored min), through the Gaussian test channel of the
    rate-distortion bound, x -> a x + sqrt(a d) n with d = var 2^(-2 bits), a = 1 - 2^(-2 bits), n ~ N(0, 1): mean
    squared error d, the least any code of that rate can reach on a Gaussian source of that variance (a uniform
    quantizer's is about 1.9x it at 2 bits). Then rotated back. Not a quantizer: the bound for any value code of
    that many bits per value with a mean and a scale per block."""
    x = hadamard_rotate(v)
    G, D = x.shape
    b = x.reshape(G, D // 64, 64).astype(np.float64)
    mu = b.mean(axis=2, keepdims=True)
    var = ((b - mu) ** 2).mean(axis=2, keepdims=True)
    a = 1.0 - 2.0 ** (-2 * bits)
    y = mu + a * (b - mu) + np.sqrt(a * var * 2.0 ** (-2 * bits)) * rng.standard_normal(b.shape)
    return hadamard_rotate(y.reshape(G, D).astype(np.float32))


def _contiguous(tt: GgmlTensor) -> bool:
    return tt.nb[0] == 4 and tt.nb[1] == 4 * tt.ne[0] and tt.nb[2] == tt.nb[1] * tt.ne[1]


def _sealed(qr: np.ndarray, cols: np.ndarray, R: int) -> np.ndarray:
    """Which positions cols are in sealed groups for the rows at positions qr (position 0, the sink, never is)."""
    return (cols < np.maximum(0, (qr + 1 - R) // G) * G) & (cols > 0)


def _causal_softmax(s: np.ndarray, cols: np.ndarray, qr: np.ndarray) -> np.ndarray:
    """Softmax over each row of scores s (rows at positions qr, columns at positions cols), the future masked."""
    s = np.where(cols > qr, -np.inf, s)
    p = np.exp(s - s.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


class _Layer:
    """One full-attention layer's history: exact K/V (fp16-rounded, float32), and per KV head the sealed groups'
    served keys at 2 and 3 bits and values, filled as groups complete."""

    def __init__(self, n_kv: int, D: int, cap: int) -> None:
        self.k = np.zeros((cap, n_kv, D), np.float32)
        self.v = np.zeros((cap, n_kv, D), np.float32)
        self.k2 = np.zeros_like(self.k)
        self.k3 = np.zeros_like(self.k)
        self.vq = np.zeros_like(self.v)
        self.vh = np.zeros_like(self.v)  # v_h2o's served values of the chosen tokens (exact or v_h2o_bits)
        self.vy = np.zeros_like(self.v)  # v_age's young values (one bit wider)
        self.ks = np.zeros_like(self.k)  # k_h2o's served sealed keys (the chosen tokens' included)
        self.recv = np.zeros((cap, n_kv), np.float64)  # attention received so far, summed over query rows
        self.chosen = np.zeros((cap, n_kv), bool)  # v_h2o's tokens
        self.n_chosen = [0] * n_kv  # per KV head, groups whose tokens are chosen (or whose seal is decided)
        self.gset: list[dict[int, float]] = [{} for _ in range(n_kv)]  # kg_attn: per KV head, wide group -> mass
        self.gmass = np.zeros((cap // G + 1, n_kv))  # kg_attn: the probe queries' attention to each group
        self.n = 0  # positions stored
        self.n_groups = 0  # groups quantized
        self.q: np.ndarray | None = None
        self.pending: dict[str, tuple[np.ndarray, bool]] = {}  # this ubatch's Q/K/V: (array, from a view)


class ServedAttention:
    """cb_eval: records Qcur/Kcur/Vcur of the served layers, rewrites kqv_out."""

    def __init__(self, served: list[int], n_head: int, n_kv: int, D: int, scale: float, cap: int) -> None:
        self.served = set(served)
        self.n_head, self.n_kv, self.D, self.scale, self.cap = n_head, n_kv, D, scale, cap
        self.names = {f"{x}-{il}".encode(): (x, il) for il in served for x in ("Qcur", "Kcur", "Vcur", "kqv_out")}
        self.scheme: Scheme | None = Scheme(exact=True)
        self.layers: dict[int, _Layer] = {}
        self.compare_only = False
        self.diffs: list[tuple[float, float]] = []
        self.error: BaseException | None = None
        self.c2 = OttConfig(k_bits=2, outlier_num=0)
        self.c3 = OttConfig(k_bits=3, outlier_num=0)
        self.cv = {b: OttConfig(bits=b) for b in (2, 3, 4)}
        self.rng = np.random.default_rng(0)

    def reset(self, scheme: Scheme | None) -> None:
        """scheme None: llama.cpp's own attention, untouched (the harness's check)."""
        self.scheme, self.layers, self.error = scheme, {}, None
        self.rng = np.random.default_rng(0)  # rd_values' noise: the same draws in every run of a scheme

    def __call__(self, t: int, ask: bool, _user_data: Any) -> bool:
        try:
            tt = GgmlTensor.from_address(t)
            hit = self.names.get(tt.name)
            if hit is None or tt.type != _F32 or self.scheme is None:
                return not ask
            x, il = hit
            heads = self.n_head if x in ("Qcur", "kqv_out") else self.n_kv
            shape = (self.D * heads, int(tt.ne[1])) if x == "kqv_out" else (self.D, heads)
            if (int(tt.ne[0]), int(tt.ne[1])) != shape or not _contiguous(tt):
                return not ask  # another node of that name (the 2-d projection before its reshape)
            if ask:
                return True
            lay = self.layers.setdefault(il, _Layer(self.n_kv, self.D, self.cap))
            if x == "kqv_out":
                q, k, v = (lay.pending.pop(y, (None, False))[0] for y in ("Qcur", "Kcur", "Vcur"))
                if q is None or k is None or v is None:
                    raise RuntimeError(f"layer {il}: kqv_out before this ubatch's Q, K and V")
                n = len(k)
                lay.k[lay.n : lay.n + n] = k.astype(np.float16).astype(np.float32)
                lay.v[lay.n : lay.n + n] = v.astype(np.float16).astype(np.float32)
                lay.n += n
                lay.q = q
                self._seal(lay)
                if self.scheme.kg_attn and not self.scheme.exact:
                    self._attend_groups(lay, tt)
                elif self.scheme.k_h2o and not self.scheme.exact:
                    self._attend_chosen(lay, tt)
                else:
                    self._attend(lay, tt)
                return True
            n = int(tt.ne[2])
            a = np.ctypeslib.as_array((ctypes.c_float * (self.D * heads * n)).from_address(tt.data))
            # the same name marks a reshape (a view) and then the op after it (RoPE): the later node wins, but a
            # view never replaces a computed tensor (study.capture's rule)
            if not (tt.view_src and x in lay.pending and not lay.pending[x][1]):
                lay.pending[x] = (a.reshape(n, heads, self.D).copy(), bool(tt.view_src))
            return True
        except BaseException as e:  # noqa: BLE001 - reported after llama_decode returns
            self.error = e
            return False

    def _seal(self, lay: _Layer) -> None:
        """Quantize every group completed since the last call (the served widths are chosen per query)."""
        assert self.scheme is not None
        while not self.scheme.exact and (lay.n_groups + 1) * G <= lay.n:
            g0, g1 = lay.n_groups * G, (lay.n_groups + 1) * G
            sc = self.scheme
            for h in range(self.n_kv):  # only what the scheme serves (the reference's quantizers are slow)
                k16 = lay.k[g0:g1, h].astype(np.float16)
                if sc.k_h2o:
                    pass  # keys are quantized when the group's tokens are chosen (_choose_keys)
                elif sc.age or sc.narrowed or sc.kg_attn:
                    lay.k3[g0:g1, h] = _quantize_keys_with(k16, self.c3, None)
                if not sc.k_h2o:
                    src = lay.k3[g0:g1, h].astype(np.float16) if sc.narrowed else k16
                    lay.k2[g0:g1, h] = _quantize_keys_with(src, self.c2, None)
                if sc.values and sc.v_rd:
                    lay.vq[g0:g1, h] = rd_values(lay.v[g0:g1, h], sc.v_rd, self.rng)
                elif sc.values:
                    lay.vq[g0:g1, h] = quantize_values(lay.v[g0:g1, h], self.cv[sc.v_bits])[3]
                    if sc.v_age:
                        lay.vy[g0:g1, h] = quantize_values(lay.v[g0:g1, h], self.cv[sc.v_bits + 1])[3]
                    if (sc.v_h2o or sc.k_h2o) and sc.v_h2o_bits not in (16, sc.v_bits):  # exact ones: lay.v
                        lay.vh[g0:g1, h] = quantize_values(lay.v[g0:g1, h], self.cv[sc.v_h2o_bits])[3]
            lay.n_groups += 1

    def _choose(self, lay: _Layer, h: int, qp: np.ndarray, ptot: np.ndarray) -> None:
        """v_h2o: for each group that seals for a row of this ubatch (its first sealed query at position (g + 1) G
        + R - 1) and has no choice yet, the v_h2o tokens with the most attention received from queries before that
        position (earlier ubatches' rows in recv, this one's rows below it); then recv takes this ubatch's rows."""
        sc = self.scheme
        assert sc is not None
        p1 = ptot.shape[1]
        g = lay.n_chosen[h]
        while (g + 1) * G + sc.R - 1 <= qp[-1]:
            sp, g0, g1 = (g + 1) * G + sc.R - 1, g * G, (g + 1) * G
            got = lay.recv[g0:g1, h] + ptot[qp < sp, g0:g1].sum(0)
            if sc.v_h2o_mean:  # queries at positions j..sp-1 saw token j
                got = got / (sp - np.arange(g0, g1))
            if g == 0:
                got[0] = -np.inf  # BOS is served exactly already
            top = np.argsort(-got, kind="stable")[: sc.v_h2o]
            if sc.v_h2o_random:
                top = np.random.default_rng(g * 1000 + h).choice(np.arange(1 if g == 0 else 0, G), sc.v_h2o, False)
            lay.chosen[g0 + top, h] = True
            g += 1
        lay.n_chosen[h] = g
        lay.recv[:p1, h] += ptot.sum(0)

    def _choose_keys(self, lay: _Layer, h: int, g: int) -> None:
        """k_h2o: choose group g's tokens (lay.recv holds the attention of every query before its seal) and quantize
        its keys: the chosen tokens' slots written with the others' mean (k_ph), then served exact or token-wise."""
        sc = self.scheme
        assert sc is not None and not sc.narrowed
        g0, g1, sp = g * G, (g + 1) * G, (g + 1) * G + sc.R - 1
        k16 = lay.k[g0:g1, h].astype(np.float16)
        lo = 1 if g == 0 else 0  # BOS is served exactly already
        if sc.k_choose == "attn":
            got = lay.recv[g0:g1, h].copy()
            if sc.v_h2o_mean:  # queries at positions j..sp-1 saw token j
                got = got / (sp - np.arange(g0, g1))
            top = lo + np.argsort(-got[lo:], kind="stable")[: sc.k_h2o]
        elif sc.k_choose == "l1":  # OTT's criterion: the smallest key magnitudes (ties to the earlier position)
            top = lo + np.argsort(l1_scores(k16[lo:]), kind="stable")[: sc.k_h2o]
        elif sc.k_choose == "random":
            top = np.random.default_rng(g * 1000 + h).choice(np.arange(lo, G), sc.k_h2o, False)
        else:
            raise ValueError(f"k_choose {sc.k_choose!r}")
        lay.chosen[g0 + top, h] = True
        if sc.k_ph:
            rows = np.ones(G, bool)
            rows[top] = False
            k16[top] = group_mean(k16, rows)
        lay.ks[g0:g1, h] = _quantize_keys_with(k16, self.c3 if sc.age else self.c2, None)
        kx = lay.k[g0 + top, h]
        lay.ks[g0 + top, h] = kx if sc.k_h2o_bits == 16 else _tokenwise(kx, sc.k_h2o_bits)

    def _segments(self, lay: _Layer, h: int, qp: np.ndarray) -> list[tuple[int, int, int | None, int]]:
        """This ubatch's rows (positions qp) of KV head h split at the seals in it (a group's first sealed query at
        (g + 1) G + R - 1; every row before it saw the group exact): (r0, r1, the group whose seal ends the segment
        or None for the last one, the next group to seal for the segment's rows). Advances lay.n_chosen[h]."""
        sc = self.scheme
        assert sc is not None
        out: list[tuple[int, int, int | None, int]] = []
        r0, g = 0, lay.n_chosen[h]
        while (g + 1) * G + sc.R - 1 <= qp[-1]:
            r1 = (g + 1) * G + sc.R - 1 - int(qp[0])
            assert r1 >= r0, (r1, r0)
            out.append((r0, r1, g, g))
            r0, g = r1, g + 1
        out.append((r0, len(qp), None, g))
        lay.n_chosen[h] = g
        return out

    def _probe_rows(self, qp: np.ndarray, g: int, probe: int) -> np.ndarray:
        """Which of the rows at positions qp are among the `probe` queries just before group g's seal."""
        assert self.scheme is not None
        sp = (g + 1) * G + self.scheme.R - 1
        return (qp >= sp - probe) & (qp < sp)

    def _attend_chosen(self, lay: _Layer, tt: GgmlTensor) -> None:
        """_attend for k_h2o, causal within the ubatch: its rows in segments split at the seal positions of the
        groups that seal in it; after each segment the attention it gave joins recv, and the group whose seal ends
        the segment is chosen and quantized before any later row reads it."""
        q = lay.q
        sc = self.scheme
        assert q is not None and sc is not None
        n = q.shape[0]
        assert int(tt.ne[1]) == n, (tt.ne[1], n)
        p1 = lay.n
        qp = np.arange(p1 - n, p1)
        cols = np.arange(p1)[None, :]
        rep = self.n_head // self.n_kv
        out = np.empty((n, self.n_head, self.D), np.float32)
        for h in range(self.n_kv):
            kx, vx, vq = lay.k[:p1, h], lay.v[:p1, h], lay.vq[:p1, h]
            vc = vx if sc.v_h2o_bits == 16 else vq if sc.v_h2o_bits == sc.v_bits else lay.vh[:p1, h]
            for r0, r1, gc, gp in self._segments(lay, h, qp):
                if r1 > r0:
                    qr = qp[r0:r1, None]
                    sealed = _sealed(qr, cols, sc.R)
                    ch = sealed & lay.chosen[:p1, h][None, :]
                    psum = np.zeros((r1 - r0, p1))
                    for r in range(rep):
                        qh = q[r0:r1, h * rep + r].astype(np.float16).astype(np.float32)
                        s = np.where(sealed, qh @ lay.ks[:p1, h].T, qh @ kx.T) * self.scale
                        p = _causal_softmax(s, cols, qr)
                        psum += p
                        o = (p * (sealed & ~ch)) @ vq + (p * ch) @ vc + (p * ~sealed) @ vx
                        out[r0:r1, h * rep + r] = o
                    if sc.probe:  # only the probe rows of the next group to seal count, only for its tokens
                        w = self._probe_rows(qp[r0:r1], gp, sc.probe)
                        if w.any() and (gp + 1) * G <= p1:  # the group is complete
                            lay.recv[gp * G : (gp + 1) * G, h] += psum[w, gp * G : (gp + 1) * G].sum(0)
                    else:
                        lay.recv[:p1, h] += psum.sum(0)
                if gc is not None:
                    self._choose_keys(lay, h, gc)
        dst = np.ctypeslib.as_array((ctypes.c_float * (self.D * self.n_head * n)).from_address(tt.data))
        dst[:] = out.reshape(-1)

    def _attend_groups(self, lay: _Layer, tt: GgmlTensor) -> None:
        """_attend for kg_attn, in segments split at the seals in the ubatch as _attend_chosen: each segment reads
        the 3-bit keys of the groups in its KV head's set as it stands; the probe rows' attention to the next group
        to seal is summed, and at its seal the group enters the set or not."""
        q = lay.q
        sc = self.scheme
        assert q is not None and sc is not None and not sc.narrowed
        n = q.shape[0]
        p1 = lay.n
        qp = np.arange(p1 - n, p1)
        cols = np.arange(p1)[None, :]
        rep = self.n_head // self.n_kv
        out = np.empty((n, self.n_head, self.D), np.float32)
        for h in range(self.n_kv):
            kx, vx, vq = lay.k[:p1, h], lay.v[:p1, h], lay.vq[:p1, h]
            gset = lay.gset[h]
            for r0, r1, gc, gp in self._segments(lay, h, qp):
                if r1 > r0:
                    qr = qp[r0:r1, None]
                    sealed = _sealed(qr, cols, sc.R)
                    wide = np.zeros(p1, bool)
                    for gw in gset:
                        wide[gw * G : (gw + 1) * G] = True
                    psum = np.zeros((r1 - r0, p1))
                    for r in range(rep):
                        qh = q[r0:r1, h * rep + r].astype(np.float16).astype(np.float32)
                        s2 = qh @ lay.k2[:p1, h].T
                        s3 = qh @ lay.k3[:p1, h].T
                        s = np.where(sealed, np.where(wide[None, :], s3, s2), qh @ kx.T) * self.scale
                        p = _causal_softmax(s, cols, qr)
                        psum += p
                        out[r0:r1, h * rep + r] = (p * sealed) @ vq + (p * ~sealed) @ vx
                    w = self._probe_rows(qp[r0:r1], gp, PROBE)
                    if w.any() and (gp + 1) * G <= p1:  # the group is complete
                        lay.gmass[gp, h] += psum[w, gp * G : (gp + 1) * G].sum()
                if gc is not None:
                    m = float(lay.gmass[gc, h])
                    if len(gset) < sc.kg_attn:
                        gset[gc] = m
                    else:
                        low = min(gset, key=lambda x: (gset[x], x))  # the smallest mass, the oldest on a tie
                        if m > gset[low]:
                            del gset[low]
                            gset[gc] = m
        dst = np.ctypeslib.as_array((ctypes.c_float * (self.D * self.n_head * n)).from_address(tt.data))
        dst[:] = out.reshape(-1)

    def _attend(self, lay: _Layer, tt: GgmlTensor) -> None:
        q = lay.q
        assert q is not None
        n = q.shape[0]
        assert int(tt.ne[1]) == n, (tt.ne[1], n)
        p1 = lay.n  # positions so far, this ubatch's included
        qp = np.arange(p1 - n, p1)
        sc = self.scheme
        assert sc is not None
        cols = np.arange(p1)[None, :]
        n_sealed = np.maximum(0, (qp + 1 - sc.R) // G)
        sealed = (cols < (n_sealed * G)[:, None]) & (cols > 0) & (not sc.exact)
        young = cols >= (np.maximum(0, n_sealed - sc.age) * G)[:, None]
        vyoung = sealed & (cols >= (np.maximum(0, n_sealed - sc.v_age) * G)[:, None]) if sc.v_age else None
        rep = self.n_head // self.n_kv
        out = np.empty((n, self.n_head, self.D), np.float32)
        vals = sc.values and not sc.exact
        for h in range(self.n_kv):
            kx, vx = lay.k[:p1, h], lay.v[:p1, h]
            ps = []
            for r in range(rep):
                qh = q[:, h * rep + r].astype(np.float16).astype(np.float32)  # as llama.cpp rounds Q for f16 K
                s = qh @ kx.T * self.scale
                if not sc.exact:
                    s2 = qh @ lay.k2[:p1, h].T * self.scale
                    s3 = qh @ lay.k3[:p1, h].T * self.scale if sc.age else s2
                    s = np.where(sealed, np.where(young, s3, s2), s)
                ps.append(_causal_softmax(s, cols, qp[:, None]))
            if sc.v_h2o and vals:
                self._choose(lay, h, qp, sum(ps))
            for r, p in enumerate(ps):
                if vals:
                    ps_ = p * sealed
                    if sc.v_h2o:  # the chosen tokens' values served from vh
                        ch = lay.chosen[:p1, h][None, :] & sealed
                        vh = vx if sc.v_h2o_bits == 16 else lay.vh[:p1, h]
                        o = (ps_ * ~ch) @ lay.vq[:p1, h] + (p * ch) @ vh + (p * ~sealed) @ vx
                    elif vyoung is not None:
                        o = (ps_ * ~vyoung) @ lay.vq[:p1, h] + (p * vyoung) @ lay.vy[:p1, h] + (p * ~sealed) @ vx
                    else:
                        o = ps_ @ lay.vq[:p1, h] + (p * ~sealed) @ vx
                    if sc.v_top:  # oracle: the row's most attended sealed tokens exact
                        idx = np.argpartition(-ps_, sc.v_top - 1, axis=1)[:, : sc.v_top]
                        pw = np.take_along_axis(ps_, idx, 1)
                        o += np.einsum("nm,nmd->nd", pw, vx[idx] - lay.vq[:p1, h][idx])
                else:
                    o = p @ vx
                out[:, h * rep + r] = o
        dst = np.ctypeslib.as_array((ctypes.c_float * (self.D * self.n_head * n)).from_address(tt.data))
        if self.compare_only:  # the harness's check: numpy's exact attention against llama.cpp's, not written
            self.diffs.append((float(np.sum((dst - out.reshape(-1)) ** 2)), float(np.sum(dst.astype(np.float64) ** 2))))
            return
        dst[:] = out.reshape(-1)


def _tokenwise(x: np.ndarray, bits: int) -> np.ndarray:
    """Rows of x (n, D) quantized asymmetrically per row at `bits` (fp16 scale and min), dequantized."""
    mn = x.min(1, keepdims=True).astype(np.float16).astype(np.float32)
    d = ((x.max(1, keepdims=True) - mn) / ((1 << bits) - 1)).astype(np.float16).astype(np.float32)
    c = np.clip(np.round((x - mn) / np.where(d > 0, d, 1)), 0, (1 << bits) - 1)
    return (c * d + mn).astype(np.float32)


def measure(
    name: str,
    n_ctx: int,
    chunks: int,
    schemes: list[str],
    threads: int,
    fa: bool = True,
    check: bool = False,
    own: bool = True,
) -> dict[str, tuple[float, float]]:
    """{scheme: (mean KLD vs the exact scheme, top-1 %)} over the second halves of `chunks` chunks of n_ctx.
    check: first one pass that computes numpy's exact attention beside llama.cpp's without writing it, and prints
    their relative squared difference per layer and ubatch. own: also llama.cpp's own attention as a row (the
    floor of the comparison: fp16 rounding in llama.cpp's kernels)."""
    lc = llama_cpp_module().llama_cpp
    _ggml()
    path = models.fetch(name, quiet=True)
    lc.llama_backend_init()
    llm = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if not llm:
        raise RuntimeError(f"llama.cpp could not load {path}")
    ctx = batch = None
    try:
        n_layer, n_kv, n_head = (lc.llama_model_n_layer(llm), lc.llama_model_n_head_kv(llm),
                                 lc.llama_model_n_head(llm))  # fmt: skip
        n_embd = lc.llama_model_n_embd(llm)
        arch = "gemma3" if "gemma" in name else "llama"
        D = int(_meta_str(lc, llm, f"{arch}.attention.key_length") or n_embd // n_head)
        swa, _ = _swa_layers(lc, llm, arch, n_layer, max(0, lc.llama_model_n_swa(llm)))
        served = [il for il in range(n_layer) if il not in set(swa)]
        scale = _attn_scale(lc, llm, arch, n_layer, n_embd, n_head, D)
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm))
        toks = _tokenize(lc, llm, corpus.docs_text(), n_ctx * chunks, True)
        hook = ServedAttention(served, n_head, n_kv, D, scale, n_ctx)
        cb = lc.ggml_backend_sched_eval_callback(hook)
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = n_ctx
        cp.n_ubatch, cp.n_seq_max = 512, 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k = cp.type_v = 1  # f16
        cp.cb_eval, cp.cb_eval_user_data = cb, None
        ctx = lc.llama_init_from_model(llm, cp)
        batch = lc.llama_batch_init(n_ctx, 0, 1)
        first = n_ctx // 2

        def run(c: int, scheme: Scheme | None, compare: bool = False) -> np.ndarray:
            hook.reset(scheme)
            hook.compare_only, hook.diffs = compare, []
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            chunk = [toks[0], *toks[c * n_ctx + 1 : (c + 1) * n_ctx]]  # BOS first, as llama-perplexity
            batch.n_tokens = n_ctx
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = tok, i, 1, 0
                batch.logits[i] = first - 1 <= i < n_ctx - 1
            rc = lc.llama_decode(ctx, batch)
            if hook.error is not None:
                raise RuntimeError("eval callback failed") from hook.error
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            if scheme is not None and (any(lay.n != n_ctx for lay in hook.layers.values())
                                       or len(hook.layers) != len(served)):  # fmt: skip
                raise RuntimeError("the callback did not see every served layer's tokens")
            # float32 logits, compared in blocks of rows (kl_divergence): Gemma 3's 262k-token vocabulary over 4096
            # scored positions is 4.3 GB a copy, and float64 log-softmaxes of two of them did not fit in 23 GiB
            return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n_ctx - first, vocab)).copy()

        got: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {s: [] for s in schemes}
        if check:
            run(0, SCHEMES["exact"], compare=True)
            rel = np.array([e / n for e, n in hook.diffs])
            print(f"{name} check: numpy's exact attention against llama.cpp's over {len(rel)} (layer, ubatch) "
                  f"outputs: relative squared difference median {np.median(rel):.2e}, max {rel.max():.2e}",
                  file=sys.stderr, flush=True)  # fmt: skip
        for c in range(chunks):
            t0 = time.time()
            base = run(c, SCHEMES["exact"])
            if own:  # numpy's exact attention against llama.cpp's own, through the model
                lo = run(c, None)
                got.setdefault("llama.cpp's own attention (check)", []).append(
                    (kl_divergence(base, lo), base.argmax(1) == lo.argmax(1))
                )
                del lo
            print(f"{name} chunk {c} exact: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            for s in schemes:
                t0 = time.time()
                lp = run(c, SCHEMES[s])
                got[s].append((kl_divergence(base, lp), base.argmax(1) == lp.argmax(1)))
                del lp
                print(f"{name} chunk {c} {s}: KLD {got[s][-1][0].mean():.5f} ({time.time() - t0:.0f} s)",
                      file=sys.stderr, flush=True)  # fmt: skip
        out = {}
        for s, rs in got.items():
            kld, top = np.concatenate([r[0] for r in rs]), np.concatenate([r[1] for r in rs])
            out[s] = (float(kld.mean()), 100 * float(top.mean()))
        return out
    finally:
        if batch is not None:
            lc.llama_batch_free(batch)
        if ctx:
            lc.llama_free(ctx)
        lc.llama_model_free(llm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--schemes", default="ott2,age4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-fa", action="store_true", help="llama.cpp's attention without flash attention")
    ap.add_argument("--check", action="store_true", help="first compare numpy's exact attention with llama.cpp's")
    a = ap.parse_args(argv)
    schemes = [s for s in a.schemes.split(",") if s]
    if bad := [s for s in schemes if s not in SCHEMES]:
        ap.error(f"unknown schemes {bad}; known: {', '.join(SCHEMES)}")
    t0 = time.time()
    res = measure(a.model, a.n_ctx, a.chunks, schemes, a.threads, not a.no_fa, a.check)
    print(f"## {a.model}, {a.chunks} chunk(s) of {a.n_ctx} tokens ({time.time() - t0:.0f} s)\n")
    print("| scheme | mean KLD vs exact keys | top-1 % |\n|---|---|---|")
    for s, (k, t) in res.items():
        print(f"| {s} | {k:.5f} | {t:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
