"""Give attention that SDPA's fused kernels compute exactly to SDPA, where those kernels are faster than ours.

A region whose score chain only scales the scores by constants, and either masks nothing or masks ``n > m`` (the
top-left causal mask over a square score matrix, with -inf or a fill that absorbs as -inf does: GPT-2's
``finfo.min``), computes exactly ``scaled_dot_product_attention(q, k, v, is_causal=..., scale=s)``. K and V may be
repeated over the query heads (GQA, MQA: an expand or ``repeat_interleave`` that the graph reads with stride 0);
SDPA then reads the unrepeated K/V once per group (``enable_gqa=True``). On the H100 (bf16) SDPA's kernels took
10–23% less time than the overlay's on causal attention, and on MQA and GQA (causal or not) up to 29% less
(benchmarks/results/h100_2026-11-23_additive_masks/final_grid_bias/, h100_2026-11-23_gqa_route_fast_tanh/), so under the
SDPA policies that keep upstream's rewrites (``config.sdpa_pattern_policy`` "sdpa" and "unmasked_sdpa") such a
region goes to SDPA on the devices of ``config.sdpa_route_devices``, as upstream already sends it the plain
unmasked forms. Any other mask, bias, transform, head dims or dtype stays with the overlay's kernel.
``scaled_dot_product_attention`` is traced under the graph's fake mode, so the backend (cuDNN, FlashAttention, ...)
is the one eager would pick; where that would be SDPA's unfused math, the region stays with the overlay too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import sympy
import torch
from torch._inductor.pattern_matcher import fwd_only

from inductor_overlay import config
from inductor_overlay.fx_passes.fx_helpers import _RESHAPES, BatchSource, _batch_source, _materialise, call_op
from inductor_overlay.fx_passes.attention_region import AttentionRegion
from inductor_overlay.fx_passes.chain_modules import _reroute_size_reads, _score_chain_module
from inductor_overlay.fx_passes.block_sparsity import COL, ROW, absorbing_fill_masks, position_masks
from inductor_overlay.fx_passes.logit_scale import fold_constant_scale


aten = torch.ops.aten
prims = torch.ops.prims

# The largest head dim given to SDPA: the head dims its kernels were measured at (64, 128).
MAX_SDPA_HEAD_DIM = 128

# SDPA's fused forward ops; a trace that reaches none of them fell back to SDPA's math decomposition.
_FUSED_SDPA_OPS = (
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
)

# (integer expression e, relation) -> e' such that "relation holds" is "e' >= 0", over the integers.
_AS_NONNEGATIVE = {
    sympy.GreaterThan: lambda e: e,
    sympy.StrictGreaterThan: lambda e: e - 1,
    sympy.LessThan: lambda e: -e,
    sympy.StrictLessThan: lambda e: -e - 1,
}


@dataclasses.dataclass(frozen=True)
class SdpaCall:
    """How a region runs as ``scaled_dot_product_attention``: its scale, whether it is causal, and the K/V layout
    SDPA reads: ``kv_heads`` heads in each of ``batch`` batch entries, each shared by ``groups`` query heads."""

    scale: float
    is_causal: bool
    batch: int
    kv_heads: int
    groups: int
    repeated_dims: int  # trailing batch dims of K and V that repeat them over the query heads


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


def _static(value: torch.Tensor) -> bool:
    """Sizes and strides are plain ints: the checks below then add no guards on symbolic shapes."""
    return all(isinstance(x, int) for x in (*value.shape, *value.stride()))


def _route_takes(values: list) -> bool:
    """The policy, device, dtype and shape conditions every program the route takes meets (its operands' values)."""
    return (
        config.sdpa_pattern_policy in ("sdpa", "unmasked_sdpa")
        and all(isinstance(v, torch.Tensor) and _static(v) for v in values)
        and all(v.device.type in config.sdpa_route_devices and v.dtype in (torch.float16, torch.bfloat16) for v in values)
    )


def _repeated_batch_dims(value: torch.Tensor) -> Optional[int]:
    """How many trailing batch dims of a K or V operand repeat it over the query heads (read with stride 0, or of
    size 1): SDPA's ``enable_gqa`` layout. None when a repeated dim comes before a real one or is a row or column."""
    if 0 in value.stride()[-2:]:
        return None
    batch = list(zip(value.shape[:-2], value.stride()[:-2]))
    repeated = 0
    while repeated < len(batch) and (batch[-1 - repeated][1] == 0 or batch[-1 - repeated][0] == 1):
        repeated += 1
    if any(stride == 0 and size > 1 for size, stride in batch[: len(batch) - repeated]):
        return None
    while repeated and batch[-repeated][0] == 1:  # size-1 dims ahead of the repeated ones stay real: [B, 1] for MQA
        repeated -= 1
    return repeated


def _kv_layout(region: AttentionRegion) -> Optional[tuple[int, int, int, int]]:
    """(batch, kv_heads, groups, repeated batch dims) shared by K and V, or None when they differ or SDPA's GQA
    layout cannot read them."""
    layouts = set()
    for source in (region.kt, region.v):
        value = source.node.meta["val"]
        repeated = _repeated_batch_dims(value)
        if repeated is None:
            return None
        real = value.shape[: value.dim() - 2 - repeated]
        groups = math.prod(value.shape[value.dim() - 2 - repeated : value.dim() - 2])
        layouts.add((math.prod(real[:-1]), real[-1] if real else 1, groups, repeated))
    return layouts.pop() if len(layouts) == 1 else None


def takes_repeated_kv(key: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether K and V (nodes of upstream's SDPA pattern) are repeated over query-head groups in a form the route
    hands SDPA in place (``enable_gqa``), where upstream's rewrite reads a copy of them, on a device and dtype the
    route takes."""
    values = [_batch_source(node).node.meta.get("val") for node in (key, value)]
    return _route_takes(values) and all((_repeated_batch_dims(v) or 0) > 0 for v in values)


def sdpa_layout(region: AttentionRegion) -> Optional[tuple[int, int, int, int]]:
    """The K/V layout SDPA reads (``_kv_layout``) when the policy, device, dtypes and shapes let SDPA take
    ``region`` apart from its chain, else None."""
    values = [source.node.meta["val"] for source in (region.q, region.kt, region.v)]
    if (
        not _route_takes(values)
        or len({value.dtype for value in values} | {region.probability_dtype}) != 1
        or not region.softmax
        or region.sink is not None
        or region.pair is not None
    ):
        return None
    layout = _kv_layout(region)
    (*batch, m, d), (*_, d_k, n), (*_, n_v, d_v) = (_logical_shape(source) for source in (region.q, region.kt, region.v))
    if not (
        layout is not None
        and math.prod(batch) == layout[0] * layout[1] * layout[2]
        and n == n_v
        and d == d_k == d_v <= MAX_SDPA_HEAD_DIM
        and d % 8 == 0
        and 0 not in values[0].stride()
    ):
        return None
    return layout


def sdpa_call(region: AttentionRegion) -> Optional[SdpaCall]:
    """How ``region`` runs as SDPA when it is attention SDPA computes exactly and the policy gives it to SDPA."""
    layout = None if region.captured or region.captured_sizes else sdpa_layout(region)
    if layout is None:
        return None
    m, n = region.score_root.meta["val"].shape[-2:]
    fills = absorbing_fill_masks(region.chain, region.score_root, region.logits, region.logit_scale)
    formula, mask_nodes, _ = position_masks(region.chain, region.score_root, fills)
    is_causal = masks_above_diagonal(formula)
    if mask_nodes and not (is_causal and m == n):
        return None
    scale = scale_apart_from(region, mask_nodes)
    return None if scale is None else SdpaCall(scale, is_causal, *layout)


def scale_apart_from(region: AttentionRegion, masks: list) -> Optional[float]:
    """The constant scale that is all the chain does to the scores apart from the ``where`` nodes ``masks`` (and
    dtype conversions), or None when it does more."""
    scale_only = _score_chain_module(region, frozenset(masks))
    folded = fold_constant_scale(scale_only)
    module, scale = folded if folded is not None else (scale_only, 1.0)
    return scale if _only_dtype_conversions(module) else None


def _sdpa_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: SdpaCall) -> torch.fx.GraphModule:
    """``scaled_dot_product_attention`` traced to the aten ops Inductor lowers."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=call.is_causal, scale=call.scale, enable_gqa=call.groups > 1
        )

    with torch._guards.detect_fake_mode([q, k, v]) or contextlib.nullcontext():
        return fwd_only(attention, [q, k, v])


def _sdpa_operand(
    graph: torch.fx.Graph, source: BatchSource, call: SdpaCall, heads: int, repeated: int, unscaled: bool = True
) -> torch.fx.Node:
    """The operand as SDPA reads it, ``[batch, heads, rows, dim]``: its repeated batch dims read at index 0; q and k
    without the constant factor that ``call.scale`` holds, V as it is (``fx_helpers._materialise``)."""
    node = _materialise(graph, source, unscaled)
    rank = node.meta["val"].dim()
    for dim in range(rank - 3, rank - 3 - repeated, -1):
        node = call_op(graph, aten.select.int, (node, dim, 0))
    return call_op(graph, aten.reshape.default, (node, [call.batch, heads, *node.meta["val"].shape[-2:]]))


def sdpa_operands(region: AttentionRegion, call: SdpaCall) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """q, k, v as SDPA reads them, ``[batch, heads, rows, dim]``, inserted where the caller inserts."""
    graph = region.pv.graph
    q = _sdpa_operand(graph, region.q, call, call.kv_heads * call.groups, 0)
    kt = _sdpa_operand(graph, region.kt, call, call.kv_heads, call.repeated_dims)
    k = call_op(graph, aten.permute.default, (kt, [0, 1, 3, 2]))
    v = _sdpa_operand(graph, region.v, call, call.kv_heads, call.repeated_dims, unscaled=False)
    return q, k, v


def copy_nodes(graph: torch.fx.Graph, nodes: list, env: dict) -> None:
    """The call nodes of a traced graph copied into ``graph``, their inputs mapped by ``env`` (which gains them)."""
    for node in nodes:
        env[node] = graph.node_copy(node, lambda arg: env[arg])


def replace_by_sdpa(region: AttentionRegion, call: SdpaCall) -> Optional[torch.fx.Node]:
    """Replace the region by SDPA and return the node that now stands for ``region.pv``; None (the region left as
    it was) when SDPA would run its math fallback. Nodes made before that finding are dead code for the caller."""
    graph = region.pv.graph
    with graph.inserting_before(region.pv):
        q, k, v = sdpa_operands(region, call)
        traced = _sdpa_graph(*(operand.meta["val"] for operand in (q, k, v)), call)
        if not any(node.target in _FUSED_SDPA_OPS for node in traced.graph.nodes):
            return None
        env = dict(zip(traced.graph.find_nodes(op="placeholder"), (q, k, v)))
        copy_nodes(graph, [node for node in traced.graph.nodes if node.op == "call_function"], env)
        output = traced.graph.find_nodes(op="output")[0].args[0]
        attention = env[output[0] if isinstance(output, (tuple, list)) else output]
        result = call_op(graph, aten.reshape.default, (attention, list(region.pv.meta["val"].shape)))
    _reroute_size_reads(region)
    # The usual user views the bmm's [B·H, M, Dv] back to [B, H, M, Dv]: that is SDPA's output as it is, whatever
    # its strides (FlashAttention's are those of [B, M, H, Dv]), with no copy through the flattened shape.
    for user in list(region.pv.users):
        if user.target in _RESHAPES and user.meta["val"].shape == attention.meta["val"].shape:
            user.replace_all_uses_with(attention)
    region.pv.replace_all_uses_with(result)
    return result
