"""Split attention scores computed by ``baddbmm`` into the matmul and the pointwise ops around it.

BLOOM's attention computes its scores and ALiBi bias in one call, ``alibi.baddbmm(q, kᵀ, beta=1, alpha=1/√d)``:
``beta·input + alpha·(q @ kᵀ)``. The attention pass follows a chain of pointwise ops from a ``bmm``; written as
``bmm``, ``mul`` and ``add``, the bias and the scale become part of that chain, as they are in code that spells
them out. The split is taken only where the product reaches a softmax's row max, so other ``baddbmm`` calls keep
upstream's kernel. ``beta = 0`` ignores ``input`` (NaN included), as ``baddbmm`` does.

In a joint graph (training) the split runs before the attention pass as well: its ops carry the number autograd
gave ``baddbmm`` (``seq_nr``), whose backward ops, left as autograd made them, then belong to the attention's own
backward (``attention_training``'s rule).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from inductor_overlay import config
from inductor_overlay.fx_passes.fx_helpers import call_op, numbered_as
from inductor_overlay.fx_passes.attention_region import reaches_row_max

aten = torch.ops.aten
log = logging.getLogger("flashlight.attention_fusion")


def _scaled(graph: torch.fx.Graph, node: torch.fx.Node, factor: object) -> torch.fx.Node:
    return node if factor == 1 else call_op(graph, aten.mul.Tensor, (node, factor))


def _batch_view(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The product's only user when it views the batch dim apart (``[B·H, M, N]`` → ``[B, H, M, N]``)."""
    users = list(node.users)
    if len(users) != 1 or users[0].target not in (aten.view.default, aten.reshape.default):
        return None
    shape, viewed = node.meta["val"].shape, users[0].meta["val"].shape
    return users[0] if tuple(viewed[-2:]) == tuple(shape[-2:]) else None


def _addend_shape(addend: torch.fx.Node, batch: int, viewed_batch: list) -> Optional[list]:
    """``input``'s shape with its batch dim viewed apart as the product's is (``[B·H, 1, N]`` → ``[B, H, 1, N]``),
    so that it broadcasts against the viewed product; None where it has a batch dim that does not split so."""
    shape = list(addend.meta["val"].shape)
    if len(shape) < 3:
        return shape  # broadcasts from the right whatever the batch dims
    if shape[0] == batch:
        return [*viewed_batch, *shape[1:]]
    return [1] * len(viewed_batch) + shape[1:] if shape[0] == 1 else None


def split_baddbmm_scores(graph: torch.fx.Graph) -> None:
    """Post-grad pass: ``baddbmm(input, a, b, beta, alpha)`` that feeds a softmax → ``alpha·bmm(a, b) + beta·input``,
    with a view of the result applied to both terms (the chain starts at the product's view)."""
    if not config.attention_fusion:
        return
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.baddbmm.default or not reaches_row_max(node):
            continue
        addend, left, right = node.args[:3]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        view = _batch_view(node)
        viewed_shape = list((view or node).meta["val"].shape)
        addend_shape = _addend_shape(addend, node.meta["val"].shape[0], viewed_shape[:-2])
        if addend_shape is None:
            continue
        before_new = node.prev
        with graph.inserting_before(node):
            product = call_op(graph, aten.bmm.default, (left, right))
            if view is not None:
                product = call_op(graph, aten.reshape.default, (product, viewed_shape))
            product = _scaled(graph, product, alpha)
            if beta != 0:
                if addend_shape != list(addend.meta["val"].shape):
                    addend = call_op(graph, aten.reshape.default, (addend, addend_shape))
                product = call_op(graph, aten.add.Tensor, (product, _scaled(graph, addend, beta)))
        inserted = before_new.next
        while inserted is not node:
            inserted = numbered_as(node, inserted).next
        replaced = view if view is not None else node
        replaced.replace_all_uses_with(product)
        graph.erase_node(replaced)
        if replaced is not node:
            graph.erase_node(node)
        log.info("baddbmm %s feeding a softmax split into bmm and pointwise ops", node.name)
