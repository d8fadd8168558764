"""GPU benchmark: each family of ``benchmarks/written_forms.py`` in every written form (positions built in the forward,
made once outside, registered buffers, precomputed masks sliced, masks passed in), compiled with the overlay, against
the family's first form (positions built in the forward; for document ids and padding, the data passed in as the
variant library writes it), FlexAttention given the family's score_mod/BlockMask, and SDPA where it has one.

    python -m benchmarks.bench_written_forms --families forms_causal,forms_alibi --shapes 4x32x4096x64 --out DIR
        [--forms captured_positions,flex]

Times are medians of ``triton.testing.do_bench``; every row is checked against a float32 reference of the in-function
form. Results: ``DIR/results.csv`` and ``DIR/results.md``, with device, versions and date per row.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
import time
from typing import Callable, Optional

import torch

import flashlight

flashlight.enable()
from benchmarks.bench_attention import DTYPES, WRONG_OUTPUT_TOLERANCE, compiled, flex_impl, parse_shape, relative_error, start_run
from benchmarks.variants import Shape, Variant, make_inputs
from benchmarks.written_forms import FORMS

COLUMNS = "family,form,B,H,S,D,ms,vs_first_form,vs_flex,rel_err,compile_s,fused,device,torch,triton,date".split(",")
SDPA = {"forms_causal": lambda q, k, v, **_: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)}


def _timed(run: Callable, q, k, v, extras: dict, ref) -> tuple[float, float]:
    import triton

    out = run(q, k, v, **extras)
    err = relative_error(out, ref) if ref is not None else float("nan")
    ms = triton.testing.do_bench(lambda: run(q, k, v, **extras), warmup=50, rep=200, return_mode="median")
    return ms, err


def bench_family(variant: Variant, shape: Shape, dtype: torch.dtype, stamp: dict, log: Callable,
                 forms: Optional[set] = None) -> list[dict]:
    """Every form of ``variant`` (or those named in ``forms``, with the first form, the ratios' base), Flex and SDPA
    (where named, or always without ``forms``) at ``shape``."""
    q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=dtype)
    try:
        with torch.no_grad():
            floats = {n: t.float() if t.is_floating_point() else t for n, t in extras.items()}
            ref = variant.reference(q.float(), k.float(), v.float(), **floats)
    except torch.cuda.OutOfMemoryError:
        ref = None
        torch.cuda.empty_cache()
    rows: list[dict] = []
    counters = torch._dynamo.utils.counters
    runs: list[tuple[str, Callable[[], tuple[Callable, float]]]] = []
    first = next(iter(variant.idioms))
    for form, fn in variant.idioms.items():
        if forms is None or form in forms or form == first:
            runs.append((form, lambda fn=fn: _compile(fn, q, k, v, extras)))
    if forms is None or "flex" in forms:
        runs.append(("flex", lambda: _flex(variant, shape, extras, q, k, v)))
    if variant.name in SDPA and (forms is None or "sdpa" in forms):
        runs.append(("sdpa", lambda: (SDPA[variant.name], 0.0)))
    for form, make in runs:
        counters.clear()
        try:
            run, compile_s = make()
            ms, err = _timed(run, q, k, v, extras, ref)
        except Exception as error:  # a failing form is a row with no time
            log(f"  {form}: FAILED {type(error).__name__}: {str(error)[:300]}")
            ms, err, compile_s = float("nan"), float("nan"), 0.0
        fused = counters["inductor"]["flashlight_attention_fused"] + counters["inductor"]["flashlight_attention_as_sdpa"]
        rows.append(dict(family=variant.name, form=form, B=shape.B, H=shape.H, S=shape.M, D=shape.D, ms=round(ms, 4),
                         rel_err=f"{err:.2e}", compile_s=round(compile_s, 2), fused=fused, **stamp))
    _ratios(rows, first_form=first)
    for row in rows:
        wrong = float(row["rel_err"]) > WRONG_OUTPUT_TOLERANCE
        log(f"  {row['form']:20} {row['ms']:>9} ms  ×first {row['vs_first_form']:>5}  ×flex {row['vs_flex']:>5}  err "
            f"{row['rel_err']}{' WRONG OUTPUT' if wrong else ''}  fused={row['fused']}")
    del q, k, v, ref
    torch.cuda.empty_cache()
    return rows


def _ratios(rows: list[dict], first_form: str) -> None:
    """Each row's speed against the family's first form (positions built in the forward, or the variant library's
    form with the data passed in) and against Flex, in one case's rows."""
    by_form = {row["form"]: row for row in rows}
    for row in rows:
        for base, column in ((first_form, "vs_first_form"), ("flex", "vs_flex")):
            other = by_form.get(base)
            ratio = float(other["ms"]) / float(row["ms"]) if other is not None else float("nan")
            row[column] = f"{ratio:.2f}" if ratio == ratio else ""


def _compile(fn: Callable, q, k, v, extras: dict) -> tuple[Callable, float]:
    start = time.perf_counter()
    run, _ = compiled(fn, overlay=True)(q, k, v, **extras)
    torch.cuda.synchronize()
    return run, time.perf_counter() - start


def _flex(variant: Variant, shape: Shape, extras: dict, q, k, v) -> tuple[Callable, float]:
    run, _ = flex_impl(variant, shape, extras)
    start = time.perf_counter()
    run(q, k, v)
    torch.cuda.synchronize()
    return run, time.perf_counter() - start


def markdown(rows: list[dict]) -> str:
    lines = ["| family | B×H×S×D | form | ms | × first form | × Flex | rel err | fused |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['family']} | {row['B']}×{row['H']}×{row['S']}×{row['D']} | {row['form']} | {row['ms']} | "
                     f"{row['vs_first_form']} | {row['vs_flex']} | {row['rel_err']} | {row['fused']} |")
    stamp = rows[0] if rows else {}
    return "\n".join(lines) + f"\n\n{stamp.get('device')}, torch {stamp.get('torch')}, triton {stamp.get('triton')}, {stamp.get('date')}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FORMS))
    parser.add_argument("--shapes", default="4x32x4096x64,1x16x16384x128")
    parser.add_argument("--forms", default="", help="forms to run (and flex, sdpa), comma-separated; default: all")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--out", default="results/written_forms")
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out)
    stamp, log = start_run(out_dir)
    rows: list[dict] = []
    for shape_text in args.shapes.split(","):
        for family in args.families.split(","):
            log(f"{family} {shape_text}")
            forms = set(args.forms.split(",")) if args.forms else None
            rows += bench_family(FORMS[family], parse_shape(shape_text), DTYPES[args.dtype], stamp, log, forms)
            with (out_dir / "results.csv").open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
            (out_dir / "results.md").write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
