"""Attention whose chain reads positions made outside the graph (``pos = torch.arange(S)`` made once, a registered
position buffer sliced to the length) runs the kernel the same attention gets with positions built in the graph,
while those tensors hold 0, 1, ..., len − 1.

Legality. Let P be a graph input the chain reads: a contiguous 1-D integer tensor of static length L. Wherever P
holds 0, 1, ..., L − 1, ``prims.iota(L)`` of P's dtype and device is the same tensor (values, shape, strides), so a
copy of the region in which P is replaced by it computes what the region computes; a slice of it with step 1 is the
iota of the slice's own range. The graph cannot know whether P holds them: the region becomes
``torch.cond(known_arange(P, ...), iota_branch, fused_branch, operands)``, ``mask_checks.known_arange`` answering on
the host from checks it ran, on the device, on earlier calls with the same tensors at the same version. Both branches
are fused as any region is: the first as the attention written with ``arange`` (its masks decided at compile time:
tiles skipped and split by the formula, a causal one on SDPA's kernel), the second reading P as before.

Positions are told from other integer vectors (document ids, bucket indices) by their use: the chain compares them
by order (``<``, ``<=``, ``>``, ``>=``) or subtracts them. Only where the graph's code runs in Python outside CUDA
graphs (``checked_branches``). Where the branch built with iota would run SDPA's kernel on less work than the causal
route's least (``MIN_WORK``), the region is left as it is: the call would be bound by the host. In training (a joint
graph, ``route_training_when_arange``) each copy holds the region's forward and its backward, fused as a pair, and
``trained_branches`` puts the forward and the backward each under a ``cond`` on the one check.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch

from inductor_overlay import config
from inductor_overlay.fx_passes.attention_region import AttentionRegion, find_attention
from inductor_overlay.fx_passes.block_sparsity import depends_on
from inductor_overlay.fx_passes.causal_tensor_route import MIN_WORK, attention_work
from inductor_overlay.fx_passes.checked_branches import (
    branch_on,
    branch_output,
    finished,
    python_wrapper_without_graphs,
    region_branch,
    shared_check,
)
from inductor_overlay.fx_passes.fx_helpers import call_op
from inductor_overlay.fx_passes.sdpa_route import sdpa_call
from inductor_overlay.fx_passes.trained_branches import route_pair
from inductor_overlay.mask_checks import known_arange

aten, prims = torch.ops.aten, torch.ops.prims

# Ops that use integers as positions: order comparisons and differences.
_POSITION_USES = {
    *(getattr(getattr(aten, name), overload) for name in ("lt", "le", "gt", "ge") for overload in ("Tensor", "Scalar")),
    aten.sub.Tensor,
}


def arange_positions(region: AttentionRegion) -> list[torch.fx.Node]:
    """The graph inputs ``region``'s chain reads as positions (see the module's rule), when the route applies."""
    if not config.arange_positions_route or region.captured_sizes or not python_wrapper_without_graphs():
        return []
    if region.pair is not None:  # (a pair output reads the probabilities outside the route's copies)
        return []
    return [node for node in region.captured if _position_vector(node) and _used_as_positions(node, region.chain)]


def _position_vector(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return (
        node.op == "placeholder"
        and isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.dtype in (torch.int32, torch.int64)
        and isinstance(value.shape[0], int)
        and value.shape[0] > 0
        and tuple(value.stride()) == (1,)
    )


def _used_as_positions(node: torch.fx.Node, chain: list[torch.fx.Node]) -> bool:
    memo: dict = {}
    return any(use.target in _POSITION_USES and depends_on(use, node, memo) for use in chain)


def _as_iota(placeholder: torch.fx.Node) -> None:
    """Replace a branch's input by the iota it holds when the route's check passes, and each slice of it by the iota
    of the slice's range."""
    value = placeholder.meta["val"]
    graph = placeholder.graph
    kwargs = dict(start=0, step=1, dtype=value.dtype, device=value.device, requires_grad=False)
    with graph.inserting_after(placeholder), torch._guards.detect_fake_mode([value]) or contextlib.nullcontext():
        iota = call_op(graph, prims.iota.default, (value.shape[0],), kwargs)
    placeholder.replace_all_uses_with(iota, delete_user_cb=lambda user: user is not iota)
    for user in list(iota.users):
        span = _slice_range(user, value.shape[0])
        if span is None:
            continue
        start, end = span
        with graph.inserting_before(user), torch._guards.detect_fake_mode([value]) or contextlib.nullcontext():
            sliced = call_op(graph, prims.iota.default, (end - start,), dict(kwargs, start=start))
        user.replace_all_uses_with(sliced)
        graph.erase_node(user)


def _slice_range(node: torch.fx.Node, length: int) -> Optional[tuple[int, int]]:
    """[start, end) of ``node`` when it is a step-1 slice of its input along dim 0 with static bounds."""
    if node.target is not aten.slice.Tensor:
        return None
    arguments = dict(dim=0, start=None, end=None, step=1)  # slice(self, dim=0, start=None, end=None, step=1)
    arguments.update(zip(arguments, node.args[1:]), **node.kwargs)
    dim, start, end, step = arguments.values()
    if dim not in (0, -1) or step != 1 or not all(isinstance(b, (int, type(None))) for b in (start, end)):
        return None
    start, end = slice(start, sys.maxsize if end is None else end).indices(length)[:2]
    return (start, max(start, end))


def _runs_as_sdpa(pv: torch.fx.Node) -> bool:
    found = find_attention(pv)
    return isinstance(found, AttentionRegion) and sdpa_call(found) is not None


def route_when_arange(
    region: AttentionRegion, positions: list[torch.fx.Node], fuse_read_branch, fuse_branch
) -> Optional[torch.fx.Node]:
    """Replace the region by a ``cond`` between its copy with ``positions`` built by iota (fused by ``fuse_branch``)
    and its copy reading them (by ``fuse_read_branch``), on ``known_arange(positions)``; return the node standing for
    the branches' output."""
    output = branch_output(region)
    first, second = region_branch(region, output), region_branch(region, output)
    if first is None or second is None:
        return None
    (iota_branch, operands, copies), (read_branch, _, read_copies) = first, second
    for node in positions:
        _as_iota(copies[node])
    # Where the branch built with iota runs SDPA's kernel (a causal mask), the causal route's least work: below it the
    # call is bound by the host (H200, 16x16x1024x64: captured causal positions took 0.166 ms a call with the route,
    # 0.157 ms of it host time, and 0.140 ms reading the positions; results/written_forms/arange_route_h200/).
    if attention_work(region) < MIN_WORK and _runs_as_sdpa(copies[region.pv]):
        return None
    fuse_branch(iota_branch.graph)
    fuse_read_branch(read_branch.graph)
    if not all(getattr(branch_copies[region.pv], "_erased", False) for branch_copies in (copies, read_copies)):
        return None  # a branch did not fuse (its matmuls are still there): it would be the unfused attention
    result = finished(iota_branch)
    finished(read_branch)
    flag = shared_check(region.pv.graph, known_arange, (positions,), output, result)
    return branch_on(flag, {"arange_positions": iota_branch, "positions_read": read_branch}, operands, output)


def route_training_when_arange(region: AttentionRegion, matched, fuse_copy) -> Optional[torch.fx.Node]:
    """In a joint graph: the region and its backward (``matched``) as ``cond``s between their copy with the positions
    built by iota and their copy reading them (``trained_branches.route_pair``), on ``known_arange`` of the positions;
    the node standing for the region's output, or None where the route does not apply."""
    positions = arange_positions(region)
    if not positions:
        return None
    return route_pair(region, matched, lambda copies: [_as_iota(copies[node]) for node in positions], fuse_copy,
                      (known_arange, (positions,)), ("arange_positions", "positions_read"))
