"""A region of the graph run as one of two copies of itself, chosen on the host by a check of tensors made outside
the graph (``mask_checks``): ``torch.cond(flag, first, second, operands)`` where each branch is a copy of the
region's nodes that a route rewrites (``causal_tensor_route``, ``arange_positions_route``).

Both branches compute the region's output from the same operands; a route may only rewrite its first branch into a
form that equals the region wherever the flag is True. The flag is a host value (a 0-d bool tensor on the CPU):
the branch costs a Python ``if`` in the graph's wrapper, which is why the routes run only where that wrapper is
Python and outside CUDA graphs.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Callable, Optional

import torch
from torch._inductor.virtualized import V
from torch._prims_common import is_non_overlapping_and_dense_or_false

from inductor_overlay.fx_passes.attention_region import AttentionRegion
from inductor_overlay.fx_passes.fx_helpers import _RESHAPES, _VIEWS, subgraph
from inductor_overlay.fx_passes.mask_tables import _shared_table

aten = torch.ops.aten


def python_wrapper_without_graphs() -> bool:
    """The graph's code runs in Python, outside CUDA graphs: a branch on a host value is free there, while CUDA
    graphs (``mode="reduce-overhead"``) would be given up for it and a C++ wrapper (AOTInductor) cannot call the
    check."""
    inductor = torch._inductor.config
    return not (inductor.triton.cudagraphs or inductor.cpp_wrapper or V.aot_compilation)


def ancestors(node: torch.fx.Node, stop: Callable[[torch.fx.Node], bool]) -> list[torch.fx.Node]:
    """``node`` and every node it reads, inputs first; a node where ``stop`` holds is listed but not followed."""
    order, seen, stack = [], set(), [(node, False)]
    while stack:
        current, expanded = stack.pop()
        if expanded:
            order.append(current)
            continue
        if current in seen:
            continue
        seen.add(current)
        stack.append((current, True))
        if not stop(current):
            stack.extend((arg, False) for arg in reversed(current.all_input_nodes))
    return order


def is_input(node: torch.fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def branch_output(region: AttentionRegion) -> torch.fx.Node:
    """The node the branches return: pv's view back to the scores' batch dims when that is its one user (SDPA's
    output as it is), else pv."""
    users = list(region.pv.users)
    if len(users) == 1 and users[0].target in _RESHAPES and tuple(users[0].meta["val"].shape) == tuple(
        region.score_root.meta["val"].shape[:-1]
    ) + (region.pv.meta["val"].shape[-1],):
        return users[0]
    return region.pv


def region_branch(region: AttentionRegion, output: torch.fx.Node) -> Optional[tuple[torch.fx.GraphModule, list, dict]]:
    """A copy of the region's nodes from its operands to ``output`` as a graph of its own, the operands it reads
    (q, k, v and the tensors the chain reads as the graph computes them, or the dense tensors they view:
    ``_exact_operand``), and the map from the region's nodes to their copies; None where an operand has no such
    form."""
    boundary = {_exact_operand(node) for node in (region.q.node, region.kt.node, region.v.node, *region.captured)}
    if None in boundary:
        return None
    graph = torch.fx.Graph()
    env: dict = {}
    order = ancestors(output, lambda node: node in boundary or is_input(node))
    operands = [node for node in order if node in boundary or is_input(node)]
    for operand in operands:
        env[operand] = graph.placeholder(operand.name)
        env[operand].meta = dict(operand.meta)
    for node in order:
        if node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output((env[output],))
    return torch.fx.GraphModule(torch.nn.Module(), graph), operands, env


def _exact_operand(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """What a branch may take for ``node``: a node Inductor hands to the branch with exactly the strides FX gives it,
    for which the branch is compiled. A graph input, or a dense tensor the graph computes (``branch_on`` has Inductor
    lay it out in its stride order); for a view of something else (a slice of a fused qkv projection), the view's
    source, the view then copied into the branch; None where the views end at a tensor that is neither."""
    while node.op == "call_function" and not is_non_overlapping_and_dense_or_false(node.meta["val"]):
        if node.target not in _VIEWS or node.target is aten.clone.default:
            return None
        node = node.args[0]
    return node


def finished(branch: torch.fx.GraphModule) -> torch.Tensor:
    """Dead code out, code regenerated; the branch's output value."""
    branch.graph.eliminate_dead_code()
    branch.graph.lint()
    branch.recompile()
    return branch.graph.find_nodes(op="output")[0].args[0][0].meta["val"]


def shared_check(graph: torch.fx.Graph, op, args: tuple, user: torch.fx.Node, fake: torch.Tensor) -> torch.fx.Node:
    """``op(*args)``, a host check answering a 0-d bool, before ``user``: the one an earlier region of the graph
    made with the same arguments, or a new one."""

    def build() -> torch.fx.Node:
        flag = graph.call_function(op, args)
        with torch._guards.detect_fake_mode([fake]) or contextlib.nullcontext():
            flag.meta["val"] = torch.empty((), dtype=torch.bool, device="cpu")
        return flag

    key = (str(op), *(tuple(arg) if isinstance(arg, list) else arg for arg in args))
    return _shared_table(graph, key, build, user)


def branch_on(flag: torch.fx.Node, branches: dict[str, torch.fx.GraphModule], operands: list[torch.fx.Node],
              output: torch.fx.Node) -> torch.fx.Node:
    """Replace ``output`` by ``cond(flag, *branches, operands)`` (the branches named by their keys); return the
    node standing for their output."""
    pin_strides(operands)
    with output.graph.inserting_before(output):
        (routed,) = cond_outputs(output.graph, flag, branches, operands)
    output.replace_all_uses_with(routed)
    return routed


def pin_strides(operands: list[torch.fx.Node]) -> None:
    """The branches are compiled for the operands' strides as FX gives them: Inductor would lay out a dense operand
    it computes (a pointwise op on a transposed k) as it likes; in the stride order FX gives it, it has them."""
    for operand in operands:
        if operand.op == "call_function":
            operand.meta["inductor_realize_to_strides"] = True


def cond_outputs(graph: torch.fx.Graph, flag: torch.fx.Node, branches: dict[str, torch.fx.GraphModule],
                 operands: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """``cond(flag, *branches, operands)`` at the graph's insertion point (the branches, subgraphs named by their
    keys, return tuples alike), and a node for each of its outputs."""
    modules = tuple(subgraph(graph, module, name) for name, module in branches.items())
    first = next(iter(branches.values()))
    values = [node.meta["val"] for node in first.graph.find_nodes(op="output")[0].args[0]]
    cond = graph.call_function(torch.ops.higher_order.cond, (flag, *modules, tuple(operands)))
    cond.meta["val"] = tuple(values)
    cond.meta["flashlight_route"] = True  # (its branches hold overlay ops: compile_fx's fallback traces them)
    items = []
    for index, value in enumerate(values):
        items.append(graph.call_function(operator.getitem, (cond, index)))
        items[-1].meta["val"] = value
    return items
