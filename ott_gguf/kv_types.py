"""K/V cache type names and the ott2 parameters (no native library needed to import this)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# K/V cache types of the pinned llama.cpp (common/arg.cpp kv_cache_types, less f32)
STOCK_KV_TYPES: tuple[str, ...] = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# the caches of this project: ott2, and kivi2 (the same cache with no outlier tokens: the baseline)
OTT_KV_TYPES: tuple[str, ...] = ("ott2", "kivi2")
KV_TYPES: tuple[str, ...] = STOCK_KV_TYPES + OTT_KV_TYPES


@dataclass(frozen=True)
class OttConfig:
    """Parameters of the ott2 cache (spec/ott2-algorithm.md). Gv (values per V block) is fixed by the build."""

    G: int = 128
    R: int = 32
    outlier_num: int = 3
    aux_cap: int = 32
    no_outlier_layers: int = 2

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ott_config.{name} must be a non-negative integer, got {value!r}")
        if self.G != 128:
            raise ValueError(f"ott_config.G must be 128 in this build (its kernels are generated for it), got {self.G}")
        if self.outlier_num >= self.G or self.outlier_num > 64:
            raise ValueError(f"ott_config.outlier_num must be below 65, got {self.outlier_num}")

    @classmethod
    def of(cls, value: OttConfig | dict[str, int] | None) -> OttConfig:
        if value is None:
            return cls()
        if isinstance(value, OttConfig):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(
                    f"unknown ott_config keys: {', '.join(unknown)}; valid: {', '.join(cls.__dataclass_fields__)}"
                )
            return cls(**value)
        raise ValueError(f"ott_config must be an OttConfig or a dict, got {type(value).__name__}")


def resolve_kv_type(kv_type: object) -> str:
    """Validate a kv_type name; raise ValueError listing the valid names."""
    if not isinstance(kv_type, str):
        raise ValueError(f"kv_type must be a string, one of {', '.join(KV_TYPES)}; got {kv_type!r}")
    name = kv_type.strip().lower()
    if name in KV_TYPES:
        return name
    raise ValueError(f"unknown kv_type {kv_type!r}; valid choices: {', '.join(KV_TYPES)}")
