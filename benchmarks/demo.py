"""The main job: compile attention variants with plain torch.compile and show that Flashlight fuses them.

    python -m benchmarks.demo

For each variant: did it become one fused kernel, does it match float64 eager, and (on a GPU) how fast is it
against eager and default torch.compile. Without a GPU it runs the generated Triton kernels through Triton's
interpreter at small sizes, so it shows fusion and correctness but no timings.
"""

from __future__ import annotations

import time

import torch

import flashlight
from benchmarks.variants import VARIANTS, Shape, make_inputs
from flashlight import testing
from inductor_overlay import config


def _reference(fn, q, k, v, extras):
    return fn(q.double(), k.double(), v.double(), **{n: t.double() if t.is_floating_point() else t for n, t in extras.items()})


def _relative_error(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def run(shape: Shape, dtype: torch.dtype, gpu: bool) -> list[tuple[str, bool, int, float]]:
    """Print one line per variant; return (variant, fused, kernel count, relative error) for each."""
    import contextlib

    counters = torch._dynamo.utils.counters
    results = []
    header = f"{'variant':20} {'fused':>6} {'kernels':>7} {'rel err':>9}"
    if gpu:
        header += f" {'eager ms':>9} {'compile ms':>10} {'flashlight ms':>13} {'speedup vs compile':>18}"
    print(header)
    for variant in VARIANTS.values():
        fn = variant.reference
        q, k, v, extras = make_inputs(variant, shape, device="cuda" if gpu else "cpu", dtype=dtype)
        harness = contextlib.nullcontext() if gpu else testing.cpu_triton()
        counters.clear()
        with harness, config.patch(sdpa_pattern_policy="flashlight"):
            out, code = testing.compile_and_get_code(fn, q, k, v, **extras)
        fused = counters["inductor"]["flashlight_attention_fused"] == 1
        kernels, error = len(testing.triton_kernels(code)), _relative_error(out, _reference(fn, q, k, v, extras))
        results.append((variant.name, fused, kernels, error))
        line = f"{variant.name:20} {'yes' if fused else 'NO':>6} {kernels:>7} {error:>9.1e}"
        if gpu:
            from triton.testing import do_bench

            def median_ms(f):
                return do_bench(lambda: f(q, k, v, **extras), return_mode="median")

            # Each compiled function is timed before the next torch._dynamo.reset(), which would recompile it.
            times = [median_ms(fn)]
            torch._dynamo.reset()
            with flashlight.enabled(False):
                upstream = torch.compile(fn)
                upstream(q, k, v, **extras)
                times.append(median_ms(upstream))
            torch._dynamo.reset()
            with config.patch(sdpa_pattern_policy="flashlight"):
                ours = torch.compile(fn)
                ours(q, k, v, **extras)
                times.append(median_ms(ours))
            line += f" {times[0]:>9.3f} {times[1]:>10.3f} {times[2]:>13.3f} {times[1] / times[2]:>17.1f}×"
        print(line, flush=True)
    return results


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Could not find an active CPU backend")
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
    print(f"done in {time.perf_counter() - start:.0f} s. 'fused' = one Triton kernel, no score matrix in memory.")


if __name__ == "__main__":
    main()
