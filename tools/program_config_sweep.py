"""Time the fused kernel of a benchmarks/programs.py program with one tile config at a time (GPU).

    PYTHONPATH=. python tools/program_config_sweep.py diff_attention 6,9 > sweep.txt   # gpu_sizes indices
"""

import sys

import torch

import flashlight
from benchmarks.programs import PROGRAMS
from tools.tile_config_sweep import time_with_config

CANDIDATES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
              (64, 32, 4, 2), (128, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 64, 8, 3)]


def main() -> None:
    flashlight.enable()
    program = PROGRAMS[sys.argv[1]]
    for index in (int(i) for i in sys.argv[2].split(",")):
        size = program.gpu_sizes[index]
        inputs = program.inputs(**size, device="cuda", dtype=torch.bfloat16)
        for m, n, warps, stages in CANDIDATES:
            ms = time_with_config(program.fn, (m, n, warps, stages), **inputs)
            print(f"{program.name} {size} BLOCK_M={m:3} BLOCK_N={n:3} warps={warps} stages={stages}  {ms:.4f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
