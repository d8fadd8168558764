"""Upstream's matmul padding (``pad_mm``) leaves attention's matmuls to the fusion (``fx_passes/pad_mm.py``).

On a GPU upstream pads a matmul with unaligned sizes when a compile-time benchmark finds the padded one faster;
the padded scores and probabilities did not fuse, so S = 300 fused or not depending on that timing. The CPU
harness forces the padding decision (``force_shape_pad``) and lets the pass believe it runs on a GPU.
"""

import contextlib
from unittest import mock

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.fx_passes import pad_mm

import flashlight
from benchmarks import variants
from flashlight import testing
from test.test_attention_fusion import assert_fused_attention, compile_on_cpu, reference

counters = torch._dynamo.utils.counters


@contextlib.contextmanager
def padding_forced():
    with mock.patch.object(pad_mm, "check_device", lambda a, b: True), mock.patch.object(
        pad_mm, "has_triton", lambda: True
    ), inductor_config.patch(force_shape_pad=True):
        yield


@pytest.mark.parametrize("program", [variants.vanilla_matmul, variants.causal_masked_fill, variants.softcap_tanh])
def test_unaligned_attention_fuses_where_upstream_would_pad(program):
    q, k, v = (torch.randn(2, 4, 37, 12) for _ in range(3))
    with padding_forced():
        out, code = compile_on_cpu(program, q, k, v)
    testing.assert_close_to_reference(out, reference(program, q, k, v))
    assert_fused_attention(code, out)


def projection(x, w):
    return torch.relu(x @ w)


def test_other_matmuls_are_still_padded():
    x, w = torch.randn(37, 12), torch.randn(12, 29)
    with padding_forced(), testing.cpu_triton():
        out, code = testing.compile_and_get_code(projection, x, w)
    torch.testing.assert_close(out, projection(x, w))
    assert "constant_pad_nd" in "\n".join(code)


def test_with_the_overlay_off_upstream_pads_attention():
    """The check above can fail: upstream pads these matmuls (soft-cap: upstream's SDPA patterns do not take it)."""
    q, k, v = (torch.randn(2, 4, 37, 12) for _ in range(3))
    with flashlight.enabled(False), padding_forced(), testing.cpu_triton():
        out, code = testing.compile_and_get_code(variants.softcap_tanh, q, k, v)
    testing.assert_close_to_reference(out, reference(variants.softcap_tanh, q, k, v))
    assert "constant_pad_nd" in "\n".join(code)
    assert counters["inductor"]["flashlight_attention_fused"] == 0



def _sigmoid_attention(q, k, v):
    from benchmarks import programs

    return programs.sigmoid_attention(q, k, v)


def _relu_weights(q, k, v):
    return torch.relu(q @ k.transpose(-1, -2) * 0.5) @ v


def _sinks(q, k, v):
    from benchmarks import programs

    return programs.attention_sinks(q, k, v, torch.linspace(-1.0, 1.0, q.shape[1]))


@pytest.mark.parametrize("program", [variants.softcap_tanh, _sigmoid_attention, _relu_weights, _sinks])
def test_unaligned_attention_trains_fused_where_upstream_would_pad(program):
    """In training, neither attention's matmuls nor the matmuls autograd made to differentiate them are padded (a
    padded backward matmul hides the attention's backward from the training pass). Weights without a softmax have no
    row max: their matmuls are attention's when the attention pass accepts the region they bound."""
    from test.test_training import assert_matches_eager, train_on_cpu

    operands = [torch.randn(2, 4, 37, 12).requires_grad_() for _ in range(3)]
    with padding_forced():
        out, grads, grad, code = train_on_cpu(program, operands, {})
    assert_matches_eager(program, operands, {}, out, grads, grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert "constant_pad_nd" not in "\n".join(code)
