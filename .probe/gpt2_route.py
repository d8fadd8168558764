import torch, math
from flashlight import testing
from inductor_overlay import config
from inductor_overlay.fx_passes import causal_tensor_route
causal_tensor_route.MIN_WORK = 0
counters = torch._dynamo.utils.counters
ROUTE = dict(sdpa_pattern_policy="unmasked_sdpa", sdpa_route_devices=("cpu",))
S = 96
bias = torch.tril(torch.ones(128, 128, dtype=torch.bool)).view(1, 1, 128, 128)
def gpt2_hf(q, k, v):
    w = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    T = q.shape[-2]
    m = bias[:, :, :T, :T]
    mv = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype)
    w = torch.where(m, w, mv)
    return torch.softmax(w, -1) @ v
addmask = torch.zeros(S, S).masked_fill(~torch.tril(torch.ones(S, S, dtype=torch.bool)), float("-inf"))
addmin = torch.zeros(S, S).masked_fill(~torch.tril(torch.ones(S, S, dtype=torch.bool)), torch.finfo(torch.float32).min)
def additive(q, k, v, mask):
    w = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(w, -1) @ v
q, k, v = (torch.randn(1, 2, S, 16, dtype=torch.bfloat16) for _ in range(3)); addmask = addmask.bfloat16(); addmin = addmin.bfloat16().masked_fill(addmin < 0, torch.finfo(torch.bfloat16).min)
for name, fn, extra in [("gpt2_hf", gpt2_hf, ()), ("additive_inf", additive, (addmask,)), ("additive_min", additive, (addmin,))]:
    torch._dynamo.reset(); counters.clear()
    c = torch.compile(fn)
    with torch._inductor.utils.fresh_cache(), testing.cpu_triton(), config.patch(**ROUTE):
        for i in range(3):
            out = c(q, k, v, *extra)
    print(name, dict(counters["inductor"]), (out - fn(q, k, v, *extra)).abs().max().item())
def gpt2_inf(q, k, v):
    w = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    T = q.shape[-2]
    w = torch.where(bias[:, :, :T, :T], w, float("-inf"))
    return torch.softmax(w, -1) @ v
torch._dynamo.reset(); counters.clear()
c = torch.compile(gpt2_inf)
with torch._inductor.utils.fresh_cache(), testing.cpu_triton(), config.patch(**ROUTE):
    for i in range(3):
        out = c(q, k, v)
print("gpt2_inf", dict(counters["inductor"]))
