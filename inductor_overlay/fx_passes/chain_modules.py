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
    scores = _placeholder(graph, "scores", region.score_root)
    env = {region.score_root: scores}
    for index, value in enumerate(region.captured):
        env[value] = _placeholder(graph, f"captured_{index}", value)
    for index, value in enumerate(region.captured_sizes):
        env[value] = _placeholder(graph, f"size_{index}", value)
    if region.operand_scale != 1.0:
        env[region.score_root] = graph.call_function(aten.mul.Tensor, (scores, region.operand_scale))
    return graph, env


def _placeholder(graph: torch.fx.Graph, name: str, value: torch.fx.Node) -> torch.fx.Node:
    """A placeholder with the fake value of the node it stands for: Inductor's joint-graph passes, which also run on
    the subgraphs of a graph that trains, read the values of a view's input."""
    node = graph.placeholder(name)
    if "val" in value.meta:
        node.meta["val"] = value.meta["val"]
    return node


def _score_chain_module(
    region: AttentionRegion, unmasked: frozenset = frozenset(), guards: Optional[dict] = None,
    affine: Optional[dict] = None,
) -> torch.fx.GraphModule:
    """The chain from scores to logits as its own graph: (scores, *captured) -> logits. The ``where(cond, -inf, x)``
    nodes in ``unmasked`` pass ``x`` through (for tiles where ``cond`` is false everywhere), and an additive mask's
    add there passes the scores through (for tiles where its bias is 0). The finite guards in ``guards`` pass
    their ``x`` through (``finite_speculation``). Each captured position
    tensor in ``affine`` (``affine_positions``) becomes its first value plus an ``iota``: the positions the kernel's
    tile loop already has, in 32-bit integers, instead of a load per tile."""
    graph, env = _chain_inputs(region)
    for leaf, first in (affine or {}).items():  # the positions as first + 0, 1, 2, ... (exact where they are)
        value = _val(leaf)
        iota = graph.call_function(
            prims.iota.default, (value.shape[-1],),
            dict(start=0, step=1, dtype=_val(first).dtype, device=value.device, requires_grad=False),
        )
        env[leaf] = graph.call_function(aten.add.Tensor, (env[first], iota))
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


def position_differences(region: AttentionRegion) -> frozenset:
    """The chain's sums and differences ``a ± b`` of two integer vectors read from memory at the rows or the columns
    (captured positions: ALiBi's ``pos[None, :] - pos[:, None]``) whose every use reads them as float32 (a product
    or sum with a float32 tensor, or a conversion to float32)."""
    found = []
    for node in region.chain:
        value = _val(node)
        if not (_is(node, (aten.sub.Tensor, aten.add.Tensor)) and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 2):
            continue
        if value is None or value.dtype.is_floating_point or value.dtype is torch.bool:
            continue
        if all(_is_vector(region, arg) for arg in node.args) and node.users and all(_reads_as_float32(u, node) for u in node.users):
            found.append(node)
    return frozenset(found)


def _is_vector(region: AttentionRegion, node: object) -> bool:
    """An integer tensor computed without the scores that varies along at most one of the logits' two dims."""
    value = _val(node) if isinstance(node, torch.fx.Node) else None
    if value is None or value.dtype.is_floating_point or value.dtype is torch.bool or value.dtype.is_complex:
        return False
    if node not in region.chain and node not in region.captured:
        return False
    return not depends_on(node, region.score_root, {}) and (value.dim() < 2 or 1 in tuple(value.shape[-2:]))


def _reads_as_float32(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    if _is(user, prims.convert_element_type.default):
        return user.args[1] is torch.float32
    if not _is(user, (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor)) or user.kwargs.get("alpha", 1) != 1:
        return False
    others = [arg for arg in user.args[:2] if arg is not node]
    if len(others) == 1 and isinstance(others[0], float):  # ``0.25 * distance``: computed in float32, converted first
        return _val(user) is not None and _val(user).dtype is torch.float32
    return len(others) == 1 and isinstance(others[0], torch.fx.Node) and _val(others[0]) is not None and (
        _val(others[0]).dtype is torch.float32
    )


def _captured_positions(region: AttentionRegion, vectors: list) -> list:
    """The captured integer tensors the position ``vectors`` (nodes of the chain) are read from that may hold
    consecutive values (``affine_positions`` checks them per call)."""
    leaves = []
    for vector in vectors:
        pending = [vector]
        while pending:
            node = pending.pop()
            if node in region.captured:
                leaves.append(node)
            elif node in region.chain:
                pending += node.all_input_nodes
    return [leaf for leaf in dict.fromkeys(leaves) if _consecutive_candidate(leaf)]


def affine_positions(graph: torch.fx.Graph, region: AttentionRegion, vectors: list) -> tuple[dict, Optional[torch.fx.Node]]:
    """The captured integer tensors ``[*lead, L]`` that the position ``vectors`` (nodes of the chain) are read from,
    each with graph nodes for its first values ``[*lead, 1]``, and one node that says, per call, whether every one
    of them holds consecutive values along its last dim (``first + 0, 1, 2, ...``: ``arange`` made once outside,
    a buffer of it sliced, HF's ``position_ids``). Where that holds, the chain may compute them from the tile's own
    positions (``_score_chain_module``'s ``affine``); where it does not, the kernel runs the exact chain."""
    leaves = _captured_positions(region, vectors)
    if not leaves:
        return {}, None
    narrow = _int32_safe(region, leaves)
    firsts, checks = {}, []
    for leaf in leaves:
        value = _val(leaf)
        length = value.shape[-1]
        first = call_op(graph, aten.slice.Tensor, (leaf, -1, 0, 1))
        iota = call_op(graph, prims.iota.default, (length,), dict(start=0, step=1, dtype=value.dtype, device=value.device, requires_grad=False))
        differs = call_op(graph, aten.ne.Tensor, (leaf, call_op(graph, aten.add.Tensor, (first, iota))))
        if narrow:  # computed in 32 bits: positions of magnitude 2^24 or more take the exact chain
            large = call_op(graph, aten.ge.Scalar, (call_op(graph, aten.abs.default, (leaf,)), NARROW_POSITION))
            differs = call_op(graph, aten.logical_or.default, (differs, large))
            first = call_op(graph, prims.convert_element_type.default, (first, torch.int32))
        as_int = call_op(graph, prims.convert_element_type.default, (differs, torch.int32))
        checks.append(call_op(graph, aten.amax.default, (as_int, list(range(value.dim())))))
        firsts[leaf] = first
    worst = checks[0]
    for check in checks[1:]:
        worst = call_op(graph, aten.maximum.default, (worst, check))
    return firsts, call_op(graph, aten.eq.Scalar, (worst, 0))


# Consecutive positions below this magnitude are computed in 32-bit integers. Each sum or difference at most doubles
# the largest magnitude (its operands, positions or constants, lie below it too): after MAX_INTEGER_SUMS of them the
# values stay below 2^30.
NARROW_POSITION = 2**24
MAX_INTEGER_SUMS = 6
_INTEGER_VIEWS = (
    aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.squeeze.dim, aten.squeeze.default,
    aten.permute.default, aten.expand.default, aten.slice.Tensor, aten.clone.default,
)
_COMPARISONS = tuple(
    op for name in ("lt", "le", "gt", "ge", "eq", "ne") for op in (getattr(aten, name).Tensor, getattr(aten, name).Scalar)
)


def _int32_safe(region: AttentionRegion, leaves: list) -> bool:
    """Whether the chain uses the integer values computed from ``leaves`` only in ways 32 bits compute exactly for
    values below NARROW_POSITION: views, at most MAX_INTEGER_SUMS sums and differences, negation, abs and comparisons
    whose other operands are values computed from ``leaves`` or numbers below NARROW_POSITION, and conversion to (or
    arithmetic with) a floating-point tensor. An integer tensor of another origin (a 0-d limit, another vector) would
    meet the narrowed values in 32 bits where eager meets them in 64: refused."""
    sums, pending, derived = 0, list(leaves), set(leaves)
    while pending:
        node = pending.pop()
        for user in node.users:
            if user not in region.chain or user in derived:
                continue
            result = _val(user)
            if result is None:
                return False
            if result.is_floating_point() and _is(user, (prims.convert_element_type.default, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor)):
                if _is(user, prims.convert_element_type.default) or all(
                    arg in derived or (isinstance(arg, torch.fx.Node) and _val(arg) is not None and _val(arg).is_floating_point())
                    for arg in user.args[:2]
                ):
                    continue
                return False
            others = [arg for arg in user.args[:2] if arg not in derived] if not _is(user, _INTEGER_VIEWS) else []
            if any(isinstance(arg, torch.fx.Node) or not isinstance(arg, int) or abs(arg) >= NARROW_POSITION for arg in others):
                return False
            if result.dtype is torch.bool and _is(user, _COMPARISONS):
                continue
            if result.is_floating_point() or result.dtype is torch.bool or user.kwargs.get("alpha", 1) != 1:
                return False
            if _is(user, (aten.add.Tensor, aten.sub.Tensor)):
                sums += 1
            elif not _is(user, (*_INTEGER_VIEWS, aten.neg.default, aten.abs.default)):
                return False
            derived.add(user)
            pending.append(user)
    return sums <= MAX_INTEGER_SUMS


def _consecutive_candidate(leaf: torch.fx.Node) -> bool:
    value = _val(leaf)
    return (
        value is not None and value.dim() >= 1 and not value.dtype.is_floating_point and value.dtype is not torch.bool
        and not value.dtype.is_complex and all(isinstance(size, int) for size in value.shape) and value.shape[-1] > 1
    )


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


def traced_joint(chain: torch.fx.GraphModule, example_inputs: list, joint, differentiate_scores: bool) -> torch.fx.GraphModule:
    """``joint(scores, *captured, *sizes, grad_logits)`` (a derivative of ``chain``) traced with Inductor's
    decompositions under the graph's fake mode, at fresh scores (requiring grad with ``differentiate_scores``) and an
    upstream gradient shaped as the chain's logits."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    scores, *captured = example_inputs
    with torch._guards.detect_fake_mode([scores]):
        scores = torch.empty_strided(scores.shape, scores.stride(), dtype=scores.dtype, device=scores.device)
        grad = torch.empty_like(chain(scores, *captured), memory_format=torch.contiguous_format)
        scores.requires_grad_(differentiate_scores)
        traced = make_fx(joint, decomposition_table=select_decomp_table())(scores, *captured, grad)
        return _without_fills_of_temporaries(traced)


def _without_fills_of_temporaries(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` with each ``copy_(dst, src)`` that refills a value the graph computed (not a view of another: no
    alias sees the write), of src's shape and dtype, after dst's last other use, replaced by ``src``: autograd's
    formulas fill some gradients in place (``maximum``'s ``masked_fill_``), which tracing keeps as such a copy, and a
    pointwise subgraph has no buffer to copy into. Any other copy stays (the lowering then declines)."""
    graph = module.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
            continue
        dst, src = node.args[:2]
        if not _refillable(dst, src, node, order):
            continue
        node.replace_all_uses_with(src)
        graph.erase_node(node)
    graph.lint()
    module.recompile()
    return module


def _refillable(dst: object, src: object, copy: torch.fx.Node, order: dict) -> bool:
    """Whether ``copy_(dst, src)`` only gives dst src's values: dst is computed by an op that is not a view, no view
    is taken of it, no other use of it follows the copy, and src has its shape and dtype."""
    if not isinstance(dst, torch.fx.Node) or not isinstance(src, torch.fx.Node) or dst.op != "call_function":
        return False
    if getattr(dst.target, "is_view", True) or any(getattr(user.target, "is_view", False) for user in dst.users):
        return False
    if any(order[user] > order[copy] for user in dst.users if user is not copy):
        return False
    value, wanted = src.meta.get("val"), dst.meta.get("val")
    return (isinstance(value, torch.Tensor) and isinstance(wanted, torch.Tensor) and value.dtype == wanted.dtype
            and tuple(value.shape) == tuple(wanted.shape))
