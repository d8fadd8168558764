"""Triton tests over a tile, rendered from the fused node's data: which tiles a mask leaves entirely masked or entirely
visible, and over which blocks an additive mask holds the same bias on every row.

The FX pass decides what a mask is (``fx_passes/block_sparsity.py``): a formula over the position symbols
``ops.ROW`` and ``ops.COL`` derived from the user's own mask expression, and flags for masks no formula bounds (an
id-equality mask, a mask table). This module renders them as Triton expressions over the kernels' own names: a tile's
row range [m_lo, m_hi] and column range [n_lo, n_hi], the pre-pass's id range [row_id_lo, row_id_hi] and column ids,
and its cell states. A formula's test is interval arithmetic over the tile, sound but not complete: a tile it calls
entirely masked is, but it may miss some. A formula it cannot bound gives no test (the kernel visits every tile).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import sympy

from inductor_overlay.ops import COL, COL_READ, ROW, ROW_READ, SCALAR_READS

# Over the row tile's id range [row_id_lo, row_id_hi] and the column ids of SCAN_TILES tiles ([SCAN_TILES, BLOCK_N]).
IDS_ALL_EQUAL = "((row_id_lo == row_id_hi) & (tl.min(col_ids, 1) == row_id_lo) & (tl.max(col_ids, 1) == row_id_lo))"
# The same where a program owns columns and scans row tiles (the backward's dK and dV programs).
IDS_ALL_EQUAL_ROWS_SCANNED = "((col_id_lo == col_id_hi) & (tl.min(row_ids, 1) == col_id_lo) & (tl.max(row_ids, 1) == col_id_lo))"

# Over the states of the cells of SCAN_TILES tiles (the pre-pass's ``table_hi``): no cell masks any element.
TABLE_CELLS_UNMASKED = "(table_hi == 0)"


class Unbounded(Exception):
    """The formula has a term that interval arithmetic over a tile does not bound."""


class _Interval:
    """Triton source for the lower and upper bound of an integer expression over a tile."""

    def __init__(self, lo: str, hi: str) -> None:
        self.lo, self.hi = lo, hi


def _interval(expr: sympy.Expr, bounds: dict) -> _Interval:
    if expr in bounds:
        return bounds[expr]
    if expr.is_Integer:
        return _Interval(str(int(expr)), str(int(expr)))
    if isinstance(expr, sympy.Add):
        parts = [_interval(a, bounds) for a in expr.args]
        return _Interval("(" + " + ".join(p.lo for p in parts) + ")", "(" + " + ".join(p.hi for p in parts) + ")")
    if isinstance(expr, sympy.Mul) and len(expr.args) == 2 and expr.args[0].is_Integer:
        factor, inner = int(expr.args[0]), _interval(expr.args[1], bounds)
        lo, hi = f"({factor} * {inner.lo})", f"({factor} * {inner.hi})"
        return _Interval(lo, hi) if factor >= 0 else _Interval(hi, lo)
    if isinstance(expr, sympy.floor) and isinstance(expr.args[0], sympy.Mul):
        numerator, denominator = expr.args[0].as_numer_denom()
        if denominator.is_Integer and int(denominator) > 0:
            inner, divide = _interval(numerator, bounds), _floor_division(numerator.is_nonnegative)
            return _Interval(divide(inner.lo, int(denominator)), divide(inner.hi, int(denominator)))
    if isinstance(expr, sympy.Abs):
        inner = _interval(expr.args[0], bounds)
        lo = f"tl.where({inner.lo} > 0, {inner.lo}, tl.where({inner.hi} < 0, -({inner.hi}), 0))"
        return _Interval(lo, f"tl.maximum(-({inner.lo}), {inner.hi})")
    raise Unbounded(expr)


def _floor_division(nonnegative: bool):
    """Triton source for ⌊x / d⌋ (d > 0): Triton's integer ``//`` rounds toward zero, which is the floor only for
    x ≥ 0 (positions m and n with nonnegative factors); otherwise one less where x is negative and not a multiple."""
    if nonnegative:
        return lambda x, d: f"({x} // {d})"
    return lambda x, d: f"tl.where(({x}) % {d} < 0, ({x}) // {d} - 1, ({x}) // {d})"


def _always(formula: sympy.Boolean, bounds: dict) -> tuple[str, str]:
    """Triton source for (formula holds on every element of the tile, formula holds on none)."""
    if formula is sympy.true:
        return "True", "False"
    if formula is sympy.false:
        return "False", "True"
    if isinstance(formula, sympy.Not):
        everywhere, nowhere = _always(formula.args[0], bounds)
        return nowhere, everywhere
    if isinstance(formula, (sympy.And, sympy.Or)):
        parts = [_always(a, bounds) for a in formula.args]
        if isinstance(formula, sympy.And):
            return "(" + " & ".join(p[0] for p in parts) + ")", "(" + " | ".join(p[1] for p in parts) + ")"
        # An Or holds everywhere if one of its parts does (sound, not complete); nowhere if every part holds nowhere.
        return "(" + " | ".join(p[0] for p in parts) + ")", "(" + " & ".join(p[1] for p in parts) + ")"
    if isinstance(formula, sympy.core.relational.Relational):
        difference = _interval(formula.lhs - formula.rhs, bounds)  # lhs - rhs over the tile
        lo, hi = difference.lo, difference.hi
        rules = {
            sympy.LessThan: (f"({hi} <= 0)", f"({lo} > 0)"),
            sympy.StrictLessThan: (f"({hi} < 0)", f"({lo} >= 0)"),
            sympy.GreaterThan: (f"({lo} >= 0)", f"({hi} < 0)"),
            sympy.StrictGreaterThan: (f"({lo} > 0)", f"({hi} <= 0)"),
            sympy.Equality: (f"(({lo} == 0) & ({hi} == 0))", f"(({lo} > 0) | ({hi} < 0))"),
            sympy.Unequality: (f"(({lo} > 0) | ({hi} < 0))", f"(({lo} == 0) & ({hi} == 0))"),
        }
        return rules[type(formula)]
    raise Unbounded(formula)


# The kernels' names for the bounds of each position over a tile: its rows and columns, and the values of the
# vectors read at them (the pre-pass's ``row_pos`` and ``col_pos``).
_BOUNDS = {
    ROW: _Interval("m_lo", "m_hi"),
    COL: _Interval("n_lo", "n_hi"),
    ROW_READ: _Interval("row_pos_lo", "row_pos_hi"),
    COL_READ: _Interval("col_pos_lo", "col_pos_hi"),
    **{symbol: _Interval(f"scalar_read_{i}", f"scalar_read_{i}") for i, symbol in enumerate(SCALAR_READS)},
}


def _tile_codes(formula: Optional[sympy.Boolean]) -> tuple[Optional[str], Optional[str]]:
    """(formula holds on every element of the tile [m_lo, m_hi] × [n_lo, n_hi], holds on none), or Nones."""
    if formula is None:
        return None, None
    bounds = _BOUNDS
    try:
        return _always(formula, bounds)
    except Unbounded:
        return None, None


def masked_tile_test(formula: Optional[sympy.Boolean], reads_vectors: bool = True) -> Optional[str]:
    """The test that every element of a tile is masked, for ``formula``: where the chain sets a logit to -inf.
    Without ``reads_vectors`` (a kernel with no pre-pass over position vectors), the formula's terms that read them
    are left out: the test then skips fewer tiles."""
    if not reads_vectors:
        formula = _without_reads(formula)
    return _tile_codes(formula)[0]


def _without_reads(formula: Optional[sympy.Boolean]) -> Optional[sympy.Boolean]:
    """The terms of an Or of masked conditions that read no position vector or scalar (where each holds, the Or
    does)."""
    reads = {ROW_READ, COL_READ, *SCALAR_READS}
    if formula is None or not formula.free_symbols & reads:
        return formula
    terms = [t for t in sympy.Or.make_args(formula) if not t.free_symbols & reads]
    return sympy.Or(*terms) if terms else None


def visible_tile_test(chain: Any, rows_scanned: bool = False) -> Optional[str]:
    """The test that none of the masks the chain's unmasked form dropped (``ops.ScoreChain``) masks any element of
    a tile: position masks by their formula, an id-equality mask when all the tile's ids are one value, the mask a
    table summarises when no cell of the tile masks anything. None: no tile is known visible (a formula that cannot
    be bounded), so the tiles have no loop of their own. ``rows_scanned``: for a program that owns a column tile and
    scans row tiles."""
    parts = []
    if chain.visible_formula is not None:
        parts.append(_tile_codes(chain.visible_formula)[1])
    if chain.drops_id_mask:
        parts.append(IDS_ALL_EQUAL_ROWS_SCANNED if rows_scanned else IDS_ALL_EQUAL)
    if chain.drops_table_mask:
        parts.append(TABLE_CELLS_UNMASKED)
    if not parts or None in parts:
        return None
    return " & ".join(f"({part})" for part in parts)


def row_invariant_test(formulas: Optional[Sequence[sympy.Boolean]]) -> Optional[str]:
    """The test that each formula is constant over a block [m_lo, m_hi] × [n_lo, n_hi] (so the value they describe
    is the same on every row of the block); None if a formula cannot be bounded."""
    if formulas is None:
        return None
    parts = [_tile_codes(formula) for formula in formulas]
    if any(everywhere is None for everywhere, _ in parts):
        return None
    return " & ".join(f"({everywhere} | {nowhere})" for everywhere, nowhere in parts) or "True"
