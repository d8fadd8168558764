"""The position-based variants in every written form (``benchmarks/written_forms.py``): positions made once outside
the compiled function or kept as registered buffers bound tiles at run time from their values; masks passed in or
sliced from a buffer are summarised into tables; ALiBi over captured positions converts each vector once."""

import pytest
import sympy
import torch
from torch.testing import FileCheck

from benchmarks import variants
from benchmarks.written_forms import FORMS, MADE_ONCE
from test.test_training import READ_TENSORS
from flashlight import testing
from inductor_overlay import config, ops
from inductor_overlay.kernel import tile_tests

FORM_CASES = [
    pytest.param(name, form, id=f"{name}-{form}") for name, variant in FORMS.items() for form in variant.idioms
]


def _compile(fn, *args, **kwargs):
    """One call's output and code: the kernel that reads the positions (a first call takes it; the route to the
    in-function kernel, on from the second call, has its own tests: ``test_arange_positions_route.py``)."""
    with testing.cpu_triton(), config.patch(arange_positions_route=False):
        return testing.compile_and_get_code(fn, *args, **kwargs)


def _kernel(code):
    return "\n".join(source for name, source in testing.triton_kernels(code).items() if "tem_fused" in name)


def _float64(extras):
    return {name: t.double() if t.is_floating_point() else t for name, t in extras.items()}


@pytest.mark.parametrize("name,form", FORM_CASES)
def test_every_written_form_fuses_and_matches_eager(name, form):
    variant = FORMS[name]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=2, H=4, M=70, N=70, D=16))
    out, code = _compile(variant.idioms[form], q, k, v, **extras)
    expected = variant.reference(q.double(), k.double(), v.double(), **_float64(extras))
    testing.assert_close_to_reference(out, expected)
    assert "for start_n in" in _kernel(code) or "partial_n" in _kernel(code)
    assert not any(size >= 70 * 70 * 2 for size in testing.allocated_buffer_numels(code)), "a score-sized buffer"


@pytest.mark.parametrize("form", ["captured_positions", "registered_buffer"])
def test_captured_positions_bound_tiles_from_their_cells(form):
    """The causal mask over captured positions becomes a formula over the values read at the rows and columns; the
    pre-pass bounds them per tile from per-cell bounds summarised once per call, skips the tiles above the diagonal
    (poisoned values there never reach the rows that do not see them) and runs the tiles below it without the mask.
    Positions a mask alone reads are read per tile, not computed from the tile (``_position_vectors``)."""
    variant = FORMS["forms_causal"]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=1, H=2, M=128, N=128, D=16))
    poisoned = v.clone()
    poisoned[..., 64:, :] = float("nan")  # keys rows 0..63 never see; a visit spreads NaN through P·V even at P = 0
    out, code = _compile(variant.idioms[form], q, k, poisoned, **extras)
    kernel = _kernel(code)
    FileCheck().check("row_pos_lo = tl.min(tl.broadcast_to(row_cell_lo").check("for scan_n in range(").check(
        "col_pos_lo = tl.min(tl.broadcast_to(col_cell_lo, [SCAN_TILES, CELLS_N]), 1)"
    ).check("masked = (").check("row_pos_hi").check("visible = ~masked &").check_not("positions_affine").run(kernel)
    assert testing.column_tile_loops(kernel) == 2, "the visible tiles' loop and the partial tiles'"
    expected = variant.reference(q.double(), k.double(), v.double(), **_float64(extras))
    testing.assert_close_to_reference(out[..., :64, :], expected[..., :64, :])


def test_a_changed_buffer_changes_the_result():
    """Nothing is specialised on the captured values: positions changed in place between calls give eager's
    results; the tile bounds and whether the positions are consecutive (and small) are read at run time."""
    variant = FORMS["forms_causal"]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=1, H=2, M=96, N=96, D=16))
    fn = variant.idioms["captured_positions"]
    compiled = torch.compile(fn)
    position = MADE_ONCE["forms_causal"]["position"]
    with testing.cpu_triton():
        torch._dynamo.reset()
        # consecutive (the fast chain), reversed, consecutive from 2^30 (too large for 32 bits), spread far out
        for change in (lambda p: p, lambda p: p.flip(0), lambda p: p + 2**30, lambda p: p * 3 + 2**40):
            position.copy_(change(torch.arange(96)))
            out = compiled(q, k, v, **extras)
            testing.assert_close_to_reference(out, fn(q.double(), k.double(), v.double()))


def test_alibi_over_consecutive_captured_positions_computes_them_from_the_tile():
    """``slopes * (pos[n] - pos[m])`` over captured int64 positions: consecutive ones (checked once per call) are
    computed from the tile's own positions in 32 bits; consecutive from 2^30 (too large for 32 bits) and shuffled
    ones run the chain that reads them. Every case matches float64 eager."""
    variant = FORMS["forms_alibi"]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=1, H=2, M=64, N=64, D=16))
    fn = variant.idioms["captured_positions"]
    position = MADE_ONCE["forms_alibi"]["position"]
    for values in (torch.arange(64), torch.arange(64) + 2**30, torch.randperm(64)):
        position.copy_(values)
        out, code = _compile(fn, q, k, v, **extras)
        FileCheck().check("if positions_affine:").check("speculation_failed").run(_kernel(code))
        testing.assert_close_to_reference(out, fn(q.double(), k.double(), v.double()))


def test_a_limit_of_another_origin_keeps_64_bit_positions():
    """A window whose limit is a 0-d int64 tensor above 2^32 (or a huge Python number) must meet the positions in
    64 bits, as in eager: the consecutive positions (computed from the tile for the ALiBi-like difference beside
    the window) are not narrowed to 32 bits there."""
    position = torch.arange(64)
    limit = torch.tensor([2**32 + 10])

    def windowed(s, bound):
        distance = position[None, :] - position[:, None]
        s = s + 0.125 * distance.float()
        return s.masked_fill((position[None, :] > position[:, None]) | ((position[:, None] - position[None, :]) >= bound), float("-inf"))

    def fn(q, k, v, limit):
        window = limit.sum()  # a 0-d int64 tensor computed in the graph
        return windowed(q @ k.transpose(-1, -2) * 0.25, window).softmax(-1) @ v

    def huge(q, k, v, limit):
        return windowed(q @ k.transpose(-1, -2) * 0.25, 2**62).softmax(-1) @ v

    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    for program in (fn, huge):
        out, code = _compile(program, q, k, v, limit)
        FileCheck().check("if positions_affine:").run(_kernel(code))
        testing.assert_close_to_reference(out, program(q.double(), k.double(), v.double(), limit))


def test_a_mask_built_with_cat_still_fuses():
    """A mask condition with a list argument (``cat`` of two masks) is not a formula; the attention still fuses with
    its mask read per element, and nothing falls back."""
    from torch._dynamo.utils import counters

    keep = torch.ones(64, 64, dtype=torch.bool).triu(1)

    def fn(q, k, v):
        mask = torch.cat([torch.zeros(64, 8, dtype=torch.bool), keep], -1)
        s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(mask, float("-inf"))
        return s.softmax(-1) @ v

    q = torch.randn(1, 2, 64, 16)
    k, v = (torch.randn(1, 2, 72, 16) for _ in range(2))
    counters.clear()
    out, _ = _compile(fn, q, k, v)
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, fn(q.double(), k.double(), v.double()))


def test_floor_of_a_difference_rounds_down_for_negative_values():
    """Triton's integer ``//`` rounds toward zero: the tile bound of ⌊pn/4⌋ (a value read from memory, of any sign)
    corrects it where the value may be negative, and keeps the plain division for positions known nonnegative."""
    lo = tile_tests._interval(sympy.floor(ops.COL_READ / 4), tile_tests._BOUNDS).lo
    assert lo.startswith("tl.where(") and "% 4 < 0" in lo
    plain = tile_tests._interval(sympy.floor(ops.ROW / 4), tile_tests._BOUNDS).lo
    assert plain == "(m_lo // 4)"


def test_captured_positions_train_with_the_fused_backward():
    """In training both passes of the kernels that read captured positions (what runs until the arange route's check
    passes; the route off here) skip tiles by their cells: the backward's pre-pass bounds the column program's own
    columns and each scanned row tile (and the reverse in the row programs); outputs and gradients match float64
    eager, and nothing falls back (containment off: a fault raises)."""
    from torch._dynamo.utils import counters

    from inductor_overlay import config

    variant = FORMS["forms_sliding_window"]
    q, k, v, _ = variants.make_inputs(variant, variants.Shape(B=1, H=2, M=64, N=64, D=16))
    fn = variant.idioms["captured_positions"]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    counters.clear()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight", fault_containment=False, **READ_TENSORS):
        torch._dynamo.reset()
        def step():
            out = torch.compile(fn)(*leaves)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
            out.backward(grad)
            return out, grad

        (out, grad), code = testing.run_keeping_graphs_and_get_code(step)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    (backward,) = [text for text in testing.triton_kernels(code).values() if "grad_scores" in text]
    FileCheck().check("if tile < column_tiles:").check("col_pos_lo = tl.min(").check("for scan_m in").check(
        "row_pos_lo = tl.min("
    ).check("masked = ").check("row_pos_").check("else:").check("row_pos_lo = tl.min(").check("for scan_n in").check(
        "col_pos_lo = tl.min("
    ).check("masked = ").check("col_pos_").run(backward)
    exact = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    expected = fn(*exact)
    expected.backward(grad.double())
    testing.assert_close_to_reference(out, expected)
    for leaf, reference in zip(leaves, exact):
        testing.assert_close_to_reference(leaf.grad, reference.grad)


# In training the CI tier keeps one form of each kind of input (a sliced buffer's mask, a bias passed in, a mask
# passed in, captured ids); the full tier trains every form.
TRAINED_IN_CI = {("forms_causal", "sliced_buffer_mask"), ("forms_alibi", "bias_passed_in"),
                 ("forms_key_padding", "mask_passed_in"), ("forms_document", "captured")}
TRAINING_CASES = [
    pytest.param(name, form, id=f"{name}-{form}", marks=() if (name, form) in TRAINED_IN_CI else pytest.mark.full)
    for name, variant in FORMS.items() for form in variant.idioms
]


@pytest.mark.parametrize("name,form", TRAINING_CASES)
def test_every_written_form_trains_fused_and_matches_eager(name, form):
    """Every form trains with the fused backward (containment off: a fault raises), keeps no score-sized buffer,
    and gives float64 eager's output and q, k, v gradients."""
    from torch._dynamo.utils import counters

    variant = FORMS[name]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=2, H=2, M=70, N=70, D=16))
    fn = variant.idioms[form]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    counters.clear()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight", fault_containment=False):
        torch._dynamo.reset()

        def step():
            out = torch.compile(fn)(*leaves, **extras)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
            out.backward(grad)
            return out, grad

        (out, grad), code = testing.run_keeping_graphs_and_get_code(step)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    assert any("grad_scores" in text for text in testing.triton_kernels(code).values())
    assert not any(size >= 70 * 70 * 2 for size in testing.allocated_buffer_numels(code)), "a score-sized buffer"
    exact = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    expected = fn(*exact, **_float64(extras))
    expected.backward(grad.double())
    testing.assert_close_to_reference(out, expected)
    for leaf, reference in zip(leaves, exact):
        testing.assert_close_to_reference(leaf.grad, reference.grad)


@pytest.mark.parametrize("form,pipelined", [("sliced_buffer_mask", False), ("captured_positions", True)])
def test_a_sliced_buffer_mask_is_read_per_score_in_the_backward(monkeypatch, form, pipelined):
    """A mask buffer longer than the sequence and sliced to it (GPT-2's ``bias[:, :, :T, :T]``) is read at every score
    like a mask passed in: the backward's loops run unpipelined (Triton 3.6's pipeliner fails on them at rows of
    2048 and more); positions read as vectors keep the stages they are given."""
    import re

    from inductor_overlay.kernel import attention_backward

    original = attention_backward.backward_configs
    monkeypatch.setattr(attention_backward, "backward_configs", lambda *a, **kw: [dict(c, num_stages=2) for c in original(*a, **kw)])
    variant = FORMS["forms_causal"]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=1, H=2, M=40, N=40, D=16))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight", fault_containment=False, **READ_TENSORS):
        torch._dynamo.reset()
        _, code = testing.run_keeping_graphs_and_get_code(
            lambda: torch.compile(variant.idioms[form])(*leaves, **extras).sum().backward()
        )
    assert any("grad_scores" in text for text in testing.triton_kernels(code).values())
    assert ("num_stages=2" in re.findall(r"num_stages=\d+", "\n".join(code))) == pipelined


@pytest.mark.parametrize(
    "name,form,says",
    [
        ("forms_sliding_window", "in_function", "tiles skipped where (n > m) | (m - n >= 1024); entirely visible"),
        ("forms_sliding_window", "captured_positions", "(positions read from memory, bounded per tile from their values)"),
        ("forms_sliding_window", "mask_passed_in", "a mask tensor summarised per call into cells of 32x32"),
        ("forms_alibi", "bias_passed_in", "every tile visited (no mask whose tiles the analysis can bound)"),
        ("forms_alibi", "bias_passed_in", "the rows' running max kept in the logits' own units with a scale per row"),
        ("forms_alibi", "captured_positions", "every tile visited (no mask whose tiles the analysis can bound)"),
    ],
)
def test_the_fusion_log_says_how_tiles_are_chosen(name, form, says, caplog):
    import logging

    variant = FORMS[name]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=1, H=2, M=40, N=40, D=16))
    with caplog.at_level(logging.INFO, logger="flashlight"):
        _compile(variant.idioms[form], q, k, v, **extras)
    assert says in caplog.text
    assert "the backward reads the positions" not in caplog.text


@pytest.mark.parametrize("form,slower", [("captured_positions", True), ("in_function", False)])
def test_the_fusion_log_says_when_training_reads_positions_per_logit(form, slower, caplog):
    """In training, the backward reads captured positions and converts them per logit (the forward computes
    consecutive ones from the tile): the log says so where it applies, and only there."""
    import logging

    variant = FORMS["forms_alibi"]
    q, k, v, extras = variants.make_inputs(variant, variants.Shape(B=1, H=2, M=40, N=40, D=16))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    with caplog.at_level(logging.INFO, logger="flashlight"), testing.cpu_triton():
        torch._dynamo.reset()
        torch.compile(variant.idioms[form])(*leaves, **extras).sum().backward()
    assert "attention at" in caplog.text
    assert ("the backward reads the positions from memory and converts them per logit" in caplog.text) == slower


def _distance_bias_causal(q, k, v, position):
    """A bias over captured positions with a constant slope (no floating tensor read: the rows' statistics are the
    narrow ones), under a causal mask over the same positions."""
    scores = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).float() + 0.25 * (position[None, :] - position[:, None])
    return torch.softmax(scores.masked_fill(position[None, :] > position[:, None], float("-inf")), -1).to(q.dtype) @ v


@pytest.mark.parametrize("kind", ["consecutive", "strided", "permuted"])
def test_training_forward_computes_consecutive_captured_positions_from_the_tile(kind):
    """In training the forward computes consecutive captured positions from its own tile positions and, where they
    are not consecutive, redoes each row tile with the chain that reads them, keeping the rows' statistics in the
    units the backward reads; the backward always reads them. Gradients match float64 eager either way."""
    from torch._dynamo.utils import counters

    position = {"consecutive": torch.arange(80) + 5, "strided": torch.arange(80) * 2 - 7,
                "permuted": torch.randperm(80, generator=torch.Generator().manual_seed(0))}[kind]
    generator = torch.Generator().manual_seed(1)
    leaves = [torch.randn(2, 2, 80, 16, generator=generator).requires_grad_(True) for _ in range(3)]
    grad = torch.randn(2, 2, 80, 16, generator=generator)
    counters.clear()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight", fault_containment=False, **READ_TENSORS):
        torch._dynamo.reset()
        out, code = testing.run_keeping_graphs_and_get_code(
            lambda: torch.compile(_distance_bias_causal)(*leaves, position)
        )
        out.backward(grad)
    assert counters["inductor"]["flashlight_attention_fused_for_training"] == 1
    (forward,) = [text for text in testing.triton_kernels(code).values() if "positions_affine" in text]
    FileCheck().check("if positions_affine:").check("speculation_failed = ").check("tl.store(LSE").run(forward)
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    expected = _distance_bias_causal(*exact, position)
    expected.backward(grad.double())
    testing.assert_close_to_reference(out, expected)
    for leaf, reference in zip(leaves, exact):
        testing.assert_close_to_reference(leaf.grad, reference.grad)
