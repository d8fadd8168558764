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
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch._dynamo.utils import counters
from torch.fx.node import map_arg

from inductor_overlay import config
from inductor_overlay.fx_passes.attention_fusion import (
    _MATMULS,
    call_op,
    Decline,
    _batch_source,
    _is,
    _strip_order_preserving,
    _val,
    find_attention,
    fuse,
)
from inductor_overlay.fx_passes.block_sparsity import depends_on

log = logging.getLogger("flashlight.attention_fusion")

aten = torch.ops.aten

_COMBINING = (aten.add.Tensor, aten.sub.Tensor)
_SCALING = (aten.mul.Tensor, aten.div.Tensor)


class _Combination:
    """``Σ_j c_j · select(W, dim, j)`` found in a graph: the selects, the ops combining them (graph order)."""

    def __init__(self) -> None:
        self.heads: Optional[torch.fx.Node] = None  # W, the probabilities viewed with the head dim split
        self.dim: Optional[int] = None
        self.selects: list[torch.fx.Node] = []
        self.ops: list[torch.fx.Node] = []
        self.coefficients: list[torch.fx.Node] = []

    def replay(self, build: "_Builder", head_values: dict) -> torch.fx.Node:
        """The combination again, with each head slice replaced by ``head_values[select]``."""
        env = dict(head_values)
        for op in self.ops:
            env[op] = build.call(op.target, *map_arg(op.args, lambda a: env.get(a, a)), **op.kwargs)
        return env[self.ops[-1]]

    def _is_head_slice(self, node: torch.fx.Node) -> bool:
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
        """Whether ``node`` is a linear combination of head slices, each op used once and keeping ``shape``."""
        if _val(node) is None or tuple(_val(node).shape) != shape or (not top and len(node.users) != 1):
            return False
        if self._is_head_slice(node):
            self.selects.append(node)
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
            for s in found.selects
        }
        coefficient = build.call(torch.ops.prims.convert_element_type.default, found.replay(build, units), torch.float32)
        vector = build.call(aten.where.self, build.call(aten.eq.Scalar, head_index, head), coefficient, vector)
    return vector


def distribute_over_heads(pv: torch.fx.Node) -> Optional[Decline]:
    """Rewrite ``combination(W) @ V`` as ``combination(W @ expand(V))`` when the new matmul fuses."""
    if not _is(pv, _MATMULS):
        return Decline("not a matmul")
    combined, views = _strip_order_preserving(pv.args[0])
    found = _Combination()
    if not (found.match(combined, tuple(_val(combined).shape)) and len(found.selects) >= 2
            and found.coefficients_independent()):
        return Decline("the matmul's left operand is not a combination of head slices")
    heads, dim = found.heads, found.dim
    head_shape = tuple(_val(heads).shape)
    if sorted(s.args[2] % head_shape[dim] for s in found.selects) != list(range(head_shape[dim])):
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
    region = find_attention(out, dead=frozenset([*found.selects, *found.ops, *views, pv]))
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
    selected = {s: build.call(aten.select.int, per_head, dim, s.args[2]) for s in found.selects}
    result = build.call(aten.reshape.default, found.replay(build, selected), list(_val(pv).shape))
    pv.replace_all_uses_with(result)
    return None


def distribute_matmul_over_head_combinations(graph: torch.fx.Graph) -> None:
    """Post-grad pass, before attention fusion: see the module doc."""
    if not config.attention_fusion:
        return
    changed = False
    # mm too: on a GPU, upstream's joint-graph pass turns a bmm of batch 1 into an mm of the squeezed operands.
    for pv in [n for n in graph.nodes if _is(n, _MATMULS)]:
        outcome = distribute_over_heads(pv)
        if outcome is None:
            changed = True
            log.info("matmul %s distributed over a combination of heads", pv.name)
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
