"""Run as `PYTHONPATH=. python tools/gpu_frozen_operands.py VARIANT[,VARIANT...]`.

Training with some of q, k, v frozen, on a GPU (bf16, 4x32x4096x64, each variant's first idiom): forward + backward
with the backward kernel launching only the programs whose gradients are wanted (the row programs alone where k and
v are frozen, the column programs alone where q is: ``attention_training._kernel_programs``) against the same
kernel launching both kinds, each compiled afresh in one process, and the largest difference between the two's
gradients.
"""
import datetime, sys
import torch, triton
import flashlight
flashlight.enable()
from benchmarks.variants import VARIANTS, Shape, make_inputs
from inductor_overlay.fx_passes import attention_training

original = attention_training._kernel_programs
print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, datetime.date.today(), flush=True)
shape = Shape(4, 32, 4096, 4096, 64)
for name in sys.argv[1].split(","):
    variant = VARIANTS[name]
    q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(q)
    for frozen in ("none", "kv", "q"):
        results = {}
        for programs in ("chosen", "both"):
          with torch._inductor.utils.fresh_cache():
            attention_training._kernel_programs = original if programs == "chosen" else (lambda matched, reads: "both")
            leaves = [t.detach().clone().requires_grad_(n not in frozen) for n, t in zip("qkv", (q, k, v))]
            torch._dynamo.reset()
            fn = torch.compile(variant.reference, dynamic=False)
            def step():
                for t in leaves:
                    t.grad = None
                fn(*leaves, **extras).backward(grad)
            step(); step(); torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
            results[programs] = (ms, [None if t.grad is None else t.grad.float().clone() for t in leaves])
        diff = max(((a - b).abs().max().item() for a, b in zip(results["chosen"][1], results["both"][1]) if a is not None), default=0.0)
        print(f"{name:16} frozen={frozen:4} chosen programs {results['chosen'][0]:.3f} ms  both {results['both'][0]:.3f} ms  "
            f"ratio {results['both'][0] / results['chosen'][0]:.2f}x  max grad diff {diff:.2e}", flush=True)
attention_training._kernel_programs = original
