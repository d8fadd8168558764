"""Where a program's GPU time goes: every kernel of one call, with its time, overlay off and on (GPU).

    PYTHONPATH=. python tools/profile_program.py evoformer_row_attention 0,1 > profile.txt   # gpu_sizes indices
    PYTHONPATH=. python tools/profile_program.py causal_mask_tensor:boolean_passed_in 4x16x4096x64,1x16x16384x64

Per compiled program it prints the kernels of one call (torch.profiler, mean over 20 calls), their sum, and the
do_bench median of the whole call: a median well above the kernel sum is launch overhead (host time the GPU
waits for), not kernel time.
"""

import collections
import sys

import torch
import triton

import flashlight
from benchmarks.bench_attention import compiled
from benchmarks.programs import PROGRAMS
from benchmarks.variants import VARIANTS, Shape, make_inputs

CALLS = 20


def kernel_times(run, inputs) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(CALLS):
            run(**inputs)
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / CALLS
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def cases(name: str, sizes: str):
    """(label, function, keyword inputs) per size: a program of benchmarks/programs.py at its gpu_sizes indices,
    or ``variant:idiom`` of benchmarks/variants.py at BxHxSxD shapes."""
    if ":" not in name:
        program = PROGRAMS[name]
        for index in (int(i) for i in sizes.split(",")):
            size = program.gpu_sizes[index]
            yield f"{name} {size}", program.fn, program.inputs(**size, device="cuda", dtype=torch.bfloat16)
        return
    variant_name, idiom = name.split(":")
    variant = VARIANTS[variant_name]
    for text in sizes.split(","):
        b, h, s, d = (int(part) for part in text.split("x"))
        shape = variant.adapt(Shape(b, h, s, s, d))
        q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=torch.bfloat16)
        yield f"{name} {text}", variant.idioms[idiom], dict(q=q, k=k, v=v, **extras)


def main() -> None:
    flashlight.enable()
    for label, fn, inputs in cases(sys.argv[1], sys.argv[2]):
        for overlay in (False, True):
            run, _ = compiled(fn, overlay=overlay)(**inputs)
            times = kernel_times(run, inputs)
            median_ms = triton.testing.do_bench(lambda: run(**inputs), warmup=25, rep=200, return_mode="median")
            print(f"{label} overlay={'on' if overlay else 'off'}: do_bench {median_ms * 1e3:.1f} us, "
                  f"kernels {sum(times.values()):.1f} us", flush=True)
            for name, micros in times.items():
                print(f"    {micros:9.1f} us  {name[:110]}")


if __name__ == "__main__":
    main()
