"""The core fusion: attention in plain PyTorch becomes one online-softmax Triton kernel (CPU harness).

Every test compares with a float64 eager reference on fresh random inputs and pins the kernel structure:
one kernel, one loop over column tiles, two ``tl.dot`` (QKᵀ and PV), the running-max rescale, and no buffer
the size of the score matrix.
"""

import logging
import re

import pytest
import torch
from torch.testing import FileCheck

from benchmarks import variants
from flashlight import testing
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from inductor_overlay import config, ops
from test import attention_programs as programs

counters = torch._dynamo.utils.counters


def fresh(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def reference(fn, *args, **kwargs):
    def up(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return fn(*(up(a) for a in args), **{name: up(t) for name, t in kwargs.items()})


def compile_on_cpu(fn, *args, **kwargs):
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        return testing.compile_and_get_code(fn, *args, **kwargs)


def assert_fused_attention(code, out):
    """One kernel with the online-softmax loop (split in three where a position mask leaves whole tiles visible),
    two dots per loop, no extern matmul, and no buffer but the output: the M×N scores never reach memory. A mask
    passed in as a tensor also has its table reduced by the graph (``block_sparsity.TensorMask``): reduction
    kernels (and the pointwise sum of its two reductions) and buffers of about 1/32 of the mask's elements; an
    additive mask computed in the graph, the table kernel and its scratch of the same size. A mask over positions
    read from memory has their bounds per cell reduced likewise (``mask_tables.position_cells``). A value computed from
    the distance n − m alone (T5's bias) has a pointwise kernel that writes it once per distance."""
    kernels = testing.triton_kernels(code)
    attention = [text for text in kernels.values() if "for start_n in range(" in text]
    assert len(attention) == 1, f"{len(attention)} attention kernels"
    kernel = attention[0]
    table = "cell_states = " in kernel or "row_pos_lo = " in kernel or "col_pos_lo = " in kernel
    distance_tables = counters["inductor"]["flashlight_distance_tables"]
    others = [name for name, text in kernels.items() if text is not kernel]
    reductions = ("triton_per_", "triton_red_", "triton_poi_")
    table_kernels = [name for name in others if name.startswith(reductions) or "ROW_CELL_MAX" in kernels[name]]
    distance_kernels = [name for name in others if distance_tables and name.startswith("triton_poi_")]
    assert not others or (table and table_kernels == others) or (distance_kernels == others), others
    testing.check_kernels(kernel, dots=2 * testing.column_tile_loops(kernel))
    testing.check_kernels(code, extern_calls=0)
    FileCheck().check("for start_n in range(").check("scores = tl.dot(").check("alpha = tl.exp2(").check(
        "acc = tl.dot(p, v, acc * alpha"
    ).check("acc = acc / l_i").run(kernel)
    allocated = testing.allocated_buffer_numels(code)
    extra = list(allocated)
    extra.remove(out.numel())
    if extra:
        rows, columns = out.shape[-2], int(re.search(r"^\s*N = (\d+)$", kernel, re.M)[1])
        batch = out.numel() // (rows * out.shape[-1])
        row_cells_of_rows = -(-rows // 32) * 32 * -(-columns // 32)  # the table's first step: per row, per cell column
        distances = rows + columns - 1  # a distance table: one value per diagonal and batch entry
        assert (table and max(extra) <= batch * row_cells_of_rows) or (
            distance_tables and max(extra) <= batch * distances
        ), f"buffers of {allocated} elements"
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0


IDIOMS = [
    pytest.param(variant.name, idiom, fn, id=f"{variant.name}-{idiom}")
    for variant in variants.VARIANTS.values()
    for idiom, fn in variant.idioms.items()
]


@pytest.mark.parametrize("name,idiom,fn", IDIOMS)
def test_variant_idioms_fuse_and_match_eager(name, idiom, fn):
    variant = variants.VARIANTS[name]
    shape = variants.Shape(B=2, H=4, M=45 if variant.self_attention else 37, N=45, D=16)
    q, k, v, extras = variants.make_inputs(variant, shape)
    out, code = compile_on_cpu(fn, q, k, v, **extras)
    testing.assert_close_to_reference(out, reference(fn, q, k, v, **extras))
    assert_fused_attention(code, out)


LAYOUTS = [
    ("bshd_transposed_in_graph", programs.causal_bshd, [(2, 37, 3, 16)] * 3),
    ("bmm_3d", programs.bmm_3d, [(6, 20, 8), (6, 29, 8), (6, 29, 24)]),
    ("mm_2d", programs.mm_2d, [(20, 8), (5, 8), (5, 4)]),
    ("five_d_leading_batch", variants.softcap_tanh, [(2, 2, 3, 9, 16), (2, 2, 3, 40, 16), (2, 2, 3, 40, 8)]),
    ("scale_on_k", programs.scale_on_k, [(2, 3, 17, 16)] * 3),
]


@pytest.mark.parametrize("name,fn,shapes", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_input_layouts_fuse_and_match_eager(name, fn, shapes):
    args = [fresh(*shape) for shape in shapes]
    out, code = compile_on_cpu(fn, *args)
    assert_fused_attention(code, out)
    testing.assert_close_to_reference(out, reference(fn, *args))


def test_non_contiguous_operands_are_read_in_place():
    q = fresh(2, 3, 16, 9).transpose(-1, -2)
    k = fresh(2, 3, 40, 32)[..., ::2]
    v = fresh(2, 3, 8, 40).transpose(-1, -2)
    slopes = fresh(3)
    out, code = compile_on_cpu(variants.alibi_slopes_tensor, q, k, v, slopes=slopes)
    assert_fused_attention(code, out)
    testing.assert_close_to_reference(out, reference(variants.alibi_slopes_tensor, q, k, v, slopes=slopes))


def _sliced_five_dimensional(q, k, v):
    q, k, v = q[:, :, 1:], k[:, :, 1:], v[:, :, 1:]
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v


def test_symbolic_batch_sizes_that_print_as_sums_index_their_entries():
    """Three batch dims, one sliced, every size symbolic (``dynamic=True``): the sliced size prints as ``(-1) +
    ks1``, and each size in a batch offset keeps its parentheses, so each program reads its own batch entry."""
    q, k, v = (fresh(2, 3, 4, 16, 8) for _ in range(3))
    counters.clear()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        out, code = testing.compile_and_get_code(_sliced_five_dimensional, q, k, v, compile_options={"dynamic": True})
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    [kernel] = [text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text]
    FileCheck().check("q_base = Q + (fl_z // ((").run(kernel)
    testing.assert_close_to_reference(out, reference(_sliced_five_dimensional, q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_accumulate_in_fp32(dtype):
    q, k, v = (fresh(2, 3, 33, 16, dtype=dtype) for _ in range(3))
    out, code = compile_on_cpu(variants.causal_arange_where, q, k, v)
    assert_fused_attention(code, out)
    assert out.dtype == dtype
    testing.assert_close_to_reference(out, reference(variants.causal_arange_where, q, k, v))


@pytest.mark.parametrize(
    "m,n", [(37, 45), (45, 37), (40, 5), (1, 3), (32, 48)], ids=["m<n", "m>n", "n<tile", "single-row", "whole-tiles"]
)
def test_ragged_and_tiny_sequence_lengths(m, n):
    q, k, v = fresh(1, 2, m, 16), fresh(1, 2, n, 16), fresh(1, 2, n, 8)
    out, code = compile_on_cpu(variants.softcap_tanh, q, k, v)
    assert_fused_attention(code, out)
    testing.assert_close_to_reference(out, reference(variants.softcap_tanh, q, k, v))


def test_fully_masked_rows_are_nan_as_in_eager():
    q, k, v = fresh(2, 3, 9, 16), fresh(2, 3, 13, 16), fresh(2, 3, 13, 16)
    keep = torch.rand(2, 1, 9, 13) > 0.4
    keep[0, 0, 3] = False
    keep[1, 0, 0] = False
    out, code = compile_on_cpu(programs.boolean_mask_tensor, q, k, v, keep)
    assert_fused_attention(code, out)
    expected = reference(programs.boolean_mask_tensor, q, k, v, keep)
    assert expected[0, :, 3].isnan().all() and expected[1, :, 0].isnan().all()
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


@pytest.mark.parametrize("length", [32, 37], ids=["whole-tiles", "ragged"])
def test_bias_tensor_loads_at_tile_positions(length):
    q, k, v = fresh(2, 4, length, 16), fresh(2, 4, length, 16), fresh(2, 4, length, 8)
    bias = fresh(4, length, length)
    out, code = compile_on_cpu(variants.per_head_bias, q, k, v, bias)
    assert_fused_attention(code, out)
    FileCheck().check(f"EVEN_N : tl.constexpr = {length % 16 == 0}").run(code[0])
    testing.assert_close_to_reference(out, reference(variants.per_head_bias, q, k, v, bias))


def _causal_scaled_v(q, k, v):
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.softmax((q @ k.transpose(-1, -2) / 4).masked_fill(~keep, float("-inf")), -1) @ (v * 0.5)


def _scaled_v_divided(q, k, v):
    return torch.softmax(q * 0.25 @ k.transpose(-1, -2), -1) @ (v / 3.0)


@pytest.mark.parametrize("fn", [_causal_scaled_v, _scaled_v_divided])
def test_a_constant_factor_on_v_is_kept(fn):
    """A constant factor on q or k moves onto the scores; one on V must stay on V (it once was taken off V too and
    applied nowhere: the output was off by that factor)."""
    args = [fresh(2, 3, 40, 16) for _ in range(3)]
    out, code = compile_on_cpu(fn, *args)
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(fn, *args))


def _projected_keys_product(x, w, k):
    return torch.matmul(x @ w, k.transpose(1, 2))


def test_a_view_that_moves_rows_into_the_batch_declines():
    """``(x @ W) @ kᵀ`` with x of three dims: the first product is a 2-D matmul of the flattened rows, viewed back
    into a batch before the second. It once fused as a product chain whose output had the flattened rows' shape;
    rows moved into the batch between the matmuls now decline."""
    args = [fresh(6, 40, 16), fresh(16, 16), fresh(6, 40, 16)]
    out, code = compile_on_cpu(_projected_keys_product, *args)
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert out.shape == (6, 40, 40)
    testing.assert_close_to_reference(out, reference(_projected_keys_product, *args))


def test_captured_tensors_are_read_at_tile_positions():
    q, k, v = fresh(2, 3, 12, 16), fresh(2, 3, 20, 16), fresh(2, 3, 20, 16)
    attention_mask = (torch.rand(2, 20) > 0.3).long()
    out, code = compile_on_cpu(programs.key_padding_bert, q, k, v, attention_mask)
    assert_fused_attention(code, out)
    testing.assert_close_to_reference(out, reference(programs.key_padding_bert, q, k, v, attention_mask))


def test_head_dim_256_is_one_tile_and_larger_declines(caplog):
    q, k, v = fresh(1, 1, 8, 256), fresh(1, 1, 8, 256), fresh(1, 1, 8, 256)
    out, code = compile_on_cpu(variants.softcap_tanh, q, k, v)
    assert_fused_attention(code, out)
    FileCheck().check("D_TILE : tl.constexpr = 256").run(code[0])
    counters.clear()
    q, k, v = fresh(1, 1, 8, 320), fresh(1, 1, 8, 320), fresh(1, 1, 8, 320)
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, code = compile_on_cpu(variants.softcap_tanh, q, k, v)
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert "head dim 320 exceeds 256" in caplog.text
    testing.assert_close_to_reference(out, reference(variants.softcap_tanh, q, k, v))


@pytest.mark.parametrize(
    "fn,reason",
    [
        (programs.returns_probabilities, "is also used outside the attention (rule 4)"),
        (programs.softmax_over_rows, "do not both reduce the last dim"),
    ],
    ids=["probabilities-returned", "softmax-over-rows"],
)
def test_illegal_rewrites_decline_with_a_reason_and_stay_correct(fn, reason, caplog):
    q, k, v = (fresh(2, 3, 11, 16) for _ in range(3))
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, code = compile_on_cpu(fn, q, k, v)
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert counters["inductor"]["flashlight_attention_declined"] == 1
    assert reason in caplog.text
    expected = reference(fn, q, k, v)
    for actual, wanted in zip(out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)):
        testing.assert_close_to_reference(actual, wanted)


def _dynamic_attention_kernel(code):
    """The one attention kernel of a dynamic-shape graph, checked like ``assert_fused_attention``: the loop, the
    dots, no extern matmul, and one buffer (the output, symbolic: the scores never reach memory)."""
    kernels = [text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text]
    assert len(kernels) == 1, f"{len(kernels)} attention kernels"
    testing.check_kernels(kernels[0], dots=2 * testing.column_tile_loops(kernels[0]))
    testing.check_kernels(code, extern_calls=0)
    assert len(testing.allocated_buffer_numels(code)) == 1, "a buffer besides the output"
    return kernels[0]


@pytest.mark.parametrize("idiom, skips_tiles", [("masked_fill", True), ("arange_where", False), ("triu_additive", True)])
def test_dynamic_sequence_length_fuses_masks_built_from_the_length(idiom, skips_tiles):
    """Dynamo recompiles with a symbolic length when the length changes; masks built from it (``ones(s, s).tril()``,
    ``arange(s)``) pass the symbol into the kernel's chain, so the dynamic graph fuses too, with block skipping
    where the mask is -inf (``arange_where`` masks with finfo.min: no tile is skippable)."""
    fn = variants.CAUSAL.idioms[idiom]
    sources = []
    with testing.cpu_triton():
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        for length in (17, 40, 33, 24):  # 40: Dynamo recompiles with a symbolic length, which 33 and 24 reuse
            q, k, v = (fresh(1, 2, length, 16) for _ in range(3))
            out, code = testing.run_keeping_graphs_and_get_code(compiled, q, k, v)
            sources.append(code)
            testing.assert_close_to_reference(out, reference(fn, q, k, v))
    assert [len(code) for code in sources] == [1, 1, 0, 0], "a static graph, then one dynamic graph reused"
    assert counters["inductor"]["flashlight_attention_fused"] == 2
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    kernel = _dynamic_attention_kernel(sources[1])
    FileCheck().check("M = ks").check("N = ks").run(kernel)  # the lengths are kernel arguments
    if skips_tiles:
        FileCheck().check("for scan_n in range(").check("masked = (").check("for start_n in range(").run(kernel)
    else:
        # (One loop over the tiles, split where they leave the bounds: the length is not known to divide the tile.)
        FileCheck().check_not("for scan_n in range(").check("for start_n in range(first_n, split_n, BLOCK_N)").check(
            "for start_n in range(split_n, end_n, BLOCK_N)").run(kernel)


def test_every_dim_dynamic_fuses_and_specialises_the_head_dim():
    """``dynamic=True``: batch, heads and length stay symbolic; the head dim (a tile size, and here a 1/sqrt(D)
    scale in the chain) is specialised, so another head dim compiles again and is still right."""
    fn = variants.causal_masked_fill
    sources = []
    with testing.cpu_triton():
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=True)
        for shape in ((2, 2, 24, 16), (3, 3, 19, 16), (2, 2, 21, 32)):  # (sizes of 1 would be specialised)
            q, k, v = (fresh(*shape) for _ in range(3))
            out, code = testing.run_keeping_graphs_and_get_code(compiled, q, k, v)
            sources.append(code)
            testing.assert_close_to_reference(out, reference(fn, q, k, v))
    assert [len(code) for code in sources] == [1, 0, 1], "batch, heads and length symbolic; a new head dim compiles"
    for code in (sources[0], sources[2]):
        _dynamic_attention_kernel(code)
    assert counters["inductor"]["flashlight_attention_fused"] == 2
    assert counters["inductor"]["flashlight_attention_declined"] == 0
    assert counters["inductor"]["flashlight_fault_fallback"] == 0


def test_fusion_flag_off_leaves_upstream_kernels():
    q, k, v = (fresh(1, 2, 12, 16) for _ in range(3))
    with config.patch(attention_fusion=False):
        out, code = compile_on_cpu(variants.causal_masked_fill, q, k, v)
    FileCheck().check_count("extern_kernels.bmm", 2, exactly=True).run("\n".join(code))
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    testing.assert_close_to_reference(out, reference(variants.causal_masked_fill, q, k, v))


@pytest.mark.parametrize("policy", ["sdpa", "flashlight", "unmasked_sdpa"])
def test_sdpa_pattern_policy_decides_who_takes_vanilla_attention(policy):
    q, k, v = (fresh(1, 2, 12, 16) for _ in range(3))
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy=policy):
        out, code = testing.compile_and_get_code(variants.vanilla_matmul, q, k, v)
    text = "\n".join(code)
    if policy in ("sdpa", "unmasked_sdpa"):
        FileCheck().check("scaled_dot_product").run(text)
        assert counters["inductor"]["flashlight_attention_fused"] == 0
    else:
        FileCheck().check_not("scaled_dot_product").run(text)
        assert_fused_attention(code, out)
    testing.assert_close_to_reference(out, reference(variants.vanilla_matmul, q, k, v))


def test_dynamic_sequence_length_fuses_when_the_chain_needs_no_dynamic_size():
    def softcapped(q, k, v):
        return torch.softmax(50 * torch.tanh(q @ k.transpose(-1, -2) * 0.125 / 50), dim=-1) @ v

    with testing.cpu_triton():
        compiled = torch.compile(softcapped)
        for length in (17, 40, 33):
            q, k, v = (fresh(1, 2, length, 16) for _ in range(3))
            for tensor in (q, k, v):
                torch._dynamo.mark_dynamic(tensor, 2)
            testing.assert_close_to_reference(compiled(q, k, v), reference(softcapped, q, k, v))
    assert counters["inductor"]["flashlight_attention_fused"] == 1, "one dynamic graph, fused once"
    assert counters["inductor"]["flashlight_fault_fallback"] == 0


def test_two_attention_layers_in_one_graph_both_fuse():
    def two_layers(x, wq, wk, wv):
        for _ in range(2):
            q, k, v = (torch.einsum("bsd,de->bse", x, w).view(2, 24, 4, 8).transpose(1, 2) for w in (wq, wk, wv))
            x = x + variants.causal_masked_fill(q, k, v).transpose(1, 2).reshape(2, 24, 32)
        return x

    x, weights = fresh(2, 24, 32), [fresh(32, 32) * 0.2 for _ in range(3)]
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(two_layers, x, *weights)
    assert counters["inductor"]["flashlight_attention_fused"] == 2
    (fused_kernel,) = [name for name in testing.triton_kernels(code) if name.startswith("triton_tem_")]
    FileCheck().check_count(f"{fused_kernel}.run(", 2, exactly=True).run("\n".join(code))  # one kernel, two calls
    testing.assert_close_to_reference(out, reference(two_layers, x, *weights), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("limit, dtype", [(200, "tl.int64"), (10**9, "tl.int32")])
def test_positions_are_int64_when_a_tensor_the_chain_reads_is_too_large_for_int32(monkeypatch, limit, dtype):
    """Inductor sizes a template's index dtype by its named inputs (q, kᵀ, v) and output; a per-head bias the chain
    reads can be far larger ([H, S, S] at S = 16k is 4.3e9 elements, past int32). The positions the chain indexes
    it with are int64 then. Here "too large for int32" is lowered to 200 elements: q, k, v and the output (96
    each) fit, the bias (288) does not."""
    from inductor_overlay.kernel import online_softmax_attention as kernel

    monkeypatch.setattr(kernel, "expr_fits_within_32bit", lambda size: int(size) < limit)
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    bias = torch.randn(2, 12, 12)

    def biased(q, k, v, bias):
        return torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v

    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(biased, q, k, v, bias)
    kernel_source = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check(f"POSITION_DTYPE : tl.constexpr = {dtype}").check("fl_m = offs_m[:, None].to(POSITION_DTYPE)").run(
        kernel_source
    )
    testing.assert_close_to_reference(out, biased(q.double(), k.double(), v.double(), bias.double()))


def test_several_tile_configs_autotune_on_the_cpu_harness(monkeypatch):
    """The GPU autotunes among several configs, the CPU harness has one: with two here, every choice must render
    from the same template and inputs (a mismatch falls back to upstream, which fault containment would hide)."""
    from inductor_overlay.kernel import online_softmax_attention as kernel

    configs = [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1), dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)]
    monkeypatch.setattr(kernel, "kernel_configs", lambda *_, **__: configs)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    keep = torch.ones(64, 64, dtype=torch.bool).tril()

    def masked(q, k, v, keep):
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")), dim=-1) @ v

    with testing.cpu_triton(), config.patch(fault_containment=False):
        out, code = testing.compile_and_get_code(masked, q, k, v, keep)
    FileCheck().check("cell_states = ").check("for start_n in range(").run("\n".join(testing.triton_kernels(code).values()))
    testing.assert_close_to_reference(out, masked(q.double(), k.double(), v.double(), keep))


def test_pipeline_stages_leave_room_for_score_sized_tensors():
    """Each pipeline stage holds the tiles of every score-sized tensor the chain reads beside K and V: at head
    dim 128 the 128×128 config keeps three stages without one, two with a boolean mask or a 16-bit bias (three
    would not fit the H100's 227 KiB), so autotuning never pays for a config that cannot run."""
    from inductor_overlay.kernel import online_softmax_attention as kernel

    def stages(element_bytes):
        configs = kernel.kernel_configs(128, 128, torch.device("cuda"), element_bytes=element_bytes, columns=8192)
        return {(c["BLOCK_M"], c["BLOCK_N"]): c["num_stages"] for c in configs}

    assert stages(0)[(128, 128)] == 3
    assert stages(1)[(128, 128)] == 2 and stages(2)[(128, 128)] == 2
    assert stages(1)[(64, 64)] == 3


def test_tile_configs_are_autotuned_only_under_max_autotune_by_default():
    """Outside max-autotune the first config of the pruned list is compiled alone (no benchmarking step), as
    FlexAttention does; which one depends on the case: rows with a score-sized bias get 128-row tiles, 64 columns
    wide over long rows, 32 over short ones (64-row tiles at rows of 256); at head dim 128 a chain whose tiles
    mostly run the visible loop gets 128×128 over rows longer than 1024, others 64×64, unless a mask table decides
    the tiles; DiffAttn's head pairs get 8 warps under a causal mask."""
    from torch._inductor import config as inductor_config

    from inductor_overlay.kernel import online_softmax_attention as kernel

    cuda = torch.device("cuda")
    long_biased = kernel.kernel_configs(128, 128, cuda, element_bytes=2, columns=2048)
    assert long_biased[0] == dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    assert kernel.kernel_configs(128, 128, cuda, element_bytes=2, columns=1024)[0] == dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3)
    assert kernel.kernel_configs(128, 128, cuda, element_bytes=2, columns=256)[0] == dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)
    assert kernel.kernel_configs(128, 128, cuda)[0] == dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    # A gather per logit (T5's distance table): 128×32 at head dim 128; head dim 64 keeps 64×64.
    assert kernel.kernel_configs(128, 128, cuda, gathers=True)[0] == dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3)
    assert kernel.kernel_configs(64, 64, cuda, gathers=True) == kernel.kernel_configs(64, 64, cuda)
    wide = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    assert kernel.kernel_configs(128, 128, cuda, columns=2048, visible_loop=True)[0] == wide
    assert kernel.kernel_configs(128, 128, cuda, columns=1024, visible_loop=True)[0]["BLOCK_N"] == 64
    # A mask tensor's kernel reads its mask only on the partial tiles: 128×128, with the stages that fit beside it,
    # at rows of 1024 and over rows longer than 4096, 64×64 between; the visible loop keeps the stages that fit
    # without the mask's tiles, the partial tiles' loop gets two. A table over a mask not read per score (computed
    # by the chain, or broadcast over the rows): 128×64 over long rows, 64×64 over short ones, every stage in both
    # loops.
    for columns in (1024, 2048, 4096, 8192):
        mask_tensor = kernel.kernel_configs(128, 128, cuda, element_bytes=1, columns=columns, visible_loop=True, mask_table=True)
        side = 64 if columns in (2048, 4096) else 128
        warps = 4 if side == 64 else 8
        assert mask_tensor[0] == dict(BLOCK_M=side, BLOCK_N=side, num_warps=warps, num_stages=3, partial_stages=2)
    computed = [kernel.kernel_configs(128, 128, cuda, columns=n, visible_loop=True, mask_table=True)[0] for n in (1024, 2048)]
    assert computed == [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3), long_biased[0]]
    assert "partial_stages" not in kernel.kernel_configs(64, 64, cuda, columns=2048, visible_loop=True, mask_table=True)[0]
    # A float32 bias read per score beside the mask: the visible loop still reads it, and gets the stages that fit.
    beside_bias = kernel.kernel_configs(128, 128, cuda, element_bytes=5, columns=8192, visible_loop=True, mask_table=True,
                                        visible_element_bytes=4)[0]
    assert beside_bias == dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=1, partial_stages=1)
    beside_bias = kernel.kernel_configs(128, 128, cuda, element_bytes=5, columns=2048, visible_loop=True, mask_table=True,
                                        visible_element_bytes=4)[0]
    assert beside_bias == dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, partial_stages=2)
    # At head dim 64, a table over a mask broadcast over the rows (key padding, a [B, H, 1, N] bias) takes 128×64 with
    # 8 warps over rows longer than 1024; a mask that varies along the rows keeps 64×64.
    rows_alike = lambda n: kernel.kernel_configs(64, 64, cuda, columns=n, visible_loop=True, mask_table=True, mask_rows_alike=True)[0]  # noqa: E731
    assert rows_alike(2048) == dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    assert rows_alike(1024) == kernel.kernel_configs(64, 64, cuda, columns=2048, visible_loop=True, mask_table=True)[0]
    assert rows_alike(1024)["BLOCK_M"] == 64
    # DiffAttn's head pairs (Q·K at 64, P·V at 128): 4 warps unmasked, 8 under a causal mask.
    assert kernel.kernel_configs(64, 128, cuda)[0] == dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4)
    assert kernel.kernel_configs(64, 128, cuda, visible_loop=True)[0] == dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    assert config.tile_autotuning == "max-autotune"
    assert kernel._autotuned(long_biased) == long_biased[:1]
    with inductor_config.patch(max_autotune=True):
        assert kernel._autotuned(long_biased) == long_biased
    with config.patch(tile_autotuning="always"):
        assert kernel._autotuned(long_biased) == long_biased


def test_light_chains_get_wide_tiles_over_long_rows():
    """Over rows longer than 1024, a chain that only does arithmetic per logit (ALiBi) and masks nothing gets
    128×128 tiles: 4 warps at head dim 64, 8 at 128; plain attention gets them at head dim 128 only. Short rows,
    a mask's visible loop at head dim 64, a bias tensor and a gather keep their tiles."""
    from inductor_overlay.kernel import online_softmax_attention as kernel

    cuda = torch.device("cuda")
    first = lambda *args, **kw: kernel.kernel_configs(*args, cuda, **kw)[0]  # noqa: E731
    wide = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    assert first(64, 64, columns=2048, chain_weight="light") == dict(wide, num_warps=4)
    assert first(64, 64, columns=2048, chain_weight="none") == first(64, 64, columns=2048)
    assert first(64, 64, columns=2048)["BLOCK_M"] == 64
    assert first(128, 128, columns=2048, chain_weight="light") == first(128, 128, columns=2048, chain_weight="none") == wide
    for head_dim in (64, 128):
        assert first(head_dim, head_dim, columns=1024, chain_weight="light") == first(head_dim, head_dim, columns=1024)
        assert first(head_dim, head_dim, columns=2048, chain_weight="light", element_bytes=2) == first(
            head_dim, head_dim, columns=2048, element_bytes=2)
    assert first(64, 64, columns=2048, chain_weight="light", visible_loop=True) == first(64, 64, columns=2048, visible_loop=True)
    assert first(128, 128, columns=2048, chain_weight="light", gathers=True) == first(128, 128, columns=2048, gathers=True)


def test_id_masks_keep_small_tiles_up_to_rows_of_4096():
    """Document ids at head dim 128: 64×64 tiles up to rows of 4096 (partial tiles along the documents' edges),
    128×128 over longer rows, where other visible-loop chains take it from 2048."""
    from inductor_overlay.kernel import online_softmax_attention as kernel

    cuda = torch.device("cuda")
    wide = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    small = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    document = [kernel.kernel_configs(128, 128, cuda, columns=n, visible_loop=True, id_mask=True, chain_weight="light")[0]
                for n in (2048, 4096, 8192)]
    assert document == [small, small, wide]
    assert kernel.kernel_configs(128, 128, cuda, columns=2048, visible_loop=True)[0] == wide


def _aten_chain(fn, *shapes):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*(torch.randn(shape) for shape in shapes))


def test_score_chain_weight():
    from inductor_overlay.fx_passes.attention_fusion import score_chain_weight

    def alibi(scores, rows, columns):
        return scores * 0.125 + torch.pow(2.0, -rows[0, 0]) * (columns - rows)

    def softcap(scores):
        return 50.0 * torch.tanh(scores / 50.0)

    def sigmoid_gate(scores, bias):
        return torch.sigmoid(scores) + bias

    assert score_chain_weight(_aten_chain(alibi, (4, 8), (4, 1), (1, 8))) == "light"  # pow of a head value
    assert score_chain_weight(_aten_chain(softcap, (4, 8))) == "heavy"
    assert score_chain_weight(_aten_chain(sigmoid_gate, (4, 8), (1, 8))) == "heavy"
    assert score_chain_weight(_aten_chain(lambda scores: scores.float(), (4, 8))) == "none"


def test_chain_weight_and_id_masks_reach_the_tile_choice(monkeypatch):
    from inductor_overlay.kernel import online_softmax_attention as kernel

    seen, original = [], kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *args, **kw: seen.append((kw["chain_weight"], kw["id_mask"])) or original(*args, **kw))
    shape = variants.Shape(B=1, H=4, M=64, N=64, D=16)
    idiom = lambda name: next(iter(variants.VARIANTS[name].idioms.values()))  # noqa: E731
    # (inputs of, program, expected): ALiBi under a causal mask is light arithmetic, but its mask's tiles rule.
    cases = (("alibi", idiom("alibi"), ("light", False)), ("softcap", idiom("softcap"), ("heavy", False)),
             ("vanilla", idiom("vanilla"), ("none", False)), ("document", idiom("document"), ("heavy", True)),
             ("alibi", causal_alibi, ("heavy", False)))
    for name, fn, weight in cases:
        q, k, v, extras = variants.make_inputs(variants.VARIANTS[name], shape, dtype=torch.bfloat16)
        out, _ = compile_on_cpu(fn, q, k, v, **extras)
        testing.assert_close_to_reference(out, reference(fn, q, k, v, **extras))
        assert seen[-1] == weight, fn.__name__


def causal_alibi(q, k, v, slopes):
    rows, columns = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + slopes[:, None, None] * (columns - rows)
    return torch.softmax(scores.masked_fill(columns > rows, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize(
    "extra,expected",
    [("none", 0), ("mask", 1), ("bias", 4), ("row_bias", 0), ("sliced_mask", 1), ("padding_rows", 0)],
    ids=["no-tensor", "mask", "bias", "broadcast-bias", "sliced-buffer-mask", "padding-vectors"],
)
def test_configs_are_told_the_bytes_the_chain_reads_per_score(monkeypatch, extra, expected):
    """A [M, N] mask (1 byte) or float32 bias (4) is read at every score, and so is a longer mask the chain slices
    to the scores (GPT-2's ``bias[:, :, :T, :T]`` buffer); a bias broadcast over rows is not, nor is one row of a
    ``[B, N]`` padding tensor however many rows it has."""
    from inductor_overlay.kernel import online_softmax_attention as kernel

    seen, original = [], kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *args, **kw: seen.append(kw["element_bytes"]) or original(*args, **kw))
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    tensors = {"none": None, "mask": torch.rand(40, 40) > 0.3, "bias": torch.randn(2, 40, 40), "row_bias": torch.randn(2, 1, 40),
               "sliced_mask": torch.rand(1, 1, 56, 56) > 0.3, "padding_rows": torch.rand(48, 40) > 0.3}

    def program(q, k, v, t):
        scores = q @ k.transpose(-2, -1)
        if t is None:
            return torch.softmax(scores, dim=-1) @ v
        if t.dim() == 4:
            t = t[:, :, : q.shape[-2], : k.shape[-2]]
        if t.shape[0] == 48:
            t = t[:1, None, None, :]
        return torch.softmax(scores.masked_fill(~t, float("-inf")) if t.dtype == torch.bool else scores + t, dim=-1) @ v

    out, code = compile_on_cpu(program, q, k, v, tensors[extra], fresh_cache=True)
    assert seen == [expected]
    testing.assert_close_to_reference(out, reference(program, q, k, v, tensors[extra]))


def test_the_visible_loop_is_told_what_it_still_reads_per_score(monkeypatch):
    """Beside a mask tensor the visible loop drops, a bias read per score stays in it: the configs are told both
    (all the bytes, and those of the visible loop), so that its stages fit shared memory."""
    from inductor_overlay.kernel import online_softmax_attention as kernel

    seen, original = [], kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *args, **kw: seen.append(
        (kw["element_bytes"], kw["visible_element_bytes"])) or original(*args, **kw))
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    bias, keep = torch.randn(1, 2, 56, 56), torch.ones(40, 40, dtype=torch.bool).tril()

    def program(q, k, v, bias, keep):
        scores = q @ k.transpose(-2, -1) + bias[:, :, : q.shape[-2], : k.shape[-2]]
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v

    out, code = compile_on_cpu(program, q, k, v, bias, keep, fresh_cache=True)
    assert seen == [(5, 4)]
    assert "for start_n in range(full_lo, full_hi" in "\n".join(testing.triton_kernels(code).values())
    testing.assert_close_to_reference(out, reference(program, q, k, v, bias, keep))


@pytest.mark.parametrize("mask_shape,boolean,alike", [((2, 1, 1, 40), True, True), ((1, 1, 40, 40), True, False),
                                                      ((2, 2, 1, 40), False, True)],
                         ids=["key-padding", "full-mask", "per-entry-and-head-bias"])
def test_configs_are_told_whether_the_tables_mask_is_the_same_on_every_row(monkeypatch, mask_shape, boolean, alike):
    """A mask or bias broadcast over the rows (key padding ``[B, 1, 1, N]``, a bias ``[B, H, 1, N]``) is told apart
    from one that varies along them: its tile choice differs (``kernel_configs``)."""
    from inductor_overlay.kernel import online_softmax_attention as kernel

    seen, original = [], kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *args, **kw: seen.append(kw["mask_rows_alike"]) or original(*args, **kw))
    q, k, v = (torch.randn(2, 2, 40, 16) for _ in range(3))
    t = torch.rand(mask_shape) > 0.3 if boolean else torch.randn(mask_shape)

    def program(q, k, v, t):
        scores = q @ k.transpose(-2, -1)
        return torch.softmax(scores.masked_fill(~t, float("-inf")) if t.dtype == torch.bool else scores.float() + t, dim=-1) @ v

    if boolean:
        t[..., 0] = True  # every row keeps a key
    out, _ = compile_on_cpu(program, q, k, v, t, fresh_cache=True)
    assert seen == [alike]
    testing.assert_close_to_reference(out, reference(program, q, k, v, t))


class _KeepPostGradModule(CustomGraphPass):
    """Keeps the post-grad graph's module, after every pass, so that a test can run it on its own."""

    def __init__(self):
        self.modules = []

    def __call__(self, graph):
        self.modules.append(graph.owning_module)

    def uuid(self):
        return None  # not cached


@pytest.mark.parametrize("name", ["causal", "document", "hf_decoder_mask"])
def test_the_fused_node_describes_itself(name):
    """The fused node carries everything it needs: its chain (and the chain without masks, the id subgraphs, the
    mask table's bias) as subgraphs of the graph's own module, its decisions as plain data. Printed, the graph shows
    them; run eagerly on its own, the node computes the attention (no process state is consulted)."""
    from torch._inductor.compile_fx import compile_fx

    variant = variants.VARIANTS[name]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=2, H=2, M=40, N=40, D=16))
    keep, graph_inputs = _KeepPostGradModule(), []

    def backend(graph_module, example_inputs):  # Inductor, keeping the inputs Dynamo hands the graph
        graph_inputs.append(list(example_inputs))
        return compile_fx(graph_module, example_inputs)

    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        with inductor_config.patch(post_grad_custom_post_pass=keep):
            out = torch.compile(variant.reference, backend=backend)(q, k, v, **extras)
    (module,), (inputs,) = keep.modules, graph_inputs
    assert sum(node.target is ops.online_softmax_attention for node in module.graph.nodes) == 1
    printed = module.print_readable(print_output=False)
    FileCheck().check("score_chain_0 = self.score_chain_0").check("online_softmax_attention(").check(
        "'graph_module': score_chain_0"
    ).check("'softmax': True").check("class score_chain_0(torch.nn.Module)").run(printed)
    if name == "hf_decoder_mask":
        assert any(node.target is ops.mask_cell_states_of for node in module.graph.nodes)
    expected = reference(variant.reference, q, k, v, **extras)
    eager = module(*inputs)
    eager = eager[0] if isinstance(eager, (tuple, list)) else eager
    testing.assert_close_to_reference(eager.view(expected.shape), expected)
    testing.assert_close_to_reference(out, expected)

