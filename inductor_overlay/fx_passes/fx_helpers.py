"""FX helpers shared by the overlay's passes: node values, op tuples, new nodes with their fake values, subgraphs of
the graph's own module, and the batch sources of matmul operands."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Optional

import torch

from inductor_overlay.fx_passes.block_sparsity import is_op as _is
from inductor_overlay import ops

aten = torch.ops.aten
prims = torch.ops.prims

_MATMULS = (aten.bmm.default, aten.mm.default)
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_VIEWS = (
    *_RESHAPES,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.permute.default,
    aten.transpose.int,
    aten.slice.Tensor,
    aten.select.int,
    aten.alias.default,
    aten.clone.default,
)


def _val(node: torch.fx.Node) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _preserves_element_order(node: torch.fx.Node) -> bool:
    """A view that keeps the row-major order of elements: reshapes, size-1 dims added/removed or moved,
    expands that expand nothing. Across such views the flat index of an element does not change."""
    if _is(node, (*_RESHAPES, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                  aten.clone.default, aten.alias.default)):
        return True
    if not (_is(node, (aten.expand.default, aten.permute.default)) and isinstance(node.args[0], torch.fx.Node)):
        return False
    source = _val(node.args[0])
    if source is None:
        return False
    if _is(node, aten.expand.default):
        return tuple(_val(node).shape) == tuple(source.shape)
    if _is(node, aten.permute.default):
        moved = [d for d in node.args[1] if source.shape[d] != 1]
        return moved == sorted(moved)
    return False


def _strip_order_preserving(node: torch.fx.Node, also: tuple = ()) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    seen = []
    while isinstance(node, torch.fx.Node) and (_preserves_element_order(node) or _is(node, also)):
        seen.append(node)
        node = node.args[0]
    return node, seen


def _strip(node: torch.fx.Node, passthrough: tuple) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    seen = []
    while _is(node, passthrough):
        seen.append(node)
        node = node.args[0]
    return node, seen


def _matmul_operands(mm: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    return mm.args[0], mm.args[1]


_OPERAND_VIEWS = (*_RESHAPES, aten.expand.default, aten.permute.default, aten.transpose.int, aten.clone.default)


def _swaps_last_two_dims(node: torch.fx.Node) -> bool:
    if _is(node, aten.transpose.int):
        rank = _val(node).dim()
        return sorted(d % rank for d in node.args[1:3]) == [rank - 2, rank - 1]
    if _is(node, aten.permute.default):
        rank = _val(node).dim()
        return list(node.args[1]) in ([*range(rank - 2), rank - 1, rank - 2], [*range(rank - 2), -1, -2])
    return False


@dataclasses.dataclass(frozen=True)
class BatchSource:
    """What a matmul operand reads, before the graph flattened its batch dims: ``node`` (transposed in its last two
    dims when ``transposed``) has batch dims whose row-major order is the operand's batch order."""

    node: torch.fx.Node
    transposed: bool


def _batch_source(operand: torch.fx.Node) -> BatchSource:
    """Peel off what only regroups batch dims or copies: reshapes keeping the last two dims, clones, expands that
    expand nothing, and swaps of the last two dims (which commute with the rest). The kernel then reads e.g. a
    transposed ``[B, S, H, D]``, or K and V repeated for GQA (``repeat_interleave`` = expand + clone + view), in
    place through their own strides instead of from a copy."""
    node, transposed = operand, False
    while True:
        source = node.args[0] if node.op == "call_function" and node.args else None
        if not isinstance(source, torch.fx.Node) or _val(source) is None:
            break
        if _swaps_last_two_dims(node):
            transposed = not transposed
        elif _is(node, _RESHAPES) and tuple(_val(source).shape[-2:]) == tuple(_val(node).shape[-2:]):
            pass
        elif not (_is(node, aten.clone.default) or (_is(node, aten.expand.default) and _val(source).shape == _val(node).shape)):
            break
        node = source
    return BatchSource(node, transposed)


def _operand_scale(operand: torch.fx.Node) -> tuple[Optional[torch.fx.Node], float]:
    """``view(s)(t * c)`` or ``view(s)(t / c)`` with a constant c: (the scaling node, c), else (None, 1).

    A dot is linear in each operand, so ``(c·q) kᵀ = c·(q kᵀ)``: the constant moves onto the scores, where the
    chain applies it to the tile in registers instead of in a separate pass over q.
    """
    base, _ = _strip(operand, _OPERAND_VIEWS)
    if not (_is(base, (aten.mul.Tensor, aten.div.Tensor)) and len(base.users) == 1):
        return None, 1.0
    factor = base.args[1]
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor == 0:
        return None, 1.0
    return base, float(factor) if base.target is aten.mul.Tensor else 1.0 / float(factor)


def _replay_views_without_scale(graph: torch.fx.Graph, operand: torch.fx.Node, scaling: torch.fx.Node) -> torch.fx.Node:
    """The operand's chain of views, re-applied to the unscaled tensor."""
    views = []
    node = operand
    while node is not scaling:
        views.append(node)
        node = node.args[0]
    replayed = scaling.args[0]
    for view in reversed(views):
        replayed = call_op(graph, view.target, (replayed, *view.args[1:]), dict(view.kwargs))
    return replayed


def _materialise(graph: torch.fx.Graph, source: BatchSource, unscaled: bool = True) -> torch.fx.Node:
    """The operand node the fused op reads: the source, transposed back if it was; with ``unscaled`` (q and k, whose
    constant factor the region moved onto the scores: ``AttentionRegion.operand_scale``) without its constant
    factor. V keeps its factor: nothing else applies it."""
    scaling, _ = _operand_scale(source.node) if unscaled else (None, 1.0)
    node = _replay_views_without_scale(graph, source.node, scaling) if scaling is not None else source.node
    if source.transposed:
        rank = _val(node).dim()
        node = call_op(graph, aten.permute.default, (node, [*range(rank - 2), rank - 1, rank - 2]))
    return node


def is_backward(node: torch.fx.Node) -> bool:
    """A node of a joint graph's backward: an op autograd made, or an upstream gradient (``tangents_*``)."""
    return node.meta.get("partitioner_tag") == "is_backward" or (
        node.op == "placeholder" and node.name.startswith("tangents")
    )


def numbered_as(old: torch.fx.Node, new: torch.fx.Node) -> torch.fx.Node:
    """``new`` with the number autograd gave ``old`` (``seq_nr``), where there is one: in a joint graph the backward
    ops of an op a rewrite replaces, left as autograd made them, then still belong to the ops that replace it (the
    training pass finds an attention's backward by these numbers)."""
    if "seq_nr" in old.meta:
        new.meta["seq_nr"] = old.meta["seq_nr"]
    return new


def call_op(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: Optional[dict] = None) -> torch.fx.Node:
    """A new node with its fake value (computed under the graph's fake mode; the overlay's own nodes by their fake
    implementation, ``ops.FAKE_IMPLS``)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    values, named = torch.fx.node.map_arg((args, kwargs), lambda arg: arg.meta.get("val"))
    tensors = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]
    with torch._guards.detect_fake_mode(tensors) or contextlib.nullcontext():
        node.meta["val"] = ops.FAKE_IMPLS.get(target, target)(*values, **named)
    return node


def call_traced(graph: torch.fx.Graph, fn: Any, args: list) -> torch.fx.Node:
    """``fn(*args)`` as the graph's own aten nodes: traced with Inductor's decompositions under the graph's fake
    mode, then each op added by ``call_op`` (a formula a pass writes once in torch, not node by node)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    values = [arg.meta["val"] for arg in args]
    with torch._guards.detect_fake_mode(values):
        traced = make_fx(fn, decomposition_table=select_decomp_table())(*values)
    return inline(graph, traced, args)


def inline(graph: torch.fx.Graph, module: torch.fx.GraphModule, args: list) -> torch.fx.Node:
    """``module``'s ops (calls only) added to ``graph`` by ``call_op``, its placeholders standing for ``args``."""
    env = dict(zip(module.graph.find_nodes(op="placeholder"), args))
    for node in module.graph.nodes:
        if node.op == "call_function":
            env[node] = call_op(graph, node.target, *torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__))
        elif node.op == "output":
            return torch.fx.node.map_arg(node.args[0], env.__getitem__)
        elif node.op != "placeholder":
            raise RuntimeError(f"an inlined module holds a {node.op} node")
    raise RuntimeError("an inlined module without output")


def subgraph(graph: torch.fx.Graph, module: torch.fx.GraphModule, stem: str) -> torch.fx.Node:
    """``module`` as a subgraph of the graph's own module: a get_attr node (``score_chain_0``, ...)."""
    owner = graph.owning_module
    name = next(f"{stem}_{i}" for i in itertools.count() if not hasattr(owner, f"{stem}_{i}"))
    owner.add_submodule(name, _scalar_fills(module))
    return graph.get_attr(name)


def _scalar_fills(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module`` with each ``full(size, value)`` whose size holds a symbolic length made a 0-d ``full`` where every
    user, a pointwise op, gives the same shape and dtype with it (the same values, broadcast): a graph module is
    pickled as its code and traced again when loaded (AOTAutograd's cache), and that tracing cannot follow a length
    inside the size list of an op with no tensor operand."""
    changed = False
    for node in list(module.graph.find_nodes(op="call_function", target=aten.full.default)):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not any(isinstance(n, torch.fx.Node) for n in node.args[0]):
            continue
        with value.fake_mode:
            scalar = torch.empty((), dtype=value.dtype, device=value.device)
        if node.users and all(_same_result_with(user, node, scalar) for user in node.users):
            node.args = ([], *node.args[1:])
            node.meta["val"] = scalar
            changed = True
    if changed:
        module.recompile()
    return module


def _same_result_with(user: torch.fx.Node, operand: torch.fx.Node, replacement: torch.Tensor) -> bool:
    """Whether pointwise ``user`` gives a result of its recorded shape and dtype with ``replacement`` for
    ``operand`` (run on the fake values)."""
    result = user.meta.get("val")
    if not (isinstance(user.target, torch._ops.OpOverload) and torch.Tag.pointwise in user.target.tags
            and isinstance(result, torch.Tensor)):
        return False
    values = {n: replacement if n is operand else n.meta.get("val") for n in user.all_input_nodes}
    if any(v is None for v in values.values()):
        return False
    # A 0-d tensor takes no part in type promotion within its category: the op must compute in the fill's dtype
    # either way, so every operand it promotes with has that dtype (a where's condition is not promoted).
    promoted = user.args
    if user.target is aten.where.self:
        promoted = () if user.args[0] is operand else user.args[1:]
    if any(isinstance(a, torch.fx.Node) and a is not operand and values[a].dtype != replacement.dtype for a in promoted):
        return False
    args, kwargs = torch.fx.node.map_arg((user.args, user.kwargs), values.__getitem__)
    try:
        with replacement.fake_mode:
            again = user.target(*args, **kwargs)
    except Exception:  # noqa: BLE001  (an op that does not take it: keep the full)
        return False
    return (isinstance(again, torch.Tensor) and again.dtype == result.dtype
            and tuple(again.shape) == tuple(result.shape))


def _broadcast(graph: torch.fx.Graph, node: torch.fx.Node, shape: list) -> torch.fx.Node:
    """``node`` expanded to ``shape`` (a view: broadcast dims are read with stride 0)."""
    if tuple(_val(node).shape) == tuple(shape):
        return node
    return call_op(graph, aten.expand.default, (node, shape))


def _hoist_before(node: torch.fx.Node, anchor: torch.fx.Node) -> None:
    """Move ``node`` and what it needs that comes after ``anchor`` to just before it, in their order (the per-pair
    tensor of a pair reduction is often viewed after the output matmul; the fused node stands where that was)."""
    position = {n: i for i, n in enumerate(anchor.graph.nodes)}
    late, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in late and position[current] > position[anchor]:
            late.add(current)
            stack.extend(current.all_input_nodes)
    for moved in sorted(late, key=position.__getitem__):
        anchor.prepend(moved)


def restore_graph(graph: torch.fx.Graph, saved: torch.fx.Graph) -> None:
    """``graph``'s nodes replaced by ``saved``'s, its placeholders kept (the partitioner knows inputs by name)."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    graph.output(graph.graph_copy(saved, dict(zip(saved.find_nodes(op="placeholder"), placeholders))))
