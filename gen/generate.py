#!/usr/bin/env python3
"""Render the ott2 kernels from the Jinja templates in gen/templates.

Deterministic: the same templates and parameters give the same bytes. A file is rewritten only when its
content changes (FlashInfer's write_if_different), so the build recompiles only what changed.

Targets:
  ggml     what the ott caches run in the build, for every (K width, V width) pair of the cache types: the
           per-head kernels of ggml-cpu and libllama (ott2-head.{h,c}) and the cache's ops as CUDA, a unit per head
           config (ott2-cuda-<tag>.cu), and as their CPU emulation for the tests (ott2-emu-<tag>.cpp), with their
           header ott2-cuda.h; the ops
           ported to Vulkan as GLSL compute shaders from the same template (ott2-vk-<kernel>.comp, compiled to
           SPIR-V by the build) and their table ott2-vk.h.
  kernels  a stand-alone kernel library for the tests only (never installed): every (bits, group) config for
           every ISA of the architecture, each ISA in its own file so it is compiled with its own flags, plus a
           table.
  cuda     for checks without a GPU: a CUDA translation unit with every block config's device functions
           (ott-cuda-check.cu), and the cache's CUDA ops (ott_cuda_ops.j2) per head config rendered twice:
           as CUDA (ott2-cuda-<tag>.cu, for nvcc and a GPU test) and as C++ that runs the same kernel bodies
           on the CPU (ott2-emu-<tag>.cpp), with their header ott2-cuda.h.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"

# Plane decomposition of a code: 2 -> one 2-bit plane, 3 -> 2-bit + 1-bit, 4 -> one 4-bit plane; 1 -> one 1-bit
# plane (the 1-bit K channels of 2-bit k_mix only: no cache type has 1-bit codes). Each plane packs 8/w codes per
# byte, strided: element j sits in byte j % nbytes at bit w*(j // nbytes), so a vector of nbytes bytes shifted by
# w*k yields nbytes consecutive codes.
PLANES = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,)}
# avx512vnni: the avx512 rendering built with VNNI (dpbusd for the scores, the integer V pass), which the test
# library checks apart from avx512 without it (the fallbacks); a llama build takes whichever -march=native gives
ISAS = {"x86_64": ("scalar", "avx2", "avx512", "avx512vnni"), "aarch64": ("scalar", "neon")}
ISA_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    "neon": ["-march=armv8.2-a+fp16+dotprod"],
}
# The quantizer's clipped ranges in sixty-fourths of a group's range (ott_gguf.quantizer, docs/clipping.md; a
# test checks the two tables agree): keys by width (1 bit: k_mix's narrowest channels of 2-bit keys,
# docs/long-context-keys.md); rotated values by (width, Gv); unrotated values full range.
CLIP_ONE = 64
K_CLIP64 = {1: 16, 2: 48, 3: 58, 4: 64}
# k_mix (docs/k-channel-widths.md, docs/long-context-keys.md): a sealed group of keys of a K_MIX_BITS width gives
# its D/4 channels of largest (max - min)*max(|max|, |min|) one bit more and its D/4 smallest one bit less, each
# width with its own clipped range: 3-bit keys (2/3/4, the default) and 2-bit keys (1/2/3, an option for now)
K_MIX_BITS = (2, 3)
V_ROT_CLIP64 = {
    (2, 32): 47, (3, 32): 58, (4, 32): 63,
    (2, 64): 42, (3, 64): 55, (4, 64): 61,
    (2, 128): 38, (3, 128): 51, (4, 128): 59,
    (2, 256): 35, (3, 256): 48, (4, 256): 57,
}  # fmt: skip
# symmetric rotated values (v_sym), by (width, Gv): sixty-fourths of max|x| (ott_gguf.quantizer.V_SYM_CLIP64)
V_SYM_CLIP64 = {(2, 32): 41, (2, 64): 37, (2, 128): 34, (2, 256): 32}
V_SYM_BITS = 2  # v_sym changes 2-bit values only (at 3 bits the min pays for itself: docs/v-blocks.md)
WIDTHS = (2, 3, 4)  # code widths of the ott cache types (ott2, ott3, ott4), on each side
# vector width in floats per ISA
WIDTH = {"scalar": 1, "avx2": 8, "avx512": 16, "avx512vnni": 16, "neon": 4}
Q8_1_BLOCK = 32  # ggml's QK8_1: the dot product's second operand
# the ott ops' kernels that have a Vulkan rendering (ott_cuda_ops.j2, mode glsl): their storage buffers in binding
# order (name in ott_cu_args, GLSL type, access); native/ggml/ggml-vulkan-ott.cpp binds them in this order
VK_BINDINGS: dict[str, list[tuple[str, str, str]]] = {
    "attn_merge": [("part", "float", "readonly"), ("out", "float", "writeonly")],
    "attn_part": [("q", "float", "readonly"), ("k", "float", "readonly"), ("v", "float", "readonly"),
                  ("ring", "uint16_t", "readonly"), ("sk", "uint8_t", "readonly"), ("sv", "uint8_t", "readonly"),
                  ("pkv", "uint16_t", "readonly"), ("pmeta", "int", "readonly"), ("plan", "int", "readonly"),
                  ("part", "float", "writeonly")],
    # the seal writes the state in place and reads back what other invocations of its workgroup wrote
    "seal": [("k", "float", "readonly"), ("v", "float", "readonly"), ("ring", "uint16_t", "coherent"),
             ("sk", "uint8_t", "coherent"), ("sv", "uint8_t", "coherent"), ("pkv", "uint16_t", "coherent"),
             ("pmeta", "int", "coherent"), ("plan", "int", "readonly"), ("flags", "int", "coherent")],
}  # fmt: skip
# the merge and the seal in one dispatch (CUDA's attn_merge_seal): workgroups [0, n_merge) merge, the rest seal
VK_BINDINGS["attn_merge_seal"] = VK_BINDINGS["attn_merge"] + VK_BINDINGS["seal"]
VK_SHARED_KERNELS = ("attn_merge",)  # read no cache state: one shader for every head config
# the attention partials' instances (ott_cuda_ops.j2 attn_part_vec_kernel): (D at most, CPL channels per lane, RP rows
# per pass, NW warps), the first whose D fits; CUDA's launcher, ott-bench's kernel lookup and the Vulkan pipelines
# (ott_vk.h.j2: their specialization constants, NW and RP smaller where shared memory is short) read this table
VEC = ((64, 2, 4, 16), (128, 4, 4, 8), (256, 8, 2, 4), (512, 16, 1, 4))


@dataclass(frozen=True)
class Plane:
    width: int  # bits per code in this plane
    shift: int  # where this plane's bits sit inside the code
    nbytes: int  # bytes of this plane per block

    @property
    def per_byte(self) -> int:
        return 8 // self.width

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1


@dataclass(frozen=True)
class Config:
    bits: int
    group: int
    clip: int = CLIP_ONE  # sixty-fourths of the group's range the codes span; the block layout does not depend on it
    sym: bool = False  # one fp16 scale, no min: levels (k - nlev/2) d over [-a, a], a = max|x| (ott_arith.j2)

    def __post_init__(self) -> None:
        if self.bits not in PLANES:
            raise ValueError(f"bits must be one of {sorted(PLANES)}, got {self.bits}")
        if self.group % Q8_1_BLOCK != 0 or self.group <= 0 or self.group > 256:
            raise ValueError(f"group must be a multiple of {Q8_1_BLOCK} in [32, 256], got {self.group}")
        if not 1 <= self.clip <= CLIP_ONE:
            raise ValueError(f"clip must be in [1, {CLIP_ONE}] sixty-fourths, got {self.clip}")

    @property
    def tag(self) -> str:
        return f"b{self.bits}{'s' if self.sym else ''}g{self.group}" + (
            f"c{self.clip}" if self.clip != CLIP_ONE else ""
        )

    @property
    def clip_scale(self) -> str:
        """c = clip/64 as an exact C float literal."""
        return f"{self.clip / CLIP_ONE!r}f"

    @property
    def clip_offset(self) -> str:
        """o = (1 - c)/2 as an exact C float literal."""
        return f"{(CLIP_ONE - self.clip) / (2 * CLIP_ONE)!r}f"

    @property
    def nlev(self) -> int:
        return (1 << self.bits) - 1

    @property
    def planes(self) -> tuple[Plane, ...]:
        out, shift = [], 0
        for w in PLANES[self.bits]:
            out.append(Plane(w, shift, self.group * w // 8))
            shift += w
        return tuple(out)

    @property
    def block_bytes(self) -> int:
        return (2 if self.sym else 4) + sum(p.nbytes for p in self.planes)

    @property
    def sym_half(self) -> str:
        """-(nlev/2) as an exact C float literal: a symmetric block's min is this times its scale."""
        return f"{-self.nlev / 2!r}f"


@dataclass(frozen=True)
class HeadConfig:
    """One ott cache config for the per-head kernels: K blocks of G tokens at kbits per code, V blocks of Gv
    channels at vbits per code."""

    kbits: int
    vbits: int
    G: int
    Gv: int
    kmix: bool = False  # K widths per channel (kbits - 1 .. kbits + 1, kbits in K_MIX_BITS), chosen per sealed group
    vsym: bool = False  # symmetric V blocks (one scale, no min), for rotated V_SYM_BITS-bit values

    def __post_init__(self) -> None:
        if self.kbits not in WIDTHS or self.vbits not in WIDTHS:
            raise ValueError(f"K and V bits must be one of {WIDTHS}, got {self.kbits}/{self.vbits}")
        if self.kmix and self.kbits not in K_MIX_BITS:
            raise ValueError(f"mixed K widths need keys of {' or '.join(map(str, K_MIX_BITS))} bits, got {self.kbits}")
        if self.vsym and (self.vbits, self.Gv) not in V_SYM_CLIP64:
            raise ValueError(f"symmetric V blocks need {V_SYM_BITS}-bit values, got {self.vbits}")

    @property
    def k(self) -> Config:
        """K blocks (one channel over G tokens); with kmix the nominal width's format."""
        return Config(self.kbits, self.G, K_CLIP64.get(self.kbits, CLIP_ONE))

    @property
    def k_formats(self) -> tuple[Config, ...]:
        """Every K block format a group can hold: with kmix one per width, in width order."""
        if not self.kmix:
            return (self.k,)
        return tuple(Config(b, self.G, K_CLIP64.get(b, CLIP_ONE)) for b in (self.kbits - 1, self.kbits, self.kbits + 1))

    def k_group_bytes(self, D: int) -> int:
        """Bytes of one head's sealed K group: D channel blocks, plus with kmix the table of D 2-bit widths (the
        quotas make the blocks take exactly D nominal-width blocks)."""
        return D * self.k.block_bytes + (D // 4 if self.kmix else 0)

    @property
    def v(self) -> Config:
        """V blocks stored unrotated (full range; with vsym symmetric too, the units a rotation would overflow)."""
        return Config(self.vbits, self.Gv, sym=self.vsym)

    @property
    def vr(self) -> Config:
        """V blocks of rotated units: the same layout, quantized to their clipped range."""
        if self.vsym:
            return Config(self.vbits, self.Gv, V_SYM_CLIP64[(self.vbits, self.Gv)], sym=True)
        return Config(self.vbits, self.Gv, V_ROT_CLIP64.get((self.vbits, self.Gv), CLIP_ONE))

    @property
    def tag(self) -> str:
        return f"k{self.kbits}{'m' if self.kmix else ''}v{self.vbits}{'s' if self.vsym else ''}g{self.G}x{self.Gv}"

    @property
    def spec(self) -> str:
        return f"{self.kbits}{'m' if self.kmix else ''}/{self.vbits}{'s' if self.vsym else ''}:{self.G}:{self.Gv}"

    @property
    def vplane(self) -> bool:
        """V codes in one plane of 16 bytes per block (2-bit, Gv = 64): ISAs with OTT_VPLANE read them in place,
        and those with OTT_VINT weigh them in integers (ott_head.c.j2)."""
        p = self.v.planes
        return len(p) == 1 and p[0].width == 2 and p[0].nbytes == 16 and self.Gv == 64

    @property
    def int_chunk(self) -> int:
        """Channels whose int8-query x code products an int16 lane can sum without overflow (a power of 2)."""
        n = 2
        nlev = max(c.nlev for c in self.k_formats)
        while 2 * n * nlev * 127 <= 32767:
            n *= 2
        return n


def parse_heads(text: str) -> list[HeadConfig]:
    """'K/V:G:Gv' items (or 'B:G:Gv' for the same width on both sides; K as '3m': mixed widths; V as '2s':
    symmetric blocks), comma-separated."""
    out = []
    for item in text.split(","):
        b, g, gv = item.strip().split(":")
        kb, _, vb = b.partition("/")
        mix = kb.endswith("m")
        kb = kb.removesuffix("m")
        sym = vb.endswith("s")
        vb = vb.removesuffix("s")
        hc = HeadConfig(int(kb), int(vb or kb), int(g), int(gv), mix, sym)
        hc.k, hc.v, hc.vr  # noqa: B018 (validates the block formats)
        out.append(hc)
    return out


def with_head_formats(configs: list[Config], heads: list[HeadConfig]) -> list[Config]:
    """The block configs plus every K and V format the head configs need, each once, in a stable order."""
    out = list(configs)
    for hc in heads:
        for c in (*hc.k_formats, hc.v, hc.vr):
            if c not in out:
                out.append(c)
    return out


def config_spec(c: Config) -> str:
    """'bits:group', or 'bits:group:clip' for a clipped config, bits as '2s' for a symmetric one (what
    parse_configs reads)."""
    return f"{c.bits}{'s' if c.sym else ''}:{c.group}" + (f":{c.clip}" if c.clip != CLIP_ONE else "")


def parse_configs(text: str) -> list[Config]:
    out = []
    for item in text.split(","):
        b, g, *c = item.strip().split(":")
        out.append(Config(int(b.removesuffix("s")), int(g), *(int(x) for x in c), sym=b.endswith("s")))
    return out


def env() -> jinja2.Environment:
    e = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    e.globals.update(WIDTH=WIDTH, Q8_1_BLOCK=Q8_1_BLOCK, VK_BINDINGS=VK_BINDINGS, VEC=VEC)
    return e


GENERATED = b"// Generated by gen/generate.py from "  # how every generated file begins (remove_stale)


def header(template: str, params: str) -> str:
    return f"{GENERATED.decode()}gen/templates/{template} ({params}). Do not edit.\n"


def write_if_different(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def remove_stale(out: Path, keep: set[str]) -> list[Path]:
    """Remove the files an earlier run generated in `out` (they start with header()) that this run did not: a build
    directory kept between builds must never glob or compile a kernel the templates no longer make."""
    stale = []
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.relative_to(out).as_posix() not in keep:
            with path.open("rb") as f:
                if f.read(len(GENERATED)) == GENERATED:
                    path.unlink()
                    stale.append(path)
    return stale


def render(e: jinja2.Environment, template: str, params: str, **kw: object) -> str:
    return header(template, params) + e.get_template(template).render(**kw)


def build_heads(G: int, Gv: int) -> list[HeadConfig]:
    """Every (K width, V width) pair the build's cache types can combine (-ctk ott3 -ctv ott2 and so on), the
    mixed-width keys (k_mix: 3-bit, then 2-bit keys) with every V width, and every K format with symmetric 2-bit
    values (v_sym)."""
    plain = [HeadConfig(kb, vb, G, Gv) for kb in WIDTHS for vb in WIDTHS]
    mixed = [HeadConfig(kb, vb, G, Gv, True) for kb in sorted(K_MIX_BITS, reverse=True) for vb in WIDTHS]
    sym = [HeadConfig(kb, V_SYM_BITS, G, Gv, False, True) for kb in WIDTHS] + [
        HeadConfig(kb, V_SYM_BITS, G, Gv, True, True) for kb in sorted(K_MIX_BITS, reverse=True)
    ]
    return plain + mixed + sym


def heads_param(heads: list[HeadConfig]) -> str:
    return "heads=" + ",".join(h.spec for h in heads)


def render_cuda_ops(e: jinja2.Environment, heads: list[HeadConfig], mode: str) -> str:
    """The CUDA ops of every head config in one translation unit (the prelude is guarded)."""
    return header("ott_cuda_ops.j2", heads_param(heads) + f", mode={mode}") + "".join(
        e.get_template("ott_cuda_ops.j2").render(hc=hc, mode=mode) for hc in heads
    )


def gen_ggml(out: Path, G: int, Gv: int) -> dict[str, str]:
    e = env()
    heads = build_heads(G, Gv)
    ph = heads_param(heads)
    files = {
        "ott2-head.h": render(e, "llama_head.h.j2", ph, heads=heads),
        "ott2-head.c": render(e, "llama_head.c.j2", ph, heads=heads),
        "ott2-cuda.h": render(e, "ott_cuda.h.j2", ph, heads=heads, modes=["cuda", "emu"], table=True),
    }
    # one unit per head config, so that the build compiles them in parallel (the 20 in one unit were the CUDA
    # build's and the test libraries' longest job); the emulation runs the same kernels on the CPU for the test
    # library ott_cuda_emu (native/tests/ott-cuda-emu.cpp)
    for hc in heads:
        files[f"ott2-cuda-{hc.tag}.cu"] = render_cuda_ops(e, [hc], "cuda")
        files[f"ott2-emu-{hc.tag}.cpp"] = render_cuda_ops(e, [hc], "emu")
    shaders = []  # (name, kernel, head config or None): ott2-vk-<name>.comp each
    for k in VK_BINDINGS:
        for hc in [None] if k in VK_SHARED_KERNELS else heads:
            name = k if hc is None else f"{hc.tag}-{k}"
            h = hc or heads[0]
            params = f"mode=glsl, vk_kernel={k}, heads={h.spec}"
            text = e.get_template("ott_cuda_ops.j2").render(hc=h, mode="glsl", vk_kernel=k)
            files[f"ott2-vk-{name}.comp"] = header("ott_cuda_ops.j2", params) + text
            shaders.append((name, k, hc))
    files["ott2-vk.h"] = render(e, "ott_vk.h.j2", ph, shaders=shaders)
    return files


def gen_kernels(out: Path, configs: list[Config], heads: list[HeadConfig], arch: str) -> dict[str, str]:
    e = env()
    isas = ISAS[arch]
    configs = with_head_formats(configs, heads)
    p = "configs=" + ",".join(config_spec(c) for c in configs) + ", " + heads_param(heads)
    kw = dict(configs=configs, heads=heads)
    files = {"ott-kernels.h": render(e, "kernels.h.j2", p, isas=isas, **kw)}
    for isa in isas:
        files[f"ott-kernels-{isa}.c"] = render(e, "kernels_isa.c.j2", p + f", isa={isa}", isa=isa, **kw)
    files["ott-kernels-table.c"] = render(e, "kernels_table.c.j2", p, isas=isas, **kw)
    return files


def gen_cuda(out: Path, configs: list[Config], heads: list[HeadConfig]) -> dict[str, str]:
    e = env()
    p = "configs=" + ",".join(config_spec(c) for c in configs)
    files = {
        "ott-cuda-check.cu": render(e, "cuda_check.cu.j2", p, configs=configs),
        "ott2-cuda.h": render(e, "ott_cuda.h.j2", heads_param(heads), heads=heads, modes=["cuda", "emu"], table=False),
    }
    for hc in heads:
        files[f"ott2-cuda-{hc.tag}.cu"] = render_cuda_ops(e, [hc], "cuda")
        files[f"ott2-emu-{hc.tag}.cpp"] = render_cuda_ops(e, [hc], "emu")
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=["ggml", "kernels", "cuda", "flags"])
    ap.add_argument("--out", type=Path, required=False)
    ap.add_argument("--group", type=int, default=64, help="ggml target: values per block = Gv (default 64)")
    ap.add_argument("--G", type=int, default=128, help="ggml target: tokens per sealed group (default 128)")
    ap.add_argument("--configs", default="2:32,2:64,2:128,3:64,4:64", help="kernels/cuda: bits:group list")
    ap.add_argument(
        "--heads",
        default="2:128:64,2:64:32,2:32:32,3:128:64,4:128:64,3/2:128:64,2/3:128:64,4/2:128:64,3m/2:128:64,3m/4:64:32,"
        "2/2s:128:64,3m/2s:128:64,2/2s:64:32,2m/2:128:64,2m/4:64:32,2m/2s:128:64",
        help="kernels: K/V:G:Gv per-head configs (B:G:Gv: B bits on both sides)",
    )
    ap.add_argument(
        "--cuda-heads",
        default="2:128:64,2:64:32,4:128:64,3/2:128:64,3m/2:128:64,3m/2s:128:64,2/2s:64:32,2m/2:128:64,2m/2s:128:64",
        help="cuda: K/V:G:Gv head configs",
    )
    ap.add_argument("--arch", default="x86_64", choices=sorted(ISAS))
    ap.add_argument("--isa", default="scalar", help="flags target: print the compiler flags of an ISA")
    args = ap.parse_args(argv)
    try:
        if args.target == "flags":
            print(" ".join(ISA_FLAGS[args.isa]))
            return 0
        if args.out is None:
            ap.error("--out is required")
        if args.target == "ggml":
            files = gen_ggml(args.out, args.G, args.group)
        elif args.target == "kernels":
            files = gen_kernels(args.out, parse_configs(args.configs), parse_heads(args.heads), args.arch)
        else:
            files = gen_cuda(args.out, parse_configs(args.configs), parse_heads(args.cuda_heads))
    except (ValueError, jinja2.TemplateError) as exc:
        print(f"gen/generate.py: error: {exc}", file=sys.stderr)
        return 1
    for name, text in files.items():
        write_if_different(args.out / name, text)
    remove_stale(args.out, set(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
