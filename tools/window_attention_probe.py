"""Run as `PYTHONPATH=. python tools/window_attention_probe.py` on a GPU. Swin-like window attention (bf16): a
per-head bias gathered from a position table plus a window mask, over windows of 7×7 and 8×8 tokens, timed for the
fused kernel, default `torch.compile` (fusion off) and SDPA given bias + mask prebuilt as one additive mask (the
mask's construction not timed); each output checked against float32 eager."""
import torch, triton
import flashlight
from triton.testing import do_bench
from inductor_overlay import config

flashlight.enable()


def swin(q, k, v, table, index, mask):
    windows, heads, area, d = q.shape
    bias = table[index].view(area, area, heads).permute(2, 0, 1).unsqueeze(0)
    scores = (q @ k.transpose(-2, -1)) * d ** -0.5 + bias + mask
    return torch.softmax(scores, dim=-1) @ v


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
for side, windows, heads, d in [(7, 4096, 4, 32), (7, 1024, 8, 32), (7, 256, 16, 32), (7, 64, 32, 32), (8, 4096, 4, 32), (8, 256, 16, 32)]:
    area = side * side
    dev, dt = "cuda", torch.bfloat16
    q, k, v = (torch.randn(windows, heads, area, d, device=dev, dtype=dt) for _ in range(3))
    table = torch.randn((2 * side - 1) ** 2, heads, device=dev, dtype=dt)
    index = torch.randint(0, (2 * side - 1) ** 2, (area * area,), device=dev)
    mask = torch.where(torch.rand(windows, 1, area, area, device=dev) < 0.2, -100.0, 0.0).to(dt)
    args = (q, k, v, table, index, mask)
    ref = swin(*(t.float() if t.is_floating_point() else t for t in args))
    row = {}
    for name, fused in (("compile", False), ("flashlight", True)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with config.patch(attention_fusion=fused, sdpa_pattern_policy="flashlight"):
            fn = torch.compile(swin)
            out = fn(*args)
            ms = do_bench(lambda: fn(*args), warmup=50, rep=300)
        err = float((out.float() - ref).norm() / ref.norm())
        row[name] = (ms, err, torch._dynamo.utils.counters["inductor"]["flashlight_attention_fused"])
    bias_mask = (table[index].view(area, area, heads).permute(2, 0, 1).unsqueeze(0) + mask).contiguous()
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias_mask)
    out = sdpa()
    row["sdpa (mask prebuilt)"] = (do_bench(sdpa, warmup=50, rep=300), float((out.float() - ref).norm() / ref.norm()), 0)
    c, f, s = row["compile"][0], row["flashlight"][0], row["sdpa (mask prebuilt)"][0]
    print(f"window {side} windows {windows} heads {heads} d {d}: " + " ".join(f"{n}={m:.4f}ms(err {e:.1e}, fused {u})" for n, (m, e, u) in row.items())
          + f" | ours vs compile {c / f:.2f}x, vs sdpa {s / f:.2f}x", flush=True)
