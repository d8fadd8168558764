"""PNG plots of a benchmark results.csv: TFLOP/s against sequence length, one line per implementation, one panel per
(H, D), one figure per variant.

    python -m benchmarks.plots results/<run>/results.csv      # writes <run>/plots/<variant>.png
"""

from __future__ import annotations

import csv
import pathlib
import sys


def plot(csv_path: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.bench_attention import cases, wrong_output

    # A wrong output is no point on a speed plot: the tables mark it instead.
    rows = [r for impls in cases(list(csv.DictReader(csv_path.open()))).values() for r in impls.values()
            if r["tflops"] not in ("", "nan") and not wrong_output(r, impls)]
    out_dir = csv_path.parent / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for variant in sorted({r["variant"] for r in rows}):
        mine = [r for r in rows if r["variant"] == variant]
        panels = sorted({(int(r["H"]), int(r["D"])) for r in mine})
        figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
        for axis, (h, d) in zip(axes[0], panels):
            for impl in sorted({r["impl"] for r in mine}):
                points = sorted((int(r["M"]), float(r["tflops"])) for r in mine
                                if r["impl"] == impl and int(r["H"]) == h and int(r["D"]) == d)
                if points:
                    axis.plot(*zip(*points), marker="o", label=impl)
            axis.set_xscale("log", base=2)
            axis.set_title(f"{variant}, H={h}, D={d}")
            axis.set_xlabel("sequence length (B·S = 16k)")
            axis.set_ylabel("TFLOP/s (unmasked work)")
            axis.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=8)
        stamp = mine[0]
        figure.suptitle(f"{stamp['device']}, torch {stamp['torch']}, triton {stamp['triton']}, {stamp['date']}, "
                        f"{stamp['dtype']}", fontsize=9)
        figure.tight_layout()
        path = out_dir / f"{variant}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


if __name__ == "__main__":
    for written in plot(pathlib.Path(sys.argv[1])):
        print(written)
