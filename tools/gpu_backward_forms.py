"""Forward + backward step and per-kernel CUDA time of masks in their written forms (GPU).

HF's additive decoder mask and key padding filled with finfo.min (summarised in a mask table) against the same masks
as booleans filled with -inf (position formulas), and any variant of the library by name; FlexAttention's kernels on
the same inputs with FLEX=1 (boolean forms and variants). Inputs are seeded alike in every process (seed 1234).

    FORMS=hf_add,hf_bool,kp_min,kp_bool SHAPES=4x32x4096x64 FLEX=1 LABEL=default python tools/gpu_backward_forms.py

Set FLASHLIGHT_BACKWARD_TILES (``BLOCK_M1,BLOCK_N1,BLOCK_M2,BLOCK_N2,warps,stages``) to compare backward tiles, or
SWITCH to a boolean setting of ``inductor_overlay.config`` to time each form with it on and off in one process:

    FORMS=softcap,gemma2 SWITCH=fold_gradient_factors python tools/gpu_backward_forms.py
"""
import collections
import math
import os

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import flashlight
from inductor_overlay import config as overlay_config
from benchmarks.bench_attention import flex_impl, parse_shape
from benchmarks.variants import VARIANTS, hf_causal_padding_4d, key_padding_bool_masked_fill, key_padding_finfo_min, make_inputs

flashlight.enable()


def hf_bool(q, k, v, attention_mask):
    """HF's decoder mask (causal and padding) as booleans filled with -inf."""
    m, n = q.shape[-2], k.shape[-2]
    causal = torch.ones(m, n, dtype=torch.bool, device=q.device).tril()
    keep = causal[None, None] & (attention_mask[:, None, None, :] != 0)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


FORMS = {
    "hf_add": ("hf_decoder_mask", hf_causal_padding_4d, False),
    "hf_bool": ("hf_decoder_mask", hf_bool, True),
    "kp_min": ("key_padding", key_padding_finfo_min, False),
    "kp_bool": ("key_padding", key_padding_bool_masked_fill, True),
}


def kernel_times(step, steps=10):
    """Mean CUDA time per step of each kernel, longest first."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / steps
    return sorted(times.items(), key=lambda item: -item[1])


def main():
    label = os.environ.get("LABEL", "default")
    for shape_text in os.environ.get("SHAPES", "4x32x4096x64").split(","):
        for form in os.environ.get("FORMS", ",".join(FORMS)).split(","):
            name, fn, flex_equivalent = FORMS.get(form, (form, None, True))
            variant = VARIANTS[name]
            fn = fn or variant.reference
            shape = variant.adapt(parse_shape(shape_text))
            q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=torch.bfloat16, seed=1234)
            tensors = [t.requires_grad_() for t in (q, k, v)]
            switch = os.environ.get("SWITCH")
            impls = [f"{switch}={int(on)}" for on in (True, False)] if switch else ["ours"]
            flex = flex_impl(variant, shape, extras) if os.environ.get("FLEX") and flex_equivalent else None
            impls += ["flex"] if flex is not None else []
            for impl in impls:
                torch._dynamo.reset()
                if impl == "flex":
                    run = flex[0]
                else:
                    settings = {switch: impl.endswith("=1")} if switch else {}
                    with overlay_config.patch(**settings):
                        run = torch.compile(fn, dynamic=False)
                        run(*tensors, **extras).sum().backward()  # (both graphs compiled under the setting)
                grad = torch.randn_like(run(*tensors, **extras))

                def step():
                    run(*tensors, **extras).backward(grad)
                    for t in tensors:
                        t.grad = None

                ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
                top = " | ".join(f"{us:7.1f} {kernel[:40]}" for kernel, us in kernel_times(step)[:3])
                print(f"{label:8s} {form:8s} {shape_text} {impl:8s} step {ms:.3f} ms | {top}", flush=True)


if __name__ == "__main__":
    main()
