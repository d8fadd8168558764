"""Block skipping derived from the user's position mask: the analysis, the generated test, and exact results."""

import math

import pytest
import sympy
import torch
from torch.testing import FileCheck

from benchmarks import variants
from flashlight import testing
from inductor_overlay import config
from inductor_overlay import ops
from inductor_overlay.fx_passes import block_sparsity
from inductor_overlay.kernel import tile_tests

m, n = ops.ROW, ops.COL


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
    code = tile_tests.masked_tile_test(formula)
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
    code = tile_tests.masked_tile_test(sympy.Gt(n, m))
    assert _tile_is_masked(code, 0, 15, 16, 31)
    assert not _tile_is_masked(code, 16, 31, 16, 31)


def test_formulas_travel_as_data_and_tests_are_rendered_by_the_kernel():
    """The pass hands the kernel formulas (text in the node's decisions, read back exactly); the kernel renders them,
    the id and table summaries by their flags."""
    causal = sympy.Gt(n, m)
    assert ops.formula_of(ops.formula_text(causal)) == causal
    chain = ops.ScoreChain(None, (1,), torch.float32, torch.float32, visible_formula=causal, drops_table_mask=True)
    assert tile_tests.visible_tile_test(chain) == f"({tile_tests._tile_codes(causal)[1]}) & ((table_hi == 0))"


def product_of_positions(q, k, v):
    rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    scores = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(torch.where(rows * cols > 900, float("-inf"), scores), dim=-1) @ v


def test_a_formula_the_tile_tests_cannot_bound_gives_no_test():
    """A mask over positions that interval arithmetic does not bound (a product of positions) gives no test: no tile
    is skipped, none runs the chain without its mask (one loop), and the result is eager's."""
    product = sympy.Gt(m * n, 900)
    assert tile_tests.masked_tile_test(product) is None
    chain = ops.ScoreChain(None, (1,), torch.float32, torch.float32, visible_formula=product)
    assert tile_tests.visible_tile_test(chain) is None
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(product_of_positions, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    assert testing.column_tile_loops(kernel) == 1 and "for scan_n in range(" not in kernel
    testing.assert_close_to_reference(out, product_of_positions(q.double(), k.double(), v.double()))


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


def window_from_one_arange(q, k, v, width=9):
    """One position vector for both sides: the mask's rows and columns are the same iota, unsqueezed two ways."""
    position = torch.arange(q.shape[-2])
    far = (position[:, None] - position[None, :]).abs() >= width
    scores = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(scores.masked_fill(far, float("-inf")), dim=-1) @ v


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
        (window_from_one_arange, "masked = (((-9 + tl.where((m_lo + (-1 * n_hi)) > 0, (m_lo + (-1 * n_hi)), tl.where((m_hi + (-1 * n_lo)) < 0, -((m_hi + (-1 * n_lo))), 0))) >= 0)) | (n_lo >= N)"),
    ],
    ids=["causal", "sliding-window", "prefix-lm", "empty-rows", "one-arange-window"],
)
def test_position_masks_skip_tiles_and_stay_exact(fn, skip_test):
    """The mask's formula is read from where each position meets the scores, not from the shape the position vector
    was made with: a window built from one ``arange`` used as both rows and columns gave the wrong formula before
    (|n - n| ≥ 9, never masked, so the mask was dropped from every tile), a silent miscompile."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(fn, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check("for scan_n in range(0, N, BLOCK_N * SCAN_TILES)").check(skip_test).check("visible = ").run(kernel)
    assert testing.column_tile_loops(kernel) == 2
    expected = fn(q.double(), k.double(), v.double())
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


def _where_fill(rows_first_kept: int, fill: float, after: float = 1.0, softcap: bool = False):
    """Attention whose mask fills with a finite constant (GPT-2's ``where(causal, w, finfo.min)``): row m keeps the
    keys n <= m - rows_first_kept, so its first ``rows_first_kept`` rows keep none when that is positive."""

    def attention(q, k, v):
        rows = torch.arange(q.shape[-2])[:, None]
        cols = torch.arange(k.shape[-2])[None, :]
        scores = torch.where(cols <= rows - rows_first_kept, q @ k.transpose(-1, -2) * 0.25, fill) * after
        scores = 5.0 * torch.tanh(scores / 5.0) if softcap else scores
        return torch.softmax(scores, dim=-1) @ v

    return attention


@pytest.mark.parametrize(
    "fn",
    [variants.causal_arange_where, variants.gpt2_causal_where, _where_fill(0, torch.finfo(torch.float32).min, after=0.5)],
)
def test_finite_fill_where_every_row_keeps_a_key_is_skipped_like_minus_inf(fn):
    """Every row keeps a key, so the fill (finfo.min, still at most -2^124 after the scale) adds exactly 0 to every
    row's sums: its tiles are skipped and the visible ones run without the mask, as for -inf."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(fn, q, k, v)
    FileCheck().check("for scan_n").check("masked = (((n_lo + (-1 * m_hi)) > 0))").check("visible = ").run(code[0])
    assert testing.column_tile_loops(code[0]) == 2
    expected = fn(q.double(), k.double(), v.double())
    assert not expected.isnan().any()
    testing.assert_close_to_reference(out, expected)


@pytest.mark.parametrize(
    "case, fn",
    [
        ("rows that keep no key", _where_fill(20, torch.finfo(torch.float32).min)),
        ("a fill scaled above -2^124", _where_fill(0, torch.finfo(torch.float32).min, after=1e-30)),
        ("fill -1e4", _where_fill(0, -1e4)),
        ("a soft-cap after the fill", _where_fill(0, torch.finfo(torch.float32).min, softcap=True)),
    ],
)
def test_finite_fill_is_not_skipped_where_it_may_not_absorb(case, fn):
    """Rows that keep no key average V in eager (all their logits equal the fill), and a fill that is not far
    enough below the kept logits (or that a soft-cap maps to -5) weighs in the softmax: no tile may be skipped."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(fn, q, k, v)
    FileCheck().check_not("for scan_n").check("for start_n in range(first_n, end_n, BLOCK_N)").run(code[0])
    expected = fn(q.double(), k.double(), v.double())
    assert not expected.isnan().any()
    testing.assert_close_to_reference(out, expected)


@pytest.mark.parametrize(
    "formula, rows, columns, keeps",
    [
        (sympy.Gt(n, m), 64, 64, True),  # key 0
        (sympy.Or(sympy.Gt(n, m), sympy.Ge(m - n, 7)), 64, 64, True),  # the diagonal
        (sympy.Gt(n, m - 3), 64, 64, False),  # rows 0-2 keep nothing
        (sympy.Lt(n, m), 8, 8, True),  # anti-causal: key N - 1
        (sympy.Ne(n, 5), 4, 8, False),  # only key 5 is kept: not among the witnesses
    ],
)
def test_every_row_keeps_a_key_checks_each_row(formula, rows, columns, keeps):
    assert block_sparsity._every_row_keeps_a_key(formula, rows, columns) is keeps


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


@pytest.mark.parametrize("last_rows_first", [True, False])
def test_row_tiles_launch_last_first(last_rows_first):
    """Program 0 takes the last row tile (the causal mask's longest) when the flag is on, the first when it is off;
    every row tile is still computed once (ragged last tile included), NaN rows as eager."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton(), config.patch(last_rows_first=last_rows_first):
        out, code = testing.compile_and_get_code(shifted_causal_with_empty_rows, q, k, v, fresh_cache=True)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check(f"LAST_ROWS_FIRST : tl.constexpr = {last_rows_first}").check("row_tile = tl.program_id(0)").check(
        "row_tile = tl.num_programs(0) - 1 - row_tile"
    ).check("start_m = row_tile.to(").run(kernel)
    expected = shifted_causal_with_empty_rows(q.double(), k.double(), v.double())
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


@pytest.mark.parametrize("idiom", ["masked_fill", "triu_additive"])
def test_entirely_visible_tiles_run_the_chain_without_its_mask(idiom):
    """The loop over tiles the causal mask leaves entirely visible has no mask math; the loops over the tiles it
    cuts through keep the user's where(..., -inf, ...). An additive ``triu(full(-inf), 1)`` bias is 0 there, so its
    add goes too, and like a masked_fill it lets the 1/√d scale fold into the exp2 factor (no multiply per logit).
    Same result as eager, NaN rows included."""
    fn = variants.CAUSAL.idioms[idiom]
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(fn, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    assert testing.column_tile_loops(kernel) == 2
    visible, partial = testing.split_loop_chains(kernel)
    assert "tl.where(" in partial and "tl.where(" not in visible
    assert " + " not in visible and " * " not in visible and " * " not in partial, (visible, partial)
    FileCheck().check(f"LOGIT_SCALE : tl.constexpr = {math.log2(math.e) / 4}").run(kernel)
    testing.assert_close_to_reference(out, fn(q.double(), k.double(), v.double()))


def causal_bias_of_one_half(q, k, v):
    rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    bias = torch.where(cols > rows, float("-inf"), 0.5)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.5 + bias, dim=-1) @ v


def test_a_bias_that_is_not_zero_where_visible_keeps_its_add_and_scale():
    """``where(cond, -inf, 0.5)`` still skips masked tiles, but adds 0.5 where visible: the add stays in every
    tile's chain and the scale is not folded through it (c·x + 0.5 ≠ c·(x + 0.5))."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(causal_bias_of_one_half, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check(f"LOGIT_SCALE : tl.constexpr = {math.log2(math.e)}").check("for scan_n in range(").run(kernel)
    for chain in testing.split_loop_chains(kernel) if testing.column_tile_loops(kernel) == 2 else [kernel]:
        FileCheck().check(" * ").check(" + ").run(chain)
    testing.assert_close_to_reference(out, causal_bias_of_one_half(q.double(), k.double(), v.double()))


@pytest.mark.parametrize("head_dim, max_head_dim, loops", [(128, 128, 2), (128, 64, 1), (256, 128, 1)])
def test_visible_loop_up_to_the_configured_head_dim(head_dim, max_head_dim, loops):
    """Causal splits off its entirely visible tiles up to ``visible_loop_max_head_dim`` (128 by default: the H100
    measurement), one loop above it; the result is the same either way."""
    q, k, v = (torch.randn(1, 1, 40, head_dim) for _ in range(3))
    with testing.cpu_triton(), config.patch(visible_loop_max_head_dim=max_head_dim):
        out, code = testing.compile_and_get_code(variants.causal_masked_fill, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    assert testing.column_tile_loops(kernel) == loops
    testing.assert_close_to_reference(out, variants.causal_masked_fill(q.double(), k.double(), v.double()))


def test_split_flag_off_keeps_one_loop():
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with testing.cpu_triton(), config.patch(split_visible_tiles=False):
        out, code = testing.compile_and_get_code(variants.causal_masked_fill, q, k, v)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check("for start_n in range(first_n, end_n, BLOCK_N)").check_not("full_lo").run(kernel)
    testing.assert_close_to_reference(out, variants.causal_masked_fill(q.double(), k.double(), v.double()))


def ids_equal(q, k, v, q_ids, k_ids):
    same = q_ids[:, None, :, None] == k_ids[:, None, None, :]
    return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~same, float("-inf")), dim=-1) @ v


def ids_equal_where_kept(q, k, v, q_ids, k_ids):
    same = q_ids[:, None, :, None] == k_ids[:, None, None, :]
    return torch.softmax(torch.where(same, q @ k.transpose(-2, -1), float("-inf")), dim=-1) @ v


def causal_within_documents(q, k, v, q_ids, k_ids):
    rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    keep = (q_ids[:, None, :, None] == k_ids[:, None, None, :]) & (cols <= rows)
    return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")), dim=-1) @ v


def _sorted_ids(batch, length, documents):
    boundaries = torch.sort(torch.randint(1, length, (batch, documents - 1))).values
    return (torch.arange(length)[None, :, None] >= boundaries[:, None, :]).sum(-1)


@pytest.mark.parametrize("fn", [ids_equal, ids_equal_where_kept, causal_within_documents])
@pytest.mark.parametrize("ordering", ["sorted", "shuffled"])
def test_document_ids_get_a_run_time_tile_summary(fn, ordering):
    """Ids read from memory cannot be bounded by a formula: the pre-pass reads them (the row tile's range, each
    column tile's range) and skips column tiles with none of the rows' ids. Exact for any ids, sorted or not, with
    NaN rows where a row keeps nothing, as in eager."""
    q, k, v = (torch.randn(2, 2, 70, 16) for _ in range(3))
    ids = _sorted_ids(2, 70, 4)
    if ordering == "shuffled":
        ids = ids[:, torch.randperm(70)]
    k_ids = ids.clone()
    k_ids[1, :5] = 9  # keys no query has: rows never keep them
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(fn, q, k, v, ids, k_ids)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check("row_id_lo = tl.min(row_ids)").check("for scan_n in range(").check("col_ids = ").check(
        "ids_disjoint = (tl.max(col_ids, 1) < row_id_lo) | (tl.min(col_ids, 1) > row_id_hi)"
    ).check("| ids_disjoint | (n_lo >= N)").check_regex(
        r"for (start_n in range\(first_n, |partial_n in tl.range\(0, partial_before)"
    ).run(kernel)
    expected = fn(q.double(), k.double(), v.double(), ids, k_ids)
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


def test_tiles_of_ids_no_row_has_are_never_read():
    """Keys whose id no query row has sit in tiles the pre-pass skips: poisoned values there (NaN, which any
    visit would spread through P·V, even with P = 0) never reach the output."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    q_ids = torch.zeros(1, 64, dtype=torch.long)
    k_ids = (torch.arange(64) >= 32).long()[None, :]  # keys 32.. (column tiles 2 and 3 at BLOCK_N 16): no row has id 1
    poisoned = v.clone()
    poisoned[:, :, 32:] = float("nan")
    with testing.cpu_triton():
        out, _ = testing.compile_and_get_code(ids_equal, q, k, poisoned, q_ids, k_ids)
    testing.assert_close_to_reference(out, ids_equal(q.double(), k.double(), v.double(), q_ids, k_ids))


def test_float_ids_are_not_summarised():
    """Only integer ids get the summary (a NaN id would defeat the interval test); float ids keep every tile."""
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    ids = _sorted_ids(1, 40, 3).float()
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(ids_equal, q, k, v, ids, ids)
    FileCheck().check_not("row_ids").run("\n".join(testing.triton_kernels(code).values()))
    testing.assert_close_to_reference(out, ids_equal(q.double(), k.double(), v.double(), ids, ids))


@pytest.mark.parametrize("fn", [ids_equal, ids_equal_where_kept])
def test_tiles_inside_one_document_run_the_chain_without_the_mask(fn):
    """A tile whose row and column ids are all one value is entirely kept: with the id-equality mask alone in its
    ``where``, such tiles (contiguous inside a document, for sorted ids) get a loop with no id loads or mask math."""
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    ids = torch.tensor([0] * 40 + [1] * 56)[None, :]  # column tiles 3..5 of 16 lie inside document 1
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(fn, q, k, v, ids, ids)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check("visible = ~masked & ").check("(row_id_lo == row_id_hi) & (tl.min(col_ids, 1) == row_id_lo)").run(kernel)
    visible, partial = testing.split_loop_chains(kernel)
    assert "tl.where(" in partial and "tl.load(" in partial
    assert "tl.where(" not in visible and "tl.load(" not in visible
    testing.assert_close_to_reference(out, fn(q.double(), k.double(), v.double(), ids, ids))


def test_ids_with_another_term_keep_their_mask_in_every_tile():
    """``doc[m] == doc[n] & n <= m``: all ids equal does not make a tile visible; the causal term still skips."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    ids = torch.tensor([0] * 20 + [1] * 44)[None, :]
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(causal_within_documents, q, k, v, ids, ids)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check("masked = (((n_lo + (-1 * m_hi)) > 0)) | ids_disjoint").check_not("visible = ").run(kernel)
    assert testing.column_tile_loops(kernel) == 1
    testing.assert_close_to_reference(out, causal_within_documents(q.double(), k.double(), v.double(), ids, ids))


def keep_masked_fill(q, k, v, keep):
    return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")), dim=-1) @ v


def keep_where(q, k, v, keep):
    return torch.softmax(torch.where(keep, q @ k.transpose(-2, -1), float("-inf")), dim=-1) @ v


def keep_and_causal(q, k, v, keep):
    rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~(keep & (cols <= rows)), float("-inf")), dim=-1) @ v


def _random_blocky_mask(batch, rows, cols):
    """Whole 32×32 blocks kept or dropped at random, a few single elements flipped, and one row with nothing kept."""
    cell = block_sparsity.MASK_TABLE_CELL
    blocks = torch.rand(batch, 1, -(-rows // cell), -(-cols // cell)) < 0.5
    keep = blocks.repeat_interleave(cell, -2).repeat_interleave(cell, -1)[..., :rows, :cols].clone()
    flips = torch.rand(keep.shape) < 0.01
    keep ^= flips
    keep[..., 7, :] = False
    return keep


@pytest.mark.parametrize("fn", [keep_masked_fill, keep_where, keep_and_causal])
@pytest.mark.parametrize("shape", ["causal", "per_batch_random"])
def test_mask_tensor_gets_a_graph_level_tile_table(fn, shape):
    """A boolean mask passed in cannot be bounded by a formula: the graph reduces it once per call (over its own
    batch dims, not the heads it broadcasts over) to a table of 32×32 cell states, and the pre-pass skips tiles all
    of whose cells are masked. Exact, with NaN rows where a row keeps nothing; ragged sizes (100 rows) included."""
    q, k, v = (torch.randn(2, 2, 100, 16) for _ in range(3))
    if shape == "causal":
        keep = torch.ones(100, 100, dtype=torch.bool).tril()
        keep[5] = False
    else:
        keep = _random_blocky_mask(2, 100, 100)
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(fn, q, k, v, keep)
    kernel = next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)
    FileCheck().check("for scan_n in range(").check("for row_cell in tl.static_range(CELLS_M):").check(
        "cell_states = "
    ).check("| (table_lo == 2) | (n_lo >= N)").check_regex(
        r"for (start_n in range\(first_n, |partial_n in tl.range\(0, partial_before)"
    ).run(kernel)
    cells = -(-100 // block_sparsity.MASK_TABLE_CELL)
    assert max(testing.allocated_buffer_numels(code)) <= max(2 * 2 * 100 * 16, keep.shape[0] * cells * cells)
    expected = fn(q.double(), k.double(), v.double(), keep)
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


def test_tiles_a_mask_tensor_drops_are_never_read():
    """Keys no row keeps (columns 64.. of the mask: cell column 2) sit in tiles the table marks entirely masked:
    poisoned values there never reach the output, so the pre-pass really skipped them."""
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    keep = torch.rand(96, 96) < 0.7
    keep[:, 64:] = False
    poisoned = v.clone()
    poisoned[:, :, 64:] = float("nan")
    with testing.cpu_triton():
        out, _ = testing.compile_and_get_code(keep_masked_fill, q, k, poisoned, keep)
    testing.assert_close_to_reference(out, keep_masked_fill(q.double(), k.double(), v.double(), keep))


def test_tiles_a_mask_tensor_keeps_whole_run_the_chain_without_it():
    """Causal keep passed in: tiles whose cells mask nothing get the loop that runs the chain with no mask load."""
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    keep = torch.ones(128, 128, dtype=torch.bool).tril()
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(keep_masked_fill, q, k, v, keep)
    kernel = next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)
    FileCheck().check("visible = ~masked & (((table_hi == 0)))").run(kernel)
    assert testing.column_tile_loops(kernel) == 2
    visible, partial = testing.split_loop_chains(kernel)
    assert "tl.where(" in partial and "tl.load(" in partial
    assert "tl.where(" not in visible and "tl.load(" not in visible
    # The partial loop's tile start, picked from two ranges, is declared a multiple of the tile, as a loop
    # variable's is: the mask's loads along the columns stay vectorised.
    FileCheck().check("for partial_n in tl.range(").check("start_n = tl.where(").check(
        "start_n = tl.multiple_of(start_n, BLOCK_N)").check("offs_n = start_n + tl.arange(0, BLOCK_N)").run(kernel)
    testing.assert_close_to_reference(out, keep_masked_fill(q.double(), k.double(), v.double(), keep))


def test_mask_tensor_table_flag_off_reads_every_tile():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    keep = torch.ones(64, 64, dtype=torch.bool).tril()
    with testing.cpu_triton(), config.patch(mask_tensor_tables=False):
        out, code = testing.compile_and_get_code(keep_masked_fill, q, k, v, keep)
    kernel = "\n".join(testing.triton_kernels(code).values())
    FileCheck().check_not("cell_states").check("first_n, end_n = 0, N").run(kernel)
    testing.assert_close_to_reference(out, keep_masked_fill(q.double(), k.double(), v.double(), keep))


def test_autotuning_table_is_the_table_of_a_causal_mask():
    """Autotuning times the kernel on ``causal_cell_states`` (a random table would skip nothing): it is exactly the
    table the graph computes from a causal mask, ragged edge included."""
    from inductor_overlay.kernel.online_softmax_attention import causal_cell_states

    size, cell = 100, block_sparsity.MASK_TABLE_CELL
    cells = -(-size // cell)
    masked = ~torch.ones(size, size, dtype=torch.bool).tril()
    padded_some = torch.nn.functional.pad(masked, (0, cells * cell - size, 0, cells * cell - size), value=False)
    padded_all = torch.nn.functional.pad(masked, (0, cells * cell - size, 0, cells * cell - size), value=True)
    some = padded_some.view(cells, cell, cells, cell).amax((1, 3))
    every = padded_all.view(cells, cell, cells, cell).amin((1, 3))
    expected = some.to(torch.int8) + every.to(torch.int8)
    assert torch.equal(causal_cell_states([2, cells, cells], [0, cells, 1])[1], expected)


def _reference_cell_states(masked: torch.Tensor) -> torch.Tensor:
    """0 where no element of a 32×32 cell is masked, 2 where all are, else 1; past the edges, elements count as masked
    for "all" and as unmasked for "some"."""
    cell = block_sparsity.MASK_TABLE_CELL
    *lead, rows, cols = masked.shape
    cells = [-(-rows // cell), -(-cols // cell)]
    padding = (0, cells[1] * cell - cols, 0, cells[0] * cell - rows)
    some = torch.nn.functional.pad(masked, padding, value=False).view(*lead, cells[0], cell, cells[1], cell).amax((-3, -1))
    every = torch.nn.functional.pad(masked, padding, value=True).view(*lead, cells[0], cell, cells[1], cell).amin((-3, -1))
    return some.to(torch.int8) + every.to(torch.int8)


@pytest.mark.parametrize("negated", [True, False])
def test_tensor_mask_table_holds_each_cells_state(negated):
    """The graph's table of a mask tensor is each cell's state exactly: ragged edges, cells masked in a single
    element, whole cells kept or dropped, and batch dims of the mask's own."""
    from inductor_overlay.fx_passes import mask_tables

    cell = block_sparsity.MASK_TABLE_CELL
    blocks = torch.rand(2, 1, 4, 3, generator=torch.Generator().manual_seed(0)) < 0.5
    blocks[0, 0, 1, 1], blocks[1, 0, 2, 0] = True, False
    keep = blocks.repeat_interleave(cell, -2).repeat_interleave(cell, -1)[..., :100, :70].clone()
    keep[0, 0, 40, 33] = False  # a cell otherwise whole, masked in one element
    keep[1, 0, 70, 5] = True  # a cell otherwise masked, kept in one element
    term = keep if negated else ~keep
    graph = torch.fx.Graph()
    placeholder = graph.placeholder("term")
    placeholder.meta["val"] = term
    mask = block_sparsity.TensorMask(where=None, term=placeholder, negated=negated, alone=True)
    graph.output(mask_tables._tensor_mask_table(graph, mask))
    table = torch.fx.GraphModule(torch.nn.Module(), graph)(term)
    assert table.dtype == torch.int8
    assert torch.equal(table, _reference_cell_states(~keep))
    assert set(table.unique().tolist()) == {0, 1, 2}


def key_padding_masked_fill(q, k, v, key_kept):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~key_kept[:, None, None, :], float("-inf")), dim=-1) @ v


def test_key_padding_mask_gets_one_row_of_cells():
    """A key-padding mask ``[B, N]`` broadcast over heads and rows (fairseq's idiom) is summarised into one row of
    cells per batch entry, read by every row tile: tiles of padded keys are skipped (poisoned values there never
    reach the output), tiles with no padding run without the mask, and a batch entry with no key kept gives NaN
    rows, as eager does. Ragged sizes (N 100)."""
    q, k, v = (torch.randn(3, 2, 70, 16) for _ in range(3))
    k, v = (torch.randn(3, 2, 100, 16) for _ in range(2))
    lengths = torch.tensor([40, 100, 0])
    key_kept = torch.arange(100)[None, :] < lengths[:, None]
    poisoned = v.clone()
    poisoned[0, :, 64:] = float("nan")
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(key_padding_masked_fill, q, k, poisoned, key_kept)
    kernel = next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)
    FileCheck().check("cell_states = ").check("| (table_lo == 2) | (n_lo >= N)").check(
        "visible = ~masked & (((table_hi == 0)))"
    ).run(kernel)
    assert testing.column_tile_loops(kernel) == 2
    cells = -(-100 // block_sparsity.MASK_TABLE_CELL)
    assert max(testing.allocated_buffer_numels(code)) <= max(3 * 2 * 70 * 16, 3 * cells)
    expected = key_padding_masked_fill(q.double(), k.double(), v.double(), key_kept)
    assert torch.equal(out.isnan(), expected.isnan()) and out[2].isnan().all()
    testing.assert_close_to_reference(out, expected)


def test_additive_finfo_min_key_padding_gets_a_table():
    """HF's key padding, ``scores + (1 - mask) * finfo.min`` broadcast over heads and rows, gets a table too: tiles of
    padded keys are skipped (poisoned values there never reach the output), tiles with no padding run without the
    bias. A batch entry with no key kept has no absorbing cell: it gets the mean of V, as eager does, not NaN.
    The default SDPA policy leaves this masked pattern to the overlay."""
    q = torch.randn(3, 2, 70, 16)
    k, v = (torch.randn(3, 2, 100, 16) for _ in range(2))
    attention_mask = (torch.arange(100)[None, :] < torch.tensor([40, 100, 0])[:, None]).long()
    poisoned = v.clone()
    poisoned[0, :, 64:] = float("nan")
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(variants.key_padding_finfo_min, q, k, poisoned, attention_mask)
    kernel = next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)
    FileCheck().check("cell_states = ").check("| (table_lo == 2) | (n_lo >= N)").check(
        "visible = ~masked & (((table_hi == 0)))"
    ).run(kernel)
    assert testing.column_tile_loops(kernel) == 2
    assert len(testing.triton_kernels(code)) <= 3  # the table's reductions and the attention kernel
    expected = variants.key_padding_finfo_min(q.double(), k.double(), v.double(), attention_mask)
    assert not out.isnan().any() and not expected.isnan().any()
    testing.assert_close_to_reference(out, expected)
    testing.assert_close_to_reference(out[2], v[2].double().mean(-2, keepdim=True).expand_as(out[2]))


def finfo_min_fill(q, k, v, keep):
    """A boolean mask filled with ``finfo.min`` (Hugging Face's GPT-2 and BART idiom), softmax in float32."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    lowest = torch.full([], torch.finfo(scores.dtype).min, dtype=scores.dtype)
    return torch.softmax(torch.where(keep, scores, lowest), dim=-1) @ v


@pytest.mark.parametrize("case", ["key_padding", "window"])
def test_a_finite_fill_skips_only_cells_whose_rows_keep_a_key(case):
    """A mask tensor filled with ``finfo.min`` gets a table: tiles it masks entirely are skipped (poisoned values
    there never reach the output) where every row of the tile keeps a key; a row that keeps none (a batch entry
    with every key padded; a window's row 40 emptied) gets the mean of V over every key, as in eager."""
    q = torch.randn(3, 2, 70, 16)
    k, v = (torch.randn(3, 2, 100, 16) for _ in range(2))
    poisoned = v.clone()
    if case == "key_padding":
        keep = (torch.arange(100)[None, :] < torch.tensor([40, 100, 0])[:, None])[:, None, None, :]
        poisoned[0, :, 64:] = float("nan")
    else:
        rows, columns = torch.arange(70)[:, None], torch.arange(100)[None, :]
        keep = ((columns <= rows) & (rows - columns < 8)).expand(3, 1, 70, 100).clone()
        keep[2, :, 40] = False
        poisoned[:2, :, 96:] = float("nan")
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(finfo_min_fill, q, k, poisoned, keep)
    kernel = next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)
    FileCheck().check("cell_states = ").check("| (table_lo == 2) | (n_lo >= N)").run(kernel)
    expected = finfo_min_fill(q.double(), k.double(), v.double(), keep)
    assert not out.isnan().any() and not expected.isnan().any()
    testing.assert_close_to_reference(out, expected)
    mean = v[2].double().mean(-2)  # [H, D]
    if case == "key_padding":
        testing.assert_close_to_reference(out[2], mean[:, None, :].expand_as(out[2]))
    else:
        testing.assert_close_to_reference(out[2, :, 40], mean)


def test_a_finite_fill_trains_on_its_table():
    """In training the backward reads the same table: a window's mask tensor filled with ``finfo.min``, one row of
    one batch entry keeping no key; output and gradients are float64 eager's, the backward skipping the table's
    all-masked tiles too."""
    from test.test_training import train_calls

    rows, columns = torch.arange(70)[:, None], torch.arange(70)[None, :]
    keep = ((columns <= rows) & (rows - columns < 8)).expand(2, 1, 70, 70).clone()
    keep[1, :, 40] = False
    args = tuple(torch.randn(2, 2, 70, 16).requires_grad_() for _ in range(3))
    code = train_calls(lambda q, k, v: finfo_min_fill(q, k, v, keep), args, 1, causal_tensor_route=False)
    (backward,) = [text for text in testing.triton_kernels(code).values() if "grad_scores" in text]
    FileCheck().check("cell_states = ").run(backward)


def alpha_position_mask(q, k, v):
    rows, columns = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    scores = q @ k.transpose(-2, -1) / 4.0
    return torch.softmax(torch.where(torch.sub(columns, rows, alpha=2) > 0, float("-inf"), scores), dim=-1) @ v


def alpha_negated_bias(q, k, v):
    rows, columns = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    bias = torch.where(columns > rows, float("-inf"), 0.0)
    return torch.softmax(torch.add(q @ k.transpose(-2, -1) / 4.0, bias, alpha=-1), dim=-1) @ v


@pytest.mark.parametrize("fn", [alpha_position_mask, alpha_negated_bias])
def test_an_add_or_sub_with_alpha_is_not_read_as_a_plain_sum(fn):
    """``sub(n, m, alpha=2)`` is n − 2m, not the causal n − m; a -inf bias added with ``alpha=-1`` is +inf (NaN
    rows, as in eager): neither is a mask the kernel may skip by."""
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    with testing.cpu_triton():
        out, _ = testing.compile_and_get_code(fn, q, k, v)
    expected = fn(q.double(), k.double(), v.double())
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)


def _bias_then_softcap(q, k, v, attention_mask):
    bias = (1.0 - attention_mask[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(30 * torch.tanh((q @ k.transpose(-1, -2) + bias) / 30), dim=-1) @ v


def test_additive_mask_under_a_softcap_is_read_per_element():
    """No table where an absorbing bias is not enough to drop a tile: a soft-cap after it maps finfo.min to -30.
    One kernel, every tile visited, results as eager."""
    q, k, v = (torch.randn(2, 2, 70, 16) for _ in range(3))
    attention_mask = (torch.arange(70)[None, :] < torch.tensor([30, 70])[:, None]).long()
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        out, code = testing.compile_and_get_code(_bias_then_softcap, q, k, v, attention_mask)
    kernels = testing.triton_kernels(code)
    assert len(kernels) == 1
    kernel = next(iter(kernels.values()))
    FileCheck().check_not("cell_states").run(kernel)
    assert testing.column_tile_loops(kernel) == 1
    testing.assert_close_to_reference(out, _bias_then_softcap(q.double(), k.double(), v.double(), attention_mask))


def _softcap_then_bias(q, k, v, attention_mask):
    bias = (1.0 - attention_mask[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return torch.softmax(30 * torch.tanh(q @ k.transpose(-1, -2) / 30) + bias, dim=-1) @ v


def test_additive_mask_after_a_softcap_gets_a_table():
    """Gemma-2's order, a soft-cap and then the padding mask: the tanh bounds the logits before the bias, so an
    absorbing bias drops its tiles (poisoned values there never reach the output); a batch entry with no key kept
    gets the mean of V, as in eager."""
    q, k, v = (torch.randn(3, 2, 70, 16) for _ in range(3))
    k, v = (torch.randn(3, 2, 100, 16) for _ in range(2))
    attention_mask = (torch.arange(100)[None, :] < torch.tensor([40, 100, 0])[:, None]).long()
    poisoned = v.clone()
    poisoned[0, :, 64:] = float("nan")
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        out, code = testing.compile_and_get_code(_softcap_then_bias, q, k, poisoned, attention_mask)
    kernel = next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)
    FileCheck().check("cell_states = ").check("| (table_lo == 2) | (n_lo >= N)").run(kernel)
    expected = _softcap_then_bias(q.double(), k.double(), v.double(), attention_mask)
    assert not out.isnan().any() and not expected.isnan().any()
    testing.assert_close_to_reference(out, expected)
    testing.assert_close_to_reference(out[2], v[2].double().mean(-2, keepdim=True).expand_as(out[2]))


def _hf_eager_attention(q, k, v, attention_mask_4d):
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + attention_mask_4d
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def test_hf_four_dim_additive_mask_gets_a_table():
    """HF's eager attention adds a ``[B, 1, M, N]`` float mask, finfo.min above the diagonal and at padded keys,
    shared by the heads: it is summarised per call into cells. Tiles above the diagonal are skipped (poisoned values
    there never reach the rows before them), and the left-padded rows, masked throughout, get the mean of V as in
    eager. The default SDPA policy leaves this masked pattern to the overlay."""
    q, k, v = (torch.randn(2, 2, 100, 16) for _ in range(3))
    position = torch.arange(100)
    keep = (position[None, :] <= position[:, None]) & (position[None, None, :] >= torch.tensor([0, 20])[:, None, None])
    mask = torch.zeros(2, 1, 100, 100).masked_fill(~keep[:, None], torch.finfo(torch.float32).min)
    poisoned = v.clone()
    poisoned[0, :, 64:] = float("nan")
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(_hf_eager_attention, q, k, poisoned, mask)
    kernel = next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)
    FileCheck().check("cell_states = ").check("| (table_lo == 2) | (n_lo >= N)").run(kernel)
    FileCheck().check("BATCH_FASTEST : tl.constexpr = 0").run(kernel)  # the mask differs per batch entry
    assert testing.column_tile_loops(kernel) == 2
    expected = _hf_eager_attention(q.double(), k.double(), v.double(), mask.double())
    testing.assert_close_to_reference(out[0, :, :64], expected[0, :, :64])
    testing.assert_close_to_reference(out[1], expected[1])
    testing.assert_close_to_reference(out[1, :, :20], v[1].double().mean(-2, keepdim=True).expand(2, 20, 16))


def test_hf_decoder_mask_computed_in_the_graph_gets_the_table_kernel():
    """HF's decoder mask built inside the compiled graph from a ``[B, N]`` padding vector: the table kernel computes
    the bias tile by tile from the vector, as the attention kernel does, so no M×N tensor is ever written. Padded
    keys (poisoned) are skipped; left-padded rows, masked throughout, get the mean of V as in eager."""
    q, k, v = (torch.randn(2, 2, 100, 16) for _ in range(3))
    attention_mask = torch.ones(2, 100, dtype=torch.long)
    attention_mask[0, 60:] = 0
    attention_mask[1, :20] = 0
    poisoned = v.clone()
    poisoned[0, :, 64:] = float("nan")
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(variants.hf_causal_padding_4d, q, k, poisoned, attention_mask)
    kernels = testing.triton_kernels(code)
    assert len(kernels) == 2
    table = next(text for text in kernels.values() if "ROW_CELL_MAX" in text)
    FileCheck().check("tl.load(in_ptr").check("row_cell_max = tl.max(").check("tl.store(ROW_CELL_MAX").run(table)
    attention = next(text for text in kernels.values() if "for start_n in range(" in text)
    FileCheck().check("cell_states = ").check("| (table_lo == 2) | (n_lo >= N)").run(attention)
    buffers = testing.allocated_buffer_numels(code)
    buffers.remove(out.numel())
    assert max(buffers) <= 2 * 4 * 32 * 4 < 100 * 100  # the table's scratch: one value per row and cell
    expected = variants.hf_causal_padding_4d(q, k, v, attention_mask)  # float32: float64 would make those rows NaN
    testing.assert_close_to_reference(out, expected)
    testing.assert_close_to_reference(out[1, :, :20], v[1].double().mean(-2, keepdim=True).expand(2, 20, 16))


def test_per_head_bias_gets_no_table():
    """A bias of its own per head (``[H, M, N]``) is read per element, not summarised: a table would cost a full
    extra read of it for cells that rarely skip. One kernel, which launches the batch entries of a head side by side
    (they share the bias tiles in L2)."""
    q, k, v = (torch.randn(3, 2, 40, 16) for _ in range(3))
    bias = torch.randn(2, 40, 40)
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(variants.per_head_bias, q, k, v, bias)
    kernels = testing.triton_kernels(code)
    assert len(kernels) == 1
    FileCheck().check("BATCH_FASTEST : tl.constexpr = 3").check("if BATCH_FASTEST > 1:").check(
        "out_z = (out_z % BATCH_FASTEST) * (tl.num_programs(1) // BATCH_FASTEST) + out_z // BATCH_FASTEST"
    ).run(next(iter(kernels.values())))
    testing.assert_close_to_reference(out, variants.per_head_bias(q.double(), k.double(), v.double(), bias.double()))


@pytest.mark.parametrize("bias_shape,table", [((2, 1, 40), False), ((1, 2, 1, 40), False), ((3, 2, 1, 40), True),
                                              ((3, 1, 1, 40), True)],
                         ids=["heads-only", "heads-only-4d", "entries-and-heads", "key-padding"])
def test_a_position_bias_broadcast_over_rows_gets_no_table(bias_shape, table):
    """A float bias ``[.., 1, N]`` that differs between heads and not between batch entries (ALiBi's ``[H, 1, N]``)
    is a position bias: no table (its cells would all be partial), one kernel whose tiles are all visited and which
    reads the bias per tile (keys it masks included). One that differs between batch entries (padding) keeps its
    table."""
    q, k, v = (torch.randn(3, 2, 40, 16) for _ in range(3))
    bias = torch.randn(bias_shape)
    bias[..., 5:9] = float("-inf")

    def program(q, k, v, bias):
        return torch.softmax((q @ k.transpose(-2, -1) * 0.25).float() + bias, dim=-1) @ v

    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(program, q, k, v, bias)
    kernels = testing.triton_kernels(code)
    fused = "\n".join(source for name, source in kernels.items() if "tem_fused" in name)
    if table:
        assert len(kernels) > 1
        FileCheck().check("cell_states").check("for start_n in range(full_lo, full_hi, BLOCK_N):").run(fused)
    else:
        assert len(kernels) == 1
        FileCheck().check_not("cell_states").check("first_n, end_n = 0, N").check("tl.load(in_ptr3 +").run(fused)
    testing.assert_close_to_reference(out, program(q.double(), k.double(), v.double(), bias.double()))


def test_rows_of_finfo_min_logits_get_the_mean_of_v():
    """A row whose logits all sit at finfo.min (a batch entry padded throughout, no table to tell) must not overflow
    to -inf when the kernel scales it to the log2 domain: eager gives it the mean of V. Kernels whose logits cannot
    come near -FLT_MAX (causal by position) keep their running max in the log2 domain."""
    q = torch.randn(2, 2, 40, 16)
    k, v = (torch.randn(2, 2, 50, 16) for _ in range(2))
    attention_mask = (torch.arange(50)[None, :] < torch.tensor([50, 0])[:, None]).long()
    with testing.cpu_triton(), config.patch(mask_tensor_tables=False):
        out, code = testing.compile_and_get_code(variants.key_padding_finfo_min, q, k, v, attention_mask)
        _, causal_code = testing.compile_and_get_code(variants.causal_masked_fill, q, q, v[:, :, :40])
    kernel = next(iter(testing.triton_kernels(code).values()))
    FileCheck().check("m_new = tl.maximum(m_i, tl.max(logits, 1))").check(
        "row_scale = tl.where(tl.abs(m_known * LOGIT_SCALE) < 1073741824.0, LOGIT_SCALE, TINY_LOGIT_SCALE)"
    ).check("p = tl.exp2(logits * row_scale[:, None] - (m_known * row_scale)[:, None])").run(kernel)
    causal_kernel = next(iter(testing.triton_kernels(causal_code).values()))
    FileCheck().check("p = tl.exp2(logits * LOGIT_SCALE - m_shift[:, None])").check_not("row_scale").run(causal_kernel)
    expected = variants.key_padding_finfo_min(q.double(), k.double(), v.double(), attention_mask)
    testing.assert_close_to_reference(out, expected)
    testing.assert_close_to_reference(out[1], v[1].double().mean(-2, keepdim=True).expand_as(out[1]))


def test_layers_sharing_a_mask_share_its_table():
    """Two attentions of one graph over the same padding mask (two layers of a model compiled whole) read one table:
    the table's kernels appear once, beside the two attention kernels."""

    def two_layers(q, k, v, attention_mask):
        first = variants.key_padding_finfo_min(q, k, v, attention_mask)
        return variants.key_padding_finfo_min(first, k, v, attention_mask)

    q, k, v = (torch.randn(2, 2, 70, 16) for _ in range(3))
    attention_mask = (torch.arange(70)[None, :] < torch.tensor([30, 70])[:, None]).long()
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(two_layers, q, k, v, attention_mask)
    kernels = testing.triton_kernels(code)
    attention = [name for name, text in kernels.items() if "for start_n in range(" in text]
    assert len(attention) == 2 and all("cell_states" in kernels[name] for name in attention)
    assert len(kernels) - len(attention) <= 2  # one table: its row-of-cells reductions
    testing.assert_close_to_reference(out, two_layers(q.double(), k.double(), v.double(), attention_mask))


def causal_bias_read_by_a_mask(q, k, v, keep):
    """A -inf ``where`` that fills a bias, not a score: the mask ``bias > 0`` reads it and masks nothing."""
    bias = torch.where(keep, torch.zeros((), dtype=q.dtype), float("-inf"))
    scores = q @ k.transpose(-2, -1) / 4.0
    return torch.softmax(scores.masked_fill(bias > 0, float("-inf")), dim=-1) @ v


def causal_factor(q, k, v, keep):
    """A -inf ``where`` that multiplies the scores (NaN or +inf logits above the diagonal), not a mask of them."""
    factor = torch.where(keep, torch.full((), 0.25, dtype=q.dtype), float("-inf"))
    return torch.softmax((q @ k.transpose(-2, -1)) * factor, dim=-1) @ v


def negated_after_mask(q, k, v, keep):
    """The masked scores negated: -inf becomes +inf (NaN rows in eager), not a mask."""
    return torch.softmax(-(q @ k.transpose(-2, -1) / 4.0).masked_fill(~keep, float("-inf")), dim=-1) @ v


def capped_after_mask(q, k, v, keep):
    """A soft-cap after the mask: tanh(-inf) = -1, a logit of -1, weighed like any other."""
    masked = (q @ k.transpose(-2, -1) / 4.0).masked_fill(~keep, float("-inf"))
    return torch.softmax(torch.tanh(masked), dim=-1) @ v


@pytest.mark.parametrize("fn", [causal_bias_read_by_a_mask, causal_factor, negated_after_mask, capped_after_mask])
def test_a_minus_inf_fill_of_another_value_skips_no_tile(fn):
    """A ``where`` masks only when its -inf stands in for a score and reaches the logits as -inf
    (``block_sparsity.fills_a_score``): skipping the tiles of these fills' positions changed the result (every tile
    above the diagonal counts here)."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    args = (q, k, v, torch.ones(64, 64, dtype=torch.bool).tril())
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        out, code = testing.compile_and_get_code(fn, *args)
    assert torch._dynamo.utils.counters["inductor"]["flashlight_attention_fused"] == 1
    expected = fn(*(a.double() if a.is_floating_point() else a for a in args))
    assert torch.equal(out.isnan(), expected.isnan())
    testing.assert_close_to_reference(out, expected)
