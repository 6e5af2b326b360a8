"""Named K/V cache tiers (`--kv-tier`, `Llama(kv_tier=...)`) and the calibration files the quality tier reads.

A tier is chosen like a cache type and stands for a K/V pair with its parameters (docs/kv-tiers.md):

- compact: ott2 on both sides with symmetric 2-bit value blocks, --ott-params COMPACT_PARAMS (about 2.6 bits per
  element at 8k tokens), plus the model's calibrated key widths per layer when an ott2 calibration of that GGUF is
  found: the bits the symmetric blocks save spent on 3-bit keys in the layers that lose most at long context,
  within 2.8 bits (docs/long-context.md).
- quality: ott3 keys, ott2 values, --ott-params QUALITY_PARAMS (a 64-token fp16 window, symmetric 2-bit values),
  plus the model's calibrated widths per layer when a calibration of that GGUF is found.
Either tier runs its uncalibrated recipe otherwise, and says so.

Calibrations (`ott-gguf calibrate`) are small JSON files keyed by the GGUF's sha256 and named by the pair and
parameters they calibrate (calibration_name: `<sha256>.json` for the quality tier's, `<sha256>.ott2.<params>.json`
for compact's), looked up in this order: a file next to the model (`<model>.ott-calib.json`, used when it
calibrates the tier's pair), the user cache (`<cache>/calibrations/`), the calibrations shipped in this package
(`ott_gguf/calibrations/`). A model's sha256 is computed once and kept in `<cache>/sha256.json` by path, size and
modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .kv_types import OttConfig, parse_layer_widths

__all__ = [
    "CALIBRATION_SCHEMA",
    "COMPACT_PARAMS",
    "KV_TIERS",
    "QUALITY_PARAMS",
    "Tier",
    "calibration_name",
    "calibration_target",
    "find_calibration",
    "model_sha256",
    "read_calibration",
    "resolve_tier",
    "write_calibration",
]

KV_TIERS: tuple[str, ...] = ("compact", "quality")
QUALITY_KV_TYPE = "ott3/ott2"
QUALITY_PARAMS = "128,64,3,32,2,1,1,1"  # G, R, outliers, aux, no-outlier layers, v_rotate, k_mix, v_sym
COMPACT_KV_TYPE = "ott2"
COMPACT_PARAMS = "128,32,3,32,2,1,2,1"  # ott2's defaults with v_sym (docs/long-context.md "The compact tier")
TIER_PAIRS: dict[str, tuple[str, str]] = {
    "compact": (COMPACT_KV_TYPE, COMPACT_PARAMS),
    "quality": (QUALITY_KV_TYPE, QUALITY_PARAMS),
}
# what makes a tier's calibration (besides the model): ott2 has nothing narrower than its 2/2, so it widens only,
# within 2.8 bits, a layer per block up to 30 layers (on SmolLM2 at 8k a layer per block chose 11 layers, 0.0507 on
# the calibration split, where blocks of two chose 10, 0.0541: docs/long-context.md)
TIER_CALIBRATE = {
    "compact": f"--kv-type {COMPACT_KV_TYPE} --ott-params {COMPACT_PARAMS} --up 3/2 --max-bits 2.8 --blocks 30",
    "quality": "",
}
CALIBRATION_SCHEMA = "ott-gguf-calibration"
CALIBRATION_VERSION = 1
PACKAGE_CALIBRATIONS = Path(__file__).resolve().parent / "calibrations"
SIDE_SUFFIX = ".ott-calib.json"


def tier_config(params: str, layer_widths: str = "") -> OttConfig:
    from .cli import parse_ott_params

    return OttConfig(**parse_ott_params(params), layer_widths=layer_widths)  # type: ignore[arg-type]


def quality_config(layer_widths: str = "") -> OttConfig:
    return tier_config(QUALITY_PARAMS, layer_widths)


def _cache_dir() -> Path:
    from .models import cache_dir

    return cache_dir()


def user_calibration_dir() -> Path:
    return _cache_dir() / "calibrations"


def model_sha256(path: str | Path) -> str:
    """The sha256 of a file, computed once per (path, size, mtime) and remembered in the user cache."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    index = _cache_dir() / "sha256.json"
    try:
        known: dict[str, str] = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    known = {k: v for k, v in known.items() if not k.startswith(f"{p}|")}  # an older version of this file
    known[key] = digest
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=0, sort_keys=True))
        tmp.replace(index)  # atomic: concurrent tools never read half a file
    except OSError:
        pass  # a read-only cache only costs the hash again next time
    return digest


@dataclass(frozen=True)
class CalibrationFile:
    path: Path
    data: dict[str, Any]

    @property
    def layer_widths(self) -> str:
        return str(self.data["layer_widths"])

    @property
    def ott_params(self) -> str:
        return str(self.data["ott_params"])

    @property
    def kv_type(self) -> str:
        return str(self.data["kv_type"])


def read_calibration(path: str | Path) -> CalibrationFile:
    """A calibration file, checked against the documented format (ValueError naming what is wrong)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"calibration file {p}: cannot be read as JSON: {e}") from None
    if not isinstance(data, dict) or data.get("schema") != CALIBRATION_SCHEMA:
        raise ValueError(f'calibration file {p}: not an {CALIBRATION_SCHEMA} file (no "schema" field saying so)')
    if data.get("version") != CALIBRATION_VERSION:
        raise ValueError(f"calibration file {p}: version {data.get('version')!r}, this ott-gguf reads "
                         f"{CALIBRATION_VERSION}")  # fmt: skip
    for key in ("model_sha256", "kv_type", "ott_params", "layer_widths"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"calibration file {p}: field {key!r} missing or not a string")
    try:
        parse_layer_widths(data["layer_widths"])
    except ValueError as e:
        raise ValueError(f"calibration file {p}: layer_widths: {e}") from None
    return CalibrationFile(p, data)


def write_calibration(path: str | Path, data: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"schema": CALIBRATION_SCHEMA, "version": CALIBRATION_VERSION, **data}, indent=2) + "\n")
    tmp.replace(p)
    read_calibration(p)  # what is written is what the tools read back
    return p


def calibration_name(sha256: str, kv_type: str, ott_params: str) -> str:
    """The file name of a calibration in the user cache or the package: the quality tier's `<sha256>.json`, any
    other pair or parameters (compact's ott2) `<sha256>.<K-V>.<ott-params>.json`."""
    if (kv_type, ott_params) == (QUALITY_KV_TYPE, QUALITY_PARAMS):
        return f"{sha256}.json"
    return f"{sha256}.{kv_type.replace('/', '-')}.{ott_params}.json"


def calibration_target(record: dict[str, Any]) -> Path:
    """Where `ott-gguf calibrate` writes a calibration without --out: the user cache, under the name the tier of
    its pair and parameters looks for (calibration_name), so that a calibration never replaces another pair's."""
    return user_calibration_dir() / calibration_name(str(record["model_sha256"]), str(record["kv_type"]),
                                                     str(record["ott_params"]))  # fmt: skip


def find_calibration(model: str | Path, kv_type: str = QUALITY_KV_TYPE,
                     ott_params: str = QUALITY_PARAMS) -> tuple[CalibrationFile | None, list[str]]:  # fmt: skip
    """The calibration of this GGUF (by content hash) for this pair and parameters, in lookup order, and notes on
    the candidates passed over (a file next to the model made for another file or another pair)."""
    notes: list[str] = []
    side = Path(str(model) + SIDE_SUFFIX)
    sha = model_sha256(model)
    name = calibration_name(sha, kv_type, ott_params)
    for c in (side, user_calibration_dir() / name, PACKAGE_CALIBRATIONS / name):
        if not c.is_file():
            continue
        cal = read_calibration(c)
        if cal.data["model_sha256"] != sha:
            notes.append(f"{c} was made for another file (sha256 {cal.data['model_sha256'][:12]}...), not used")
            continue
        if (cal.kv_type, cal.ott_params) != (kv_type, ott_params):
            notes.append(f"{c} calibrates {cal.kv_type} --ott-params {cal.ott_params}, not {kv_type} --ott-params "
                         f"{ott_params}: not used")  # fmt: skip
            continue
        return cal, notes
    return None, notes


@dataclass(frozen=True)
class Tier:
    name: str
    kv_type: str  # the K/V pair
    ott_config: OttConfig | None
    line: str  # what it resolved to, in one line, for the log
    calibration: Path | None = None


def resolve_tier(tier: str, model: str | Path) -> Tier:
    """The K/V pair and configuration a tier gives this model: its recipe with the model's calibrated widths per
    layer when a calibration of the tier's pair is found, the recipe alone otherwise."""
    if tier not in KV_TIERS:
        raise ValueError(f"unknown kv_tier {tier!r}; valid choices: {', '.join(KV_TIERS)}")
    kv_type, params = TIER_PAIRS[tier]
    name = Path(model).name
    cal, notes = find_calibration(model, kv_type, params)
    recipe = f"{kv_type} --ott-params {params}"
    extra = f" ({'; '.join(notes)})" if notes else ""
    if cal is None:
        how = " ".join(filter(None, ["ott-gguf calibrate", str(model), TIER_CALIBRATE[tier]]))
        line = (f"kv tier {tier}: {recipe}, uncalibrated (no {kv_type} calibration of {name} found; `{how}` makes "
                f"one){extra}")  # fmt: skip
        return Tier(tier, kv_type, tier_config(params), line)
    widths = cal.layer_widths
    where = ("next to the model" if cal.path.name.endswith(SIDE_SUFFIX) else
             "shipped with ott-gguf" if cal.path.parent == PACKAGE_CALIBRATIONS else "from the user cache")  # fmt: skip
    line = f"kv tier {tier}: {recipe} --ott-layers {widths or '(none)'}, calibrated ({where}: {cal.path}){extra}"
    return Tier(tier, kv_type, tier_config(params, widths), line, cal.path)
