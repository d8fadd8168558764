"""Re-measure cells where flashlight < flex: both compiled once, then 7 alternating do_bench rounds each."""
import statistics, sys, torch, triton
from benchmarks.bench_attention import compiled, flex_impl, parse_shape, register_sdpa_patterns_under_overlay
from benchmarks.variants import VARIANTS, make_inputs
register_sdpa_patterns_under_overlay("cuda")
for cell in sys.argv[1:]:
    name, shape_text = cell.split(":")
    variant = VARIANTS[name]
    shape = variant.adapt(parse_shape(shape_text))
    q, k, v, extras = make_inputs(variant, shape, device="cuda", dtype=torch.bfloat16)
    ours, _ = compiled(variant.reference, overlay=True)(q, k, v, **extras)
    flex, _ = flex_impl(variant, shape, extras)
    flex(q, k, v)
    times = {"flashlight": [], "flex": []}
    for _ in range(7):
        for impl, run in (("flashlight", ours), ("flex", flex)):
            times[impl].append(triton.testing.do_bench(lambda: run(q, k, v, **extras), warmup=50, rep=200, return_mode="median"))
    med = {impl: statistics.median(ts) for impl, ts in times.items()}
    print(f"{name} {shape_text}: flashlight {med['flashlight']:.4f} ms (range {min(times['flashlight']):.4f}-{max(times['flashlight']):.4f}), "
          f"flex {med['flex']:.4f} ms (range {min(times['flex']):.4f}-{max(times['flex']):.4f}), ratio {med['flex']/med['flashlight']:.3f}", flush=True)
    del q, k, v, extras
    torch.cuda.empty_cache()
