"""Time the fused kernel of a benchmarks/programs.py program with one tile config at a time (GPU).

    PYTHONPATH=. python tools/program_config_sweep.py diff_attention 6,9 > sweep.txt   # gpu_sizes indices
    PYTHONPATH=. python tools/program_config_sweep.py ipa_attention 1 --configs 32x32x8x2,16x16x8x2 --isolated

``--isolated`` runs each config in a process of its own, so a config whose kernel faults (an illegal memory
access poisons the CUDA context) is a row, not the end of the sweep. Each row checks the result against float32.
"""

import argparse
import subprocess
import sys

import torch
import triton

import flashlight
from benchmarks.bench_attention import gpu_stamp, relative_error
from benchmarks.programs import PROGRAMS
from tools.tile_config_sweep import only_config

CANDIDATES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
              (64, 32, 4, 2), (128, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 64, 8, 3)]


def sweep_one(program, index: int, config: tuple[int, int, int, int]) -> None:
    size = program.gpu_sizes[index]
    inputs = program.inputs(**size, device="cuda", dtype=torch.bfloat16)
    with only_config(config):
        compiled = torch.compile(program.fn)
        out = compiled(**inputs)
    ref = program.fn(**{k: t.float() if t.is_floating_point() else t for k, t in inputs.items()})
    error = relative_error(out, ref)
    ms = triton.testing.do_bench(lambda: compiled(**inputs), warmup=25, rep=100, return_mode="median")
    m, n, warps, stages = config
    print(f"{program.name} {size} BLOCK_M={m:3} BLOCK_N={n:3} warps={warps} stages={stages}  {ms:.4f} ms "
          f"rel_err {error:.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("program")
    parser.add_argument("sizes", help="gpu_sizes indices, comma-separated")
    parser.add_argument("--configs", help="MxNxWARPSxSTAGES, comma-separated (default: the built-in candidates)")
    parser.add_argument("--isolated", action="store_true", help="one process per config")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")] if args.configs else CANDIDATES
    program = PROGRAMS[args.program]
    print("#", gpu_stamp(), flush=True)
    for index in (int(i) for i in args.sizes.split(",")):
        for config in configs:
            if args.isolated:
                text = "x".join(map(str, config))
                done = subprocess.run([sys.executable, __file__, args.program, str(index), "--configs", text])
                if done.returncode:
                    print(f"{program.name} size {index} {text}: process failed (exit {done.returncode})", flush=True)
            else:
                flashlight.enable()
                try:
                    sweep_one(program, index, config)
                except Exception as err:  # a config that does not compile (shared memory) is a row, not the end
                    print(f"{program.name} size {index} {config}: failed {type(err).__name__}", flush=True)


if __name__ == "__main__":
    main()
