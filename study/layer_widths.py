"""Code widths per layer (issue 12): calibrated on one text, measured on another.

    python -m study.layer_widths --out docs/layer-widths.md [--models smollm2-135m,gemma3-270m] [--threads 2]

For each model:
1. `ott_gguf.calibrate` (the `ott-gguf calibrate` command) measures, on the calibration text (the pinned llama.cpp
   docs from byte 300,000 on), how much widening (4/3) or narrowing (2/2) each block of layers changes the mean
   KL divergence of ott3/ott2, and picks the widths per layer with the lowest predicted KLD at no more bytes.
2. The evaluation text of docs/tiers.md (the first 200,000 bytes, 2048-token chunks) then measures q4_0, ott3/ott2,
   the calibrated widths and ott4/ott2 side by side: KLD, top-1 and the bytes each cache allocates.
Every number is measured by the run that writes it; the commands are printed with the tables.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from ott_gguf import models
from ott_gguf.calibrate import calibrate

from .tiers import Row, Tier, markdown, measure, write_report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/layer-widths.md"))
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4, help="evaluation chunks of 2048 tokens")
    ap.add_argument("--calib-chunks", type=int, default=2, help="calibration chunks of 2048 tokens")
    a = ap.parse_args(argv)
    t0 = time.time()
    parts: list[str] = []
    log: list[str] = []
    for name in a.models.split(","):
        path = models.fetch(name, quiet=True)
        print(f"{name}: calibration", file=sys.stderr, flush=True)
        cal = calibrate(path, kv_type="ott3/ott2", chunks=a.calib_chunks, n_ctx=2048, threads=a.threads,
                        log=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
        log += cal.commands
        tiers = [Tier("q4_0", "q4_0"), Tier("ott3", "ott2", True)]
        if cal.spec:
            tiers.append(Tier("ott3", "ott2", True, cal.spec))
        tiers.append(Tier("ott4", "ott2", True))
        print(f"{name}: evaluation", file=sys.stderr, flush=True)
        rows: list[Row] = measure(path, a.threads, a.chunks, log, tiers)
        parts += [f"## {name}", "", "Calibration (calibration text, " + f"{a.calib_chunks} chunks of 2048 tokens):",
                  "", cal.report(), "", "Evaluation (evaluation text, as docs/tiers.md):", "",
                  markdown(name, rows)]  # fmt: skip
    text = (
        "# Code widths per layer, calibrated per model\n\n"
        f"Measured {time.strftime('%a %b %d %H:%M:%S %Y')} on {platform.machine()}, {a.threads} threads, in "
        f"{time.time() - t0:.0f} s (`python -m study.layer_widths --out {a.out} --models {a.models} "
        f"--chunks {a.chunks} --calib-chunks {a.calib_chunks}`).\n\n" + (__doc__ or "").split("\n\n", 2)[2]
        + "\n"
    )  # fmt: skip
    write_report(a.out, text, parts, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
