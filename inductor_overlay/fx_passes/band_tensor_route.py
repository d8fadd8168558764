"""Attention masked by tensors made outside the graph runs with a band's formula while those tensors hold that band:
a causal sliding window, a prefix every row sees (prefix-LM), or both, passed in as a mask, sliced from a buffer,
added as a float mask.

Legality. The region is one the causal route takes (``causal_tensor_route``: its masks are ``where`` nodes with -inf
or absorbing fills, or one float bias added last, read from tensors the graph is given), in the branch of that route
where the mask is not causal. Let ``band_parameters`` read W and P off the mask's first entry (P the keys its first
row keeps when more than one, W the keys from P on its last row keeps). Where every entry of the mask masks exactly
``~(((n <= m) & (m - n < W)) | (n < P))``, with W ≥ 1 or P ≥ 1 (every row keeps a key: its own, or the first), the
region computes exactly its copy in which each mask is that formula and each fill -inf: a fill or bias that absorbs
where every row keeps a key adds exactly 0 to its row's sums, as -inf does (for logits up to 2^124, as for the causal
route; for a bias, a NaN or infinite logit at a masked position, which eager carries into its row, is -inf in the
copy). W and P are computed in the copy from the mask's two rows by the function the check uses, on the same
tensors, so they are the values the check compared with. The copy's kernel reads W and P once (integer scalars of
its formula, ``ops.SCALAR_READS``), skips and splits tiles by them as the in-function form does by its constants,
and runs the entirely visible tiles without mask.

The region becomes ``torch.cond(known_band(tensors), band_branch, fused_branch, operands)``
(``mask_checks.known_band``: checked on the device from the second call that sees the same tensors at the same
version); the branches are copies of the region's nodes, both fused as any region is. In inference only; in a
joint graph the causal route alone applies.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._inductor.pattern_matcher import stable_topological_sort

from inductor_overlay import config
from inductor_overlay.fx_passes.attention_region import AttentionRegion
from inductor_overlay.fx_passes.causal_tensor_route import (
    CausalMasks,
    _tensor_masks,
    as_formula,
    masked_by,
    route_on_mask_check,
)
from inductor_overlay.fx_passes.fx_helpers import call_op, call_traced, prims
from inductor_overlay.mask_checks import band_masked, band_parameters, known_band

aten = torch.ops.aten


def band_route_masks(region: AttentionRegion) -> Optional[CausalMasks]:
    """The region's masks where the band route may take them (the causal route's, with the switch on)."""
    return _tensor_masks(region) if config.band_tensor_route else None


def route_when_band(region: AttentionRegion, masks: CausalMasks, fuse_branch) -> Optional[torch.fx.Node]:
    """Replace the region by a ``cond`` between its copy with the band's formula and its copy that reads the masks,
    each fused by ``fuse_branch``, on ``known_band`` of its masks' tensors; return the node standing for the
    branches' output, or None (the region left as it was)."""
    return route_on_mask_check(
        region, masks, lambda graph, copies, rows: _as_band_formula(graph, copies, masks, rows), known_band,
        (fuse_branch, fuse_branch), lambda branch: ("band_formula", "band_mask_read"),
    )


def _as_band_formula(graph: torch.fx.Graph, copies: dict, masks: CausalMasks, rows: int) -> bool:
    """The copies of the masks made the band's formula, its parameters read off the copies' own mask; False where
    the mask is not ``[..., rows, rows]``."""
    output = graph.find_nodes(op="output")[0]
    with graph.inserting_before(output):
        masked = masked_by(graph, masks, copies.__getitem__, lambda target, args: call_op(graph, target, args))
        if tuple(masked.meta["val"].shape[-2:]) != (rows, rows):
            return False
        width, prefix = call_traced(graph, band_parameters, [masked])
    device = masked.meta["val"].device
    kwargs = dict(start=0, step=1, dtype=torch.int32, device=device, requires_grad=False)  # (W and P are int32)

    def formula(graph: torch.fx.Graph, device: torch.device, masked: bool, shape: list) -> torch.fx.Node:
        positions = call_op(graph, prims.iota.default, (rows,), kwargs)
        at_rows = call_op(graph, aten.unsqueeze.default, (positions, 1))
        at_columns = call_op(graph, aten.unsqueeze.default, (positions, 0))
        band = call_traced(graph, band_masked, [at_rows, at_columns, width, prefix])
        if not masked:
            band = call_op(graph, aten.bitwise_not.default, (band,))
        return call_op(graph, aten.expand.default, (band, shape))

    if not as_formula(copies, masks, formula, minus_inf_fills=True):
        return False
    stable_topological_sort(graph)
    return True
