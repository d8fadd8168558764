"""Rewrite OpenFold's pair output, a matmul of the transposed probabilities, into the sum the kernel accumulates.

Invariant point attention also reduces its probabilities ``a`` ``[*lead, H, M, N]`` against the pair tensor ``z``
``[*lead, M, N, C]``. The attention fusion takes that as ``(a.unsqueeze(-1) * z.unsqueeze(-4)).sum(-2)`` (a
``PairReduction``); OpenFold writes it as ``matmul(a.transpose(-2, -3), z)``, a batched matmul over the query
positions whose ``[*lead, M, H, C]`` result holds the same sums:
``out[.., m, h, c] = Σ_n a[.., h, m, n]·z[.., m, n, c]``.
This pass replaces such a matmul by that sum, transposed back, so that the attention fuses with it as its second
output. It keeps the rewrite only when the attention then fuses with this sum (``find_attention`` accepts it), and
otherwise leaves the graph as it was.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from inductor_overlay import config
from inductor_overlay.fx_passes.fx_helpers import _MATMULS, _batch_source, _val, call_op
from inductor_overlay.fx_passes.attention_region import Decline, find_attention
from inductor_overlay.fx_passes.block_sparsity import is_op as _is

log = logging.getLogger("flashlight.attention_fusion")

aten = torch.ops.aten


def _transposed_probabilities(operand: torch.fx.Node) -> Optional[torch.fx.Node]:
    """``a`` when the bmm operand is ``a.transpose(-2, -3)`` with its leading dims and rows flattened together."""
    source = _batch_source(operand)
    node = source.node
    if source.transposed or not _is(node, aten.permute.default):
        return None
    rank = _val(node).dim()
    swaps_heads_and_rows = list(node.args[1]) == [*range(rank - 3), rank - 2, rank - 3, rank - 1]
    return node.args[0] if rank >= 3 and swaps_heads_and_rows else None


def _sum_form(bmm: torch.fx.Node) -> Optional[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """The sum that ``bmm`` computes, built before it (its result shaped as the bmm's output), and the new nodes;
    None when ``bmm`` is not such a pair matmul."""
    left, right = bmm.args
    probabilities = _transposed_probabilities(left)
    pair = _batch_source(right)
    if probabilities is None or pair.transposed:
        return None
    *lead, heads, rows, columns = _val(probabilities).shape
    if tuple(_val(pair.node).shape[:-1]) != (*lead, rows, columns):
        return None
    graph, new = bmm.graph, []

    def op(target, *args, **kwargs):
        new.append(call_op(graph, target, args, kwargs))
        return new[-1]

    with graph.inserting_before(bmm):
        rank = len(lead) + 3
        weights = op(aten.unsqueeze.default, probabilities, -1)  # [*lead, H, M, N, 1]
        products = op(aten.mul.Tensor, weights, op(aten.unsqueeze.default, pair.node, -4))
        sums = op(aten.sum.dim_IntList, products, [-2])  # [*lead, H, M, C]
        by_row = op(aten.permute.default, sums, [*range(rank - 3), rank - 2, rank - 3, rank - 1])
        contiguous = op(aten.clone.default, by_row, memory_format=torch.contiguous_format)
        result = op(aten.view.default, contiguous, list(_val(bmm).shape))
    return result, new


def _exclusive_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and the nodes computed only for it (its view chains), outputs first."""
    found, stack = [node], list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current.op == "call_function" and all(user in found for user in current.users) and current not in found:
            found.append(current)
            stack.extend(current.all_input_nodes)
    return found


def _fuses_with(sums: torch.fx.Node, dead: frozenset) -> bool:
    """Whether some attention of the graph takes ``sums`` as its pair reduction."""
    for pv in [n for n in sums.graph.nodes if _is(n, _MATMULS) and n not in dead]:
        region = find_attention(pv, dead)
        if not isinstance(region, Decline) and region.pair is not None and region.pair.result is sums:
            return True
    return False


def rewrite_pair_matmuls(graph: torch.fx.Graph) -> None:
    """Post-grad pass: each pair matmul whose attention then fuses becomes the sum form (see the module doc)."""
    if not config.attention_fusion:
        return
    for bmm in [n for n in graph.nodes if _is(n, aten.bmm.default)]:
        if _val(bmm) is None or getattr(bmm, "_erased", False):
            continue
        built = _sum_form(bmm)
        if built is None:
            continue
        result, new = built
        old = _exclusive_inputs(bmm)
        bmm.replace_all_uses_with(result)
        sums = next(node for node in new if node.target is aten.sum.dim_IntList)
        if _fuses_with(sums, frozenset(old)):
            for node in old:
                graph.erase_node(node)
            log.info("pair matmul %s rewritten as the sum the attention kernel accumulates", bmm.name)
            continue
        result.replace_all_uses_with(bmm)
        for node in reversed(new):
            graph.erase_node(node)
