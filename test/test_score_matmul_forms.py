"""How the scores' matmul is written: ``baddbmm`` with a bias (BLOOM), and views that are not attention's rows.

CPU harness; every case against a float64 eager reference on fresh random inputs.
"""

import logging

import torch
import torch.nn.functional as F

from flashlight import testing
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
