"""The score chain as GraphModules: (scores, *captured, *sizes) -> logits, the chain without some of its nodes, or a
value of the chain alone. The fused node carries them as subgraphs; Inductor lowers them at the tile's positions."""

from __future__ import annotations

from typing import Optional

import torch

from inductor_overlay.fx_passes.block_sparsity import constant_value, depends_on, fill_is_true_branch
from inductor_overlay.fx_passes.block_sparsity import is_op as _is
from inductor_overlay.fx_passes.fx_helpers import _val, call_op, aten, prims
from inductor_overlay.fx_passes.attention_region import AttentionRegion, _size_source


def _reroute_size_reads(region: AttentionRegion) -> None:
    """Size reads of the nodes fusion removes read the same sizes from graph inputs or the operands instead."""
    operands = [region.q.node, region.kt.node, region.v.node]
    reads = [u for node in region.pv.graph.nodes if node in region.internal for u in node.users if u not in region.internal]
    for read in dict.fromkeys(reads):  # in graph order, each once
        found = _size_source(read, operands)
        if found is not None:
            source, dim = found
            if dim is not None:
                with read.graph.inserting_before(read):
                    source = call_op(read.graph, aten.sym_size.int, (source, dim))
            read.replace_all_uses_with(source)


def _chain_inputs(region: AttentionRegion) -> tuple[torch.fx.Graph, dict]:
    """A new graph whose placeholders are the chain's inputs, (scores, *captured, *captured_sizes), and the map
    from the user's nodes to them (the score root to the scores, times the scale taken off q or k)."""
    graph = torch.fx.Graph()
    scores = graph.placeholder("scores")
    env = {region.score_root: scores}
    for index, value in enumerate(region.captured):
        env[value] = graph.placeholder(f"captured_{index}")
    for index, value in enumerate(region.captured_sizes):
        env[value] = graph.placeholder(f"size_{index}")
    if region.operand_scale != 1.0:
        env[region.score_root] = graph.call_function(aten.mul.Tensor, (scores, region.operand_scale))
    return graph, env


def _score_chain_module(
    region: AttentionRegion, unmasked: frozenset = frozenset(), guards: Optional[dict] = None
) -> torch.fx.GraphModule:
    """The chain from scores to logits as its own graph: (scores, *captured) -> logits. The ``where(cond, -inf, x)``
    nodes in ``unmasked`` pass ``x`` through (for tiles where ``cond`` is false everywhere), and an additive mask's
    add there passes the scores through (for tiles where its bias is 0). The finite guards in ``guards`` pass
    their ``x`` through (``finite_speculation``)."""
    graph, env = _chain_inputs(region)
    zeros: set[torch.fx.Node] = set()  # chain nodes that are 0 on these tiles: a bias ``where(cond, -inf, 0)``
    for node in region.chain:
        if guards and node in guards:  # x, in the guard's dtype
            env[node] = _in_dtype_of(graph, env[guards[node]], guards[node], node)
            continue
        if node in unmasked and node.target is aten.add.Tensor:  # an additive mask: its bias is 0 on these tiles
            addend = next(arg for arg in node.args if depends_on(arg, region.score_root, {}))
        else:  # x + a dropped position mask's 0
            addend = _added_to_zero(node, zeros)
        if addend is not None:  # the sum is x, in the sum's dtype
            env[node] = _in_dtype_of(graph, env[addend], addend, node)
            continue
        if node in unmasked:
            condition, if_true, if_false = node.args
            kept = if_false if fill_is_true_branch(node) else if_true
            env[node] = env[kept] if isinstance(kept, torch.fx.Node) else graph.call_function(
                aten.full_like.default, (env[region.score_root], kept)
            )
            if constant_value(kept) == 0.0:
                zeros.add(node)
            continue
        if _is(node, prims.convert_element_type.default) and node.args[0] in zeros:
            zeros.add(node)
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    logits = env[region.logits]
    if region.logit_scale != 1.0:
        logits = graph.call_function(aten.mul.Tensor, (logits, region.logit_scale))
    graph.output(logits)
    graph.eliminate_dead_code()  # the bypassed masks' conditions
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _in_dtype_of(graph: torch.fx.Graph, value: torch.fx.Node, source: torch.fx.Node, node: torch.fx.Node) -> torch.fx.Node:
    """``value`` (the copy of ``source`` in ``graph``) standing for ``node``: converted to ``node``'s dtype if it differs."""
    if _val(source).dtype == _val(node).dtype:
        return value
    return graph.call_function(prims.convert_element_type.default, (value, _val(node).dtype))


def _added_to_zero(node: torch.fx.Node, zeros: set) -> Optional[torch.fx.Node]:
    """``x`` when ``node`` is ``x + z`` with ``z`` in ``zeros`` and of ``x``'s shape (the sum is ``x``)."""
    if not (_is(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 2):
        return None
    for zero, kept in (node.args, node.args[::-1]):
        if zero in zeros and _val(kept) is not None and _val(kept).shape == _val(node).shape:
            return kept
    return None


def _chain_value_module(region: AttentionRegion, value: torch.fx.Node, shape: list) -> torch.fx.GraphModule:
    """(scores, *captured) -> ``value`` (a node of the chain or a captured tensor), expanded to ``shape``."""
    graph, env = _chain_inputs(region)
    for node in region.chain:
        if value in env:
            break
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(graph.call_function(aten.expand.default, (env[value], shape)))
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(torch.nn.Module(), graph)
