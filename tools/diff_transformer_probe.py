"""Where the DIFF Transformer reference code's time goes (GPU): the same causal DiffAttn with one feature changed
at a time, timed in one process, each program's generated code written beside the timings.

    PYTHONPATH=. OUT=DIR python tools/diff_transformer_probe.py > DIR/probe.txt

Forms: the reference code (``nan_to_num`` on the scores, an additive ``triu`` of -inf), without ``nan_to_num``, with
a ``masked_fill`` causal mask instead of the additive one, both changes, and the non-causal program.
"""

import functools
import os

import torch
import triton
from torch._inductor.utils import run_and_get_code

import flashlight

flashlight.enable()
from benchmarks import programs

OUT = os.environ.get("OUT", "/tmp")


def causal_diff(q, k, v, lam, nan_to_num=True, additive=True):
    b, two_h, m, d = q.shape
    n = k.shape[-2]
    scores = torch.matmul(q * d**-0.5, k.transpose(-1, -2))
    if nan_to_num:
        scores = torch.nan_to_num(scores)
    if additive:
        future = torch.zeros([m, n], device=q.device).float().fill_(float("-inf")).type_as(scores)
        scores = scores + torch.triu(future, 1)
    else:
        scores = scores.masked_fill(torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores).view(b, two_h // 2, 2, m, n)
    return torch.matmul(weights[:, :, 0] - lam * weights[:, :, 1], v)


FORMS = {
    "as_is": causal_diff,
    "no_nan_to_num": functools.partial(causal_diff, nan_to_num=False),
    "masked_fill": functools.partial(causal_diff, additive=False),
    "masked_fill_no_nan": functools.partial(causal_diff, nan_to_num=False, additive=False),
    "noncausal_diff": programs.diff_attention,
}

for size in (dict(B=4, H=32, S=4096, D=64), dict(B=4, H=16, S=4096, D=128)):
    inputs = programs.diff_inputs(**size, device="cuda", dtype=torch.bfloat16)
    for name, fn in FORMS.items():
        torch._dynamo.reset()
        run = torch.compile(fn, dynamic=False)
        _, code = run_and_get_code(run, **inputs)
        ms = triton.testing.do_bench(lambda: run(**inputs), warmup=25, rep=150, return_mode="median")
        flops = programs.diff_flops(**size) / (1 if name == "noncausal_diff" else 2)
        print(f"{size} {name:22} {ms:.4f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
        with open(f"{OUT}/code_{name}_D{size['D']}.py", "w") as handle:
            handle.write("\n\n#####\n\n".join(code))
