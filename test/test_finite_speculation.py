"""A chain guarded against NaN and infinity (``nan_to_num``) runs without its guards, speculating that the scores
are finite; a row tile whose softmax state shows otherwise runs again with the whole chain (CPU harness).

Each test checks the result against eager on fresh random inputs, some with NaN and infinite scores placed where
the fast chain's result would differ from eager's, and pins the kernel's structure: the guards' compares only in the
loop that runs after a failed check.
"""

import math
import re

import pytest
import torch
from torch.testing import FileCheck

from benchmarks import programs
from flashlight import testing
from inductor_overlay import config

PROGRAM = programs.PROGRAMS["diff_transformer_causal"]


def compile_on_cpu(fn, inputs, **overlay_config):
    with testing.cpu_triton(), config.patch(**overlay_config):
        return testing.compile_and_get_code(fn, **inputs)


def fused_kernel(code):
    kernels = [k for k in testing.triton_kernels(code).values() if "for start_n in range(" in k]
    assert len(kernels) == 1, f"expected one fused kernel, found {len(kernels)}"
    return kernels[0]


def logit_scale(kernel, name="LOGIT_SCALE"):
    return float(re.search(rf"\b{name} : tl.constexpr = (\S+)", kernel)[1])


@pytest.mark.parametrize("shared", [True, False])
def test_guarded_chain_runs_its_loops_without_the_guards(shared):
    """The DIFF Transformer's code: the visible tiles' loop has no compare and no where (its mask and its guards are
    gone, 1/√d joins exp2), the partial tiles' loop only its mask; the guards run after the check, with the scale.
    Its head pairs share one pass (``share_v_tile_in_head_groups``; names suffixed by the head), or run in turn: a
    row tile either head fails runs again for both (after both, in one loop over the heads that is not unrolled)."""
    inputs = PROGRAM.inputs(B=1, H=2, S=200, D=16)
    out, code = compile_on_cpu(PROGRAM.fn, inputs, share_v_tile_in_head_groups=shared)
    testing.assert_close_to_reference(out, PROGRAM.fn(**{k: v.double() for k, v in inputs.items()}))
    kernel = fused_kernel(code)
    assert logit_scale(kernel) == pytest.approx(math.log2(math.e) / 4)
    assert logit_scale(kernel, "EXACT_LOGIT_SCALE") == pytest.approx(math.log2(math.e))
    fast, exact = kernel.split("speculation_failed = " if shared else "any_speculation_failed = tl.maximum(")
    visible, partial = fast.split("for start_n in range(full_lo, full_hi")[1].split("for partial_n in")
    heads = ["0", "1"] if shared else [""]
    for loop in (visible, partial):
        for h in heads:
            FileCheck().check(f"scores{h} = tl.dot(q{h}, kt{h}").check_not("isnan").check_not(" == ").check_not(
                "* tmp").check(f"logits{h} = tmp").run(loop)
    FileCheck().check_not("tl.where(tmp").run(visible)
    FileCheck().check("tl.where(tmp").run(partial)
    check = FileCheck()
    for h in heads:
        check = check.check(f"(tl.abs(m_i{h}) < SPECULATION_MAX_BOUND)")
    check = check.check("if tl.max(speculation_failed") if shared else check.check("if any_speculation_failed > 0:").check(
        "for redo_group in range(GROUPS):")
    check.check("for start_n in tl.range(first_n, end_n, BLOCK_N, num_stages=1)")
    for h in heads:
        check = check.check(" == tmp").check("libdevice.isnan").check("row_scale")
    for h in heads:
        check = check.check(f"acc{h} = tl.dot(p{h}, v")
    check.check(f"acc{heads[0]} = acc{heads[0]} / l_i{heads[0]}").run(exact)


def _with_non_finite_scores(inputs, kind):
    """Inputs whose scores hold ``kind`` values in some rows of the first head (the causal mask shows row r the
    columns up to r): NaN rows, rows of +inf and -inf (an infinite query meets keys of both signs), or columns of
    -inf (column 0: row 0 sees nothing else, so eager spreads it uniformly over -FLT_MAX)."""
    q, k = inputs["q"], inputs["k"]
    if kind == "nan_rows":
        q[0, 0, [3, 40, 77]] = math.nan
    elif kind == "infinite_rows":
        q[0, 0, [5, 63], 1:] = 0.0
        q[0, 0, [5, 63], 0] = math.inf
    elif kind == "minus_inf_columns":
        q[0, 0, :, 0] = q[0, 0, :, 0].abs() + 0.1
        k[0, 0, [0, 9], 1:] = 0.0
        k[0, 0, [0, 9], 0] = -math.inf
    return inputs


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("kind", ["nan_rows", "infinite_rows", "minus_inf_columns"])
def test_non_finite_scores_match_eager(kind, shared):
    """Heads sharing one pass, or in turn (the non-finite scores are in the first head of a pair: its redo must
    recompute the second head's share too, and the partial sum must hold the redo's, not the fast loops')."""
    inputs = _with_non_finite_scores(PROGRAM.inputs(B=2, H=4, S=96, D=8), kind)
    out, code = compile_on_cpu(PROGRAM.fn, inputs, share_v_tile_in_head_groups=shared)
    expected = PROGRAM.fn(**inputs)  # eager in the inputs' dtype: nan_to_num's bounds are float32's
    assert torch.isfinite(expected).all()
    testing.assert_close_to_reference(out, expected)
    assert "speculation_failed" in fused_kernel(code)


def test_without_speculation_the_loops_keep_the_guards():
    inputs = _with_non_finite_scores(PROGRAM.inputs(B=1, H=2, S=64, D=8), "infinite_rows")
    out, code = compile_on_cpu(PROGRAM.fn, inputs, speculate_finite_scores=False)
    testing.assert_close_to_reference(out, PROGRAM.fn(**inputs))
    kernel = fused_kernel(code)
    assert "speculation_failed" not in kernel
    FileCheck().check("for start_n in range(first_n, end_n").check("libdevice.isnan").run(kernel)


def soft_capped_after_guard(q, k, v):
    scores = torch.nan_to_num(q @ k.transpose(-1, -2) / 8.0)
    return torch.softmax(30.0 * torch.tanh(scores / 30.0), dim=-1) @ v


def guard_to_minus_100(q, k, v):
    return torch.softmax(torch.nan_to_num(q @ k.transpose(-1, -2), neginf=-100.0) * 0.5, dim=-1) @ v


@pytest.mark.parametrize("fn", [soft_capped_after_guard, guard_to_minus_100])
def test_guards_whose_values_matter_stay(fn):
    """After the guard a soft-cap maps -FLT_MAX and -inf alike, but not through the ops the check reasons about; a
    guard that gives -inf the logit -50 weighs it exp(-50 - max), not 0. Both keep their guards in the loop."""
    q, k, v = (torch.randn(1, 2, 48, 8) for _ in range(3))
    q[0, 0, 7] = math.nan
    q[0, 1, 5, 1:], q[0, 1, 5, 0] = 0.0, -math.inf
    out, code = compile_on_cpu(fn, dict(q=q, k=k, v=v))
    testing.assert_close_to_reference(out, fn(q, k, v))
    kernel = fused_kernel(code)
    assert "speculation_failed" not in kernel
    FileCheck().check("for start_n in range(").check("libdevice.isnan").run(kernel)


def where_isnan(q, k, v):
    scores = q @ k.transpose(-1, -2) * 0.25
    return torch.softmax(torch.where(torch.isnan(scores), 0.0, scores), dim=-1) @ v


def masked_fill_isinf(q, k, v):
    scores = q @ k.transpose(-1, -2)
    return torch.softmax(scores.masked_fill(torch.isinf(scores), -1e4) * 0.25, dim=-1) @ v


@pytest.mark.parametrize("fn", [where_isnan, masked_fill_isinf])
def test_guards_written_by_hand_are_speculated(fn):
    """A guard against NaN alone (-inf stays -inf), and one that gives ±inf the logit -2500 (the row max must stay
    within ±625 for the fast chain's 0 to be exact, as the check requires)."""
    q, k, v = (torch.randn(1, 2, 48, 8) for _ in range(3))
    q[0, 1, 5, 1:], q[0, 1, 5, 0] = 0.0, math.inf
    q[0, 0, 9] = math.nan
    out, code = compile_on_cpu(fn, dict(q=q, k=k, v=v))
    testing.assert_close_to_reference(out, fn(q, k, v))
    fast, exact = fused_kernel(code).split("speculation_failed = ")
    FileCheck().check("scores = tl.dot(q, kt").check_not("tl.where(tmp").check("logits = tmp").run(fast)
    FileCheck().check("tl.where(tmp").run(exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_guards_on_16_bit_scores_are_speculated(dtype):
    """In 16-bit the decomposed ``nan_to_num`` tests the scores widened to float32 for infinity and the scores
    themselves for NaN: one guard of one value all the same (the head pair shares one pass: both heads' chains)."""
    inputs = _with_non_finite_scores(PROGRAM.inputs(B=1, H=2, S=96, D=8, dtype=dtype), "infinite_rows")
    out, code = compile_on_cpu(PROGRAM.fn, inputs)
    testing.assert_close_to_reference(out, PROGRAM.fn(**{name: t.float() for name, t in inputs.items()}))
    fast, exact = fused_kernel(code).split("speculation_failed = ")
    FileCheck().check("scores0 = tl.dot(q0, kt0").check_not("isnan").check("logits0 = tmp").check(
        "scores1 = tl.dot(q1, kt1"
    ).check_not("isnan").check("logits1 = tmp").run(fast)
    FileCheck().check("libdevice.isnan").run(exact)
