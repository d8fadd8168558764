"""Fold the score chain's constant scale into the kernel's exp2 factor, and its derivative's into the backward's sums.

Most chains scale the scores by a constant (``/ sqrt(d)``) and mask some of them to -inf. The kernel multiplies the
logits by log2(e) anyway; when the chain is only positive constant factors and -inf masks, the factors can join
that multiply, so the kernel scales each logit and subtracts the row max in one fma instead of two multiplies and
a subtraction. The row max commutes with a positive factor exactly (rounding is monotone), and -inf stays -inf.
A finite fill the mask analysis proved absorbing (``block_sparsity.absorbing_fill_masks``) is scaled by the folded
factor too; the fold is kept only if it still reaches the softmax at most ``ABSORBING_FILL``, so it still adds
exactly 0 wherever eager's did.

The chain's derivative is linear in the gradient of the logits: a constant factor on the way from that gradient to
the derivative's output (1/√d, a soft-cap's c and 1/c) can leave the backward's loops and multiply dK and dQ once,
as they are stored (``fold_gradient_factors``). The factors' product is the same; each element skips their
multiplies, and rounds once fewer.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from inductor_overlay.fx_passes.block_sparsity import constant_value, is_minus_inf, positive_scalar

aten = torch.ops.aten
prims = torch.ops.prims


def _scale_step(node: torch.fx.Node, scaled: dict) -> Optional[tuple[torch.fx.Node, float]]:
    """(input, factor) when ``node`` multiplies or divides a scaled value by a positive constant."""
    if node.target not in (aten.mul.Tensor, aten.div.Tensor) or len(node.args) != 2:
        return None
    first, second = node.args
    if node.target is aten.mul.Tensor and first not in scaled:
        first, second = second, first
    factor = positive_scalar(second)
    if first not in scaled or factor is None:
        return None
    return first, factor if node.target is aten.mul.Tensor else 1.0 / factor


def _passes_scale_through(node: torch.fx.Node, scaled: dict, fills: Optional[list]) -> bool:
    """Nodes that commute with a positive factor: floating dtype conversions, and ``where`` choosing between the
    scaled value and -inf (a mask whose condition does not read the scores), or a finite constant when ``fills``
    collects them (the caller bounds them once the factor is known); and adding a bias that is 0 or -inf."""
    if node.target is prims.convert_element_type.default:
        return node.args[0] in scaled and node.args[1].is_floating_point
    if node.target is aten.add.Tensor:
        return node.kwargs.get("alpha", 1) == 1 and sum(arg in scaled for arg in node.args) == 1 and any(
            zero_or_minus_inf(arg) for arg in node.args
        )
    if node.target is not aten.where.self:
        return False
    condition, if_true, if_false = node.args
    if condition in scaled or (if_true in scaled) == (if_false in scaled):
        return False
    fill = if_false if if_true in scaled else if_true
    if is_minus_inf(fill):
        return True
    value = constant_value(fill)
    if fills is None or value is None or value >= 0:
        return False
    fills.append(value)
    return True


def zero_or_minus_inf(node: object) -> bool:
    """A bias ``where(cond, -inf, 0)`` (in any float dtype): ``c·x + b = c·(x + b)`` for every c > 0."""
    while isinstance(node, torch.fx.Node) and node.target is prims.convert_element_type.default:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target is aten.where.self):
        return False
    branches = {constant_value(node.args[1]), constant_value(node.args[2])}
    return branches == {0.0, -math.inf}


def fold_constant_scale(
    module: torch.fx.GraphModule, fill_bound: Optional[float] = None
) -> Optional[tuple[torch.fx.GraphModule, float]]:
    """The chain without its constant factors, and their product; None unless every node the scores reach is a
    positive constant factor or passes the scale through (see above) and the output is the scaled value. With
    ``fill_bound``, masks may fill with finite constants whose product with the folded factor is at most it."""
    graph = module.graph
    score = next(node for node in graph.nodes if node.op == "placeholder")
    scaled = {score: 1.0}  # nodes that are the scores times a known positive factor
    fills: Optional[list] = [] if fill_bound is not None else None
    bypass: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not any(arg in scaled for arg in node.all_input_nodes):
            continue
        step = _scale_step(node, scaled)
        if step is not None:
            scaled[node] = scaled[step[0]] * step[1]
            bypass[node] = step[0]
        elif _passes_scale_through(node, scaled, fills):
            source = next(arg for arg in node.all_input_nodes if arg in scaled)
            scaled[node] = scaled[source]
        else:
            return None
    output = next(node for node in graph.nodes if node.op == "output")
    result = output.args[0]
    if result not in scaled or not bypass or any(fill * scaled[result] > fill_bound for fill in fills or ()):
        return None
    folded = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node in bypass:
            env[node] = env[bypass[node]]
        else:
            env[node] = folded.node_copy(node, lambda arg: env[arg])
    folded.eliminate_dead_code()
    return torch.fx.GraphModule(torch.nn.Module(), folded), scaled[result]


def _same_value_type(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``node`` has ``source``'s dtype and shape (dropping it changes neither)."""
    values = [n.meta.get("val") for n in (node, source)]
    return (all(isinstance(v, torch.Tensor) for v in values) and values[0].dtype == values[1].dtype
            and values[0].shape == values[1].shape)


# Dtypes with float32's range: a value the derivative converts to one of them keeps its range without the factors
# taken out (float16's would overflow where the factor had made it small).
_WIDE_FLOATS = (torch.bfloat16, torch.float32, torch.float64)


def _constant_factor(node: object) -> Optional[float]:
    """A constant's value as the op multiplies by it: a number, or a floating constant tensor's value rounded to its
    dtype; None for an integer tensor (it holds the value truncated) or anything else."""
    value = constant_value(node)
    if value is None or not isinstance(node, torch.fx.Node):
        return value
    dtype = getattr(node.meta.get("val"), "dtype", None)
    return torch.tensor(value, dtype=dtype).item() if dtype in _WIDE_FLOATS else None


def _linear_step(node: torch.fx.Node, linear: dict) -> Optional[tuple[torch.fx.Node, float, bool]]:
    """(the linear input, the constant factor ``node`` applies to it, whether ``node`` is that factor alone and can
    go) when ``node`` is linear in one value of ``linear`` (a factor of 1.0 where the other operand is not a
    constant: a tensor the gradient does not reach)."""
    target, args = node.target, node.args
    if target is prims.convert_element_type.default:
        return (args[0], 1.0, False) if args[0] in linear and args[1] in _WIDE_FLOATS else None
    if target is aten._to_copy.default:
        plain = set(node.kwargs) <= {"dtype", "layout", "device"} and node.kwargs.get("dtype") in _WIDE_FLOATS
        return (args[0], 1.0, False) if plain and args[0] in linear else None
    if target is aten.neg.default:
        return (args[0], -1.0, True) if _same_value_type(node, args[0]) else None
    if target in (aten.mul.Tensor, aten.div.Tensor) and len(args) == 2:
        first, second = args
        if target is aten.mul.Tensor and first not in linear:
            first, second = second, first
        if first not in linear or second in linear:
            return None
        factor = _constant_factor(second)
        if factor is None:
            return (first, 1.0, False) if constant_value(second) is None else None
        if factor == 0.0 or not math.isfinite(factor) or not _same_value_type(node, first):
            return None
        return first, factor if target is aten.mul.Tensor else 1.0 / factor, True
    if target is aten.where.self:
        condition, if_true, if_false = args
        branch = if_true if if_true in linear else if_false
        other = if_false if branch is if_true else if_true
        if condition in linear or other in linear or constant_value(other) != 0.0:
            return None
        return branch, 1.0, False
    return None


def fold_gradient_factors(module: torch.fx.GraphModule) -> Optional[tuple[torch.fx.GraphModule, float]]:
    """The chain's derivative (its last input the gradient of the logits) without the constant factors between
    that gradient and its output, and their product; None unless every op the gradient reaches is linear in it
    (``_linear_step``: constant factors, a product with a tensor it does not reach, a dtype conversion, a mask
    filling 0) and some constant factor is there."""
    graph = module.graph
    grad = [node for node in graph.nodes if node.op == "placeholder"][-1]
    factors = {grad: 1.0}
    bypass: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not any(arg in factors for arg in node.all_input_nodes):
            continue
        step = _linear_step(node, factors)
        if step is None:
            return None
        source, factor, removable = step
        factors[node] = factors[source] * factor
        if removable:
            bypass[node] = source
    result = next(node for node in graph.nodes if node.op == "output").args[0]
    if result not in factors or not bypass:
        return None
    single = torch.tensor(factors[result], dtype=torch.float32).item()  # the kernel applies it in float32
    if single == 0.0 or not math.isfinite(single):
        return None
    folded = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        env[node] = env[bypass[node]] if node in bypass else folded.node_copy(node, lambda arg: env[arg])
    folded.eliminate_dead_code()
    return torch.fx.GraphModule(module, folded), factors[result]  # (the module's constants stay its attributes)


def fold_common_gradient_factor(modules: list) -> tuple[list, float]:
    """The derivatives ``modules`` (None entries kept) without their constant factors where all have the same one
    (``fold_gradient_factors``), and that factor; else as they are, and 1."""
    folds = [fold_gradient_factors(module) for module in modules if module is not None]
    if not folds or any(fold is None for fold in folds) or len({factor for _, factor in folds}) != 1:
        return modules, 1.0
    folded = iter(module for module, _ in folds)
    return [None if module is None else next(folded) for module in modules], folds[0][1]
