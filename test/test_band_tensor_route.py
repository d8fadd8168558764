"""Attention masked by tensors made outside the graph runs with a band's formula (a causal window of W keys, a prefix
of P keys every row sees) while those tensors hold that band, reading them otherwise (``fx_passes/band_tensor_route.py``,
``mask_checks.known_band``), on the CPU harness, every call compared with float64 eager."""

import re

import pytest
import torch
from torch.testing import FileCheck

from flashlight import testing
from inductor_overlay import config, mask_checks
from inductor_overlay.fx_passes import causal_tensor_route
from test.test_attention_fusion import reference
from test.test_causal_tensor_route import run_calls, spy_on_checks

counters = torch._dynamo.utils.counters
S = 96
POSITIONS = torch.arange(S)
ROWS, COLUMNS = POSITIONS[:, None], POSITIONS[None, :]
KEEPS = {
    "window": (COLUMNS <= ROWS) & (ROWS - COLUMNS < 24),
    "prefix": (COLUMNS <= ROWS) | (COLUMNS < 20),
    "window_and_prefix": ((COLUMNS <= ROWS) & (ROWS - COLUMNS < 24)) | (COLUMNS < 20),
    "key_padding": (COLUMNS < 80).expand(S, S),  # every row keeps the first 80 keys: W = 0, P = 80
}


@pytest.fixture(autouse=True)
def small_work_routed(monkeypatch):
    """The tests' shapes are far below the least work the route takes on a GPU (``MIN_WORK``)."""
    monkeypatch.setattr(causal_tensor_route, "MIN_WORK", 0)


@pytest.fixture
def answers(monkeypatch):
    return spy_on_checks(monkeypatch, "is_known_band", "_start_band_check")


def attention(mask: torch.Tensor, form: str, softcap: bool = False):
    """Attention masked by ``mask`` (True where kept) as model code writes it: a -inf ``masked_fill``, a ``finfo.min``
    fill (GPT-2), or an additive float mask ``[1, 1, S, S]`` of 0 and ``finfo.min`` (Hugging Face)."""
    additive = torch.zeros(1, 1, S, S, dtype=torch.bfloat16).masked_fill(~mask, torch.finfo(torch.bfloat16).min)

    def fn(q, k, v):
        scores = q @ k.transpose(-1, -2) * 0.25
        if softcap:
            scores = 5.0 * torch.tanh(scores / 5.0)
        if form == "masked_fill":
            scores = scores.masked_fill(~mask, float("-inf"))
        elif form == "finfo_min":
            scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
        else:
            scores = scores + additive
        return torch.softmax(scores, -1) @ v  # (in the dtype of the scores: float64 for the reference)

    return fn


def inputs():
    return tuple(torch.randn(1, 2, S, 16, dtype=torch.bfloat16) * 2 for _ in range(3))


def band_kernel(code) -> str:
    """The fused kernel of the branch with the band's formula."""
    text = "\n".join(code)
    branch = text[text.index("def causal_fused_0_band_formula_0(") :]
    name = branch[branch.index("triton_tem_fused_") :].split(".run(")[0]
    return testing.triton_kernels(code)[name]


@pytest.mark.parametrize("form", ["masked_fill", "finfo_min", "additive"])
@pytest.mark.parametrize("band", list(KEEPS))
def test_a_band_from_tensors_runs_its_formula_from_its_check_on(band, form, answers):
    """First call: the mask is new, read. Second: the causal check answers False and the band's check runs (at once on
    the CPU), then the band's branch answers: its kernel reads W and P once and skips and splits tiles by them, the
    mask never read."""
    code = run_calls(attention(KEEPS[band].clone(), form), inputs(), 4)
    assert answers["answers"] == [False, True, True, True] and answers["checks"] == 1
    FileCheck().check("def causal_fused_0_band_formula_0").check("def causal_fused_0_band_mask_read_0").check(
        "flashlight.known_band.default(").check(".item():").check("causal_fused_0_band_formula_0").run("\n".join(code))
    kernel = band_kernel(code)
    FileCheck().check("scalar_read_0 = ").check("scalar_read_1 = ").check("visible = ").check(
        "for start_n in range(full_lo, full_hi").run(kernel)
    (masked_test,) = re.findall(r"^\s*masked = (.*)$", kernel, re.M)
    assert "scalar_read_0" in masked_test and "scalar_read_1" in masked_test
    assert counters["inductor"]["flashlight_attention_band_route"] == 1


def test_a_band_in_every_batch_entry_takes_the_route(answers):
    """A ``[B, 1, S, S]`` mask whose entries are all the same band: routed (the check compares every entry)."""
    mask = KEEPS["window"].expand(2, 1, S, S).clone()
    q, k, v = (torch.cat([t, t.flip(0)]) for t in inputs())
    run_calls(attention(mask, "masked_fill"), (q, k, v), 3)
    assert answers["answers"] == [False, True, True]


@pytest.mark.parametrize("case", ["window", "window_and_padding", "minus_1e4", "kept_bias", "nan"])
def test_masks_of_two_wheres_and_biases_that_are_no_band(case, answers):
    """Two masks in two -inf ``where``s (a window and a key padding that keeps every key: a band; that keeps 80: no
    band), an additive mask filling -1e4 (not absorbing), one adding a nonzero bias where it keeps, one with a NaN:
    the check compares them as they mask; only the first is routed, and each call is eager's."""
    window, padding = KEEPS["window"], (COLUMNS < (80 if case == "window_and_padding" else S)).expand(S, S)

    def two_wheres(q, k, v):
        scores = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~window, float("-inf"))
        return torch.softmax(scores.masked_fill(~padding, float("-inf")), -1) @ v

    additive = torch.zeros(1, 1, S, S, dtype=torch.bfloat16)
    if case == "minus_1e4":
        additive.masked_fill_(~window, -1e4)
    elif case in ("kept_bias", "nan"):
        additive.masked_fill_(~window, torch.finfo(torch.bfloat16).min)
        additive[..., 50, 40] = 0.5 if case == "kept_bias" else float("nan")

    def added(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + additive, -1) @ v

    fn = two_wheres if case.startswith("window") else added
    run_calls(fn, inputs(), 3)
    assert answers["answers"] == ([False, True, True] if case == "window" else [False] * 3)


@pytest.mark.parametrize("case, expected", [
    ("window", True), ("key_padding", True), ("one_row", True), ("one_sink", False), ("no_key", False),
    ("causal", True),
])
def test_the_band_check_on_masks_directly(case, expected):
    """``known_band`` on masks made directly (True where masked): the parameters read off their rows, the band
    compared everywhere; a row keeping no key, or a window with one sink (P = 1 reads as no prefix), is no band."""
    mask_checks._SIGHTINGS.clear()
    source = "def forward(self, input_0):\n    return torch.ops.aten.bitwise_not.default(input_0)\n"
    keep = {
        "window": KEEPS["window"], "key_padding": KEEPS["key_padding"], "one_row": torch.ones(1, 1, dtype=torch.bool),
        "one_sink": (COLUMNS <= ROWS) & ((ROWS - COLUMNS < 24) | (COLUMNS < 1)),
        "no_key": torch.zeros(S, S, dtype=torch.bool), "causal": (COLUMNS <= ROWS) | (COLUMNS < 1),
    }[case].clone()
    rows = keep.shape[-1]
    assert [mask_checks.is_known_band([keep], source, rows) for _ in range(3)] == [False, expected, expected]


def test_a_soft_capped_finite_fill_takes_the_route(answers):
    """``where(keep, c · tanh(s / c), finfo.min)`` (Gemma-2's window with GPT-2's fill): the fill absorbs after a
    soft-cap, whose tanh bounds the kept logits."""
    code = run_calls(attention(KEEPS["window"].clone(), "finfo_min", softcap=True), inputs(), 3)
    assert answers["answers"] == [False, True, True]
    FileCheck().check("scalar_read_0").check("masked = ").run(band_kernel(code))


@pytest.mark.parametrize("case", ["sinks", "one_cell", "batch_entry", "no_key"])
def test_a_mask_that_is_not_a_band_is_read(case, answers):
    """A window with sinks (rows before the sinks' end do not see them all), a band with one cell flipped, a band in
    one batch entry only, and a mask that keeps no key (finite fill: eager averages V; a band must keep one per row):
    checked once, read on every call, eager's result."""
    if case == "sinks":
        mask = (COLUMNS <= ROWS) & ((ROWS - COLUMNS < 24) | (COLUMNS < 4))
    elif case == "one_cell":
        mask = KEEPS["window"].clone()
        mask[70, 3] = True
    elif case == "batch_entry":
        mask = torch.stack([KEEPS["window"], KEEPS["window"].clone().index_fill_(1, torch.tensor([5]), False)])[:, None]
    else:
        mask = torch.zeros(S, S, dtype=torch.bool)
    form = "finfo_min" if case == "no_key" else "masked_fill"
    q, k, v = inputs()
    if case == "batch_entry":
        q, k, v = (torch.cat([t, t]) for t in (q, k, v))
    run_calls(attention(mask, form), (q, k, v), 4)
    assert answers["answers"] == [False] * 4 and answers["checks"] == 1


def test_a_mask_written_in_place_is_checked_again(answers):
    """A window mask written in place between calls: first another band (a narrower window: W read again), then no
    band (one cell flipped), then the window again. Every call matches eager on the mask it reads; an answer never
    outlives the version it was checked at."""
    mask = KEEPS["window"].clone()

    def kwargs_of_call(call):
        if call == 3:
            mask.copy_((COLUMNS <= ROWS) & (ROWS - COLUMNS < 9))
        if call == 6:
            mask[50, 2] = True
        if call == 8:
            mask.copy_(KEEPS["window"])
        return {}

    run_calls(attention(mask, "masked_fill"), inputs(), 11, kwargs_of_call)
    assert answers["answers"] == [False, True, True, False, True, True, False, False, False, True, True]


def test_no_band_route_with_the_switch_off(answers):
    with config.patch(band_tensor_route=False):
        code = run_calls(attention(KEEPS["window"].clone(), "masked_fill"), inputs(), 3)
    FileCheck().check_not("known_band").run("\n".join(code))
    assert answers["answers"] == []


def _window_of_captured_width(width: torch.Tensor):
    def fn(q, k, v):
        scores = q @ k.transpose(-1, -2) * 0.25
        positions = torch.arange(q.shape[-2])
        keep = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < width)
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v

    return fn


def test_a_width_read_from_a_captured_scalar_skips_tiles():
    """``(n <= m) & (m - n < w)`` with ``w`` a captured 0-d integer tensor, fused without the routes: in inference
    the kernel reads ``w`` once and skips tiles by it (a new value takes effect at the next call)."""
    width = torch.tensor(24)
    fn = _window_of_captured_width(width)
    q, k, v = inputs()
    torch._dynamo.reset()
    with testing.cpu_triton(), config.patch(causal_tensor_route=False):
        compiled = torch.compile(fn)
        out, code = testing.run_keeping_graphs_and_get_code(compiled, q, k, v)
        testing.assert_close_to_reference(out, reference(fn, q, k, v))
        width.fill_(9)
        testing.assert_close_to_reference(compiled(q, k, v), reference(fn, q, k, v))
    (name,) = [name for name in testing.triton_kernels(code) if "tem_fused" in name]
    FileCheck().check("scalar_read_0 = ").check("masked = ").check("scalar_read_0").run(testing.triton_kernels(code)[name])


def test_a_captured_scalar_width_trains_computed_per_element():
    """The same in training, where the kernels read no scalar: the forward and the backward compute the mask per
    element, and match eager (gradients too) as the width changes."""
    from test.test_training import assert_fused_training, train_calls

    width = torch.tensor(24)
    args = [t.float().requires_grad_() for t in inputs()]
    code = train_calls(_window_of_captured_width(width), args, 3, lambda call: width.fill_(24 - 7 * call),
                       causal_tensor_route=False)
    assert_fused_training(code, S * S)
    assert "scalar_read" not in "\n".join(code)


def test_a_scalar_read_inside_a_term_no_formula_bounds_is_not_counted():
    """``m - n < a`` and ``n >= where(b > 1, b, 0)`` over captured 0-d tensors: the formula reads two scalars, ``a``
    and the ``where`` (``b``, read while trying to bound the ``where``, does not count), so both bound tiles."""
    a, b = torch.tensor(24), torch.tensor(10)

    def fn(q, k, v):
        scores = q @ k.transpose(-1, -2) * 0.25
        positions = torch.arange(q.shape[-2])
        rows, columns = positions[:, None], positions[None, :]
        keep = (rows - columns < a) & (columns >= torch.where(b > 1, b, 0)) & (columns <= rows)
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v

    q, k, v = inputs()
    torch._dynamo.reset()
    with testing.cpu_triton(), config.patch(causal_tensor_route=False):
        out, code = testing.compile_and_get_code(fn, q, k, v)
    testing.assert_close_to_reference(out, reference(fn, q, k, v))
    (name,) = [name for name in testing.triton_kernels(code) if "tem_fused" in name]
    FileCheck().check("scalar_read_0 = ").check("scalar_read_1 = ").check("masked = ").check("scalar_read_1").run(
        testing.triton_kernels(code)[name])


@pytest.mark.parametrize("shared", [True, False])
def test_scalar_reads_in_head_groups(shared):
    """DiffAttn's head pairs masked by a window of a captured width: the kernel reads the width once for the group,
    whether its heads share one pass or run in turn."""
    from benchmarks.programs import diff_attention, diff_inputs

    width = torch.tensor(9)

    def fn(q, k, v, lam):
        positions = torch.arange(q.shape[-2])
        keep = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < width)
        b, two_h, m, d = q.shape
        weights = torch.softmax((q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~keep, float("-inf")), dim=-1)
        weights = weights.view(b, two_h // 2, 2, m, k.shape[-2])
        return (weights[:, :, 0] - lam * weights[:, :, 1]) @ v

    operands = diff_inputs(S=70)
    torch._dynamo.reset()
    with testing.cpu_triton(), config.patch(causal_tensor_route=False, share_v_tile_in_head_groups=shared,
                                            fault_containment=False):
        out, code = testing.compile_and_get_code(fn, **operands)
    testing.assert_close_to_reference(out, reference(fn, **operands))
    (name,) = [name for name in testing.triton_kernels(code) if "tem_fused" in name]
    kernel = testing.triton_kernels(code)[name]
    assert ("fl_z0 = " in kernel) == shared
    FileCheck().check("scalar_read_0 = ").check("masked = ").run(kernel)


def test_a_probe_of_a_term_keeps_its_scalar_reads_to_itself():
    """``PositionReads.copy``: what a copy reads is not read by the original (``matched_tensor_masks`` probes terms
    on a copy)."""
    from inductor_overlay.fx_passes.block_sparsity import PositionReads

    graph = torch.fx.Graph()
    scores, width = graph.placeholder("scores"), graph.placeholder("width")
    reads = PositionReads(scores, lambda node: True, scalars=True)
    reads.copy().scalar(width)
    assert reads.scalars == []


def test_no_route_at_a_symbolic_length(answers):
    """A window mask passed in, compiled with symbolic sizes: no checked route (the check and the formula are built
    for one size), the mask read at every length, eager's result."""
    def fn(q, k, v, keep):
        return torch.softmax((q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf")), -1) @ v

    torch._dynamo.reset()
    with testing.cpu_triton(), config.patch(fault_containment=False):
        compiled = torch.compile(fn, dynamic=True)
        for length in (S, S - 16):
            q, k, v = (t[..., :length, :] for t in inputs())
            keep = KEEPS["window"][:length, :length].clone()
            for _ in range(3):
                testing.assert_close_to_reference(compiled(q, k, v, keep), reference(fn, q, k, v, keep))
    assert answers["answers"] == [] and counters["inductor"]["flashlight_route_fault"] == 0
