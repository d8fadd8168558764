"""Run as `PYTHONPATH=. python tools/gpu_training.py [--variants=a,b] [--shapes=BxHxSxD,...] [--check-only] [--learned]
[--programs=a,b [--program-shapes=BxHxSxD,...]] [--forms=family:form,...] [--impls=flashlight,compile,flex,sdpa]`.

Training on the GPU: forward + backward of each variant's first idiom, inputs requiring grad.

1. Correctness (2×4×512×D, bf16): the output and dq, dk, dv against float64 eager (norm-wise relative error), and
   whether the attention fused for training.
2. Time (bf16, the given shapes): median of ``triton.testing.do_bench`` of one forward + backward for the overlay
   (under the default policy: plain causal attention trains on SDPA's kernels, ``as_sdpa``),
   default ``torch.compile`` (overlay off), FlexAttention (the variant's score_mod / block mask, compiled) and SDPA
   where the variant has one (or those ``--impls`` names); peak memory of one step beside each. One process, so the ratios compare like with like.

With ``--learned`` the variant's floating tensors (ALiBi's slopes, a per-head bias) require grad too: their
gradients are checked and computed in every timed step (FlexAttention's as its captured buffers' gradients).

With ``--programs`` the named programs of ``benchmarks/programs.py`` (every floating input requiring grad) are
checked at their CPU size and timed at their GPU sizes (or at ``--program-shapes``, for programs sized by B, H, S,
D) against default ``torch.compile`` instead; with ``--forms``
the named written forms of ``benchmarks/written_forms.py`` (``forms_causal:sliced_buffer_mask``, ...) stand for the
variants.
"""

from __future__ import annotations

import datetime
import sys

import torch
import triton

import flashlight

flashlight.enable()  # explicit, so the script also runs from a checkout that is not pip-installed
from benchmarks.bench_attention import flex_impl, parse_shape
from benchmarks.variants import VARIANTS, Shape, make_inputs
from inductor_overlay import config

DEFAULT_VARIANTS = "vanilla,causal,softcap,sliding_window,document,alibi,alibi_arange,gemma2,hf_decoder_mask,t5_bias,gqa_causal"
DEFAULT_SHAPES = "4x16x2048x64,4x16x2048x128"


def _arg(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"--{name}=")), default)


def _inputs(variant, shape, dtype):
    q, k, v, extras = make_inputs(variant, variant.adapt(shape), device="cuda", dtype=dtype)
    if "--learned" in sys.argv:
        extras = {name: t.requires_grad_() if t.is_floating_point() else t for name, t in extras.items()}
    return [t.requires_grad_() for t in (q, k, v)], extras


def _learned(extras) -> list:
    return [t for t in extras.values() if t.requires_grad]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())


def check(variant) -> str:
    fn = variant.reference
    (q, k, v), extras = _inputs(variant, Shape(2, 4, 512, 512, 64), torch.bfloat16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = torch.compile(fn, dynamic=False)(q, k, v, **extras)
    grad = torch.randn_like(out)
    out.backward(grad)
    inductor = torch._dynamo.utils.counters["inductor"]
    fused, as_sdpa = inductor["flashlight_attention_fused_for_training"], inductor["flashlight_attention_as_sdpa_for_training"]
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    wide = {n: t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t for n, t in extras.items()}
    expected = fn(*ref, **wide)
    expected.backward(grad.double())
    errors = [_relative(out, expected)] + [_relative(t.grad, r.grad) for t, r in zip((q, k, v), ref)]
    errors += [_relative(extras[n].grad, wide[n].grad) for n in extras if extras[n].requires_grad]
    ok = all(e < 2e-2 for e in errors)
    fallback = inductor["flashlight_fault_fallback"]
    return f"{'ok ' if ok else 'BAD'} {variant.name:16} fused={fused} as_sdpa={as_sdpa} fallback={fallback} errors out/dq/dk/dv(/learned) " + " ".join(f"{e:.1e}" for e in errors)


def step_time(run, tensors, extras) -> tuple[float, float]:
    def step():
        out = run(*tensors, **extras)
        out.backward(grad)

    out = run(*tensors, **extras)
    grad = torch.randn_like(out)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    learned = _learned(extras)
    ms = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=[*tensors, *learned], return_mode="median")
    return ms, peak


def bench(variant, shape) -> list[str]:
    fn = variant.reference
    tensors, extras = _inputs(variant, shape, torch.bfloat16)
    rows, times = [], {}
    impls = {
        "flashlight": lambda: torch.compile(fn, dynamic=False),
        "compile": lambda: torch.compile(fn, dynamic=False),
        "flex": lambda: (flex_impl(variant, variant.adapt(shape), extras) or (None,))[0],
        "sdpa": lambda: variant.sdpa,
    }
    chosen = _arg("impls", ",".join(impls)).split(",")
    for impl, make in ((name, make) for name, make in impls.items() if name in chosen):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            with flashlight.enabled(impl != "compile"):
                run = make()
                if run is None:
                    continue
                ms, peak = step_time(run, tensors, extras)
        except Exception as error:  # a failing implementation is a row with no time
            rows.append(f"  {impl:10} FAILED {type(error).__name__}: {str(error)[:200]}")
            torch.cuda.empty_cache()
            continue
        inductor = torch._dynamo.utils.counters["inductor"]
        fused, as_sdpa = inductor["flashlight_attention_fused_for_training"], inductor["flashlight_attention_as_sdpa_for_training"]
        times[impl] = ms
        note = f" fused={fused} as_sdpa={as_sdpa} fallback={inductor['flashlight_fault_fallback']}" if impl == "flashlight" else ""
        rows.append(f"  {impl:10} {ms:8.3f} ms  peak {peak:8.1f} MiB{note}")
        torch.cuda.empty_cache()
    ours = times.get("flashlight")
    if ours:
        ratios = " ".join(f"{base}/ours {times[base] / ours:.2f}x" for base in ("compile", "flex", "sdpa") if base in times)
        rows.append(f"  {ratios}")
    return rows


SWEEP_TILES = {
    64: ["32,128,128,32,4,3", "32,128,128,32,4,5", "64,64,64,64,4,3", "64,128,128,64,8,3", "32,64,64,32,4,3"],
    128: ["64,64,64,64,4,2", "64,128,128,64,8,3", "64,128,128,64,8,2", "64,64,64,64,8,3", "32,128,128,32,8,2",
          "64,64,64,64,4,3"],
}


def sweep(variant, shape) -> list[str]:
    """The overlay's forward + backward under each backward tile config (``config.backward_tiles``), one process."""
    fn = variant.reference
    tensors, extras = _inputs(variant, shape, torch.bfloat16)
    rows = []
    for tiles in SWEEP_TILES[64 if shape.D <= 64 else 128]:
        torch._dynamo.reset()
        try:
            with config.patch(backward_tiles=tiles):
                ms, _ = step_time(torch.compile(fn, dynamic=False), tensors, extras)
            rows.append(f"  tiles {tiles:22} {ms:8.3f} ms")
        except Exception as error:  # a config that does not compile is a row with no time
            rows.append(f"  tiles {tiles:22} FAILED {type(error).__name__}: {str(error)[:120]}")
        torch.cuda.empty_cache()
    return rows


def program_rows(program) -> list[str]:
    """One program of ``benchmarks/programs.py`` in training: gradients against float64 eager at its CPU size, then
    forward + backward time and peak memory, the overlay against default compile, at each GPU size."""
    def learned(size, dtype):
        inputs = program.inputs(**size, device="cuda", dtype=dtype, generator=torch.Generator().manual_seed(0))
        return {n: t.requires_grad_() if t.is_floating_point() else t for n, t in inputs.items()}

    inputs = learned(program.cpu_size, torch.bfloat16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = torch.compile(program.fn, dynamic=False)(**inputs)
    grad = torch.randn_like(out)
    out.backward(grad)
    fused = torch._dynamo.utils.counters["inductor"]["flashlight_attention_fused_for_training"]
    wide = {n: t.detach().double().requires_grad_() if t.is_floating_point() else t for n, t in inputs.items()}
    program.fn(**wide).backward(grad.double())
    errors = {n: _relative(t.grad, wide[n].grad) for n, t in inputs.items() if t.requires_grad}
    rows = [f"{program.name} bf16 check fused={fused} errors " + " ".join(f"{n} {e:.1e}" for n, e in errors.items())]
    shapes = [s for s in _arg("program-shapes", "").split(",") if s]
    sizes = [dict(B=x.B, H=x.H, S=x.M, D=x.D) for x in map(parse_shape, shapes)] or program.gpu_sizes
    for size in sizes:
        inputs = learned(size, torch.bfloat16)
        times = {}
        rows.append(f"{program.name} {size} bf16 forward+backward")
        for impl in ("flashlight", "compile"):
            torch._dynamo.reset()
            with flashlight.enabled(impl == "flashlight"):
                ms, peak = step_time(torch.compile(program.fn, dynamic=False), [], inputs)
            times[impl] = ms
            rows.append(f"  {impl:10} {ms:8.3f} ms  peak {peak:8.1f} MiB")
            torch.cuda.empty_cache()
        rows.append(f"  compile/ours {times['compile'] / times['flashlight']:.2f}x")
    return rows


def written_form_rows(forms: list[str], shapes: list[Shape]) -> list[str]:
    """``--forms=family:form,...``: forms of ``benchmarks/written_forms.py`` checked and timed one at a time."""
    from benchmarks.written_forms import form_variant

    rows = []
    for name in forms:
        variant = form_variant(name)
        rows.append(f"{name.replace(':', ' ')} {check(variant)}")
        for shape in shapes:
            rows += [f"  {shape.B}x{shape.H}x{shape.M}x{shape.D} bf16 forward+backward", *bench(variant, shape)]
    return rows


def main() -> None:
    if _arg("programs", ""):
        from benchmarks.programs import PROGRAMS

        print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {datetime.date.today()}")
        for name in _arg("programs", "").split(","):
            for row in program_rows(PROGRAMS[name]):
                print(row, flush=True)
        return
    names = _arg("variants", DEFAULT_VARIANTS).split(",")
    shapes = [parse_shape(s) for s in _arg("shapes", DEFAULT_SHAPES).split(",")]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {datetime.date.today()}")
    if _arg("forms", ""):
        for row in written_form_rows(_arg("forms", "").split(","), shapes):
            print(row, flush=True)
        return
    with config.patch(sdpa_pattern_policy="flashlight"):
        for name in names:
            print(check(VARIANTS[name]), flush=True)
    for name in [name for name in names if name in ("vanilla", "causal", "gpt2_causal")]:
        print(f"{check(VARIANTS[name])} (default policy: SDPA's kernels)", flush=True)
    if "--check-only" in sys.argv:
        return
    if "--sweep" in sys.argv:
        for shape in shapes:
            for name in names:
                print(f"{name} {shape.B}x{shape.H}x{shape.M}x{shape.D} bf16 forward+backward, backward tiles", flush=True)
                for row in sweep(VARIANTS[name], shape):
                    print(row, flush=True)
        return
    for shape in shapes:
        for name in names:
            print(f"{name} {shape.B}x{shape.H}x{shape.M}x{shape.D} bf16 forward+backward", flush=True)
            for row in bench(VARIANTS[name], shape):
                print(row, flush=True)


if __name__ == "__main__":
    main()
