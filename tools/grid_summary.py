"""Summarise a benchmark CSV against the project's targets: for each baseline, how many times faster ``flashlight`` ran
(geomean, worst cell, every cell under the target), and which rows computed a wrong output.

    python tools/grid_summary.py results/<run>/results.csv [--ours flashlight]

A cell counts only where both rows ran and neither output is wrong (``bench_attention.wrong_output``).
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_attention import cases, speedup, wrong_output  # noqa: E402

# Each baseline and the speed-up we aim for against it.
TARGETS = {"flex": 1.0, "flex_formula": 1.0, "sdpa": 0.9, "compile": 5.0}


def speedups_over(rows: list[dict], base: str, ours: str) -> dict[tuple, float]:
    ratios = {case: speedup(impls, ours, base) for case, impls in cases(rows).items()}
    return {case: ratio for case, ratio in ratios.items() if ratio is not None}


def summary(rows: list[dict], ours: str = "flashlight") -> str:
    lines = []
    for base, target in TARGETS.items():
        ratios = speedups_over(rows, base, ours)
        if not ratios:
            continue
        geomean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
        short = sorted((r, case) for case, r in ratios.items() if r < target)
        lines.append(f"{ours} vs {base}: {len(ratios)} cells, geomean {geomean:.3f}×, worst {min(ratios.values()):.3f}×, "
                     f"{len(short)} under {target}×")
        lines += [f"  {r:.3f}×  {case[0]} {case[1]}×{case[2]}×{case[3]}×{case[4]}" for r, case in short]
    wrong = [(case, impl, row["rel_err"]) for case, impls in cases(rows).items() for impl, row in impls.items()
             if wrong_output(row, impls)]
    lines.append(f"wrong outputs: {len(wrong)}")
    lines += [f"  {impl} {case[0]} {case[1]}×{case[2]}×{case[3]}×{case[4]} (rel err {err})" for case, impl, err in wrong]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=pathlib.Path)
    parser.add_argument("--ours", default="flashlight")
    args = parser.parse_args()
    sys.stdout.write(summary(list(csv.DictReader(args.csv.open())), args.ours))
    return 0


if __name__ == "__main__":
    sys.exit(main())
