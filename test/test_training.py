"""Training: attention whose inputs require grad compiles into a fused forward and a fused backward (CPU harness).

Every idiom of the variant library is compiled with q, k and v requiring grad and run forward and backward under
the Triton interpreter; the output and the three gradients are checked against float64 eager autograd on fresh
random inputs and upstream gradients (outputs poisoned), and the generated code is pinned: a forward kernel that
stores the rows' statistics, a backward kernel with its two loops (dK and dV per column tile, dQ per row tile), the
user's chain and its derivative inside, and no buffer as large as the score matrix in either graph.
"""

import logging
import math
import re

import pytest
import torch
from torch.testing import FileCheck

from benchmarks import programs, variants
from flashlight import testing
from inductor_overlay import config, ops
from inductor_overlay.fx_passes import attention_training
from inductor_overlay.kernel import attention_backward, online_softmax_attention

counters = torch._dynamo.utils.counters

# The CI tier: one idiom of each kind of chain (position masks, a mask tensor, ids, a bias read through a gather,
# a soft-cap, logits near -FLT_MAX, GQA); the full tier runs every idiom.
CI_IDIOMS = {
    ("causal", "masked_fill"), ("causal_mask_tensor", "boolean_passed_in"), ("document", "ids_equal"),
    ("t5_bias", "bucket_gather"), ("gemma2", "softcap_window_fp32"), ("hf_decoder_mask", "additive_4d"),
    ("gqa_causal", "repeat_interleave"),
}
IDIOMS = [
    pytest.param(
        variant.name, idiom, fn, id=f"{variant.name}-{idiom}",
        marks=() if (variant.name, idiom) in CI_IDIOMS else pytest.mark.full,
    )
    for variant in variants.VARIANTS.values()
    for idiom, fn in variant.idioms.items()
]


# The kernels that read the tensors a chain is given: what runs until a checked route's check passes (the routes
# have tests of their own: test_arange_positions_route.py, test_causal_tensor_route.py).
READ_TENSORS = dict(arange_positions_route=False, causal_tensor_route=False)


def float64(tensor):
    return tensor.detach().double() if tensor.is_floating_point() else tensor


def train_on_cpu(fn, operands, extras, grad_seed=0, dynamic=None, **overlay):
    """Compile ``fn`` afresh, run it forward and backward at a fresh random upstream gradient (the checked routes off:
    ``READ_TENSORS``); returns the output, the operands' gradients, the upstream gradient and the generated code of
    both graphs."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with testing.cpu_triton(), config.patch(**{"sdpa_pattern_policy": "flashlight", **READ_TENSORS, **overlay}), fresh_cache():

        def step():
            out = torch.compile(fn, dynamic=dynamic)(*operands, **extras)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=out.dtype)
            out.backward(grad)
            return out, grad

        (out, grad), code = testing.run_keeping_graphs_and_get_code(step)
    return out, [t.grad for t in operands], grad, code


def eager_gradients(fn, operands, extras, grad):
    leaves = [float64(t).requires_grad_() for t in operands]
    out = fn(*leaves, **{name: float64(t) for name, t in extras.items()})
    out.backward(grad.double())
    return out, [t.grad for t in leaves]


def assert_matches_eager(fn, operands, extras, out, grads, grad):
    expected, expected_grads = eager_gradients(fn, operands, extras, grad)
    testing.assert_close_to_reference(out, expected)
    for actual, reference in zip(grads, expected_grads, strict=True):
        testing.assert_close_to_reference(actual, reference)


def train_calls(fn, args, calls, before_call=lambda call: None, **overlay):
    """Compile ``fn`` afresh and run it forward and backward ``calls`` times (``args`` require grad), each output and
    gradient against float64 eager autograd at a fresh upstream gradient; the first call's code."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    compiled = torch.compile(fn)
    first_code = None
    overlay = {"sdpa_pattern_policy": "flashlight", "fault_containment": False, **overlay}
    with fresh_cache(), testing.cpu_triton(), config.patch(**overlay):
        for call in range(calls):
            before_call(call)
            for operand in args:
                operand.grad = None

            def step():
                out = compiled(*args)
                grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(call), dtype=out.dtype)
                out.backward(grad)
                return out, grad

            (out, grad), code = testing.run_keeping_graphs_and_get_code(step)
            first_code = first_code or code
            expected, expected_grads = eager_gradients(fn, args, {}, grad)
            testing.assert_close_to_reference(out, expected)
            for operand, reference in zip(args, expected_grads, strict=True):
                testing.assert_close_to_reference(operand.grad, reference)
    return first_code


def assert_fused_training(code, score_numel, extern_calls=0, learned_full_biases=0):
    """A forward kernel that stores the rows' statistics; a backward kernel with the column-tile loop (dV, dK)
    and the row-tile loop (dQ), the chain and its derivative in each; no extern matmul (but ``extern_calls`` of the
    program's own, None for any); no buffer of the score matrix's size in either graph, but the gradients of
    ``learned_full_biases`` biases as large as the scores (their own size)."""
    kernels = testing.triton_kernels(code)
    forward = [text for text in kernels.values() if "for start_n in range(" in text and "grad_scores" not in text]
    backward = [text for text in kernels.values() if "grad_scores" in text]
    assert len(forward) == 1 and len(backward) == 1, list(kernels)
    FileCheck().check("acc = tl.dot(p, v, acc * alpha").check("LSE + out_z").run(forward[0])
    FileCheck().check("if tile < column_tiles:").check("for start_m in range(").check("scores = tl.dot(k, qt").check(
        "dv = tl.dot(p.to("
    ).check("dp = tl.dot(v, tl.trans(do)").check("grad_logits = p * (dp - delta").check("dk = tl.dot(grad_scores").check(
        "else:"
    ).check("for start_n in range(").check("scores = tl.dot(q, kt").check("dp = tl.dot(do, tl.trans(v)").check(
        "dq = tl.dot(grad_scores"
    ).run(backward[0])
    # The backward skips the tiles the forward skips by position or by ids, from both sides.
    position_test = re.search(r"masked = (\(\(.*?\)\))", forward[0])
    if position_test is not None and "n_lo < 0" not in position_test[1]:
        assert backward[0].count(position_test[1]) == 2, position_test[1]
    assert backward[0].count("ids_disjoint =") == 2 * forward[0].count("ids_disjoint =")
    assert backward[0].count("cell_states = ") == 2 * forward[0].count("cell_states = ")
    testing.check_kernels(code, extern_calls=extern_calls)
    allocated = testing.allocated_buffer_numels(code)
    score_sized = [numel for numel in allocated if numel >= score_numel]
    assert score_sized == [score_numel] * learned_full_biases, f"buffers of {allocated} elements, scores {score_numel}"
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_training_fault"] == 0
    assert counters["inductor"]["flashlight_fault_fallback"] == 0


def operands_of(variant, shape, dtype=torch.float32):
    q, k, v, extras = variants.make_inputs(variant, shape, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)], extras


@pytest.mark.parametrize("name,idiom,fn", IDIOMS)
def test_variant_idioms_train_fused_and_match_eager(name, idiom, fn):
    variant = variants.VARIANTS[name]
    shape = variants.Shape(B=2, H=4, M=45 if variant.self_attention else 37, N=45, D=16)
    operands, extras = operands_of(variant, shape)
    out, grads, grad, code = train_on_cpu(fn, operands, extras)
    assert_matches_eager(fn, operands, extras, out, grads, grad)
    assert_fused_training(code, shape.B * shape.H * shape.M * shape.N)


@pytest.mark.parametrize("name", ["gemma2", "document", "hf_decoder_mask"])
def test_half_precision_training_matches_eager_and_passes_the_gpu_front_end(name):
    """bf16, and the forward and backward kernels through Triton's front end for sm90 (``check_gpu_front_end``):
    a soft-capped window (wide fp32 chain, fast tanh), id-mask skipping and a mask table from both sides."""
    variant = variants.VARIANTS[name]
    shape = variants.Shape(B=1, H=2, M=40, N=40, D=16)
    operands, extras = operands_of(variant, shape, dtype=torch.bfloat16)
    out, grads, grad, code = train_on_cpu(variant.reference, operands, extras)
    assert_matches_eager(variant.reference, operands, extras, out, grads, grad)
    assert_fused_training(code, 2 * 40 * 40)
    testing.check_gpu_front_end(code)


def test_a_chain_that_gathers_takes_wider_backward_tiles_at_head_dim_128(monkeypatch):
    """T5's distance table read per logit: the backward's first config at head dim 128 is 64×128 / 128×64 with 8
    warps (the others keep 64×64); the lowering tells the configs that the chain gathers (16-bit operands)."""
    cuda = torch.device("cuda")
    wide = dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=3)
    assert attention_backward.backward_configs(128, 128, cuda, gathers=True)[0] == wide
    assert attention_backward.backward_configs(128, 128, cuda)[0]["BLOCK_N1"] == 64
    assert attention_backward.backward_configs(64, 64, cuda, gathers=True) == attention_backward.backward_configs(64, 64, cuda)
    told = []
    original = attention_backward.backward_configs
    monkeypatch.setattr(attention_backward, "backward_configs", lambda *a, **kw: told.append(kw["gathers"]) or original(*a, **kw))
    variant = variants.VARIANTS["t5_bias"]
    operands, extras = operands_of(variant, variants.Shape(B=1, H=2, M=24, N=24, D=16))
    out, grads, grad, code = train_on_cpu(variant.reference, operands, extras)
    assert_matches_eager(variant.reference, operands, extras, out, grads, grad)
    operands, extras = operands_of(variant, variants.Shape(B=1, H=2, M=24, N=24, D=16), dtype=torch.bfloat16)
    train_on_cpu(variant.reference, operands, extras)
    assert told == [False, True]  # float32 operands keep the default tiles


def test_a_chain_that_reads_a_mask_table_takes_two_stages_at_head_dim_64(monkeypatch):
    """HF's additive decoder mask is summarised in a mask table: the backward's first config at head dim 64 runs
    2 stages (at 3 the kernel spilled registers on the H200), where a boolean mask's keeps 3; the lowering tells
    the configs that the chain reads a table."""
    cuda = torch.device("cuda")
    assert attention_backward.backward_configs(64, 64, cuda, table=True)[0] == dict(
        BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, num_warps=4, num_stages=2
    )
    assert attention_backward.backward_configs(64, 64, cuda)[0]["num_stages"] == 3
    assert attention_backward.backward_configs(64, 64, cuda, table=True)[1:] == attention_backward.backward_configs(64, 64, cuda)
    assert attention_backward.backward_configs(128, 128, cuda, table=True) == attention_backward.backward_configs(128, 128, cuda)
    told = []
    original = attention_backward.backward_configs
    monkeypatch.setattr(attention_backward, "backward_configs", lambda *a, **kw: told.append(kw["table"]) or original(*a, **kw))
    for name in ("hf_decoder_mask", "sliding_window"):
        variant = variants.VARIANTS[name]
        operands, extras = operands_of(variant, variants.Shape(B=2, H=2, M=64, N=64, D=16))
        out, grads, grad, code = train_on_cpu(variant.reference, operands, extras)
        assert_matches_eager(variant.reference, operands, extras, out, grads, grad)
    assert told == [True, False]


def test_a_bias_read_through_a_permute_counts_as_score_sized(monkeypatch):
    """Hugging Face T5's bias reaches the chain as ``[M, N, H]``, permuted there: it is read per score like a
    ``[H, M, N]`` bias, and the forward's configs count it so (uncounted, 128×128 tiles with three stages ask for
    more shared memory than the H100 has)."""
    told = []
    original = online_softmax_attention.kernel_configs
    monkeypatch.setattr(online_softmax_attention, "kernel_configs", lambda *a, **kw: told.append(kw) or original(*a, **kw))
    variant = variants.VARIANTS["t5_hf"]
    operands, extras = operands_of(variant, variants.Shape(B=1, H=2, M=24, N=24, D=16))
    out, grads, grad, code = train_on_cpu(variant.reference, operands, extras)
    assert_matches_eager(variant.reference, operands, extras, out, grads, grad)
    assert [kw["element_bytes"] for kw in told] == [4]


SDPA_ROUTE = {"sdpa_pattern_policy": "unmasked_sdpa", "sdpa_route_devices": ("cpu",)}


def _causal_scaled_v(q, k, v):
    return variants.causal_masked_fill(q, k, v * 0.5)


@pytest.mark.parametrize("route", [{}, SDPA_ROUTE], ids=["fused", "sdpa_route"])
def test_a_constant_factor_on_v_trains_exactly(route):
    operands = [torch.randn(1, 2, 32, 16, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    out, grads, grad, code = train_on_cpu(_causal_scaled_v, operands, {}, **route)
    assert_matches_eager(_causal_scaled_v, operands, {}, out, grads, grad)
    trained = counters["inductor"]["flashlight_attention_as_sdpa_for_training" if route else "flashlight_attention_fused_for_training"]
    assert trained == 1


@pytest.mark.parametrize("fn", [variants.causal_masked_fill, variants.gpt2_causal_where])
def test_plain_causal_attention_trains_on_sdpas_kernels(fn):
    """Where the route gives plain causal attention to SDPA (on the CPU here: its CPU flash kernels), training
    takes SDPA's forward and backward ops as a pair: no score-sized buffer, gradients as eager's."""
    operands = [torch.randn(2, 2, 40, 16, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    out, grads, grad, code = train_on_cpu(fn, operands, {}, **SDPA_ROUTE)
    assert_matches_eager(fn, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_as_sdpa_for_training"] == 1
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 0
    forward, backward = code
    FileCheck().check("_scaled_dot_product_flash_attention_for_cpu.default(").check_not("_backward").run(forward)
    FileCheck().check("_scaled_dot_product_flash_attention_for_cpu_backward.default(").run(backward)
    assert max(testing.allocated_buffer_numels(code)) < 2 * 2 * 40 * 40


@pytest.mark.parametrize("name", ["gqa_causal", "mqa"])
def test_grouped_kv_trains_on_sdpas_kernels_reading_kv_unrepeated(name):
    """K/V repeated over query-head groups: SDPA reads them unrepeated (``enable_gqa``) and gives the group's
    gradient; each repeated copy gets its share, and the graph's own sum over the group gives k.grad and v.grad."""
    variant = variants.VARIANTS[name]
    operands, extras = operands_of(variant, variants.Shape(B=2, H=4, M=32, N=32, D=16), dtype=torch.bfloat16)
    out, grads, grad, code = train_on_cpu(variant.reference, operands, extras, **SDPA_ROUTE)
    assert_matches_eager(variant.reference, operands, extras, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_as_sdpa_for_training"] == 1
    FileCheck().check("_scaled_dot_product_flash_attention_for_cpu_backward.default(").run(code[1])
    assert max(testing.allocated_buffer_numels(code)) < 2 * 4 * 32 * 32


@pytest.mark.parametrize("name", ["gemma2", "sliding_window"])
def test_attention_sdpa_cannot_take_in_training_stays_ours(name):
    """Chains beyond a scale and a causal mask stay with the fused kernels under the route."""
    variant = variants.VARIANTS[name]
    operands, extras = operands_of(variant, variants.Shape(B=1, H=4, M=32, N=32, D=16), dtype=torch.bfloat16)
    out, grads, grad, code = train_on_cpu(variant.reference, operands, extras, **SDPA_ROUTE)
    assert_matches_eager(variant.reference, operands, extras, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_as_sdpa_for_training"] == 0
    assert_fused_training(code, 4 * 32 * 32)


def _rows_masked_by_where(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(s.shape[-2], device=q.device)
    return torch.softmax(torch.where((rows < 3)[:, None], float("-inf"), s), -1) @ v


def _rows_masked_by_bias(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(s.shape[-2], device=q.device)
    bias = torch.where((rows < 3)[:, None], float("-inf"), 0.0)
    return torch.softmax(s + bias, -1) @ v


def _causal_padded_rows_masked_by_where(q, k, v):
    """Wide statistics (the last keys padded by an added finfo.min), a causal mask that skips tiles, and rows whose
    logits are all -inf, whose NaN reaches every key's dV in eager."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows, cols = (torch.arange(size, device=q.device) for size in s.shape[-2:])
    padding = torch.zeros(s.shape[-1], dtype=s.dtype, device=q.device).masked_fill(cols >= s.shape[-1] - 4, torch.finfo(s.dtype).min)
    s = torch.where(cols[None, :] <= rows[:, None], s + padding, float("-inf"))
    return torch.softmax(torch.where((rows < 3)[:, None], float("-inf"), s), -1) @ v


@pytest.mark.parametrize("fn", [_rows_masked_by_where, _rows_masked_by_bias, _causal_padded_rows_masked_by_where])
def test_fully_masked_rows_give_eagers_nan_and_zero_gradients(fn):
    """Rows whose logits are all -inf are NaN forward; backward, eager gives NaN or 0 by the chain's own derivative
    (a ``where`` passes 0 to the masked scores, an added -inf bias passes the NaN): the fused backward visits every
    tile of such a batch entry and gives the same, with wide statistics too (``ops.backward_row_terms``' flag 1)."""
    operands = [torch.randn(1, 2, 20, 16).requires_grad_() for _ in range(3)]
    out, grads, grad, code = train_on_cpu(fn, operands, {})
    assert out[..., :3, :].isnan().all()
    assert_matches_eager(fn, operands, {}, out, grads, grad)
    assert_fused_training(code, 2 * 20 * 20)


def _left_padded_decoder(q, k, v, attention_mask):
    """Hugging Face's eager decoder mask with left padding: the first rows see only padded keys, every logit of
    theirs is finfo.min (finite, too large to scale): eager's softmax there is uniform over all the columns."""
    lowest = torch.finfo(q.dtype).min
    causal = torch.full((q.shape[-2], k.shape[-2]), lowest, dtype=q.dtype, device=q.device).triu(1)
    mask = causal[None, None].masked_fill(attention_mask[:, None, None, :] == 0, lowest)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, -1) @ v


def test_rows_of_finite_huge_logits_train_as_eager():
    """Rows whose logits are all finfo.min keep their uniform probabilities in the backward (the wide statistics:
    the row's own scale, shift and 1/l apart, ``ops.backward_row_terms``), and the other rows stay exact beside
    them: no entirely visible tile holds those rows, and the visible tiles of both batch entries (rows 64–71, keys
    32–63: the mask table's cells are 32 wide) run in the narrow form (log2(l) in the shift)."""
    operands = [torch.randn(2, 2, 72, 16).requires_grad_() for _ in range(3)]
    attention_mask = (torch.arange(72)[None, :] >= torch.tensor([[5], [0]])).long()
    out, grads, grad, code = train_on_cpu(_left_padded_decoder, operands, {"attention_mask": attention_mask})
    expected = _left_padded_decoder(*(t.detach().double() for t in operands), attention_mask)
    torch.testing.assert_close(out[0, :, :5].double(), expected[0, :, :5])  # the uniform rows
    assert_matches_eager(_left_padded_decoder, operands, {"attention_mask": attention_mask}, out, grads, grad)
    assert_fused_training(code, 2 * 2 * 72 * 72)
    FileCheck().check("row_norm = tl.load").check("* row_norm").check("range(full_lo, full_hi").check(
        "* LOGIT_SCALE - row_shift"
    ).run(code[1])


def test_a_row_of_huge_visible_logits_keeps_the_general_form_in_its_batch_entry():
    """A row whose logits are finite but too large to scale is wide in tiles the mask leaves entirely visible: its
    batch entry runs every tile in the general form (its scale and norm), the other entry's visible tiles the narrow
    one. Here q's row 40 meets two equal keys (5 and 6, in a visible tile) at 2.5e10: its probabilities are 1/2 each
    (the narrow form would give inf). Output and gradients as eager's, but dK of its head: there q's 1e10 multiplies
    float32's rounding of p·(dp − delta) = 0, in eager's float32 as in the kernel."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 48, 16, generator=generator) for _ in range(3))
    direction = torch.zeros(16)
    direction[0] = 1.0
    k[0, 1, 5] = k[0, 1, 6] = 10.0 * direction
    q[0, 1, 40] = 1e10 * direction
    operands = [t.requires_grad_() for t in (q, k, v)]
    extras = {"attention_mask": torch.ones(2, 48, dtype=torch.long)}
    out, (dq, dk, dv), grad, code = train_on_cpu(_left_padded_decoder, operands, extras)
    expected, (expected_dq, expected_dk, expected_dv) = eager_gradients(_left_padded_decoder, operands, extras, grad)
    for actual, reference in ((out, expected), (dq, expected_dq), (dv, expected_dv), (dk[1], expected_dk[1]), (dk[0, 0], expected_dk[0, 0])):
        testing.assert_close_to_reference(actual, reference)
    FileCheck().check("range(full_lo, full_hi").run(code[1])


def test_backward_row_terms_fold_the_rows_that_keep_a_key():
    """``ops.backward_row_terms`` on statistics made by hand: a row of ordinary logits folds log2(l) into its shift
    (norm 1); a row whose logits are all finfo.min, and one whose max is 2^12, keep the scale the forward chose and
    1/l apart, and the latter flags its entry (2: a visible tile may hold it), where the former, hidden by its mask,
    does not; a row of -inf is dense (flag 1)."""
    scale = ops.LOG2E * 0.25
    row_max = torch.tensor([[3.0, 2.0], [torch.finfo(torch.float32).min, 2.0], [2.0**12 / scale, 1.0], [-math.inf, 0.5]])
    row_sum = torch.tensor([[4.0, 2.0], [48.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    terms, flags = ops.backward_row_terms(torch.stack([row_max, row_sum], 1), 0.25)
    assert flags.tolist() == [0, 0, 2, 1]
    tiny = 2.0 ** math.floor(math.log2(scale))
    torch.testing.assert_close(terms[0], torch.tensor([[scale, scale], [3 * scale + 2.0, 2 * scale + 1.0], [1.0, 1.0]]))
    torch.testing.assert_close(terms[1, :, 0], torch.tensor([tiny, torch.finfo(torch.float32).min * tiny, 1 / 48]))
    torch.testing.assert_close(terms[2, :, 0], torch.tensor([scale, 2.0**12, 0.5]))
    assert terms[3, 1, 0] == -math.inf and terms[3, 2, 0] == 1.0  # exp2(x · scale + inf) at x = -inf: NaN, as eager


@pytest.mark.parametrize("idiom,wide", [("finfo_min", True), ("bool_masked_fill", False)])
def test_the_backward_runs_entirely_visible_tiles_apart(idiom, wide):
    """Key padding: the forward runs entirely visible tiles in a loop of their own, and so does the backward, with
    wide statistics (a finfo.min mask) too: there the visible tiles take the narrow form of the probabilities
    (``exp2(logits · LOGIT_SCALE − shift)``, log2(l) in the shift), the others the general one (a scale and a norm
    per row), and no tile divides by the rows' sums (``ops.backward_row_terms`` computes them once per row).
    Gradients as eager's either way."""
    variant = variants.VARIANTS["key_padding"]
    operands, extras = operands_of(variant, variants.Shape(B=2, H=2, M=48, N=48, D=16))
    fn = variant.idioms[idiom]
    out, grads, grad, code = train_on_cpu(fn, operands, extras)
    assert_matches_eager(fn, operands, extras, out, grads, grad)
    forward, backward = (testing.triton_kernels(text) for text in code)
    backward_kernel = "".join(text for text in backward.values() if "grad_scores" in text)
    FileCheck().check("range(full_lo, full_hi, BLOCK_N)").run("".join(forward.values()))
    check = FileCheck().check("for start_m in range(full_lo, full_hi, BLOCK_M1)")
    if wide:
        check = check.check("p = tl.exp2(logits.to(tl.float32) * LOGIT_SCALE - row_shift[None, :])")
    check.check("for start_n in range(full_lo, full_hi, BLOCK_N2)").run(backward_kernel)
    if wide:
        FileCheck().check("* row_scale[None, :] - row_shift[None, :]) * row_norm[None, :]").check_not("/ row_sum").run(backward_kernel)


def test_masked_tiles_on_both_sides_of_the_visible_ones_run_in_one_loop():
    """Each program of the backward carries its accumulators through two loops: the tiles that need the mask, before
    and after the entirely visible ones, in one, the visible tiles in the other (a third loop makes ptxas serialize
    the kernel's wgmma: ``masked_loop`` in attention_backward.py.jinja). Documents whose bounds fall inside tiles
    put masked tiles on both sides of visible ones, for the columns and for the rows; gradients as eager's."""
    document_id = torch.tensor([[0] * 10 + [1] * 37 + [2] * 25, [0] * 30 + [1] * 42])
    operands = [torch.randn(2, 2, 72, 16).requires_grad_() for _ in range(3)]
    fn = variants.document_mask
    out, grads, grad, code = train_on_cpu(fn, operands, {"document_id": document_id})
    assert_matches_eager(fn, operands, {"document_id": document_id}, out, grads, grad)
    backward = "".join(text for text in testing.triton_kernels(code[1]).values() if "grad_scores" in text)
    FileCheck().check("for masked_step in range(0, masked_count)").check_next("start_m = tl.where(").check(
        "for start_m in range(full_lo, full_hi, BLOCK_M1)"
    ).check("for masked_step in range(0, masked_count)").check_next("start_n = tl.where(").check(
        "for start_n in range(full_lo, full_hi, BLOCK_N2)"
    ).run(backward)
    FileCheck().check_count("for start_m in range(", 1, exactly=True).run(backward)
    FileCheck().check_count("for start_n in range(", 1, exactly=True).run(backward)


def _hopper_constants(config: dict) -> dict:
    """The constants the backward's lowering sets for a GPU config (``attention_backward.backward_configs``)."""
    tiles = {name: config[name] for name in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")}
    return {**tiles, **attention_backward.tile_constants(config), "UPCAST_DOT_OPERANDS": False}


@pytest.mark.parametrize(
    "name,d",
    [("document", 128), ("sliding_window", 64), ("hf_decoder_mask", 64), pytest.param("prefix_lm", 128, marks=pytest.mark.full)],
)
def test_backward_kernel_keeps_its_wgmma_asynchronous_on_hopper(name, d):
    """The backward kernel of a mask with entirely visible tiles, compiled for sm90 at the GPU's first backward config
    (Triton and its ptxas, no GPU): ptxas does not serialize its wgmma (C7515), as it does where the tiles the mask
    cuts through run in two loops (13–20% more time for the kernel on an H200, backward_masked_loop_h200.md), and for
    the sliding window at head dim 64 where that loop's tile start carries an alignment hint. HF's decoder mask, whose
    wide statistics run the visible tiles in the narrow form and the others in the general one, at its table's 2
    stages."""
    variant = variants.VARIANTS[name]
    operands, extras = operands_of(variant, variants.Shape(B=1, H=2, M=128, N=128, D=d), dtype=torch.bfloat16)
    _, _, _, code = train_on_cpu(variant.reference, operands, extras)
    config = attention_backward.backward_configs(
        d, d, torch.device("cuda"), id_mask=name == "document", table=name == "hf_decoder_mask"
    )[0]
    reports = testing.hopper_ptxas_reports(
        code[1], _hopper_constants(config), config["num_warps"], config["num_stages"], contains="grad_scores"
    )
    assert len(reports) == 1
    report = next(iter(reports.values()))
    assert re.search(r"Used \d+ registers", report), report
    assert "C7515" not in report, report


@pytest.mark.parametrize("fn", [programs.diff_attention, programs.diff_attention_two_matmuls, programs.diff_transformer_causal])
def test_differential_attention_trains_as_one_fused_attention_over_all_heads(fn, caplog):
    """Before autograd, the output matmul is distributed over the heads' combination (``head_groups_pre_grad.py``):
    one fused forward and backward over all 2h heads, V read per group, and λ's gradient from the combination of
    the outputs; every gradient, λ's included, matches float64 autograd."""
    inputs = programs.diff_inputs(B=1, H=4, S=40, D=8, generator=torch.Generator().manual_seed(2))
    operands = [inputs.pop(name).requires_grad_() for name in ("q", "k", "v", "lam")]
    with caplog.at_level(logging.INFO, logger="flashlight.attention_fusion"):
        out, grads, grad, code = train_on_cpu(fn, operands, inputs)
    assert "before autograd (training)" in caplog.text
    assert counters["inductor"]["flashlight_training_declined"] == 0
    # No buffer as large as one combined M×N (B·h·M·N); the per-head outputs B·2h·M·2d are smaller here.
    assert_fused_training(code, 1 * 2 * 40 * 40)
    assert_matches_eager(fn, operands, inputs, out, grads, grad)


def _train_over_lengths(variant, lengths, caplog):
    """One ``torch.compile`` of the variant trained at each length in turn (Dynamo makes the length dynamic at the
    second): per length, the overlay's counters and whether the result matched float64 autograd."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    steps = []
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"), fresh_cache():
        compiled = torch.compile(variant.reference)
        for length in lengths:
            shape = variants.Shape(B=2, H=2, M=length if variant.self_attention else 24, N=length, D=16)
            operands, extras = operands_of(variant, shape)
            counters.clear()
            def step():
                out = compiled(*operands, **extras)
                grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(length))
                out.backward(grad)
                return out, grad

            with caplog.at_level(logging.INFO, logger="flashlight.attention_fusion"):
                (out, grad), code = testing.run_keeping_graphs_and_get_code(step)
            assert_matches_eager(variant.reference, operands, extras, out, [t.grad for t in operands], grad)
            steps.append((dict(counters["inductor"]), code))
    return steps


@pytest.mark.parametrize("name", [
    "causal", "document", *(pytest.param(name, marks=pytest.mark.full) for name in ("sliding_window", "hf_decoder_mask", "alibi")),
])
def test_dynamic_lengths_train_fused_in_one_graph(name, caplog):
    """The second length makes Dynamo compile a graph with a symbolic length: it trains fused too (no size is
    specialised, so the third length runs the same graph), every gradient matches float64 autograd, and the kernels
    of the symbolic graph pass Triton's front end for sm90."""
    (first, _), (second, code), (third, _) = _train_over_lengths(variants.VARIANTS[name], (40, 53, 29), caplog)
    assert first["flashlight_attention_fused_for_training"] == 1
    assert second["flashlight_attention_fused_for_training"] == 1
    assert "flashlight_compile_fx" not in third  # no recompile: the lengths stayed symbolic
    assert "training_declined" not in caplog.text and "dynamic shape" not in caplog.text
    assert second.get("flashlight_fault_fallback", 0) == 0 and second.get("flashlight_training_fault", 0) == 0
    assert len([text for text in testing.triton_kernels(code).values() if "grad_scores" in text]) == 1
    testing.check_gpu_front_end(code)


@pytest.mark.parametrize("name", ["sliding_window", "softcap", "document"])
def test_tiles_inside_a_symbolic_length_run_without_bounds_tests(name, caplog):
    """A symbolic length is not known to be a multiple of the tile, but every tile before its last, partial one
    lies inside the bounds: the forward's and both of the backward's loops run those tiles without bounds tests,
    and the rest (with them) in a second loop. Gradients match float64 autograd at lengths with and without a
    partial tile (53, 48: the second runs the symbolic graph too). (Under a causal mask the partial last column
    tile is never entirely visible; soft-cap's single loop and the last document's visible tiles run it.)"""
    (_, _), (second, code), (third, _) = _train_over_lengths(variants.VARIANTS[name], (40, 53, 48), caplog)
    assert second["flashlight_attention_fused_for_training"] == 1 and "flashlight_compile_fx" not in third
    kernels = testing.triton_kernels(code).values()
    (backward,) = [text for text in kernels if "grad_scores" in text]
    (forward,) = [text for text in kernels if "acc = tl.dot(p, v" in text and text is not backward]
    FileCheck().check("split_n = tl.minimum(tl.maximum(N - N % BLOCK_N").check(", split_n, BLOCK_N):").check_not(
        "col_in_bounds").check("if not EVEN_N:").check("for start_n in range(split_n, ").check(
        "tl.where(col_in_bounds, logits").run(forward)
    for loop, step, bounded in (("start_m", "BLOCK_M1", "p = tl.where(in_bounds"), ("start_n", "BLOCK_N2", "p = tl.where(in_bounds")):
        split = "split_" + loop[-1]
        FileCheck().check(f"{split} = tl.minimum(tl.maximum(interior_end_{loop[-1]}").check(
            f", {split}, {step}):").check_not("in_bounds, ").check("if not (EVEN_M and EVEN_N):").check(
            f"for {loop} in range({split}, ").check(bounded).run(backward)


@pytest.mark.parametrize("fn,make_inputs", [
    (programs.attention_sinks, programs.sinks_inputs), (programs.diff_transformer_causal, programs.diff_inputs),
])
def test_sinks_and_head_pairs_train_fused_at_a_dynamic_length(fn, make_inputs):
    """Attention sinks (their logits learned) and DIFF Transformer's code (λ learned) at a symbolic length: fused,
    no recompile at a third length, every gradient float64 autograd's."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"), fresh_cache():
        compiled = torch.compile(fn)
        for length in (40, 53, 29):
            inputs = make_inputs(B=1, H=4, S=length, D=16, generator=torch.Generator().manual_seed(length))
            operands = [t.requires_grad_() for t in inputs.values()]
            counters.clear()
            out = compiled(*operands)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(length))
            out.backward(grad)
            assert_matches_eager(fn, operands, {}, out, [t.grad for t in operands], grad)
            assert counters["inductor"]["flashlight_attention_fused_for_training"] == (0 if length == 29 else 1)
            assert counters["inductor"]["flashlight_compile_fx"] == (0 if length == 29 else 1)


@pytest.mark.parametrize("name", ["vanilla", "softcap", "sliding_window", "gemma2"])
def test_every_size_symbolic_trains_fused(name):
    """``torch.compile(dynamic=True)`` makes every size symbolic, the head dim too, so the softmax's scale 1/√d is a
    tensor known at run time: upstream splits its sign off (given back by ``signed_scales``), a pattern leaves an
    unlabelled multiply by it in the backward (``attention_training._convex``), and Gemma-2's chain reads it as a 0-d
    tensor. Each trains fused and matches float64 autograd."""
    variant = variants.VARIANTS[name]
    operands, extras = operands_of(variant, variants.Shape(B=2, H=4, M=45, N=45, D=16))
    counters.clear()
    out, grads, grad, code = train_on_cpu(variant.reference, operands, extras, dynamic=True)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert_matches_eager(variant.reference, operands, extras, out, grads, grad)
    assert len([text for text in testing.triton_kernels(code).values() if "grad_scores" in text]) == 1


def _per_head_temperature(q, k, v, temperature):
    return torch.softmax(q @ k.transpose(-2, -1) / temperature, dim=-1) @ v


def test_learned_temperature_of_an_unmasked_softmax_trains_fused():
    """A per-head temperature that requires grad, of both signs, dividing the scores of an unmasked softmax (which
    upstream rewrites with the sign trick): fused, the temperature's gradient from the backward kernel, all gradients
    float64 autograd's."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=generator).requires_grad_() for _ in range(3))
    temperature = torch.tensor([0.5, -0.7, 1.3, -2.0]).view(4, 1, 1).requires_grad_()
    operands = [q, k, v, temperature]
    counters.clear()
    out, grads, grad, code = train_on_cpu(_per_head_temperature, operands, {})
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert_matches_eager(_per_head_temperature, operands, {}, out, grads, grad)
    assert_fused_training(code, 2 * 4 * 40 * 40, extern_calls=None)


def _soft_capped_by_a_learned_scalar(q, k, v, scale):
    return torch.softmax(torch.tanh(q @ k.transpose(-2, -1) * scale), dim=-1) @ v


def test_learned_scalar_with_every_size_symbolic_trains_on_upstreams_path():
    """A learned 0-d scale with every size symbolic: its derivative would be traced at the scores' symbolic batch
    sizes, so the attention trains on upstream's path, with its reason in the log, and every gradient matches (fused,
    its backward graph would fail to compile, on the fallback path too)."""
    generator = torch.Generator().manual_seed(4)
    operands = [torch.randn(2, 4, 40, 16, generator=generator).requires_grad_() for _ in range(3)]
    operands.append(torch.tensor(0.7).requires_grad_())
    counters.clear()
    out, grads, grad, _ = train_on_cpu(_soft_capped_by_a_learned_scalar, operands, {}, dynamic=True)
    assert counters["inductor"]["flashlight_training_declined"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    assert_matches_eager(_soft_capped_by_a_learned_scalar, operands, {}, out, grads, grad)


def test_backward_fault_at_symbolic_sizes_falls_back(monkeypatch):
    """A fault while lowering the fused backward of a graph with every size symbolic: the backward graph (which
    holds reshapes to symbolic shapes written as SymInts) is traced node by node into upstream's ops and compiled
    on upstream's path; the gradients still match float64 autograd."""

    def fault(*args, **kwargs):
        raise RuntimeError("injected fault in the backward's lowering")

    monkeypatch.setattr(attention_backward, "backward_configs", fault)
    variant = variants.VARIANTS["sliding_window"]
    operands, extras = operands_of(variant, variants.Shape(B=2, H=4, M=45, N=45, D=16))
    counters.clear()
    out, grads, grad, _ = train_on_cpu(variant.reference, operands, extras, dynamic=True)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 1
    assert_matches_eager(variant.reference, operands, extras, out, grads, grad)


def _alibi_with_learned_tensors(q, k, v, slopes, key_bias):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    pos = torch.arange(k.shape[-2], device=q.device)
    s = s + slopes[:, None, None] * (pos[None, :] - pos[:, None]) + key_bias
    return torch.softmax(s.masked_fill(pos[None, :] > pos[:, None], float("-inf")), -1) @ v


@pytest.mark.parametrize("learned", ["slopes", "key_bias"])
def test_learned_tensors_at_a_dynamic_length(learned, caplog):
    """Slopes ``[H]`` keep their shape at any length: their gradient comes from the fused backward at a symbolic
    length too. A key bias ``[B, 1, 1, N]`` has the length in its shape, which the gradient's partial sums are
    sized by statically: that attention declines, with its reason. Either way the gradients are eager's."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"), fresh_cache():
        compiled = torch.compile(_alibi_with_learned_tensors)
        for length in (40, 53):
            tensors = {"slopes": torch.rand(3), "key_bias": torch.randn(2, 1, 1, length)}
            operands = [torch.randn(2, 3, length, 16).requires_grad_() for _ in range(3)] + [tensors.pop(learned).requires_grad_()]
            extras = tensors if learned == "key_bias" else {"key_bias": tensors["key_bias"]}
            function = _alibi_with_learned_tensors if learned == "slopes" else (
                lambda q, k, v, key_bias, slopes: _alibi_with_learned_tensors(q, k, v, slopes, key_bias))
            counters.clear()
            with caplog.at_level(logging.INFO, logger="flashlight.attention_fusion"):
                out = compiled(*operands[:3], **{learned: operands[3]}, **extras)
                grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(length))
                out.backward(grad)
            assert_matches_eager(function, operands, extras, out, [t.grad for t in operands], grad)
    fused = counters["inductor"]["flashlight_attention_fused_for_training"]
    assert counters["inductor"]["flashlight_training_fault"] == 0
    if learned == "slopes":
        assert fused == 1
    else:
        assert fused == 0 and "the gradient of a tensor the chain reads with a dynamic shape" in caplog.text


def _masked_below_a_wider_fill(q, k, v, weights):
    """A mask comparing float32 weights with a float64 fill of the scores' shape: the comparison runs in float64."""
    s = q @ k.transpose(-1, -2) / 4.0
    fill = torch.full((s.shape[-2], s.shape[-1]), 0.1, dtype=torch.float64)
    return torch.softmax(s.masked_fill(weights <= fill, float("-inf")), -1) @ v


def test_a_fill_whose_dtype_the_comparison_computes_in_keeps_its_size():
    """At a symbolic length a sized fill becomes a 0-d one only where the op computes in the same dtype either
    way: a 0-d float64 fill would let the comparison run in float32, where 0.1 rounds and masks every score."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"), fresh_cache():
        compiled = torch.compile(_masked_below_a_wider_fill)
        for length in (40, 53):
            operands = [torch.randn(2, 2, length, 16).requires_grad_() for _ in range(3)]
            extras = {"weights": torch.full((length, length), 0.1)}
            counters.clear()
            out = compiled(*operands, **extras)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(length))
            out.backward(grad)
            assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
            assert_matches_eager(_masked_below_a_wider_fill, operands, extras, out, [t.grad for t in operands], grad)


def test_a_dynamic_training_graph_loads_from_the_cache(caplog):
    """AOTAutograd's cache stores a training graph's modules as code traced again when loaded: the chain modules
    hold no symbolic size inside a list (a 0-d fill, broadcast, instead), so a second process's compile loads it."""
    from torch._inductor.utils import fresh_cache

    variant = variants.VARIANTS["causal"]
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"), fresh_cache():
        for attempt in range(2):
            torch._dynamo.reset()
            compiled = torch.compile(variant.reference)
            counters.clear()
            with caplog.at_level(logging.WARNING):
                for length in (40, 53):
                    operands, extras = operands_of(variant, variants.Shape(B=1, H=2, M=24, N=length, D=16))
                    compiled(*operands, **extras).sum().backward()
        assert counters["aot_autograd"]["autograd_cache_hit"] == 2
    assert "unable to load" not in caplog.text
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 0  # both graphs came from the cache


def _diff_pairs(q, k):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1).view(q.shape[0], q.shape[1] // 2, 2, q.shape[2], -1)


def _diff_coefficient_along_keys(q, k, v, lam):
    """The second head's coefficient varies along N, the dim the matmul contracts."""
    w = _diff_pairs(q, k)
    return (w[:, :, 0] - lam * torch.linspace(0, 1, k.shape[-2]) * w[:, :, 1]) @ v


def _diff_plus_constant(q, k, v, lam):
    """An add of a number: (X0 + c) @ V is not X0 @ V + c."""
    w = _diff_pairs(q, k)
    return (1 - w[:, :, 0] - lam * w[:, :, 1]) @ v


def _diff_plus_other_probabilities(q, k, v, lam):
    """An add of another softmax's head: not a term of the combination."""
    w, u = _diff_pairs(q, k), _diff_pairs(k, q)
    return (w[:, :, 0] - lam * w[:, :, 1] + u[:, :, 0]) @ v


def _diff_term_squared(q, k, v, lam):
    """A product of a term with itself is not linear."""
    w = _diff_pairs(q, k)
    first = w[:, :, 0]
    return (first * first - lam * w[:, :, 1]) @ v


def _diff_combined_without_grad(q, k, v, lam):
    """The combination made under no_grad: q, k and λ get no gradient, as in eager."""
    w = _diff_pairs(q, k)
    with torch.no_grad():
        combined = w[:, :, 0] - lam * w[:, :, 1]
    return combined @ v


@pytest.mark.parametrize("fn", [_diff_coefficient_along_keys, _diff_plus_constant, _diff_plus_other_probabilities,
                                _diff_term_squared, _diff_combined_without_grad])
def test_head_combinations_the_rule_does_not_cover_train_on_upstreams_path(fn, caplog):
    inputs = programs.diff_inputs(B=1, H=4, S=16, D=8, generator=torch.Generator().manual_seed(3))
    operands = [inputs.pop(name).requires_grad_() for name in ("q", "k", "v", "lam")]
    with caplog.at_level(logging.INFO, logger="flashlight.attention_fusion"):
        out, grads, grad, code = train_on_cpu(fn, operands, inputs)
    expected, expected_grads = eager_gradients(fn, operands, inputs, grad)
    testing.assert_close_to_reference(out, expected)
    for actual, reference in zip(grads, expected_grads, strict=True):
        assert (actual is None) == (reference is None)
        if actual is not None:
            testing.assert_close_to_reference(actual, reference)
    assert "before autograd" not in caplog.text
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 0


def test_a_failure_inside_the_head_group_distribution_leaves_dynamos_graph_as_it_was(monkeypatch, caplog):
    """Fault containment before autograd: the rewrite fails after it has started editing the graph; the graph is
    put back and trains on upstream's path with eager's gradients."""
    from inductor_overlay.fx_passes import head_groups_pre_grad

    def fail(node):
        raise RuntimeError("injected")

    monkeypatch.setattr(head_groups_pre_grad, "_with_value", fail)
    inputs = programs.diff_inputs(B=1, H=4, S=24, D=8)
    operands = [inputs.pop(name).requires_grad_() for name in ("q", "k", "v", "lam")]
    with caplog.at_level(logging.INFO, logger="flashlight.attention_fusion"):
        out, grads, grad, code = train_on_cpu(programs.diff_attention, operands, inputs)
    assert "not distributed (RuntimeError: injected)" in caplog.text
    assert counters["inductor"]["flashlight_training_declined"] == 1
    assert_matches_eager(programs.diff_attention, operands, inputs, out, grads, grad)


def test_differential_attention_declines_training_with_the_distribution_switched_off(caplog):
    inputs = programs.diff_inputs(B=1, H=4, S=24, D=8)
    operands = [inputs.pop(name).requires_grad_() for name in ("q", "k", "v")]
    with caplog.at_level(logging.INFO, logger="flashlight.attention_fusion"):
        out, grads, grad, code = train_on_cpu(programs.diff_attention, operands, inputs,
                                              distribute_head_groups_in_training=False)
    assert counters["inductor"]["flashlight_training_declined"] == 1
    assert caplog.text.count("sliced or combined across heads before V") == 1
    assert_matches_eager(programs.diff_attention, operands, inputs, out, grads, grad)


def test_evoformer_row_attention_trains_fused_with_its_pair_bias_gradient():
    """AlphaFold2's MSA row attention: q, k, v and the gate, the mask bias ([B, N_seq, 1, 1, S]) and the pair bias
    ([B, 1, H, S, S], shared by every MSA row: its gradient summed over them) all match float64 autograd."""
    inputs = programs.evoformer_inputs(B=1, N_seq=3, S=21, H=2, D=16, generator=torch.Generator().manual_seed(4))
    operands = [t.requires_grad_() for t in inputs.values()]
    out, grads, grad, code = train_on_cpu(programs.evoformer_row_attention, operands, {})
    assert_matches_eager(lambda *ts: programs.evoformer_row_attention(*ts), operands, {}, out, grads, grad)
    assert_fused_training(code, 1 * 3 * 2 * 21 * 21)


def _causal_3d(q, k, v):
    """Attention on [B·H, S, D] tensors (older HF models' bmm layout): ``torch.matmul`` of 3-D tensors expands its
    operands to their own shape, and autograd leaves those expands out of the backward."""
    s = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    visible = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).tril()
    return torch.matmul(torch.softmax(s.masked_fill(~visible, float("-inf")), -1), v)


def _projected_causal_3d(x, wq, wk, wv):
    return _causal_3d(x @ wq, x @ wk, x @ wv)


@pytest.mark.parametrize("weight_shape", [(16, 16), (6, 16, 16)])
def test_three_dimensional_attention_of_projections_trains_fused(weight_shape):
    """q, k, v projected in the graph (2-D matmuls of the flattened rows viewed back into the batch, or batched
    matmuls): the softmax attention fuses, not the product chain of the queries' projection and kᵀ (which once
    fused first, took the attention's scores, and failed its backward)."""
    weights = [(torch.randn(weight_shape) / 4).requires_grad_() for _ in range(3)]  # at the usual 1/√d scale
    operands = [torch.randn(6, 40, 16).requires_grad_(), *weights]
    out, grads, grad, code = train_on_cpu(_projected_causal_3d, operands, {})
    assert_matches_eager(_projected_causal_3d, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_training_fault"] == 0
    assert_fused_training(code, 6 * 40 * 40, extern_calls=None)
    assert "extern_kernels.bmm" not in "".join(code) or len(weight_shape) == 3  # the projections' matmuls only


def _query_projected_3d(x, wq, k, v):
    return _causal_3d(torch.bmm(x, wq), k, v)


@pytest.mark.parametrize("training", [False, True])
def test_a_product_that_is_a_softmaxs_scores_leaves_the_attention_to_fuse(training):
    """``(x·Wq)·kᵀ`` is a product chain, but also the scores of the softmax attention after it: the attention
    fuses, in inference and in training (the product chain once fused first and left the softmax unfused)."""
    operands = [torch.randn(6, 40, 16), torch.randn(6, 16, 16) / 4, torch.randn(6, 40, 16), torch.randn(6, 40, 16)]
    if training:
        operands = [t.requires_grad_() for t in operands]
        out, grads, grad, code = train_on_cpu(_query_projected_3d, operands, {})
        assert_matches_eager(_query_projected_3d, operands, {}, out, grads, grad)
        assert_fused_training(code, 6 * 40 * 40, extern_calls=None)
    else:
        with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
            out, code = testing.compile_and_get_code(_query_projected_3d, *operands)
        testing.assert_close_to_reference(out, _query_projected_3d(*(t.double() for t in operands)))
        FileCheck().check("scores = tl.dot(q, k").check("acc = tl.dot(p, v").run("".join(testing.triton_kernels(code).values()))
    assert counters["inductor"]["flashlight_attention_declined"] == 0


def test_three_dimensional_operands_train_fused():
    """q, k, v of three dims, leaves of the graph: each gradient the backward kernel hands out is recognised as its
    operand's (through the expands autograd does not differentiate)."""
    operands = [torch.randn(6, 40, 16).requires_grad_() for _ in range(3)]
    out, grads, grad, code = train_on_cpu(_causal_3d, operands, {})
    assert_matches_eager(_causal_3d, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_training_declined"] == 0
    assert_fused_training(code, 6 * 40 * 40)


def _sliced_softmax_beside_attention(x, w, q, k, v):
    routed = torch.softmax(x, -1)[:, :, :8] @ w
    return torch.cat([routed.flatten(), (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).flatten()])


def test_a_sliced_softmax_not_of_scores_reports_no_attention(caplog):
    """Head slices of a softmax whose input no matmul made (a router's weights, say) are not attention: no decline
    is reported for them, while the attention beside them trains fused."""
    operands = [torch.randn(2, 6, 12), torch.randn(8, 5), *(torch.randn(2, 20, 8) for _ in range(3))]
    operands = [t.requires_grad_() for t in operands]
    with caplog.at_level(logging.INFO, logger="flashlight.attention_fusion"):
        out, grads, grad, code = train_on_cpu(_sliced_softmax_beside_attention, operands, {})
    assert_matches_eager(_sliced_softmax_beside_attention, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_training_declined"] == 0
    assert "across heads" not in caplog.text


def _bias_added(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v


def _learned_slopes(q, k, v, slopes):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    positions = torch.arange(s.shape[-1], device=q.device)
    return torch.softmax(s + slopes[:, None, None] * (positions[None, :] - positions[:, None]), -1) @ v


def _causal_temperature(q, k, v, temperature):
    s = q @ k.transpose(-1, -2)
    positions = torch.arange(s.shape[-1], device=q.device)
    return torch.softmax(torch.where(positions[None, :] <= positions[:, None], s * temperature, float("-inf")), -1) @ v


def _softcapped_row_bias(q, k, v, bias):
    return torch.softmax(30 * torch.tanh((q @ k.transpose(-1, -2) + bias) / 30), -1) @ v


def _causal_learned_mask(q, k, v, bias):
    s = q @ k.transpose(-1, -2)
    positions = torch.arange(s.shape[-1], device=q.device)
    return torch.softmax(torch.where(positions[None, :] <= positions[:, None], s + bias, float("-inf")), -1) @ v


# (program, shape of the tensor the chain reads, how the kernel sums its gradient) at B=2, H=3, M=N=20.
CAPTURED_GRADIENTS = {
    "bias_BHMN": (_bias_added, (2, 3, 20, 20), "store"),
    "bias_HMN_shared_over_batch": (_bias_added, (3, 20, 20), "atomic_add"),
    "key_bias_B11N": (_bias_added, (2, 1, 1, 20), "column_sums"),
    "alibi_slopes_H": (_learned_slopes, (3,), "column_sums"),
    "temperature_under_causal_mask": (_causal_temperature, (1,), "column_sums"),
    "per_head_temperature": (_causal_temperature, (3, 1, 1), "column_sums"),
    "row_bias_under_softcap": (_softcapped_row_bias, (2, 3, 20, 1), "row_sums"),
    "learned_mask_MN_under_causal_mask": (_causal_learned_mask, (20, 20), "atomic_add"),
}


@pytest.mark.parametrize("name", list(CAPTURED_GRADIENTS))
def test_gradients_of_tensors_the_chain_reads_come_from_the_fused_backward(name):
    """A bias, slopes or a temperature that requires grad: the backward kernel computes the derivative of its read
    per logit from the chain's joint graph and sums it (per column, per row or per logit, as its shape broadcasts);
    every gradient matches float64 eager, and nothing the size of the scores is allocated beyond a gradient that
    has that size itself."""
    fn, shape, summed = CAPTURED_GRADIENTS[name]
    operands = [torch.randn(2, 3, 20, 8).requires_grad_() for _ in range(3)]
    operands.append(torch.rand(shape).requires_grad_())
    out, grads, grad, code = train_on_cpu(fn, operands, {})
    assert_matches_eager(fn, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    (backward,) = [text for text in testing.triton_kernels(code).values() if "grad_scores" in text]
    patterns = {
        "store": "tl.store(GRAD_READ_0 + (",
        "atomic_add": "tl.atomic_add(GRAD_READ_0 + (",
        "column_sums": "column_sums_0 += tl.sum(grad_read_0, 1)",
        "row_sums": "tl.atomic_add(GRAD_READ_0 + out_z * M + offs_m, tl.sum(grad_read_0, 0)",
    }
    FileCheck().check("for start_m in range(").check("dk = tl.dot(grad_scores").check("grad_read_0 = ").check(
        patterns[summed]
    ).check("else:").run(backward)
    assert [p for k, p in patterns.items() if k != summed and p in backward] == []
    testing.check_kernels(code, extern_calls=0)
    assert max(testing.allocated_buffer_numels(code)) <= max(2 * 3 * 20 * 20 - 1, math.prod(shape))


def _t5_with_learned_table(shape, name="t5_bias"):
    variant = variants.VARIANTS[name]
    (fn,) = variant.idioms.values()
    operands, extras = operands_of(variant, shape)
    table = extras.pop("table").requires_grad_()

    def with_table(q, k, v, table):
        return fn(q, k, v, table=table)

    return with_table, [*operands, table]


@pytest.mark.parametrize("switch", [True, False])
def test_a_table_gathered_by_distance_trains_fused_by_default(switch, caplog):
    """T5's learned bucket table, read through a gather by the distance n − m, trains fused by default; with
    ``distance_gather_gradients`` off the attention trains on upstream's path, the log naming the switch. The
    gradients are eager's either way."""
    fn, operands = _t5_with_learned_table(variants.Shape(B=1, H=2, M=12, N=12, D=8))
    overlay = {} if switch else {"distance_gather_gradients": False}
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, grads, grad, _ = train_on_cpu(fn, operands, {}, **overlay)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == int(switch)
    said = "a table gathered by the distance n − m" in caplog.text and "FLASHLIGHT_DISTANCE_GATHER_GRADIENTS=0" in caplog.text
    assert said != switch
    assert_matches_eager(fn, operands, {}, out, grads, grad)


@pytest.mark.parametrize("m, n", [(40, 40), (37, 53), (53, 29)])
def test_a_table_gathered_by_distance_gets_its_gradient_per_diagonal(m, n):
    """With ``distance_gather_gradients``: the column programs sum the read's gradient per diagonal (a gather
    shears each tile, float32 atomics into ``[H, M + N − 1]``), the graph scatters the sums into the table's rows;
    every gradient, the table's too, matches float64 eager, nothing the scores' size is allocated, and the kernels
    pass Triton's front end for sm90."""
    fn, operands = _t5_with_learned_table(variants.Shape(B=2, H=2, M=m, N=n, D=8))
    out, grads, grad, code = train_on_cpu(fn, operands, {}, distance_gather_gradients=True)
    assert_matches_eager(fn, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    (backward,) = [text for text in testing.triton_kernels(code).values() if "grad_scores" in text]
    FileCheck().check("for start_m in range(").check("grad_read_0 = ").check(
        "sheared = tl.gather(grad_read_0, tl.where(on_tile, diagonal_rows, 0), 1)"
    ).check("tl.atomic_add(GRAD_READ_0 + (").check("* (M + N - 1) + diagonals").check("else:").run(backward)
    assert max(testing.allocated_buffer_numels(code)) < 2 * m * n
    testing.check_gpu_front_end(code)


def test_hugging_faces_t5_embedding_trains_fused_through_its_gathered_values():
    """Hugging Face's T5 gathers its learned table with ``nn.Embedding`` before the chain, which reads the gathered
    ``[M, N, H]`` values: their gradient is written per logit (float32 atomics, shared by the batch) and autograd
    scatters it into the table; fused whatever ``distance_gather_gradients`` says, every gradient eager's."""
    fn, operands = _t5_with_learned_table(variants.Shape(B=2, H=2, M=24, N=24, D=8), "t5_hf")
    for switch in (False, True):
        counters.clear()
        out, grads, grad, code = train_on_cpu(fn, operands, {}, distance_gather_gradients=switch)
        assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
        assert_matches_eager(fn, operands, {}, out, grads, grad)
        (backward,) = [text for text in testing.triton_kernels(code).values() if "grad_scores" in text]
        assert "tl.atomic_add(GRAD_READ_0 + (" in backward and "tl.gather(" not in backward
        for t in operands:
            t.grad = None


def _rows_minus_columns_gather(q, k, v, table):
    rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    bias = table[(rows - cols).clamp(-8, 8) + 8].permute(2, 0, 1)  # the distance m − n, clipped
    return torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v


@pytest.mark.parametrize("m, n", [(37, 53), (53, 29)])
def test_a_table_gathered_by_rows_minus_columns_gets_its_gradient(m, n):
    """The distance written m − n: the index computed once per distance runs the other way along the diagonals,
    reversed before the scatter; fused, and every gradient matches float64 eager."""
    operands = [torch.randn(2, 2, m, 8).requires_grad_(), torch.randn(2, 2, n, 8).requires_grad_(),
                torch.randn(2, 2, n, 8).requires_grad_(), torch.randn(17, 2).requires_grad_()]
    out, grads, grad, code = train_on_cpu(_rows_minus_columns_gather, operands, {}, distance_gather_gradients=True)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    assert_matches_eager(_rows_minus_columns_gather, operands, {}, out, grads, grad)


def _scaled_distance_gather(q, k, v, table, scale):
    rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    index = ((cols - rows).abs().float() * scale).long().clamp(max=table.shape[0] - 1)
    return torch.softmax(q @ k.transpose(-2, -1) + table[index].permute(2, 0, 1), dim=-1) @ v


def test_a_table_gathered_by_an_index_reading_a_tensor_declines(caplog):
    """An index computed from the distance and a tensor the chain reads (a learned scale): not computable once per
    distance ahead of the graph's sums, so the attention trains on upstream's path, with no fault."""
    operands = [torch.randn(1, 2, 20, 8).requires_grad_() for _ in range(3)] + [torch.randn(9, 2).requires_grad_()]
    extras = {"scale": torch.tensor(0.5)}
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, grads, grad, _ = train_on_cpu(_scaled_distance_gather, operands, extras, distance_gather_gradients=True)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 0
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    assert "a gather's gradient is a scatter" in caplog.text
    assert_matches_eager(_scaled_distance_gather, operands, extras, out, grads, grad)


def _sliced_bias(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-1, -2) + bias[:, : q.shape[-2], : k.shape[-2]], -1) @ v


def _selected_bias(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-1, -2) + bias[1], -1) @ v


@pytest.mark.parametrize("fn, shape", [(_sliced_bias, (3, 24, 24)), (_selected_bias, (2, 3, 20, 20))])
def test_a_sliced_or_selected_learned_bias_trains_fused(fn, shape):
    """A learned bias read through a slice or a select: the gradient of the read is scattered back into zeros of
    the bias's shape (which rule 3 does not count as a gradient read), traced into ops Inductor lowers; fused, and
    every gradient matches float64 eager."""
    operands = [torch.randn(2, 3, 20, 8).requires_grad_() for _ in range(3)] + [torch.randn(shape).requires_grad_()]
    out, grads, grad, _ = train_on_cpu(fn, operands, {})
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    assert_matches_eager(fn, operands, {}, out, grads, grad)


def _summed_positions_gather(q, k, v, table):
    rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    bias = table[(rows + cols) % table.shape[0]].permute(2, 0, 1)
    return torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v


def test_a_table_gathered_by_another_index_declines_with_the_switch_on(caplog):
    """A table gathered by m + n, not by a distance: its gradient is a scatter of every logit; the attention trains
    on upstream's path with the reason in the log."""
    operands = [torch.randn(1, 2, 12, 8).requires_grad_() for _ in range(3)] + [torch.randn(7, 2).requires_grad_()]
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, grads, grad, _ = train_on_cpu(_summed_positions_gather, operands, {}, distance_gather_gradients=True)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 0
    assert "not by broadcasting (a gather's gradient is a scatter, not fused)" in caplog.text
    assert_matches_eager(_summed_positions_gather, operands, {}, out, grads, grad)


def test_a_fault_in_a_distance_gathers_backward_falls_back_to_the_meaning(monkeypatch):
    """A fault while lowering the backward of a distance-gathered table's attention: the fused node runs as its
    meaning (the diagonal sums from autograd's per-logit gradient), and the table's gradient still matches."""

    def fault(*args, **kwargs):
        raise RuntimeError("injected fault in the backward's lowering")

    monkeypatch.setattr(attention_backward, "backward_configs", fault)
    fn, operands = _t5_with_learned_table(variants.Shape(B=1, H=2, M=20, N=20, D=8))
    out, grads, grad, _ = train_on_cpu(fn, operands, {}, distance_gather_gradients=True)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert_matches_eager(fn, operands, {}, out, grads, grad)


def test_a_bias_gradient_in_fully_masked_rows_is_eagers():
    """Rows whose logits are all -inf: the gradient of a bias added before the mask is 0 there, as eager's."""

    def masked_rows_with_bias(q, k, v, bias):
        s = q @ k.transpose(-1, -2) + bias
        rows = torch.arange(s.shape[-2], device=q.device)
        return torch.softmax(torch.where((rows < 3)[:, None], float("-inf"), s), -1) @ v

    operands = [torch.randn(1, 2, 20, 16).requires_grad_() for _ in range(3)] + [torch.randn(2, 20, 20).requires_grad_()]
    out, grads, grad, code = train_on_cpu(masked_rows_with_bias, operands, {})
    assert out[..., :3, :].isnan().all()
    assert (grads[3][:, :3] == 0).all()
    assert_matches_eager(masked_rows_with_bias, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1


def _causal_sigmoid_attention(q, k, v):
    """Sigmoid attention with a causal mask: sigmoid(-inf) = 0 weighs the masked keys out."""
    m, n = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 - math.log(n)
    s = s.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.sigmoid(s) @ v


def _sinks_with_masked_rows(q, k, v, sinks):
    """gpt-oss's sinks in bf16-style code (a float32 softmax over the concatenated logits), where the first rows
    see no key at all: their sink takes the whole row (output 0, no NaN)."""
    b, h, m, _ = q.shape
    scores = q @ k.transpose(-1, -2) / 4.0
    rows = torch.arange(m, device=q.device)
    scores = scores.masked_fill((rows < 3)[:, None] | (rows[None, :] > rows[:, None]), float("-inf"))
    combined = torch.cat([scores, sinks.reshape(1, h, 1, 1).expand(b, h, m, 1)], dim=-1)
    return torch.softmax(combined.float(), dim=-1)[..., :-1].to(v.dtype) @ v


@pytest.mark.parametrize("fn", [programs.attention_sinks, programs.attention_sinks_max_subtracted, _sinks_with_masked_rows])
def test_attention_sinks_train_fused_with_the_sinks_gradient(fn):
    """Learned sink logits (gpt-oss): the fused forward keeps the sink's column in the rows' statistics, the
    backward kernel is the plain one, and the sinks' gradient is -p_sink · delta per row, summed by the graph; q, k,
    v and the sinks' gradients match float64 eager (also the Hugging Face form, which shifts the logits by their row
    max first, and rows that only the sink sees)."""
    inputs = programs.sinks_inputs(B=2, H=3, S=40, D=16, generator=torch.Generator().manual_seed(5))
    operands = [inputs[name].requires_grad_() for name in ("q", "k", "v", "sinks")]
    out, grads, grad, code = train_on_cpu(fn, operands, {})
    assert_matches_eager(fn, operands, {}, out, grads, grad)
    assert not out.isnan().any()
    assert_fused_training(code, 2 * 3 * 40 * 40)
    assert "sink_base = SINK" in "".join(testing.triton_kernels(code).values())


def _gpt_oss_attention(q, k, v, sinks):
    """Hugging Face's gpt-oss eager attention: K/V repeated over head groups, a causal sliding window as an additive
    mask, the sinks concatenated and the row max subtracted before a softmax in the logits' dtype."""
    b, h, m, d = q.shape
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    weights = q @ k.transpose(2, 3) * d**-0.5
    i = torch.arange(m, device=q.device)
    weights = weights + torch.where((i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= 8), float("-inf"), 0.0)
    combined = torch.cat([weights, sinks.reshape(1, -1, 1, 1).expand(b, -1, m, -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype) @ v


def test_gpt_oss_attention_trains_fused():
    """GQA, a sliding window and learned sinks together, as Hugging Face writes gpt-oss: one fused forward (tiles
    outside the window skipped) and backward, every gradient eager's."""
    g = torch.Generator().manual_seed(1)
    operands = [torch.randn(shape, generator=g).requires_grad_() for shape in ((2, 4, 33, 16), (2, 2, 33, 16), (2, 2, 33, 16), (4,))]
    out, grads, grad, code = train_on_cpu(_gpt_oss_attention, operands, {})
    assert_matches_eager(_gpt_oss_attention, operands, {}, out, grads, grad)
    assert_fused_training(code, 2 * 4 * 33 * 33)


@pytest.mark.parametrize("fn,make_inputs", [
    (_sinks_with_masked_rows, programs.sinks_inputs), (_causal_sigmoid_attention, programs.qkv_inputs),
])
def test_sinks_and_sigmoid_train_in_half_precision_and_pass_the_gpu_front_end(fn, make_inputs):
    inputs = make_inputs(B=1, H=2, S=40, D=16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6))
    operands = [t.requires_grad_() for t in inputs.values()]
    out, grads, grad, code = train_on_cpu(fn, operands, {})
    assert_matches_eager(fn, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    testing.check_gpu_front_end(code)


NO_SOFTMAX = {
    "sigmoid_attention": (programs.sigmoid_attention, programs.qkv_inputs, dict(B=2, H=3, S=40, D=16)),
    "causal_sigmoid_attention": (_causal_sigmoid_attention, programs.qkv_inputs, dict(B=2, H=3, S=40, D=16)),
    "chained_matmul": (programs.chained_matmul, programs.chain_inputs, dict(M=48, K=24, N=72, P=40)),
}


@pytest.mark.parametrize("name", list(NO_SOFTMAX))
def test_weights_without_a_softmax_train_fused(name):
    """Sigmoid attention and (A·B)·C: the weights are the chain's output itself, so the forward saves no row
    statistics and the backward's gradient of the logits is dO Vᵀ (no softmax Jacobian, no delta); every gradient
    matches float64 eager and nothing of the M×N product's size is allocated."""
    fn, make_inputs, size = NO_SOFTMAX[name]
    inputs = make_inputs(**size, generator=torch.Generator().manual_seed(7))
    operands = [t.requires_grad_() for t in inputs.values()]
    out, grads, grad, code = train_on_cpu(fn, operands, {})
    assert_matches_eager(fn, operands, {}, out, grads, grad)
    kernels = testing.triton_kernels(code)
    (backward,) = [text for text in kernels.values() if "grad_scores" in text]
    FileCheck().check("for start_m in range(").check("p = logits.to(tl.float32)").check("grad_logits = dp").check(
        "dk = tl.dot(grad_scores"
    ).check("else:").check("grad_logits = dp").check("dq = tl.dot(grad_scores").run(backward)
    assert "LSE" not in backward and "delta" not in backward
    testing.check_kernels(code, extern_calls=0)
    m, n = out.shape[-2], operands[1].shape[-1] if name == "chained_matmul" else operands[1].shape[-2]
    assert max(testing.allocated_buffer_numels(code)) < math.prod(out.shape[:-2]) * m * n
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0


def test_a_fault_anywhere_in_the_joint_pass_leaves_the_joint_graph_as_upstream_made_it(monkeypatch):
    """A failure outside the per-attention containment (here the region search itself) would fail the user's
    compile, since the joint graph is partitioned outside the compile step whose faults fall back: the pass puts
    the graph back as it was, logs, and the program trains on upstream's path with eager's results."""

    def broken(*args, **kwargs):
        raise RuntimeError("no region")

    monkeypatch.setattr(attention_training, "find_attention", broken)
    variant = variants.VARIANTS["causal"]
    operands, extras = operands_of(variant, variants.Shape(B=1, H=2, M=24, N=24, D=8))
    fn = variant.idioms["masked_fill"]
    out, grads, grad, _ = train_on_cpu(fn, operands, extras)
    assert_matches_eager(fn, operands, extras, out, grads, grad)
    assert counters["inductor"]["flashlight_fault_fallback"] >= 1
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 0


def _softmax_of_a_2d_product(a, b, c):
    return torch.softmax(a @ b, dim=-1) @ c


def test_a_2d_attention_trains_fused():
    """2-D operands: the fused forward's output is squeezed after its statistics, and the backward goes after both
    (it once went before the squeeze and the joint graph was out of order)."""
    operands = [t.requires_grad_() for t in programs.chain_inputs(M=40, K=16, N=36, P=24, generator=torch.Generator().manual_seed(3)).values()]
    out, grads, grad, code = train_on_cpu(_softmax_of_a_2d_product, operands, {})
    assert_matches_eager(_softmax_of_a_2d_product, operands, {}, out, grads, grad)
    assert_fused_training(code, 40 * 36)


def test_a_fault_in_the_fused_backward_leaves_upstreams_and_stays_correct(monkeypatch):
    def broken(*args):
        raise RuntimeError("no derivative")

    monkeypatch.setattr(attention_training, "chain_vjp_module", broken)
    fn = variants.causal_masked_fill
    operands = [torch.randn(1, 2, 12, 8).requires_grad_() for _ in range(3)]
    out, grads, grad, code = train_on_cpu(fn, operands, {})
    assert counters["inductor"]["flashlight_training_fault"] == 1
    # The whole joint graph is put back as upstream made it: no fused backward, and no fused forward either.
    assert counters["inductor"]["flashlight_fault_fallback"] == 1
    assert not [text for text in testing.triton_kernels(code).values() if "grad_scores" in text or "LSE + out_z" in text]
    assert_matches_eager(fn, operands, {}, out, grads, grad)


def test_fused_backward_flag_off_leaves_upstreams_backward():
    fn = variants.causal_masked_fill
    operands = [torch.randn(1, 2, 12, 8).requires_grad_() for _ in range(3)]
    out, grads, grad, code = train_on_cpu(fn, operands, {}, fused_backward=False)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 0
    assert_matches_eager(fn, operands, {}, out, grads, grad)


def test_the_chains_derivative_is_its_joint_graph():
    """The soft-cap's derivative is traced from the chain: its tanh appears with the 1 - tanh² of autograd."""
    graph = torch.fx.Graph()
    scores = graph.placeholder("scores")
    capped = graph.call_function(torch.ops.aten.mul.Tensor, (
        graph.call_function(torch.ops.aten.tanh.default, (graph.call_function(torch.ops.aten.div.Tensor, (scores, 30.0)),)), 30.0,
    ))
    graph.output(capped)
    chain = torch.fx.GraphModule(torch.nn.Module(), graph)
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode() as mode:
        example = torch.empty(2, 3, 4)
    assert torch._guards.detect_fake_mode([example]) is mode
    vjp = attention_training.chain_vjp_module(chain, [example])
    s, g = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(vjp(s, g), g * (1 - torch.tanh(s / 30) ** 2))
    assert any(node.target is torch.ops.aten.tanh.default for node in vjp.graph.nodes)


@pytest.mark.parametrize("learned_bias", [False, True])
def test_scores_and_bias_from_baddbmm_train_fused(learned_bias):
    """BLOOM's attention computes its scores and ALiBi bias in one ``baddbmm``. In the joint graph the split into
    ``bmm`` and pointwise ops (``scaled_matmuls``) carries baddbmm's autograd number, so its backward ops are the
    attention's own: one fused forward and backward, no ``baddbmm`` and no M×N buffer left, and the gradients of
    q, k, v (and of the bias where it is learned) match float64 eager."""
    from test.test_score_matmul_forms import _alibi, bloom_attention

    torch._dynamo.utils.counters.clear()
    operands = [torch.randn(2, 4, 40, 16).requires_grad_() for _ in range(3)]
    alibi = _alibi(2, 4, 40)
    extras = {} if learned_bias else {"alibi": alibi}
    if learned_bias:
        operands.append(alibi.requires_grad_())
    out, grads, grad, code = train_on_cpu(bloom_attention, operands, extras)
    assert_matches_eager(bloom_attention, operands, extras, out, grads, grad)
    assert torch._dynamo.utils.counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert "baddbmm" not in "\n".join(code)
    assert_fused_training(code, 2 * 4 * 40 * 40)


def test_a_chain_whose_derivative_fills_in_place_trains_without_a_fault():
    """``torch.max(scores, floor)``: autograd's derivative of ``maximum`` fills the gradient in place
    (``masked_fill_``), which tracing keeps as a ``copy_`` into a temporary; the chain's derivative is made pure
    (``chain_modules``), so the backward lowers: no fault, one fused forward and backward, gradients as eager's."""

    def clamped(q, k, v, mask):
        scores = q @ k.transpose(-1, -2) * 0.25 + mask
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        return torch.softmax(scores, -1) @ v

    torch._dynamo.utils.counters.clear()
    operands = [torch.randn(2, 4, 40, 16).requires_grad_() for _ in range(3)]
    mask = torch.zeros(2, 1, 40, 40)
    mask[1, ..., 30:] = torch.finfo(torch.float32).min
    out, grads, grad, code = train_on_cpu(clamped, operands, {"mask": mask}, fault_containment=False)
    assert_matches_eager(clamped, operands, {"mask": mask}, out, grads, grad)
    assert_fused_training(code, 2 * 4 * 40 * 40)


def test_only_a_refill_of_a_temporary_leaves_the_derivative():
    """The rewrite that makes a traced derivative pure replaces ``copy_(dst, src)`` by ``src`` only where that
    changes nothing: dst a value the graph computed, no view of it, no use of it after the copy, src of its shape
    and dtype. A copy into a slice (which writes the tensor it views), one followed by another use of dst, or one
    that broadcasts src stays."""
    from inductor_overlay.fx_passes.chain_modules import _without_fills_of_temporaries
    from torch.fx.experimental.proxy_tensor import make_fx

    def refill(a, b):
        filled = a * 2
        return filled.copy_(b)

    def into_a_slice(a, b):
        whole = a * 2
        whole[:, :2].copy_(b[:, :2])
        return whole

    def read_before(a, b):
        filled = a * 2
        before = filled + 1
        return filled.copy_(b) + before

    def broadcast(a, b):
        return (a * 2).copy_(b[:1])

    a, b = torch.randn(3, 4), torch.randn(3, 4)
    for fn, kept in ((refill, 0), (read_before, 0), (into_a_slice, 1), (broadcast, 1)):
        module = _without_fills_of_temporaries(make_fx(fn)(a, b))
        copies = [n for n in module.graph.nodes if n.target is torch.ops.aten.copy_.default]
        assert len(copies) == kept, fn.__name__
        torch.testing.assert_close(module(a, b), fn(a.clone(), b), msg=fn.__name__)
    # A graph that reads dst itself after the copy (tracing reads the copy's result instead) keeps it.
    module = make_fx(refill)(a, b)
    graph = module.graph
    doubled, copy = (next(n for n in graph.nodes if n.target is target)
                     for target in (torch.ops.aten.mul.Tensor, torch.ops.aten.copy_.default))
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        later = graph.call_function(torch.ops.aten.add.Tensor, (copy, doubled))
        later.meta["val"] = copy.meta["val"]
    output.args = (later,)
    module.recompile()
    module = _without_fills_of_temporaries(module)
    assert any(n.target is torch.ops.aten.copy_.default for n in module.graph.nodes)


@pytest.mark.parametrize("form", ["xglm", "deberta", "deberta_learned_bias"])
def test_scores_viewed_between_batch_groupings_train_fused(form):
    """Older Hugging Face code views the scores between ``[B·H, M, N]`` and ``[B, H, M, N]`` on their way to the
    softmax. In the joint graph the views move as in inference (``score_views``: XGLM's below the softmax, after its
    ``torch.max`` clamp at finfo.min; DeBERTa-v2's up to the scores' matmul, past a relative bias), their ops keeping
    the numbers autograd gave the ops they replace: one fused forward and backward, no M×N buffer, and every
    gradient (the bias's too where it is learned) matches float64 eager. The clamp's derivative, which autograd's
    formula writes in place, becomes a pure pointwise subgraph (``chain_modules``)."""
    from test.test_score_matmul_forms import _padding_mask, deberta_attention, xglm_attention

    torch._dynamo.utils.counters.clear()
    if form == "xglm":
        fn, operands = xglm_attention, [torch.randn(8, 40, 16).requires_grad_() for _ in range(3)]
        extras = {"mask": _padding_mask(2, 40, 40, torch.float32)}
    else:
        fn, operands = deberta_attention, [torch.randn(8, 40, 16).requires_grad_() for _ in range(3)]
        bias, mask = torch.randn(8, 40, 40), torch.ones(2, 1, 40, 40, dtype=torch.bool)
        mask[1, :, :, 28:] = False
        extras = {"mask": mask}
        if form == "deberta_learned_bias":
            operands.append(bias.requires_grad_())
        else:
            extras = {"bias": bias, **extras}
    out, grads, grad, code = train_on_cpu(fn, operands, extras)
    assert_matches_eager(fn, operands, extras, out, grads, grad)
    assert torch._dynamo.utils.counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert torch._dynamo.utils.counters["inductor"]["flashlight_fault_fallback"] == 0
    assert_fused_training(code, 2 * 4 * 40 * 40, learned_full_biases=int(form == "deberta_learned_bias"))


# Hugging Face models whose parameters require grad (run without ``torch.no_grad()``, the training graph): GQA with
# rotary embeddings and HF's padding mask (llama) in the CI tier; in the full tier a finfo.min causal mask with its
# division by a tensor (gpt2), a bidirectional padding mask (bert), a soft-capped sliding window (gemma2), ALiBi added
# by ``baddbmm`` (bloom), a mask added on a ``[B, H, M, N]`` view of ``[B·H, M, N]`` scores (xglm), a sliding window
# (mistral), q/k norms (qwen3), MQA (gpt_bigcode) and relative position buckets (t5). DeBERTa-v2's relative-position
# scores are gathered per logit: declined for training, with the reason in the log.
HF_TRAINING = [
    ("llama", True), ("gpt2", False), ("bert", True), ("gemma2", True), ("bloom", True), ("xglm", True),
    ("mistral", True), ("qwen3", True), ("gpt_bigcode", True), ("t5", True),
]


@pytest.mark.parametrize("family_name,padded", [
    pytest.param(name, padded, id=f"{name}-{'padding_mask' if padded else 'no_mask'}",
                 marks=() if name == "llama" else pytest.mark.full)
    for name, padded in HF_TRAINING
])
def test_hf_model_trains_with_the_fused_backward(family_name, padded):
    """Every attention of the model fuses forward and backward, nothing falls back, and the gradients of every
    parameter match the eager model's (float32; HF's masks depend on the dtype, as in ``test_hf_models.py``)."""
    pytest.importorskip("transformers")
    from benchmarks import hf_models

    family = next(f for f in hf_models.FAMILIES if f.name == family_name)
    torch.manual_seed(0)
    overrides = dict(sliding_window=8) if family_name in ("gemma2", "mistral") else {}
    model = hf_models.build(family, hidden=64, heads=4, layers=1, **overrides)
    ids, mask = hf_models.token_inputs(2, 40, padded)

    # A fixed random weighting of the outputs (their squares would sum to a constant after the final norm: a
    # gradient of rounding noise).
    weights = torch.randn(hf_models.forward(model, ids, mask).shape, generator=torch.Generator().manual_seed(1))

    def loss_of(forward):
        return (forward(model, ids, mask).float() * weights).mean()

    loss_of(hf_models.forward).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with testing.cpu_triton(), fresh_cache():
        loss_of(torch.compile(hf_models.forward)).backward()
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == family.attentions_per_layer
    assert counters["inductor"]["flashlight_training_fault"] == 0
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    # Norm-wise per parameter, against the largest gradient too: a key projection's bias has a gradient of 0 in exact
    # arithmetic (it shifts every score of a row alike), rounding noise in both. Embedding tables are left out: their
    # gradient is a scatter-add, which the Triton interpreter loses duplicates of (default compile's too, here).
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    scale = max(float(reference.norm()) for reference in expected.values())
    errors = {}
    for name, reference in expected.items():
        grad = dict(model.named_parameters())[name].grad
        if name not in embeddings:
            errors[name] = float((grad - reference).norm()) / (float(reference.norm()) + 1e-3 * scale)
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.full
def test_deberta_v2_declines_training_with_its_reason(caplog):
    """Hugging Face's DeBERTa-v2 gathers its relative-position scores per logit: its attention is left to upstream
    for training (the graph still trains), with the reason in the log."""
    pytest.importorskip("transformers")
    from benchmarks import hf_models

    torch.manual_seed(0)
    model = hf_models.build(hf_models.BY_NAME["deberta-v2"], hidden=64, heads=4, layers=1)
    ids, mask = hf_models.token_inputs(2, 40, True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with testing.cpu_triton(), caplog.at_level(logging.INFO, logger="flashlight.attention_fusion"):
        out = torch.compile(lambda i, m: hf_models.forward(model, i, m))(ids, mask)
        out.float().mean().backward()
    assert torch._dynamo.utils.counters["inductor"]["flashlight_attention_fused_for_training"] == 0
    assert torch._dynamo.utils.counters["inductor"]["flashlight_fault_fallback"] == 0
    assert "not fused for training" in caplog.text


def test_a_fault_in_the_backward_kernel_falls_back_to_the_meaning_of_the_node(monkeypatch):
    """The fused backward reaches the backward graph's compiler already in place: when its lowering fails, the
    graph is compiled again on upstream's path with the node traced into the aten ops of its meaning."""
    from torch._inductor import lowering

    from inductor_overlay import ops

    def broken(*args, **kwargs):
        raise RuntimeError("injected backward fault")

    monkeypatch.setitem(lowering.lowerings, ops.online_softmax_attention_backward, broken)
    fn = variants.causal_masked_fill
    operands = [torch.randn(1, 2, 12, 8).requires_grad_() for _ in range(3)]
    with pytest.warns(UserWarning, match="injected backward fault"):
        out, grads, grad, code = train_on_cpu(fn, operands, {})
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 1
    assert_matches_eager(fn, operands, {}, out, grads, grad)


def _bias_viewed(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-1, -2) + bias.view(1, *bias.shape), -1) @ v


@pytest.mark.parametrize("learned", [True, False])
def test_a_bias_read_through_a_view_trains_fused(learned):
    """Inductor's joint-graph passes also run on the subgraphs of a graph that trains and read the value of a view's
    input: the chain's inputs carry their values (a view of a captured bias crashed the compile)."""
    operands = [torch.randn(1, 2, 12, 8).requires_grad_() for _ in range(3)]
    bias = torch.randn(2, 12, 12)
    operands, extras = (operands + [bias.requires_grad_()], {}) if learned else (operands, {"bias": bias})
    out, grads, grad, code = train_on_cpu(_bias_viewed, operands, extras)
    assert_matches_eager(_bias_viewed, operands, extras, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1


def test_gradients_summed_with_atomics_decline_under_deterministic_algorithms(caplog):
    """A bias shared across the batch sums its gradient with float32 atomics, whose order varies: under
    ``torch.use_deterministic_algorithms`` it declines (the log says why) and trains on upstream's path."""
    operands = [torch.randn(2, 3, 20, 8).requires_grad_() for _ in range(3)] + [torch.randn(3, 20, 20).requires_grad_()]
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with caplog.at_level(logging.INFO, logger="flashlight"):
            out, grads, grad, _ = train_on_cpu(_bias_added, operands, {})
    finally:
        torch.use_deterministic_algorithms(False)
    assert "summed with atomics; deterministic algorithms are requested" in caplog.text
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 0
    assert_matches_eager(_bias_added, operands, {}, out, grads, grad)


def _positions_after_a_transpose(q, k, v_rows):
    v = v_rows.transpose(1, 2)  # a differentiable op just before the positions, which carry its sequence number
    i = torch.arange(q.shape[1], device=q.device)
    scores = torch.bmm(q, k.transpose(1, 2))
    return torch.bmm(torch.softmax(scores.masked_fill(i[:, None] < i[None, :], float("-inf")), -1), v)


def test_positions_made_after_another_op_do_not_pull_its_backward_in():
    """Ops that make no autograd node (an ``arange``, a comparison) carry the sequence number of the op before them:
    the chain's backward is not taken to include that op's backward, and the attention trains fused."""
    operands = [torch.randn(2, 12, 8).requires_grad_(), torch.randn(2, 12, 8).requires_grad_(), torch.randn(2, 8, 12).requires_grad_()]
    out, grads, grad, code = train_on_cpu(_positions_after_a_transpose, operands, {})
    assert_matches_eager(_positions_after_a_transpose, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1


def test_64_bit_indexing_kernels_pass_the_gpu_front_end(monkeypatch):
    """Operands beyond 2^31 elements index in 64 bits (``INDEX_DTYPE``): the backward's two branches still define
    their shared names with one type each (Triton merges them), with a mask and a learned bias; forced here at a
    small size, through Triton's front end for sm90, and run."""
    from torch._inductor import select_algorithm

    monkeypatch.setattr(select_algorithm.TritonScheduling, "can_use_32bit_indexing", staticmethod(lambda *args: False))
    fn = _causal_learned_mask
    operands = [torch.randn(1, 2, 40, 16).requires_grad_() for _ in range(3)] + [torch.randn(40, 40).requires_grad_()]
    out, grads, grad, code = train_on_cpu(fn, operands, {})
    assert_matches_eager(fn, operands, {}, out, grads, grad)
    (backward,) = [text for text in testing.triton_kernels(code).values() if "grad_scores" in text]
    assert "INDEX_DTYPE : tl.constexpr = tl.int64" in backward
    testing.check_gpu_front_end(code)


def test_weights_without_a_softmax_over_few_column_tiles_decline_on_a_gpu(monkeypatch):
    """(A·B)·C with no batch and a narrow B would leave most of a GPU idle in the fused backward: declined there,
    with the reason; the same chain over enough column tiles, and any softmax attention, is taken."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))

    def region(shape, softmax=False):
        from torch._subclasses.fake_tensor import FakeTensorMode

        node = torch.fx.Graph().placeholder("scores")
        with FakeTensorMode():
            node.meta["val"] = torch.empty(shape, device="cuda")
        return SimpleNamespace(softmax=softmax, qk=node, score_root=node, pair=None)

    assert "fewer than the GPU's 132 multiprocessors" in attention_training._too_few_column_programs(region((16384, 128)))
    assert attention_training._too_few_column_programs(region((16384, 16384))) is None
    assert attention_training._too_few_column_programs(region((4, 32, 4096, 4096))) is None
    assert attention_training._too_few_column_programs(region((16384, 128), softmax=True)) is None


def _causal_with_bias(q, k, v, bias):
    n = torch.arange(q.shape[-2])
    scores = (q @ k.transpose(-2, -1) * 0.25 + bias).masked_fill(n[None, :] > n[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("trained", ["q", "k", "v", "q,k", "k,v", "bias", "q,bias"])
def test_attention_with_frozen_operands_trains_fused(trained):
    """Some of q, k, v and a bias require grad, the others not (k and v of a frozen memory, q alone trained, a bias
    alone): the views of a frozen operand make no autograd node and carry the number of one of the attention's own
    ops; the attention still trains fused, and every gradient that exists is eager's. The backward kernel launches
    only its row programs (dQ) where k and v are frozen, only its column programs (dKᵀ, dV) where q is, both where
    a bias's gradient is summed."""
    names = ("q", "k", "v", "bias")
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    operands = [q, k, v, torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(3))]  # a key bias per head
    wanted = [name in trained.split(",") for name in names]
    operands = [t.requires_grad_(flag) for t, flag in zip(operands, wanted)]
    out, grads, grad, code = train_on_cpu(_causal_with_bias, operands, {})
    leaves = [float64(t).requires_grad_(flag) for t, flag in zip(operands, wanted)]
    _causal_with_bias(*leaves).backward(grad.double())
    testing.assert_close_to_reference(out, _causal_with_bias(*[leaf.detach() for leaf in leaves]))
    for actual, leaf, flag in zip(grads, leaves, wanted):
        assert (actual is None) == (not flag)
        if flag:
            testing.assert_close_to_reference(actual, leaf.grad)
    assert_fused_training(code, 2 * 64 * 64)
    (backward,) = [text for text in testing.triton_kernels(code).values() if "grad_scores" in text]
    alone = {"q": "the row programs alone", "k": "the column programs alone", "v": "the column programs alone",
             "k,v": "the column programs alone"}.get(trained)
    for programs in ("the row programs alone", "the column programs alone"):
        assert (programs in backward) == (programs == alone), programs
