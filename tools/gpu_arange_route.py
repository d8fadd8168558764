"""Run as `PYTHONPATH=. python tools/gpu_arange_route.py FAMILY:FORM,... BxHxSxD,...`.

Written forms (``benchmarks/written_forms.py``) with the arange route on and off (``config.arange_positions_route``,
recompiled for each), in inference: the median time of a call (``triton.testing.do_bench``) and the host's time per
call (200 calls without synchronising, after 30), one process. Where the host's time nears the call's, the call is
bound by the host.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import triton

import flashlight

flashlight.enable()  # explicit, so the script also runs from a checkout that is not pip-installed
from benchmarks.bench_attention import parse_shape
from benchmarks.variants import make_inputs
from benchmarks.written_forms import form_variant
from inductor_overlay import config


def timed(run, q, k, v) -> tuple[float, float]:
    for _ in range(30):
        run(q, k, v)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        run(q, k, v)
    host = (time.perf_counter() - start) / 200 * 1e3
    torch.cuda.synchronize()
    return triton.testing.do_bench(lambda: run(q, k, v), warmup=50, rep=300, return_mode="median"), host


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          datetime.date.today(), flush=True)
    for shape_text in sys.argv[2].split(","):
        shape = parse_shape(shape_text)
        for name in sys.argv[1].split(","):
            variant = form_variant(name)
            q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=torch.bfloat16)
            for route in (True, False):
                torch._dynamo.reset()
                with config.patch(arange_positions_route=route), torch.no_grad():
                    ms, host = timed(torch.compile(lambda q, k, v: variant.reference(q, k, v, **extras)), q, k, v)
                print(f"{name:40} {shape_text:16} route={'on ' if route else 'off'} {ms:8.4f} ms  host/call "
                      f"{host:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
