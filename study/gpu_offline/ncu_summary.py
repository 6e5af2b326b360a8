"""Summarises `ncu --csv` output (one row per kernel launch and metric): per kernel and launch shape, the number
of launches and the medians of each metric. The prefill ubatches and the decoded tokens differ in grid size.

    python3 study/gpu_offline/ncu_summary.py ncu.csv
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict


def main(path: str) -> int:
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.DictReader(line for line in f if line.startswith('"')))
    # (kernel, grid, block) -> metric -> values
    groups: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    launches: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for r in rows:
        try:
            key = (r["Kernel Name"], r.get("Grid Size", ""), r.get("Block Size", ""))
            value = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        unit = r.get("Metric Unit", "")
        name = r["Metric Name"] + (f" [{unit}]" if unit else "")
        groups[key][name].append(value)
        launches[key].add(r.get("ID", ""))
    if not groups:
        print(f"ncu_summary: no metric rows in {path}")
        return 1
    for key in sorted(groups, key=lambda k: (k[0], -len(launches[k]))):
        kernel, grid, block = key
        parts = [f"{m}={statistics.median(v):.4g}" for m, v in sorted(groups[key].items())]
        print(f"{kernel} grid {grid} block {block}: {len(launches[key])} launches; medians: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
