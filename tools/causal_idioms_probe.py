"""Causal attention written as ``masked_fill`` and as an additive ``triu`` of -inf, with the SDPA route on and off
(our kernel), timed in one process against a float32 reference (GPU).

    PYTHONPATH=. python tools/causal_idioms_probe.py > causal_idioms.txt
"""

import torch
import triton

import flashlight

flashlight.enable()
from benchmarks.bench_attention import compiled, relative_error
from benchmarks.variants import CAUSAL

for B, H, S, D in ((4, 32, 4096, 64), (8, 16, 2048, 128), (16, 16, 1024, 64), (1, 16, 16384, 128)):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    reference = CAUSAL.idioms["masked_fill"](q.float(), k.float(), v.float())
    for idiom in ("masked_fill", "triu_additive"):
        for route in ("on", "off"):
            policy = {} if route == "on" else {"sdpa_route_devices": ()}
            run, out = compiled(CAUSAL.idioms[idiom], overlay=True, **policy)(q, k, v)
            ms = triton.testing.do_bench(lambda: run(q, k, v), warmup=25, rep=150, return_mode="median")
            tflops = 2 * B * H * S * S * D / ms / 1e9
            print(f"{B}x{H}x{S}x{D} {idiom:14} route={route:3} {ms:.4f} ms {tflops:6.1f} TFLOP/s "
                  f"err {relative_error(out, reference):.2e}", flush=True)
