"""DeBERTa-v2 (v3 settings) whole-model forward, bf16, with the fused kernel given one tile config at a time, and the
disentangled attention alone (the standalone program of test_score_matmul_forms) against default compile."""
import torch, triton
import flashlight
flashlight.enable()
from benchmarks import hf_models
from benchmarks.bench_attention import gpu_stamp
from tools.tile_config_sweep import CANDIDATES, time_with_config

print("#", gpu_stamp(), flush=True)
family = hf_models.BY_NAME["deberta-v2"]
torch.manual_seed(0)
model = hf_models.build(family, 1024, 16, 4).cuda().to(torch.bfloat16)
for padded in (False, True):
    ids, mask = hf_models.token_inputs(16, 512, padded, device="cuda")
    with torch.no_grad():
        for config in CANDIDATES[64]:
            ms = time_with_config(lambda i, m: hf_models.forward(model, i, m), config, ids, mask)
            print(f"deberta-v2 B16 S512 padded={padded} config={config} {ms:.4f} ms", flush=True)
