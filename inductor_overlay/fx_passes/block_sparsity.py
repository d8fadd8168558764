"""Derive, from the user's own mask expression, which (row tile, column tile) blocks are entirely masked.

A score chain often contains ``where(cond, -inf, x)`` (``masked_fill``) where ``cond`` depends only on the
positions m and n (causal, sliding window, prefix-LM, block-causal ...). This module turns such a ``cond`` into a
sympy formula over the position symbols ``ops.ROW`` and ``ops.COL``; the fused node carries it, and the kernel
(``kernel/tile_tests.py``) renders from it the Triton test that decides, by interval arithmetic over a tile's row
and column ranges, whether ``cond`` holds for every element of the tile. Such a tile contributes exp(-inf) = 0 to
every sum: the kernel can skip it exactly. That holds only for a ``where`` whose -inf stands in for a score (the
value it keeps is computed from the scores, or it is a bias every use adds to them) and reaches the logits as -inf
(``fills_a_score``): one that fills another value (a bias a condition reads, a factor), or whose -inf a later op
turns into something else (a negation, a tanh), masks nothing by itself. A fully
masked row then gets 0/0 = NaN, exactly as eager does. A finite fill (GPT-2's ``finfo.min``) counts as -inf only
where it provably absorbs (``absorbing_fill_masks``): every row keeps a key and the fill lies far enough below; eager
gives a row that keeps no key the mean of V, so other finite fills (-1e4) stay per-element only.

Anything the analysis does not understand (tensor loads, scores, unknown ops) makes the mask "unknown", and the
kernel simply visits every tile; so does a formula the kernel's interval arithmetic does not bound.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Optional

import sympy
import torch

from inductor_overlay.ops import COL, COL_READ, ROW, ROW_READ, SCALAR_READS, TABLE_CELL

aten = torch.ops.aten
prims = torch.ops.prims


class Unknown(Exception):
    """The expression is not a function of positions the analysis can bound."""


def _shape(node: torch.fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _size_one_dims_map(source: tuple, target: tuple) -> Optional[list[int]]:
    """For a view that only inserts or removes size-1 dims: the source dim of each target dim of size > 1."""
    source_dims = [i for i, size in enumerate(source) if size != 1]
    target_dims = [i for i, size in enumerate(target) if size != 1]
    if [source[i] for i in source_dims] != [target[i] for i in target_dims]:
        return None
    mapping = [-1] * len(target)
    for s, t in zip(source_dims, target_dims):
        mapping[t] = s
    return mapping


_DIM_VIEWS = (aten.unsqueeze.default, aten.permute.default, aten.view.default, aten.reshape.default, aten.squeeze.dim,
              aten.squeeze.default)
# Ops whose element at an index is their input's element there (broadcast right-aligned, or cast).
_COPIES = (aten.expand.default, prims.convert_element_type.default, aten.clone.default)


def _is_elementwise(node: torch.fx.Node) -> bool:
    """An op whose element at an index reads its inputs at the same index, broadcast right-aligned."""
    target = node.target
    return target in _COPIES or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags)


def _input_dim(node: torch.fx.Node, dim: int, arg: torch.fx.Node) -> Optional[int]:
    """The dim of ``arg`` that ``node``'s dim ``dim`` reads (-1: ``arg`` is broadcast along it); None for a
    view that moves it otherwise than by size-1 dims or a permutation."""
    target, rank = node.target, len(_shape(node))
    if dim < 0:
        return -1
    if _is_elementwise(node):
        source = len(_shape(arg)) - rank + dim
    elif target is aten.unsqueeze.default:
        inserted = node.args[1] % rank
        source = -1 if dim == inserted else dim if dim < inserted else dim - 1
    elif target is aten.permute.default:
        source = node.args[1][dim] % len(_shape(arg))
    elif target in (aten.view.default, aten.reshape.default, aten.squeeze.dim, aten.squeeze.default):
        mapping = _size_one_dims_map(_shape(arg), _shape(node))
        if mapping is None:
            return None
        source = mapping[dim]
    else:
        return None
    return source if source >= 0 and _shape(arg)[source] != 1 else -1


def _value(
    node: object, dims: Optional[tuple[int, int]] = None, reads: Optional["PositionReads"] = None, aligned: bool = True
) -> sympy.Basic:
    """``node`` as a formula over the positions m and n. ``dims`` are the node's own dims that hold the logits' rows
    and columns (-1: the node is broadcast along it), by default its last two; each operand is followed with the
    dims that its op reads there, so a position is m or n by where it meets the logits, not by its own shape. With
    ``reads``, an integer vector read from memory along the rows or the columns is the symbol ROW_READ or COL_READ,
    an integer scalar one of SCALAR_READS (``PositionReads``); ``aligned``: every op from the formula's root to
    ``node`` broadcasts right-aligned."""
    if isinstance(node, bool):
        return sympy.true if node else sympy.false
    if isinstance(node, (int, float)):
        return sympy.sympify(node)
    if not isinstance(node, torch.fx.Node):
        raise Unknown(node)
    if dims is None:
        rank = len(_shape(node))
        dims = (max(-1, rank - 2), rank - 1)
    if node.op != "call_function":
        return _read_vector(node, dims, reads, aligned)
    target, args = node.target, node.args
    if target is prims.iota.default:
        start, step = node.kwargs.get("start", 0), node.kwargs.get("step", 1)
        if args[0] == 1:
            return sympy.sympify(start)
        if dims[0] == 0 or dims[1] == 0:
            return start + step * (ROW if dims[0] == 0 else COL)
        raise Unknown(node)  # a position along another dim
    if target is aten.full.default:
        return sympy.sympify(args[1])
    if target is aten.scalar_tensor.default:
        return sympy.sympify(args[0])
    if node.kwargs.get("alpha", 1) != 1:  # (add or sub scaled: not read as a plain sum)
        raise Unknown(node)

    def operand(arg: object) -> sympy.Basic:
        if not isinstance(arg, torch.fx.Node):
            return _value(arg)
        arg_dims = tuple(_input_dim(node, dim, arg) for dim in dims)
        if None in arg_dims:
            raise Unknown(node)
        arg_aligned = aligned and _is_elementwise(node)
        # Below a conversion that may round or wrap (to a float, to a narrower integer), values read from memory are
        # not what the formula would bound: no reads there.
        arg_reads = None if _lossy_conversion(node, arg) else reads
        before = None if arg_reads is None else arg_reads.state()
        try:
            return _value(arg, arg_dims, arg_reads, arg_aligned)
        except Unknown:
            if arg_reads is not None:
                arg_reads.restore(before)  # (what the part read before it failed is not read)
            return _read_vector(arg, arg_dims, arg_reads, arg_aligned)

    if target in _DIM_VIEWS or target in _COPIES:
        return operand(args[0])  # the same values, its dims mapped by ``_input_dim``
    operands = [operand(a) for a in args[:2]] if len(args) >= 2 else [operand(args[0])]
    binary = {
        aten.add.Tensor: lambda a, b: a + b,
        aten.sub.Tensor: lambda a, b: a - b,
        aten.mul.Tensor: lambda a, b: a * b,
        aten.floor_divide.default: lambda a, b: sympy.floor(a / b),
        aten.le.Tensor: sympy.Le, aten.le.Scalar: sympy.Le,
        aten.lt.Tensor: sympy.Lt, aten.lt.Scalar: sympy.Lt,
        aten.ge.Tensor: sympy.Ge, aten.ge.Scalar: sympy.Ge,
        aten.gt.Tensor: sympy.Gt, aten.gt.Scalar: sympy.Gt,
        aten.eq.Tensor: sympy.Eq, aten.eq.Scalar: sympy.Eq,
        aten.ne.Tensor: sympy.Ne, aten.ne.Scalar: sympy.Ne,
        aten.logical_and.default: sympy.And, aten.bitwise_and.Tensor: sympy.And,
        aten.logical_or.default: sympy.Or, aten.bitwise_or.Tensor: sympy.Or,
    }
    if target in binary:
        return binary[target](*operands)
    if target in (aten.logical_not.default, aten.bitwise_not.default):
        return sympy.Not(operands[0])
    if target is aten.abs.default:
        return sympy.Abs(operands[0])
    if target is aten.neg.default:
        return -operands[0]
    raise Unknown(target)


class PositionReads:
    """The integer vectors a formula reads from memory, one per axis at most: ``rows`` (the symbol ROW_READ) varies
    along the logits' rows only, ``columns`` (COL_READ) along their columns only; and, where the kernel reads them,
    up to two integer scalars (``scalars``, the symbols SCALAR_READS: a band's width and prefix computed in the
    graph, a window size kept as a tensor). Each vector is a node whose value, broadcast right-aligned to the scores,
    is that vector at every logit (``pos[:, None]``, or ``pos`` itself for the columns); the kernel bounds it per
    tile from the values it reads. Positions made once outside the compiled
    function, a registered buffer of them, HF's ``position_ids``."""

    def __init__(self, scores: torch.fx.Node, readable: Callable[[torch.fx.Node], bool], scalars: bool = False) -> None:
        self.rows: Optional[torch.fx.Node] = None
        self.columns: Optional[torch.fx.Node] = None
        self.scores = scores
        self.readable = readable  # whether the kernel can compute a node's value (the chain's own, or captured)
        # With ``scalars`` (a kernel that reads them: the forward's), integer tensors of one element are SCALAR_READS.
        self.scalars: Optional[list[torch.fx.Node]] = [] if scalars else None

    def scalar(self, node: torch.fx.Node) -> sympy.Symbol:
        """``node``'s symbol among SCALAR_READS (the one of an equal node read before, else the next)."""
        if self.scalars is None:
            raise Unknown(node)
        for index, known in enumerate(self.scalars):
            if _same_value(known, node):
                return SCALAR_READS[index]
        if len(self.scalars) == len(SCALAR_READS):
            raise Unknown(node)
        self.scalars.append(node)
        return SCALAR_READS[len(self.scalars) - 1]

    def copy(self) -> "PositionReads":
        """A copy that reads the same vectors so far, and whose reads from now on are its own."""
        copied = copy.copy(self)
        copied.scalars = None if self.scalars is None else list(self.scalars)
        return copied

    def state(self) -> tuple:
        return self.rows, self.columns, None if self.scalars is None else list(self.scalars)

    def restore(self, state: tuple) -> None:
        self.rows, self.columns, self.scalars = state

    def symbol(self, node: torch.fx.Node, axis: str) -> sympy.Symbol:
        current = getattr(self, axis)
        if current is not None and not _same_value(current, node):
            raise Unknown(node)  # a second vector along one axis
        setattr(self, axis, current or node)
        return ROW_READ if axis == "rows" else COL_READ


def _lossy_conversion(node: torch.fx.Node, arg: torch.fx.Node) -> bool:
    """Whether ``node`` converts ``arg`` to a floating dtype, or to an integer dtype narrower than its own."""
    if node.target is not prims.convert_element_type.default or "val" not in arg.meta:
        return False
    source, target = arg.meta["val"].dtype, node.args[1]
    if target.is_floating_point:
        return not source.is_floating_point
    return target.itemsize < source.itemsize


def _same_value(a: object, b: object) -> bool:
    """Whether two nodes compute the same value by the same ops from the same inputs (``pos[:, None]`` written
    twice)."""
    if a is b:
        return True
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return not isinstance(a, torch.fx.Node) and not isinstance(b, torch.fx.Node) and type(a) is type(b) and a == b
    if a.op != "call_function" or b.op != "call_function" or a.target is not b.target or a.kwargs != b.kwargs:
        return False
    if len(a.args) != len(b.args):
        return False
    return all(
        _same_value(x, y) if not isinstance(x, (list, tuple)) else
        isinstance(y, (list, tuple)) and len(x) == len(y) and all(_same_value(i, j) for i, j in zip(x, y))
        for x, y in zip(a.args, b.args)
    )


def _read_vector(node: object, dims: tuple[int, int], reads: Optional[PositionReads], aligned: bool) -> sympy.Symbol:
    """``node`` as ROW_READ or COL_READ: an integer tensor computed without the scores that varies along the rows
    only or the columns only (or, of one element, a scalar: ``PositionReads.scalar``), and whose broadcast to the
    scores puts that axis where it meets them (its rows dim second to last over a last dim of 1, or its columns dim
    last; with a view between it and the formula's root, no other dim of size above 1, since the view may have
    moved its batch dims)."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if reads is None or not isinstance(value, torch.Tensor) or value.dtype.is_floating_point:
        raise Unknown(node)
    if value.dtype in (torch.bool,) or value.dtype.is_complex or not reads.readable(node):
        raise Unknown(node)
    shape, rank = tuple(value.shape), value.dim()
    row, col = dims
    if row < 0 and col < 0 and value.numel() == 1:
        return reads.scalar(node)  # one value for every logit
    if (row >= 0) == (col >= 0):
        raise Unknown(node)  # constant along both, or varying along both
    axis_dim = row if row >= 0 else col
    expected = rank - 2 if row >= 0 else rank - 1
    if axis_dim != expected or (row >= 0 and shape[-1] != 1):
        raise Unknown(node)
    if not aligned and any(size != 1 for i, size in enumerate(shape) if i != axis_dim):
        raise Unknown(node)
    return reads.symbol(node, "rows" if row >= 0 else "columns")


def constant_value(node: object) -> Optional[float]:
    """The value of a number, or of a constant tensor the graph builds (``full``, ``scalar_tensor``); else None."""
    if isinstance(node, bool):
        return None
    if isinstance(node, (int, float)):
        return float(node)
    if is_op(node, aten.full.default) and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool):
        return float(node.args[1])
    if is_op(node, aten.scalar_tensor.default) and isinstance(node.args[0], (int, float)):
        return float(node.args[0])
    return None


def positive_scalar(node: object) -> Optional[float]:
    """The value of a positive finite number, or of a constant tensor of one element holding one (GPT-2 divides its
    scores by ``full([], √d)``); else None."""
    if is_op(node, aten.full.default) and math.prod(node.args[0]) != 1:
        return None
    value = constant_value(node)
    return value if value is not None and 0.0 < value < math.inf else None


def is_minus_inf(node: object) -> bool:
    return constant_value(node) == -math.inf


def fill_is_true_branch(where: torch.fx.Node) -> bool:
    """Which branch of ``where(cond, a, b)`` is the mask's fill: -inf, or else a constant beside a computed value."""
    condition, if_true, if_false = where.args
    if is_minus_inf(if_true) or is_minus_inf(if_false):
        return is_minus_inf(if_true)
    return constant_value(if_true) is not None and constant_value(if_false) is None


def masked_terms(where: torch.fx.Node, fills: frozenset = frozenset()) -> Optional[list[tuple[object, bool]]]:
    """For ``where(cond, -inf, x)`` (or ``where(cond, x, -inf)``), terms whose OR is exactly where the logit is set
    to -inf, each as (node, negated): ``~(a & b)`` gives [(a, True), (b, True)]. The ``where`` nodes in ``fills``
    count as well with their finite constant fill (``absorbing_fill_masks``, ``fills_absorbing_where_rows_keep_keys``).
    None for any other node."""
    if where.op != "call_function" or where.target is not aten.where.self:
        return None
    condition, if_true, if_false = where.args
    true_fill = fill_is_true_branch(where)
    fill = if_true if true_fill else if_false
    if is_minus_inf(fill) or (where in fills and constant_value(fill) is not None):
        return _or_terms(condition, not true_fill)
    return None


def fills_a_score(where: torch.fx.Node, scores: torch.fx.Node, chain: frozenset, memo: dict) -> bool:
    """Whether the -inf fill of ``where`` masks a logit: it stands in for a score (the value kept beside it is
    computed from ``scores``, or ``where`` is a bias, ``where(cond, -inf, 0)``, that every use adds to such a value,
    through dtype conversions and broadcasts), and every op of the ``chain`` on its way to the logits keeps -inf as
    -inf. A ``where`` that fills some other value (a bias a later condition reads, a factor of the scores), or whose
    -inf a later op turns into something else (a negation, a soft-cap's tanh), masks nothing by itself."""
    kept = where.args[2] if fill_is_true_branch(where) else where.args[1]
    if isinstance(kept, torch.fx.Node) and depends_on(kept, scores, memo):
        starts = [where]
    else:
        starts = _adds_to_scores(where, scores, memo)
    return bool(starts) and all(_keeps_minus_inf(start, chain, set()) for start in starts)


_BROADCASTS = (prims.convert_element_type.default, aten.expand.default, aten.unsqueeze.default)
_VIEWS_OF_SCORES = (*_BROADCASTS, aten.view.default, aten.reshape.default)


def _adds_to_scores(value: torch.fx.Node, scores: torch.fx.Node, memo: dict) -> Optional[list[torch.fx.Node]]:
    """The adds of ``value`` (through broadcasts) to values computed from the scores, when every use is one."""
    adds = []
    for user in value.users:
        if is_op(user, _BROADCASTS) and user.args[0] is value:
            more = _adds_to_scores(user, scores, memo)
            if more is None:
                return None
            adds += more
        elif is_op(user, aten.add.Tensor) and user.kwargs.get("alpha", 1) == 1 and any(
            isinstance(arg, torch.fx.Node) and arg is not value and depends_on(arg, scores, memo) for arg in user.args
        ):
            adds.append(user)
        else:
            return None
    return adds or None


def _keeps_minus_inf(value: torch.fx.Node, chain: frozenset, seen: set) -> bool:
    """Every op of ``chain`` that reads ``value`` gives -inf where it is -inf, and so on to the chain's end."""
    for user in value.users:
        if user not in chain or user in seen:
            continue
        seen.add(user)
        if not (_minus_inf_in_minus_inf_out(user, value) and _keeps_minus_inf(user, chain, seen)):
            return False
    return True


def _minus_inf_in_minus_inf_out(op: torch.fx.Node, value: torch.fx.Node) -> bool:
    first = op.args[0]
    if is_op(op, prims.convert_element_type.default):
        return op.args[1].is_floating_point
    if op.kwargs.get("alpha", 1) != 1:  # an add or sub scaled by alpha (a negative one turns -inf into +inf)
        return False
    if is_op(op, _VIEWS_OF_SCORES) or is_op(op, aten.add.Tensor):
        return True
    if is_op(op, aten.sub.Tensor):
        return first is value and op.args[1] is not value
    if is_op(op, (aten.mul.Tensor, aten.div.Tensor)):  # by a positive constant (a divisor only)
        factor = op.args[1] if first is value else first
        in_order = first is value or is_op(op, aten.mul.Tensor)
        return in_order and factor is not value and positive_scalar(factor) is not None
    if is_op(op, aten.where.self):  # another mask: the other branch is -inf too
        condition, if_true, if_false = op.args
        return condition is not value and is_minus_inf(if_false if if_true is value else if_true)
    return False


def logit_mask_terms(
    node: torch.fx.Node, scores: torch.fx.Node, chain: frozenset, memo: dict, fills: frozenset = frozenset()
) -> Optional[list[tuple[object, bool]]]:
    """``masked_terms`` of a ``where`` that masks a logit (``fills_a_score``); None for any other node."""
    if not (is_op(node, aten.where.self) and fills_a_score(node, scores, chain, memo)):
        return None
    return masked_terms(node, fills)


def _or_terms(node: object, negated: bool) -> list[tuple[object, bool]]:
    if is_op(node, (aten.logical_not.default, aten.bitwise_not.default)):
        return _or_terms(node.args[0], not negated)
    joins = (aten.logical_and.default, aten.bitwise_and.Tensor) if negated else (aten.logical_or.default, aten.bitwise_or.Tensor)
    if is_op(node, joins):
        return _or_terms(node.args[0], negated) + _or_terms(node.args[1], negated)
    return [(node, negated)]


def position_masks(
    chain: list[torch.fx.Node],
    scores: torch.fx.Node,
    fills: frozenset = frozenset(),
    reads: Optional[PositionReads] = None,
) -> tuple[Optional[sympy.Boolean], list[torch.fx.Node], Optional[sympy.Boolean]]:
    """Formulas over (m, n) of where the chain sets the logit to -inf by position, and the ``where`` nodes that
    do it. The first formula covers the masks whose every term is a position term: only those may be dropped from
    entirely visible tiles (the nodes). The third also has the position terms of masks that combine positions with
    terms no formula bounds (``doc[m] == doc[n] & n <= m``): it implies -inf, enough to skip a tile. The ``where``
    nodes in ``fills`` count as -inf masks (``absorbing_fill_masks``); only a ``where`` that fills a score does
    (``fills_a_score``). With ``reads``, positions may also be integer vectors read from memory (``PositionReads``)."""
    complete, nodes, skippable, memo, links = [], [], [], {}, frozenset(chain)
    for node in chain:
        terms = logit_mask_terms(node, scores, links, memo, fills)
        known = _known_terms(terms or [], reads)
        skippable += known
        if terms and len(known) == len(terms):
            complete.append(sympy.Or(*known))
            nodes.append(node)
    return (sympy.Or(*complete) if complete else None), nodes, (sympy.Or(*skippable) if skippable else None)


def _position_formula(node: object, reads: Optional[PositionReads] = None) -> Optional[sympy.Boolean]:
    """``node`` as a condition on the positions m and n alone (and, with ``reads``, on vectors read at them), or
    None. A node that is not a formula leaves ``reads`` as it was."""
    before = None if reads is None else reads.state()
    try:
        formula = _value(node, reads=reads)
    except (Unknown, KeyError, TypeError):
        formula = None
    symbols = {ROW, COL} | ({ROW_READ, COL_READ, *SCALAR_READS} if reads is not None else set())
    if formula is not None and formula.free_symbols <= symbols and isinstance(formula, sympy.logic.boolalg.Boolean):
        return formula
    if reads is not None:
        reads.restore(before)
    return None


def reads_vectors(formula: Optional[sympy.Basic]) -> bool:
    """Whether ``formula`` reads a position vector from memory (ROW_READ or COL_READ)."""
    return formula is not None and bool(formula.free_symbols & {ROW_READ, COL_READ})


def reads_scalars(formula: Optional[sympy.Basic]) -> bool:
    """Whether ``formula`` reads an integer scalar from memory (SCALAR_READS)."""
    return formula is not None and bool(formula.free_symbols & set(SCALAR_READS))


def _known_terms(terms: list[tuple[object, bool]], reads: Optional[PositionReads] = None) -> list[sympy.Boolean]:
    """The formulas of the terms of a -inf mask (``masked_terms``) that depend on positions alone."""
    # (An id-equality mask keeps its own run-time summary, ``matched_id_masks``, which the backward also reads.)
    formulas = [
        (None if reads is not None and _id_sides(term, negated, reads.scores) else _position_formula(term, reads), negated)
        for term, negated in terms
    ]
    return [sympy.Not(formula) if negated else formula for formula, negated in formulas if formula is not None]


# A position mask may fill with a finite constant instead of -inf (GPT-2's ``where(causal, w, finfo.min)``). Once
# scaled as the softmax sees it, a fill at most ABSORBING_FILL lies 2^123 or more below any kept logit above -2^123,
# so exp(fill - row max) is exactly 0 in float32 wherever the row keeps a key: the fill's tiles add exactly 0 to every
# sum, as -inf's do. A row that keeps no key would average V in eager, so every row must provably keep one.
ABSORBING_FILL = -(2.0**124)


def absorbing_fill_masks(
    chain: list[torch.fx.Node], scores: torch.fx.Node, logits: torch.fx.Node, logit_scale: float
) -> frozenset:
    """The ``where`` nodes of the chain whose finite fill may count as -inf: when the chain is only position masks
    (each filling with -inf or a constant), dtype conversions and positive constant factors, every finite fill
    reaches the softmax at most ABSORBING_FILL, and some key ``n*`` (0, the row's own position, N - 1) is kept for
    every row, checked row by row."""
    found = _absorbing_fills(chain, scores, logits, logit_scale, positions_only=True)
    if found is None or not _every_row_keeps_a_key(sympy.Or(*found[1]), *scores.meta["val"].shape[-2:]):
        return frozenset()
    return found[0]


def fills_absorbing_where_rows_keep_keys(
    chain: list[torch.fx.Node], scores: torch.fx.Node, logits: torch.fx.Node, logit_scale: float
) -> frozenset:
    """The ``where`` nodes of the chain whose finite fill counts as -inf wherever every row keeps a key: the rule of
    ``absorbing_fill_masks`` with masks of any condition computed without the scores, and no proof that rows keep
    keys (a run-time check of the masks' tensors gives it: ``causal_tensor_route``)."""
    found = _absorbing_fills(chain, scores, logits, logit_scale, positions_only=False)
    return frozenset() if found is None else found[0]


def _absorbing_fills(
    chain: list[torch.fx.Node], scores: torch.fx.Node, logits: torch.fx.Node, logit_scale: float, positions_only: bool
) -> Optional[tuple[frozenset, list]]:
    """The finite fills that reach the softmax at most ABSORBING_FILL, on a chain of masks (of positions alone where
    ``positions_only``), dtype conversions, positive constant factors and tanh (a soft-cap before the fill), with the
    masks' formulas; None otherwise."""
    rows, columns = scores.meta["val"].shape[-2:]
    if not (isinstance(rows, int) and isinstance(columns, int)):
        return None
    memo: dict = {}
    on_path = [node for node in chain if depends_on(node, scores, memo)]
    step, source, finite, formulas = {}, {}, [], []
    for node in on_path:
        inputs = [arg for arg in node.all_input_nodes if arg is scores or arg in step]
        if len(inputs) != 1 or node.op != "call_function":
            return None
        source[node] = inputs[0]
        terms = masked_terms(node, frozenset([node]))
        if terms is not None:
            if depends_on(node.args[0], scores, memo):
                return None
            if positions_only:  # (the formulas only this rule reads)
                known = _known_terms(terms)
                if len(known) != len(terms):
                    return None
                formulas.append(sympy.Or(*known))
            fill = constant_value(node.args[1] if fill_is_true_branch(node) else node.args[2])
            step[node] = 1.0
            if fill != -math.inf:
                finite.append((node, fill))
        elif node.target is prims.convert_element_type.default and node.args[1].is_floating_point:
            step[node] = 1.0
        elif _is_constant_scaling(node, inputs[0]):
            factor = positive_scalar(node.args[1])
            step[node] = factor if node.target is aten.mul.Tensor else 1.0 / factor
        elif node.target is aten.tanh.default:
            # A soft-cap's tanh bounds what follows it (|c · tanh| ≤ c); a fill before it does not reach the softmax
            # as a fill (factor 0: never absorbing).
            step[node] = 0.0
        else:
            return None
    if not finite or logits not in step:
        return None
    after = {logits: logit_scale}  # the factor each on-path value is multiplied by before the softmax
    for node in reversed(on_path):
        if node not in after or source[node] in after:
            return None  # off the path to the logits, or a value used twice on it
        after[source[node]] = after[node] * step[node]
    if any(fill * after[node] > ABSORBING_FILL for node, fill in finite):
        return None
    return frozenset(node for node, _ in finite), formulas


def _is_constant_scaling(node: torch.fx.Node, value: torch.fx.Node) -> bool:
    """``value * c`` or ``value / c`` with a positive constant c."""
    scaling = node.target in (aten.mul.Tensor, aten.div.Tensor) and node.args[0] is value
    return scaling and positive_scalar(node.args[1]) is not None


def _every_row_keeps_a_key(masked: sympy.Boolean, rows: int, columns: int) -> bool:
    """Whether, for every row m, one of the keys 0, min(m, N - 1) or N - 1 is not masked."""
    import numpy as np

    evaluate = sympy.lambdify((ROW, COL), masked, modules="numpy")
    m = np.arange(rows)
    kept = np.zeros(rows, dtype=bool)
    for n in (np.zeros_like(m), np.minimum(m, columns - 1), np.full_like(m, columns - 1)):
        kept |= ~np.broadcast_to(np.asarray(evaluate(m, n), dtype=bool), m.shape)
    return bool(kept.all())


@dataclasses.dataclass(frozen=True)
class IdMask:
    """A ``where`` that sets a logit to -inf unless a per-row id equals a per-column id (document masking:
    ``doc[m] == doc[n]``), possibly among other terms."""

    where: torch.fx.Node
    rows: torch.fx.Node  # the ids, per row (constant along the columns)
    columns: torch.fx.Node  # the ids, per column
    alone: bool  # the equality is the mask's only term: where all ids of a tile are equal, the mask keeps it all


def matched_id_masks(chain: list[torch.fx.Node], scores: torch.fx.Node) -> list[IdMask]:
    """Every id-equality mask of the chain. The ids are integer tensors read from memory, so no formula bounds
    them; the kernel bounds them per tile at run time instead: a tile whose row ids and column ids span disjoint
    intervals has no equal pair, so it is entirely masked (``ids_disjoint``); one whose ids are all one value is
    entirely kept by the mask (``tile_tests.IDS_ALL_EQUAL``)."""
    found, memo, links = [], {}, frozenset(chain)
    for node in chain:
        terms = logit_mask_terms(node, scores, links, memo) or []
        for term, negated in terms:
            sides = _id_sides(term, negated, scores)
            if sides is not None:
                found.append(IdMask(node, sides[0], sides[1], alone=len(terms) == 1))
    return found


def _id_sides(term: object, negated: bool, scores: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """(per-row ids, per-column ids) when the term masks where the two differ, else None."""
    if not (is_op(term, aten.eq.Tensor) and negated) and not (is_op(term, aten.ne.Tensor) and not negated):
        return None
    sides = sorted(term.args[:2], key=lambda side: _varying_axis(side) or 0)
    if [_varying_axis(side) for side in sides] == [-2, -1] and not any(depends_on(side, scores, {}) for side in sides):
        return sides[0], sides[1]
    return None


# A mask passed in as a tensor is summarised per cell of MASK_TABLE_CELL x MASK_TABLE_CELL elements: every kernel
# tile is a whole number of cells or lies inside one. A cell's state counts what holds of its elements:
# 0 none masked, 1 some masked, 2 all masked (``ops.mask_cell_states``).
MASK_TABLE_CELL = TABLE_CELL


@dataclasses.dataclass(frozen=True)
class TensorMask:
    """A ``where`` that sets a logit to -inf where a boolean tensor, varying along rows and columns, says so (a mask
    passed in: ``scores.masked_fill(~keep, -inf)``). No formula bounds it and reading it per tile costs as much as
    using it, so the graph reduces it once per call, over its own batch dims only (shared by all heads it
    broadcasts over), to a table of cell states that the kernel's pre-pass reads."""

    where: torch.fx.Node
    term: torch.fx.Node  # the boolean tensor; the logit is -inf where it is true (``negated``: where it is false)
    negated: bool
    alone: bool  # the term is the mask's only one: where no cell of a tile masks, the mask keeps the tile whole
    # The fill is finite (``finfo.min``) and absorbs only in rows that keep a key: a cell counts as all masked only
    # where each of its rows keeps one (a row that keeps none averages V over every key in eager).
    rows_keep_keys: bool = False


def matched_tensor_masks(
    chain: list[torch.fx.Node], scores: torch.fx.Node, reads: Optional[PositionReads] = None,
    finite_fills: frozenset = frozenset(),
) -> list[TensorMask]:
    """Every -inf mask term that is a boolean tensor of the scores' last two dims, or of their columns broadcast
    over the rows (a key-padding mask ``[B, 1, 1, N]``), computed without the scores, that neither a position
    formula (over ``reads`` too) nor an id summary covers; the ``where`` nodes in ``finite_fills`` count with their
    finite fill (``TensorMask.rows_keep_keys``)."""
    rows, columns = scores.meta["val"].shape[-2:]
    static_rows = isinstance(rows, int)
    found, memo, links = [], {}, frozenset(chain)
    for node in chain:
        terms = logit_mask_terms(node, scores, links, memo, finite_fills) or []
        for term, negated in terms:
            value = term.meta.get("val") if isinstance(term, torch.fx.Node) else None
            if (
                isinstance(value, torch.Tensor)
                and value.dtype is torch.bool
                and value.dim() >= 2
                and value.shape[-1] == columns
                and (value.shape[-2] == rows or (value.shape[-2] == 1 and static_rows))
                and all(isinstance(size, int) for size in value.shape)
                and not _known_terms([(term, negated)], None if reads is None else reads.copy())
                and _id_sides(term, negated, scores) is None
                and not depends_on(term, scores, {})
            ):
                alone = len(terms) == 1
                found.append(TensorMask(node, term, negated, alone=alone, rows_keep_keys=node in finite_fills))
    return found


# An additive bias at least this far below its row's largest bias absorbs the score it is added to: the key's weight
# exp(x + bias - max) underflows to exactly 0 in float32 whenever the scores ``x`` before the bias spread by less than
# 2^126 - 150 over the row, which holds for |x| <= 2^124 (about 2e37, within 16x of bf16/float32 overflow). The row
# max is at least a kept key's logit, and the key with the row's largest bias is never in a skipped cell. It takes
# HF's ``finfo.min`` padding mask (bf16 and float32) and -inf; ``finfo(float16).min`` and -1e9 are too small for it.
ABSORBING_BIAS_GAP = 2.0**126


@dataclasses.dataclass(frozen=True)
class AdditiveMask:
    """``logits = scaled scores + bias``, with nothing else on the score path but constant scaling, and a
    floating-point bias that is a mask rather than a per-head bias: broadcast over the rows (a key-padding mask added
    as ``(1 - mask) * finfo.min``) or over the heads (HF's ``[B, 1, M, N]`` causal-and-padding mask). Its table marks
    the cells whose bias is all 0 (the add may be dropped there) and those whose bias is absorbing
    (``ABSORBING_BIAS_GAP`` below its row's largest): those tiles add exactly 0 to every sum. A row whose every bias
    is equally low (a batch entry with no key kept) has no absorbing cell: eager gives it the mean of V, and so does
    the kernel. A bias of its own per head would cost a full extra read to summarise, for tables that rarely skip;
    over scores ``[B, H, M, N]`` one broadcast over the rows that differs between heads and not between batch
    entries (ALiBi's ``[H, 1, N]``) is taken for a position bias, which masks nothing: it gets no table either (every
    tile would be partial: the table's reductions and pre-pass are work for nothing; one that does mask keys is read
    per element, its tiles not skipped)."""

    add: torch.fx.Node
    bias: torch.fx.Node


_SCALING = (aten.mul.Tensor, aten.div.Tensor, prims.convert_element_type.default)


def matched_additive_mask(chain: list[torch.fx.Node], logits: torch.fx.Node, scores: torch.fx.Node) -> Optional[AdditiveMask]:
    """The chain's additive mask (``AdditiveMask``), or None: a bias added on the score path as ``additive_bias``
    finds it, shared by the heads, or broadcast over the rows and not a position bias (``_position_bias``)."""
    found = additive_bias(chain, logits, scores)
    if found is None:
        return None
    add, _, bias = found
    value, score_shape = bias.meta["val"], scores.meta["val"].shape
    heads = score_shape[-3] if len(score_shape) >= 3 else 1
    shared_by_heads = isinstance(heads, int) and heads != 1 and (value.dim() < 3 or value.shape[-3] == 1)
    rows_alike = value.shape[-2] == 1
    return AdditiveMask(add, bias) if shared_by_heads or (rows_alike and not _position_bias(value, score_shape)) else None


def _position_bias(bias: torch.Tensor, score_shape: torch.Size) -> bool:
    """Whether ``bias``, over scores ``[B, H, M, N]``, differs between heads but is the same for every batch entry
    (``[H, 1, N]``, ``[1, H, 1, N]``), as position biases are; padding masks differ between batch entries and are
    shared by the heads. (Over scores ``[B·H, M, N]`` the two cannot be told apart.) The bias's sizes are static
    (``additive_bias``)."""
    if len(score_shape) != 4 or bias.dim() < 3 or bias.shape[-3] == 1:
        return False
    return bias.dim() == 3 or bias.shape[-4] == 1


def additive_bias(
    chain: list[torch.fx.Node], logits: torch.fx.Node, scores: torch.fx.Node, scaled_scores_only: bool = True
) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]:
    """The add of a floating-point bias ``[..., M or 1, N]`` (static sizes) to the scores, the add's side computed
    from the scores, and the bias (its expands taken off), or None. The add (with no ``alpha``) must be the last op
    on the score path (up to dtype conversions), and, where ``scaled_scores_only``, every op before it a dtype
    conversion, a product with a constant or a tanh (a soft-cap: finite wherever its input is, and bounded): any
    other mask or transform on that path could make a row's largest bias a poor witness that the row keeps a key (a
    check of the bias's values that finds each row's own key kept needs no such rule: ``causal_tensor_route``)."""
    rows, columns = scores.meta["val"].shape[-2:]
    add = logits
    while is_op(add, prims.convert_element_type.default):
        add = add.args[0]
    if not is_op(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or not isinstance(rows, int):
        return None
    memo: dict = {}
    sides = [arg for arg in add.args[:2] if isinstance(arg, torch.fx.Node)]
    on_path = [arg for arg in sides if depends_on(arg, scores, memo)]
    if len(sides) != 2 or len(on_path) != 1:
        return None
    bias = next(arg for arg in sides if arg is not on_path[0])
    for node in chain if scaled_scores_only else ():
        if node is add or not depends_on(node, scores, memo) or node.op != "call_function":
            continue
        if node.target is aten.tanh.default:
            continue
        if node.target not in _SCALING:
            return None
        if node.target is not prims.convert_element_type.default and not isinstance(node.args[1], (int, float)):
            return None  # scaled by a tensor
    while is_op(bias, aten.expand.default):
        bias = bias.args[0]
    value = bias.meta.get("val")
    if not (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dim() >= 2
        and all(isinstance(size, int) for size in (*value.shape, columns))  # static sizes: compared without guards
        and value.shape[-1] == columns
        and value.shape[-2] in (1, rows)
    ):
        return None
    return add, on_path[0], bias


def is_op(node: object, targets: object) -> bool:
    """Whether ``node`` calls ``targets`` (one op or a tuple of them)."""
    targets = targets if isinstance(targets, tuple) else (targets,)
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _varying_axis(node: object) -> Optional[int]:
    """-2 for an integer tensor constant along the columns (per row), -1 for one constant along the rows."""
    if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
        return None
    value = node.meta["val"]
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dim() < 2 or value.dtype is torch.bool:
        return None
    rows, columns = value.shape[-2:]
    if columns == 1 and rows != 1:
        return -2
    if rows == 1 and columns != 1:
        return -1
    return None


def depends_on(node: torch.fx.Node, target: torch.fx.Node, memo: dict) -> bool:
    """Whether ``node`` is computed from ``target`` (``memo`` caches the answer per node, for one target). Iterative:
    a long chain of ops must not reach Python's recursion limit."""
    stack = [node]
    while stack:
        current = stack[-1]
        if current is target:
            memo[current] = True
        if current in memo:
            stack.pop()
            continue
        pending = [arg for arg in current.all_input_nodes if arg not in memo and arg is not target]
        if pending:
            stack.extend(pending)
            continue
        memo[current] = any(arg is target or memo[arg] for arg in current.all_input_nodes)
        stack.pop()
    return memo[node]


# ------------------------------------------------------------------------------------------- row-invariant blocks
def row_position_formulas(value: torch.fx.Node) -> Optional[list[sympy.Boolean]]:
    """The position formulas over (m, n) through which ``value`` (``[..., M, N]``) varies
    along the rows, or None when it may vary along them some other way (a tensor read per row, a position used in
    arithmetic). Wherever every formula is constant over a block of rows and columns, each row of the block holds
    the same values: HF's causal-and-padding bias is ``where(pad[b, n] | (n > m), min, 0)``, the same on every row
    of a block the diagonal does not cross. Each node is followed with the dims that hold the value's rows and
    columns; a formula is taken only from a node whose own last two dims are those."""
    formulas: list[sympy.Boolean] = []
    rank = len(_shape(value))
    pending, seen = [(value, rank - 2, rank - 1)], set()
    while pending:
        node, row, col = pending.pop()
        if not isinstance(node, torch.fx.Node) or row < 0 or (node, row, col) in seen:
            continue  # a number, or broadcast along the rows
        seen.add((node, row, col))
        if _shape(node)[row] == 1 or is_op(node, (aten.full.default, aten.scalar_tensor.default)):
            continue
        rank = len(_shape(node))
        aligned = row == rank - 2 and col in (rank - 1, -1)
        formula = _position_formula(node) if aligned and node.meta["val"].dtype is torch.bool else None
        if formula is not None:
            formulas += [formula] if ROW in formula.free_symbols else []
            continue
        if node.op != "call_function" or not (_is_elementwise(node) or node.target in _DIM_VIEWS):
            return None  # a tensor read per row, a position itself, an op this does not follow
        for arg in node.all_input_nodes:
            arg_row, arg_col = _input_dim(node, row, arg), _input_dim(node, col, arg)
            if arg_row is None or arg_col is None:
                return None
            pending.append((arg, arg_row, arg_col))
    return formulas
