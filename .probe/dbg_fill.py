import torch
from flashlight import testing
from inductor_overlay import config
from inductor_overlay.fx_passes import causal_tensor_route as ctr, block_sparsity as bs
ctr.MIN_WORK = 0
ROUTE = dict(sdpa_pattern_policy="unmasked_sdpa", sdpa_route_devices=("cpu",))
o = ctr._tensor_masks
def dbg(region):
    print([n.format_node() for n in region.chain])
    print("fills", bs.fills_absorbing_where_rows_keep_keys(region.chain, region.score_root, region.logits, region.logit_scale))
    r = o(region); print("->", r); return r
ctr._tensor_masks = dbg
o2 = ctr.causal_route_masks
def dbg2(region):
    print("layout", ctr.sdpa_layout(region), ctr.attention_work(region)); return o2(region)
ctr.causal_route_masks = dbg2
import test.test_causal_tensor_route as t
q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.bfloat16) for _ in range(3))
keep = torch.ones(64, 64, dtype=torch.bool).tril()
with testing.cpu_triton(), config.patch(**ROUTE):
    out, code = testing.compile_and_get_code(t.filled_with(-1e30), q, k, v, keep)
