"""The main job: compile attention variants with plain torch.compile and show that Flashlight fuses them.

    python -m benchmarks.demo

For each variant: did it become one fused kernel, does it match float64 eager, and (on a GPU) how fast is it
against eager and default torch.compile. Then the same for the programs of ``benchmarks/programs.py``, which
FlexAttention cannot express. Without a GPU it runs the generated Triton kernels through Triton's
interpreter at small sizes, so it shows fusion and correctness but no timings.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional, Sequence

import torch

import flashlight
from benchmarks.bench_attention import relative_error
from benchmarks.programs import PROGRAMS
from benchmarks.variants import VARIANTS, Shape, make_inputs
from flashlight import testing
from inductor_overlay import config


def _reference(fn, dtype: torch.dtype, *args, **kwargs):
    """``fn`` on ``dtype`` copies of the floating-point inputs; bool and integer inputs stay as they are."""
    def up(t):
        return t.to(dtype) if t.is_floating_point() else t

    return fn(*map(up, args), **{name: up(t) for name, t in kwargs.items()})


def _compile(fn, gpu: bool, *args, **kwargs) -> tuple[torch.Tensor, int, int]:
    """Compile ``fn`` afresh with the overlay; return (output, attentions fused, Triton kernel count)."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    harness = contextlib.nullcontext() if gpu else testing.cpu_triton()
    with harness, config.patch(sdpa_pattern_policy="flashlight"):
        out, code = testing.compile_and_get_code(fn, *args, **kwargs)
    return out, counters["inductor"]["flashlight_attention_fused"], len(testing.triton_kernels(code))


_TIMING_HEADER = f" {'eager ms':>9} {'compile ms':>10} {'flashlight ms':>13} {'speedup vs compile':>18}"


def _timings(fn, *args, **kwargs) -> str:
    """The GPU columns: eager, default torch.compile (overlay off) and Flashlight, median ms of each."""
    from triton.testing import do_bench

    def median_ms(f):
        return do_bench(lambda: f(*args, **kwargs), return_mode="median")

    # Each compiled function is timed before the next torch._dynamo.reset(), which would recompile it.
    times = [median_ms(fn)]
    torch._dynamo.reset()
    with flashlight.enabled(False):
        upstream = torch.compile(fn)
        upstream(*args, **kwargs)
        times.append(median_ms(upstream))
    torch._dynamo.reset()
    with config.patch(sdpa_pattern_policy="flashlight"):
        ours = torch.compile(fn)
        ours(*args, **kwargs)
        times.append(median_ms(ours))
    return f" {times[0]:>9.3f} {times[1]:>10.3f} {times[2]:>13.3f} {times[1] / times[2]:>17.1f}×"


def run(shape: Shape, dtype: torch.dtype, gpu: bool, names: Optional[Sequence[str]] = None) -> list[tuple[str, bool, int, float]]:
    """Print one line per variant (those of ``names``, or all); return (variant, fused, kernel count, relative
    error) for each."""
    results = []
    print(f"{'variant':20} {'fused':>6} {'kernels':>7} {'rel err':>9}" + (_TIMING_HEADER if gpu else ""))
    for variant in [VARIANTS[name] for name in names] if names is not None else VARIANTS.values():
        fn = variant.reference
        q, k, v, extras = make_inputs(variant, shape, device="cuda" if gpu else "cpu", dtype=dtype)
        out, fused_count, kernels = _compile(fn, gpu, q, k, v, **extras)
        fused, error = fused_count == 1, relative_error(out, _reference(fn, torch.float64, q, k, v, **extras))
        results.append((variant.name, fused, kernels, error))
        line = f"{variant.name:20} {'yes' if fused else 'NO':>6} {kernels:>7} {error:>9.1e}"
        print(line + (_timings(fn, q, k, v, **extras) if gpu else ""), flush=True)
    return results


def run_programs(gpu: bool, names: Optional[Sequence[str]] = None) -> list[tuple[str, bool, int, float]]:
    """Print one line per program of ``benchmarks/programs.py``; return (program, fused, kernel count, relative
    error) for each. On the GPU each runs at its first benchmark size in bf16, checked against float32 (float64
    would be slow at those sizes); programs without a GPU size are left out there, as the GPU benchmark does."""
    results = []
    header = f"{'program':30} {'fused':>6} {'kernels':>7} {'expected':>8} {'rel err':>9}"
    print(header + (_TIMING_HEADER if gpu else ""))
    dtype, reference_dtype = (torch.bfloat16, torch.float32) if gpu else (torch.float32, torch.float64)
    chosen = [PROGRAMS[name] for name in names] if names is not None else PROGRAMS.values()
    for program in [p for p in chosen if p.gpu_sizes or not gpu]:
        size = program.gpu_sizes[0] if gpu else program.cpu_size
        inputs = program.inputs(**size, device="cuda" if gpu else "cpu", dtype=dtype)
        out, fused_count, kernels = _compile(program.fn, gpu, **inputs)
        fused, error = fused_count >= 1, relative_error(out, _reference(program.fn, reference_dtype, **inputs))
        results.append((program.name, fused, kernels, error))
        line = f"{program.name:30} {'yes' if fused else 'NO':>6} {kernels:>7} {program.kernels:>8} {error:>9.1e}"
        print(line + (_timings(program.fn, **inputs) if gpu else ""), flush=True)
    return results


def main() -> None:
    testing.quiet_interpreter_warnings()
    flashlight.enable()
    gpu = torch.cuda.is_available()
    if gpu:
        shape, dtype = Shape(B=4, H=16, M=2048, N=2048, D=64), torch.bfloat16
        where = f"{torch.cuda.get_device_name()}, bf16, B×H×S×D = 4×16×2048×64"
    else:
        shape, dtype = Shape(B=1, H=4, M=64, N=64, D=16), torch.float32
        where = "CPU, Triton interpreter, fp32, B×H×S×D = 1×4×64×16 (no GPU: correctness only, no timings)"
    print(f"Flashlight demo — torch {torch.__version__} — {where}")
    start = time.perf_counter()
    run(shape, dtype, gpu)
    print("\nPrograms FlexAttention cannot express:")
    run_programs(gpu)
    print(f"done in {time.perf_counter() - start:.0f} s. 'fused' = one attention kernel, no score matrix in memory (a mask "
          "passed in as a tensor adds the kernels that reduce it to its tile table; a value of the distance n - m, T5's "
          "bias, the kernel that computes it once per distance).")


if __name__ == "__main__":
    main()
