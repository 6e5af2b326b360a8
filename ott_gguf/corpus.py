"""The real-text corpus of spec/targets.md: the pinned llama.cpp's `docs/**/*.md`, concatenated.

The text ships with llama.cpp itself (the tree vendored in the pinned llama-cpp-python sdist), so every
measurement runs on the same, real, version-pinned English/Markdown text without bundling a data set.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from .models import cache_dir

__all__ = ["DEFAULT_MAX_BYTES", "PINNED_SDIST_SHA256", "docs_dir", "docs_files", "docs_text"]

DEFAULT_MAX_BYTES = 200_000
# the llama-cpp-python 0.3.36 sdist whose vendored llama.cpp the project patches (CMakeLists.txt OTT_LCP_SHA256);
# native/fetch_llama_cpp.py unpacks it, unpatched, to <cache>/llama.cpp-<first 16 hex digits>
PINNED_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"


def _candidates() -> list[Path]:
    sha = PINNED_SDIST_SHA256
    src: str | None = None
    try:
        from ._lib import build_info

        info = build_info()
        sha = str(info.get("sdist_sha256") or sha)
        src = str(info["llama_src"]) if info.get("llama_src") else None
    except (OSError, ImportError, KeyError, ValueError):
        pass  # no native build here: the pristine tree in the cache is enough
    out = [cache_dir() / f"llama.cpp-{sha[:16]}" / "docs"]
    if src:
        out.append(Path(src) / "docs")  # the patched build tree (patches do not touch docs/)
    return out


def docs_dir() -> Path:
    """The pinned llama.cpp's docs/ directory: the cache's pristine tree, else the build tree."""
    tried = _candidates()
    for d in tried:
        if d.is_dir() and any(d.rglob("*.md")):
            return d
    raise FileNotFoundError(
        "the pinned llama.cpp source is not unpacked (looked in "
        + ", ".join(str(d) for d in tried)
        + "); building ott-gguf (`make install`) fetches it"
    )


@cache
def _docs_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in docs_files(root))


def docs_files(root: Path | None = None) -> list[Path]:
    """docs/**/*.md in sorted order of their POSIX paths relative to docs/ (code-point order, as `LC_ALL=C sort`)."""
    root = docs_dir() if root is None else root
    files = [p for p in root.rglob("*.md") if p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def docs_text(max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The first max_bytes bytes of the concatenated docs as text.

    The cut moves back to a character boundary, so the result's UTF-8 encoding is at most max_bytes long (and at
    most 3 bytes shorter) and is exactly a prefix of the concatenated files.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    data = _docs_bytes(docs_dir())
    cut = min(max_bytes, len(data))
    # never split a multi-byte character: back off over UTF-8 continuation bytes (0b10xxxxxx)
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return data[:cut].decode("utf-8")
