"""Where the compile time of one attention goes (GPU): cProfile of its first call, from a fresh Inductor cache.

    PYTHONPATH=. python tools/profile_compile.py causal_mask_tensor:boolean_passed_in 4x16x4096x64 > compile.txt
    PYTHONPATH=. python tools/profile_compile.py diff_transformer_causal 9 > compile.txt   # a program, gpu_sizes index

Prints the wall time of the first call, then the functions with the most cumulative and the most own time.
Autotuning compiles its choices in worker threads or processes: their time shows as waiting in the main thread.
"""

import cProfile
import io
import pstats
import sys
import time

import torch
from torch._inductor.utils import fresh_cache

import flashlight
from tools.profile_program import cases


def main() -> None:
    flashlight.enable()
    _, fn, inputs = next(cases(sys.argv[1], sys.argv[2]))
    compiled = torch.compile(fn, dynamic=False)
    profiler = cProfile.Profile()
    with fresh_cache():
        start = time.perf_counter()
        profiler.enable()
        compiled(**inputs)
        torch.cuda.synchronize()
        profiler.disable()
    print(f"{sys.argv[1]} {sys.argv[2]}: first call {time.perf_counter() - start:.1f} s")
    for order, count in (("cumulative", 45), ("tottime", 25)):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(count)
        print(text.getvalue())


if __name__ == "__main__":
    main()
