"""How much would distributing ALiBi's slope over (n - m) gain? The same program written both ways, same process."""
import statistics, torch, triton
from benchmarks.bench_attention import flex_impl, parse_shape, register_sdpa_patterns_under_overlay, relative_error
from benchmarks.variants import VARIANTS, make_inputs, _scale

register_sdpa_patterns_under_overlay("cuda")


def alibi_split(q, k, v, slopes):
    n = torch.arange(k.shape[-2], device=q.device).float()[None, :]
    m = torch.arange(q.shape[-2], device=q.device).float()[:, None]
    s = slopes[:, None, None].float()
    scores = q @ k.transpose(-2, -1) * _scale(q)
    return torch.softmax(scores + (s * n - s * m).to(scores.dtype), dim=-1) @ v


variant = VARIANTS["alibi"]
for shape_text in ("16x16x1024x64", "4x32x4096x64", "8x16x2048x128", "1x16x16384x128"):
    shape = parse_shape(shape_text)
    q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=torch.bfloat16)
    ref = variant.reference(q.float(), k.float(), v.float(), **extras)
    flex, _ = flex_impl(variant, shape, extras)
    runs = {"product": torch.compile(variant.reference, dynamic=False), "split": torch.compile(alibi_split, dynamic=False),
            "flex": flex}
    errs = {name: relative_error(run(q, k, v, **extras), ref) for name, run in runs.items()}
    times = {name: [] for name in runs}
    for _ in range(5):
        for name, run in runs.items():
            times[name].append(triton.testing.do_bench(lambda: run(q, k, v, **extras), warmup=50, rep=200, return_mode="median"))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(shape_text, " ".join(f"{name} {med[name]:.4f} ms (err {errs[name]:.2e})" for name in runs),
          f"split/product {med['product'] / med['split']:.3f}x, split vs flex {med['flex'] / med['split']:.3f}x", flush=True)
    del q, k, v, extras, ref
    torch.cuda.empty_cache()
