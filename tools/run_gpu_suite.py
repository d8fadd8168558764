"""The GPU benchmark suite (the 20-shape grid): every variant at (B, S) ∈ {(16,1k), (8,2k), (4,4k), (2,8k), (1,16k)},
H ∈ {16, 32}, D ∈ {64, 128}, bf16 forward, against eager, default torch.compile, FlexAttention and SDPA.

One chunk is one variant at one head dim (ten shapes), sized to finish within a ten-minute call:

    PYTHONPATH=. python tools/run_gpu_suite.py --list                 # the chunks, numbered
    PYTHONPATH=. python tools/run_gpu_suite.py --chunk 3 --out DIR    # run one (or --chunk 3,4,5)
    PYTHONPATH=. python tools/run_gpu_suite.py --merge --out DIR      # DIR/results.csv, results.md, plots/*.png

Each chunk writes ``DIR/chunks/<variant>_d<D>/`` through ``benchmarks.bench_attention`` (its CSV has the columns
the grid asks for, with device, versions and date on every row); ``--merge`` joins them and draws the plots.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import subprocess
import sys

SEQUENCES = [(16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
HEADS = [16, 32]
HEAD_DIMS = [64, 128]
IMPLS = "eager,compile,flashlight,flex,flex_formula,sdpa"


def chunks() -> list[tuple[str, int]]:
    from benchmarks.variants import VARIANTS

    return [(variant, d) for variant in VARIANTS for d in HEAD_DIMS]


def shapes(d: int) -> str:
    return ",".join(f"{b}x{h}x{s}x{d}" for h in HEADS for b, s in SEQUENCES)


def run_chunk(index: int, out: pathlib.Path, impls: str, timeout_s: int) -> int:
    variant, d = chunks()[index]
    target = out / "chunks" / f"{variant}_d{d}"
    command = [sys.executable, "-m", "benchmarks.bench_attention", "--variants", variant, "--shapes", shapes(d),
               "--impls", impls, "--out", str(target)]
    print(" ".join(command), flush=True)
    try:
        return subprocess.run(command, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"chunk {index} ({variant}, D={d}) ran past {timeout_s} s; its finished rows are kept", flush=True)
        return 1


def merge(out: pathlib.Path) -> None:
    from benchmarks.bench_attention import save_results
    from benchmarks.plots import plot

    rows = []
    for part in sorted((out / "chunks").glob("*/results.csv")):
        rows += list(csv.DictReader(part.open()))
    save_results(out, rows)
    for path in plot(out / "results.csv"):
        print(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--chunk", help="chunk numbers, comma-separated")
    parser.add_argument("--merge", action="store_true")
    parser.add_argument("--impls", default=IMPLS)
    parser.add_argument("--timeout-s", type=int, default=570, help="per chunk")
    parser.add_argument("--out", default="results/suite")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    if args.list:
        for index, (variant, d) in enumerate(chunks()):
            print(f"{index:3} {variant:20} D={d}  shapes {shapes(d)}")
    failures = 0
    if args.chunk:
        failures = sum(run_chunk(int(i), out, args.impls, args.timeout_s) != 0 for i in args.chunk.split(","))
    if args.merge:
        merge(out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
