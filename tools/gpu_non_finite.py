"""GPU check of logits at the ends of the float range: chains guarded against NaN and infinity (speculation on
finite scores, ``fx_passes/finite_speculation.py``), compiled, against eager in float32 on inputs whose scores hold
NaN, +inf and -inf in some rows; and a batch entry padded throughout under an additive finfo.min mask (logits all
near -FLT_MAX: eager gives the mean of V), with and without the mask's table.

    PYTHONPATH=. python tools/gpu_non_finite.py [--padded-only]

Every row prints the largest error against the reference and whether their NaN positions agree; the exit status is
the number of failures.
"""

import datetime
import math
import sys

import torch
import triton

import flashlight

flashlight.enable()
from benchmarks import programs, variants
from inductor_overlay import config


def where_isnan(q, k, v, lam=None):
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(torch.where(torch.isnan(scores), 0.0, scores), dim=-1) @ v[:, :, :, : q.shape[-1]].repeat(1, 2, 1, 1)


def masked_fill_isinf(q, k, v, lam=None):
    scores = q @ k.transpose(-1, -2)
    weights = torch.softmax(scores.masked_fill(torch.isinf(scores), -1e4) * q.shape[-1] ** -0.5, dim=-1)
    return weights @ v[:, :, :, : q.shape[-1]].repeat(1, 2, 1, 1)


PROGRAMS = {
    "diff_transformer_causal": lambda q, k, v, lam: programs.diff_transformer_causal(q, k, v, lam),
    "where_isnan": where_isnan,
    "masked_fill_isinf": masked_fill_isinf,
}


def with_non_finite_scores(inputs, kind):
    """Scores of the first head get NaN rows, rows of ±inf (an infinite query meets keys of both signs) or columns
    of -inf (column 0 is all that row 0 sees under a causal mask)."""
    q, k = inputs["q"], inputs["k"]
    if kind == "nan_rows":
        q[0, 0, [3, 200, 511]] = math.nan
    elif kind == "infinite_rows":
        q[0, 0, [5, 130, 400], 1:] = 0.0
        q[0, 0, [5, 130, 400], 0] = math.inf
    elif kind == "minus_inf_columns":
        q[0, 0, :, 0] = q[0, 0, :, 0].abs() + 0.1
        k[0, 0, [0, 9, 300], 1:] = 0.0
        k[0, 0, [0, 9, 300], 0] = -math.inf
    return inputs


def padded_reference(q, k, v, attention_mask):
    """``key_padding_finfo_min`` in float32 but with the inputs' finfo.min, as the compiled kernel computes it (its
    sum is not rounded to 16 bits: in float16, -65504 + x keeps x)."""
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    additive = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(q.dtype).min
    return torch.softmax(scores + additive, dim=-1) @ v.float()


def main() -> int:
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {datetime.date.today()}")
    failures = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tables in (True, False):
            torch._dynamo.reset()
            q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=dtype) for _ in range(3))
            attention_mask = (torch.arange(300, device="cuda")[None, :] < torch.tensor([200, 0], device="cuda")[:, None]).long()
            with config.patch(mask_tensor_tables=tables):
                out = torch.compile(variants.key_padding_finfo_min)(q, k, v, attention_mask)
            reference = padded_reference(q, k, v, attention_mask)
            error = float((out.float() - reference).abs().max())
            ok = error < (2e-2 if dtype != torch.float32 else 1e-3)
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} {'key_padding_finfo_min':24} {str(dtype):15} D64   padded_entry tables={tables!s:5} max_err={error:.2e}", flush=True)
    for name, fn in PROGRAMS.items() if "--padded-only" not in sys.argv else ():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for d in (64, 128) if name == "diff_transformer_causal" and dtype != torch.float32 else (64,):
                torch._dynamo.reset()
                compiled = torch.compile(fn)
                for kind in ("finite", "nan_rows", "infinite_rows", "minus_inf_columns"):
                    inputs = with_non_finite_scores(programs.diff_inputs(B=2, H=4, S=600, D=d, device="cuda", dtype=dtype), kind)
                    out = compiled(**inputs)
                    reference = fn(**{key: value.float() for key, value in inputs.items()})
                    same_nan = bool((out.isnan() == reference.isnan()).all())
                    finite = ~reference.isnan()
                    error = float((out.float() - reference)[finite].abs().max())
                    ok = same_nan and error < (2e-2 if dtype != torch.float32 else 1e-3)
                    failures += not ok
                    print(f"{'ok ' if ok else 'BAD'} {name:24} {str(dtype):15} D{d:<4} {kind:18} max_err={error:.2e} nan_rows_agree={same_nan}", flush=True)
    print("failures:", failures)
    return failures


if __name__ == "__main__":
    sys.exit(main())
