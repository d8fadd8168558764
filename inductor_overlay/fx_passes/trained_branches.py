"""A checked route in training: an attention's fused forward and fused backward each run as one of two versions,
chosen by one host check (``checked_branches``), in a joint graph before it is partitioned.

Legality. A route gives two copies of the region, the first rewritten into a form that equals the region wherever
the check's flag is True (the route's own rule), the second fused as it is. Here each copy holds the region's
forward and its backward (``R_bwd`` of ``attention_training``): the copy is differentiated as the region is, so its
backward computes the region's gradients wherever its forward computes the region's output. Each copy is fused as a
pair (forward and backward kernels) inside a graph of its own, then cut in two at what its backward reads of its
forward's kernel (the output, the rows' statistics): the joint graph gets ``cond(flag, first_forward,
second_forward)`` in the region's place and ``cond(flag, first_backward, second_backward)`` in R_bwd's. The backward
reads the flag the forward read, so the two choose the same copy; the values the backward reads must have the same
shapes, strides and dtypes in both copies (else the route declines). Everything else a backward reads of its
forward (views of the operands, the masks' tables) it computes again from the operands: small, and the same in
either copy. The partitioner then sends each ``cond`` to its graph, the flag saved for the backward.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import torch

from inductor_overlay import ops
from inductor_overlay.fx_passes.attention_region import AttentionRegion
from inductor_overlay.fx_passes.block_sparsity import depends_on
from inductor_overlay.fx_passes.checked_branches import _exact_operand, ancestors, is_input
from inductor_overlay.fx_passes.fx_helpers import _VIEWS, subgraph
from inductor_overlay.fx_passes.sdpa_training import _FUSED_SDPA_OPS

# The ops whose outputs a backward reads as saved: the forward kernels.
_FORWARD_KERNELS = (ops.online_softmax_attention_with_lse, ops.online_softmax_attention, *_FUSED_SDPA_OPS)


def joint_branch(region: AttentionRegion, backward: set, grad_out: torch.fx.Node, outputs: list[torch.fx.Node]):
    """A copy of the region's forward (to ``outputs[0]``) and of its backward ``backward`` (R_bwd, handing out
    ``outputs[1:]``) as a graph of its own, whose last input is ``grad_out``; its operands (the graph's values the
    copy reads, as ``checked_branches._exact_operand`` gives them, views copied in) and the map from the joint
    graph's nodes to their copies. None where an operand has no exact form."""
    boundary = {_exact_operand(node) for node in (region.q.node, region.kt.node, region.v.node, *region.captured)}
    if None in boundary:
        return None
    forward = ancestors(outputs[0], lambda node: node in boundary or is_input(node))
    inside = {node for node in forward if node not in boundary and not is_input(node)} | set(backward)
    memo: dict = {}
    pending = list(inside)
    while pending:
        for arg in pending.pop().all_input_nodes:
            if arg in inside or arg is grad_out or is_input(arg):
                continue
            if depends_on(arg, region.qk, memo) or (arg.op == "call_function" and not arg.all_input_nodes):
                inside.add(arg)  # an alias of the probabilities only the backward reads, or a constant autograd made
                pending.append(arg)
                continue
            exact = _exact_operand(arg)
            if exact is None:
                return None
            while arg is not exact:  # the views between an operand and its dense source
                inside.add(arg)
                arg = arg.args[0]
    order = [node for node in region.pv.graph.nodes if node in inside]
    reads = {arg for node in order for arg in node.all_input_nodes if arg not in inside and arg is not grad_out}
    operands = [node for node in region.pv.graph.nodes if node in reads]
    graph, env = torch.fx.Graph(), {}
    for operand in [*operands, grad_out]:
        env[operand] = graph.placeholder(operand.name)
        env[operand].meta = dict(operand.meta)
    for node in order:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph), operands, env


@dataclasses.dataclass
class Cut:
    """A fused pair's branch (operands..., grad_out -> output, *gradients) cut at the outputs of its forward kernels
    (``saved``: those the output or the backward reads). The forward computes them; the output is their view
    (``result_views``, replayed in the joint graph: a ``cond``'s outputs may not alias one another); the backward
    computes again what else it reads of the forward (views of the operands, the masks' tables, the rows' flags)."""

    branch: torch.fx.GraphModule
    saved: list
    result_source: torch.fx.Node  # the one of ``saved`` the output is a view of (or is)
    result_views: list  # the view nodes from it to the output, in order
    gradients: list
    forward_reads: set  # indices of the operands the forward reads
    backward_reads: set  # and the backward


def cut_at_kernels(branch: torch.fx.GraphModule) -> Optional[Cut]:
    """``branch`` cut at its kernels' outputs, or None where its output is not a view of one of them."""
    graph = branch.graph
    *operands, grad_out = graph.find_nodes(op="placeholder")
    output, *gradients = graph.find_nodes(op="output")[0].args[0]
    outputs = []
    for kernel in (n for n in graph.nodes if n.op == "call_function" and n.target in _FORWARD_KERNELS):
        items = list(kernel.users)
        outputs += items if items and all(user.target is operator.getitem for user in items) else [kernel]
    stop = set(outputs) | set(operands)
    views = [node for node in ancestors(output, stop.__contains__) if node not in stop]
    if not all(node.target in _VIEWS and len(node.all_input_nodes) == 1 for node in views):
        return None
    source = views[0].all_input_nodes[0] if views else output
    if source not in outputs:
        return None
    needed = set(ancestors(output, stop.__contains__))
    for gradient in gradients:
        needed.update(ancestors(gradient, stop.__contains__))
    saved = [node for node in outputs if node in needed]

    def reads(nodes: list, stop: set) -> set:
        found = set()
        for node in nodes:
            found.update(ancestors(node, lambda n: n in stop or n.op == "placeholder"))
        return {index for index, operand in enumerate(operands) if operand in found}

    return Cut(branch, saved, source, views, gradients, reads(saved, set()), reads(gradients, set(saved)))


def _descendants(nodes: list[torch.fx.Node]) -> set:
    found, pending = set(nodes), list(nodes)
    while pending:
        for user in pending.pop().users:
            if user not in found and user.op != "output":
                found.add(user)
                pending.append(user)
    return found


def _module(branch: torch.fx.GraphModule, inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """The part of ``branch`` that computes ``outputs`` from ``inputs`` (some of its placeholders and nodes), as a
    module of its own (its subgraphs copied from ``branch``)."""
    graph, env = torch.fx.Graph(), {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    needed = set()
    for output in outputs:
        needed.update(ancestors(output, lambda node: node in env))
    for node in branch.graph.nodes:
        if node in needed and node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in outputs))
    module = torch.fx.GraphModule(branch, graph)
    module.graph.lint()
    return module


def _same_layout(first: list, second: list) -> bool:
    values = [[node.meta["val"] for node in nodes] for nodes in (first, second)]
    return len(first) == len(second) and all(
        (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device) for a, b in zip(*values)
    )


def branch_pair_on(
    flag: torch.fx.Node,
    cuts: dict[str, Cut],
    operands: list[torch.fx.Node],
    grad_out: torch.fx.Node,
    output: torch.fx.Node,
    handed_out: list[torch.fx.Node],
) -> bool:
    """Replace ``output`` (the region's) by ``cond(flag, *forwards)`` and ``handed_out`` (R_bwd's outputs) by
    ``cond(flag, *backwards)``, the two versions' cuts named by their keys; False (nothing changed) where their
    forwards save values of different layouts."""
    first, second = cuts.values()
    if not _same_layout(first.saved, second.saved) or _view_steps(first) != _view_steps(second):
        return False
    forward_reads = sorted(first.forward_reads | second.forward_reads)
    backward_reads = sorted(first.backward_reads | second.backward_reads)
    forwards, backwards = {}, {}
    for name, cut in cuts.items():
        placeholders = cut.branch.graph.find_nodes(op="placeholder")
        forwards[f"{name}_forward"] = _module(cut.branch, [placeholders[i] for i in forward_reads], cut.saved)
        backwards[f"{name}_backward"] = _module(
            cut.branch, [*(placeholders[i] for i in backward_reads), *cut.saved, placeholders[-1]], cut.gradients
        )
    graph = output.graph
    with graph.inserting_before(output):
        saved = _cond(graph, flag, forwards, [operands[i] for i in forward_reads])
        env = dict(zip(first.saved, saved))
        result = env[first.result_source]
        for view in first.result_views:
            result = env[view] = graph.node_copy(view, env.__getitem__)
    output.replace_all_uses_with(result)
    backward_operands = [*(operands[i] for i in backward_reads), *saved, grad_out]
    position = {node: index for index, node in enumerate(graph.nodes)}
    anchor = max([result, *backward_operands], key=position.__getitem__)
    with graph.inserting_before(anchor.next):
        gradients = _cond(graph, flag, backwards, backward_operands)
    for value, gradient in zip(handed_out, gradients, strict=True):
        value.replace_all_uses_with(gradient)
    return True


def _view_steps(cut: Cut) -> list:
    """How the output is made from the saved values: which one, then each view with its arguments."""
    steps = [(view.target, torch.fx.node.map_arg((view.args, view.kwargs), lambda _: None)) for view in cut.result_views]
    return [cut.saved.index(cut.result_source), *steps]


def _cond(graph: torch.fx.Graph, flag: torch.fx.Node, branches: dict, operands: list) -> list:
    """``cond(flag, *branches, operands)`` and a getitem node per output."""
    modules = tuple(subgraph(graph, module, name) for name, module in branches.items())
    values = [node.meta["val"] for node in next(iter(branches.values())).graph.find_nodes(op="output")[0].args[0]]
    cond = graph.call_function(torch.ops.higher_order.cond, (flag, *modules, tuple(operands)))
    cond.meta["val"] = tuple(values)
    items = []
    for index, value in enumerate(values):
        item = graph.call_function(operator.getitem, (cond, index))
        item.meta["val"] = value
        items.append(item)
    return items


def fused_pair_branch(region: AttentionRegion, matched, rewrite: Callable, fuse_copy: Callable) -> Optional[tuple[Cut, list]]:
    """One version of a trained region (``matched``: its ``attention_training.RegionBackward``): the region's forward
    and backward copied (``joint_branch``), ``rewrite`` run on the copy (given the map of copies), the copy fused as
    a pair by ``fuse_copy`` (given the map; False where it does not fuse); the copy cut at its forward kernels, and
    its operands. None where the copy cannot be made or does not fuse."""
    built = joint_branch(region, matched.nodes, matched.grad_out, [region.pv, *matched.grads])
    if built is None:
        return None
    branch, operands, copies = built
    rewrite(copies)
    if not fuse_copy(copies):
        return None
    branch.graph.eliminate_dead_code()
    branch.graph.lint()
    branch.recompile()
    cut = cut_at_kernels(branch)
    return None if cut is None else (cut, operands)
