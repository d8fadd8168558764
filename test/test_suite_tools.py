"""The GPU suite's merge step and plots work on the CPU from chunk results (synthetic numbers, real file formats)."""

import csv

import pytest

from benchmarks.bench_attention import COLUMNS

pytest.importorskip("matplotlib")


def test_merge_joins_chunks_and_draws_one_plot_per_variant(tmp_path):
    from tools import run_gpu_suite

    for variant, d in [("causal", 64), ("alibi", 128)]:
        chunk = tmp_path / "chunks" / f"{variant}_d{d}"
        chunk.mkdir(parents=True)
        with (chunk / "results.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            for impl, ms in [("compile", 4.0), ("flashlight", 1.0), ("flex", "nan")]:
                for b, s in run_gpu_suite.SEQUENCES:
                    writer.writerow(dict(variant=variant, impl=impl, B=b, H=16, M=s, N=s, D=d, dtype="bfloat16",
                                         ms=ms, tflops=100.0 if ms != "nan" else "nan", rel_err="1e-3", compile_s=1.0,
                                         device="test", torch="2.11.0", triton="3.6.0", date="2026-11-22"))
    run_gpu_suite.merge(tmp_path)
    merged = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(merged) == 2 * 3 * len(run_gpu_suite.SEQUENCES)
    table = (tmp_path / "results.md").read_text()
    assert "| causal | 16×16×1024×64 | flashlight | 1.0 |" in table and "4.00×" in table
    for variant in ("causal", "alibi"):
        assert (tmp_path / "plots" / f"{variant}.png").stat().st_size > 1000
