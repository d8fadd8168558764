"""Attention over positions made outside the graph runs the kernel of the same attention written with ``arange``
while those positions hold 0, 1, ..., the kernel that reads them otherwise (``fx_passes/arange_positions_route.py``,
``mask_checks.known_arange``), on the CPU harness, every call compared with float64 eager."""

import re

import pytest
import torch
from torch.testing import FileCheck

from benchmarks.variants import Shape, make_inputs
from benchmarks.written_forms import MADE_ONCE, form_variant
from flashlight import testing
from inductor_overlay import config, mask_checks
from inductor_overlay.fx_passes import arange_positions_route
from test.test_attention_fusion import reference
from test.test_causal_tensor_route import spy_on_checks
from test.test_training import train_calls

counters = torch._dynamo.utils.counters
SHAPE = Shape(1, 2, 96, 96, 16)
FAMILIES = ["forms_causal", "forms_sliding_window", "forms_prefix_lm", "forms_softcap_window", "forms_alibi"]


@pytest.fixture
def answers(monkeypatch):
    mask_checks._SIGHTINGS.clear()  # (tensors made once at import are seen by several tests)
    return spy_on_checks(monkeypatch, "is_known_arange", "_start_arange_check")


def run_calls(fn, args, calls, before_call=lambda call: None, **overlay):
    """Compile ``fn`` afresh and call it ``calls`` times, each result against float64 eager; the first call's code."""
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    first_code = None
    with torch._inductor.utils.fresh_cache(), testing.cpu_triton(), config.patch(**overlay):
        for call in range(calls):
            before_call(call)
            out, code = testing.run_keeping_graphs_and_get_code(compiled, *args)
            first_code = first_code or code
            testing.assert_close_to_reference(out, reference(fn, *args))
    return first_code


def fused_kernels(code) -> set[str]:
    """The fused attention kernels' sources, their names left out."""
    kernels = testing.triton_kernels(code)
    return {re.sub(re.escape(name), "KERNEL", source) for name, source in kernels.items() if "tem_fused" in name}


def the_form(family, form):
    variant = form_variant(f"{family}:{form}")
    q, k, v, extras = make_inputs(variant, SHAPE, dtype=torch.bfloat16)
    return (lambda q, k, v: variant.reference(q, k, v, **extras)), (q, k, v)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("form", ["captured_positions", "registered_buffer"])
def test_positions_that_hold_arange_run_the_in_function_kernel(family, form, answers):
    """First call: the positions are new, read. Second: the check runs (at once on the CPU) and the branch built with
    iota answers, from then on. That branch's fused kernel is the in-function form's, byte for byte (its masks
    decided when compiling: tiles skipped and split by the formula, no position read)."""
    fn, args = the_form(family, form)
    code = run_calls(fn, args, 3)
    text = "\n".join(code)
    FileCheck().check("def arange_positions_0").check("def positions_read_0").check(
        "torch.ops.flashlight.known_arange.default(").check(".item():").check("arange_positions_0").check(
        "positions_read_0").run(text)
    assert answers["answers"] == [False, True, True]
    assert answers["checks"] == 1
    assert counters["inductor"]["flashlight_attention_arange_route"] == 1
    in_function, in_function_args = the_form(family, "in_function")
    with testing.cpu_triton():
        _, reference_code = testing.compile_and_get_code(in_function, *in_function_args)
    if family != "forms_alibi":  # (the in-function ALiBi computes its slopes too, the others read them)
        assert fused_kernels(reference_code) <= fused_kernels(code)
    assert len(fused_kernels(code)) == 2


def reversed_then_restored(position, reversed_at, restored_at):
    """A ``before_call`` that reverses ``position`` in place before call ``reversed_at`` and makes it 0, 1, ...
    again before call ``restored_at``."""

    def before_call(call):
        if call == reversed_at:
            position.copy_(position.flip(0))
        if call == restored_at:
            position.copy_(torch.arange(position.numel()))

    return before_call


def test_positions_changed_in_place_are_read_until_checked_again(answers):
    """Captured positions reversed between calls 3 and 6, then made consecutive again: the calls after each write
    read them (every result eager's), and the iota branch answers again only once a new check has passed."""
    fn, args = the_form("forms_sliding_window", "captured_positions")
    run_calls(fn, args, 9, reversed_then_restored(MADE_ONCE["forms_sliding_window"]["position"], 3, 6))
    assert answers["answers"] == [False, True, True, False, False, False, False, True, True]
    assert answers["checks"] == 3


@pytest.mark.parametrize("offset", [1, -96])
def test_positions_that_do_not_start_at_zero_are_read(offset, answers):
    """Consecutive positions from another start (the same masks, a different ALiBi origin) are not 0, 1, ...:
    checked once, read on every call."""
    fn, args = the_form("forms_softcap_window", "captured_positions")
    MADE_ONCE["forms_softcap_window"]["position"].add_(offset)
    run_calls(fn, args, 3)
    assert answers["answers"] == [False, False, False]
    assert answers["checks"] == 1


DOCUMENT = torch.arange(SHAPE.M) // 24  # 1-D ids made once, compared only for equality


def captured_document_ids(q, k, v):
    scores = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(scores.masked_fill(DOCUMENT[:, None] != DOCUMENT[None, :], float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("case", ["switch_off", "document_ids", "in_function", "per_call"])
def test_no_route_where_it_does_not_apply(case, answers):
    """The switch off, 1-D integers compared only for equality (document ids), positions built in the graph, or
    positions made anew for every call (checked never)."""
    form = "in_function" if case == "in_function" else "captured_positions"
    fn, args = the_form("forms_sliding_window", form)
    if case == "document_ids":
        fn = captured_document_ids
    if case == "per_call":
        made = MADE_ONCE["forms_sliding_window"]
        run_calls(fn, args, 3, lambda call: made.update(position=torch.arange(SHAPE.M)))
        assert answers["answers"] == [False] * 3 and answers["checks"] == 0
        return
    code = run_calls(fn, args, 2, arange_positions_route=case != "switch_off")
    FileCheck().check_not("known_arange").run("\n".join(code))
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    assert counters["inductor"]["flashlight_attention_arange_route"] == 0
    assert answers["answers"] == []


@pytest.mark.parametrize("small", [False, True])
def test_a_causal_mask_over_positions_runs_as_sdpa_once_checked(small, monkeypatch):
    """With SDPA taking causal attention on the CPU, the iota branch of captured causal positions is SDPA's causal
    call, as the in-function form's graph is; below the least work for SDPA under a check (``MIN_WORK``) there is no
    route, and the fused kernel reads the positions."""
    if not small:
        monkeypatch.setattr(arange_positions_route, "MIN_WORK", 0)
    fn, args = the_form("forms_causal", "registered_buffer")
    code = "\n".join(run_calls(fn, args, 3, sdpa_pattern_policy="unmasked_sdpa", sdpa_route_devices=("cpu",)))
    if small:
        FileCheck().check_not("known_arange").check("triton_tem_fused").run(code)
        assert counters["inductor"]["flashlight_attention_arange_route"] == 0
    else:
        FileCheck().check("def arange_positions_0").check("_scaled_dot_product_flash_attention_for_cpu").check(
            "True, scale=").check("def positions_read_0").check("triton_tem_fused").run(code)
    assert counters["inductor"]["flashlight_attention_causal_route"] == 0


def test_the_check_compares_every_tensor():
    """``known_arange`` holds only when every tensor holds 0, 1, ..., len − 1."""
    mask_checks._SIGHTINGS.clear()
    rows, columns = torch.arange(12), torch.arange(20)
    assert [mask_checks.is_known_arange([rows, columns]) for _ in range(3)] == [False, True, True]
    other = torch.arange(20)
    other[19] = 18
    assert [mask_checks.is_known_arange([rows, other]) for _ in range(3)] == [False, False, False]


POSITION = torch.arange(200, dtype=torch.int32)  # made once; rows and columns read slices of it


def window_over_slices(q, k, v):
    """Rows at positions 32..127, columns at 0..127 (int32): a causal window of 40 over the slices."""
    rows, columns = POSITION[32:128, None], POSITION[None, -200:128]
    scores = q @ k.transpose(-2, -1) * 0.25
    keep = (columns <= rows) & (rows - columns < 40)
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def two_layers_one_position(q, k, v):
    first = window_over_slices(q, k, v)
    return window_over_slices(first, k, v)


@pytest.mark.parametrize("fn", [window_over_slices, two_layers_one_position])
def test_slices_of_int32_positions_and_two_attentions_share_one_check(fn, answers):
    """Slices of a captured int32 vector from a non-zero start (96 rows, 128 columns) become iotas of their ranges;
    two attentions over the same positions share one check."""
    q = torch.randn(1, 2, 96, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 128, 16, dtype=torch.bfloat16) for _ in range(2))
    text = "\n".join(run_calls(fn, (q, k, v), 3))
    assert text.count("torch.ops.flashlight.known_arange.default(") == 1
    assert answers["answers"] == [False, True, True] and answers["checks"] == 1
    assert counters["inductor"]["flashlight_attention_arange_route"] == (2 if fn is two_layers_one_position else 1)


def test_positions_that_are_not_arange_keep_the_causal_route(monkeypatch):
    """Captured causal positions from 5 on are not 0, 1, ... but their mask is causal: where SDPA takes causal
    attention, the branch that reads them runs the causal route (SDPA's kernel once the mask is checked causal)."""
    from inductor_overlay.fx_passes import causal_tensor_route

    monkeypatch.setattr(causal_tensor_route, "MIN_WORK", 0)
    monkeypatch.setattr(arange_positions_route, "MIN_WORK", 0)
    mask_checks._SIGHTINGS.clear()
    seen = spy_on_checks(monkeypatch, "is_known_causal", "_start_check")
    fn, args = the_form("forms_causal", "captured_positions")
    MADE_ONCE["forms_causal"]["position"].add_(5)
    code = "\n".join(run_calls(fn, args, 3, sdpa_pattern_policy="unmasked_sdpa", sdpa_route_devices=("cpu",)))
    FileCheck().check("def positions_read_0").check("flashlight.known_causal.default(").run(code)
    assert "def arange_positions_0" in code
    assert counters["inductor"]["flashlight_attention_arange_route"] == 1
    assert counters["inductor"]["flashlight_attention_causal_route"] == 1
    assert seen["answers"] == [False, True, True]


def test_a_route_that_fails_leaves_the_attention_fused(monkeypatch, caplog):
    """An error inside the route (here in the iota branch's rewrite): that attention is fused without the route, with
    the reason in the log, and the graph's other attention keeps its own fusion."""
    import logging

    def broken(placeholder):
        raise RuntimeError("injected")

    monkeypatch.setattr(arange_positions_route, "_as_iota", broken)
    fn, args = the_form("forms_sliding_window", "captured_positions")

    def two(q, k, v):
        return fn(q, k, v) + torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

    with caplog.at_level(logging.WARNING, logger="flashlight"):
        code = run_calls(two, args, 2)
    assert "route_when_arange failed (RuntimeError: injected); fused without it" in caplog.text
    assert counters["inductor"]["flashlight_route_fault"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    assert len(fused_kernels(code)) == 2



def trained_form(family, form):
    fn, args = the_form(family, form)
    return fn, tuple(operand.float().requires_grad_() for operand in args)


TRAINED_IN_CI = {("forms_sliding_window", "captured_positions"), ("forms_alibi", "registered_buffer")}


@pytest.mark.parametrize("family,form", [
    pytest.param(family, form, marks=() if (family, form) in TRAINED_IN_CI else pytest.mark.full)
    for family in FAMILIES for form in ("captured_positions", "registered_buffer")
])
def test_positions_that_hold_arange_train_on_the_in_function_kernels(family, form, answers):
    """In training the forward and the backward each run under a ``cond`` on one check: from the second call, the
    copies built with iota, whose kernels are the in-function form's training kernels byte for byte (forward and
    backward); the forward saves only its output and the rows' statistics (no score-sized buffer). Every call's
    output and gradients are float64 eager's."""
    fn, args = trained_form(family, form)
    code = train_calls(fn, args, 3)
    text = "\n".join(code)
    FileCheck().check("def arange_positions_forward_0").check("def positions_read_forward_0").check(
        "torch.ops.flashlight.known_arange.default(").check(".item():").run(text)
    FileCheck().check("def arange_positions_backward_0").check("def positions_read_backward_0").check(
        "known_arange_default.item():").run(text)
    assert text.count("torch.ops.flashlight.known_arange.default(") == 1
    assert answers["answers"] == [False, True, True] and answers["checks"] == 1
    assert counters["inductor"]["flashlight_attention_arange_route"] == 1
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert max(testing.allocated_buffer_numels(code)) < SHAPE.M * SHAPE.N
    in_function, in_function_args = trained_form(family, "in_function")
    reference_code = train_calls(in_function, in_function_args, 1)
    assert len(fused_kernels(reference_code)) == 2  # a forward and a backward
    if family != "forms_alibi":  # (the in-function ALiBi computes its slopes too, the others read them)
        assert fused_kernels(reference_code) <= fused_kernels(code)
    assert len(fused_kernels(code)) == 4


def test_positions_changed_in_place_between_steps_are_read_until_checked_again(answers):
    """Captured positions reversed between steps 2 and 4, then made consecutive again: the steps after each write
    read them, forward and backward (every result and gradient eager's), until a new check has passed."""
    fn, args = trained_form("forms_softcap_window", "captured_positions")
    train_calls(fn, args, 6, reversed_then_restored(MADE_ONCE["forms_softcap_window"]["position"], 2, 4))
    assert answers["answers"] == [False, True, False, False, False, True]
    assert answers["checks"] == 3


POSITIONS_96 = torch.arange(96)  # made once


def alibi_with_learned_slopes(q, k, v, slopes):
    """Causal ALiBi over captured positions, its slopes trained."""
    distance = (POSITIONS_96[None, :] - POSITIONS_96[:, None]).float()
    scores = q @ k.transpose(-2, -1) * 0.25 + slopes[:, None, None] * distance
    return torch.softmax(scores.masked_fill(POSITIONS_96[None, :] > POSITIONS_96[:, None], float("-inf")), -1) @ v


def window_of_projections(x, wq, wk, wv):
    """q, k, v projected in the graph and viewed as [B, H, S, D] from [B, S, H, D], q scaled there (pointwise ops
    on transposed views), under a window over captured positions."""
    q, k, v = (((x @ w).view(1, 96, 2, 16) * c).transpose(1, 2) for w, c in ((wq, 0.25), (wk, 1.5), (wv, 1.0)))
    scores = q @ k.transpose(-2, -1)
    rows, columns = POSITIONS_96[:, None], POSITIONS_96[None, :]
    masked = (columns > rows) | (rows - columns >= 24)
    return torch.softmax(scores.masked_fill(masked, float("-inf")), -1) @ v


@pytest.mark.parametrize("fn", [alibi_with_learned_slopes, window_of_projections])
def test_routed_training_with_learned_tensors_and_operands_the_graph_computes(fn, answers):
    """Slopes that require grad get their gradient from both versions (the copy's tensors renumbered once the
    positions are iotas); operands the graph computes (projections scaled in the ``[B, S, H, D]`` layout, then
    transposed) reach the conds as their branches read them. Every step matches float64 eager."""
    generator = torch.Generator().manual_seed(3)
    if fn is alibi_with_learned_slopes:
        args = (*(torch.randn(1, 2, 96, 16, generator=generator) for _ in range(3)), torch.rand(2, generator=generator))
    else:
        args = (torch.randn(1, 96, 32, generator=generator), *(torch.randn(32, 32, generator=generator) / 6 for _ in range(3)))
    args = tuple(arg.requires_grad_() for arg in args)
    train_calls(fn, args, 3)
    assert answers["answers"] == [False, True, True]
    assert counters["inductor"]["flashlight_attention_arange_route"] == 1


@pytest.mark.parametrize("case", ["switch_off", "per_call"])
def test_no_route_in_training_where_it_does_not_apply(case, answers):
    """In training too: the switch off, or positions made anew for every call (checked never)."""
    fn, args = trained_form("forms_sliding_window", "captured_positions")
    made = MADE_ONCE["forms_sliding_window"]
    per_call = lambda call: made.update(position=torch.arange(SHAPE.M)) if case == "per_call" else None  # noqa: E731
    code = train_calls(fn, args, 3, per_call, arange_positions_route=case != "switch_off")
    assert ("known_arange" in "\n".join(code)) == (case == "per_call")
    assert answers["answers"] == ([False] * 3 if case == "per_call" else []) and answers["checks"] == 0
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
