"""K/V cache type names and the one configuration of the ott caches (no native library needed to import this).

`OttConfig` is used both by `Llama(kv_type="ott2", ott_config=...)` and by the numpy reference
(`ott_gguf.reference`). Its own checks are the algorithm's (spec/ott2-algorithm.md); what a build's native cache
accepts on top of that (G and Gv of its generated kernels, upper bounds) is checked once, in C
(`llama_ott_config_check`, native/src/llama-ott.cpp), and reported with its reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

# K/V cache types of the pinned llama.cpp (common/arg.cpp kv_cache_types, less f32)
STOCK_KV_TYPES: tuple[str, ...] = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# the caches of this project, each a ggml type id that selects the ott cache for one side (native/src/llama-ott.cpp
# lists them; a test checks that the two lists agree): ott2..ott4 (2, 3 or 4-bit codes with outlier tokens) and
# kivi2..kivi4 (the same cache with no outlier tokens). K and V may differ in width, not in family.
OTT_KV_TYPES: tuple[str, ...] = ("ott2", "ott3", "ott4", "kivi2", "kivi3", "kivi4")
KV_TYPES: tuple[str, ...] = STOCK_KV_TYPES + OTT_KV_TYPES
# ott types without outlier tokens: the KIVI baselines
KIVI_KV_TYPES: frozenset[str] = frozenset(t for t in OTT_KV_TYPES if t.startswith("kivi"))

MeanMode = Literal["non_outlier", "all"]
_BITS = (2, 3, 4)
# k_mix's levels: the key widths whose sealed groups mix widths per channel (w - 1, w, w + 1 bits). 2 (the
# default): 2-bit keys (1/2/3, docs/long-context-keys.md) and 3-bit keys (2/3/4); 1 (True): 3-bit keys only
# (docs/k-channel-widths.md); 0 (False): none
K_MIX_WIDTHS: dict[int, tuple[int, ...]] = {0: (), 1: (3,), 2: (2, 3)}
K_MIX_DEFAULT = 2  # docs/long-context-keys.md: the measurement that made 2 the default
V_SYM_BITS = 2  # v_sym stores 2-bit values in symmetric blocks
K_YOUNG_BITS = 2  # k_young applies to layers with 2-bit keys (their young keys: 3 bits)
K_YOUNG_MAX = 16  # sealed groups (native llama_ott_config_check's bound)
ROT_BLOCK = 64  # channels per Hadamard block of k_rotate/v_rotate (the head dim must be a multiple)


@dataclass(frozen=True)
class OttConfig:
    """Parameters of the ott caches (spec/ott2-algorithm.md).

    The native cache takes G, R, outlier_num, aux_cap, no_outlier_layers, v_rotate, k_mix, v_sym (C struct
    `llama_ott_config`); its code widths come from the K and V types (type_k="ott3": 3-bit keys) and Gv from the
    build. The other fields are variants of the numpy reference (and of the fidelity study): bits, or k_bits/v_bits
    per side (None: bits); k_rotate/v_rotate:
    an orthonormal Hadamard transform over blocks of ROT_BLOCK channels before quantizing that side (scores for
    outlier tracing stay on the unrotated keys; pooled and tail tokens are stored unrotated; V is rotated or not per
    token and unit of max(Gv, ROT_BLOCK) channels, flagged in the sign bit of its fp16 scales, so v_rotate needs Gv
    to be 32 or a multiple of ROT_BLOCK: see reference.quantize_values); mean "non_outlier"
    (the spec's decision) or "all" (the paper's wording) for the placeholder value; identity switches
    quantization off (x_hat = x), so that the output must equal dense attention. outlier_num = 0 is the KIVI
    baseline ("kivi2"). clip: the quantizer's clipped ranges (quantizer.K_CLIP64, V_ROT_CLIP64), as the native
    kernels use; False: full min-max ranges (the formats before clipping, for studies).

    k_mix: K widths per channel, chosen per sealed group (docs/k-channel-widths.md): in
    a group of 3-bit keys, the quarter of the channels with the largest range*max|k| get 4 bits and the quarter
    with the smallest get 2, so a group holds the same code bits; a table of the widths goes with the group. At
    level 2 (the default, K_MIX_DEFAULT) 2-bit keys mix widths by the same rule one width lower (1/2/3 bits, the
    1-bit channels clipped to quantizer.K_CLIP64[1]; docs/long-context-keys.md); level 1 (True) mixes 3-bit keys
    only, 0 (False) none (K_MIX_WIDTHS); 4-bit keys never. For 0.016 bits per key element it cuts the KL
    divergence of ott3/ott2 by about a third (docs/tiers.md) and ott2's by about half at 2k tokens (0.42x
    SmolLM2, 0.54x Gemma 3: docs/tiers-defaults.md) and more at 8k (0.36x SmolLM2, docs/long-context-keys.md).
    k_rotate needs it off.

    v_sym: 2-bit values in symmetric blocks (one fp16 scale, no min, levels centred on zero; quantizer module
    docstring): 0.25 bits per value less at about 5% more value error, since rotated values are centred
    (docs/v-blocks.md). Needs v_rotate; layers with wider values are unaffected.

    k_young: keys by age (docs/long-context.md "Keys by age"): in layers with 2-bit keys, the newest k_young
    sealed groups also hold their keys at 3 bits (k_mix 2/3/4 when k_mix is on), quantized from the same fp16 keys
    when the group is sealed, and attention reads those groups' keys at 3 bits; older groups are read at 2 bits.
    Costs k_young 3-bit K groups per (layer, sequence, KV head); 0 (the default) is off. The native cache runs it
    on the CPU only so far. v_young: the same for values (layers with 2-bit values; 3-bit young values, never
    symmetric blocks).

    layer_widths: K/V code widths of some layers, "LAYER[-LAST]:K/V" items separated by commas ("15-24:4/3");
    the other layers take the widths of the K/V types (or k_bits/v_bits). Kept in a canonical form (ascending,
    adjacent equal layers merged), so two configurations that give every layer the same widths compare equal.
    """

    G: int = 128
    R: int = 32
    outlier_num: int = 3
    aux_cap: int = 32
    no_outlier_layers: int = 2
    bits: int = 2
    Gv: int = 64
    mean: MeanMode = "non_outlier"
    identity: bool = False
    k_bits: int | None = None
    v_bits: int | None = None
    k_rotate: bool = False
    v_rotate: bool = True
    clip: bool = True
    layer_widths: str = ""
    k_mix: bool | int = K_MIX_DEFAULT  # 0/False, 1/True or 2: K_MIX_WIDTHS
    v_sym: bool = False
    k_young: int = 0
    v_young: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layer_widths, str):
            raise ValueError(f"ott_config.layer_widths must be a string like '15-24:4/3', got {self.layer_widths!r}")
        object.__setattr__(self, "layer_widths", format_layer_widths(parse_layer_widths(self.layer_widths)))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("mean", "identity", "k_rotate", "v_rotate", "clip", "layer_widths", "k_mix", "v_sym") or (
                f.name.endswith("_bits") and value is None
            ):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ott_config.{f.name} must be a non-negative integer, got {value!r}")
        for name in ("bits", "k_bits", "v_bits"):
            value = getattr(self, name)
            if value is not None and value not in _BITS:
                raise ValueError(f"ott_config.{name} must be one of {_BITS}, got {value}")
        if not isinstance(self.k_mix, int) or self.k_mix not in K_MIX_WIDTHS:
            raise ValueError(
                f"ott_config.k_mix must be False/0, True/1 (3-bit keys) or 2 (2- and 3-bit keys), got {self.k_mix!r}"
            )
        for name in ("identity", "k_rotate", "v_rotate", "clip", "v_sym"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ott_config.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("G", "Gv"):
            group = getattr(self, name)
            if group == 0 or group % 32 != 0 or group > 256:
                raise ValueError(f"ott_config.{name} must be a multiple of 32 in [32, 256], got {group}")
        if self.v_rotate and self.Gv % ROT_BLOCK and ROT_BLOCK % self.Gv:
            # a rotation unit, max(Gv, ROT_BLOCK) channels, must hold whole Hadamard blocks and whole V blocks
            raise ValueError(f"ott_config.v_rotate needs Gv to be 32 or a multiple of {ROT_BLOCK}, got {self.Gv}")
        if self.outlier_num >= self.G:
            # a group must keep at least one non-outlier token to define the placeholder mean
            raise ValueError(f"ott_config.outlier_num must be below G={self.G}, got {self.outlier_num}")
        if self.v_sym and not self.v_rotate:
            raise ValueError(
                "ott_config.v_sym needs v_rotate (symmetric blocks suit rotated values, which are centred)"
            )
        if self.v_sym and self.Gv not in (32, 64, 128, 256):
            raise ValueError(f"ott_config.v_sym needs Gv in 32, 64, 128 or 256, got {self.Gv}")
        if self.k_mix and self.k_rotate:
            raise ValueError("ott_config.k_mix and k_rotate exclude each other (k_mix ranks the unrotated channels)")
        for name in ("k_young", "v_young"):
            if getattr(self, name) > K_YOUNG_MAX:
                raise ValueError(
                    f"ott_config.{name} must be in [0, {K_YOUNG_MAX}] (sealed groups), got {getattr(self, name)}"
                )
        if self.mean not in ("non_outlier", "all"):
            raise ValueError(f"ott_config.mean must be 'non_outlier' or 'all', got {self.mean!r}")

    @property
    def kbits(self) -> int:
        """Code width of the keys."""
        return self.bits if self.k_bits is None else self.k_bits

    @property
    def vbits(self) -> int:
        """Code width of the values."""
        return self.bits if self.v_bits is None else self.v_bits

    # the fields of the native cache's configuration (C struct llama_ott_config), in its order
    # (all int32 there: v_rotate and v_sym are 0 or 1, k_mix 0, 1 or 2)
    NATIVE_FIELDS = (
        "G", "R", "outlier_num", "aux_cap", "no_outlier_layers", "v_rotate", "k_mix", "v_sym", "k_young", "v_young"
    )  # fmt: skip

    @classmethod
    def of(cls, value: OttConfig | dict[str, Any] | None) -> OttConfig:
        """An OttConfig from itself, a dict of its fields, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, OttConfig):
            return value
        if isinstance(value, dict):
            names = [f.name for f in fields(cls)]
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"unknown ott_config keys: {', '.join(unknown)}; valid: {', '.join(names)}")
            return cls(**value)
        raise ValueError(f"ott_config must be an OttConfig or a dict, got {type(value).__name__}")

    @classmethod
    def kivi2(cls, **kwargs: Any) -> OttConfig:
        """The KIVI-2 baseline with OTT's G/R schedule: no outlier pools anywhere."""
        return cls(outlier_num=0, **kwargs)

    def replace(self, **changes: Any) -> OttConfig:
        return OttConfig(**{**asdict(self), **changes})

    def for_kv_type(self, kv_type: str) -> OttConfig:
        """The configuration an ott cache of this type, or "K/V" pair of types, runs: the code widths of its types
        (k_bits/v_bits, set where they differ from this configuration's), and no outliers for the kivi types."""
        k, v = resolve_kv_types(kv_type)
        if k not in OTT_KV_TYPES:
            raise ValueError(f"{kv_type!r} is not an ott cache type; valid: {', '.join(OTT_KV_TYPES)}")
        changes: dict[str, Any] = {}
        if kv_type_bits(k) != self.kbits:
            changes["k_bits"] = kv_type_bits(k)
        if kv_type_bits(v) != self.vbits:
            changes["v_bits"] = kv_type_bits(v)
        if k in KIVI_KV_TYPES:
            changes["outlier_num"] = 0
        return self.replace(**changes) if changes else self

    def native(self) -> tuple[int, ...]:
        """The values of NATIVE_FIELDS, as the C struct's int32 fields (v_rotate, v_sym: 0 or 1; k_mix: 0, 1 or 2)."""
        return tuple(int(getattr(self, n)) for n in self.NATIVE_FIELDS)

    def params_text(self) -> str:
        """The native fields as llama.cpp's tools of this build take them (--ott-params); k_young and v_young only
        when set, so a configuration without them reads as it always did."""
        values = self.native()
        n = len(values) if self.v_young else len(values) - 1 if self.k_young else len(values) - 2
        return ",".join(str(x) for x in values[:n])

    def young_for_layer(self, layer: int | None = None) -> int:
        """Keys by age: how many of the newest sealed groups of this layer also hold their keys at 3 bits
        (k_young on layers with 2-bit keys, else 0)."""
        kbits = self.kbits if layer is None else self.widths_for_layer(layer)[0]
        return self.k_young if kbits == K_YOUNG_BITS else 0

    def young_values_for_layer(self, layer: int | None = None) -> int:
        """Values by age: how many of the newest sealed groups of this layer also hold their values at 3 bits
        (v_young on layers with 2-bit values, else 0)."""
        vbits = self.vbits if layer is None else self.widths_for_layer(layer)[1]
        return self.v_young if vbits == K_YOUNG_BITS else 0

    def widths_for_layer(self, layer: int) -> tuple[int, int]:
        """(K bits, V bits) of a layer: its layer_widths item, else the configuration's widths."""
        return parse_layer_widths(self.layer_widths).get(layer, (self.kbits, self.vbits))

    def for_layer(self, layer: int) -> OttConfig:
        """The configuration one layer runs: its widths as k_bits/v_bits, no layer_widths."""
        if not self.layer_widths:
            return self
        k, v = self.widths_for_layer(layer)
        return self.replace(k_bits=k, v_bits=v, layer_widths="")

    def outliers_for_layer(self, layer: int) -> int:
        """Outlier pool capacity of a layer: the first no_outlier_layers layers have none."""
        return 0 if layer < self.no_outlier_layers else self.outlier_num

    @property
    def k_format(self) -> Any:  # quantizer.BlockFormat (imported lazily: this module stays dependency-free)
        return self.k_format_of(self.kbits)

    def k_format_of(self, bits: int) -> Any:
        """The block format of one key channel of a group at `bits` (k_mix mixes widths within a group)."""
        from .quantizer import CLIP_ONE, K_CLIP64, BlockFormat

        return BlockFormat(bits, self.G, K_CLIP64[bits] if self.clip else CLIP_ONE)

    @property
    def k_mixed(self) -> bool:
        """Whether sealed key groups mix widths per channel: k_mix on keys of a width its level mixes (K_MIX_WIDTHS)."""
        return self.kbits in K_MIX_WIDTHS[int(self.k_mix)]

    @property
    def v_symmetric(self) -> bool:
        """Whether V blocks are symmetric: v_sym on 2-bit values."""
        return self.v_sym and self.vbits == V_SYM_BITS

    @property
    def v_format(self) -> Any:
        """The format of unrotated V units (full range; symmetric too under v_symmetric)."""
        from .quantizer import BlockFormat

        return BlockFormat(self.vbits, self.Gv, sym=self.v_symmetric)

    @property
    def vr_format(self) -> Any:
        """The format of rotated V units: the same blocks, quantized to the clipped range of their width and Gv."""
        from .quantizer import CLIP_ONE, V_ROT_CLIP64, V_SYM_CLIP64, BlockFormat

        if self.v_symmetric:
            return BlockFormat(
                self.vbits, self.Gv, V_SYM_CLIP64[(self.vbits, self.Gv)] if self.clip else CLIP_ONE, True
            )
        return BlockFormat(self.vbits, self.Gv, V_ROT_CLIP64[(self.vbits, self.Gv)] if self.clip else CLIP_ONE)


MAX_LAYERS = 256  # LLAMA_OTT_MAX_LAYERS: layers a layer_widths item may name


def parse_layer_widths(spec: str) -> dict[int, tuple[int, int]]:
    """{layer: (K bits, V bits)} of a layer_widths string ("15-24:4/3,0:3/2"; later items win), as the native
    llama_ott_config_set_layer_widths reads it; ValueError saying what is wrong."""
    out: dict[int, tuple[int, int]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        layers, _, widths = item.partition(":")
        first, _, last = layers.partition("-")
        k, _, v = widths.partition("/")
        try:
            a, b, kb, vb = int(first), int(last or first), int(k), int(v)
        except ValueError:
            raise ValueError(
                f"ott_config.layer_widths: cannot read {item!r}: items are LAYER[-LAST]:K/V, e.g. 15-24:4/3"
            ) from None
        if not 0 <= a <= b < MAX_LAYERS:
            raise ValueError(f"ott_config.layer_widths: layers {a}-{b} are not a range within [0, {MAX_LAYERS - 1}]")
        if kb not in _BITS or vb not in _BITS:
            raise ValueError(f"ott_config.layer_widths: widths {kb}/{vb} are not K/V bits of {_BITS}")
        out.update({il: (kb, vb) for il in range(a, b + 1)})
    return out


def format_layer_widths(widths: dict[int, tuple[int, int]]) -> str:
    """The canonical string of {layer: (K bits, V bits)}: ascending runs of equal widths."""
    items: list[str] = []
    layers = sorted(widths)
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1 and widths[layers[j + 1]] == widths[layers[i]]:
            j += 1
        k, v = widths[layers[i]]
        span = f"{layers[i]}" if i == j else f"{layers[i]}-{layers[j]}"
        items.append(f"{span}:{k}/{v}")
        i = j + 1
    return ",".join(items)


def resolve_kv_type(kv_type: object, what: str = "kv_type") -> str:
    """Validate one K/V cache type name (case-insensitive); raise ValueError listing the valid names. `what` names
    the argument in the message."""
    if not isinstance(kv_type, str):
        raise ValueError(f"{what} must be a string, one of {', '.join(KV_TYPES)}; got {kv_type!r}")
    name = kv_type.strip().lower()
    if name in KV_TYPES:
        return name
    raise ValueError(f"unknown {what} {kv_type!r}; valid choices: {', '.join(KV_TYPES)}")


def kv_type_bits(name: str) -> int:
    """Code width of an ott cache type: ott3 and kivi3 store 3-bit codes."""
    if name not in OTT_KV_TYPES:
        raise ValueError(f"{name!r} is not an ott cache type; valid: {', '.join(OTT_KV_TYPES)}")
    return int(name[-1])


def _family(name: str) -> str:
    return "kivi" if name in KIVI_KV_TYPES else "ott" if name in OTT_KV_TYPES else "stock"


def _side(value: object, what: str) -> str:
    """One side's type: a name, or a ggml type id (as llama_cpp.Llama's type_k/type_v take; needs the native
    library to read the ids)."""
    if isinstance(value, int) and not isinstance(value, bool):
        from ._lib import ggml_type_ids  # the ids are the loaded build's

        by_id = {i: n for n, i in ggml_type_ids().items()}
        name = by_id.get(value)
        if name in KV_TYPES:
            return name
        valid = ", ".join(f"{n}={i}" for n, i in ggml_type_ids().items() if n in KV_TYPES)
        has = f"ggml type {name!r}" if name else "no ggml type"
        raise ValueError(f"{what}={value} is not the ggml id of a K/V cache type ({has}); valid: {valid}")
    return resolve_kv_type(value, what)


def resolve_kv_pair(type_k: str | int, type_v: str | int) -> tuple[str, str]:
    """The (K, V) type names of a pair given by names (case-insensitive) or ggml type ids.

    Stock types mix freely (K q8_0, V q4_0). The ott caches hold both sides: an ott type needs an ott type on the
    other side, a kivi type a kivi type; the widths may differ (K ott3, V ott2). Raises ValueError saying why."""
    k, v = _side(type_k, "type_k"), _side(type_v, "type_v")
    fk, fv = _family(k), _family(v)
    if fk != fv:
        if "stock" in (fk, fv):
            ott, stock = (k, v) if fk != "stock" else (v, k)
            raise ValueError(
                f"type_k={k!r} with type_v={v!r}: the ott caches hold both K and V, so {ott!r} needs an ott type on "
                f"the other side too, not the stock type {stock!r} (both ott* or both kivi*, widths free: e.g. "
                "type_k='ott3', type_v='ott2')"
            )
        raise ValueError(
            f"type_k={k!r} with type_v={v!r}: K and V must both be ott types ({', '.join(_of('ott'))}) or both kivi "
            f"types ({', '.join(_of('kivi'))}); the widths are free (e.g. type_k='ott3', type_v='ott2')"
        )
    return k, v


def _of(family: str) -> list[str]:
    return [t for t in OTT_KV_TYPES if _family(t) == family]


def kv_pair_name(type_k: str, type_v: str) -> str:
    """The name of a (K, V) pair of types as the native cache says it: "ott3/ott2" when they differ, else "ott2"."""
    return type_k if type_k == type_v else f"{type_k}/{type_v}"


def resolve_kv_types(
    kv_type: str = "f16", type_k: str | int | None = None, type_v: str | int | None = None
) -> tuple[str, str]:
    """The (K, V) type names of kv_type (one name for both sides, or "K/V" such as "ott3/ott2"), with type_k or
    type_v (names or ggml type ids) replacing one side each; validated as resolve_kv_pair does."""
    if not isinstance(kv_type, str):
        raise ValueError(f"kv_type must be a string, one of {', '.join(KV_TYPES)} or 'K/V'; got {kv_type!r}")
    parts = kv_type.split("/")
    if len(parts) > 2:
        raise ValueError(f"kv_type {kv_type!r}: expected one type or 'K/V' (e.g. 'ott3/ott2')")
    k = resolve_kv_type(parts[0])
    v = resolve_kv_type(parts[-1])
    return resolve_kv_pair(k if type_k is None else type_k, v if type_v is None else type_v)


def is_ott_kv_type(kv_type: str) -> bool:
    """Whether a kv_type (a name, or "K/V") selects an ott cache (ott* or kivi* types)."""
    return resolve_kv_types(kv_type)[0] in OTT_KV_TYPES
