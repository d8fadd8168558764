"""Attention SDPA computes exactly (plain causal, and unmasked or causal with K/V repeated over query-head groups) goes
to SDPA's kernel under the SDPA policies; everything else stays fused (CPU harness).

The default device list is ("cuda",), so on the CPU the route is off; most tests here turn it on for
the CPU, where SDPA runs its CPU flash kernel, and compare with float64 eager.
"""

import pytest
import sympy
import torch
from torch.testing import FileCheck

from benchmarks import variants
from flashlight import testing
from inductor_overlay import config
from inductor_overlay.fx_passes.block_sparsity import COL, ROW
from inductor_overlay.fx_passes.sdpa_route import masks_above_diagonal
from test.test_attention_fusion import reference

counters = torch._dynamo.utils.counters


def compile_with_route(fn, *args, policy="unmasked_sdpa"):
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy=policy, sdpa_route_devices=("cpu",)):
        return testing.compile_and_get_code(fn, *args)


def bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def causal_from_heads_last(q, k, v):
    """A layer's view of attention: projections [B, S, H·D] split into heads, attended, heads joined again."""
    batch, length, width = q.shape
    heads = width // 16

    def split(t):
        return t.view(batch, length, heads, 16).transpose(1, 2)

    scores = (split(q) @ split(k).transpose(-1, -2)) / 4.0
    upper = torch.triu(torch.ones(length, length, dtype=torch.bool, device=q.device), diagonal=1)
    out = torch.softmax(scores.masked_fill(upper, float("-inf")), dim=-1) @ split(v)
    return out.transpose(1, 2).reshape(batch, length, width)


def causal_softcapped(q, k, v):
    scores = 30 * torch.tanh(q @ k.transpose(-1, -2) / 30)
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def diagonal_masked_too(q, k, v):
    """``n >= m`` masked: row 0 keeps nothing and is NaN in eager; not SDPA's is_causal."""
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(-1)
    return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize(
    "formula, causal",
    [
        (sympy.Gt(COL, ROW), True),
        (sympy.Lt(ROW, COL), True),
        (sympy.Ge(COL, ROW + 1), True),
        (sympy.Le(ROW + 1, COL), True),
        (sympy.Gt(COL - ROW, 0), True),
        (sympy.Ge(COL, ROW), False),
        (sympy.Gt(COL, ROW + 1), False),
        (sympy.Gt(ROW, COL), False),
        (sympy.Gt(2 * COL, 2 * ROW), False),
        (sympy.Or(sympy.Gt(COL, ROW), sympy.Gt(ROW - COL, 64)), False),
        (None, False),
    ],
)
def test_masks_above_diagonal_recognises_exactly_n_greater_than_m(formula, causal):
    assert masks_above_diagonal(formula) is causal


IDIOMS = {"masked_fill": variants.causal_masked_fill, "finfo_min_where": variants.causal_arange_where,
          "gpt2": variants.gpt2_causal_where}


@pytest.mark.parametrize("idiom", [*IDIOMS, "heads_last_layer"])
def test_plain_causal_attention_runs_as_sdpa(idiom):
    if idiom in IDIOMS:
        fn, args = IDIOMS[idiom], [bf16(2, 3, 40, 16) for _ in range(3)]
    else:
        fn, args = causal_from_heads_last, [bf16(2, 40, 32) for _ in range(3)]
    out, code = compile_with_route(fn, *args)
    text = "\n".join(code)
    FileCheck().check("aten._scaled_dot_product_flash_attention_for_cpu").check("True, scale=0.25").run(text)
    assert counters["inductor"]["flashlight_attention_as_sdpa"] == 1
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert not [k for k, kernel in testing.triton_kernels(code).items() if "tl.dot" in kernel]
    assert out.shape == fn(*args).shape
    testing.assert_close_to_reference(out, reference(fn, *args))


def test_a_constant_factor_on_v_stays_on_v_under_the_route():
    def causal_scaled_v(q, k, v):
        return variants.causal_masked_fill(q, k, v * 0.5)

    args = [bf16(2, 3, 40, 16) for _ in range(3)]
    out, code = compile_with_route(causal_scaled_v, *args)
    assert counters["inductor"]["flashlight_attention_as_sdpa"] == 1
    testing.assert_close_to_reference(out, reference(causal_scaled_v, *args))


@pytest.mark.parametrize(
    "case", ["policy_flashlight", "float32", "sliding_window", "softcapped", "diagonal_masked_too", "rectangular"]
)
def test_attention_sdpa_does_not_compute_exactly_stays_fused(case):
    fn, shapes, dtype, policy = variants.causal_masked_fill, [(1, 2, 24, 16)] * 3, torch.bfloat16, "unmasked_sdpa"
    if case == "policy_flashlight":
        policy = "flashlight"
    elif case == "float32":
        dtype = torch.float32
    elif case == "sliding_window":
        fn = variants.sliding_window_masked_fill
    elif case == "softcapped":
        fn = causal_softcapped
    elif case == "diagonal_masked_too":
        fn = diagonal_masked_too
    else:  # 24 queries, 40 keys: the top-left mask, but SDPA's is_causal is only taken for square scores
        shapes = [(1, 2, 24, 16), (1, 2, 40, 16), (1, 2, 40, 16)]
    args = [torch.randn(*shape, dtype=dtype) for shape in shapes]
    out, code = compile_with_route(fn, *args, policy=policy)
    FileCheck().check_not("scaled_dot_product").run("\n".join(code))
    assert counters["inductor"]["flashlight_attention_as_sdpa"] == 0
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(fn, *args))
    if case == "diagonal_masked_too":
        assert out[..., 0, :].isnan().all() and not out[..., 1:, :].isnan().any()


def test_route_follows_the_device_list():
    """The default names only CUDA (measured there); a device type not in the list keeps the fused kernel."""
    assert config.sdpa_route_devices == ("cuda",)
    args = [bf16(1, 2, 24, 16) for _ in range(3)]
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(variants.causal_masked_fill, *args)
    FileCheck().check_not("scaled_dot_product").run("\n".join(code))
    assert [name for name, kernel in testing.triton_kernels(code).items() if "tl.dot" in kernel]
    assert counters["inductor"]["flashlight_attention_as_sdpa"] == 0
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(variants.causal_masked_fill, *args))


GROUPED = {  # fn, q/k/v shapes, causal
    "gqa_causal_repeat_interleave": (variants.gqa_repeat_interleave, [(2, 8, 40, 16), (2, 2, 40, 16), (2, 2, 40, 16)], True),
    "gqa_expand": (variants.gqa_expand, [(2, 8, 40, 16), (2, 2, 40, 16), (2, 2, 40, 16)], False),
    "mqa_expand_cross": (variants.gqa_expand, [(2, 8, 40, 16), (2, 1, 24, 16), (2, 1, 24, 16)], False),
}


@pytest.mark.parametrize("case", GROUPED)
def test_grouped_kv_runs_as_sdpa_reading_kv_in_place(case):
    """GQA/MQA: SDPA gets the unrepeated K and V (enable_gqa); nothing copies them, so the call is the only work.
    The unmasked GQA form is one upstream would rewrite to SDPA itself, after copying the repeated K/V."""
    fn, shapes, causal = GROUPED[case]
    args = [bf16(*shape) for shape in shapes]
    out, code = compile_with_route(fn, *args)
    text = "\n".join(code)
    FileCheck().check("aten._scaled_dot_product_flash_attention_for_cpu").check(
        "True, scale=0.25" if causal else "scale=0.25"
    ).run(text)
    assert ("0.0, True" in text) is causal
    assert counters["inductor"]["flashlight_attention_as_sdpa"] == 1
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert counters["inductor"]["fuse_attention"] == 0
    assert testing.triton_kernels(code) == {}
    testing.assert_close_to_reference(out, reference(fn, *args))


def causal_kv_shared_by_the_batch(q, k, v):
    """One K/V for every batch entry: repeated over a leading dim, which SDPA's GQA layout cannot read."""
    k, v = k.expand(q.shape[0], -1, -1, -1), v.expand(q.shape[0], -1, -1, -1)
    return variants.causal_masked_fill(q, k, v)


def test_kv_repeated_over_the_batch_stays_fused():
    args = [bf16(3, 2, 40, 16), bf16(1, 2, 40, 16), bf16(1, 2, 40, 16)]
    out, code = compile_with_route(causal_kv_shared_by_the_batch, *args)
    FileCheck().check_not("scaled_dot_product").run("\n".join(code))
    assert counters["inductor"]["flashlight_attention_as_sdpa"] == 0
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(causal_kv_shared_by_the_batch, *args))


def test_dynamic_shapes_stay_fused():
    """Symbolic sizes: the route reads no symbolic size or stride (no guards added) and leaves the region fused."""
    args = [bf16(2, 8, 40, 16), bf16(2, 2, 40, 16), bf16(2, 2, 40, 16)]
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="unmasked_sdpa", sdpa_route_devices=("cpu",)):
        out, code = testing.compile_and_get_code(
            variants.gqa_repeat_interleave, *args, compile_options={"dynamic": True}
        )
    FileCheck().check_not("scaled_dot_product").run("\n".join(code))
    assert counters["inductor"]["flashlight_attention_as_sdpa"] == 0
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(variants.gqa_repeat_interleave, *args))
