"""Run as `PYTHONPATH=. python tools/gpu_hf_models.py [dtype]`. Quick GPU check of test/test_hf_models.py: each
Hugging Face family (``benchmarks/hf_models.py``), one small layer, with and without a padding mask, compiled with
the overlay: every attention fuses, nothing falls back, and the output matches the eager model in the same dtype."""

import datetime
import logging
import sys

import torch
import triton

import flashlight

flashlight.enable()  # explicit, so the script also runs from a checkout that is not pip-installed
import transformers  # noqa: E402

from benchmarks import hf_models  # noqa: E402
from benchmarks.bench_attention import relative_error  # noqa: E402

logging.basicConfig(level=logging.WARNING)
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.bfloat16
# Windows shorter than the 300 tokens, so that rows near the padding see only padded keys.
OVERRIDES = {"mistral": dict(sliding_window=64), "gemma2": dict(sliding_window=64)}
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
      f"transformers {transformers.__version__} {dtype} {datetime.date.today()}", flush=True)
failures = 0
for family in hf_models.FAMILIES:
    for padded in (False, True):
        torch.manual_seed(0)
        model = hf_models.build(family, hidden=512, heads=8, layers=1, **OVERRIDES.get(family.name, {}))
        model = model.cuda().to(dtype)
        ids, mask = hf_models.token_inputs(2, 300, padded, device="cuda")
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        with torch.no_grad():
            expected = hf_models.forward(model, ids, mask)
            out = torch.compile(lambda i, m: hf_models.forward(model, i, m))(ids, mask)
        inductor = counters["inductor"]
        err = relative_error(out.float(), expected.float())
        ok = (inductor["flashlight_attention_fused"] + inductor["flashlight_attention_as_sdpa"]
              == family.attentions_per_layer and inductor["flashlight_fault_fallback"] == 0 and err < 2e-2)
        failures += not ok
        print(f"{'ok ' if ok else 'BAD'} {family.name:12} {'padded' if padded else 'no mask':8} "
              f"fused={inductor['flashlight_attention_fused']} as_sdpa={inductor['flashlight_attention_as_sdpa']} "
              f"fallbacks={inductor['flashlight_fault_fallback']} err={err:.2e}", flush=True)
print(f"failures: {failures}")
sys.exit(1 if failures else 0)
