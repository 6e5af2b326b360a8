"""The NEON kernels, cross-compiled for aarch64 and run under qemu-user, against the numpy quantizer."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from native_kernels import PoolArrays, SealResult

from ott_gguf import quantizer as Q
from ott_gguf import reference as ref

from helpers import ROOT, check_attention, k_mix_of, keys_values, lockstep, make_inputs, require_tool

CONFIGS = [(2, 32), (2, 64), (2, 128), (3, 64), (4, 64)]
# (K bits, V bits, G, Gv, K widths per channel, symmetric V blocks): the generator's default head configs
# (`kernels --arch aarch64`, which the driver is built from; test_driver_has_the_generated_heads checks the two agree)
HEADS = [(2, 2, 128, 64, False, False), (2, 2, 64, 32, False, False), (2, 2, 32, 32, False, False),
         (3, 3, 128, 64, False, False), (4, 4, 128, 64, False, False), (3, 2, 128, 64, False, False),
         (2, 3, 128, 64, False, False), (4, 2, 128, 64, False, False), (3, 2, 128, 64, True, False),
         (3, 4, 64, 32, True, False), (2, 2, 128, 64, False, True), (3, 2, 128, 64, True, True),
         (2, 2, 64, 32, False, True), (2, 2, 128, 64, True, False), (2, 4, 64, 32, True, False),
         (2, 2, 128, 64, True, True)]  # fmt: skip
# V stored rotated (qemu is slow: a few configs): a per-side width pair, and one with Gv below the rotation block
# whose test also plants a unit that falls back to unrotated; the symmetric V heads (v_sym), every one, run rotated
# only (the cache refuses v_sym without v_rotate), the Gv 32 one with the fallback unit (a full-range symmetric block)
VROT_HEADS = [(3, 2, 128, 64, False, False), (2, 2, 64, 32, False, False), (2, 2, 128, 64, False, True),
              (3, 2, 128, 64, True, True), (2, 2, 64, 32, False, True), (2, 2, 128, 64, True, True)]  # fmt: skip
# the symmetric block formats the v_sym heads bring (GROUP, CLIP: sixty-fourths of max|x|): rotated units clipped,
# the unrotated fallback full range (gen/generate.py HeadConfig.vr and .v; quantizer.V_SYM_CLIP64)
SYM_CONFIGS = sorted({(h[1], h[3], c) for h in HEADS if h[5] for c in (Q.V_SYM_CLIP64[(h[1], h[3])], Q.CLIP_ONE)})


def _hid(h: tuple[int, int, int, int, bool, bool]) -> str:
    return f"k{h[0]}{'m' if h[4] else ''}v{h[1]}{'s' if h[5] else ''}g{h[2]}x{h[3]}"


HEAD_CASES = [pytest.param(*h, False, id=_hid(h)) for h in HEADS if not h[5]] + [
    pytest.param(*h, True, id=_hid(h) + "-vrot") for h in VROT_HEADS
]
CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("neon") / "gen"


@pytest.fixture(scope="module")
def driver(gen_dir: Path) -> Path:
    require_tool(CC, QEMU, hint="apt-get install gcc-aarch64-linux-gnu qemu-user; .ci/run installs them")
    gen = gen_dir
    out = gen.parent
    cfg = ",".join(f"{b}:{g}" for b, g in CONFIGS)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "gen" / "generate.py"),
            "kernels",
            "--arch",
            "aarch64",
            "--configs",
            cfg,
            "--out",
            str(gen),
        ],
        check=True,
    )
    flags = subprocess.run(
        [sys.executable, str(ROOT / "gen" / "generate.py"), "flags", "--isa", "neon"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    exe = out / "ott_kernel_driver"
    srcs = [
        gen / "ott-kernels-scalar.c",
        gen / "ott-kernels-neon.c",
        gen / "ott-kernels-table.c",
        ROOT / "native" / "tests" / "ott_kernel_driver.c",
    ]
    # one flag set for all files: the table and driver are plain C; -ffp-contract=off as in every build
    subprocess.run(
        [
            CC,
            "-O2",
            "-std=c11",
            "-static",
            "-ffp-contract=off",
            *flags,
            "-I",
            str(gen),
            "-I",
            str(ROOT / "native" / "kernels"),
            *map(str, srcs),
            "-lm",
            "-o",
            str(exe),
        ],
        check=True,
    )
    return exe


def run(driver: Path, bits: int, group: int, isa: str, op: str, data: bytes, tmp: Path, clip: int = Q.CLIP_ONE,
        sym: bool = False) -> bytes:  # fmt: skip
    src, dst = tmp / f"{op}.in", tmp / f"{op}.out"
    src.write_bytes(data)
    b = f"{bits}{'s' if sym else ''}"
    g = f"{group}" + (f"c{clip}" if clip != Q.CLIP_ONE else "")
    subprocess.run([QEMU, "-cpu", "max", str(driver), b, g, isa, op, str(src), str(dst)], check=True, timeout=120)
    return dst.read_bytes()


@pytest.mark.parametrize("isa", ["neon", "scalar"])
@pytest.mark.parametrize("bits,group", CONFIGS)
def test_aarch64_kernels_match_numpy(driver: Path, bits: int, group: int, isa: str, tmp_path: Path) -> None:
    fmt = Q.BlockFormat(bits, group)
    x = make_inputs(np.random.default_rng(bits * 31 + group), group)
    want = Q.pack(Q.quantize(x, fmt), fmt)
    got = np.frombuffer(run(driver, bits, group, isa, "quantize", x.tobytes(), tmp_path), dtype=np.uint8)
    np.testing.assert_array_equal(got.reshape(want.shape), want)

    recon = Q.dequantize(Q.unpack(want, fmt)).reshape(-1)
    got_f = np.frombuffer(run(driver, bits, group, isa, "dequantize", want.tobytes(), tmp_path), dtype=np.float32)
    np.testing.assert_array_equal(got_f.view(np.uint32), recon.view(np.uint32))

    y = np.random.default_rng(1).standard_normal(x.size).astype(np.float32)
    q8 = Q.quantize_q8_1(y)
    payload = np.int64(x.size).tobytes() + want.tobytes() + q8.tobytes()
    got_dot = float(np.frombuffer(run(driver, bits, group, isa, "vec_dot", payload, tmp_path), dtype=np.float32)[0])
    want_dot, mag = Q.vec_dot_q8_1(want, q8, fmt)
    assert abs(got_dot - want_dot) <= 1e-5 * mag


@pytest.mark.parametrize("isa", ["neon", "scalar"])
@pytest.mark.parametrize("bits,group,clip", SYM_CONFIGS)
def test_aarch64_symmetric_blocks_match_numpy(driver: Path, bits: int, group: int, clip: int, isa: str,
                                              tmp_path: Path) -> None:  # fmt: skip
    """The v_sym heads' symmetric blocks (one scale, no min): quantize bit for bit, dequantize exact, vec_dot
    within fp32 rounding."""
    fmt = Q.BlockFormat(bits, group, clip, sym=True)
    x = make_inputs(np.random.default_rng(bits * 1000 + group + clip + 5), group)
    want = Q.pack(Q.quantize(x, fmt), fmt)
    assert want.shape[1] == 2 + group * bits // 8
    got = np.frombuffer(run(driver, bits, group, isa, "quantize", x.tobytes(), tmp_path, clip, True), np.uint8)
    np.testing.assert_array_equal(got.reshape(want.shape), want)

    recon = Q.dequantize(Q.unpack(want, fmt)).reshape(-1)
    got_f = np.frombuffer(run(driver, bits, group, isa, "dequantize", want.tobytes(), tmp_path, clip, True), np.float32)
    np.testing.assert_array_equal(got_f.view(np.uint32), recon.view(np.uint32))

    y = np.random.default_rng(1).standard_normal(x.size).astype(np.float32)
    q8 = Q.quantize_q8_1(y)
    payload = np.int64(x.size).tobytes() + want.tobytes() + q8.tobytes()
    out = run(driver, bits, group, isa, "vec_dot", payload, tmp_path, clip, True)
    want_dot, mag = Q.vec_dot_q8_1(want, q8, fmt)
    assert abs(float(np.frombuffer(out, np.float32)[0]) - want_dot) <= 1e-5 * mag + 1e-6


def test_driver_has_the_generated_heads(driver: Path, gen_dir: Path) -> None:
    """HEADS is what the generator renders for aarch64 by default (the head table the driver was built with)."""
    line = (gen_dir / "ott-kernels-table.c").read_text().splitlines()[0]
    m = re.search(r"heads=([^)]*)\)", line)
    assert m, line
    got = []
    for b, g, gv in (s.split(":") for s in m.group(1).split(",")):
        kb, _, vb = b.partition("/")
        vb = vb or kb.removesuffix("m")
        got.append((int(kb.removesuffix("m")), int(vb.removesuffix("s")), int(g), int(gv), kb.endswith("m"),
                    vb.endswith("s")))  # fmt: skip
    assert got == HEADS


class QemuHead:
    """The per-head kernels of the aarch64 driver, run under qemu-user, behind the cffi kernels' interface
    (native_kernels.HeadKernelSet); vrot: V stored rotated."""

    def __init__(self, driver: Path, kbits: int, vbits: int, G: int, Gv: int, isa: str, tmp: Path,
                 vrot: bool = False, kmix: bool = False, vsym: bool = False) -> None:  # fmt: skip
        self.driver, self.tmp = driver, tmp
        self.args = [f"{kbits}{'m' if kmix else ''}", f"{vbits}{'s' if vsym else ''}", str(G), str(Gv), isa,
                     str(int(vrot))]  # fmt: skip
        self.kbits, self.vbits, self.G, self.Gv, self.isa, self.vrot = kbits, vbits, G, Gv, isa, vrot
        self.kmix, self.vsym = kmix, vsym
        self.vint = 0  # the integer V pass is x86's only (ott_isa.j2 OTT_VINT, OTT_VINT16)
        self.k_block_bytes = Q.BlockFormat(kbits, G).block_bytes
        self.v_block_bytes = Q.BlockFormat(vbits, Gv, sym=vsym).block_bytes

    def _run(self, op: str, payload: bytes) -> bytes:
        src, dst = self.tmp / f"head-{op}.in", self.tmp / f"head-{op}.out"
        src.write_bytes(payload)
        subprocess.run([QEMU, "-cpu", "max", str(self.driver), "head", *self.args, op, str(src), str(dst)],
                       check=True, timeout=120)  # fmt: skip
        return dst.read_bytes()

    @staticmethod
    def _meta(p: PoolArrays) -> bytes:
        m = np.zeros(len(p.pos), dtype=[("pos", "<i4"), ("score", "<f4")])
        m["pos"], m["score"] = p.pos, p.score
        return m.tobytes()

    def seal(self, gk: np.ndarray, gv: np.ndarray, pos0: int, outlier_num: int, aux_cap: int, pool: PoolArrays,
             aux: PoolArrays, tracing: bool) -> SealResult:  # fmt: skip
        D = gk.shape[1]
        head = np.array([D, pos0, outlier_num, aux_cap, len(pool.pos), len(aux.pos), int(tracing), 0], np.int32)
        payload = b"".join([
            head.tobytes(), np.asarray(gk, np.float16).tobytes(), np.asarray(gv, np.float16).tobytes(),
            self._meta(pool), np.asarray(pool.k, np.float16).tobytes(), np.asarray(pool.v, np.float16).tobytes(),
            self._meta(aux), np.asarray(aux.k, np.float16).tobytes(), np.asarray(aux.v, np.float16).tobytes(),
        ])  # fmt: skip
        out = self._run("seal", payload)
        n_won, n_pool, n_aux, tr = np.frombuffer(out[:16], np.int32)
        off = 16
        kq_n = D * self.k_block_bytes + (D // 4 if self.kmix else 0)
        vq_n = self.G * (D // self.Gv) * self.v_block_bytes
        kq = np.frombuffer(out[off : off + kq_n], np.uint8)
        off += kq_n
        vq = np.frombuffer(out[off : off + vq_n], np.uint8).reshape(-1, self.v_block_bytes)
        off += vq_n

        def pool_at(n: int) -> PoolArrays:
            nonlocal off
            m = np.frombuffer(out[off : off + 8 * n], dtype=[("pos", "<i4"), ("score", "<f4")])
            off += 8 * n
            k = np.frombuffer(out[off : off + 2 * n * D], np.float16).reshape(n, D)
            off += 2 * n * D
            v = np.frombuffer(out[off : off + 2 * n * D], np.float16).reshape(n, D)
            off += 2 * n * D
            return PoolArrays(m["pos"].astype(np.int32), m["score"].astype(np.float32), k, v)

        p, a = pool_at(int(n_pool)), pool_at(int(n_aux))
        return SealResult(kq, vq, p, a, bool(tr), int(n_won))

    def attn(self, q: np.ndarray, q_pos: int, scale: float, kq: np.ndarray, vq: np.ndarray, n_sealed: int,
             pooled_pos: np.ndarray, pooled_k: np.ndarray, pooled_v: np.ndarray, tail_pos0: int,
             tail_k: np.ndarray, tail_v: np.ndarray) -> np.ndarray:  # fmt: skip
        D = q.size
        head = np.array([D, q_pos, n_sealed, len(pooled_pos), len(tail_k), tail_pos0], np.int32)
        payload = b"".join([
            head.tobytes(), np.float32(scale).tobytes(), np.asarray(q, np.float32).tobytes(),
            np.ascontiguousarray(kq, np.uint8).tobytes(), np.ascontiguousarray(vq, np.uint8).tobytes(),
            np.asarray(pooled_pos, np.int32).tobytes(), np.asarray(pooled_k, np.float16).tobytes(),
            np.asarray(pooled_v, np.float16).tobytes(), np.asarray(tail_k, np.float16).tobytes(),
            np.asarray(tail_v, np.float16).tobytes(),
        ])  # fmt: skip
        return np.frombuffer(self._run("attn", payload), np.float32).copy()

    def attn_rows(self, q: np.ndarray, q_pos: np.ndarray, scale: float, kq: np.ndarray, vq: np.ndarray,
                  n_sealed: int, pooled_pos: np.ndarray, pooled_k: np.ndarray, pooled_v: np.ndarray, tail_pos0: int,
                  tail_k: np.ndarray, tail_v: np.ndarray) -> np.ndarray:  # fmt: skip
        n_rows, D = q.shape
        head = np.array([D, n_rows, n_sealed, len(pooled_pos), len(tail_k), tail_pos0], np.int32)
        payload = b"".join([
            head.tobytes(), np.float32(scale).tobytes(), np.asarray(q, np.float32).tobytes(),
            np.asarray(q_pos, np.int32).tobytes(),
            np.ascontiguousarray(kq, np.uint8).tobytes(), np.ascontiguousarray(vq, np.uint8).tobytes(),
            np.asarray(pooled_pos, np.int32).tobytes(), np.asarray(pooled_k, np.float16).tobytes(),
            np.asarray(pooled_v, np.float16).tobytes(), np.asarray(tail_k, np.float16).tobytes(),
            np.asarray(tail_v, np.float16).tobytes(),
        ])  # fmt: skip
        return np.frombuffer(self._run("rows", payload), np.float32).reshape(n_rows, D).copy()


@pytest.mark.parametrize("isa", ["neon", "scalar"])
@pytest.mark.parametrize("kbits,vbits,G,Gv,kmix,vsym,vrot", HEAD_CASES)
def test_aarch64_head_kernels_match_reference(driver: Path, kbits: int, vbits: int, G: int, Gv: int, kmix: bool,
                                              vsym: bool, vrot: bool, isa: str, tmp_path: Path) -> None:  # fmt: skip
    hk = QemuHead(driver, kbits, vbits, G, Gv, isa, tmp_path, vrot, kmix, vsym)
    cfg = ref.OttConfig(k_bits=kbits, v_bits=vbits, G=G, R=32, Gv=Gv, outlier_num=3, aux_cap=4, v_rotate=vrot,
                        k_mix=k_mix_of(kbits, kmix), v_sym=vsym)  # fmt: skip
    assert cfg.k_mixed == kmix
    assert hk.v_block_bytes == cfg.v_format.block_bytes == (2 if vsym else 4) + Gv * vbits // 8
    rng = np.random.default_rng(kbits * 7 + vbits * 3 + G + Gv + 11 * vsym)
    n = 4 * G + 40
    D = 128 if vrot else 64  # rotated: two rotation units per token
    k, v = keys_values(rng, n, D)
    fallback = vrot and Gv < 64
    if fallback:
        v[5, :64] = (
            60000.0  # unit 0 of token 5: rotated, 8 x 60000 does not fit fp16, even clipped, so stored unrotated
        )
    st, nat = lockstep(hk, cfg, 3, k, v, [G + 5, n - G - 5])
    assert st.n_sealed >= 3
    if vrot:  # the scales' sign bits flag rotated units (compared bit for bit by lockstep)
        flags = np.concatenate([np.signbit(g.v_scale) for g in st.groups])  # (n_sealed*G, D/Gv)
        if fallback:
            per_unit = 64 // Gv
            assert not flags[5, :per_unit].any() and flags[5, per_unit:].all()
            flags = np.delete(flags, 5, axis=0)
        assert flags.all()
    check_attention(hk, st, nat, rng)
