"""GPU benchmark of whole Hugging Face models in training (``benchmarks/hf_models.py``): loss curves and step times.

    python -m benchmarks.bench_hf_training --families llama,gemma2,gpt2,bert --steps 50 --out DIR

Each family's base model (random weights, ``bench_hf_models.SIZES`` with the layers given by ``--layers``) gets a
linear head over its vocabulary and learns next-token prediction on a fixed set of random token batches, with
AdamW (fp32 master weights) under bf16 autocast. The implementations start from the same weights and see the same
batches: ``flashlight`` (eager attention, the overlay on), ``compile`` (eager attention, default torch.compile) and
``hf_sdpa_compile`` (the model built with HF's SDPA attention, default torch.compile). The compiled function is the
loss; its backward is AOTAutograd's. Recorded: the loss at every step (``DIR/losses.csv``; the curves should agree
within bf16's rounding, which compounds over the steps), the median step time (forward, backward and optimizer
step, ``triton.testing.do_bench`` after the curve's steps), the peak memory of a step, and the attentions the overlay
fused for training. ``DIR/hf_training.md`` is the summary, with device, versions and date.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
from typing import Any, Callable

import torch

import flashlight

flashlight.enable()  # explicit, so the script also runs from a checkout that is not pip-installed
from benchmarks import hf_models
from benchmarks.bench_attention import start_run
from benchmarks.bench_hf_models import SIZES

IMPLS = ("flashlight", "compile", "hf_sdpa_compile")


def _loss(model: torch.nn.Module, head: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = hf_models.forward(model, ids, None)
        logits = head(hidden[:, :-1]).float()
    targets = ids[:, 1 : hidden.shape[1]]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Trainer:
    """One implementation's model, head, optimizer and compiled loss."""

    def __init__(self, family: hf_models.Family, impl: str, layers: int, state: dict) -> None:
        hidden, heads, _, _, _ = SIZES[family.name]
        attention = "sdpa" if impl == "hf_sdpa_compile" else "eager"
        self.model = hf_models.build(family, hidden, heads, layers, attn_implementation=attention).cuda()
        self.head = torch.nn.Linear(hidden, 1024, bias=False).cuda()
        self.model.load_state_dict(state["model"])  # eval mode (hf_models.build): no dropout, same batches, same curves
        self.head.load_state_dict(state["head"])
        parameters = [*self.model.parameters(), *self.head.parameters()]
        self.optimizer = torch.optim.AdamW(parameters, lr=3e-4, fused=True)
        self.overlay = impl == "flashlight"
        self.loss = torch.compile(lambda ids: _loss(self.model, self.head, ids), dynamic=False)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(ids)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def first_step(self, ids: torch.Tensor) -> torch.Tensor:
        """The step that compiles forward and backward (AOTAutograd compiles the backward at its first call), with
        the overlay on or off."""
        torch._dynamo.reset()
        with flashlight.enabled(self.overlay):
            return self.step(ids)


def train_family(family: hf_models.Family, args: argparse.Namespace, stamp: dict, log: Callable[[str], None]) -> tuple:
    import triton

    hidden, heads, _, batch, tokens = SIZES[family.name]
    torch.manual_seed(0)
    reference = hf_models.build(family, hidden, heads, args.layers)
    state = {"model": reference.state_dict(), "head": torch.nn.Linear(hidden, 1024, bias=False).state_dict()}
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 1024, (batch, tokens), generator=generator).cuda() for _ in range(4)]
    curves, rows = {}, []
    counters = torch._dynamo.utils.counters
    for impl in IMPLS:
        try:
            counters.clear()
            trainer = Trainer(family, impl, args.layers, state)
            torch.cuda.reset_peak_memory_stats()
            losses = [float(trainer.first_step(batches[0]))]
            losses += [float(trainer.step(batches[i % len(batches)])) for i in range(1, args.steps)]
            fused = counters["inductor"]["flashlight_attention_fused_for_training"]
            as_sdpa = counters["inductor"]["flashlight_attention_as_sdpa_for_training"]
            declined = counters["inductor"]["flashlight_training_declined"]
            peak = torch.cuda.max_memory_allocated() / 2**30
            ms = triton.testing.do_bench(lambda: trainer.step(batches[0]), warmup=3, rep=1500, return_mode="median")
        except Exception as error:  # noqa: BLE001  (a failing implementation is a row, not the end of the run)
            log(f"  {family.name} {impl}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        curves[impl] = losses
        rows.append(dict(family=family.name, impl=impl, layers=args.layers, batch=batch, tokens=tokens,
                         step_ms=round(ms, 2), peak_gib=round(peak, 2), fused=fused, as_sdpa=as_sdpa,
                         declined=declined, first_loss=round(losses[0], 4), last_loss=round(losses[-1], 4), **stamp))
        log(f"  {family.name} {impl:16} step {ms:8.2f} ms peak {peak:6.2f} GiB fused={fused} as_sdpa={as_sdpa} "
            f"declined={declined} loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        del trainer
        torch.cuda.empty_cache()
    return rows, curves


def _curve_gap(curves: dict, impl: str) -> str:
    if impl not in curves or "compile" not in curves:
        return ""
    gaps = [abs(a - b) / abs(b) for a, b in zip(curves[impl], curves["compile"])]
    return f"{max(gaps):.2%}"


def markdown(rows: list[dict], curves: dict) -> str:
    lines = ["| family | impl | step ms | vs compile | vs hf_sdpa_compile | peak GiB | fused / as SDPA / declined | "
             "loss first → last | max loss gap to compile |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        same = {r["impl"]: r["step_ms"] for r in rows if r["family"] == row["family"]}
        ratio = lambda base: f"{same[base] / row['step_ms']:.2f}×" if base in same and row["impl"] != base else ""  # noqa: E731
        lines.append(
            f"| {row['family']} | {row['impl']} | {row['step_ms']} | {ratio('compile')} | {ratio('hf_sdpa_compile')} | "
            f"{row['peak_gib']} | {row['fused']} / {row['as_sdpa']} / {row['declined']} | {row['first_loss']} → "
            f"{row['last_loss']} | {_curve_gap(curves.get(row['family'], {}), row['impl'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="llama,gemma2,gpt2,bert")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    stamp, log = start_run(args.out)
    rows, curves = [], {}
    for name in args.families.split(","):
        family_rows, curves[name] = train_family(hf_models.BY_NAME[name], args, stamp, log)
        rows += family_rows
    with (args.out / "losses.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["family", "impl", "step", "loss"])
        for family, by_impl in curves.items():
            for impl, losses in by_impl.items():
                writer.writerows([family, impl, step, f"{loss:.6f}"] for step, loss in enumerate(losses))
    with (args.out / "hf_training.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = markdown(rows, curves)
    (args.out / "hf_training.md").write_text(f"{stamp}\n\n{summary}")
    log(summary)


if __name__ == "__main__":
    main()
