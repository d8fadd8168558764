"""Gradients of the floating tensors a score chain reads (a learned bias, ALiBi slopes, a temperature).

The rule. A tensor ``c`` the chain reads reaches the logits through a read ``R``: ``c`` itself or ``c`` after view
ops alone (``bias.unsqueeze(0)``, ``slopes[:, None, None]``). When every op from ``R`` to the logits is pointwise
(each broadcasts its operands elementwise) and every value on the way broadcasts to the score shape ``S``, putting
``E = R.expand(S)`` in place of ``R`` changes no logit: a pointwise op of broadcast operands is the broadcast of the
op. The gradient of ``E`` is then one value per logit, ``gE[z, m, n]``, computed in the backward kernel from the
chain's joint graph with ``E`` as input (``read_vjp_module``), like the scores' own; and the gradient of ``R`` is
``gE`` summed over the dims along which ``R`` is broadcast, the gradient of ``c`` that of ``R`` taken back through
the views. Where ``R`` varies along neither the rows nor the columns (slopes ``[H]``, a scalar) or along the
columns alone (a key bias ``[B, 1, 1, N]``), each column program of the backward sums its column tile over the rows:
a ``[Z, N]`` float32 partial, no atomics; a read varying along the rows alone sums each tile over its columns into
``[Z, M]`` (atomics across column programs); a read varying along both is written per logit into
``[*batch of R, M, N]`` (a plain store, or atomics where ``R`` is shared along a batch dim). The graph finishes the
sums (``gradient_of_read``). A table gathered by an index computed from the distance n − m alone (T5's bucket
table, ``table[bucket(n − m)]``, seen through permutes) gives each logit's gradient to the table row of its
diagonal: the column programs sum the read's gradient per diagonal (``[*batch of R, M + N − 1]``, float32 atomics)
and the graph scatters the sums into the rows the index names, computed once per distance
(``distance_tables.over_distances``); with ``config.distance_gather_gradients`` only. Anything else (another
gather, a reduction, a view after a pointwise op) declines, with the reason in the log.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from inductor_overlay import config, ops
from inductor_overlay.fx_passes.block_sparsity import is_op as _is
from inductor_overlay.fx_passes.chain_modules import traced_joint
from inductor_overlay.fx_passes.distance_tables import columns_minus_rows, distance_computing, over_distances
from inductor_overlay.fx_passes.fx_helpers import _VIEWS, _val, aten, call_op, inline, prims

# How the backward kernel accumulates a read's gradient (module doc).
FULL, ROWS, COLUMNS, DIAGONALS = "full", "rows", "columns", "diagonals"


@dataclasses.dataclass(frozen=True)
class GradientRead:
    index: int  # the captured tensor's position among the chain's inputs
    node: str  # the name, in the chain's module, of the read R
    shape: tuple  # R's shape
    kind: str  # FULL, ROWS or COLUMNS
    kept_batch: tuple  # per score batch dim, whether R varies along it (is not broadcast)

    def as_data(self) -> dict:
        return dataclasses.asdict(self)


def _placeholder(chain: torch.fx.GraphModule, index: int) -> torch.fx.Node:
    return next(n for n in chain.graph.find_nodes(op="placeholder") if n.name == f"captured_{index}")


def _broadcasts_to(shape, target) -> bool:
    return len(shape) <= len(target) and all(a == 1 or a == b for a, b in zip(reversed(shape), reversed(target)))


def _pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    if target is prims.convert_element_type.default:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _distance_gather(placeholder: torch.fx.Node) -> Optional[tuple[torch.fx.Node, object]]:
    """(the gather, its distance's tabulation) where ``placeholder``'s one use gathers rows of it (``table[i]``; an
    ``embedding`` never enters a chain) by an index computed from the distance n − m alone, into a value of the
    scores' M and N (T5's bucket table)."""
    if len(placeholder.users) != 1:
        return None
    gather = next(iter(placeholder.users))
    if not (_is(gather, aten.index.Tensor) and len(gather.args[1]) == 1):
        return None
    source, index = gather.args[0], gather.args[1][0]
    if source is not placeholder or not isinstance(index, torch.fx.Node) or _val(index) is None or _val(index).dim() != 2:
        return None
    tabulation = distance_computing(index)
    if tabulation is None or over_distances(tabulation, index) is None:  # (an index that reads a chain input)
        return None
    return gather, tabulation


def _read_of_distance_gather(read: torch.fx.Node) -> Optional[tuple]:
    """(gather, tabulation, order) for a read that is a distance gather (``_distance_gather``) seen through views
    that move its dims (``permute``) and add size-1 ones (``unsqueeze``): ``order`` names, per dim of the read, the
    gather's dim it is (None for an added one); the gather's M and N stay the read's last two dims."""
    views, node = [], read
    while _is(node, (aten.permute.default, aten.unsqueeze.default)):
        views.append(node)
        node = node.args[0]
    if node.op != "call_function" or not node.all_input_nodes or node.all_input_nodes[0].op != "placeholder":
        return None
    found = _distance_gather(node.all_input_nodes[0])
    if found is None or found[0] is not node:
        return None
    order = list(range(_val(node).dim()))
    for view in reversed(views):
        if _is(view, aten.permute.default):
            order = [order[i] for i in view.args[1]]
        else:
            dim = view.args[1] % (len(order) + 1)
            order.insert(dim, None)
    return (node, found[1], tuple(order)) if order[-2:] == [0, 1] else None


def _read_of(placeholder: torch.fx.Node) -> torch.fx.Node:
    """The end of the views alone that ``placeholder`` meets, one user at a time."""
    read = placeholder
    while len(read.users) == 1 and _is(next(iter(read.users)), _VIEWS):
        read = next(iter(read.users))
    return read


def gradient_read(chain: torch.fx.GraphModule, index: int, captured: torch.Tensor, scores: torch.Tensor) -> Union[GradientRead, str]:
    """How the gradient of captured tensor ``index`` comes out of the backward kernel, or why it cannot."""
    score_shape = tuple(scores.shape)
    if not captured.is_floating_point():
        return f"captured tensor {index} is not floating"
    if captured.device != scores.device or (captured.dim() == 0 and captured.dtype != scores.dtype):
        # (Broadcast to the scores, a 0-d tensor of another dtype would change the chain's type promotion.)
        return f"the gradient of captured tensor {index}: a 0-d tensor of another dtype or device than the scores'"
    read = _read_of(_placeholder(chain, index))
    gathered = _distance_gather(read) if read.op == "placeholder" else None
    if gathered is not None:
        if not config.distance_gather_gradients:
            return (f"the gradient of captured tensor {index}, a table gathered by the distance n − m: summed per "
                    "diagonal by the fused backward only with config.distance_gather_gradients, turned off "
                    "(FLASHLIGHT_DISTANCE_GATHER_GRADIENTS=0): not fused")
        read = _read_of(gathered[0])
        if _read_of_distance_gather(read) is None:
            return f"the gradient of captured tensor {index}: gathered by a distance, then not by views alone"
    shape = tuple(captured.shape) if read.op == "placeholder" else tuple(_val(read).shape) if _val(read) is not None else None
    if shape is None or not _broadcasts_to(shape, score_shape):
        users = ", ".join(f"`{user.target}`" for user in read.users)
        return (f"the gradient of captured tensor {index} {tuple(captured.shape)}: it reaches the scores through "
                f"{users}, not by broadcasting (a gather's gradient is a scatter, not fused)")
    frontier, seen = list(read.users), set()
    while frontier:
        node = frontier.pop()
        if node in seen or node.op == "output":
            continue
        seen.add(node)
        value = _val(node)
        if not _pointwise(node) or (value is not None and not _broadcasts_to(tuple(value.shape), score_shape)):
            return f"captured tensor {index} meets `{node.target}` on its way to the logits, not a pointwise op"
        frontier.extend(node.users)
    padded = (1,) * (len(score_shape) - len(shape)) + shape
    rows, columns = padded[-2] != 1, padded[-1] != 1
    kind = DIAGONALS if gathered is not None else FULL if rows and columns else ROWS if rows else COLUMNS
    kept = tuple(size != 1 for size in padded[:-2])
    shared = any(not k and size > 1 for k, size in zip(kept, score_shape[:-2]))
    if (kind in (ROWS, DIAGONALS) or (kind == FULL and shared)) and torch.are_deterministic_algorithms_enabled():
        return f"the gradient of captured tensor {index} is summed with atomics; deterministic algorithms are requested"
    return GradientRead(index, read.name, shape, kind, kept)


class _ReadReplaced(ops._Differentiable):
    """Runs the chain with the read ``node`` broadcast to ``shape`` and made a leaf of autograd (``expanded``)."""

    def __init__(self, module, node: str, shape):
        super().__init__(module)
        self.node, self.shape, self.expanded = node, list(shape), None

    def run_node(self, n):
        value = super().run_node(n)
        if n.name == self.node:
            self.expanded = value.detach().expand(self.shape).clone().requires_grad_()
            return self.expanded
        return value


def read_vjp_module(chain: torch.fx.GraphModule, read: GradientRead, example_inputs: list) -> torch.fx.GraphModule:
    """``(scores, *captured, *sizes, grad_logits) -> gE``: the gradient, float32 per logit, of the read broadcast to
    the score shape (module doc), from autograd's joint graph of the chain."""

    def joint(scores, *rest):
        *inputs, grad_logits = rest
        interpreter = _ReadReplaced(chain, read.node, scores.shape)
        with torch.enable_grad():
            logits = interpreter.run(scores, *inputs)
            (grad,) = torch.autograd.grad(logits, interpreter.expanded, grad_logits, allow_unused=True)
        if grad is None:
            return torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
        return grad.to(torch.float32)

    return traced_joint(chain, example_inputs, joint, differentiate_scores=False)


def _views_back(chain: torch.fx.GraphModule, read: GradientRead, captured: torch.Tensor) -> torch.fx.GraphModule:
    """``(c, grad_read) -> grad_c``: the views from the captured tensor to its read, differentiated."""
    from torch.fx.experimental.proxy_tensor import make_fx

    placeholder = _placeholder(chain, read.index)
    views, node = [], placeholder
    while node.name != read.node:
        node = next(iter(node.users))
        views.append(node)

    def back(c, grad_read):
        with torch.enable_grad():
            leaf = c.detach().requires_grad_()
            env = {placeholder: leaf}
            for view in views:
                env[view] = view.target(*torch.fx.node.map_arg(view.args, env.__getitem__), **view.kwargs)
            (grad,) = torch.autograd.grad(env[views[-1]] if views else leaf, leaf, grad_read)
        return grad

    from torch._inductor.decomposition import select_decomp_table

    # (Traced with Inductor's decompositions: a slice's or a select's backward is then ops Inductor lowers.)
    with torch._guards.detect_fake_mode([captured]):
        return make_fx(back, decomposition_table=select_decomp_table())(
            captured, torch.empty(read.shape, dtype=captured.dtype, device=captured.device)
        )


def gradient_of_read(
    graph: torch.fx.Graph, chain: torch.fx.GraphModule, read: GradientRead, partial: torch.fx.Node,
    captured: torch.fx.Node, score_shape,
) -> torch.fx.Node:
    """The gradient of the captured tensor from the kernel's partial (module doc), in the captured tensor's dtype."""
    batch, (m, n) = list(score_shape[:-2]), score_shape[-2:]
    padded = [1] * (len(score_shape) - len(read.shape)) + list(read.shape)
    if read.kind == DIAGONALS:
        return _gradient_of_distance_gather(graph, chain, read, partial, captured)
    if read.kind == FULL:
        grad = partial
    else:
        along = [m, 1] if read.kind == ROWS else [1, n]
        grad = call_op(graph, aten.view.default, (partial, [*batch, *along]))
        summed = [i for i, size in enumerate(padded) if size == 1 and _val(grad).shape[i] != 1]
        if summed:
            grad = call_op(graph, aten.sum.dim_IntList, (grad, summed, True))
    grad = call_op(graph, aten.reshape.default, (grad, list(read.shape)))
    value = _val(captured)
    grad = call_op(graph, prims.convert_element_type.default, (grad, value.dtype))
    if read.node == _placeholder(chain, read.index).name:
        return grad
    return inline(graph, _views_back(chain, read, value), [captured, grad])


def _gradient_of_distance_gather(
    graph: torch.fx.Graph, chain: torch.fx.GraphModule, read: GradientRead, partial: torch.fx.Node, captured: torch.fx.Node,
) -> torch.fx.Node:
    """The gradient of a table gathered by a distance (``DIAGONALS``): the kernel's partial holds the read's
    gradient summed over each diagonal n − m (``[*kept batch, M + N − 1]``, from m − n = M − 1 to n − m = N − 1);
    moved to the gather's dims, each diagonal's sum is scattered (added) into the row its index names, the index
    computed once per distance."""
    node = next(n for n in chain.graph.nodes if n.name == read.node)
    gather, tabulation, order = _read_of_distance_gather(node)
    indices = inline(graph, over_distances(tabulation, gather.args[1][0]), [])
    distances = _val(partial).shape[-1]
    if not columns_minus_rows(tabulation):  # the index's own order runs from m − n = -(N − 1): reversed
        value = _val(indices)
        backwards = call_op(graph, prims.iota.default, (distances,), dict(
            start=distances - 1, step=-1, dtype=torch.int64, device=value.device, requires_grad=False))
        indices = call_op(graph, aten.index.Tensor, (indices, [backwards]))
    grad = call_op(graph, aten.reshape.default, (partial, [*read.shape[:-2], distances]))
    kept = [i for i, source in enumerate(order[:-2]) if source is not None]
    grad = call_op(graph, aten.reshape.default, (grad, [*(read.shape[i] for i in kept), distances]))
    sources = [order[i] for i in kept]  # the gather's dims (2, 3, ...) of the kept dims; the distances are its 0, 1
    permutation = [len(sources), *(sources.index(dim) for dim in range(2, 2 + len(sources)))]
    grad = call_op(graph, aten.permute.default, (grad, permutation))
    value = _val(captured)
    zeros = call_op(graph, aten.full.default, (list(value.shape), 0.0), dict(dtype=torch.float32, device=value.device))
    grad = call_op(graph, aten.index_put.default, (zeros, [indices], grad, True))
    return call_op(graph, prims.convert_element_type.default, (grad, value.dtype))
