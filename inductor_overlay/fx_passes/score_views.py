"""Move views that regroup the scores' batch dims out of the way of the attention pass.

Hugging Face code often views the scores between batch groupings on their way to the softmax: ``[B·H, M, N]``
from a ``bmm`` of ``[B·H, ·, D]`` operands, ``[B, H, M, N]`` to add a ``[B, 1, M, N]`` mask. The attention pass
follows the scores through elementwise ops in one shape, and a view in the middle of that chain stops it. Two exact
rewrites take such a view off the chain:

* below the softmax (XGLM, TrOCR, MVP, FSMT, SpeechT5, LED: the mask is added on ``[B, H, M, N]`` and the scores
  are viewed back to ``[B·H, M, N]`` for the softmax): a softmax over the last dim does not care how the dims
  before it are grouped, so ``softmax(view(x))`` becomes ``view(softmax(x))``, and the view ends up between the
  probabilities and the output matmul, where the attention pass looks through it;
* up to the scores' matmul (DeBERTa-v2: a relative-position bias is added on ``[B·H, M, N]``, the mask on
  ``[B, H, M, N]``): ``view(f(a, b))`` for an elementwise ``f`` becomes ``f(view(a), view(b))``, repeated until the
  view stands on the matmul, where it is the scores' batch view the attention pass expects.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from inductor_overlay import config
from inductor_overlay.fx_passes.fx_helpers import _MATMULS, _RESHAPES, call_op, is_backward, numbered_as
from inductor_overlay.fx_passes.attention_region import (
    Decline,
    is_matmul_fed_by,
    match_normalised_exp,
    reaches_row_max,
)
from inductor_overlay.fx_passes.block_sparsity import is_op

aten = torch.ops.aten
prims = torch.ops.prims
log = logging.getLogger("flashlight.attention_fusion")

_ROW_REDUCTIONS = (aten.amax.default, aten.sum.dim_IntList)


def _batch_regrouping(node: object) -> bool:
    """A reshape that changes only the dims before the last two (rows and columns keep their sizes)."""
    if not is_op(node, _RESHAPES) or not isinstance(node.args[0], torch.fx.Node):
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    if before is None or after is None or min(before.dim(), after.dim()) < 3:
        return False
    return tuple(before.shape) != tuple(after.shape) and tuple(before.shape[-2:]) == tuple(after.shape[-2:])


def _replay_on(graph: torch.fx.Graph, softmax: list[torch.fx.Node], logits: torch.fx.Node, view: torch.fx.Node) -> torch.fx.Node:
    """The softmax nodes recomputed from the view's source (reductions over dim -1, whatever the rank)."""
    replaced = {view: view.args[0]}
    for node in [logits, *softmax] if logits is not view else softmax:
        args = torch.fx.node.map_arg(node.args, lambda arg: replaced.get(arg, arg))
        if is_op(node, _ROW_REDUCTIONS):
            args = (args[0], [-1], True, *args[3:])
        replaced[node] = numbered_as(node, call_op(graph, node.target, args, dict(node.kwargs)))
    return replaced[softmax[-1]]


def _sink_below_softmax(graph: torch.fx.Graph, p: torch.fx.Node) -> None:
    matched = match_normalised_exp(p)
    if isinstance(matched, Decline) or not is_matmul_fed_by(p):
        return
    logits, softmax, _ = matched
    view = logits.args[0] if is_op(logits, prims.convert_element_type.default) else logits
    if not _batch_regrouping(view) or not _elementwise(view.args[0]):
        return  # (a view straight off the matmul is the scores' batch view the attention pass expects)
    with graph.inserting_before(p):
        probabilities = _replay_on(graph, softmax, logits, view)
        regrouped = numbered_as(view, call_op(graph, aten.reshape.default, (probabilities, list(p.meta["val"].shape))))
    p.replace_all_uses_with(regrouped)
    for node in reversed([view, *([logits] if logits is not view else []), *softmax]):
        if not node.users:
            graph.erase_node(node)
    log.info("softmax %s moved below the view %s of its logits", p.name, view.name)


def _elementwise(node: object) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.pointwise in node.target.tags
    )


def _pointwise(node: object) -> bool:
    """An elementwise op used once (moving a view above it computes it once still)."""
    return _elementwise(node) and len(node.users) == 1


def _dim_groups(before: tuple, after: tuple) -> Optional[list[tuple[range, range]]]:
    """The reshape from ``before`` to ``after`` as groups of consecutive dims with equal products (a split, a merge or
    a dim kept), or None when the sizes do not factor that way."""
    groups, i, j = [], 0, 0
    while i < len(before) or j < len(after):
        start_i, start_j, left, right = i, j, 1, 1
        while i < len(before) or j < len(after):
            if left <= right and i < len(before):
                left, i = left * before[i], i + 1
            elif j < len(after):
                right, j = right * after[j], j + 1
            else:
                return None
            if left == right and (i == len(before) or before[i] != 1 or j == len(after)):
                break
        if left != right:
            return None
        groups.append((range(start_i, i), range(start_j, j)))
    return groups


def _regrouped_shape(operand: object, before: tuple, after: tuple) -> Optional[object]:
    """The shape ``operand`` takes so that it broadcasts against the output regrouped from ``before`` to ``after``
    batch dims as it did before: in each group of dims the reshape splits or merges, its own sizes regrouped, or all
    ones where it is broadcast over the whole group; ``()`` where it needs no change (a scalar, or no batch dims: it
    broadcasts from the right); None where it is broadcast over only part of a group."""
    value = operand.meta.get("val") if isinstance(operand, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() <= 2:
        return ()
    lead, rest = tuple(value.shape[: value.dim() - 2]), list(value.shape[value.dim() - 2 :])
    if len(lead) > len(before):
        return None
    lead = (1,) * (len(before) - len(lead)) + lead  # broadcast from the right
    groups = _dim_groups(before, after)
    if groups is None:
        return None
    shape = []
    for source, target in groups:
        sizes = [lead[d] for d in source]
        if sizes == [before[d] for d in source]:
            shape += [after[d] for d in target]
        elif all(size == 1 for size in sizes):
            shape += [1] * len(target)
        else:
            return None
    return [*shape, *rest]


def _lifts_to_a_matmul(view: torch.fx.Node) -> bool:
    """Whether pushing the view up through single-use elementwise ops reaches a matmul, every operand on the way
    taking the regrouping."""
    before, after = (tuple(n.meta["val"].shape[:-2]) for n in (view.args[0], view))
    stack = [view.args[0]]
    while stack:
        node = stack.pop()
        while is_op(node, _RESHAPES):  # views of the matmul: the new view of them is one more view of it
            node = node.args[0]
        if is_op(node, _MATMULS):
            return True
        if not _pointwise(node):
            continue
        operands = node.all_input_nodes
        if any(_regrouped_shape(a, before, after) is None for a in operands):
            return False
        stack.extend(operands)
    return False


def _lift(graph: torch.fx.Graph, view: torch.fx.Node) -> None:
    """``view(f(a, b))`` → ``f(view(a), view(b))``, then the same for each new view on a single-use elementwise op."""
    source = view.args[0]
    if not _pointwise(source):
        return
    before, after = (tuple(n.meta["val"].shape[:-2]) for n in (source, view))
    new_views = []

    def regrouped(operand: object) -> object:
        shape = _regrouped_shape(operand, before, after)
        if shape == ():
            return operand
        new_views.append(numbered_as(view, call_op(graph, aten.reshape.default, (operand, shape))))
        return new_views[-1]

    with graph.inserting_before(view):
        args = torch.fx.node.map_arg(source.args, regrouped)
        kwargs = torch.fx.node.map_arg(source.kwargs, regrouped)
        lifted = numbered_as(source, call_op(graph, source.target, args, kwargs))
    view.replace_all_uses_with(lifted)
    graph.erase_node(view)
    graph.erase_node(source)
    for new_view in new_views:
        if _batch_regrouping(new_view):
            _lift(graph, new_view)


def move_batch_views_off_score_chains(graph: torch.fx.Graph) -> None:
    """Post-grad pass: views that regroup the scores' batch dims between their matmul and a softmax feeding a
    matmul move below the softmax or up to the scores' matmul."""
    if not config.attention_fusion:
        return
    # (In a joint graph, the forward's ops only.)
    for p in [n for n in graph.nodes if is_op(n, aten.div.Tensor) and not is_backward(n)]:
        _sink_below_softmax(graph, p)
    for view in [n for n in graph.nodes if _batch_regrouping(n) and not is_backward(n)]:
        if _pointwise(view.args[0]) and reaches_row_max(view) and _lifts_to_a_matmul(view):
            log.info("view %s moved up to the scores' matmul", view.name)
            _lift(graph, view)
