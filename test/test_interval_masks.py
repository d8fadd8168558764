"""Boolean mask tensors whose rows each keep one interval of columns (``mask_tables.interval_rows``): the kernel
tests each column against its row's interval instead of loading the mask, where a check once per call says every
row is such an interval, and runs the chain that reads the mask where it is not."""

import re

import pytest
import torch
from torch.testing import FileCheck

from flashlight import testing
from inductor_overlay import config
from test.test_training import assert_fused_training, assert_matches_eager, train_on_cpu


def keep_masked_fill(q, k, v, keep):
    return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")), dim=-1) @ v


def window(rows: int, columns: int, size: int) -> torch.Tensor:
    m, n = torch.arange(rows)[:, None], torch.arange(columns)[None, :]
    return (n <= m) & (m - n < size)


def _attention_kernel(code) -> str:
    return next(text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text)


def _column_reads(chain: str) -> list[str]:
    """The loads in a chain's code whose index is computed from the column position ``fl_n``."""
    columns = set()
    for name, value in re.findall(r"(tmp\d+) = (.*)", chain):
        if value.strip() == "(fl_n)" or any(re.search(rf"\b{c}\b", value) for c in columns) and "tl.load" not in value:
            columns.add(name)
    return [value for _, value in re.findall(r"(tmp\d+) = (tl\.load\(.*)", chain) if any(re.search(rf"\b{c}\b", value) for c in columns)]


def _compiled(fn, *args, **overlay):
    with testing.cpu_triton(), config.patch(**overlay):
        return testing.compile_and_get_code(fn, *args)


def test_a_window_mask_passed_in_is_tested_against_row_intervals():
    """The partial tiles compare the column with two per-row vectors and load no element of the mask; the loop after
    the check (a mask that is not intervals, a row that keeps nothing) reads it. Mask [2, 1, 96, 80] (ragged tiles,
    more rows than columns), one batch entry's window wider than the other's."""
    q, k, v = torch.randn(2, 3, 96, 16), torch.randn(2, 3, 80, 16), torch.randn(2, 3, 80, 16)
    keep = torch.stack([window(96, 80, 17), window(96, 80, 40)])[:, None]
    out, code = _compiled(keep_masked_fill, q, k, v, keep)
    kernel = _attention_kernel(code)
    FileCheck().check("positions_affine = ").check("if positions_affine:").check("for partial_n in tl.range(").check(
        "if tl.max(speculation_failed").run(kernel)
    assert testing.column_tile_loops(kernel) == 3
    # The pre-pass: under the flag the rows' intervals bound the tiles, otherwise the table's cells do.
    FileCheck().check("if positions_affine:").check("row_first = ").check("row_last = ").check(
        "first_n = (tl.min(tl.where(row_in_bounds, row_first, N)) // BLOCK_N) * BLOCK_N"
    ).check("full_lo = ").check("else:").check("for scan_n in range(").check("cell_states = ").check(
        "if positions_affine:"
    ).run(kernel)
    testing.check_gpu_front_end(code)
    _, partial = testing.split_loop_chains(kernel)
    assert " >= " in partial and " <= " in partial and "tl.where(" in partial
    assert _column_reads(partial) == [], _column_reads(partial)
    exact = kernel.split("speculation_failed = ")[1]
    assert len(_column_reads(exact)) == 1  # the mask, read per element after a failed check
    testing.assert_close_to_reference(out, keep_masked_fill(q.double(), k.double(), v.double(), keep))


def test_a_mask_that_is_not_intervals_runs_the_chain_that_reads_it():
    """A window with a key kept far outside it on one row: that row's interval would span every column between, so
    the check fails for the call and the kernel reads the mask (values past the window poisoned in V where the
    mask is false stay out of the output). Rows that keep nothing give NaN, as in eager."""
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    keep = window(96, 96, 8)
    keep[70, 2] = True
    keep[5] = False
    out, code = _compiled(keep_masked_fill, q, k, v, keep)
    assert "if positions_affine:" in _attention_kernel(code)
    expected = keep_masked_fill(q.double(), k.double(), v.double(), keep)
    assert torch.equal(out.isnan(), expected.isnan()) and out[0, :, 5].isnan().all()
    testing.assert_close_to_reference(out, expected)


def test_rows_that_keep_nothing_give_nan_with_interval_masks():
    """An interval mask whose rows past a length keep nothing (first N, last -1): NaN there, as eager gives."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    keep = window(64, 64, 10)
    keep[40:] = False
    out, code = _compiled(keep_masked_fill, q, k, v, keep)
    assert "if positions_affine:" in _attention_kernel(code)
    expected = keep_masked_fill(q.double(), k.double(), v.double(), keep)
    assert torch.equal(out.isnan(), expected.isnan()) and out[0, :, 40:].isnan().all()
    testing.assert_close_to_reference(out, expected)


class SlicedBuffer(torch.nn.Module):
    """GPT-2's form: a causal buffer made once, sliced to the sequence and compared with 0."""

    def __init__(self, longest: int) -> None:
        super().__init__()
        self.register_buffer("bias", torch.ones(longest, longest).tril()[None, None], persistent=False)

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) * 0.25
        length = q.shape[-2]
        mask = self.bias[:, :, :length, :length] == 0
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def test_a_buffer_changed_between_calls_is_checked_again():
    """The check runs per call: a registered buffer changed in place (a stray key that breaks the intervals, then a
    window) gives eager's result each time, from one compiled graph."""
    module = SlicedBuffer(80)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    from torch._inductor.utils import run_and_get_code

    with testing.cpu_triton():
        compiled = torch.compile(module)
        for change in (None, lambda b: b[0, 0, 50, 3].zero_(), lambda b: b.copy_(window(80, 80, 6).float()[None, None])):
            if change is None:
                out, code = run_and_get_code(compiled, q, k, v)
                assert "if positions_affine:" in _attention_kernel(code)
            else:
                with torch.no_grad():
                    change(module.bias)
                out = compiled(q, k, v)
            expected = module(q.double(), k.double(), v.double())
            testing.assert_close_to_reference(out, expected)


def test_switch_off_reads_the_mask_in_every_partial_tile():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    keep = window(64, 64, 10)
    out, code = _compiled(keep_masked_fill, q, k, v, keep, interval_masks=False)
    kernel = _attention_kernel(code)
    assert "positions_affine" not in kernel and testing.column_tile_loops(kernel) == 2
    assert len(_column_reads(testing.split_loop_chains(kernel)[1])) == 1
    testing.assert_close_to_reference(out, keep_masked_fill(q.double(), k.double(), v.double(), keep))


@pytest.mark.parametrize("stray", [False, True])
def test_interval_masks_train_fused(stray):
    """In training the forward tests the intervals and the backward reads the mask: gradients match eager's, for a
    mask of intervals and for one that is not."""
    q, k, v = (torch.randn(2, 2, 48, 16, requires_grad=True) for _ in range(3))
    keep = window(48, 48, 12)
    if stray:
        keep[30, 1] = True
    out, grads, grad, code = train_on_cpu(keep_masked_fill, [q, k, v], {"keep": keep})
    assert "if positions_affine:" in _attention_kernel(code)
    assert_fused_training(code, 2 * 2 * 48 * 48)
    assert_matches_eager(keep_masked_fill, [q, k, v], {"keep": keep}, out, grads, grad)


def test_kept_cells_from_words_match_each_cells_columns():
    """The words' bit counts give each row's first and last kept column per cell of 32 and how many it keeps, as
    reductions over the cell's columns do: random masks and intervals, ragged widths, column 31 (the sign bit)."""
    from inductor_overlay.fx_passes.mask_tables import _kept_in_cells

    generator = torch.Generator().manual_seed(0)
    for trial in range(120):
        columns = int(torch.randint(1, 100, (), generator=generator))
        keep = torch.rand(3, columns, generator=generator) < torch.rand((), generator=generator)
        if trial % 3 == 0:
            first, last = sorted(torch.randint(0, columns, (2,), generator=generator).tolist())
            keep = (torch.arange(columns) >= first) & (torch.arange(columns) <= last)
            keep = keep.expand(3, columns)
        cells = -(-columns // 32)
        padded = torch.nn.functional.pad(keep, (0, cells * 32 - columns)).view(3, cells, 32)
        offsets = torch.arange(32)
        expected = (
            torch.where(padded, offsets, 32).amin(-1), torch.where(padded, offsets, -1).amax(-1), padded.sum(-1),
        )
        for got, want in zip(_kept_in_cells(keep), expected, strict=True):
            assert torch.equal(got.long(), want), (trial, got, want)
