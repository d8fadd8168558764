import torch
from flashlight import testing
from inductor_overlay import config
from inductor_overlay.fx_passes import causal_tensor_route as ctr
from benchmarks.variants import hf_causal_padding_4d
ctr.MIN_WORK = 0
counters = torch._dynamo.utils.counters
ROUTE = dict(sdpa_pattern_policy="unmasked_sdpa", sdpa_route_devices=("cpu",))
q, k, v = (torch.randn(2, 2, 96, 16, dtype=torch.bfloat16) for _ in range(3))
for name, am in [("ones", torch.ones(2, 96, dtype=torch.long)), ("padded", torch.ones(2, 96, dtype=torch.long).index_fill_(1, torch.tensor([0,1,2]), 0))]:
    torch._dynamo.reset(); counters.clear()
    c = torch.compile(hf_causal_padding_4d)
    with torch._inductor.utils.fresh_cache(), testing.cpu_triton(), config.patch(**ROUTE):
        for i in range(3):
            out = c(q, k, v, am)
            ref = hf_causal_padding_4d(q.double(), k.double(), v.double(), am)
            print(name, i, (out.double() - ref).abs().max().item())
    print(name, dict(counters["inductor"]))
am = torch.ones(2, 96, dtype=torch.long).index_fill_(1, torch.tensor([0,1,2]), 0)
ref = hf_causal_padding_4d(q.double(), k.double(), v.double(), am); e = hf_causal_padding_4d(q, k, v, am)
print("refnan", ref.isnan().any().item(), "eager bf16 nan", e.isnan().any().item(), "out nan", out.isnan().any().item(), (out.double()-e.double()).abs().max().item())
