from __future__ import annotations

from pathlib import Path

import pytest

import ott_gguf
from ott_gguf._lib import LIB_DIR

# the tests exercise the installed package with its native build (or OTT_GGUF_NATIVE_DIR), never a source
# tree without one
if not LIB_DIR.is_dir():
    pytest.exit(
        f"ott_gguf imported from {ott_gguf.__file__} has no native build: run the tests with the "
        "venv's pytest after installing (make test)",
        returncode=4,
    )


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from ott_gguf import models

    return models.fetch("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def gemma3() -> Path:
    from ott_gguf import models

    return models.fetch("gemma3-270m", quiet=True)
