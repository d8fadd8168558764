"""Time the fused kernel of a benchmarks/programs.py program with one tile config at a time (GPU).

    PYTHONPATH=. python tools/program_config_sweep.py diff_attention 6,9 > sweep.txt   # gpu_sizes indices
"""

import sys

import torch
import triton
from torch._inductor.utils import fresh_cache

import flashlight
from benchmarks.programs import PROGRAMS
from inductor_overlay.kernel import online_softmax_attention as kernel

CANDIDATES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
              (64, 32, 4, 2), (128, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 64, 8, 3)]


def main() -> None:
    flashlight.enable()
    program = PROGRAMS[sys.argv[1]]
    original = kernel.kernel_configs
    for index in (int(i) for i in sys.argv[2].split(",")):
        size = program.gpu_sizes[index]
        inputs = program.inputs(**size, device="cuda", dtype=torch.bfloat16)
        for m, n, warps, stages in CANDIDATES:
            kernel.kernel_configs = lambda d, dv, device, c=(m, n, warps, stages): [
                dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3])
            ]
            torch._dynamo.reset()
            try:
                with fresh_cache():  # the config is not part of Inductor's cache key
                    fn = torch.compile(program.fn)
                    fn(**inputs)
                ms = triton.testing.do_bench(lambda: fn(**inputs), warmup=25, rep=100, return_mode="median")
            except Exception as err:  # a config that does not compile is a row, not a dead sweep
                ms = float("nan")
                print(f"  failed: {type(err).__name__}", flush=True)
            print(f"{program.name} {size} BLOCK_M={m:3} BLOCK_N={n:3} warps={warps} stages={stages}  {ms:.4f} ms",
                  flush=True)
    kernel.kernel_configs = original


if __name__ == "__main__":
    main()
