"""Run as `PYTHONPATH=. python tools/gpu_smoke.py [N | --case=K | --shape=BxHxSxD ...]`. Quick GPU check: every variant idiom fuses into one kernel and matches a float32 reference (small shapes; `--shape` adds bf16 cases, e.g. long ragged rows that take the wide tiles)."""

import dataclasses
import datetime
import logging
import sys

import torch
import triton
from torch._inductor.utils import run_and_get_code

import flashlight

flashlight.enable()  # explicit, so the scripts also run from a checkout that is not pip-installed
from benchmarks.bench_attention import parse_shape
from benchmarks.variants import VARIANTS, Shape, make_inputs
from flashlight import testing
from inductor_overlay import config

logging.basicConfig(level=logging.WARNING)
logging.getLogger("flashlight").setLevel(logging.INFO)
failures = 0
ALL_CASES = [
    (Shape(2, 4, 300, 300, 64), torch.bfloat16),
    (Shape(2, 4, 300, 300, 64), torch.float32),
    (Shape(1, 4, 129, 77, 128), torch.float16),
]
# `N`: the first N cases; `--case=K`: case K alone (0-based).
chosen = [ALL_CASES[int(arg.split("=", 1)[1])] for arg in sys.argv[1:] if arg.startswith("--case=")]
chosen += [(parse_shape(arg.split("=", 1)[1]), torch.bfloat16) for arg in sys.argv[1:] if arg.startswith("--shape=")]
CASES = chosen or (ALL_CASES[: int(sys.argv[1])] if len(sys.argv) > 1 else ALL_CASES)
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {datetime.date.today()}", flush=True)
for shape, dtype in CASES:
    for variant in VARIANTS.values():
        for idiom, fn in variant.idioms.items():
            case_shape = dataclasses.replace(shape, M=shape.N) if variant.self_attention else shape
            q, k, v, extras = make_inputs(variant, case_shape, device="cuda", dtype=dtype)
            ref = fn(q.double(), k.double(), v.double(), **{n: t.double() if t.is_floating_point() else t for n, t in extras.items()})
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            with config.patch(sdpa_pattern_policy="flashlight"):
                out, code = run_and_get_code(torch.compile(fn), q, k, v, **extras)
            kernels = list(testing.triton_kernels(code))
            err = float((out.double() - ref).norm() / ref.norm())
            fused = torch._dynamo.utils.counters["inductor"]["flashlight_attention_fused"]
            attention = [name for name, text in testing.triton_kernels(code).items() if "for start_n in range(" in text]
            # Besides the one attention kernel, only a mask tensor or an additive mask may add its table's
            # reductions (up to four kernels for an M×N additive mask), and a value of the distance n - m its
            # table's kernel (T5's bias).
            table_only = all("cell_states" in testing.triton_kernels(code)[name] for name in attention)
            distance_tables = torch._dynamo.utils.counters["inductor"]["flashlight_distance_tables"]
            one = len(kernels) == 1 or (
                len(attention) == 1 and ((table_only and len(kernels) <= 5) or len(kernels) == 1 + distance_tables)
            )
            ok = fused == 1 and one and err < (2e-2 if dtype != torch.float32 else 1e-4)
            failures += not ok
            # Diagnostics for an unfused result: was the overlay's entry point called, was the graph a cache hit?
            seen = torch._dynamo.utils.counters["inductor"]
            trace = f"patched={flashlight.is_enabled()} entry={seen['flashlight_compile_fx']} cache_hit={seen['fxgraph_cache_hit']}"
            print(f"{'ok ' if ok else 'BAD'} {variant.name:15} {idiom:22} {str(dtype):15} {shape} kernels={len(kernels)} fused={fused} err={err:.2e} {trace}", flush=True)
print("failures:", failures)
sys.exit(1 if failures else 0)
