"""Convert integer positions to float before the arithmetic on them, not after (ALiBi's ``slope · (n − m)``).

ALiBi subtracts two ``arange`` vectors broadcast to the score grid and multiplies the integer difference by a float
slope: the kernel converts the difference to float once per logit. An int→float conversion issues at a fraction of
the fp32 rate on the GPU, so in a kernel bound by its per-logit work it costs about what the logit's exp2 costs.
Converting each position vector first leaves one float subtraction per logit and one conversion per row and per
column. Integers up to 2^24 in magnitude (2^53 for float64), and sums and differences that stay in that range, are
exact in float32, so the rewrite is taken only where bounds on every intermediate value prove it exact: the same
numbers reach the float consumer. Expressions over positions read from tensors (document ids, a ``cumsum``) have
no static bounds and keep their integer arithmetic.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch._dynamo.utils import counters

from inductor_overlay import config
from inductor_overlay.fx_passes.attention_fusion import call_op
from inductor_overlay.fx_passes.block_sparsity import is_op

log = logging.getLogger("flashlight.float_positions")

aten = torch.ops.aten
prims = torch.ops.prims

Bounds = tuple[int, int]

# Ops that only view or copy their first argument: the values, hence the bounds, are the argument's.
_SAME_VALUES = (
    aten.unsqueeze.default, aten.squeeze.dim, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.expand.default, aten.permute.default, aten.clone.default, aten.alias.default,
)
_EXACT_RANGE = {torch.float32: 2**24, torch.float64: 2**53}
# Float ops that take an integer tensor by value (converted under type promotion), with the argument positions that
# may be replaced by the float expression; ``index``, ``embedding`` and the like take integers as indices instead.
_FLOAT_CONSUMERS = {
    aten.mul.Tensor: (0, 1),
    aten.add.Tensor: (0, 1),
    aten.sub.Tensor: (0, 1),
    aten.div.Tensor: (0, 1),
    aten.where.self: (1, 2),
    prims.convert_element_type.default: (0,),
}


def _is_integer(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and value.dtype is not torch.bool


def integer_bounds(node: object) -> Optional[Bounds]:
    """Inclusive bounds on the values of an integer expression over ``arange`` positions; None where unknown."""
    if isinstance(node, int) and not isinstance(node, bool):
        return node, node
    if not isinstance(node, torch.fx.Node) or not _is_integer(node.meta.get("val")):
        return None
    if is_op(node, prims.iota.default):
        length, start, step = node.args[0], node.kwargs.get("start"), node.kwargs.get("step")
        if not all(isinstance(x, int) for x in (length, start, step)) or length < 1:
            return None
        ends = start, start + (length - 1) * step
        return min(ends), max(ends)
    if is_op(node, _SAME_VALUES):
        return integer_bounds(node.args[0])
    if is_op(node, aten.neg.default):
        inner = integer_bounds(node.args[0])
        return None if inner is None else (-inner[1], -inner[0])
    if is_op(node, aten.abs.default):
        inner = integer_bounds(node.args[0])
        if inner is None:
            return None
        low, high = inner
        return (0 if low <= 0 <= high else min(abs(low), abs(high))), max(abs(low), abs(high))
    if is_op(node, (aten.add.Tensor, aten.sub.Tensor)) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        left, right = (integer_bounds(arg) for arg in node.args)
        if left is None or right is None:
            return None
        if node.target is aten.sub.Tensor:
            right = -right[1], -right[0]
        return left[0] + right[0], left[1] + right[1]
    if is_op(node, aten.mul.Tensor) and len(node.args) == 2:
        left, right = (integer_bounds(arg) for arg in node.args)
        if left is None or right is None:
            return None
        products = [a * b for a in left for b in right]
        return min(products), max(products)
    return None


def _exact_in(node: object, limit: int) -> bool:
    """Whether every value of the expression and of each of its integer sub-expressions lies within ±limit."""
    bounds = integer_bounds(node)
    if bounds is None or max(abs(bounds[0]), abs(bounds[1])) > limit:
        return False
    if not isinstance(node, torch.fx.Node) or is_op(node, prims.iota.default):
        return True
    return all(_exact_in(arg, limit) for arg in node.args if isinstance(arg, (torch.fx.Node, int)))


def _in_float(graph: torch.fx.Graph, node: object, dtype: torch.dtype, made: dict) -> object:
    """The expression recomputed in ``dtype``: its leaves converted (vectors, before any broadcast), its integer
    arithmetic done in float. ``made`` shares nodes between the consumers of one expression."""
    if not isinstance(node, torch.fx.Node):
        return node
    key = (node, dtype)
    if key not in made:
        if is_op(node, (aten.neg.default, aten.abs.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)):
            args = tuple(_in_float(graph, arg, dtype, made) for arg in node.args)
            made[key] = call_op(graph, node.target, args, dict(node.kwargs))
        else:
            made[key] = call_op(graph, prims.convert_element_type.default, (node, dtype))
    return made[key]


def _float_dtype(consumer: torch.fx.Node) -> Optional[torch.dtype]:
    value = consumer.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return value.dtype if value.dtype in _EXACT_RANGE else None


def convert_positions_before_arithmetic(graph: torch.fx.Graph) -> None:
    """Post-grad pass: an integer expression over ``arange`` positions that a float32/float64 op reads by value is
    recomputed from its converted leaves, where the bounds prove the float arithmetic exact."""
    if not config.float_positions:
        return
    made: dict = {}
    for consumer in list(graph.nodes):
        slots = _FLOAT_CONSUMERS.get(consumer.target) if consumer.op == "call_function" else None
        dtype = _float_dtype(consumer) if slots else None
        if dtype is None:
            continue
        for slot in slots:
            operand = consumer.args[slot] if slot < len(consumer.args) else None
            # A leaf (a position vector itself) converts per element already: nothing to move.
            if not isinstance(operand, torch.fx.Node) or not _is_integer(operand.meta.get("val")):
                continue
            if not is_op(operand, (aten.neg.default, aten.abs.default, aten.add.Tensor, aten.sub.Tensor,
                                   aten.mul.Tensor)):
                continue
            if not _exact_in(operand, _EXACT_RANGE[dtype]):
                continue
            with graph.inserting_before(consumer):
                replacement = _in_float(graph, operand, dtype, made)
            if consumer.target is prims.convert_element_type.default:
                consumer.replace_all_uses_with(replacement)
            else:
                consumer.replace_input_with(operand, replacement)
            counters["inductor"]["flashlight_float_positions"] += 1
            log.info("integer positions %s converted to %s before their arithmetic", operand.name, dtype)
    graph.eliminate_dead_code()
