"""GPU benchmark: each variant of benchmarks/variants.py against eager, default torch.compile, FlexAttention, SDPA
(and, for a mask passed in as a tensor, Flex given the formula the mask was built from: `flex_formula`).

    python -m benchmarks.bench_attention --variants vanilla,causal --shapes 4x32x4096x64,8x16x2048x128 --out DIR

Times are medians of ``triton.testing.do_bench``; every row is checked against a float32 reference computed
from the same inputs. Results: ``DIR/results.csv`` and ``DIR/results.md``, with device, versions and date per row.

    python -m benchmarks.bench_attention --table DIR/results.csv   # rewrites DIR/results.md from the CSV (no GPU)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import pathlib
import sys
import time
from typing import Any, Callable, Optional

import torch

import flashlight

flashlight.enable()  # explicit, so the scripts also run from a checkout that is not pip-installed
from benchmarks.variants import VARIANTS, Shape, Variant, make_inputs
from inductor_overlay import config as overlay_config

# Our kernel with one overlay feature switched off (or set back), for in-run A/B against `flashlight`.
FLASHLIGHT_POLICIES: dict[str, dict[str, Any]] = {
    "flashlight_sdpa_off": {"sdpa_pattern_policy": "flashlight"},
    "flashlight_unsplit": {"split_visible_tiles": False},
    "flashlight_scalar_scan": {"vector_tile_scan": False},
    "flashlight_no_skip": {"block_skipping": False},
    "flashlight_launch_in_order": {"last_rows_first": False},
    "flashlight_unfolded": {"fold_logit_scale": False},
    "flashlight_visible_loop_d64": {"visible_loop_max_head_dim": 64},
    "flashlight_autotuned": {"tile_autotuning": "always"},
    "flashlight_sdpa_kept": {"sdpa_pattern_policy": "sdpa"},
    "flashlight_causal_sdpa": {"sdpa_route_devices": ("cuda",)},
    "flashlight_causal_kernel": {"sdpa_route_devices": ()},
    "flashlight_libdevice_tanh": {"fast_tanh": False},
    "flashlight_all_rows_table": {"row_invariant_mask_blocks": False},
    "flashlight_per_logit_distance": {"distance_tables": False},
}
COLUMNS = "variant,impl,B,H,M,N,D,dtype,ms,tflops,rel_err,compile_s,device,torch,triton,date".split(",")
# Norm-wise relative error above which an output counts as wrong. Correct bf16 rows land between 2e-3 and 3e-2 (the
# top: default compile rounding T5's bias to bf16); Flex's int32 indexing of a per-head bias with more than 2^31
# elements gives 0.76 or NaN.
WRONG_OUTPUT_TOLERANCE = 5e-2
# CUDA errors after which the process's context is unusable: every later launch fails with the same error.
_STICKY_CUDA_ERRORS = ("illegal memory access", "misaligned address", "unspecified launch failure", "device-side assert")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_shape(text: str) -> Shape:
    b, h, s, d = (int(x) for x in text.split("x"))
    return Shape(B=b, H=h, M=s, N=s, D=d)


def relative_error(out: Any, ref: Any) -> float:
    """Norm-wise relative error; for a program with several outputs (IPA), the largest."""
    if isinstance(out, tuple):
        return max(relative_error(o, r) for o, r in zip(out, ref, strict=True))
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape:
        return float("inf")
    return float((out - ref).norm() / ref.norm())


def flops(shape: Shape, variant: Variant, extras: Optional[dict] = None) -> float:
    """The unmasked work: for a mask drawn at random, this draw's share of unmasked pairs."""
    drawn = variant.drawn_visible_fraction
    fraction = drawn(extras) if drawn is not None and extras is not None else variant.visible_fraction(shape)
    return 2.0 * shape.B * shape.H * shape.M * shape.N * (shape.D + shape.value_dim) * fraction


def compiled(fn: Callable, overlay: bool, **policy: Any) -> Callable:
    """torch.compile(fn) whose compilation happens now, with the overlay on or off."""

    def first_call(*args: Any, **kwargs: Any) -> tuple[Callable, Any]:
        torch._dynamo.reset()
        compiled_fn = torch.compile(fn, dynamic=False)
        with flashlight.enabled(overlay), overlay_config.patch(**policy):
            out = compiled_fn(*args, **kwargs)
        return compiled_fn, out

    return first_call


def flex_impl(variant: Variant, shape: Shape, extras: dict, formula: bool = False) -> Optional[tuple[Callable, float]]:
    """Flex with the variant's score_mod and a block mask from its mask_mod (``formula``: from the formula a mask
    tensor was built with, ``Variant.flex_formula_mask_mod``), built outside the timed call; None where there is none."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_mod = variant.flex_formula_mask_mod if formula else variant.flex_mask_mod
    if (formula and mask_mod is None) or (variant.flex_score_mod is None and mask_mod is None):
        return None
    score_mod = variant.flex_score_mod(extras) if variant.flex_score_mod else None
    block_mask, mask_seconds = None, 0.0
    if mask_mod is not None:
        start = time.perf_counter()
        block_mask = create_block_mask(mask_mod(extras), shape.B, None, shape.M, shape.N, device="cuda")
        torch.cuda.synchronize()
        mask_seconds = time.perf_counter() - start
    flex = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, **_):
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=variant.flex_scale,
                    enable_gqa=k.shape[1] != q.shape[1])

    return run, mask_seconds


class ContextLost(Exception):
    """An implementation broke the CUDA context; carries the rows of the case measured so far (the failed one last)."""

    def __init__(self, rows: list[dict]):
        super().__init__("the CUDA context is lost: no later kernel can run in this process")
        self.rows = rows


def breaks_context(error: Exception) -> bool:
    return isinstance(error, torch.AcceleratorError) and any(text in str(error) for text in _STICKY_CUDA_ERRORS)


def wrong_output(row: dict, case: dict[str, dict]) -> bool:
    """Whether ``row`` (an implementation of ``case``, the rows of one variant and shape by implementation) computed a
    wrong output: an error above the tolerance, or none at all (NaN) where the case had a reference to compare with
    (another row got a finite error). A row that failed to run (no time) is not a wrong output."""
    err, ms = float(row["rel_err"]), float(row["ms"])
    if ms != ms:
        return False
    if err == err:
        return err > WRONG_OUTPUT_TOLERANCE
    return any(float(other["rel_err"]) == float(other["rel_err"]) for other in case.values())


def bench_one(variant: Variant, shape: Shape, dtype: torch.dtype, impls: list[str], stamp: dict, log: Callable) -> list[dict]:
    import triton

    shape = variant.adapt(shape)
    q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=dtype)
    try:
        with torch.no_grad():
            ref = variant.reference(q.float(), k.float(), v.float(), **{n: t.float() if t.is_floating_point() else t for n, t in extras.items()})
    except torch.cuda.OutOfMemoryError:  # float32 scores of the largest shapes do not fit: rows get rel_err nan
        log("  float32 reference does not fit in memory at this shape: no error check (rel_err nan)")
        ref = None
        torch.cuda.empty_cache()
    rows = []
    fn = variant.reference
    for impl in impls:
        compile_s = 0.0
        counters = torch._dynamo.utils.counters
        counters.clear()
        try:
            if impl == "eager":
                run = fn
            elif impl in ("compile", "flashlight", *FLASHLIGHT_POLICIES):
                policy = FLASHLIGHT_POLICIES.get(impl, {})
                start = time.perf_counter()
                run, _ = compiled(fn, overlay=impl != "compile", **policy)(q, k, v, **extras)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
            elif impl in ("flex", "flex_formula"):
                made = flex_impl(variant, shape, extras, formula=impl == "flex_formula")
                if made is None:
                    continue
                run, mask_s = made
                start = time.perf_counter()
                run(q, k, v)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
                log(f"  flex block mask built in {mask_s:.3f}s")
            elif impl == "sdpa":
                if variant.sdpa is None:
                    continue
                run = variant.sdpa
            else:
                raise ValueError(impl)
            out = run(q, k, v, **extras)
            err = relative_error(out, ref) if ref is not None else float("nan")
            ms = triton.testing.do_bench(lambda: run(q, k, v, **extras), warmup=50, rep=200, return_mode="median")
            fused = counters["inductor"]["flashlight_attention_fused"]
            as_sdpa = counters["inductor"]["flashlight_attention_as_sdpa"]
            fell_back = counters["inductor"]["flashlight_fault_fallback"]
        except Exception as err_:  # a failing implementation is a row with no time, not a dead run
            log(f"  {impl}: FAILED {type(err_).__name__}: {str(err_)[:300]}")
            ms, err, fused, as_sdpa, fell_back = float("nan"), float("nan"), 0, 0, 0
            context_lost = breaks_context(err_)
        else:
            context_lost = False
        row = dict(
            variant=variant.name, impl=impl, B=shape.B, H=shape.H, M=shape.M, N=shape.N, D=shape.D,
            dtype=str(dtype).removeprefix("torch."), ms=round(ms, 4),
            tflops=round(flops(shape, variant, extras) / (ms * 1e-3) / 1e12, 1) if ms == ms else float("nan"),
            rel_err=f"{err:.2e}", compile_s=round(compile_s, 2), **stamp,
        )
        rows.append(row)
        note = f" fused={fused}" + (f" as_sdpa={as_sdpa}" if as_sdpa else "") + (f" FALLBACK={fell_back}" if fell_back else "")
        note = note if impl.startswith("flashlight") else ""
        if ref is not None and ms == ms and not err <= WRONG_OUTPUT_TOLERANCE:
            note += " WRONG OUTPUT"
        log(f"  {impl:20} {row['ms']:>9} ms {row['tflops']:>7} TFLOP/s err {row['rel_err']} compile {compile_s:.1f}s{note}")
        if context_lost:
            log(f"  {impl} broke the CUDA context: this process cannot run the remaining implementations or cases")
            raise ContextLost(rows)
    del q, k, v, ref
    torch.cuda.empty_cache()
    return rows


def cases(rows: list[dict], keys: tuple[str, ...] = ("variant", "B", "H", "M", "D")) -> dict[tuple, dict[str, dict]]:
    """The rows of each case (the rows' values under ``keys``), by implementation."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault(tuple(row[key] for key in keys), {})[row["impl"]] = row
    return by_case


def markdown(rows: list[dict]) -> str:
    lines = ["| variant | B×H×S×D | impl | ms | TFLOP/s | rel err | compile s | vs compile | vs flex | vs sdpa | vs flex_formula |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (variant, b, h, s, d), impls in cases(rows).items():
        for impl, row in impls.items():
            err = f"**wrong** ({row['rel_err']})" if wrong_output(row, impls) else row["rel_err"]
            lines.append(f"| {variant} | {b}×{h}×{s}×{d} | {impl} | {row['ms']} | {row['tflops']} | {err} | "
                         f"{row['compile_s']} | " + " | ".join(speedups(impls, impl, ("compile", "flex", "sdpa", "flex_formula"))) + " |")
    return "\n".join(lines) + "\n"


def speedup(impls: dict[str, dict], impl: str, base: str) -> Optional[float]:
    """How many times faster ``impl`` ran than ``base`` in one case; None where either did not run or is a wrong
    output: a fast wrong answer is not a baseline."""
    row, other = impls.get(impl), impls.get(base)
    if row is None or other is None or impl == base or wrong_output(row, impls) or wrong_output(other, impls):
        return None
    ratio = float(other["ms"]) / float(row["ms"])
    return None if ratio != ratio else ratio


def speedups(impls: dict[str, dict], impl: str, bases: tuple[str, ...]) -> list[str]:
    """Table cells: ``speedup`` of ``impl`` over each base implementation of the same case."""
    ratios = (speedup(impls, impl, base) for base in bases)
    return [f"{ratio:.2f}×" if ratio is not None else "" for ratio in ratios]


def gpu_stamp() -> dict:
    """The device, versions and date every measurement is recorded with."""
    import triton

    return dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        date=datetime.date.today().isoformat(),
    )


def start_run(out_dir: pathlib.Path) -> tuple[dict, Callable[[str], None]]:
    """Create the results folder; return the device/versions/date stamp of every row and a logger that prints
    and appends to ``log.txt``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = gpu_stamp()
    log_file = (out_dir / "log.txt").open("a")

    def log(message: str) -> None:
        print(message, flush=True)
        log_file.write(message + "\n")
        log_file.flush()

    log(f"# {stamp}")
    return stamp, log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="vanilla,causal,alibi,softcap")
    parser.add_argument("--shapes", default="4x32x4096x64,8x16x2048x128")
    parser.add_argument("--impls", default="eager,compile,flashlight,flex,flex_formula,sdpa")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--out", default="results/latest")
    parser.add_argument("--table", type=pathlib.Path, help="only rewrite the results.md beside this results.csv")
    args = parser.parse_args()
    if args.table:
        args.table.with_name("results.md").write_text(markdown(list(csv.DictReader(args.table.open()))))
        return 0
    out_dir = pathlib.Path(args.out)
    stamp, log = start_run(out_dir)
    rows: list[dict] = []
    for variant_name in args.variants.split(","):
        for shape_text in args.shapes.split(","):
            shape = parse_shape(shape_text)
            log(f"{variant_name} {shape_text}")
            try:
                rows += bench_one(VARIANTS[variant_name], shape, DTYPES[args.dtype], args.impls.split(","), stamp, log)
            except ContextLost as lost:
                rows += lost.rows
                save_results(out_dir, rows)
                return 3
            save_results(out_dir, rows)
    return 0


def save_results(out_dir: pathlib.Path, rows: list[dict]) -> None:
    with (out_dir / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "results.md").write_text(markdown(rows))


if __name__ == "__main__":
    sys.exit(main())
