"""Where a program's GPU time goes: every kernel of one call, with its time, overlay off and on (GPU).

    PYTHONPATH=. python tools/profile_program.py evoformer_row_attention 0,1 > profile.txt   # gpu_sizes indices

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


def main() -> None:
    flashlight.enable()
    program = PROGRAMS[sys.argv[1]]
    for index in (int(i) for i in sys.argv[2].split(",")):
        size = program.gpu_sizes[index]
        inputs = program.inputs(**size, device="cuda", dtype=torch.bfloat16)
        for overlay in (False, True):
            run, _ = compiled(program.fn, overlay=overlay)(**inputs)
            times = kernel_times(run, inputs)
            median_ms = triton.testing.do_bench(lambda: run(**inputs), warmup=25, rep=200, return_mode="median")
            print(f"{program.name} {size} overlay={'on' if overlay else 'off'}: do_bench {median_ms * 1e3:.1f} us, "
                  f"kernels {sum(times.values()):.1f} us", flush=True)
            for name, micros in times.items():
                print(f"    {micros:9.1f} us  {name[:110]}")


if __name__ == "__main__":
    main()
