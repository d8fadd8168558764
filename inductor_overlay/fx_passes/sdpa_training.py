"""Training: attention SDPA computes exactly trains on SDPA's forward and backward kernels.

In inference ``sdpa_route`` hands SDPA the attention its fused kernels compute exactly (plain causal, unmasked) on
the devices where they are faster than ours. In a joint graph the same attention has a backward as well, and
SDPA's backward kernel (FlashAttention-2's, cuDNN's) is faster than ours there too. So a region that ``sdpa_call``
gives to SDPA, whose backward ``attention_training.match_backward`` recognised, is replaced as a pair: the forward
region by SDPA's forward op and the region's backward by SDPA's backward op, both taken from autograd's own joint
graph of ``scaled_dot_product_attention`` (traced under the graph's fake mode, so the backend is eager's), with the
same saved values (output, log-sum-exp, the RNG state) that AOTAutograd would keep for it.

K and V repeated over query-head groups (GQA, MQA) in the graph are read unrepeated (``enable_gqa``), as in
inference. SDPA's backward then gives the gradient of the unrepeated K, the sum over each group; the graph's backward
wants the gradient of the repeated operand, which only the repeat's backward reads (rule 4), and it sums over the
group: the first copy gets the group's sum and the others zeros, which that sum gives back exactly. A repeated K or V
that is a graph input (its per-copy gradient would leave the graph) stays ours. Taken only where both traced ops are
fused kernels (not SDPA's math fallback, which would materialise the scores again).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from inductor_overlay.fx_passes.chain_modules import _reroute_size_reads
from inductor_overlay.fx_passes.fx_helpers import _val, aten, call_op
from inductor_overlay.fx_passes.sdpa_route import _FUSED_SDPA_OPS, SdpaCall, copy_nodes, sdpa_operands


def _fused_backward_op(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    return name.startswith("_scaled_dot_product") and "_backward" in name


def sdpa_joint_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, call: SdpaCall) -> torch.fx.GraphModule:
    """``(q, k, v, grad_out) -> (out, dq, dk, dv)``: autograd's joint graph of SDPA, in the aten ops Inductor lowers
    (SDPA's forward and backward ops)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def joint(q, k, v, grad):
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=call.is_causal, scale=call.scale, enable_gqa=call.groups > 1
            )
            return (out, *torch.autograd.grad(out, (q, k, v), grad))

    with torch._guards.detect_fake_mode([q, k, v, grad]) or contextlib.nullcontext():
        inputs = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(i < 3)
            for i, t in enumerate((q, k, v, grad))
        ]
        return make_fx(joint)(*inputs)


def _per_copy(graph: torch.fx.Graph, grad: torch.fx.Node, call: SdpaCall) -> torch.fx.Node:
    """The gradient of K or V repeated over the query heads, ``[batch, kv_heads·groups, rows, dim]``, from SDPA's
    gradient of the unrepeated tensor (the group's sum): the sum in each group's first copy, zeros in the others."""
    if call.groups == 1:
        return grad
    batch, heads, rows, dim = _val(grad).shape
    first = call_op(graph, aten.unsqueeze.default, (grad, 2))  # [batch, heads, 1, rows, dim]
    copies = call_op(graph, aten.constant_pad_nd.default, (first, [0, 0, 0, 0, 0, call.groups - 1], 0.0))
    return call_op(graph, aten.reshape.default, (copies, [batch, heads * call.groups, rows, dim]))


def replace_pair_by_sdpa(region, call: SdpaCall, grad_out: torch.fx.Node) -> Optional[list]:
    """Replace the region's forward by SDPA's forward op and insert SDPA's backward op after ``grad_out``; returns the
    gradients of the fused op's operands ``[q, kᵀ, v]`` (scale-free, ``fx_helpers._materialise``), or None (nothing
    changed but dead nodes) when K/V repeated in place are graph inputs or SDPA would run its math fallback."""
    if call.groups > 1 and any(source.node.op == "placeholder" for source in (region.kt, region.v)):
        return None
    graph = region.pv.graph
    with graph.inserting_before(region.pv):
        q, k, v = sdpa_operands(region, call)
    out_shape = [*_val(q).shape[:-1], _val(v).shape[-1]]
    joint = sdpa_joint_graph(_val(q), _val(k), _val(v), _val(q).new_empty(out_shape), call)
    placeholders = joint.graph.find_nodes(op="placeholder")
    backward = {placeholders[3]}
    for node in joint.graph.nodes:
        if node.op == "call_function" and any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    forward_ops = [n for n in joint.graph.nodes if n.op == "call_function" and n not in backward]
    backward_ops = [n for n in joint.graph.nodes if n.op == "call_function" and n in backward]
    if not any(n.target in _FUSED_SDPA_OPS for n in forward_ops) or not any(map(_fused_backward_op, backward_ops)):
        return None
    out, dq, dk, dv = joint.graph.find_nodes(op="output")[0].args[0]
    env = dict(zip(placeholders[:3], (q, k, v)))
    with graph.inserting_before(region.pv):
        copy_nodes(graph, forward_ops, env)
        result = call_op(graph, aten.reshape.default, (env[out], list(_val(region.pv).shape)))
    # After both the output's gradient and SDPA's forward (the gradient may be a graph input, ahead of everything).
    position = {node: index for index, node in enumerate(graph.nodes)}
    anchor = grad_out if position[grad_out] > position[result] else result
    with graph.inserting_before(anchor.next):
        env[placeholders[3]] = call_op(graph, aten.reshape.default, (grad_out, out_shape))
        copy_nodes(graph, backward_ops, env)
        grads = [env[dq], call_op(graph, aten.permute.default, (_per_copy(graph, env[dk], call), [0, 1, 3, 2])),
                 _per_copy(graph, env[dv], call)]
    _reroute_size_reads(region)
    region.pv.replace_all_uses_with(result)
    return grads
