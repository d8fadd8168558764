"""The chain's constant scale folded into the kernel's exp2 factor (``fx_passes/logit_scale.py``), CPU harness."""

import math
import re

import pytest
import torch
from torch.testing import FileCheck

from benchmarks import variants
from flashlight import testing
from inductor_overlay import config
from inductor_overlay.kernel.online_softmax_attention import LOG2E


def _rows_cols(q, k):
    return torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]


def causal_divided(q, k, v):
    rows, cols = _rows_cols(q, k)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(cols > rows - 20, float("-inf")), dim=-1) @ v  # first 20 rows: NaN


def two_factors(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.5 * 0.3, dim=-1) @ v


def negative_factor(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * -0.5, dim=-1) @ v


def biased_then_scaled(q, k, v):
    rows, cols = _rows_cols(q, k)
    return torch.softmax((q @ k.transpose(-2, -1) - 0.1 * (rows - cols).abs()) * 0.5, dim=-1) @ v


def finite_fill_scaled_first(factor, fill=torch.finfo(torch.float32).min):
    """GPT-2's order (scale, then ``where(causal, w, fill)``) with any factor and fill."""

    def attention(q, k, v):
        rows, cols = _rows_cols(q, k)
        return torch.softmax(torch.where(cols <= rows, q @ k.transpose(-2, -1) * factor, fill), dim=-1) @ v

    return attention


def _logit_scale(kernel):
    return float(re.search(r"LOGIT_SCALE : tl.constexpr = (\S+)", kernel)[1])


def _compile(fn, *args, **patches):
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight", **patches):
        out, code = testing.compile_and_get_code(fn, *args, fresh_cache=True)
    kernels = testing.triton_kernels(code)
    assert len(kernels) == 1, list(kernels)
    return out, next(iter(kernels.values()))


@pytest.mark.parametrize(
    "fn,factor",
    [(causal_divided, 0.25), (two_factors, 0.15), (variants.gpt2_causal_where, 0.25)],
    ids=["causal-divided", "two-factors", "gpt2-finite-fill"],
)
def test_constant_scale_joins_the_exp2_factor(fn, factor):
    """The chain keeps only its mask; every logit is scaled and shifted by the row max in one expression."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    out, kernel = _compile(fn, q, k, v)
    assert _logit_scale(kernel) == pytest.approx(factor * LOG2E, rel=1e-12)
    FileCheck().check("scores = tl.dot(").check_not(" * 0.").check_not(" / ").check(
        "p = tl.exp2(logits * LOGIT_SCALE - m_shift[:, None])"
    ).run(kernel)
    expected = fn(q.double(), k.double(), v.double())
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


@pytest.mark.parametrize(
    "fn,patches",
    [
        (negative_factor, {}),
        (biased_then_scaled, {}),
        (two_factors, {"fold_logit_scale": False}),
        (finite_fill_scaled_first(0.25, fill=-1e4), {}),
        (finite_fill_scaled_first(1e-3), {}),
    ],
    ids=["negative-factor", "bias-before-scale", "flag-off", "fill-not-absorbing", "fill-lifted-above-bound"],
)
def test_scale_stays_in_the_chain_when_it_cannot_fold(fn, patches):
    """A negative factor would turn the row max into a min, and a bias added before the scale does not commute
    with it; a finite fill weighs in eager's softmax unless it is absorbing (-1e4 is not), and folding 1e-3 into
    finfo.min's fill would lift it to -3.4e35, above -2^124, where it might not absorb: the chain keeps its
    factors and the kernel's factor is log2(e) alone."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    out, kernel = _compile(fn, q, k, v, **patches)
    assert _logit_scale(kernel) == LOG2E
    FileCheck().check("scores = tl.dot(").check(" * ").check("logits = ").run(kernel)
    testing.assert_close_to_reference(out, fn(q.double(), k.double(), v.double()))


def scaled_by_tensor(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v


def divided_by_tensor(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-2, -1) / scale, dim=-1) @ v


def soft_capped_by_tensor(q, k, v, scale):
    return torch.softmax(30.0 * torch.tanh(q @ k.transpose(-2, -1) * scale / 30.0), dim=-1) @ v


@pytest.mark.parametrize("fn", [scaled_by_tensor, divided_by_tensor], ids=["times", "divided"])
@pytest.mark.parametrize("scale", [[0.5, -0.7, 1.3, -2.0], [0.0, 0.5, -0.5, 2.0]], ids=["signs", "zero"])
def test_scale_known_at_run_time_is_read_by_the_kernel(fn, scale):
    """Upstream rewrites a softmax scaled by a tensor into the sign trick (``exp((x·s − max x·s)·(s·c))``); the
    overlay gives the logits back (``fx_passes/signed_scales.py``) and the kernel multiplies each logit by the
    per-head scale it reads. Negative scales and a zero (a NaN head when dividing) give eager's values."""
    q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
    c = torch.tensor(scale).view(4, 1, 1)
    out, kernel = _compile(fn, q, k, v, c)
    assert _logit_scale(kernel) == LOG2E
    FileCheck().check("scores = tl.dot(").check("tl.load(").check("logits = ").check_not("tl.where(tmp").run(kernel)
    expected = fn(q.double(), k.double(), v.double(), c.double())
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


def test_zero_dim_cpu_tensor_read_by_the_chain():
    """A 0-d tensor (``torch.tensor(0.7)``, which eager lets meet tensors of any device) is handed to a GPU kernel
    as a scalar by Inductor; the chain reads it from a one-element buffer instead of loading from a scalar."""
    q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
    c = torch.tensor(0.7)
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        out, code = testing.compile_and_get_code(soft_capped_by_tensor, q, k, v, c, fresh_cache=True)
    [kernel] = [text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text]
    FileCheck().check("scores = tl.dot(").check("tl.load(in_ptr").check("tanh").run(kernel)
    testing.assert_close_to_reference(out, soft_capped_by_tensor(q.double(), k.double(), v.double(), c.double()))


def _softmax_alone(x, scale):
    return torch.softmax(x * scale, dim=-1).sum(-1)


def test_signed_scales_rewrite_only_attention_and_follow_their_switch():
    """With ``rejoin_signed_scales`` off, a softmax scaled by a tensor keeps upstream's sign trick and the attention
    runs on upstream's path; a softmax that weighs no matmul keeps it with the switch on."""
    q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
    c = torch.tensor([0.5, -0.7, 1.3, -2.0]).view(4, 1, 1)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight", rejoin_signed_scales=False):
        out, _ = testing.compile_and_get_code(scaled_by_tensor, q, k, v, c)
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert counters["inductor"]["flashlight_signed_scales_rejoined"] == 0
    testing.assert_close_to_reference(out, scaled_by_tensor(q.double(), k.double(), v.double(), c.double()))
    counters.clear()
    x = torch.randn(2, 4, 40, 40)
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        out, _ = testing.compile_and_get_code(_softmax_alone, x, c)
    assert counters["inductor"]["flashlight_signed_scales_rejoined"] == 0
    testing.assert_close_to_reference(out, _softmax_alone(x.double(), c.double()))
    # In training too, where the softmax's backward reaches the scores' matmul's backward.
    a, b, w = (torch.randn(2, 4, 40, 16).requires_grad_() for _ in range(3))
    counters.clear()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        out, _ = testing.compile_and_get_code(_weighted_softmax_alone, a, b, c, w)
        out.sum().backward()
    assert counters["inductor"]["flashlight_signed_scales_rejoined"] == 0
    testing.assert_close_to_reference(out, _weighted_softmax_alone(a.double(), b.double(), c.double(), w.double()))


def _weighted_softmax_alone(a, b, scale, w):
    return (torch.softmax(a @ b.transpose(-2, -1) * scale, dim=-1) * (w @ w.transpose(-2, -1))).sum(-1)
