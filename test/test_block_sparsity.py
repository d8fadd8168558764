"""Block skipping derived from the user's position mask: the analysis, the generated test, and exact results."""

import pytest
import sympy
import torch
from torch.testing import FileCheck

from benchmarks import variants
from flashlight import testing
from inductor_overlay import config
from inductor_overlay.fx_passes import block_sparsity

m, n = block_sparsity.ROW, block_sparsity.COL


def _tile_is_masked(code, m_lo, m_hi, n_lo, n_hi):
    expression = code.replace("tl.where", "_where").replace("tl.maximum", "max")
    return bool(eval(expression, {"_where": lambda c, a, b: a if c else b, "max": max},
                     {"m_lo": m_lo, "m_hi": m_hi, "n_lo": n_lo, "n_hi": n_hi}))


@pytest.mark.parametrize(
    "formula",
    [
        sympy.Gt(n, m),  # causal
        sympy.Or(sympy.Gt(n, m), sympy.Ge(m - n, 7)),  # sliding window
        sympy.And(sympy.Gt(n, m), sympy.Ge(n, 5)),  # prefix-LM
        sympy.Ne(sympy.floor(m / 4), sympy.floor(n / 4)),  # block-diagonal
        sympy.Gt(sympy.Abs(m - n), 3),  # band
    ],
    ids=["causal", "window", "prefix", "block-diagonal", "band"],
)
def test_tile_test_is_sound_against_brute_force(formula):
    """A tile called fully masked must have every element masked (checked on every small tile)."""
    code = block_sparsity.fully_masked_tile_code(formula)
    assert code is not None
    masked_at = sympy.lambdify((m, n), formula)
    skipped = 0
    for m_lo in range(0, 12, 3):
        for n_lo in range(0, 12, 2):
            m_hi, n_hi = m_lo + 2, n_lo + 1
            every = all(masked_at(i, j) for i in range(m_lo, m_hi + 1) for j in range(n_lo, n_hi + 1))
            if _tile_is_masked(code, m_lo, m_hi, n_lo, n_hi):
                assert every, (m_lo, m_hi, n_lo, n_hi)
                skipped += 1
    assert skipped > 0, "the test never skips a tile, so it proves nothing"


def test_causal_tile_test_is_exact():
    code = block_sparsity.fully_masked_tile_code(sympy.Gt(n, m))
    assert _tile_is_masked(code, 0, 15, 16, 31)
    assert not _tile_is_masked(code, 16, 31, 16, 31)


def window(q, k, v, width=20):
    rows = torch.arange(q.shape[-2])[:, None]
    cols = torch.arange(k.shape[-2])[None, :]
    visible = (cols <= rows) & (rows - cols < width)
    scores = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def prefix_lm(q, k, v, prefix=10):
    rows = torch.arange(q.shape[-2])[:, None]
    cols = torch.arange(k.shape[-2])[None, :]
    scores = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(torch.where((cols <= rows) | (cols < prefix), scores, float("-inf")), dim=-1) @ v


def shifted_causal_with_empty_rows(q, k, v):
    rows = torch.arange(q.shape[-2])[:, None]
    cols = torch.arange(k.shape[-2])[None, :]
    scores = q @ k.transpose(-2, -1)
    return torch.softmax(scores.masked_fill(cols > rows - 20, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize(
    "fn,skip_test",
    [
        (variants.causal_masked_fill, "masked = (((n_lo + (-1 * m_hi)) > 0)) | (n_lo >= N)"),
        (window, "masked = ((((n_lo + (-1 * m_hi)) > 0) | ((-20 + m_lo + (-1 * n_hi)) >= 0))) | (n_lo >= N)"),
        (prefix_lm, "masked = ((((n_lo + (-1 * m_hi)) > 0) & ((-10 + n_lo) >= 0))) | (n_lo >= N)"),
        (shifted_causal_with_empty_rows, "masked = "),
    ],
    ids=["causal", "sliding-window", "prefix-lm", "empty-rows"],
)
def test_position_masks_skip_tiles_and_stay_exact(fn, skip_test):
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(fn, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check("for scan_n in range(0, N, BLOCK_N * SCAN_TILES)").check(skip_test).check("visible = ").run(kernel)
    assert testing.column_tile_loops(kernel) == 3
    expected = fn(q.double(), k.double(), v.double())
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


def test_finite_fill_is_not_skipped():
    """finfo.min rows that are fully masked average V in eager; skipping them would give NaN instead."""
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(variants.causal_arange_where, q, k, v)
    FileCheck().check_not("for scan_n").check("for start_n in range(first_n, end_n, BLOCK_N)").run(code[0])
    testing.assert_close_to_reference(out, variants.causal_arange_where(q.double(), k.double(), v.double()))


def test_flag_off_visits_every_tile():
    """Without block skipping no tile is skipped: no pre-pass at all, or (when visible tiles still get a loop of
    their own) one whose skip test never holds."""
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with testing.cpu_triton(), config.patch(block_skipping=False, split_visible_tiles=False):
        out, code = testing.compile_and_get_code(variants.causal_masked_fill, q, k, v)
    FileCheck().check_not("for scan_n").run(code[0])
    with testing.cpu_triton(), config.patch(block_skipping=False):
        out, code = testing.compile_and_get_code(variants.causal_masked_fill, q, k, v, fresh_cache=True)
    FileCheck().check("masked = ((n_lo < 0)) | (n_lo >= N)").check("visible = ").run(code[0])
    testing.assert_close_to_reference(out, variants.causal_masked_fill(q.double(), k.double(), v.double()))


def test_entirely_visible_tiles_run_the_chain_without_its_mask():
    """The loop over tiles the causal mask leaves entirely visible has no mask math; the loops over the tiles it
    cuts through keep the user's where(..., -inf, ...). Same result as eager, NaN rows included."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(variants.causal_masked_fill, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    loops = kernel.split("for start_n in range(")[1:]
    assert len(loops) == 3
    partial_before, visible, partial_after = (loop.split("logits = tmp")[0] for loop in loops)
    assert "tl.where(" in partial_before and "tl.where(" in partial_after
    assert "tl.where(" not in visible
    testing.assert_close_to_reference(out, variants.causal_masked_fill(q.double(), k.double(), v.double()))


def test_split_flag_off_keeps_one_loop():
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with testing.cpu_triton(), config.patch(split_visible_tiles=False):
        out, code = testing.compile_and_get_code(variants.causal_masked_fill, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check("for start_n in range(first_n, end_n, BLOCK_N)").check_not("full_lo").run(kernel)
    testing.assert_close_to_reference(out, variants.causal_masked_fill(q.double(), k.double(), v.double()))
