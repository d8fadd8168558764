"""Give plain causal attention to SDPA's kernel, where that kernel is faster than ours.

A region whose score chain only scales the scores by constants and masks ``n > m`` (the top-left causal mask over a
square score matrix, with -inf or a fill that absorbs as -inf does: GPT-2's ``finfo.min``) computes exactly
``scaled_dot_product_attention(q, k, v, is_causal=True, scale=s)``. On the H100 (bf16) SDPA's fused causal kernel
took 10–23% less time than the overlay's (benchmarks/results/h100_2026-11-23_additive_masks/final_grid_bias/), so
under the SDPA policies that keep upstream's rewrites (``config.sdpa_pattern_policy`` "sdpa" and "unmasked_sdpa")
such a region may go to SDPA (``config.causal_sdpa_devices``), as upstream already sends it the unmasked forms. Any
other mask, bias, transform, grouped K/V or dtype stays with the overlay's kernel. ``scaled_dot_product_attention``
is traced under the graph's fake mode, so the backend (cuDNN, FlashAttention, ...) is the one eager would pick.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import sympy
import torch
from torch._inductor.pattern_matcher import fwd_only

from inductor_overlay import config
from inductor_overlay.fx_passes.attention_fusion import (
    _RESHAPES,
    AttentionRegion,
    BatchSource,
    _materialise,
    _reroute_size_reads,
    _score_chain_module,
    call_op,
)
from inductor_overlay.fx_passes.block_sparsity import COL, ROW, absorbing_fill_masks, position_masks
from inductor_overlay.fx_passes.logit_scale import fold_constant_scale


aten = torch.ops.aten
prims = torch.ops.prims

# The largest head dim given to SDPA: the head dims its causal kernel was measured at (64, 128).
MAX_SDPA_HEAD_DIM = 128

# (integer expression e, relation) -> e' such that "relation holds" is "e' >= 0", over the integers.
_AS_NONNEGATIVE = {
    sympy.GreaterThan: lambda e: e,
    sympy.StrictGreaterThan: lambda e: e - 1,
    sympy.LessThan: lambda e: -e,
    sympy.StrictLessThan: lambda e: -e - 1,
}


def masks_above_diagonal(formula: Optional[sympy.Boolean]) -> bool:
    """Whether ``formula`` (where the logit is -inf, over positions m and n) is exactly ``n > m``."""
    if not isinstance(formula, sympy.core.relational.Relational) or type(formula) not in _AS_NONNEGATIVE:
        return False
    nonnegative = _AS_NONNEGATIVE[type(formula)](formula.lhs - formula.rhs)
    return sympy.expand(nonnegative - (COL - ROW - 1)) == 0


def _only_dtype_conversions(module: torch.fx.GraphModule) -> bool:
    conversion = prims.convert_element_type.default
    return all(
        node.op != "call_function" or (node.target is conversion and node.args[1].is_floating_point)
        for node in module.graph.nodes
    )


def _logical_shape(source: BatchSource) -> tuple:
    """The operand's shape as the matmul reads it (the source's last two dims swapped back if it is transposed)."""
    shape = tuple(source.node.meta["val"].shape)
    return (*shape[:-2], shape[-1], shape[-2]) if source.transposed else shape


def causal_sdpa_scale(region: AttentionRegion) -> Optional[float]:
    """The softmax scale when ``region`` is SDPA's causal attention and the policy gives it to SDPA, else None."""
    values = [source.node.meta["val"] for source in (region.q, region.kt, region.v)]
    if (
        config.sdpa_pattern_policy not in ("sdpa", "unmasked_sdpa")
        or values[0].device.type not in config.causal_sdpa_devices
        or not region.softmax
        or region.sink is not None
        or region.pair is not None
        or region.captured
        or region.captured_sizes
    ):
        return None
    dtypes = {value.dtype for value in values} | {region.probability_dtype}
    if len(dtypes) != 1 or dtypes - {torch.float16, torch.bfloat16}:
        return None
    shapes = [_logical_shape(source) for source in (region.q, region.kt, region.v)]
    (*batch, m, d), (*k_batch, d_k, n), (*v_batch, n_v, d_v) = shapes
    sizes = (*batch, *k_batch, *v_batch, m, d, n, d_v)
    if not (
        all(isinstance(size, int) for size in sizes)
        and batch == k_batch == v_batch
        and len(batch) <= 2
        and m == n == n_v
        and d == d_k == d_v <= MAX_SDPA_HEAD_DIM
        and d % 8 == 0
        and all(0 not in value.stride() for value in values)
    ):
        return None
    fills = absorbing_fill_masks(region.chain, region.score_root, region.logits, region.logit_scale)
    formula, mask_nodes, _ = position_masks(region.chain, len(region.score_root.meta["val"].shape), fills)
    if not masks_above_diagonal(formula):
        return None
    scale_only = _score_chain_module(region, frozenset(mask_nodes))
    folded = fold_constant_scale(scale_only)
    module, scale = folded if folded is not None else (scale_only, 1.0)
    return scale if _only_dtype_conversions(module) else None


def _sdpa_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.fx.GraphModule:
    """``scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)`` traced to the aten ops Inductor lowers."""

    def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    with torch._guards.detect_fake_mode([q, k, v]) or contextlib.nullcontext():
        return fwd_only(causal_attention, [q, k, v])


def replace_by_causal_sdpa(region: AttentionRegion, scale: float) -> torch.fx.Node:
    """Replace the region by SDPA's causal attention and return the node that now stands for ``region.pv``."""
    graph = region.pv.graph
    with graph.inserting_before(region.pv):
        q, kt, v = (_materialise(graph, source) for source in (region.q, region.kt, region.v))
        rank = kt.meta["val"].dim()
        k = call_op(graph, aten.permute.default, (kt, [*range(rank - 2), rank - 1, rank - 2]))
        operands = []
        for operand in (q, k, v):
            while operand.meta["val"].dim() < 4:
                operand = call_op(graph, aten.unsqueeze.default, (operand, 0))
            operands.append(operand)
        traced = _sdpa_graph(*(operand.meta["val"] for operand in operands), scale)
        env = dict(zip([node for node in traced.graph.nodes if node.op == "placeholder"], operands))
        for node in traced.graph.nodes:
            if node.op == "call_function":
                env[node] = graph.node_copy(node, lambda arg: env[arg])
            elif node.op == "output":
                attention = env[node.args[0][0] if isinstance(node.args[0], (tuple, list)) else node.args[0]]
        result = call_op(graph, aten.reshape.default, (attention, list(region.pv.meta["val"].shape)))
    _reroute_size_reads(region)
    # The usual user views the bmm's [B·H, M, Dv] back to [B, H, M, Dv]: that is SDPA's output as it is, whatever
    # its strides (FlashAttention's are those of [B, M, H, Dv]), with no copy through the flattened shape.
    for user in list(region.pv.users):
        if user.target in _RESHAPES and user.meta["val"].shape == attention.meta["val"].shape:
            user.replace_all_uses_with(attention)
    region.pv.replace_all_uses_with(result)
    return result
