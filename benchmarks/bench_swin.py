"""GPU benchmark of whole Swin models (Hugging Face's ``SwinModel`` and ``Swinv2Model``, eager attention, random
weights): the forward pass at 224×224, bf16, no grad.

    python -m benchmarks.bench_swin --batch 64 --out DIR

Swin-B's sizes (embed dim 128, depths 2-2-18-2, heads 4-8-16-32, windows of 7; V2: windows of 8). Implementations
from the same weights and images: ``eager``, ``compile`` (default torch.compile, overlay off), ``flashlight`` (overlay
on) and, where HF offers it, ``hf_sdpa_compile`` (the model built with SDPA attention, under default torch.compile).
Each row: median of ``triton.testing.do_bench``, the norm-wise error against the float32 eager model, and the window
attentions the overlay fused. ``DIR/swin.md`` and ``DIR/swin.csv`` carry device, versions and date.
"""

from __future__ import annotations

import argparse
import csv
import pathlib

import torch

import flashlight

flashlight.enable()  # explicit, so the script also runs from a checkout that is not pip-installed
from benchmarks.bench_attention import compiled, relative_error, start_run

SWIN_B = dict(image_size=224, patch_size=4, num_channels=3, embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32])


def _build(version: int, attention: str) -> torch.nn.Module:
    import transformers

    if version == 1:
        config = transformers.SwinConfig(**SWIN_B, window_size=7, attn_implementation=attention)
        return transformers.SwinModel(config).eval()
    config = transformers.Swinv2Config(**SWIN_B, window_size=8, attn_implementation=attention)
    return transformers.Swinv2Model(config).eval()


def bench(version: int, batch: int, stamp: dict, log) -> list[dict]:
    import triton

    torch.manual_seed(0)
    model = _build(version, "eager").cuda()
    pixels = torch.randn(batch, 3, 224, 224, device="cuda")
    counters = torch._dynamo.utils.counters
    rows = []
    with torch.no_grad():
        reference = model(pixels).last_hidden_state.float()
        model.to(torch.bfloat16)
        images = pixels.to(torch.bfloat16)
        models = {"eager": model, "compile": model, "flashlight": model}
        try:
            sdpa = _build(version, "sdpa").cuda()
            sdpa.load_state_dict(model.state_dict())
            models["hf_sdpa_compile"] = sdpa.to(torch.bfloat16)
        except (ValueError, NotImplementedError) as error:
            log(f"  swin v{version} hf_sdpa_compile: {str(error).splitlines()[0][:120]}")
        for impl, target in models.items():
            counters.clear()
            forward = lambda x, target=target: target(x).last_hidden_state  # noqa: E731
            try:
                if impl == "eager":
                    out, call = forward(images), lambda: forward(images)
                else:
                    compiled_fn, out = compiled(forward, overlay=impl == "flashlight")(images)
                    call = lambda compiled_fn=compiled_fn: compiled_fn(images)  # noqa: E731
                ms = triton.testing.do_bench(call, warmup=5, rep=200, return_mode="median")
            except Exception as error:  # noqa: BLE001  (a failing implementation is a row, not the end of the run)
                log(f"  swin v{version} {impl}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            inductor = counters["inductor"]
            rows.append(dict(model=f"swin_v{version}", impl=impl, batch=batch, ms=round(ms, 3),
                             rel_err=f"{relative_error(out.float(), reference):.2e}",
                             fused=inductor["flashlight_attention_fused"], fallbacks=inductor["flashlight_fault_fallback"],
                             **stamp))
            log(f"  swin v{version} {impl:16} {ms:9.3f} ms err {rows[-1]['rel_err']} fused={rows[-1]['fused']} "
                f"fallbacks={rows[-1]['fallbacks']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--versions", default="1,2")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    stamp, log = start_run(args.out)
    rows = [row for version in args.versions.split(",") for row in bench(int(version), args.batch, stamp, log)]
    with (args.out / "swin.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| model | impl | ms | ours vs it | rel err | window attentions fused |", "|---|---|---|---|---|---|"]
    for row in rows:
        ours = next(r["ms"] for r in rows if r["model"] == row["model"] and r["impl"] == "flashlight")
        lines.append(f"| {row['model']} | {row['impl']} | {row['ms']} | {row['ms'] / ours:.2f}× | {row['rel_err']} | "
                     f"{row['fused']} |")
    (args.out / "swin.md").write_text(f"{stamp}, batch {args.batch}, 224×224, bf16 forward\n\n" + "\n".join(lines) + "\n")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
