"""Attention masked by tensors made outside the graph runs as SDPA's causal attention while those tensors hold the
causal mask, fused otherwise (``fx_passes/causal_tensor_route.py``, ``mask_checks.py``), on the CPU harness with the
SDPA route turned on for the CPU (its CPU flash kernel), every call compared with float64 eager."""

import pytest
import torch
from torch.testing import FileCheck

from benchmarks.variants import make_inputs, Shape
from benchmarks.written_forms import MADE_ONCE, form_variant
from flashlight import testing
from inductor_overlay import config, mask_checks
from inductor_overlay.fx_passes import causal_tensor_route
from test.test_attention_fusion import reference

counters = torch._dynamo.utils.counters
ROUTE = dict(sdpa_pattern_policy="unmasked_sdpa", sdpa_route_devices=("cpu",))
SHAPE = Shape(1, 2, 96, 96, 16)


@pytest.fixture(autouse=True)
def small_work_routed(monkeypatch):
    """The tests' shapes are far below the least work the route takes on a GPU (``MIN_WORK``)."""
    monkeypatch.setattr(causal_tensor_route, "MIN_WORK", 0)


@pytest.fixture
def answers(monkeypatch):
    """Every answer ``known_causal`` gives, and every check it starts."""
    seen = {"answers": [], "checks": 0}
    answer, start = mask_checks.known_causal_meaning, mask_checks._start_check

    def spy_answer(*args):
        seen["answers"].append(answer(*args))
        return seen["answers"][-1]

    def spy_start(*args):
        seen["checks"] += 1
        return start(*args)

    monkeypatch.setattr(mask_checks, "known_causal_meaning", spy_answer)
    monkeypatch.setattr(mask_checks, "_start_check", spy_start)
    return seen


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
    FileCheck().check("def causal_sdpa_0").check("_scaled_dot_product_flash_attention_for_cpu").check("True, scale=")
    FileCheck().check("def causal_fused_0").check("triton_tem_fused").check(".run(").run(text)
    FileCheck().check("flashlight.known_causal.default(").check(".item():").check("causal_sdpa_0").check(
        "causal_fused_0").run(text)
    assert counters["inductor"]["flashlight_attention_causal_route"] == 1


@pytest.mark.parametrize("form", ["sliced_buffer_mask", "captured_positions", "registered_buffer", "mask_passed_in"])
def test_a_causal_mask_from_tensors_runs_as_sdpa_from_its_check_on(form, answers):
    """First call: the tensors are new, fused. Second: the check runs (at once on the CPU) and SDPA answers. Then
    SDPA, with no further check."""
    variant = form_variant(f"forms_causal:{form}")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    code = run_calls(lambda q, k, v: variant.reference(q, k, v, **extras), (q, k, v), 4)
    assert_both_branches(code)
    assert answers["answers"] == [False, True, True, True]
    assert answers["checks"] == 1


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
    answer = mask_checks.known_causal_meaning

    def spy(*args):
        seen.append(answer(*args))
        return seen[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mask_checks, "known_causal_meaning", spy)
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


@pytest.mark.parametrize("case", ["switch_off", "training", "in_function", "small"])
def test_no_route_where_it_does_not_apply(case, monkeypatch):
    """The switch off, a graph that trains, positions built in the graph (which the SDPA route decides when
    compiling), or less work than ``MIN_WORK``: no host check."""
    if case == "small":
        monkeypatch.setattr(causal_tensor_route, "MIN_WORK", SHAPE.B * SHAPE.H * SHAPE.M * SHAPE.N * SHAPE.D + 1)
    form = "in_function" if case == "in_function" else "sliced_buffer_mask"
    variant = form_variant(f"forms_causal:{form}")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    if case == "training":
        q.requires_grad_()
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
    assert [mask_checks.known_causal_meaning([keep], source, 12) for _ in range(3)] == [False, True, True]
    other = keep.clone()
    other[1, 0, 11, 11] = False
    assert [mask_checks.known_causal_meaning([other], source, 12) for _ in range(3)] == [False, False, False]
