"""The GPU suite's merge step and plots work on the CPU from chunk results (synthetic numbers, real file formats)."""

import csv
import pathlib

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


def _case_rows(flex_err: str) -> list[dict]:
    stamp = dict(variant="head_bias", B=1, H=16, M=16384, N=16384, D=128, dtype="bfloat16", compile_s=1.0,
                 device="test", torch="2.11.0", triton="3.6.0", date="2026-11-24")
    return [dict(stamp, impl="compile", ms=17.0, tflops=128.0, rel_err="4.4e-03"),
            dict(stamp, impl="flashlight", ms=5.7, tflops=383.0, rel_err="2.2e-03"),
            dict(stamp, impl="flex", ms=5.6, tflops=392.0, rel_err=flex_err)]


def _write_csv(path, rows: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


@pytest.mark.parametrize("flex_err", ["7.6e-01", "nan"])
def test_a_wrong_output_is_marked_and_is_no_baseline(flex_err):
    """Flex indexes a per-head bias of more than 2^31 elements in int32 and returns garbage (0.76) or NaN: the table
    must say so and draw no speed ratio against it, while the other ratios stay."""
    from benchmarks.bench_attention import markdown

    table = markdown(_case_rows(flex_err))
    flex_line = next(line for line in table.splitlines() if "| flex |" in line)
    ours_line = next(line for line in table.splitlines() if "| flashlight |" in line)
    ratio_cells = [cell.strip() for cell in flex_line.split("|")[-5:-1]]
    assert f"**wrong** ({flex_err})" in flex_line and ratio_cells == ["", "", "", ""]
    assert "2.98×" in ours_line and "0.98×" not in ours_line


def test_an_accurate_flex_row_is_a_baseline():
    from benchmarks.bench_attention import markdown

    table = markdown(_case_rows("2.3e-03"))
    ours_line = next(line for line in table.splitlines() if "| flashlight |" in line)
    assert "**wrong**" not in table and "0.98×" in ours_line


def test_wrong_outputs_are_left_out_of_the_plots(tmp_path, monkeypatch):
    import matplotlib.axes

    from benchmarks import plots

    _write_csv(tmp_path / "results.csv", _case_rows("7.6e-01"))
    drawn = []
    original = matplotlib.axes.Axes.plot

    def record(self, *args, **kwargs):
        drawn.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record)
    plots.plot(tmp_path / "results.csv")
    assert sorted(drawn) == ["compile", "flashlight"]


def test_a_cuda_fault_that_breaks_the_context_is_recognised():
    import torch

    from benchmarks.bench_attention import breaks_context

    assert breaks_context(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert not breaks_context(torch.AcceleratorError("CUDA error: out of memory"))
    assert not breaks_context(RuntimeError("an illegal memory access was encountered"))


def test_a_table_is_rebuilt_from_a_csv_with_wrong_rows_marked(tmp_path, monkeypatch):
    """Old result folders are re-tabled from their CSVs (strings, not floats) when the table's rules change."""
    from benchmarks import bench_attention

    _write_csv(tmp_path / "results.csv", _case_rows("7.6e-01"))
    monkeypatch.setattr("sys.argv", ["bench_attention", "--table", str(tmp_path / "results.csv")])
    assert bench_attention.main() == 0
    table = (tmp_path / "results.md").read_text()
    assert "**wrong** (7.6e-01)" in table and "2.98×" in table


def test_the_grid_summary_counts_cells_under_each_target_and_skips_wrong_baselines():
    from tools import grid_summary

    rows = _case_rows("7.6e-01") + [dict(row, B=8, M=2048, N=2048) for row in _case_rows("2.0e-03")]
    rows[-1]["ms"] = 6.0  # flex at the second shape: 6.0 / 5.7 = 1.053×
    text = grid_summary.summary(rows)
    assert "flashlight vs flex: 1 cells, geomean 1.053×, worst 1.053×, 0 under 1.0×" in text
    assert "flashlight vs compile: 2 cells, geomean 2.982×, worst 2.982×, 2 under 5.0×" in text
    assert "wrong outputs: 1\n  flex head_bias 1×16×16384×128 (rel err 7.6e-01)" in text


def test_the_grid_summary_runs_as_its_docstring_says_from_any_directory(tmp_path):
    import subprocess
    import sys

    _write_csv(tmp_path / "results.csv", _case_rows("2.0e-03"))
    script = pathlib.Path(__file__).resolve().parents[1] / "tools" / "grid_summary.py"
    result = subprocess.run([sys.executable, str(script), "results.csv"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "flashlight vs compile: 1 cells" in result.stdout
