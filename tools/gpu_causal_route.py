"""Causal masks from tensors made outside the graph with the causal route (a ``torch.cond`` between SDPA's causal
kernel and the fused kernel, ``config.causal_tensor_route``) on and off, per written form and shape, on the GPU: the
whole call (median of ``do_bench``), the kernels' CUDA time, what ``known_causal`` answered at the first five calls,
and the error against float32 eager at the fifth.

    FORMS=forms_causal:mask_passed_in,forms_causal:sliced_buffer_mask SHAPES=4x32x4096x64 python tools/gpu_causal_route.py

With ``MUTATION=BxHxSxD`` it instead calls GPT-2's sliced causal buffer twelve times at that shape, writing one key of
the buffer in place before the sixth call and back before the tenth, and prints each call's answer and error.
"""

from __future__ import annotations

import collections
import os

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import flashlight

flashlight.enable()
from benchmarks.bench_attention import parse_shape  # noqa: E402
from benchmarks.variants import make_inputs  # noqa: E402
from benchmarks.written_forms import FORMS, MADE_ONCE  # noqa: E402
from inductor_overlay import config, mask_checks  # noqa: E402


class Answers:
    """Records what ``known_causal`` answers while active."""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self.answer = mask_checks.is_known_causal

    def __enter__(self) -> "Answers":
        mask_checks.is_known_causal = self.record
        return self

    def __exit__(self, *_: object) -> None:
        mask_checks.is_known_causal = self.answer

    def record(self, *args: object) -> bool:
        self.seen.append(self.answer(*args))
        return self.seen[-1]

    def first(self, count: int) -> str:
        return "".join("T" if answer else "F" for answer in self.seen[:count])


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def float32_reference(fn, q, k, v, extras: dict) -> torch.Tensor:
    with torch.no_grad():
        return fn(q.float(), k.float(), v.float(), **{n: t.float() if t.is_floating_point() else t for n, t in extras.items()})


def timed(fn, q, k, v, extras: dict) -> tuple[torch.Tensor, float, str, str]:
    torch._dynamo.reset()
    run = torch.compile(fn, dynamic=False)
    with Answers() as answers, torch.no_grad():
        for _ in range(5):
            out = run(q, k, v, **extras)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(lambda: run(q, k, v, **extras), warmup=50, rep=300, return_mode="median")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                run(q, k, v, **extras)
            torch.cuda.synchronize()
    kernels = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:26]] += event.device_time / 10
    top = sorted(kernels.items(), key=lambda item: -item[1])[:3]
    return out, ms, answers.first(5), " ".join(f"{name}={us:.0f}" for name, us in top)


def compare_forms() -> None:
    for shape_text in os.environ["SHAPES"].split(","):
        for spec in os.environ["FORMS"].split(","):
            family, form = spec.split(":")
            variant = FORMS[family]
            q, k, v, extras = make_inputs(variant, variant.adapt(parse_shape(shape_text)), device="cuda",
                                          dtype=torch.bfloat16, seed=0)
            fn = variant.idioms[form]
            ref = float32_reference(fn, q, k, v, extras)
            for label in ("on", "off"):
                with config.patch(causal_tensor_route=label == "on"), torch._inductor.utils.fresh_cache():
                    out, ms, first, kernels = timed(fn, q, k, v, extras)
                print(f"{spec:40} {shape_text:16} {label:4} {ms:.4f} ms  answers {first:6} "
                      f"err {relative_error(out, ref):.1e}  {kernels}", flush=True)


def mutation(shape_text: str) -> None:
    variant = FORMS["forms_causal"]
    fn = variant.idioms["sliced_buffer_mask"]
    q, k, v, _ = make_inputs(variant, parse_shape(shape_text), device="cuda", dtype=torch.bfloat16, seed=1)
    buffers = MADE_ONCE["forms_causal"]["module"]
    run = torch.compile(fn)
    with Answers() as answers, torch.no_grad():
        for call in range(12):
            if call in (5, 9):
                buffers.mask[..., 700, 3] = call == 9
            out = run(q, k, v)
            err = relative_error(out, float32_reference(fn, q, k, v, {}))
            print(call, "answer", answers.seen[-1] if answers.seen else None, f"err {err:.2e}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if os.environ.get("MUTATION"):
        mutation(os.environ["MUTATION"])
    else:
        compare_forms()
