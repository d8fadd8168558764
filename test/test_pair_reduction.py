"""IPA-style attention (issue 6): a small reduction inside the score chain and a second output reduced against a
per-pair tensor, both fused into the one online-softmax kernel (CPU harness, float64 references)."""

import pytest
import torch
from torch.testing import FileCheck

from benchmarks import programs
from flashlight import testing
from inductor_overlay import config
from test.test_programs import compile_on_cpu, float64

counters = torch._dynamo.utils.counters


def check_against_eager(fn, inputs):
    out, code = compile_on_cpu(fn, inputs)
    expected = fn(**float64(inputs))
    for actual, reference in zip(out, expected, strict=True):
        testing.assert_close_to_reference(actual, reference)
    return out, code


def score_numel(inputs):
    b, h, s = inputs["q"].shape[:3]
    return b * h * s * s


def test_point_distance_and_pair_output_live_in_the_kernel():
    """The squared point distance is summed per tile element (no M×N distance tensor, no second kernel), and
    Σ_j a_ij z_ij accumulates beside A·V under the same rescaling and normaliser."""
    inputs = programs.ipa_inputs(B=2, H=3, S=21, C=16, P=4, Cz=8)
    (out, pair), code = check_against_eager(programs.ipa_attention, inputs)
    testing.check_kernels(code, kernels=1, extern_calls=0)
    kernel = next(iter(testing.triton_kernels(code).values()))
    FileCheck().check("pair_acc = tl.zeros([BLOCK_M, C_TILE]").check("for start_n in range(").check(
        "alpha = tl.exp2("
    ).check("pair_acc = pair_acc * alpha[:, None] + tl.sum(p[:, :, None] * y").check(
        "acc = tl.dot(p, v, acc * alpha"
    ).check("pair_acc = pair_acc / l_i").check("tl.store(PAIR_OUT").run(kernel)
    assert all(n < score_numel(inputs) for n in testing.allocated_buffer_numels(code))
    assert pair.shape == (2, 3, 21, 8)
    assert counters["inductor"]["flashlight_attention_fused"] == 1


def ipa_with_masked_rows(q, k, v, q_pts, k_pts, pair_bias, head_weights, z, row_mask):
    logits = q @ k.transpose(-1, -2) + pair_bias
    logits = logits - head_weights.view(1, -1, 1, 1) * ((q_pts.unsqueeze(-3) - k_pts.unsqueeze(-4)) ** 2).sum((-1, -2))
    weights = torch.softmax(logits.masked_fill(row_mask, float("-inf")), dim=-1)
    return weights @ v, (weights.unsqueeze(-1) * z.unsqueeze(1)).sum(-2)


def test_fully_masked_rows_are_nan_in_both_outputs():
    inputs = programs.ipa_inputs(B=1, H=2, S=19, C=8, P=2, Cz=4)
    inputs["row_mask"] = (torch.arange(19) % 5 == 0).view(19, 1).expand(19, 19)
    (out, pair), _ = check_against_eager(ipa_with_masked_rows, inputs)
    assert out[:, :, ::5].isnan().all() and pair[:, :, ::5].isnan().all()
    assert not out[:, :, 1::5].isnan().any() and not pair[:, :, 1::5].isnan().any()
    assert counters["inductor"]["flashlight_attention_fused"] == 1


def pair_first_with_late_projection(q, k, v, z, w):
    weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    pair = (weights.unsqueeze(-1) * (z @ w).unsqueeze(1)).sum(-2)  # z projected inside the graph
    return weights @ v, pair


def test_pair_tensor_computed_in_the_graph_and_reduced_first():
    """The fused node stands where the first of its outputs was; the pair tensor's own computation moves before
    it when the graph computed it later."""
    g = torch.Generator().manual_seed(0)
    inputs = dict(q=torch.randn(2, 2, 23, 8, generator=g), k=torch.randn(2, 2, 23, 8, generator=g),
                  v=torch.randn(2, 2, 23, 8, generator=g), z=torch.randn(2, 23, 23, 6, generator=g),
                  w=torch.randn(6, 5, generator=g))
    _, code = check_against_eager(pair_first_with_late_projection, inputs)
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    assert sum("for start_n in range(" in k for k in testing.triton_kernels(code).values()) == 1


def pair_of_the_scores(q, k, v, z):
    scores = q @ k.transpose(-1, -2)
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, (weights.unsqueeze(-1) * (z.unsqueeze(1) * scores.unsqueeze(-1))).sum(-2)


def two_pair_reductions(q, k, v, z):
    weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return weights @ v, (weights.unsqueeze(-1) * z.unsqueeze(1)).sum(-2), (weights.unsqueeze(-1) * z.unsqueeze(1).cos()).sum(-2)


@pytest.mark.parametrize("fn", [pair_of_the_scores, two_pair_reductions])
def test_pair_reductions_that_do_not_fit_stay_on_upstreams_path(fn):
    """A per-pair tensor that depends on the scores, or a second pair reduction: declined, same results."""
    g = torch.Generator().manual_seed(1)
    inputs = dict(q=torch.randn(1, 2, 17, 8, generator=g), k=torch.randn(1, 2, 17, 8, generator=g),
                  v=torch.randn(1, 2, 17, 8, generator=g), z=torch.randn(1, 17, 17, 3, generator=g))
    check_against_eager(fn, inputs)
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert counters["inductor"]["flashlight_attention_declined"] >= 1


@pytest.mark.parametrize("points,in_kernel", [(5, True), (6, False)])
def test_chain_reductions_above_the_limit_are_read_as_tensors(points, in_kernel):
    """5 points × 3 coordinates = 15 terms are unrolled into the chain; 18 exceed chain_reduction_max_elements
    (16): the distance is computed by its own kernel and read by the fused one, which still fuses."""
    inputs = programs.ipa_inputs(B=1, H=2, S=18, C=8, P=points, Cz=4)
    _, code = check_against_eager(programs.ipa_attention, inputs)
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    kernels = testing.triton_kernels(code)
    assert len(kernels) == (1 if in_kernel else 2)
    assert any(n >= score_numel(inputs) for n in testing.allocated_buffer_numels(code)) != in_kernel


def openfold_pair_output(q, k, v, z):
    weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return weights @ v, torch.matmul(weights.transpose(-2, -3), z)  # [B, S, H, Cz], OpenFold's form


def test_pair_output_written_as_a_matmul_over_query_batches_fuses():
    """OpenFold writes Σ_j a_ij z_ij as a batched matmul with the query position as batch
    (``fx_passes/pair_matmul.py`` turns it into the kernel's pair sum): one attention, no extern matmul."""
    g = torch.Generator().manual_seed(2)
    inputs = dict(q=torch.randn(1, 2, 17, 8, generator=g), k=torch.randn(1, 2, 17, 8, generator=g),
                  v=torch.randn(1, 2, 17, 8, generator=g), z=torch.randn(1, 17, 17, 3, generator=g))
    (_, pair), code = check_against_eager(openfold_pair_output, inputs)
    testing.check_kernels(code, extern_calls=0)
    assert pair.shape == (1, 17, 2, 3)
    assert counters["inductor"]["flashlight_attention_fused"] == 1


def test_pair_reduction_gets_one_tile_config_on_the_gpu():
    """Autotuning among several pair-reduction configs faulted on the H100 (see PAIR_TILES): one config, sized by
    the channels so the [BLOCK_M, BLOCK_N, C] tile stays near 128 registers per thread."""
    from inductor_overlay.kernel.online_softmax_attention import kernel_configs

    cuda = torch.device("cuda")
    assert kernel_configs(16, 16, cuda, pair_channels=32) == [dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2)]
    assert kernel_configs(16, 16, cuda, pair_channels=64) == [dict(BLOCK_M=16, BLOCK_N=16, num_warps=8, num_stages=2)]
    assert len(kernel_configs(64, 64, cuda)) == 3


def test_more_pair_channels_than_the_limit_are_declined():
    inputs = programs.ipa_inputs(B=1, H=2, S=17, C=8, P=2, Cz=config.pair_reduction_max_channels + 1)
    check_against_eager(programs.ipa_attention, inputs)
    assert counters["inductor"]["flashlight_attention_fused"] == 0


def test_openfold_pair_matmul_is_accumulated_in_the_kernel():
    """OpenFold's ``matmul(a.transpose(-2, -3), z)`` becomes the kernel's pair accumulator: no extern matmul, no
    buffer of the scores' size, and the [B, S, H, Cz] result in OpenFold's order."""
    inputs = programs.ipa_inputs(B=2, H=3, S=21, C=16, P=4, Cz=8)
    (out, pair), code = check_against_eager(programs.ipa_attention_openfold, inputs)
    testing.check_kernels(code, kernels=2, extern_calls=0)
    kernel = next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)
    FileCheck().check("pair_acc = pair_acc * alpha[:, None] + tl.sum(p[:, :, None] * y").check(
        "tl.store(PAIR_OUT"
    ).run(kernel)
    assert all(n < score_numel(inputs) for n in testing.allocated_buffer_numels(code))
    assert pair.shape == (2, 21, 3, 8)
    assert counters["inductor"]["flashlight_attention_fused"] == 1


def test_openfold_pair_matmul_is_left_as_it_was_when_the_attention_cannot_take_it():
    """Above pair_reduction_max_channels the attention declines the pair sum: the rewrite is undone, and upstream
    runs the three matmuls as written."""
    inputs = programs.ipa_inputs(B=1, H=2, S=17, C=8, P=2, Cz=config.pair_reduction_max_channels + 1)
    _, code = check_against_eager(programs.ipa_attention_openfold, inputs)
    FileCheck().check_count("extern_kernels.bmm(", 3, exactly=True).run("\n".join(code))
    assert counters["inductor"]["flashlight_attention_fused"] == 0
