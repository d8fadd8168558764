"""GPU benchmark of whole Hugging Face models (``benchmarks/hf_models.py``): the forward pass, bf16, no grad.

    python -m benchmarks.bench_hf_models --families llama,bert --out DIR [--padding none|padded|both]

Implementations, all from the same weights and tokens: ``eager`` (HF's eager attention), ``compile`` (that model
under default torch.compile, overlay off), ``flashlight`` (overlay on), and ``hf_sdpa_compile``: the model built with
``attn_implementation="sdpa"`` (HF calls SDPA itself) under default torch.compile, the fast path HF offers.
Each row: median of ``triton.testing.do_bench``, the norm-wise error against the float32 model with eager
attention, the first call's compile time, and the attentions the overlay fused or routed to SDPA. Results:
``DIR/hf_models.csv``, ``DIR/hf_models.md``, ``DIR/log.txt``, with device, versions and date on each row.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import time
from typing import Any, Callable

import torch

import flashlight

flashlight.enable()  # explicit, so the script also runs from a checkout that is not pip-installed
from benchmarks import hf_models
from benchmarks.bench_attention import cases, compiled, relative_error, speedups, start_run, wrong_output

COLUMNS = ("family,impl,size,ms,rel_err,compile_s,fused,as_sdpa,fallbacks,transformers,device,torch,triton,date").split(",")
# family -> (hidden, heads, layers, batch, tokens): head dim 128 for the decoders with GQA, 64 for the rest.
SIZES = {
    "llama": (2048, 16, 4, 4, 2048), "mistral": (2048, 16, 4, 4, 2048), "gemma2": (2048, 16, 4, 4, 2048),
    "qwen3": (2048, 16, 4, 4, 2048), "gpt2": (1024, 16, 4, 4, 2048), "gpt_bigcode": (1024, 16, 4, 4, 2048),
    "bloom": (2048, 16, 4, 4, 2048), "bert": (1024, 16, 4, 16, 512), "t5": (1024, 16, 4, 8, 1024),
    "xglm": (1024, 16, 4, 4, 2048), "deberta-v2": (1024, 16, 4, 16, 512),
}


def _time(run: Callable[[], Any]) -> float:
    import triton

    return triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median")


def bench_family(family: hf_models.Family, padded: bool, stamp: dict, log: Callable[[str], None]) -> list[dict]:
    import transformers

    hidden, heads, layers, batch, tokens = SIZES[family.name]
    label = f"h{hidden}xH{heads}xL{layers}xB{batch}xS{tokens}" + ("_padded" if padded else "")
    torch.manual_seed(0)
    model = hf_models.build(family, hidden, heads, layers).cuda()
    ids, mask = hf_models.token_inputs(batch, tokens, padded, device="cuda")
    rows = []
    counters = torch._dynamo.utils.counters
    with torch.no_grad():
        reference = hf_models.forward(model.float(), ids, mask)
        model.to(torch.bfloat16)
        impls = ["eager", "compile", "flashlight"]
        try:
            sdpa_model = hf_models.build(family, hidden, heads, layers, attn_implementation="sdpa").cuda()
            sdpa_model.load_state_dict(model.state_dict())
            sdpa_model.to(torch.bfloat16)
            impls.append("hf_sdpa_compile")
        except ValueError as error:  # BLOOM: HF has no SDPA path for it
            log(f"  {family.name} hf_sdpa_compile: {str(error).splitlines()[0][:120]}")
        for impl in impls:
            counters.clear()
            start = time.perf_counter()
            target = sdpa_model if impl == "hf_sdpa_compile" else model
            try:
                if impl == "eager":
                    out = hf_models.forward(target, ids, mask)
                    call = lambda target=target: hf_models.forward(target, ids, mask)  # noqa: E731
                else:
                    step = compiled(lambda i, m, target=target: hf_models.forward(target, i, m), overlay=impl == "flashlight")
                    compiled_fn, out = step(ids, mask)
                    call = lambda compiled_fn=compiled_fn: compiled_fn(ids, mask)  # noqa: E731
                torch.cuda.synchronize()
            except Exception as error:  # noqa: BLE001  (a failing implementation is a row, not the end of the run)
                log(f"  {family.name} {impl}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            compile_s = time.perf_counter() - start if impl != "eager" else 0.0
            ms = _time(call)
            err = relative_error(out.float(), reference)
            inductor = counters["inductor"]
            rows.append(dict(
                family=family.name, impl=impl, size=label, ms=round(ms, 4), rel_err=f"{err:.2e}",
                compile_s=round(compile_s, 2), fused=inductor["flashlight_attention_fused"],
                as_sdpa=inductor["flashlight_attention_as_sdpa"], fallbacks=inductor["flashlight_fault_fallback"],
                transformers=transformers.__version__, **stamp,
            ))
            log(f"  {family.name} {label} {impl:16} {ms:9.4f} ms err {err:.2e} compile {compile_s:5.1f}s "
                f"fused={rows[-1]['fused']} as_sdpa={rows[-1]['as_sdpa']} fallbacks={rows[-1]['fallbacks']}")
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| family | size | impl | ms | rel err | compile s | fused / as SDPA | vs eager | vs compile | vs HF SDPA compiled |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (family, size), impls in cases(rows, ("family", "size")).items():
        for impl, row in impls.items():
            err = f"**wrong** ({row['rel_err']})" if wrong_output(row, impls) else row["rel_err"]
            ratios = speedups(impls, impl, ("eager", "compile", "hf_sdpa_compile"))
            lines.append(f"| {family} | {size} | {impl} | {row['ms']} | {err} | {row['compile_s']} | "
                         f"{row['fused']} / {row['as_sdpa']} | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(family.name for family in hf_models.FAMILIES))
    parser.add_argument("--padding", choices=("none", "padded", "both"), default="none",
                        help="run without an attention mask, with a padding mask (HF builds its 4-D mask), or both")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    stamp, log = start_run(args.out)
    rows: list[dict] = []
    for name in args.families.split(","):
        for padded in {"none": (False,), "padded": (True,), "both": (False, True)}[args.padding]:
            rows += bench_family(hf_models.BY_NAME[name], padded, stamp, log)
            with (args.out / "hf_models.csv").open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
            (args.out / "hf_models.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
