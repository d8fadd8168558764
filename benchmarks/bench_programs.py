"""GPU benchmark of the programs FlexAttention cannot express (benchmarks/programs.py) and of an Evoformer block.

    python -m benchmarks.bench_programs --programs diff_attention,evoformer_row_attention --out DIR [--block]

Implementations: ``eager``, ``compile`` (default torch.compile, overlay off), ``flashlight`` (overlay on),
``flashlight_two_kernels`` (``combine_head_groups_in_kernel`` off: DiffAttn's head combination in a kernel of its own), and ``flex`` where FlexAttention approximates the
program. Times are medians of ``triton.testing.do_bench``; every row
is checked against a float32 eager reference (computed in head chunks where the full one would not fit). Results:
``DIR/programs.csv``, ``DIR/programs.md``, ``DIR/log.txt``, with device, versions and date on each row.
"""

from __future__ import annotations

import argparse
import csv
import functools
import inspect
import pathlib
import time
from typing import Any, Callable

import torch

import flashlight

flashlight.enable()  # explicit, so the script also runs from a checkout that is not pip-installed
from benchmarks.bench_attention import (
    FLASHLIGHT_POLICIES,
    cases,
    compiled,
    relative_error,
    speedups,
    start_run,
    wrong_output,
)
from benchmarks.evoformer_block import EvoformerBlock, block_inputs
from benchmarks.programs import PROGRAMS, Program, diff_inputs

# bench_attention's one-feature A/B impls, and DiffAttn's head combination in a kernel of its own.
PROGRAM_POLICIES = {**FLASHLIGHT_POLICIES, "flashlight_two_kernels": {"combine_head_groups_in_kernel": False}}

COLUMNS = "program,impl,size,ms,tflops,rel_err,compile_s,fused,kernels_note,device,torch,triton,date".split(",")


def _flex_diff_attention(q, k, v, lam):
    """FlexAttention over all 2h heads with V repeated per head pair, then the combination (V is copied)."""
    from torch.nn.attention.flex_attention import flex_attention

    b, two_h, m, _ = q.shape
    out = flex_attention(q, k, v.repeat_interleave(2, dim=1)).view(b, two_h // 2, 2, m, -1)
    return out[:, :, 0] - lam * out[:, :, 1]


def _flex_diff_causal(q, k, v, lam, block_mask):
    """As above, causal, with the causal ``BlockMask`` (built before the timed call)."""
    from torch.nn.attention.flex_attention import flex_attention

    b, two_h, m, _ = q.shape
    out = flex_attention(q, k, v.repeat_interleave(2, dim=1), block_mask=block_mask).view(b, two_h // 2, 2, m, -1)
    return out[:, :, 0] - lam * out[:, :, 1]


def _flex_evoformer(q, k, v, mask_bias, pair_bias, gate):
    """FlexAttention over [B·N_seq, H, S, D] with both biases added by a score_mod; the gate outside."""
    from torch.nn.attention.flex_attention import flex_attention

    b, n_seq, s, h, d = q.shape
    mask = mask_bias.reshape(b * n_seq, s)
    pair = pair_bias.reshape(b, h, s, s)

    def biases(score, z, head, row, col):
        return score + mask[z, col] + pair[z // n_seq, head, row, col]

    def heads_first(t):
        return t.transpose(-2, -3).reshape(b * n_seq, h, s, d)

    out = flex_attention(heads_first(q), heads_first(k), heads_first(v), score_mod=biases, scale=d**-0.5)
    return out.view(b, n_seq, h, s, d).transpose(-2, -3) * torch.sigmoid(gate)


def _flex_mla_causal(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask)


def _with_causal_block_mask(approximation: Callable, inputs: dict[str, Any]) -> tuple[Callable, float]:
    """An approximation taking a ``block_mask`` gets the causal one, built here (outside the timed call); the
    build time is reported in the row's note, as the suite does for variants."""
    from torch.nn.attention.flex_attention import create_block_mask

    if "block_mask" not in inspect.signature(approximation).parameters:
        return approximation, 0.0
    start = time.perf_counter()
    m, n = inputs["q"].shape[-2], inputs["k"].shape[-2]
    mask = create_block_mask(lambda b, h, row, col: col <= row, None, None, m, n, device=inputs["q"].device)
    torch.cuda.synchronize()
    return functools.partial(approximation, block_mask=mask), time.perf_counter() - start


FLEX_APPROXIMATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "diff_attention": _flex_diff_attention,
    "diff_attention_two_matmuls": _flex_diff_attention,
    "diff_transformer_causal": _flex_diff_causal,
    "evoformer_row_attention": _flex_evoformer,
    "mla_causal": _flex_mla_causal,
}


def _reference(program: Program, inputs: dict[str, Any]) -> torch.Tensor:
    """float32 eager; for sequences too long to hold the float32 scores at once, one head pair at a time."""
    up = {name: t.float() if t.is_floating_point() else t for name, t in inputs.items()}
    if program.inputs is not diff_inputs or up["q"].shape[-2] < 8192:
        return program.fn(**up)
    q, k, v, lam = up["q"], up["k"], up["v"], up["lam"]
    return torch.cat([program.fn(q[:, i : i + 2], k[:, i : i + 2], v[:, i // 2 : i // 2 + 1], lam)
                      for i in range(0, q.shape[1], 2)], dim=1)


def _time(run: Callable[[], Any]) -> float:
    import triton

    return triton.testing.do_bench(run, warmup=25, rep=150, return_mode="median")


def bench_program(program: Program, size: dict, impls: list[str], stamp: dict, log: Callable) -> list[dict]:
    inputs = program.inputs(**size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = _reference(program, inputs)
    rows = []
    label = "x".join(f"{k}{v}" for k, v in size.items())
    for impl in impls:
        counters = torch._dynamo.utils.counters
        counters.clear()
        compile_s, fn = 0.0, program.fn
        try:
            if impl == "flex":
                if program.name not in FLEX_APPROXIMATIONS:
                    continue
                approximation, mask_s = _with_causal_block_mask(FLEX_APPROXIMATIONS[program.name], inputs)
                start = time.perf_counter()
                run, out = compiled(approximation, overlay=False)(**inputs)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
            elif impl in ("compile", "flashlight", *PROGRAM_POLICIES):
                policy = PROGRAM_POLICIES.get(impl, {})
                start = time.perf_counter()
                run, out = compiled(fn, overlay=impl != "compile", **policy)(**inputs)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
            else:
                run = fn
                out = run(**inputs)
            err = relative_error(out, ref)
            ms = _time(lambda: run(**inputs))
            fused = counters["inductor"]["flashlight_attention_fused"]
            note = f"fallback={counters['inductor']['flashlight_fault_fallback']}"
            if impl == "flex" and mask_s:
                note += f" block_mask_s={mask_s:.3f}"
        except Exception as error:  # a failing implementation is a row with no time, not a dead run
            log(f"  {impl}: FAILED {type(error).__name__}: {str(error)[:300]}")
            ms, err, fused, note = float("nan"), float("nan"), 0, "failed"
        tflops = program.flops(**size) / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
        rows.append(dict(program=program.name, impl=impl, size=label, ms=round(ms, 4), tflops=round(tflops, 1),
                         rel_err=f"{err:.2e}", compile_s=round(compile_s, 2), fused=fused, kernels_note=note, **stamp))
        log(f"  {impl:11} {ms:9.4f} ms {tflops:7.1f} TFLOP/s err {err:.2e} compile {compile_s:.1f}s fused={fused}")
        torch._dynamo.reset()
    del inputs, ref
    torch.cuda.empty_cache()
    return rows


def bench_evoformer_block(stamp: dict, log: Callable, **size: int) -> list[dict]:
    """End to end: the same block and inputs compiled with the overlay off and on, in one run."""
    torch.manual_seed(0)
    block = EvoformerBlock().cuda().to(torch.bfloat16).eval()
    inputs = block_inputs(**size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = block.float()(**{k: t.float() for k, t in inputs.items()})[0]
        block.to(torch.bfloat16)
        rows = []
        for impl in ("eager", "compile", "flashlight"):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            start = time.perf_counter()
            if impl == "eager":
                run, out = block, block(**inputs)
            else:
                run, out = compiled(block, overlay=impl == "flashlight")(**inputs)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start if impl != "eager" else 0.0
            ms = _time(lambda: run(**inputs))
            err = relative_error(out[0], reference)
            fused = torch._dynamo.utils.counters["inductor"]["flashlight_attention_fused"]
            label = "x".join(f"{k}{v}" for k, v in size.items())
            rows.append(dict(program="evoformer_block", impl=impl, size=label, ms=round(ms, 4), tflops="",
                             rel_err=f"{err:.2e}", compile_s=round(compile_s, 2), fused=fused, kernels_note="", **stamp))
            log(f"  block {impl:11} {ms:9.4f} ms err {err:.2e} compile {compile_s:.1f}s fused={fused}")
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| program | size | impl | ms | TFLOP/s | rel err | compile s | vs eager | vs compile | vs flex |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (program, size), impls in cases(rows, ("program", "size")).items():
        for impl, row in impls.items():
            err = f"**wrong** ({row['rel_err']})" if wrong_output(row, impls) else row["rel_err"]
            lines.append(f"| {program} | {size} | {impl} | {row['ms']} | {row['tflops']} | {err} | "
                         f"{row['compile_s']} | " + " | ".join(speedups(impls, impl, ("eager", "compile", "flex"))) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--impls", default="eager,compile,flashlight,flex")
    parser.add_argument("--max-sizes", type=int, default=0, help="only the first N sizes of each program (0: all)")
    parser.add_argument("--size-indices", default="", help="only these gpu_sizes indices, comma-separated (e.g. 6,7,8)")
    parser.add_argument("--block", action="store_true", help="also time an Evoformer block end to end")
    parser.add_argument("--out", default="results/latest")
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out)
    stamp, log = start_run(out_dir)
    rows: list[dict] = []

    def save() -> None:
        with (out_dir / "programs.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        (out_dir / "programs.md").write_text(markdown(rows))

    for name in args.programs.split(","):
        program = PROGRAMS[name]
        sizes = program.gpu_sizes[: args.max_sizes] if args.max_sizes else program.gpu_sizes
        if args.size_indices:
            sizes = [program.gpu_sizes[int(index)] for index in args.size_indices.split(",") if int(index) < len(program.gpu_sizes)]
        for size in sizes:
            log(f"{name} {size}")
            rows += bench_program(program, size, args.impls.split(","), stamp, log)
            save()
    if args.block:
        log("evoformer_block B1 N_seq128 S256 c_m256 c_z128 H8 D32")
        rows += bench_evoformer_block(stamp, log, B=1, N_seq=128, S=256)
        save()


if __name__ == "__main__":
    main()
