"""How the scores' matmul is written: ``baddbmm`` with a bias (BLOOM), views that are not attention's rows, views
that regroup the scores' batch dims around a mask or a bias (XGLM, DeBERTa-v2), gathered relative-position scores.

CPU harness; every case against a float64 eager reference on fresh random inputs.
"""

import logging
import re

import pytest
import torch
import torch.nn.functional as F

from flashlight import testing
from inductor_overlay import config
from test.test_attention_fusion import assert_fused_attention, compile_on_cpu, fresh, reference

counters = torch._dynamo.utils.counters


def bloom_attention(q, k, v, alibi, beta=1.0):
    """BLOOM's attention: the ALiBi bias ``[B·H, 1, N]`` added by ``baddbmm``, a float32 softmax, ``bmm``."""
    batch, heads, rows, dim = q.shape
    columns = k.shape[-2]
    scores = alibi.baddbmm(
        q.reshape(batch * heads, rows, dim),
        k.reshape(batch * heads, columns, dim).transpose(1, 2),
        beta=beta,
        alpha=dim**-0.5,
    )
    probabilities = torch.softmax(scores.view(batch, heads, rows, columns), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probabilities.view(batch * heads, rows, columns), v.reshape(batch * heads, columns, dim))
    return out.view(batch, heads, rows, dim)


def _alibi(batch, heads, columns):
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    return (slopes[:, None] * torch.arange(columns)[None, :]).repeat(batch, 1).view(batch * heads, 1, columns)


def test_baddbmm_scores_fuse_with_their_bias():
    q, k, v = fresh(2, 4, 37, 16), fresh(2, 4, 45, 16), fresh(2, 4, 45, 16)
    alibi = _alibi(2, 4, 45)
    out, code = compile_on_cpu(bloom_attention, q, k, v, alibi)
    assert_fused_attention(code, out)
    assert "baddbmm" not in "\n".join(code)
    testing.assert_close_to_reference(out, reference(bloom_attention, q, k, v, alibi))


def test_baddbmm_with_beta_zero_ignores_its_input():
    q, k, v = fresh(2, 4, 21, 16), fresh(2, 4, 30, 16), fresh(2, 4, 30, 16)
    poisoned = torch.full((8, 1, 30), float("nan"))

    def attention(q, k, v, alibi):
        return bloom_attention(q, k, v, alibi, beta=0.0)

    out, code = compile_on_cpu(attention, q, k, v, poisoned)
    assert_fused_attention(code, out)
    assert not out.isnan().any()
    testing.assert_close_to_reference(out, reference(attention, q, k, v, poisoned))


def test_baddbmm_outside_attention_keeps_upstreams_kernel():
    def scaled_sum(bias, a, b):
        return torch.baddbmm(bias, a, b, alpha=0.5).relu().sum(-1)

    bias, a, b = fresh(3, 1, 20), fresh(3, 10, 8), fresh(3, 8, 20)
    out, code = compile_on_cpu(scaled_sum, bias, a, b)
    assert "baddbmm" in "\n".join(code)
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    testing.assert_close_to_reference(out, reference(scaled_sum, bias, a, b))


def swiglu_mlp(x, gate, up, down):
    """A gated MLP on ``[B, S, hidden]``: its matmuls run over B·S rows and are viewed as ``[B, S, ·]``."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def test_a_view_that_splits_the_matmuls_rows_declines():
    """``(silu(x·Gᵀ) ⊙ x·Uᵀ)·Dᵀ`` is a chained matmul, but its product ``[B·S, I]`` reaches the chain viewed as
    ``[B, S, I]``: the view splits the kernel's rows. It used to fuse with B as a batch dim on top of B·S rows
    (an output B times too large, caught only as a fault: Hugging Face's Llama MLP at hidden size 128)."""
    x, gate, up, down = fresh(2, 24, 32), fresh(48, 32) / 6, fresh(48, 32) / 6, fresh(32, 48) / 7
    out, code = compile_on_cpu(swiglu_mlp, x, gate, up, down)
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    testing.assert_close_to_reference(out, reference(swiglu_mlp, x, gate, up, down))


def softmax_of_a_linear(x, keys, values):
    """A softmax over a linear layer's outputs, ``[B, S, N]`` from one matmul over B·S rows."""
    return torch.softmax(F.linear(x, keys), dim=-1) @ values


def test_a_softmax_over_rows_split_by_a_view_declines_with_a_reason(caplog):
    x, keys, values = fresh(2, 24, 16), fresh(40, 16), fresh(40, 8)
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, code = compile_on_cpu(softmax_of_a_linear, x, keys, values)
    assert "a view of the scores splits or merges their rows" in caplog.text
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    testing.assert_close_to_reference(out, reference(softmax_of_a_linear, x, keys, values))


def xglm_attention(q, k, v, mask, softmax_dtype=None):
    """Older Hugging Face code (XGLM, TrOCR, MVP, FSMT, ...): ``[B·H, ·, D]`` operands, the mask added to a
    ``[B, H, M, N]`` view of the scores, clamped at ``finfo.min``, viewed back to ``[B·H, M, N]`` for the softmax."""
    batch_heads, rows, columns = q.shape[0], q.shape[1], k.shape[1]
    batch = mask.shape[0]
    scores = torch.bmm(q * q.shape[-1] ** -0.5, k.transpose(1, 2))
    scores = scores.view(batch, batch_heads // batch, rows, columns) + mask
    scores = torch.max(scores, torch.full((), torch.finfo(scores.dtype).min, dtype=scores.dtype))
    probabilities = F.softmax(scores.view(batch_heads, rows, columns), dim=-1, dtype=softmax_dtype).to(q.dtype)
    return torch.bmm(probabilities, v)


def _padding_mask(batch, rows, columns, dtype):
    mask = torch.zeros(batch, 1, rows, columns, dtype=dtype)
    mask[1, :, :, columns - columns // 3 :] = torch.finfo(dtype).min
    return mask


def test_a_softmax_over_scores_viewed_back_to_the_matmuls_batch_fuses(caplog):
    q, k, v = fresh(8, 37, 16), fresh(8, 45, 16), fresh(8, 45, 16)
    mask = _padding_mask(2, 37, 45, torch.float32)
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, code = compile_on_cpu(xglm_attention, q, k, v, mask)
    assert "moved below the view" in caplog.text
    assert_fused_attention(code, out)
    testing.assert_close_to_reference(out, reference(xglm_attention, q, k, v, mask))


def test_a_float32_softmax_over_bf16_scores_viewed_back_fuses():
    q, k, v = (fresh(8, 33, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = _padding_mask(2, 33, 33, torch.bfloat16)
    out, code = compile_on_cpu(xglm_attention, q, k, v, mask, torch.float32)
    assert_fused_attention(code, out)
    testing.assert_close_to_reference(out, reference(xglm_attention, q, k, v, mask, torch.float32))


def test_moving_the_softmax_keeps_probabilities_used_elsewhere():
    """The rewrite is exact, so it stands where the fusion then declines (the probabilities are also returned)."""

    def with_probabilities(q, k, v, mask):
        batch_heads, rows, columns = q.shape[0], q.shape[1], k.shape[1]
        scores = torch.bmm(q, k.transpose(1, 2)).view(2, batch_heads // 2, rows, columns) + mask
        probabilities = F.softmax(scores.view(batch_heads, rows, columns), dim=-1)
        return torch.bmm(probabilities, v), probabilities

    q, k, v = fresh(8, 21, 16), fresh(8, 30, 16), fresh(8, 30, 16)
    mask = _padding_mask(2, 21, 30, torch.float32)
    (out, probabilities), code = compile_on_cpu(with_probabilities, q, k, v, mask)
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    expected_out, expected_probabilities = reference(with_probabilities, q, k, v, mask)
    testing.assert_close_to_reference(out, expected_out)
    testing.assert_close_to_reference(probabilities, expected_probabilities)


def deberta_attention(q, k, v, bias, mask):
    """DeBERTa-v2: ``[B·H, ·, D]`` operands, a relative-position bias added to the ``[B·H, M, N]`` scores, which
    are then viewed as ``[B, H, M, N]`` for the ``[B, 1, M, N]`` mask and the softmax."""
    heads = q.shape[0] // mask.shape[0]
    scores = torch.bmm(q, k.transpose(-1, -2) / q.shape[-1] ** 0.5) + bias
    scores = scores.view(-1, heads, scores.size(-2), scores.size(-1))
    scores = scores.masked_fill(~mask, torch.finfo(q.dtype).min)
    probabilities = F.softmax(scores, dim=-1)
    return torch.bmm(probabilities.view(-1, probabilities.size(-2), probabilities.size(-1)), v)


def test_a_batch_view_after_a_bias_moves_up_to_the_scores_matmul(caplog):
    q, k, v, bias = fresh(8, 37, 16), fresh(8, 45, 16), fresh(8, 45, 16), fresh(8, 37, 45)
    mask = torch.ones(2, 1, 37, 45, dtype=torch.bool)
    mask[1, :, :, 30:] = False
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, code = compile_on_cpu(deberta_attention, q, k, v, bias, mask)
    assert "moved up to the scores' matmul" in caplog.text
    assert_fused_attention(code, out)
    testing.assert_close_to_reference(out, reference(deberta_attention, q, k, v, bias, mask))


def test_a_view_that_cannot_move_declines_and_keeps_the_result(caplog):
    """A ``[H, M, N]`` bias added to ``[B, H, M, N]`` scores that are then merged to ``[B·H, M, N]`` and masked:
    the merge cannot move up (the bias has only some of the batch dims) nor below the softmax (the mask is applied
    after it). The attention pass declines and upstream computes the same result."""

    def merged_after_a_head_bias(q, k, v, bias, mask):
        scores = torch.bmm(q, k.transpose(-1, -2)).view(2, 4, 21, 30) + bias
        scores = scores.view(8, 21, 30).masked_fill(~mask, float("-inf"))
        return torch.bmm(F.softmax(scores, dim=-1), v)

    q, k, v, bias = fresh(8, 21, 16), fresh(8, 30, 16), fresh(8, 30, 16), fresh(4, 21, 30)
    mask = torch.rand(21, 30) > 0.2
    mask[:, 0] = True
    with caplog.at_level(logging.INFO, logger="flashlight"):
        out, code = compile_on_cpu(merged_after_a_head_bias, q, k, v, bias, mask)
    assert "is not elementwise on the scores" in caplog.text
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    testing.assert_close_to_reference(out, reference(merged_after_a_head_bias, q, k, v, bias, mask))


def disentangled_attention(q, k, v, position_keys, position_queries, mask, span=8):
    """DeBERTa's disentangled attention: content-to-content scores, plus content-to-position and
    position-to-content scores gathered from ``[B·H, M, 2·span]`` matmuls at the clamped relative position."""
    rows, columns = q.shape[1], k.shape[1]
    relative = torch.arange(rows)[:, None] - torch.arange(columns)[None, :]
    c2p = torch.bmm(q, position_keys.transpose(-1, -2))
    c2p = torch.gather(c2p, -1, torch.clamp(relative + span, 0, 2 * span - 1).expand(q.shape[0], rows, columns))
    p2c = torch.bmm(k, position_queries.transpose(-1, -2))
    p2c_index = torch.clamp(-relative.T + span, 0, 2 * span - 1).expand(q.shape[0], columns, rows)
    p2c = torch.gather(p2c, -1, p2c_index).transpose(-1, -2)
    return deberta_attention(q, k, v, (c2p + p2c) / (3 * q.shape[-1]) ** 0.5, mask)


@pytest.mark.parametrize("in_kernel", [True, False], ids=["gathers_in_kernel", "bias_read"])
def test_relative_position_scores_fuse(in_kernel):
    """With ``gathers_in_score_chain`` the ``gather``s read the two small position-score tensors per logit and no
    M×N bias reaches memory; without it (the default) the gathered bias is computed by its own kernel and read."""
    q, k, v = fresh(8, 37, 16), fresh(8, 45, 16), fresh(8, 45, 16)
    position_keys, position_queries = fresh(8, 16, 16), fresh(8, 16, 16)
    mask = torch.ones(2, 1, 37, 45, dtype=torch.bool)
    mask[1, :, :, 30:] = False
    args = (q, k, v, position_keys, position_queries, mask)
    with config.patch(gathers_in_score_chain=in_kernel):
        out, code = compile_on_cpu(disentangled_attention, *args)
    kernels = [text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text]
    assert len(kernels) == 1 and counters["inductor"]["flashlight_attention_fused"] == 1
    testing.check_kernels(code, extern_calls=2)  # the two position-score matmuls
    assert (max(testing.allocated_buffer_numels(code)) < 8 * 37 * 45) == in_kernel
    loop = kernels[0].split("scores = tl.dot(")[1].split("tl.dot(p")[0]
    gathers = re.findall(r"tl\.load\(in_ptr\d+ \+ tmp\d+ \+ 16\*tmp\d+", loop)  # a table row, at a computed column
    assert len(gathers) == (2 if in_kernel else 0), loop
    testing.assert_close_to_reference(out, reference(disentangled_attention, *args))
