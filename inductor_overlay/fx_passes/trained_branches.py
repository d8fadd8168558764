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
from inductor_overlay.fx_passes.fx_helpers import _VIEWS, aten, subgraph
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
    output: torch.fx.Node
    saved: list
    constants: dict  # outputs of a kernel that are not tensors (a length, a flag), by their values
    result_source: Optional[torch.fx.Node]  # the one of ``saved`` the output is a view of (or is); None: neither
    result_views: list  # the view nodes from it to the output, in order
    gradients: list
    forward_reads: set  # indices of the operands the forward reads
    backward_reads: set  # and the backward


def cut_at_kernels(branch: torch.fx.GraphModule) -> Optional[Cut]:
    """``branch`` cut at its kernels' outputs, or None where a kernel's output that is not a tensor is not a
    constant."""
    graph = branch.graph
    *operands, grad_out = graph.find_nodes(op="placeholder")
    output, *gradients = graph.find_nodes(op="output")[0].args[0]
    outputs = []
    for kernel in (n for n in graph.nodes if n.op == "call_function" and n.target in _FORWARD_KERNELS):
        items = list(kernel.users)
        outputs += items if items and all(user.target is operator.getitem for user in items) else [kernel]
    constants = {node: node.meta["val"] for node in outputs if not isinstance(node.meta.get("val"), torch.Tensor)}
    if not all(isinstance(value, (int, float, bool, type(None))) for value in constants.values()):
        return None
    outputs = [node for node in outputs if node not in constants]
    stop = set(outputs) | set(operands) | set(constants)
    views = [node for node in ancestors(output, stop.__contains__) if node not in stop]
    source = views[0].all_input_nodes[0] if views else output
    if source not in outputs or not all(node.target in _VIEWS and len(node.all_input_nodes) == 1 for node in views):
        source, views = None, []  # (made otherwise: the forward returns the output itself)
    needed = set(ancestors(output, stop.__contains__))
    for gradient in gradients:
        needed.update(ancestors(gradient, stop.__contains__))
    saved = [node for node in outputs if node in needed]

    def reads(nodes: list, stop: set) -> set:
        found = set()
        for node in nodes:
            found.update(ancestors(node, lambda n: n in stop or n.op == "placeholder"))
        return {index for index, operand in enumerate(operands) if operand in found}

    return Cut(branch, output, saved, constants, source, views, gradients, reads(saved, set()), reads(gradients, {*saved, *constants}))


def _descendants(nodes: list[torch.fx.Node]) -> set:
    found, pending = set(nodes), list(nodes)
    while pending:
        for user in pending.pop().users:
            if user not in found and user.op != "output":
                found.add(user)
                pending.append(user)
    return found


def _module(cut: Cut, inputs: list, outputs: list, layouts: Optional[list] = None) -> torch.fx.GraphModule:
    """The part of ``cut.branch`` that computes ``outputs`` from ``inputs``, as a module of its own (its subgraphs
    copied from the branch). Inputs and outputs are the branch's nodes, or fake tensors: an input that is not read,
    an output that is an empty tensor of that layout (a value the other version saves). With ``layouts`` (fake
    tensors), an output laid out otherwise is copied into that layout (both branches of a cond return the same)."""
    graph, env = torch.fx.Graph(), dict(cut.constants)
    for index, node in enumerate(inputs):
        placeholder = graph.placeholder(node.name if isinstance(node, torch.fx.Node) else f"unread_{index}")
        placeholder.meta["val"] = node.meta["val"] if isinstance(node, torch.fx.Node) else node
        env[node if isinstance(node, torch.fx.Node) else placeholder] = placeholder
    needed = set()
    for output in outputs:
        if isinstance(output, torch.fx.Node):
            needed.update(ancestors(output, lambda node: node in env))
    for node in cut.branch.graph.nodes:
        if node in needed and node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    results = [env[output] if isinstance(output, torch.fx.Node) else _empty(graph, output) for output in outputs]
    for index, layout in enumerate(layouts or []):
        if results[index].meta["val"].stride() != layout.stride():
            results[index] = graph.call_function(aten.copy.default, (_empty(graph, layout), results[index]))
            results[index].meta["val"] = layout
    graph.output(tuple(results))
    module = torch.fx.GraphModule(cut.branch, graph)
    module.graph.lint()
    return module


def _empty(graph: torch.fx.Graph, value: torch.Tensor) -> torch.fx.Node:
    node = graph.call_function(aten.empty_strided.default, (list(value.shape), list(value.stride())),
                               dict(dtype=value.dtype, device=value.device))
    node.meta["val"] = value
    return node


def _layout(node: torch.fx.Node) -> tuple:
    value = node.meta["val"]
    return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device)


def _slots(first: list, second: list) -> tuple[list, list]:
    """The forward cond's slots for two versions' saved values: a value of the second shares the first free slot of
    the first's of its layout (our output and SDPA's, alike), else takes a slot of its own. Each version's list of
    its value per slot (None: a slot it does not fill)."""
    first_slots, second_slots = list(first), [None] * len(first)
    for node in second:
        free = [i for i, other in enumerate(first) if second_slots[i] is None and _layout(other) == _layout(node)]
        if free:
            second_slots[free[0]] = node
        else:
            first_slots.append(None)
            second_slots.append(node)
    return first_slots, second_slots


def _slot_values(*versions: list) -> list:
    """Each slot's fake value (from the version that fills it)."""
    return [next(node for node in nodes if node is not None).meta["val"] for nodes in zip(*versions)]


def branch_pair_on(
    flag: torch.fx.Node,
    cuts: dict[str, Cut],
    operands: list[torch.fx.Node],
    grad_out: torch.fx.Node,
    output: torch.fx.Node,
    handed_out: list[torch.fx.Node],
) -> None:
    """Replace ``output`` (the region's) by ``cond(flag, *forwards)`` and ``handed_out`` (R_bwd's outputs) by
    ``cond(flag, *backwards)``, the two versions' cuts named by their keys. Values the two save with the same
    layouts share a slot of the forward cond's outputs (``_slots``); a slot one version does not fill it fills with
    an empty tensor (SDPA's row statistics beside ours)."""
    first, second = cuts.values()
    forward_reads = sorted(first.forward_reads | second.forward_reads)
    backward_reads = sorted(first.backward_reads | second.backward_reads)
    first_slots, second_slots = _slots(first.saved, second.saved)
    # The output made from the saved values after the cond (whose outputs may not alias one another: Inductor would
    # copy one), where both versions make it alike from a shared slot; else the forwards return it too.
    steps = _view_steps(first, first_slots)
    replayed = steps is not None and steps == _view_steps(second, second_slots)
    forwards, backwards = {}, {}
    for name, cut, slots in zip(cuts, (first, second), (first_slots, second_slots)):
        placeholders = cut.branch.graph.find_nodes(op="placeholder")
        slots = [node if node is not None else fake for node, fake in zip(slots, _slot_values(first_slots, second_slots))]
        returned = slots if replayed else [cut.output, *slots]
        layouts = [] if replayed else [first.output.meta["val"]]  # (the first version's: it runs once checked)
        forwards[f"{name}_forward"] = _module(cut, [placeholders[i] for i in forward_reads], returned, layouts)
        backwards[f"{name}_backward"] = _module(cut, [*(placeholders[i] for i in backward_reads), *slots, placeholders[-1]],
                                                cut.gradients, [node.meta["val"] for node in first.gradients])
    graph = output.graph
    with graph.inserting_before(output):
        saved = _cond(graph, flag, forwards, [operands[i] for i in forward_reads])
        if replayed:
            env = dict(zip(first_slots, saved))
            result = env[first.result_source]
            for view in first.result_views:
                result = env[view] = graph.node_copy(view, env.__getitem__)
        else:
            result, *saved = saved
    output.replace_all_uses_with(result)
    backward_operands = [*(operands[i] for i in backward_reads), *saved, grad_out]
    position = {node: index for index, node in enumerate(graph.nodes)}
    anchor = max([result, *backward_operands], key=position.__getitem__)
    with graph.inserting_before(anchor.next):
        gradients = _cond(graph, flag, backwards, backward_operands)
    for value, gradient in zip(handed_out, gradients, strict=True):
        value.replace_all_uses_with(gradient)


def _view_steps(cut: Cut, slots: list) -> Optional[list]:
    """How the output is made from the saved values: the slot it is a view of, then each view with its arguments."""
    if cut.result_source is None:
        return None
    steps = [(view.target, torch.fx.node.map_arg((view.args, view.kwargs), lambda _: None)) for view in cut.result_views]
    return [next(i for i, node in enumerate(slots) if node is cut.result_source), *steps]


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
