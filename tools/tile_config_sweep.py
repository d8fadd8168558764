"""Time the fused kernel with one tile config at a time (GPU), to choose the autotuning space.

    PYTHONPATH=. python tools/tile_config_sweep.py causal,alibi 4x32x4096x64 > sweep.txt
    PYTHONPATH=. python tools/tile_config_sweep.py causal_mask_tensor 8x16x2048x128 128x128x8x3x2,128x128x8x2
    PYTHONPATH=. python tools/tile_config_sweep.py forms_causal:mask_passed_in 1x16x16384x128

A name ``family:form`` times one written form of ``benchmarks/written_forms.py``.
"""

import contextlib
import sys
from typing import Iterator

import torch
import triton
from torch._inductor.utils import fresh_cache

import flashlight
from benchmarks.bench_attention import gpu_stamp, parse_shape
from benchmarks.variants import VARIANTS, make_inputs
from inductor_overlay import config as overlay_config
from inductor_overlay.kernel import online_softmax_attention as kernel

CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (128, 128, 4, 3), (64, 128, 4, 3),
         (128, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 2), (64, 64, 4, 4)],
    128: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 128, 4, 3),
          (128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2)],
}


@contextlib.contextmanager
def only_config(config: tuple[int, int, int, int]) -> Iterator[None]:
    """Compilations inside may give the fused kernel only ``config`` (BLOCK_M, BLOCK_N, warps, stages), from a fresh
    cache (the config is not part of Inductor's cache key), with no fallback to upstream."""
    m, n, warps, stages, *partial = config
    original = kernel.kernel_configs
    chosen = dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages, **({"partial_stages": partial[0]} if partial else {}))
    kernel.kernel_configs = lambda *_, **__: [chosen]
    torch._dynamo.reset()
    try:
        # A config that fails must fail the row, not time upstream's fallback.
        with fresh_cache(), overlay_config.patch(fault_containment=False):
            yield
    finally:
        kernel.kernel_configs = original


def time_with_config(fn, config: tuple[int, int, int, int], *args, **kwargs) -> float:
    """Median ms of ``torch.compile(fn)`` whose fused kernel may use only ``config``; NaN if it does not compile."""
    try:
        with only_config(config):
            compiled = torch.compile(fn)
            compiled(*args, **kwargs)
        return triton.testing.do_bench(lambda: compiled(*args, **kwargs), warmup=25, rep=100, return_mode="median")
    except Exception as err:  # a config that does not compile is a row, not a dead sweep
        print(f"  failed: {type(err).__name__}", flush=True)
        return float("nan")


def _variant(name: str):
    """A variant of the library, or (``family:form``) a written form as a variant of its own."""
    if ":" not in name:
        return VARIANTS[name]
    from benchmarks.written_forms import form_variant

    return form_variant(name)


def main() -> None:
    flashlight.enable()
    print("#", gpu_stamp(), flush=True)
    variants, shapes = sys.argv[1].split(","), sys.argv[2].split(",")
    # Optional third argument: MxNxWARPSxSTAGES[xPARTIAL_STAGES], comma-separated, instead of the candidates.
    chosen = [tuple(int(x) for x in c.split("x")) for c in sys.argv[3].split(",")] if len(sys.argv) > 3 else None
    for shape_text in shapes:
        shape = parse_shape(shape_text)
        for name in variants:
            variant = _variant(name)
            q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=torch.bfloat16)
            for config in chosen or CANDIDATES[shape.D]:
                ms = time_with_config(variant.reference, config, q, k, v, **extras)
                m, n, warps, stages, *partial = config
                partial_text = f" partial_stages={partial[0]}" if partial else ""
                print(f"{name:12} {shape_text:14} BLOCK_M={m:3} BLOCK_N={n:3} warps={warps} stages={stages}{partial_text}"
                      f"  {ms:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
