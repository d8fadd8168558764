"""Run as `PYTHONPATH=. python tools/gpu_dynamic_shapes.py [OUT_DIR] [--timing-only]`. GPU check that attention still fuses after
Dynamo recompiles with a symbolic sequence length (as it does by default the second time the length changes):
every variant idiom is called at four lengths through one ``torch.compile``; each call is checked against a float64
reference and each compiled graph must hold one fused kernel. Then causal at 4096 is timed through the dynamic
graph, through a static one and with SDPA (medians of ``triton.testing.do_bench``)."""

import dataclasses
import datetime
import logging
import pathlib
import sys

import torch
import triton

import flashlight

flashlight.enable()  # explicit, so the scripts also run from a checkout that is not pip-installed
from benchmarks.variants import CAUSAL, VARIANTS, Shape, make_inputs
from flashlight import testing
from inductor_overlay import config

LENGTHS = (256, 512, 384, 300)  # the second length makes Dynamo recompile with a symbolic one; the rest reuse it
logging.basicConfig(level=logging.WARNING)
counters = torch._dynamo.utils.counters


def check_idiom(variant, idiom, fn, dtype, head_dim, log, device="cuda") -> bool:
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn)
    ok = True
    for length in LENGTHS:
        shape = variant.adapt(Shape(2, 4, length, length, head_dim))
        q, k, v, extras = make_inputs(variant, shape, device=device, dtype=dtype)
        ref = fn(q.double(), k.double(), v.double(), **{n: t.double() if t.is_floating_point() else t for n, t in extras.items()})
        with config.patch(sdpa_pattern_policy="flashlight"):
            out, code = testing.run_keeping_graphs_and_get_code(compiled, q, k, v, **extras)
        err = float((out.double() - ref).nan_to_num().norm() / ref.nan_to_num().norm())
        attention = [name for name, text in testing.triton_kernels(code).items() if "for start_n in range(" in text]
        same_nans = torch.equal(out.isnan(), ref.isnan())
        good = err < 2e-2 and same_nans and (not code or len(attention) == 1)
        ok &= good
        log(f"  {variant.name}/{idiom} S={length}: graphs_compiled={len(code)} attention_kernels={len(attention)} "
            f"rel_err={err:.1e} nan_rows_match={same_nans} {'ok' if good else 'FAIL'}")
    log(f"  {variant.name}/{idiom}: graphs {counters['stats']['unique_graphs']}, fused {counters['inductor']['flashlight_attention_fused']}, "
        f"declined {counters['inductor']['flashlight_attention_declined']}, fallbacks {counters['inductor']['flashlight_fault_fallback']}")
    return ok and counters["inductor"]["flashlight_fault_fallback"] == 0


def time_causal(dtype, head_dim, log) -> None:
    fn = CAUSAL.reference
    shape = Shape(4, 32, 4096, 4096, head_dim)
    q, k, v, _ = make_inputs(CAUSAL, shape, device="cuda", dtype=dtype)
    torch._dynamo.reset()
    static = torch.compile(fn, dynamic=False)
    every_dim = torch.compile(fn, dynamic=True)
    length = torch.compile(fn)  # called at another length first: the second call recompiles with a symbolic length
    shorter = make_inputs(CAUSAL, dataclasses.replace(shape, M=shape.M // 2, N=shape.N // 2), device="cuda", dtype=dtype)
    length(*shorter[:3])
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    ref = sdpa().double()
    runs = (("static", lambda: static(q, k, v)), ("dynamic length", lambda: length(q, k, v)),
            ("dynamic=True", lambda: every_dim(q, k, v)), ("sdpa", sdpa))
    for name, run in runs:
        err = float((run().double() - ref).norm() / ref.norm())
        ms = triton.testing.do_bench(run, rep=300)
        log(f"  causal {shape.B}x{shape.H}x{shape.M}x{head_dim} {name:14s} {ms:.4f} ms (rel_err vs sdpa {err:.1e})")


def main() -> int:
    paths = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    out_dir = pathlib.Path(paths[0]) if paths else None
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {datetime.date.today()}"]

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    log(lines[0])
    failures = 0
    for variant in VARIANTS.values() if "--timing-only" not in sys.argv else ():
        for idiom, fn in variant.idioms.items():
            failures += not check_idiom(variant, idiom, fn, torch.bfloat16, 64, log)
    for head_dim in (64, 128):
        time_causal(torch.bfloat16, head_dim, log)
    log(f"{failures} idioms failed")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_dynamic_shapes.txt").write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
