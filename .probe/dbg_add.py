import torch, math
exec(open('.probe/gpt2_route.py').read().split("q, k, v =")[0])
from inductor_overlay.fx_passes import causal_tensor_route as ctr, block_sparsity as bs
orig = ctr._additive_mask
def dbg(region):
    print("chain", [n.format_node() for n in region.chain]); print("logits", region.logits, "scale", region.logit_scale)
    print("additive_bias", bs.additive_bias(region.chain, region.logits, region.score_root))
    r = orig(region); print("->", r); return r
ctr._additive_mask = dbg
o1 = ctr._tensor_masks
def dbg2(region):
    r = o1(region); print("tensor_masks ->", r, "captured", region.captured, region.captured_sizes); return r
ctr._tensor_masks = dbg2
q, k, v = (torch.randn(1, 2, S, 16, dtype=torch.bfloat16) for _ in range(3)); addmask = addmask.bfloat16()
torch._dynamo.reset()
c = torch.compile(additive)
with torch._inductor.utils.fresh_cache(), testing.cpu_triton(), config.patch(**ROUTE):
    c(q, k, v, addmask)
print("=== steps")
o3 = ctr._mask_check
def dbg3(m):
    r = o3(m); print("mask_check ->", r); return r
ctr._mask_check = dbg3
o4 = ctr._as_sdpa
def dbg4(copies, masks, rows, pv):
    ok = ctr._as_causal_formula(copies, masks, rows)
    copied = ctr.find_attention(copies[pv])
    print("copied", copied if not isinstance(copied, ctr.AttentionRegion) else ([n.format_node() for n in copied.chain], copied.captured))
    print("sdpa_call", ctr.sdpa_call(copied), ctr.sdpa_layout(copied))
    return False
ctr._as_sdpa = dbg4
torch._dynamo.reset()
c = torch.compile(additive)
with torch._inductor.utils.fresh_cache(), testing.cpu_triton(), config.patch(**ROUTE):
    c(q, k, v, addmask)
