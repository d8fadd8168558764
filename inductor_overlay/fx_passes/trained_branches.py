"""A checked route in training: an attention's fused forward and fused backward each run as one of two versions,
chosen by one host check (``checked_branches``), in a joint graph before it is partitioned.

Legality. A route gives two copies of the region, the first rewritten into a form that equals the region wherever
the check's flag is True (the route's own rule), the second as it is. Here each copy holds the region's forward and
its backward (``R_bwd`` of ``attention_training``): the copy is differentiated as the region is, so its backward
computes the region's gradients wherever its forward computes the region's output. Each copy is fused as a pair
(forward and backward kernels) in a graph of its own, then cut at its forward kernels' outputs: the joint graph gets
``cond(flag, first_forward, second_forward)`` in the region's place and ``cond(flag, first_backward,
second_backward)`` in R_bwd's. The backward reads the flag the forward read (saved, never recomputed), so the two
choose the same copy; it reads of the forward only the kernels' outputs, each version's in slots of the forward
cond's outputs (values of one layout in both versions share a slot; a slot a version does not fill it fills with an
empty tensor), and computes again whatever else it reads of the forward (views of the operands, the masks' tables).
The partitioner then sends each ``cond`` to its graph.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy

from inductor_overlay import ops
from inductor_overlay.fx_passes.attention_region import AttentionRegion
from inductor_overlay.fx_passes.block_sparsity import depends_on
from inductor_overlay.fx_passes.checked_branches import (
    _exact_operand,
    ancestors,
    cond_outputs,
    finished,
    is_input,
    pin_strides,
    shared_check,
)
from inductor_overlay.fx_passes.fx_helpers import _VIEWS, aten
from inductor_overlay.fx_passes.sdpa_training import _FUSED_SDPA_OPS

# The ops whose outputs a backward reads as saved: the forward kernels.
_FORWARD_KERNELS = (ops.online_softmax_attention_with_lse, ops.online_softmax_attention, *_FUSED_SDPA_OPS)


def route_pair(region: AttentionRegion, matched, rewrite: Callable, fuse_copy: Callable, check: tuple,
               names: tuple[str, str]) -> Optional[torch.fx.Node]:
    """The route in a joint graph: the region and its backward (``matched``, ``attention_training.RegionBackward``)
    as ``cond``s, on ``check`` (a host op and its arguments), between their copy rewritten by ``rewrite`` (given the
    map of copies; False declines), fused by ``fuse_copy`` with SDPA's pair allowed, and their copy as it is, fused
    on our kernels; the node standing for the region's output, or None (nothing changed but dead nodes)."""
    first = fused_pair_branch(region, matched, rewrite, lambda copies: fuse_copy(region, matched, copies, sdpa=True))
    second = fused_pair_branch(region, matched, lambda copies: None,
                               lambda copies: fuse_copy(region, matched, copies, sdpa=False))
    if first is None or second is None:
        return None
    (first_cut, operands), (second_cut, second_operands) = first, second
    if second_operands != operands:
        return None  # (both copies are made from the same nodes: this does not happen)
    flag = shared_check(region.pv.graph, *check, region.pv, region.pv.meta["val"])
    flag.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # a check again in the backward could answer otherwise
    return branch_pair_on(flag, dict(zip(names, (first_cut, second_cut))), operands, region.pv, list(matched.grads))


def fused_pair_branch(region: AttentionRegion, matched, rewrite: Callable, fuse_copy: Callable):
    """One version of a trained region: its forward and backward copied (``joint_branch``), ``rewrite`` run on the
    copy, the copy fused as a pair by ``fuse_copy`` (given the map of copies; False where it does not fuse); the copy
    cut at its forward kernels, and its operands (the gradient's source last). None where the copy cannot be made,
    the rewrite declines or the copy does not fuse."""
    built = joint_branch(region, matched)
    if built is None:
        return None
    branch, operands, copies = built
    if rewrite(copies) is False or not fuse_copy(copies):
        return None
    finished(branch)
    cut = cut_at_kernels(branch)
    return None if cut is None else (cut, operands)


def joint_branch(region: AttentionRegion, matched):
    """A copy of the region's forward and of its backward (R_bwd) as a graph of its own, returning the region's
    output and R_bwd's handed-out values; its operands (the joint graph's values the copy reads, as
    ``checked_branches._exact_operand`` gives them, views copied in; the source of the output's gradient last) and
    the map from the joint graph's nodes to their copies. None where an operand has no such form."""
    boundary = {_exact_operand(node) for node in (region.q.node, region.kt.node, region.v.node, *region.captured)}
    gradient = _exact_operand(matched.grad_out)
    if None in boundary or gradient is None:
        return None
    forward = ancestors(region.pv, lambda node: node in boundary or is_input(node))
    inside = {node for node in forward if node not in boundary and not is_input(node)} | set(matched.nodes)
    inside |= _views_between(matched.grad_out, gradient)
    memo: dict = {}
    pending = list(inside)
    while pending:
        for arg in pending.pop().all_input_nodes:
            if arg in inside or arg is gradient or is_input(arg):
                continue
            if not isinstance(arg.meta.get("val"), torch.Tensor):
                return None  # (a size the backward reads: static shapes only)
            if depends_on(arg, region.qk, memo) or (arg.op == "call_function" and not arg.all_input_nodes):
                inside.add(arg)  # an alias of the probabilities only the backward reads, or a constant autograd made
                pending.append(arg)
                continue
            exact = _exact_operand(arg)
            if exact is None:
                return None
            inside |= _views_between(arg, exact)
    order = [node for node in region.pv.graph.nodes if node in inside]
    reads = {arg for node in order for arg in node.all_input_nodes if arg not in inside and arg is not gradient}
    operands = [*(node for node in region.pv.graph.nodes if node in reads), gradient]
    graph, env = torch.fx.Graph(), {}
    for operand in operands:
        env[operand] = graph.placeholder(operand.name)
        env[operand].meta = dict(operand.meta)
    for node in order:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in (region.pv, *matched.grads)))
    return torch.fx.GraphModule(torch.nn.Module(), graph), operands, env


def _views_between(view: torch.fx.Node, source: torch.fx.Node) -> set:
    """The views from ``source`` (``_exact_operand``'s) to ``view``, ``view`` included; none where they are one."""
    views = set()
    while view is not source:
        views.add(view)
        view = view.args[0]
    return views


@dataclasses.dataclass
class Cut:
    """A fused pair's branch (operands..., gradient -> output, *handed out) cut at the outputs of its forward
    kernels (``saved``: those the output or the backward reads). The forward computes them; the output is, where it
    can be, their view (``result_views``, replayed in the joint graph: a cond's outputs had better not alias one
    another); the backward computes again what else it reads of the forward (views of the operands, the masks'
    tables, the rows' flags)."""

    branch: torch.fx.GraphModule
    output: torch.fx.Node
    saved: list
    constants: dict  # outputs of a kernel that are not tensors (a length, a flag), by their values
    result_source: Optional[torch.fx.Node]  # the one of ``saved`` the output is a view of (or is); None: neither
    result_views: list  # the view nodes from it to the output, in order
    gradients: list
    forward_reads: set  # indices of the operands the forward reads (the output's own reads included)
    backward_reads: set  # and the backward (the gradient, the last operand, apart)


def cut_at_kernels(branch: torch.fx.GraphModule) -> Optional[Cut]:
    """``branch`` cut at its kernels' outputs, or None where a kernel's output that is not a tensor is not a
    constant."""
    graph = branch.graph
    *operands, gradient = graph.find_nodes(op="placeholder")
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
    for value in gradients:
        needed.update(ancestors(value, stop.__contains__))
    saved = [node for node in outputs if node in needed]

    def reads(nodes: list, stop: set) -> set:
        found = set()
        for node in nodes:
            found.update(ancestors(node, lambda n: n in stop or n.op == "placeholder"))
        return {index for index, operand in enumerate(operands) if operand in found}

    return Cut(branch, output, saved, constants, source, views, gradients, reads([output, *saved], set()),
               reads(gradients, {*saved, *constants}))


def branch_pair_on(flag: torch.fx.Node, cuts: dict[str, Cut], operands: list[torch.fx.Node], output: torch.fx.Node,
                   handed_out: list[torch.fx.Node]) -> torch.fx.Node:
    """Replace ``output`` (the region's) by ``cond(flag, *forwards)`` and ``handed_out`` (R_bwd's outputs) by
    ``cond(flag, *backwards)``, the two versions' cuts named by their keys (``_slots`` says what the forwards return);
    the node standing for the output. Both conds are in place before any use is replaced."""
    first, second = cuts.values()
    forward_reads = sorted(first.forward_reads | second.forward_reads)
    backward_reads = sorted(first.backward_reads | second.backward_reads)
    slots = _slots(first.saved, second.saved)
    replayed = _result_layout(first, slots[0]) is not None and _result_layout(first, slots[0]) == _result_layout(
        second, slots[1])
    forwards, backwards = {}, {}
    for name, cut, filled in zip(cuts, cuts.values(), slots):
        forwards[f"{name}_forward"], backwards[f"{name}_backward"] = _cut_modules(
            cut, filled, _slot_values(*slots), forward_reads, backward_reads, replayed, first
        )
    graph = output.graph
    forward_operands = [operands[i] for i in forward_reads]
    if len(handed_out) != len(first.gradients):
        raise ValueError("the copy hands out other values than the region's backward")
    with graph.inserting_before(output):
        values = cond_outputs(graph, flag, forwards, forward_operands)
        result = _result(graph, first, slots[0], values) if replayed else values[0]
        saved = values if replayed else values[1:]
    backward_operands = [*(operands[i] for i in backward_reads), *saved, operands[-1]]
    position = {node: index for index, node in enumerate(graph.nodes)}
    with graph.inserting_before(max([result, *backward_operands], key=position.__getitem__).next):
        gradients = cond_outputs(graph, flag, backwards, backward_operands)
    pin_strides([*forward_operands, *(operands[i] for i in backward_reads), operands[-1]])
    output.replace_all_uses_with(result)
    for value, gradient in zip(handed_out, gradients, strict=True):
        value.replace_all_uses_with(gradient)
    return result


def _cut_modules(cut: Cut, filled: list, values: list, forward_reads: list, backward_reads: list, replayed: bool,
                 first: Cut) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """A version's forward (operands -> [output,] slots) and backward (operands, slots, gradient -> handed out),
    each slot its own value or, where it fills none, an empty tensor (forward) or an input it does not read; the
    output and the handed-out values in the first version's layouts (a cond's branches return alike)."""
    placeholders = cut.branch.graph.find_nodes(op="placeholder")
    slots = [node if node is not None else value for node, value in zip(filled, values)]
    returned = slots if replayed else [cut.output, *slots]
    layouts = [] if replayed else [first.output.meta["val"]]
    forward = _module(cut, [placeholders[i] for i in forward_reads], returned, layouts)
    inputs = [*(placeholders[i] for i in backward_reads), *slots, placeholders[-1]]
    backward = _module(cut, inputs, cut.gradients, [node.meta["val"] for node in first.gradients])
    return forward, backward


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


def _result_layout(cut: Cut, slots: list) -> Optional[tuple]:
    """The slot the output is a view of, and the view's size, strides and offset into it; None where it is not."""
    if cut.result_source is None:
        return None
    value, source = cut.output.meta["val"], cut.result_source.meta["val"]
    slot = next(i for i, node in enumerate(slots) if node is cut.result_source)
    return (slot, tuple(value.shape), tuple(value.stride()), value.storage_offset() - source.storage_offset())


def _result(graph: torch.fx.Graph, first: Cut, slots: list, values: list) -> torch.fx.Node:
    """The output made from the forward cond's slots by the first version's views (the same view in both)."""
    env = dict(zip(slots, values))
    result = env[first.result_source]
    for view in first.result_views:
        result = env[view] = graph.node_copy(view, env.__getitem__)
    return result


def _module(cut: Cut, inputs: list, outputs: list, layouts: list) -> torch.fx.GraphModule:
    """The part of ``cut.branch`` that computes ``outputs`` from ``inputs``, as a module of its own (its subgraphs
    copied from the branch). Inputs and outputs are the branch's nodes, or fake tensors: an input that is not read,
    an output that is an empty tensor of that layout (a value the other version saves). Outputs laid out otherwise
    than ``layouts`` (fake tensors, for the first outputs) are copied into them."""
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
    for index, layout in enumerate(layouts):
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
