"""Attention masked by tensors made outside the graph runs as the in-function causal form (SDPA's causal attention,
or our kernel with the causal formula) while those tensors hold the causal mask, reading them otherwise
(``fx_passes/causal_tensor_route.py``, ``mask_checks.py``), on the CPU harness with the SDPA route turned on for
the CPU (its CPU flash kernel), every call compared with float64 eager."""

import re

import pytest
import torch
from torch.testing import FileCheck

from benchmarks.variants import make_inputs, Shape
from benchmarks.written_forms import MADE_ONCE, form_variant
from flashlight import testing
from inductor_overlay import config, mask_checks
from inductor_overlay.fx_passes import causal_tensor_route
from test.test_attention_fusion import reference
from test.test_block_sparsity import causal_bias_read_by_a_mask, causal_factor

counters = torch._dynamo.utils.counters
ROUTE = dict(sdpa_pattern_policy="unmasked_sdpa", sdpa_route_devices=("cpu",))
SHAPE = Shape(1, 2, 96, 96, 16)


@pytest.fixture(autouse=True)
def small_work_routed(monkeypatch):
    """The tests' shapes are far below the least work the route takes on a GPU (``MIN_WORK``)."""
    monkeypatch.setattr(causal_tensor_route, "MIN_WORK", 0)


def spy_on_checks(monkeypatch, answer_name: str, start_name: str) -> dict:
    """Every answer ``mask_checks.<answer_name>`` gives, and every check ``mask_checks.<start_name>`` starts."""
    seen = {"answers": [], "checks": 0}
    answer, start = getattr(mask_checks, answer_name), getattr(mask_checks, start_name)

    def spy_answer(*args):
        seen["answers"].append(answer(*args))
        return seen["answers"][-1]

    def spy_start(*args):
        seen["checks"] += 1
        return start(*args)

    monkeypatch.setattr(mask_checks, answer_name, spy_answer)
    monkeypatch.setattr(mask_checks, start_name, spy_start)
    return seen


@pytest.fixture
def answers(monkeypatch):
    return spy_on_checks(monkeypatch, "is_known_causal", "_start_check")


def run_calls(fn, args, calls, kwargs_of_call=lambda call: {}):
    """Compile ``fn`` afresh and call it ``calls`` times, each result against float64 eager; the first call's code."""
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    first_code = None
    with torch._inductor.utils.fresh_cache(), testing.cpu_triton(), config.patch(**ROUTE):
        for call in range(calls):
            kwargs = kwargs_of_call(call)
            out, code = testing.run_keeping_graphs_and_get_code(compiled, *args, **kwargs)
            first_code = first_code or code
            testing.assert_close_to_reference(out, reference(fn, *args, **kwargs))
    return first_code


def assert_both_branches(code):
    """A host check, a branch on its answer, SDPA's causal kernel in one branch and the fused kernel in the other."""
    text = "\n".join(code)
    FileCheck().check("def causal_sdpa_0").check("_scaled_dot_product_flash_attention_for_cpu").check(
        "True, scale=").run(text)
    FileCheck().check("def causal_fused_0").check("triton_tem_fused").check(".run(").run(text)
    FileCheck().check("flashlight.known_causal.default(").check(".item():").check("causal_sdpa_0").check(
        "causal_fused_0").run(text)
    assert counters["inductor"]["flashlight_attention_causal_route"] == 1


@pytest.mark.parametrize("form", ["sliced_buffer_mask", "captured_positions", "registered_buffer", "mask_passed_in",
                                  "finfo_min_buffer", "additive_mask_passed_in"])
def test_a_causal_mask_from_tensors_runs_as_sdpa_from_its_check_on(form, answers):
    """First call: the tensors are new, fused. Second: the check runs (at once on the CPU) and SDPA answers. Then
    SDPA, with no further check."""
    variant = form_variant(f"forms_causal:{form}")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    code = run_calls(lambda q, k, v: variant.reference(q, k, v, **extras), (q, k, v), 4)
    assert_both_branches(code)
    assert answers["answers"] == [False, True, True, True]
    assert answers["checks"] == 1


@pytest.mark.parametrize("form", ["mask_passed_in", "additive_mask_passed_in"])
def test_a_soft_capped_causal_mask_from_tensors_runs_the_in_function_kernel(form, answers):
    """Where SDPA cannot take the copy with the causal formula (a soft-cap: Gemma-2's global layers, whose Hugging
    Face form adds a 4-D mask after it), that copy is fused as the in-function form is, its kernel the in-function
    form's byte for byte (tiles skipped by the formula, no mask read), from the check on."""
    from test.test_arange_positions_route import fused_kernels, the_form

    variant = form_variant(f"forms_softcap_causal:{form}")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    code = run_calls(lambda q, k, v: variant.reference(q, k, v, **extras), (q, k, v), 3)
    FileCheck().check("def causal_formula_0").check("def causal_fused_0").check("flashlight.known_causal.default(").run(
        "\n".join(code))
    assert answers["answers"] == [False, True, True] and answers["checks"] == 1
    with testing.cpu_triton(), config.patch(**ROUTE):
        in_function, operands = the_form("forms_softcap_causal", "in_function")
        _, in_function_code = testing.compile_and_get_code(in_function, *operands)
    reference_kernels = fused_kernels(in_function_code)
    assert len(reference_kernels) == 1 and reference_kernels <= fused_kernels(code)


def test_a_mask_written_in_place_is_checked_again():
    """A registered causal buffer changed in place between calls (one key of row 40 masked): the next call is fused
    and matches eager on the changed mask; an answer never outlives the version it was checked at."""
    variant = form_variant("forms_causal:sliced_buffer_mask")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    buffers = MADE_ONCE["forms_causal"]["module"]

    def kwargs_of_call(call):
        if call == 3:
            buffers.mask[..., 40, 7] = False
        if call == 5:
            buffers.mask[..., 40, 7] = True
        return {}

    seen = []
    answer = mask_checks.is_known_causal

    def spy(*args):
        seen.append(answer(*args))
        return seen[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mask_checks, "is_known_causal", spy)
        run_calls(lambda q, k, v: variant.reference(q, k, v, **extras), (q, k, v), 8, kwargs_of_call)
    assert seen == [False, True, True, False, False, False, True, True]


@pytest.mark.parametrize("case", ["prefix_lm", "empty_row", "window"])
def test_a_mask_that_is_not_causal_stays_fused(case, answers):
    """Masks from tensors that differ from ``n > m`` (a prefix, a row that keeps nothing: NaN there as in eager, a
    window shorter than the rows) are checked once and run fused on every call."""
    if case == "prefix_lm":
        variant = form_variant("forms_prefix_lm:mask_passed_in")
        q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    else:
        variant = form_variant("forms_causal:mask_passed_in")
        q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
        keep = extras["keep"].clone()
        if case == "empty_row":
            keep[..., 30, :] = False
        else:
            keep &= ~torch.ones_like(keep).tril(-20)
        extras = dict(extras, keep=keep)
    fn = lambda q, k, v: variant.reference(q, k, v, **extras)  # noqa: E731
    code = run_calls(fn, (q, k, v), 4)
    assert_both_branches(code)
    assert answers["answers"] == [False] * 4
    assert answers["checks"] == 1
    if case == "empty_row":
        with testing.cpu_triton(), config.patch(**ROUTE):
            out = torch.compile(fn)(q, k, v)
        assert out[..., 30, :].isnan().all() and not out[..., :30, :].isnan().any()


def test_a_mask_made_for_every_call_is_never_checked(answers):
    """Tensors that are new objects at every call (a mask built per call outside) cost no check: fused throughout."""
    variant = form_variant("forms_causal:mask_passed_in")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    run_calls(variant.reference, (q, k, v), 4, lambda call: {"keep": extras["keep"].clone()})
    assert answers["answers"] == [False] * 4
    assert answers["checks"] == 0


@pytest.mark.parametrize("case", ["switch_off", "in_function", "small"])
def test_no_route_where_it_does_not_apply(case, monkeypatch):
    """The switch off, positions built in the graph (which the SDPA route decides when compiling), or less work than
    ``MIN_WORK``: no host check."""
    if case == "small":
        monkeypatch.setattr(causal_tensor_route, "MIN_WORK", SHAPE.B * SHAPE.H * SHAPE.M * SHAPE.N * SHAPE.D + 1)
    form = "in_function" if case == "in_function" else "sliced_buffer_mask"
    variant = form_variant(f"forms_causal:{form}")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    with testing.cpu_triton(), config.patch(**ROUTE, causal_tensor_route=case != "switch_off"):
        out, code = testing.compile_and_get_code(variant.reference, q, k, v, **extras)
    FileCheck().check_not("known_causal").run("\n".join(code))
    assert counters["inductor"]["flashlight_attention_causal_route"] == 0
    testing.assert_close_to_reference(out, reference(variant.reference, q, k, v, **extras))


def test_the_check_compares_every_batch_entry():
    """``known_causal`` on a mask with a batch dim: causal in one entry only is not causal."""
    mask_checks._SIGHTINGS.clear()
    source = "def forward(self, input_0):\n    return torch.ops.aten.bitwise_not.default(input_0)\n"
    keep = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    assert [mask_checks.is_known_causal([keep], source, 12) for _ in range(3)] == [False, True, True]
    other = keep.clone()
    other[1, 0, 11, 11] = False
    assert [mask_checks.is_known_causal([other], source, 12) for _ in range(3)] == [False, False, False]


def scaled_q_sliced_buffer(q, k, v):
    """GPT-2's sliced buffer with the scale on q (``(q * c) @ kᵀ``) rather than on the scores."""
    buffer = MADE_ONCE["forms_causal"]["module"].mask
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    mask = buffer[:, :, : q.shape[-2], : k.shape[-2]] == 0
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def test_a_constant_on_q_is_applied_once(answers):
    """The branches read q as the graph computes it (scaled): SDPA's call takes its scale from the branch, not from
    the region, which moved the constant onto the scores."""
    variant = form_variant("forms_causal:sliced_buffer_mask")
    q, k, v, _ = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    code = run_calls(scaled_q_sliced_buffer, (q, k, v), 3)
    assert_both_branches(code)
    assert answers["answers"] == [False, True, True]


@pytest.mark.parametrize("fn", [causal_bias_read_by_a_mask, causal_factor])
def test_a_minus_inf_where_off_the_score_path_takes_no_route(fn):
    """A -inf fill of a bias that a condition reads, or of a factor of the scores, is no mask: no route."""
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.ones(64, 64, dtype=torch.bool).tril()
    with testing.cpu_triton(), config.patch(**ROUTE):
        out, code = testing.compile_and_get_code(fn, q, k, v, keep)
    FileCheck().check_not("known_causal").run("\n".join(code))
    testing.assert_close_to_reference(out, reference(fn, q, k, v, keep))


def added(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + bias, dim=-1) @ v


def additive_causal(case: str) -> torch.Tensor:
    """Float masks of the causal mask: ``nn.Transformer``'s (-inf above the diagonal, ``[M, M]``) or Hugging
    Face's ``[B, 1, M, M]`` of bf16 ``finfo.min``; and masks that are not: a batch entry whose first four keys are
    padding (rows 0-3 keep no key: eager averages V there), a fill of -1e4 (not low enough to absorb), a bias below
    the diagonal (an ALiBi-like slope with the causal -inf)."""
    rows = SHAPE.M
    if case == "transformer":
        return torch.nn.Transformer.generate_square_subsequent_mask(rows, dtype=torch.bfloat16)
    lowest = torch.finfo(torch.bfloat16).min
    masked = ~torch.ones(rows, rows, dtype=torch.bool).tril()
    bias = torch.zeros(2, 1, rows, rows).masked_fill(masked, lowest)
    if case == "padded":
        bias[1, ..., :4] = lowest
    elif case == "not_absorbing":
        bias = bias.masked_fill(masked, -1e4)
    elif case == "sloped":
        positions = torch.arange(rows, dtype=torch.float32)
        bias = (0.5 * (positions[None, :] - positions[:, None])).masked_fill(masked, float("-inf"))
    return bias.bfloat16()


@pytest.mark.parametrize("case", ["transformer", "hf_4d"])
def test_an_additive_causal_mask_runs_as_sdpa_from_its_check_on(case, answers):
    """A float mask added to the scores whose every element is 0 on and below the diagonal and absorbing above it
    (-inf, ``finfo.min``) is the causal mask: SDPA from its check on."""
    q, k, v = (torch.randn(2, 2, SHAPE.M, 16, dtype=torch.bfloat16) for _ in range(3))
    bias = additive_causal(case)
    code = run_calls(lambda q, k, v: added(q, k, v, bias), (q, k, v), 3)
    assert_both_branches(code)
    assert answers["answers"] == [False, True, True] and answers["checks"] == 1


def test_hf_decoder_mask_without_padding_runs_as_sdpa(answers):
    """Hugging Face's decoder mask built in the graph from a ``[B, N]`` padding mask: with no key padded it is the
    causal mask, checked from the padding mask's values."""
    from benchmarks.variants import hf_causal_padding_4d

    q, k, v = (torch.randn(2, 2, SHAPE.M, 16, dtype=torch.bfloat16) for _ in range(3))
    attention_mask = torch.ones(2, SHAPE.M, dtype=torch.long)
    code = run_calls(lambda q, k, v: hf_causal_padding_4d(q, k, v, attention_mask), (q, k, v), 3)
    assert_both_branches(code)
    assert answers["answers"] == [False, True, True]


def test_an_add_with_alpha_takes_no_route(answers):
    """``torch.add(scores, bias, alpha=-1)`` adds the negated mask: no route (it would take -inf for +finfo.min)."""
    q, k, v = (torch.randn(2, 2, SHAPE.M, 16, dtype=torch.bfloat16) for _ in range(3))
    bias = additive_causal("hf_4d")

    def negated(q, k, v):
        return torch.softmax(torch.add(q @ k.transpose(-2, -1) * 0.25, bias, alpha=-1), dim=-1) @ v

    code = run_calls(negated, (q, k, v), 2)
    FileCheck().check_not("known_causal").run("\n".join(code))
    assert answers["checks"] == 0


@pytest.mark.parametrize("case", ["padded", "not_absorbing", "sloped"])
def test_an_additive_mask_that_is_not_causal_stays_fused(case, answers):
    q, k, v = (torch.randn(2, 2, SHAPE.M, 16, dtype=torch.bfloat16) for _ in range(3))
    bias = additive_causal(case)
    code = run_calls(lambda q, k, v: added(q, k, v, bias), (q, k, v), 3)
    assert_both_branches(code)
    assert answers["answers"] == [False] * 3 and answers["checks"] == 1


def filled_with(fill):
    def attention(q, k, v, keep):
        scores = q @ k.transpose(-2, -1) * 0.25
        return torch.softmax(torch.where(keep, scores, fill), dim=-1) @ v

    return attention


@pytest.mark.parametrize("training", [False, True])
def test_a_fill_that_may_not_absorb_takes_no_route(training):
    """A finite fill above ``ABSORBING_FILL`` (-1e30; float16's ``finfo.min``, -65504, likewise) is not proven to
    add exactly 0 to a row's sums: its ``where`` counts as no mask, and the region takes no route."""
    from test.test_training import train_calls

    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float32 if training else torch.bfloat16) for _ in range(3))
    keep = torch.ones(64, 64, dtype=torch.bool).tril()
    fill = filled_with(-1e30)
    fn = lambda q, k, v: fill(q, k, v, keep)  # noqa: E731
    if training:
        code = train_calls(fn, tuple(t.requires_grad_() for t in (q, k, v)), 2)
    else:
        with testing.cpu_triton(), config.patch(**ROUTE):
            out, code = testing.compile_and_get_code(fn, q, k, v)
        testing.assert_close_to_reference(out, reference(fn, q, k, v))
    FileCheck().check_not("known_causal").run("\n".join(code))


def two_layers_one_mask(q, k, v, keep):
    first = torch.softmax((q @ k.transpose(-2, -1) / 4.0).masked_fill(~keep, float("-inf")), dim=-1) @ v
    return torch.softmax((first @ k.transpose(-2, -1) / 4.0).masked_fill(~keep, float("-inf")), dim=-1) @ v


def test_attentions_reading_one_mask_share_its_check(answers):
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.ones(64, 64, dtype=torch.bool).tril()
    code = run_calls(lambda q, k, v: two_layers_one_mask(q, k, v, keep), (q, k, v), 3)
    text = "\n".join(code)
    assert text.count("torch.ops.flashlight.known_causal.default(") == 1
    # Each layer branches on the causal check, and in its branch for masks that are not causal on the band's check.
    assert text.count(".item():") == 4 and text.count("torch.ops.flashlight.known_band.default(") == 2
    assert answers["answers"] == [False, True, True]
    assert answers["checks"] == 1


def test_tensors_without_versions_are_never_trusted():
    """Tensors made under inference_mode have no version counter: answered False, unchecked."""
    mask_checks._SIGHTINGS.clear()
    source = "def forward(self, input_0):\n    return torch.ops.aten.bitwise_not.default(input_0)\n"
    with torch.inference_mode():
        keep = torch.ones(12, 12, dtype=torch.bool).tril()
    assert [mask_checks.is_known_causal([keep], source, 12) for _ in range(3)] == [False, False, False]


def test_an_answer_waits_for_its_check(monkeypatch):
    """On the GPU the verdict lands later: the answer stays False until the check's event says it is done."""
    mask_checks._SIGHTINGS.clear()
    source = "def forward(self, input_0):\n    return torch.ops.aten.bitwise_not.default(input_0)\n"
    keep = torch.ones(12, 12, dtype=torch.bool).tril()
    events = iter([False, False, True])
    start = mask_checks._start_check

    def later(sighting, *args):
        start(sighting, *args)
        sighting.ready = lambda: next(events)

    monkeypatch.setattr(mask_checks, "_start_check", later)
    assert [mask_checks.is_known_causal([keep], source, 12) for _ in range(5)] == [False, False, False, True, True]


def test_a_check_that_fails_counts_as_not_causal():
    mask_checks._SIGHTINGS.clear()
    failing = "def forward(self, input_0):\n    raise RuntimeError('out of memory')\n"
    keep = torch.ones(12, 12, dtype=torch.bool).tril()
    assert [mask_checks.is_known_causal([keep], failing, 12) for _ in range(3)] == [False, False, False]


def trained_causal_form(form, keep=None):
    variant = form_variant(f"forms_causal:{form}")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.float32)
    extras = extras if keep is None else dict(extras, keep=keep)
    return (lambda q, k, v: variant.reference(q, k, v, **extras)), tuple(t.requires_grad_() for t in (q, k, v))


@pytest.mark.parametrize("form", ["sliced_buffer_mask", "additive_mask_passed_in",
                                  pytest.param("mask_passed_in", marks=pytest.mark.full)])
def test_a_causal_mask_from_tensors_trains_on_the_causal_formula_once_checked(form, answers):
    """In training the forward and the backward each run under a ``cond`` on one check: from the second step, the
    copies whose mask is the causal formula, whose kernels are the in-function causal form's training kernels byte
    for byte; every step's output and gradients are float64 eager's."""
    from test.test_arange_positions_route import fused_kernels
    from test.test_training import train_calls

    fn, args = trained_causal_form(form)
    code = train_calls(fn, args, 3)
    text = "\n".join(code)
    FileCheck().check("def causal_forward_0").check("def causal_mask_read_forward_0").check(
        "flashlight.known_causal.default(").check(".item():").run(text)
    FileCheck().check("def causal_backward_0").check("def causal_mask_read_backward_0").run(text)
    assert answers["answers"] == [False, True, True] and answers["checks"] == 1
    assert counters["inductor"]["flashlight_attention_causal_route"] == 1
    in_function, in_function_args = trained_causal_form("in_function")
    reference_kernels = fused_kernels(train_calls(in_function, in_function_args, 1))
    assert len(reference_kernels) == 2 and reference_kernels <= fused_kernels(code)


def test_hf_gpt2s_finite_fill_trains_on_the_causal_formula_once_checked(answers):
    """Hugging Face's GPT-2 fills ``finfo.min`` where its sliced buffer is false: once the buffer is checked causal,
    every row keeps its own key and the fill absorbs, so the copy with the causal formula trains; eager's gradients
    at every step."""
    from test.test_training import train_calls

    fn, args = trained_causal_form("finfo_min_buffer")
    text = "\n".join(train_calls(fn, args, 3))
    FileCheck().check("def causal_forward_0").check("def causal_mask_read_forward_0").run(text)
    assert answers["answers"] == [False, True, True]
    assert counters["inductor"]["flashlight_attention_causal_route"] == 1


def alibi_then_mask(q, k, v, bias):
    """BLOOM's order: ALiBi's bias on the scores, then the causal mask added last."""
    positions = torch.arange(q.shape[-2])
    slopes = torch.pow(2.0, -torch.arange(1, q.shape[1] + 1, dtype=torch.float32))[:, None, None]
    scores = q @ k.transpose(-2, -1) * 0.25 + slopes * (positions[None, :] - positions[:, None])
    return torch.softmax(scores + bias, dim=-1) @ v


def test_an_additive_mask_after_other_terms_trains_on_the_causal_formula(answers):
    """The bias added last to logits the chain computes otherwise (ALiBi's): once checked, the copy with the causal
    formula trains; eager's gradients at every step."""
    from test.test_training import train_calls

    bias = additive_causal("hf_4d").float()
    args = tuple(torch.randn(2, 2, SHAPE.M, 16).requires_grad_() for _ in range(3))
    text = "\n".join(train_calls(lambda q, k, v: alibi_then_mask(q, k, v, bias), args, 3))
    FileCheck().check("def causal_forward_0").check("def causal_mask_read_forward_0").run(text)
    assert answers["answers"] == [False, True, True]
    assert counters["inductor"]["flashlight_attention_causal_route"] == 1


def test_an_additive_mask_after_another_float_mask_takes_no_route(answers):
    """A padding mask of ``finfo.min`` added before the causal mask puts logits far beyond 2^124, where the causal
    mask no longer absorbs (a row whose own keys are all padded weighs the later keys in eager): no route, and that
    row matches eager."""
    q, k, v = (torch.randn(2, 2, SHAPE.M, 16, dtype=torch.bfloat16) for _ in range(3))
    padding = torch.zeros(2, 1, 1, SHAPE.M, dtype=torch.bfloat16)
    padding[1, ..., :4] = torch.finfo(torch.bfloat16).min
    causal = additive_causal("hf_4d")

    def padded_then_causal(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + padding + causal, dim=-1) @ v

    code = run_calls(padded_then_causal, (q, k, v), 3)
    FileCheck().check_not("known_causal").run("\n".join(code))
    assert answers["checks"] == 0


def test_a_learned_additive_mask_takes_no_route(answers):
    """A float mask that requires grad gets its gradient from the kernel that reads it: no route (the causal copy
    would not compute it)."""
    from test.test_training import train_calls

    q, k, v = (torch.randn(2, 2, SHAPE.M, 16) for _ in range(3))
    bias = additive_causal("transformer").float()
    args = tuple(t.requires_grad_() for t in (q, k, v, bias))
    text = "\n".join(train_calls(added, args, 2))
    FileCheck().check_not("known_causal").run(text)
    assert counters["inductor"]["flashlight_attention_causal_route"] == 0
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1


@pytest.mark.parametrize("case", ["written_in_place", "prefix"])
def test_a_trained_mask_that_is_not_causal_is_read(case, answers):
    """A causal buffer with one key of row 40 masked in place between steps 2 and 4, or a mask that is not causal
    (a prefix of 20 visible keys): those steps read the mask, forward and backward, and match eager."""
    from test.test_training import train_calls

    if case == "prefix":
        keep = torch.ones(SHAPE.M, SHAPE.N, dtype=torch.bool).tril()
        keep[:, :20] = True
        fn, args = trained_causal_form("mask_passed_in", keep)
        train_calls(fn, args, 3)
        assert answers["answers"] == [False] * 3 and answers["checks"] == 1
        return
    fn, args = trained_causal_form("sliced_buffer_mask")
    buffers = MADE_ONCE["forms_causal"]["module"]

    def before_call(call):
        if call in (2, 4):
            buffers.mask[..., 40, 7] = call == 4

    train_calls(fn, args, 6, before_call)
    assert answers["answers"] == [False, True, False, False, False, True]


@pytest.mark.parametrize("form", ["mask_passed_in", pytest.param("captured_positions", marks=pytest.mark.full)])
def test_a_causal_mask_from_tensors_trains_on_sdpas_kernels_once_checked(form, answers):
    """Where SDPA takes causal attention in training (here its CPU kernels), the checked copy is SDPA's forward and
    backward pair, as the in-function form's is; the forward's cond returns three slots (the output, which both
    versions lay out alike, SDPA's rows' statistics and ours), the output itself made from its slot after the cond;
    every step matches eager."""
    from test.test_arange_positions_route import trained_form
    from test.test_training import train_calls

    fn, args = trained_causal_form(form) if form == "mask_passed_in" else trained_form("forms_causal", form)
    args = tuple(operand.detach().bfloat16().requires_grad_() for operand in args)
    text = "\n".join(train_calls(fn, args, 3, **ROUTE))
    first = "causal" if form == "mask_passed_in" else "arange_positions"
    FileCheck().check(f"def {first}_forward_0").check("_scaled_dot_product_flash_attention_for_cpu").check(
        "return (").run(text)
    FileCheck().check(f"def {first}_backward_0").check("_scaled_dot_product_flash_attention_for_cpu_backward").check(
        "return (").run(text)
    route = "causal" if form == "mask_passed_in" else "arange"
    assert counters["inductor"][f"flashlight_attention_{route}_route"] == 1
    forward = next(module for module in text.split("def call(self, args)") if "flashlight.known_" in module)
    assert re.search(r"= \[None\] \* 3\n\s+if \w+\.item\(\):", forward), "the forward cond's three slots"
    if route == "causal":
        assert answers["answers"] == [False, True, True]


@pytest.mark.parametrize("broken", ["forward", "backward"])
def test_a_routed_graph_that_fails_to_compile_keeps_its_branch_choice(broken, monkeypatch, answers):
    """When the forward (or the backward) graph of a routed attention fails to compile, that graph alone is compiled
    again on upstream's path, each route's cond kept with its branches traced into the aten ops of their meaning: the
    forward and the backward still take the same branch, here SDPA's pair once checked, whose rows' statistics have a
    slot of their own (read by the other version's backward, they would be an empty tensor). Every step's gradients
    are eager's."""
    from torch._inductor import lowering

    from inductor_overlay import ops
    from test.test_training import train_calls

    def broken_lowering(*args, **kwargs):
        raise RuntimeError(f"injected {broken} fault")

    op = ops.online_softmax_attention_with_lse if broken == "forward" else ops.online_softmax_attention_backward
    monkeypatch.setitem(lowering.lowerings, op, broken_lowering)
    fn, args = trained_causal_form("mask_passed_in")
    args = tuple(operand.detach().bfloat16().requires_grad_() for operand in args)
    with pytest.warns(UserWarning, match=f"injected {broken} fault"):
        train_calls(fn, args, 3, fault_containment=True, **ROUTE)
    assert counters["inductor"]["flashlight_attention_causal_route"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 1
    assert answers["answers"] == [False, True, True]
