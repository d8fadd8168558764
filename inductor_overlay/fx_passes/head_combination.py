"""Distribute an output matmul over a linear combination of attention heads (differential attention).

DIFF Transformer computes ``(A[:, :, 0] - λ·A[:, :, 1]) @ V`` where ``A`` is one softmax over 2h heads viewed as
``[B, h, 2, M, N]``. A matmul is linear in its left operand, and each coefficient (λ) is constant along N, the
dim the matmul contracts, so ``(Σ_j c_j·A_j) V = Σ_j c_j·(A_j V)``. The right side is one attention over all 2h
heads — head ``2i+j`` reads V's head ``i`` in place through a stride-0 expand, as for GQA — followed by the same
combination applied to its ``[.., M, Dv]`` output: a pointwise op over the output instead of over the M×N
probabilities. The attention then fuses into one online-softmax kernel. When the coefficients are scalars and the
split dim is the innermost head dim, that kernel also does the combination (``config.combine_head_groups_in_kernel``):
each program runs the heads of one group in turn and adds their normalised outputs, weighted, into one output
tile (one kernel, and the per-head outputs never reach memory). The rewrite is kept only when the new matmul fuses
(``find_attention`` accepts it); otherwise the graph is left as it was.

Written the other way round, ``A0 @ V − λ·(A1 @ V)``, neither output matmul can own the softmax both read. The
matmuls share V and each coefficient is constant along Dv, so they factor into ``(A0 − λ·A1) @ V`` first
(``factor_shared_right_operand``), which then distributes as above; again kept only when the attention fuses.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch._dynamo.utils import counters
from torch.fx.node import map_arg

from inductor_overlay import config
from inductor_overlay.fx_passes.fx_helpers import (
    _MATMULS,
    _VIEWS,
    call_op,
    _batch_source,
    _strip_order_preserving,
    _val,
)
from inductor_overlay.fx_passes.attention_region import Decline, find_attention
from inductor_overlay.fx_passes.block_sparsity import is_op as _is
from inductor_overlay.fx_passes.attention_fusion import fuse
from inductor_overlay.fx_passes.block_sparsity import depends_on

log = logging.getLogger("flashlight.attention_fusion")

aten = torch.ops.aten

_COMBINING = (aten.add.Tensor, aten.sub.Tensor)
_SCALING = (aten.mul.Tensor, aten.div.Tensor)


class _Combination:
    """``Σ_j c_j · select(W, dim, j)`` found in a graph: the terms (selects), the ops combining them (graph order)."""

    def __init__(self, dead: frozenset = frozenset()) -> None:
        self.dead = dead  # users that a rewrite in progress is about to remove
        self.heads: Optional[torch.fx.Node] = None  # W, the probabilities viewed with the head dim split
        self.dim: Optional[int] = None
        self.terms: list[torch.fx.Node] = []
        self.ops: list[torch.fx.Node] = []
        self.coefficients: list[torch.fx.Node] = []

    def replay(self, build: "_Builder", term_values: dict) -> torch.fx.Node:
        """The combination again, with each term replaced by ``term_values[term]``."""
        env = dict(term_values)
        for op in self.ops:
            env[op] = build.call(op.target, *map_arg(op.args, lambda a: env.get(a, a)), **op.kwargs)
        return env[self.ops[-1]]

    def _is_term(self, node: torch.fx.Node) -> bool:
        """A head slice ``select(W, dim, j)``, all of one W and one dim, outside its last two dims."""
        if not (_is(node, aten.select.int) and isinstance(node.args[0], torch.fx.Node)):
            return False
        heads, dim = node.args[0], node.args[1] % _val(node.args[0]).dim()
        if self.heads is None:
            self.heads, self.dim = heads, dim
        return heads is self.heads and dim == self.dim and dim < _val(heads).dim() - 2

    def _is_coefficient(self, operand: Any) -> bool:
        """Constant along N (the contracted last dim); checked independent of the heads once they are known."""
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return True
        value = _val(operand)
        if value is None or (value.dim() > 0 and value.shape[-1] != 1):
            return False
        self.coefficients.append(operand)
        return True

    def coefficients_independent(self) -> bool:
        return not any(depends_on(c, self.heads, {}) for c in self.coefficients)

    def match(self, node: torch.fx.Node, shape: tuple, top: bool = True) -> bool:
        """Whether ``node`` is a linear combination of terms, each op used once and keeping ``shape``."""
        if _val(node) is None or tuple(_val(node).shape) != shape:
            return False
        if not top and len([u for u in node.users if u not in self.dead]) != 1:
            return False
        if self._is_term(node):
            self.terms.append(node)
            return True
        alpha = node.kwargs.get("alpha", 1)
        if _is(node, _COMBINING) and alpha == 1 and all(isinstance(a, torch.fx.Node) for a in node.args[:2]):
            matched = self.match(node.args[0], shape, False) and self.match(node.args[1], shape, False)
        elif _is(node, aten.mul.Tensor):
            a, b = node.args[:2]
            matched = (self._is_coefficient(b) and self.match(a, shape, False)) or (
                self._is_coefficient(a) and self.match(b, shape, False)
            )
        elif _is(node, aten.div.Tensor):
            matched = self._is_coefficient(node.args[1]) and self.match(node.args[0], shape, False)
        elif _is(node, aten.neg.default):
            matched = self.match(node.args[0], shape, False)
        else:
            return False
        if matched:
            self.ops.append(node)
        return matched


class _MatmulCombination(_Combination):
    """``Σ_j c_j · (X_j @ V)``: the terms are matmul outputs (through order-keeping views), all of the same right
    operand ``V``. Each coefficient is constant along the output's last dim (Dv), so ``c_j·(X_j V) = (c_j·X_j) V``."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls: dict[torch.fx.Node, torch.fx.Node] = {}  # term -> its matmul
        # term -> its left operand as the user wrote it ([.., M, N], before the matmul's batch flattening)
        self.lefts: dict[torch.fx.Node, torch.fx.Node] = {}
        self.views: list[torch.fx.Node] = []  # between each term and its matmul, and on each left operand

    def _is_term(self, node: torch.fx.Node) -> bool:
        matmul, views = _strip_order_preserving(node)
        if not _is(matmul, _MATMULS):
            return False
        left, left_views = _strip_order_preserving(matmul.args[0])
        if not all(len(n.users) == 1 for n in (matmul, *views[1:], *left_views)):
            return False
        first = next(iter(self.matmuls.values()), matmul)
        same_form = matmul.target == first.target and _val(matmul.args[0]).shape == _val(first.args[0]).shape
        if not (same_form and _same_value(matmul.args[1], first.args[1])):
            return False
        self.matmuls[node], self.lefts[node] = matmul, left
        self.views += [*views, *left_views]
        return True


def _same_value(a: Any, b: Any) -> bool:
    """Whether two operands are the same node, or the same views (equal arguments) of the same node."""
    while a is not b:
        if not (_is(a, _VIEWS) and _is(b, _VIEWS) and a.target == b.target and a.args[1:] == b.args[1:]
                and a.kwargs == b.kwargs):
            return False
        a, b = a.args[0], b.args[0]
    return True


class _Builder:
    """Adds nodes before ``anchor`` with their fake values, and can take them all back."""

    def __init__(self, anchor: torch.fx.Node) -> None:
        self.graph, self.anchor, self.added = anchor.graph, anchor, []

    def call(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = call_op(self.graph, target, args, kwargs)
        self.added.append(node)
        return node

    def take_back(self) -> None:
        for node in reversed(self.added):
            self.graph.erase_node(node)


def _coefficient_vector(build: _Builder, found: _Combination, groups: int) -> torch.fx.Node:
    """The combination's coefficient of each head, ``c_j = combination(e_j)`` (it is linear), as a [G] tensor built
    by pointwise ops only (``where(iota(G) == j, c_j, ...)``), so that it is one small kernel, not one per head."""
    device = _val(found.heads).device
    head_index = build.call(
        torch.ops.prims.iota.default, groups, start=0, step=1, dtype=torch.int64, device=device, requires_grad=False
    )
    vector = build.call(aten.full.default, [groups], 0.0, dtype=torch.float32, device=device)
    for head in range(groups):
        units = {
            s: build.call(aten.full.default, [], float(s.args[2] % groups == head), dtype=torch.float32, device=device)
            for s in found.terms
        }
        coefficient = build.call(torch.ops.prims.convert_element_type.default, found.replay(build, units), torch.float32)
        vector = build.call(aten.where.self, build.call(aten.eq.Scalar, head_index, head), coefficient, vector)
    return vector


def distribute_over_heads(pv: torch.fx.Node, dead: frozenset = frozenset()) -> Optional[Decline]:
    """Rewrite ``combination(W) @ V`` as ``combination(W @ expand(V))`` when the new matmul fuses. Users in
    ``dead`` are about to be removed by the caller's rewrite."""
    if not _is(pv, _MATMULS):
        return Decline("not a matmul")
    combined, views = _strip_order_preserving(pv.args[0])
    found = _Combination(dead)
    if not (found.match(combined, tuple(_val(combined).shape)) and len(found.terms) >= 2
            and found.coefficients_independent()):
        return Decline("the matmul's left operand is not a combination of head slices")
    heads, dim = found.heads, found.dim
    head_shape = tuple(_val(heads).shape)
    if not isinstance(head_shape[dim], int):
        return Decline("the number of heads the combination splits is symbolic")
    if sorted(s.args[2] % head_shape[dim] for s in found.terms) != list(range(head_shape[dim])):
        return Decline("the combination does not use every head of the split dim exactly once")

    build = _Builder(pv)
    # Scalar coefficients on the innermost batch dim: the kernel combines each group of heads itself.
    in_kernel = (
        config.combine_head_groups_in_kernel
        and dim == len(head_shape) - 3
        and all(_val(c).dim() == 0 for c in found.coefficients)
    )
    coefficients = _coefficient_vector(build, found, head_shape[dim]) if in_kernel else None
    batch, (m, n), dv = head_shape[:-2], head_shape[-2:], _val(pv).shape[-1]
    values = pv.args[1]
    source = _batch_source(values)
    kept_batch = tuple(_val(combined).shape[:-2])
    if not source.transposed and tuple(_val(source.node).shape[:-2]) == kept_batch:
        values = source.node
    else:
        values = build.call(aten.reshape.default, values, [*kept_batch, n, dv])
    shared = build.call(aten.expand.default, build.call(aten.unsqueeze.default, values, dim), [*batch, n, dv])
    flat_heads = build.call(aten.reshape.default, heads, [-1, m, n])
    out = build.call(aten.bmm.default, flat_heads, build.call(aten.reshape.default, shared, [-1, n, dv]))
    region = find_attention(out, dead=frozenset([*found.terms, *found.ops, *views, pv, *dead]))
    if not isinstance(region, Decline) and region.pair is not None:
        region = Decline("the combined heads' probabilities are also reduced against a per-pair tensor")
    if isinstance(region, Decline):
        build.take_back()
        return region
    if coefficients is not None:
        combined = fuse(region, coefficients)
        if tuple(_val(combined).shape) != tuple(_val(pv).shape):
            combined = build.call(aten.reshape.default, combined, list(_val(pv).shape))
        pv.replace_all_uses_with(combined)
        counters["inductor"]["flashlight_attention_fused"] += 1
        return None

    per_head = build.call(aten.reshape.default, out, [*batch, m, dv])
    selected = {s: build.call(aten.select.int, per_head, dim, s.args[2]) for s in found.terms}
    result = build.call(aten.reshape.default, found.replay(build, selected), list(_val(pv).shape))
    pv.replace_all_uses_with(result)
    return None


def factor_shared_right_operand(root: torch.fx.Node) -> Optional[Decline]:
    """Rewrite ``Σ_j c_j·(X_j @ V)`` (DIFF Transformer written ``A0 @ V − λ·(A1 @ V)``) as ``(Σ_j c_j·X_j) @ V``
    and distribute that over the heads, keeping the rewrite only when the distributed matmul fuses."""
    found = _MatmulCombination()
    if not (_val(root) is not None and found.match(root, tuple(_val(root).shape)) and len(found.terms) >= 2):
        return Decline("not a combination of matmuls sharing their right operand")
    out_rows = tuple(_val(root).shape[:-1])
    if any(_val(x) is None or tuple(_val(x).shape[:-1]) != out_rows for x in found.lefts.values()):
        return Decline("a left operand is broadcast by its matmul")
    build = _Builder(root)
    first = next(iter(found.matmuls.values()))
    combined = found.replay(build, found.lefts)
    flat = build.call(aten.reshape.default, combined, list(_val(first.args[0]).shape))
    pv = build.call(first.target, flat, first.args[1])
    out = build.call(aten.reshape.default, pv, list(_val(root).shape))
    replaced = frozenset([*found.ops, *found.terms, *found.views, *found.matmuls.values()])
    outcome = distribute_over_heads(pv, dead=replaced)
    if outcome is not None:
        build.take_back()
        return outcome
    root.replace_all_uses_with(out)
    return None


def distribute_matmul_over_head_combinations(graph: torch.fx.Graph) -> None:
    """Post-grad pass, before attention fusion: see the module doc."""
    if not config.attention_fusion:
        return
    changed = False
    for root in reversed([n for n in graph.nodes if _is(n, (*_COMBINING, *_SCALING, aten.neg.default))]):
        if root.users and factor_shared_right_operand(root) is None:
            changed = True
            log.info("matmuls sharing %s factored and distributed over a combination of heads", root.name)
            graph.eliminate_dead_code()
    # mm too: on a GPU, upstream's joint-graph pass turns a bmm of batch 1 into an mm of the squeezed operands.
    for pv in [n for n in graph.nodes if _is(n, _MATMULS)]:
        outcome = distribute_over_heads(pv)
        if outcome is None:
            changed = True
            log.info("matmul %s distributed over a combination of heads", pv.name)
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
