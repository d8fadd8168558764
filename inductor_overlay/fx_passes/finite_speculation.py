"""Speculate that the scores are finite: run the chain without its guards against NaN and infinity.

The DIFF Transformer's code applies ``nan_to_num`` to its scores, which decomposes into three compares and three
``where``s per score; they also hide the chain's constant scale from the exp2 fold and its mask from the loop for
visible tiles. For finite scores such a guard changes nothing. So the kernel runs a fast chain, where each guard
``where(isnan(x) | x == ±inf, c, x)`` passes ``x`` through, and checks every row after its loop (the kernel's
``speculation_check``); a row tile whose check fails runs again with the whole chain. A NaN or a +inf reaching the
softmax leaves a NaN sum or an infinite running max, which the check finds. A -inf weighs 0 in the fast chain; the guard
gives it a value instead (nan_to_num: -FLT_MAX), which the ops up to the softmax carry to some logit g < 0. That
weighs 0 too whenever the row max exceeds g by more than exp can weigh: the check also requires the row max to lie
within ±|g|/4 (``speculation_bound``), and speculation needs |g|/4 >= MIN_BOUND.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from inductor_overlay.fx_passes.block_sparsity import (
    constant_value,
    depends_on,
    is_op,
    positive_scalar,
)
from inductor_overlay.fx_passes.logit_scale import zero_or_minus_inf

aten = torch.ops.aten
prims = torch.ops.prims

# The least row-max bound worth speculating for: logits of magnitude above it fall back to the whole chain. A -inf
# score then weighs exp(g - max) <= exp(-3|g|/4) <= exp(-768) in eager, which is 0 in float32, as in the fast chain.
MIN_BOUND = 256.0
# The bound where -inf stays -inf (a guard against NaN alone): finite, so that it is a number in the kernel's source.
MAX_BOUND = 2.0**100

_NON_FINITE_TESTS = (aten.isnan.default, aten.isinf.default, aten.isposinf.default, aten.isneginf.default)


def _widened_from(node: object) -> object:
    """``x`` when ``node`` converts ``x`` to a floating dtype of at least its range (finite stays finite), else ``node``."""
    while is_op(node, prims.convert_element_type.default) and node.args[1].is_floating_point:
        source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if source is None or not source.is_floating_point() or torch.finfo(node.args[1]).max < torch.finfo(source.dtype).max:
            break
        node = node.args[0]
    return node


def _tested_value(condition: object) -> Optional[torch.fx.Node]:
    """``x`` when ``condition`` is true only where ``x`` is NaN or infinite (an or of such tests of one ``x``)."""
    if is_op(condition, (aten.logical_or.default, aten.bitwise_or.Tensor)):
        tested = {_tested_value(arg) for arg in condition.args}
        return tested.pop() if len(tested) == 1 and None not in tested else None
    if is_op(condition, _NON_FINITE_TESTS):
        return _widened_from(condition.args[0])
    if is_op(condition, (aten.eq.Scalar, aten.eq.Tensor)) and abs(constant_value(condition.args[1]) or 0.0) == math.inf:
        value = condition.args[0]
        return _widened_from(value.args[0] if is_op(value, aten.abs.default) else value)
    if is_op(condition, (aten.ne.Tensor,)) and condition.args[0] is condition.args[1]:
        return _widened_from(condition.args[0])  # x != x: isnan
    return None


def finite_guards(chain: list[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each ``where`` of the chain that equals some ``x`` wherever ``x`` is finite, mapped to that ``x``: its condition
    tests ``x`` (or ``x`` widened to another float dtype) for NaN or infinity, one branch is a constant and the
    other ``x`` or another such guard of ``x``."""
    guards: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in chain:
        if not is_op(node, aten.where.self):
            continue
        condition, if_true, if_false = node.args
        tested = _tested_value(condition)
        if tested is None or constant_value(if_true) is None:
            continue
        kept = guards.get(if_false, if_false)
        if _widened_from(kept) is tested:
            guards[node] = kept
    return guards


def _outermost(guards: dict[torch.fx.Node, torch.fx.Node]) -> list[torch.fx.Node]:
    return [guard for guard in guards if not any(user in guards for user in guard.users)]


def _true_at_minus_inf(condition: torch.fx.Node) -> bool:
    """Whether a condition ``_tested_value`` accepts holds where its ``x`` is -inf."""
    if is_op(condition, (aten.logical_or.default, aten.bitwise_or.Tensor)):
        return any(_true_at_minus_inf(arg) for arg in condition.args)
    if is_op(condition, (aten.eq.Scalar, aten.eq.Tensor)):
        return is_op(condition.args[0], aten.abs.default) or constant_value(condition.args[1]) == -math.inf
    return is_op(condition, (aten.isinf.default, aten.isneginf.default))


def _value_at_minus_inf(guard: torch.fx.Node, guards: dict[torch.fx.Node, torch.fx.Node]) -> float:
    """What a stack of guards gives where its ``x`` is -inf: the constant of the outermost guard whose condition
    holds there, or -inf."""
    node = guard
    while node in guards:
        condition, if_true, if_false = node.args
        if _true_at_minus_inf(condition):
            return constant_value(if_true)
        node = if_false
    return -math.inf


def _factor_to_softmax(guard: torch.fx.Node, logits: torch.fx.Node, scores: torch.fx.Node, scale: float) -> Optional[float]:
    """The positive factor by which the guard's value reaches the logits, through ops that keep -inf at -inf and
    scale a finite value by it: floating conversions, positive constant factors (times the softmax's ``scale``), a
    bias that is 0 or -inf, and masks that replace it by a constant where a condition that does not read the
    scores holds. One path, no other use: none of these has another operand that reads the scores. Else None."""
    node, factor, memo = guard, scale, {}
    while node is not logits:
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        if any(depends_on(arg, scores, memo) for arg in user.all_input_nodes if arg is not node):
            return None
        if is_op(user, prims.convert_element_type.default):
            ok = user.args[1].is_floating_point
        elif is_op(user, (aten.mul.Tensor, aten.div.Tensor)) and len(user.args) == 2:
            value = positive_scalar(user.args[1] if user.args[0] is node else user.args[0])
            ok = value is not None and (user.target is aten.mul.Tensor or user.args[0] is node)
            if ok:
                factor *= value if user.target is aten.mul.Tensor else 1.0 / value
        elif is_op(user, aten.add.Tensor):
            ok = user.kwargs.get("alpha", 1) == 1 and any(zero_or_minus_inf(arg) for arg in user.args if arg is not node)
        elif is_op(user, aten.where.self):
            condition, if_true, if_false = user.args
            ok = condition is not node and constant_value(if_false if if_true is node else if_true) is not None
        else:
            ok = False
        if not ok:
            return None
        node = user
    return factor


def speculation_bound(
    chain: list[torch.fx.Node], logits: torch.fx.Node, scores: torch.fx.Node, scale: float
) -> tuple[dict[torch.fx.Node, torch.fx.Node], float]:
    """The chain's finite guards (``finite_guards``) and the bound on the row max (in the logits' units, see the
    module's docstring) when the kernel may run without them; else no guards."""
    guards = finite_guards(chain)
    bound = math.inf
    for guard in _outermost(guards):
        factor = _factor_to_softmax(guard, logits, scores, scale)
        if factor is None:
            return {}, math.inf
        value = _value_at_minus_inf(guard, guards) * factor
        bound = min(bound, -value / 4)  # inf when -inf stays -inf
    return (guards, min(bound, MAX_BOUND)) if guards and bound >= MIN_BOUND else ({}, math.inf)


def guard_only_nodes(chain: list[torch.fx.Node], guards: dict[torch.fx.Node, torch.fx.Node]) -> frozenset:
    """The guards and the nodes only they use (their tests and constants): what the fast chain does not compute."""
    dropped, kept = set(guards), set(guards.values())
    for node in reversed(chain):
        if node not in kept and node.users and all(user in dropped for user in node.users):
            dropped.add(node)
    return frozenset(dropped)

