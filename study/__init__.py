"""Study, benchmark and check tools of the repository, run from its root; not part of the installed package.

    python -m study.fidelity     # the fidelity study of the cache schemes on captured K/V (docs/fidelity.md)
    python -m study.capture      # record a model's per-layer Q, K and V into an .npz (the study's data)
    python -m study.benchmarks   # the side-by-side benchmark report (docs/benchmarks.md)
    python -m study.gpu_check    # GPU tests and the GPU decode benchmark (docs/benchmarks-gpu.md; make gpu-test)

They use the product as `ott_gguf`. Run from the repository root, `python -m` puts the root first on sys.path, so
`ott_gguf` is the source tree's, which holds no native build: the installed package's native build is used then
(OTT_GGUF_NATIVE_DIR, read by ott_gguf._lib), as when developing the source tree against the venv's build.
"""

from __future__ import annotations

import os
from importlib import metadata, util
from pathlib import Path


def _use_installed_native_build() -> None:
    if os.environ.get("OTT_GGUF_NATIVE_DIR"):
        return
    spec = util.find_spec("ott_gguf")
    if spec is None or spec.origin is None or (Path(spec.origin).parent / "lib").is_dir():
        return  # no ott_gguf, or one with its native build (the installed package): nothing to do
    try:
        installed = Path(str(metadata.distribution("ott-gguf").locate_file("ott_gguf")))
    except metadata.PackageNotFoundError:
        return  # not installed: ott_gguf._lib says what is missing when the tool needs it
    if (installed / "lib").is_dir():
        os.environ["OTT_GGUF_NATIVE_DIR"] = str(installed)


_use_installed_native_build()
