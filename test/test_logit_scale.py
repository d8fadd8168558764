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


def _traced(fn, *examples):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*examples)


_SCORES, _GRAD = torch.randn(2, 8, 8), torch.randn(2, 8, 8)
_KEEP = torch.rand(8, 8) > 0.3


@pytest.mark.parametrize("derivative, factor", [
    # a soft-cap's: c · g · (1 − tanh²) / c · scale (the product of constants is the scale)
    (lambda s, g: g * 50.0 * 1 * (1 - torch.tanh(s * 0.25 / 50.0) ** 2) / 50.0 * 0.25, 0.25),
    (lambda s, g: -(torch.where(_KEEP, g, 0.0) * 0.125), -0.125),  # a mask filling 0, a negation
    (lambda s, g: (g / 4.0).to(torch.float64).to(torch.float32), 0.25),  # dtype conversions pass
    (lambda s, g: g * s, None),  # no constant factor
    (lambda s, g: g * g * 0.5, None),  # not linear in the gradient
    (lambda s, g: torch.where(_KEEP, g * 0.5, 1.0), None),  # a fill other than 0
    (lambda s, g: g * 0.5 + s, None),  # an affine, not linear, map
    (lambda s, g: g * torch.full([2, 8, 8], 0.5), 0.5),  # a constant tensor of the gradient's shape
    (lambda s, g: (g[0] * 0.5).expand(2, 8, 8), None),  # a view on the way: not taken
    # a constant tensor's value as its dtype holds it; an integer one declines (it holds 2.5 as 2)
    (lambda s, g: g * torch.full([], 80**-0.5, dtype=torch.bfloat16), torch.tensor(80**-0.5, dtype=torch.bfloat16).item()),
    (lambda s, g: g * torch.full([], 2, dtype=torch.int64) * s, None),
    (lambda s, g: (g * 1e-3).half().float() * s, None),  # float16 could overflow without the factor
    (lambda s, g: g * 1e30 * 1e30, None),  # a product beyond float32's range
])
def test_constant_factors_leave_the_derivative(derivative, factor):
    """``fold_gradient_factors`` takes the constant factors off the gradient's path through the chain's derivative
    (its last input) and gives their product; the folded derivative times it is the derivative."""
    from inductor_overlay.fx_passes.logit_scale import fold_gradient_factors

    module = _traced(derivative, _SCORES, _GRAD)
    folded = fold_gradient_factors(module)
    if factor is None:
        assert folded is None
        return
    folded_module, found = folded
    assert found == pytest.approx(factor)
    torch.testing.assert_close(folded_module(_SCORES, _GRAD) * found, derivative(_SCORES, _GRAD))
    constants = [n for n in folded_module.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mul.Tensor
                 and any(isinstance(a, (int, float)) for a in n.args) and _grad_reaches(folded_module, n)]
    assert constants == []


def _grad_reaches(module, node):
    grad = [n for n in module.graph.nodes if n.op == "placeholder"][-1]
    frontier, seen = [grad], set()
    while frontier:
        current = frontier.pop()
        if current is node:
            return True
        if current not in seen:
            seen.add(current)
            frontier.extend(current.users)
    return False


@pytest.mark.parametrize("name, factors", [("softcap", 4), ("hf_decoder_mask", 1)])
def test_the_backward_applies_the_derivatives_factors_to_dq_and_dk_once(name, factors):
    """Trained in bf16 on the CPU harness: the backward kernel's derivative loses its constant factors (a soft-cap's
    ·c, ·1, /c and 1/√d; HF's 1/√d, which the forward cannot fold past its finfo.min mask), their product is
    GRAD_SCORES_SCALE on dQ and dK, and the gradients match float64 eager; with the switch off the derivative
    keeps them."""
    from test.test_training import assert_matches_eager, operands_of, train_on_cpu

    variant = variants.VARIANTS[name]
    products = {}
    for fold in (True, False):
        operands, extras = operands_of(variant, variants.Shape(B=1, H=2, M=40, N=40, D=16), dtype=torch.bfloat16)
        with config.patch(fold_gradient_factors=fold):
            out, grads, grad, code = train_on_cpu(variant.reference, operands, extras)
        assert_matches_eager(variant.reference, operands, extras, out, grads, grad)
        (backward,) = [text for text in testing.triton_kernels(code).values() if "GRAD_KT" in text]
        scale = float(re.search(r"GRAD_SCORES_SCALE : tl.constexpr = (\S+)", backward).group(1))
        folded = float(re.search(r"FOLDED_SCALE : tl.constexpr = (\S+)", backward).group(1))
        assert folded == 1.0 and scale == (0.25 if fold else 1.0)
        FileCheck().check("dk * GRAD_SCORES_SCALE").check("dq = dq * GRAD_SCORES_SCALE").run(backward)
        derivative = backward[backward.index("grad_logits = p"):backward.index("# dK +=")]
        products[fold] = len(re.findall(r" [*/] ", derivative[:derivative.index("grad_scores = ")]))
    assert products[False] - products[True] == factors


def test_derivatives_with_different_factors_keep_them():
    """``fold_common_gradient_factor`` folds the chain's derivative and the visible tiles' only with one factor."""
    from inductor_overlay.fx_passes.logit_scale import fold_common_gradient_factor

    half = _traced(lambda s, g: g * 0.5, _SCORES, _GRAD)
    quarter = _traced(lambda s, g: g * 0.25, _SCORES, _GRAD)
    modules, factor = fold_common_gradient_factor([half, quarter])
    assert (modules, factor) == ([half, quarter], 1.0)
    modules, factor = fold_common_gradient_factor([half, None])
    assert factor == 0.5 and modules[1] is None and modules[0] is not half


def _causal_negative_scale(q, k, v):
    rows, cols = _rows_cols(q, k)
    scores = (q @ k.transpose(-2, -1)) * -0.5
    return torch.softmax(torch.where(cols <= rows, scores, float("-inf")), dim=-1) @ v


def test_the_visible_tiles_derivative_loses_the_same_factor():
    """A causal mask over scores scaled by -0.5 (a negative factor the forward cannot fold): the backward runs the
    entirely visible tiles with the unmasked chain's derivative, which loses the factor with the masked one's;
    GRAD_SCORES_SCALE is -0.5 and the gradients match float64 eager."""
    from test.test_training import assert_matches_eager, train_on_cpu

    generator = torch.Generator().manual_seed(5)
    operands = [torch.randn(1, 2, 48, 16, generator=generator).requires_grad_() for _ in range(3)]
    out, grads, grad, code = train_on_cpu(_causal_negative_scale, operands, {})
    assert_matches_eager(_causal_negative_scale, operands, {}, out, grads, grad)
    (backward,) = [text for text in testing.triton_kernels(code).values() if "GRAD_KT" in text]
    assert float(re.search(r"GRAD_SCORES_SCALE : tl.constexpr = (\S+)", backward).group(1)) == -0.5
    # the visible tiles' loop beside the one over the partial tiles on both sides of them
    assert backward.count("for start_m in range(") == 1 and "for masked_step in range(0, masked_count)" in backward
