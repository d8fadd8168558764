"""Find attention in a post-grad graph and replace it with one ``flashlight::online_softmax_attention`` node.

The rule (technique 2, the algebraic rewrite). Three reductions over the same dim N of the logits ``x`` depend
on each other: ``m = max_N x``, ``l = sum_N exp(x - m)``, ``o = sum_N (exp(x - m) / l) * V``. They may run as one
pass with running state ``(m_i, l_i, acc)`` exactly when:

1. the max is taken over the last dim of ``x`` and feeds only ``x - m`` under ``exp``. Then, because
   ``exp(x - m) = exp(x - m') * exp(m' - m)`` (exp turns + into ×), a partial result computed under an old max
   ``m`` becomes the one under a new max ``m'`` by one multiplication by ``alpha = exp(m - m')``;
2. every other reduction over N is linear in ``exp(x - m)`` — the sum ``l`` and the matmul with V are — so
   rescaling its partial result by ``alpha`` is exact;
3. the normaliser ``l`` is constant along N (reduced over N, kept as a size-1 dim), so dividing by it commutes
   with the sum over N of the matmul: ``(e / l) V = (e V) / l``, done once after the loop;
4. no value of the fused region (scores, logits, probabilities) is used outside it; otherwise the M×N tensor
   has to exist anyway and fusing would compute it twice.

The logits ``x`` must come from ``q @ kᵀ`` (``bmm``/``mm``, the scores) through a chain of pointwise ops whose other
inputs do not depend on the scores; that chain is moved into the kernel unchanged. Index arithmetic that feeds
it (``iota``/``arange``, ``full``, views of them) moves in with it, so masks built from positions cost no memory;
any other tensor it reads (bias, mask, ids, tables) is passed to the kernel and read at the tile's positions.
Head dims up to ``MAX_HEAD_DIM`` are one tile (dimension elimination); larger ones decline.

Two more forms fuse into the same loop. Attention sinks: ``softmax(cat([x, s], -1))[..., :-1]`` with one logit
``s`` per row is a softmax over one more column that meets no V, so the running state starts at ``m = s``,
``l = 1`` (a shift ``x - max_N x`` written before a softmax is dropped: a softmax is invariant to it). No softmax
at all (sigmoid attention, ``(A·B)·C``): the chain's output meets V directly, with no running state; this only
saves the M×N round trip, so it is subject to a profitability rule (``_match_linear``).

Two relaxations serve IPA-style attention. A small sum off the score path (a squared distance between query and
key points, ``_is_small_reduction``) moves into the chain and is unrolled per tile element by the lowering. Rule 4
admits one more use of the probabilities, ``sum_N(p.unsqueeze(-1) * y, -2)``: it is linear in p like P·V, so it
accumulates in the same loop and becomes the fused node's second output (``PairReduction``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import operator
import weakref
from typing import Any, Callable, Optional, Union

import sympy
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import statically_known_true

from inductor_overlay import config
from inductor_overlay.fx_passes.block_sparsity import (
    ABSORBING_BIAS_GAP,
    ABSORBING_FILL,
    IDS_ALL_EQUAL,
    MASK_TABLE_CELL,
    TABLE_CELLS_UNMASKED,
    AdditiveMask,
    IdMask,
    TensorMask,
    absorbing_fill_masks,
    constant_value,
    depends_on,
    fill_is_true_branch,
    fully_masked_tile_code,
    fully_visible_tile_code,
    matched_additive_mask,
    matched_id_masks,
    matched_tensor_masks,
    position_masks,
    row_invariant_block_code,
    row_position_formulas,
)
from inductor_overlay.fx_passes.block_sparsity import is_op as _is
from inductor_overlay.fx_passes.finite_speculation import guard_only_nodes, speculation_bound
from inductor_overlay.fx_passes.logit_scale import fold_constant_scale
from inductor_overlay.kernel.online_softmax_attention import MAX_HEAD_DIM
from inductor_overlay import ops
from inductor_overlay.ops import DISTANCE_TABLE, MaskSummary, ScoreChain

# TORCH_LOGS=flashlight shows every fused attention and every declined one with its reason.
log = logging.getLogger("flashlight.attention_fusion")

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
_INDEX_SOURCES = (prims.iota.default, aten.full.default, aten.scalar_tensor.default, aten.index.Tensor)
_FUSABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass
class Decline:
    """Why a softmax feeding a matmul was left to upstream Inductor."""

    reason: str


@dataclasses.dataclass
class AttentionRegion:
    qk: torch.fx.Node  # the scores matmul, q @ kᵀ
    score_root: torch.fx.Node  # qk, or its reshape to [*batch, M, N]
    logits: torch.fx.Node  # x: the softmax input
    pv: torch.fx.Node  # the output matmul, P @ V
    chain: list[torch.fx.Node]  # ops from score_root to logits, moved into the kernel (graph order)
    captured: list[torch.fx.Node]  # tensors the chain reads besides the scores
    captured_sizes: list[torch.fx.Node]  # symbolic ints the chain computes with (a dynamic length: iota(s0))
    internal: set[torch.fx.Node]  # nodes that become dead once pv is replaced
    probability_dtype: torch.dtype
    logit_scale: float  # positive constant the softmax applies to the logits
    softmax: bool  # False: the chain's output meets V directly (sigmoid attention, chained matmuls)
    sink: Optional[torch.fx.Node]  # a per-row logit that joins the softmax as a dropped extra column (attention sinks)
    operand_scale: float  # constant factor taken off q or k (moved onto the scores, where it is free)
    pair: Optional["PairReduction"]  # the probabilities also reduced against a per-pair tensor (IPA), or None
    q: "BatchSource"  # operands as the kernel reads them: [*batch, M, D], [*batch, D, N], [*batch, N, Dv]
    kt: "BatchSource"
    v: "BatchSource"


def _val(node: torch.fx.Node) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _reduces_last_dim_keepdim(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    rank = _val(source).dim()
    return keepdim and list(dims or []) in ([-1], [rank - 1])


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


def _positive_constant(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def match_normalised_exp(p: torch.fx.Node) -> Union[Decline, tuple[torch.fx.Node, list[torch.fx.Node], float]]:
    """Rules 1–3: ``p = exp(c·(x - max_N x)) / sum_N exp(c·(x - max_N x))``; returns x, the softmax nodes and c.

    A positive constant c (upstream folds a softmax's scale this way) commutes with the max: c·max x = max c·x,
    so the logits are c·x.
    """
    if not _is(p, aten.div.Tensor):
        return Decline("the matmul's left operand is not a normalised exponential (softmax)")
    exp, normaliser = p.args
    if not (_is(exp, aten.exp.default) and _is(normaliser, aten.sum.dim_IntList) and normaliser.args[0] is exp):
        return Decline("the division is not exp(..) / sum_N(exp(..))")
    shifted, logit_scale, scaling = exp.args[0], 1.0, []
    if _is(shifted, (aten.mul.Tensor, aten.div.Tensor)) and _positive_constant(shifted.args[1]):
        factor = float(shifted.args[1])
        logit_scale = factor if shifted.target is aten.mul.Tensor else 1.0 / factor
        scaling, shifted = [shifted], shifted.args[0]
    if not _is(shifted, aten.sub.Tensor):
        return Decline("exp's argument is not logits minus their row max")
    logits, row_max = shifted.args
    if not (_is(row_max, aten.amax.default) and row_max.args[0] is logits):
        return Decline("exp's argument is not shifted by the max of the same logits (rule 1)")
    if not (_reduces_last_dim_keepdim(row_max, logits) and _reduces_last_dim_keepdim(normaliser, exp)):
        return Decline("max and sum do not both reduce the last dim with keepdim (rules 1 and 3)")
    return logits, [row_max, shifted, *scaling, exp, normaliser, p], logit_scale


def _is_inlinable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    tags = node.target.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    if node.target is aten.gather.default:
        return config.gathers_in_score_chain
    return torch.Tag.pointwise in tags or node.target in (*_VIEWS, *_INDEX_SOURCES, prims.convert_element_type.default)


def _is_small_reduction(node: torch.fx.Node) -> bool:
    """A floating-point ``sum`` over static dims of at most ``config.chain_reduction_max_elements`` elements (a
    squared distance between points, say). Off the score path it can move into the chain: the kernel computes it
    per tile element, unrolled, instead of reading it as an M×N tensor."""
    if not _is(node, aten.sum.dim_IntList) or node.kwargs.get("dtype") is not None or len(node.args) < 2:
        return False
    source = _val(node.args[0])
    if source is None or not source.is_floating_point() or not node.args[1]:
        return False
    sizes = [source.shape[d] for d in node.args[1]]
    return all(isinstance(s, int) for s in sizes) and math.prod(sizes) <= config.chain_reduction_max_elements


def _collect_chain(
    logits: torch.fx.Node, qk: torch.fx.Node
) -> Union[Decline, tuple[torch.fx.Node, list[torch.fx.Node], list[torch.fx.Node]]]:
    """Walk back from the logits to the scores; split what moves into the kernel from what is read by it."""
    on_score_path: dict = {}
    score_root = None
    chain: set[torch.fx.Node] = set()
    captured: dict[torch.fx.Node, None] = {}
    logits_shape = tuple(_val(logits).shape)
    stack = [logits]
    while stack:
        node = stack.pop()
        if node in chain or node in captured or node is score_root:
            continue
        if node is qk or _strip_order_preserving(node)[0] is qk:
            if tuple(_val(node).shape) != logits_shape:
                return Decline("the scores are re-viewed (not [..., M, N]) before the softmax")
            if tuple(_val(node).shape[-2:]) != tuple(_val(qk).shape[-2:]):
                # (A linear layer's mm over B·S rows, viewed as [B, S, N]: its rows are not the kernel's rows.)
                return Decline("a view of the scores splits or merges their rows")
            if score_root is not None and score_root is not node:
                return Decline("the scores enter the softmax through two different views")
            score_root = node
            continue
        if depends_on(node, qk, on_score_path):
            if not _is_inlinable(node) or _is(node, _VIEWS + _INDEX_SOURCES):
                return Decline(f"`{node.target}` between the matmul and the softmax is not elementwise on the scores")
            if tuple(_val(node).shape) != logits_shape:
                return Decline(f"`{node.target}` on the scores changes their shape")
        elif node.meta.get(DISTANCE_TABLE) or not (_is_inlinable(node) or _is_small_reduction(node)):
            captured[node] = None
            continue
        chain.add(node)
        stack.extend(node.all_input_nodes)
    if score_root is None:
        return Decline("the softmax input does not come from a matmul")
    ordered = [n for n in logits.graph.nodes if n in chain]
    return score_root, ordered, list(captured)


def _emits_triton(device: torch.device) -> bool:
    from torch._inductor import config as inductor_config

    return device.type == "cuda" or (device.type == "cpu" and inductor_config.cpu_backend == "triton")


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


def _materialise(graph: torch.fx.Graph, source: BatchSource) -> torch.fx.Node:
    """The operand node the fused op reads: the (scale-free) source, transposed back if it was."""
    scaling, _ = _operand_scale(source.node)
    node = _replay_views_without_scale(graph, source.node, scaling) if scaling is not None else source.node
    if source.transposed:
        rank = _val(node).dim()
        node = call_op(graph, aten.permute.default, (node, [*range(rank - 2), rank - 1, rank - 2]))
    return node


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


def _strip_dropped_last_column(p: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """``probs[..., :-1]``: the softmax ran over one more column than meets V (an attention sink)."""
    if _is(p, aten.slice.Tensor) and isinstance(p.args[0], torch.fx.Node) and _val(p.args[0]) is not None:
        source = _val(p.args[0])
        dim, start, end = (list(p.args[1:]) + [0, None, None])[:3]
        step = p.args[4] if len(p.args) > 4 else 1
        last = source.shape[-1]
        if dim % source.dim() == source.dim() - 1 and start in (0, None) and step == 1 and end in (-1, last - 1):
            return p.args[0], [p]
    return p, []


def _strip_row_shift(logits: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """``x - max_N x`` written by the user before a softmax: a softmax is invariant to a shift constant along N,
    so the logits are ``x`` (a fully -inf row is NaN either way)."""
    if not _is(logits, aten.sub.Tensor) or not isinstance(logits.args[1], torch.fx.Node):
        return logits, []
    x, shift = logits.args
    if len(shift.users) != 1:
        return logits, []
    if _is(shift, aten.amax.default) and shift.args[0] is x and _reduces_last_dim_keepdim(shift, x):
        return x, [shift, logits]
    if _is(shift, operator.getitem) and shift.args[1] == 0 and _is(shift.args[0], aten.max.dim):
        row_max = shift.args[0]
        dim, keepdim = (list(row_max.args[1:]) + [False])[:2]
        rank = _val(x).dim()
        if row_max.args[0] is x and keepdim and dim % rank == rank - 1 and len(row_max.users) == 1:
            return x, [row_max, shift, logits]
    return logits, []


def _split_sink(logits: torch.fx.Node) -> Union[Decline, tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]]]:
    """``cat([x, sink], -1)`` with one sink logit per row: the softmax's extra column (see ``AttentionRegion.sink``).
    An upcast of the concatenation (a 16-bit softmax computes in float32) is left to the kernel, which computes
    the softmax in float32 anyway."""
    upcast = []
    if _is(logits, prims.convert_element_type.default) and _val(logits).dtype == torch.float32:
        upcast, logits = [logits], logits.args[0]
    if not (_is(logits, aten.cat.default) and len(logits.args[0]) == 2):
        return Decline("a column is dropped after the softmax, but its logits are not cat([scores, sink], -1)")
    x, sink = logits.args[0]
    dim = logits.args[1] if len(logits.args) > 1 else 0
    rank = _val(logits).dim()
    if dim % rank != rank - 1 or _val(sink) is None or _val(sink).shape[-1] != 1:
        return Decline("the dropped softmax column is not one logit per row")
    return x, sink, [*upcast, logits]


@dataclasses.dataclass(frozen=True)
class PairReduction:
    """``sum_N(p.unsqueeze(-1) * y, -2)``: the probabilities reduced against a per-pair tensor ``y`` broadcastable
    to ``[*batch, M, N, C]`` (IPA's ``Σ_j a_ij z_ij``). Linear in ``p`` like ``P·V``, so it accumulates in the same
    loop under the same rescaling and normaliser: the probabilities are still never stored."""

    values: torch.fx.Node  # y
    result: torch.fx.Node  # the sum, [*batch, M, C]; replaced by the fused node's second output
    nodes: tuple  # the unsqueeze and the product, dead once fused


def _match_pair_reduction(
    unsqueezed: torch.fx.Node, score_shape: tuple, qk: torch.fx.Node, pv: torch.fx.Node
) -> Union[Decline, PairReduction]:
    product = next(iter(unsqueezed.users)) if len(unsqueezed.users) == 1 else None
    if not _is(product, aten.mul.Tensor):
        return Decline("the probabilities are used outside the attention, other than p.unsqueeze(-1) * y")
    values = product.args[1] if product.args[0] is unsqueezed else product.args[0]
    value = _val(values)
    if value is None or not value.is_floating_point() or depends_on(values, qk, {}) or depends_on(values, pv, {}):
        return Decline("the per-pair tensor the probabilities meet is not a float tensor independent of the scores")
    shape = tuple(_val(product).shape)
    if shape[:-1] != score_shape or not isinstance(shape[-1], int):
        return Decline("the per-pair tensor broadcasts the probabilities or has a dynamic channel count")
    if shape[-1] > config.pair_reduction_max_channels:
        return Decline(f"{shape[-1]} per-pair channels exceed pair_reduction_max_channels")
    total = next(iter(product.users)) if len(product.users) == 1 else None
    keepdim = total is not None and (total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False))
    if not (
        _is(total, aten.sum.dim_IntList)
        and list(total.args[1]) in ([-2], [len(shape) - 2])
        and not keepdim
        and total.kwargs.get("dtype") is None
    ):
        return Decline("p.unsqueeze(-1) * y is not summed over N alone")
    return PairReduction(values=values, result=total, nodes=(unsqueezed, product))


def _find_pair_reduction(
    probabilities: list[torch.fx.Node], score_shape: tuple, qk: torch.fx.Node, pv: torch.fx.Node
) -> Union[None, Decline, PairReduction]:
    """The probabilities' one reduction against a per-pair tensor, if they have one (rule 4 allows it)."""
    found = [
        _match_pair_reduction(user, score_shape, qk, pv)
        for node in probabilities
        if tuple(_val(node).shape) == score_shape
        for user in node.users
        if _is(user, aten.unsqueeze.default) and user.args[1] in (-1, len(score_shape)) and user not in probabilities
    ]
    if len(found) > 1:
        return Decline("the probabilities are reduced against more than one per-pair tensor")
    return found[0] if found else None


def _match_linear(p: torch.fx.Node, head_dims: tuple[int, int], rows: int) -> Optional[Decline]:
    """Profitability of a matmul fed by pointwise ops of another matmul, with no softmax (sigmoid attention,
    ``(A·B)·C``): always legal; fused only where the kernel beats two GEMMs (small inner dims, enough row tiles)."""
    if max(head_dims) > config.linear_fusion_max_inner_dim:
        return Decline(
            f"no softmax and inner dim {max(head_dims)} > {config.linear_fusion_max_inner_dim}: two GEMMs are faster"
        )
    if _val(p).device.type == "cuda" and rows < config.linear_fusion_min_rows:
        return Decline(f"no softmax and only {rows} rows: too few row tiles to fill the GPU")
    return None


def find_attention(pv: torch.fx.Node, dead: frozenset = frozenset()) -> Union[Decline, AttentionRegion]:
    """Decide whether ``pv`` is the output matmul of a fusable attention, by rules 1–4 of the module doc.
    Users of the region in ``dead`` are about to be removed (a rewrite is asking) and do not count for rule 4."""
    p_operand, v = _matmul_operands(pv)
    p, passthrough = _strip_order_preserving(p_operand, also=(prims.convert_element_type.default,))
    p, dropped_column = _strip_dropped_last_column(p)
    if dropped_column:
        p, downcast = _strip_order_preserving(p, also=(prims.convert_element_type.default,))
        passthrough += dropped_column + downcast
    matched = match_normalised_exp(p)
    sink = None
    if isinstance(matched, Decline):
        if dropped_column or _looks_like_softmax_input(pv):
            return matched
        logits, softmax_nodes, logit_scale, softmax = p, [], 1.0, False
    else:
        logits, softmax_nodes, logit_scale = matched
        upcast = [logits] if _is(logits, prims.convert_element_type.default) else []
        unshifted, shift_nodes = _strip_row_shift(upcast[0].args[0] if upcast else logits)
        if shift_nodes:  # the kernel's softmax runs in float32 whatever the logits' dtype
            logits, softmax_nodes = unshifted, softmax_nodes + upcast + shift_nodes
        softmax = True
        if dropped_column:
            split = _split_sink(logits)
            if isinstance(split, Decline):
                return split
            logits, sink, cat_nodes = split
            softmax_nodes += cat_nodes
    if _val(logits) is None or _val(logits).dim() < 2:
        return Decline("the logits have no static metadata")
    # The scores are the matmul the logits reach through elementwise ops; other matmuls they depend on (a
    # projected pair bias, say) are tensors the chain reads. Try the latest first.
    qk_candidates = [n for n in logits.graph.nodes if _is(n, _MATMULS) and n is not pv and depends_on(logits, n, {})]
    collected: Union[Decline, tuple] = Decline("the softmax input does not come from a matmul")
    for qk in reversed(qk_candidates):
        collected = _collect_chain(logits, qk)
        if not isinstance(collected, Decline):
            break
    if isinstance(collected, Decline):
        return collected
    score_root, chain, captured = collected
    captured_sizes = [c for c in captured if isinstance(c.meta.get("val"), torch.SymInt)]
    captured = [c for c in captured if c not in captured_sizes]
    if any(not isinstance(c.meta.get("val"), torch.Tensor) for c in captured):
        return Decline("the score chain computes with a non-tensor value that is not a size")
    if any(depends_on(c, qk, {}) for c in captured) or (sink is not None and depends_on(sink, qk, {})):
        return Decline("a tensor read by the score chain depends on the scores")

    q, kt = _matmul_operands(qk)
    if not _emits_triton(_val(q).device):
        return Decline(f"Inductor does not generate Triton code for {_val(q).device.type} tensors here")
    for name, operand in (("q", q), ("k", kt), ("v", v), ("probabilities", p_operand)):
        value = _val(operand)
        if value is None or value.dtype not in _FUSABLE_DTYPES:
            return Decline(f"{name} has dtype {getattr(value, 'dtype', None)}; fused kernels take fp16/bf16/fp32")
    # Dimension elimination needs the head dims as compile-time tile sizes: a dynamic one is specialised
    # (the kernel lowering guards on its value), like upstream Inductor does for its template block sizes.
    head_dims = (int(_val(q).shape[-1]), int(_val(v).shape[-1]))
    if max(head_dims) > MAX_HEAD_DIM:
        return Decline(f"head dim {max(head_dims)} exceeds {MAX_HEAD_DIM}, the largest kept whole in one tile")
    if math.prod(_val(score_root).shape) != math.prod(_val(p_operand).shape):
        return Decline("the probabilities are broadcast before the output matmul")
    if not softmax:
        unprofitable = _match_linear(p, head_dims, math.prod(_val(score_root).shape[:-1]))
        if unprofitable is not None:
            return unprofitable

    sources = _batch_source(q), _batch_source(kt), _batch_source(v)
    operand_scale = 1.0
    for operand in (sources[0].node, sources[1].node):
        scaling, factor = _operand_scale(operand)
        if scaling is not None:
            operand_scale *= factor
    pair = _find_pair_reduction([p, *passthrough], tuple(_val(score_root).shape), qk, pv) if softmax else None
    if isinstance(pair, Decline):
        return pair
    scores = [qk, *_strip_order_preserving(score_root)[1]]
    internal = set(scores) | {n for n in chain if depends_on(n, qk, {})} | set(softmax_nodes) | set(passthrough)
    internal |= set(pair.nodes) if pair is not None else set()
    replaced = {pv} | ({pair.result} if pair is not None else set())
    operands = [source.node for source in sources]
    for node in internal:
        outside = [
            u for u in node.users
            if u not in internal and u not in replaced and u not in dead and _size_source(u, operands) is None
        ]
        if outside:
            user = "a graph output (e.g. saved for backward)" if outside[0].op == "output" else f"`{outside[0].name}`"
            return Decline(f"`{node.name}` is also used outside the attention (rule 4), by {user}")
    return AttentionRegion(
        qk=qk,
        score_root=score_root,
        logits=logits,
        pv=pv,
        chain=chain,
        captured=captured,
        captured_sizes=captured_sizes,
        internal=internal,
        probability_dtype=_val(p_operand).dtype,
        logit_scale=logit_scale,
        softmax=softmax,
        sink=sink,
        pair=pair,
        operand_scale=operand_scale,
        q=sources[0],
        kt=sources[1],
        v=sources[2],
    )


def _size_source(read: torch.fx.Node, operands: list[torch.fx.Node]) -> Optional[tuple[torch.fx.Node, Optional[int]]]:
    """For a read of a symbolic size (``sym_size``, as a dynamic graph has for later views) of a node that fusion
    removes: a graph input holding the same symbol (dim None), or a dim of q, k or v that has it."""
    wanted = read.meta.get("val") if _is(read, aten.sym_size.int) else None
    if not isinstance(wanted, torch.SymInt):
        return None
    for node in read.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) and statically_known_true(value == wanted):
            return node, None
    for node in operands:
        for dim, size in enumerate(_val(node).shape):
            if isinstance(size, torch.SymInt) and statically_known_true(size == wanted):
                return node, dim
    return None


def _reroute_size_reads(region: AttentionRegion) -> None:
    """Size reads of the nodes fusion removes read the same sizes from graph inputs or the operands instead."""
    operands = [region.q.node, region.kt.node, region.v.node]
    reads = [u for node in region.pv.graph.nodes if node in region.internal for u in node.users if u not in region.internal]
    for read in dict.fromkeys(reads):  # in graph order, each once
        found = _size_source(read, operands)
        if found is not None:
            source, dim = found
            if dim is not None:
                with read.graph.inserting_before(read):
                    source = call_op(read.graph, aten.sym_size.int, (source, dim))
            read.replace_all_uses_with(source)


def _chain_inputs(region: AttentionRegion) -> tuple[torch.fx.Graph, dict]:
    """A new graph whose placeholders are the chain's inputs, (scores, *captured, *captured_sizes), and the map
    from the user's nodes to them (the score root to the scores, times the scale taken off q or k)."""
    graph = torch.fx.Graph()
    scores = graph.placeholder("scores")
    env = {region.score_root: scores}
    for index, value in enumerate(region.captured):
        env[value] = graph.placeholder(f"captured_{index}")
    for index, value in enumerate(region.captured_sizes):
        env[value] = graph.placeholder(f"size_{index}")
    if region.operand_scale != 1.0:
        env[region.score_root] = graph.call_function(aten.mul.Tensor, (scores, region.operand_scale))
    return graph, env


def _score_chain_module(
    region: AttentionRegion, unmasked: frozenset = frozenset(), guards: Optional[dict] = None
) -> torch.fx.GraphModule:
    """The chain from scores to logits as its own graph: (scores, *captured) -> logits. The ``where(cond, -inf, x)``
    nodes in ``unmasked`` pass ``x`` through (for tiles where ``cond`` is false everywhere), and an additive mask's
    add there passes the scores through (for tiles where its bias is 0). The finite guards in ``guards`` pass
    their ``x`` through (``finite_speculation``)."""
    graph, env = _chain_inputs(region)
    zeros: set[torch.fx.Node] = set()  # chain nodes that are 0 on these tiles: a bias ``where(cond, -inf, 0)``
    for node in region.chain:
        if guards and node in guards:  # x, in the guard's dtype
            env[node] = _in_dtype_of(graph, env[guards[node]], guards[node], node)
            continue
        if node in unmasked and node.target is aten.add.Tensor:  # an additive mask: its bias is 0 on these tiles
            addend = next(arg for arg in node.args if depends_on(arg, region.score_root, {}))
        else:  # x + a dropped position mask's 0
            addend = _added_to_zero(node, zeros)
        if addend is not None:  # the sum is x, in the sum's dtype
            env[node] = _in_dtype_of(graph, env[addend], addend, node)
            continue
        if node in unmasked:
            condition, if_true, if_false = node.args
            kept = if_false if fill_is_true_branch(node) else if_true
            env[node] = env[kept] if isinstance(kept, torch.fx.Node) else graph.call_function(
                aten.full_like.default, (env[region.score_root], kept)
            )
            if constant_value(kept) == 0.0:
                zeros.add(node)
            continue
        if _is(node, prims.convert_element_type.default) and node.args[0] in zeros:
            zeros.add(node)
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    logits = env[region.logits]
    if region.logit_scale != 1.0:
        logits = graph.call_function(aten.mul.Tensor, (logits, region.logit_scale))
    graph.output(logits)
    graph.eliminate_dead_code()  # the bypassed masks' conditions
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _in_dtype_of(graph: torch.fx.Graph, value: torch.fx.Node, source: torch.fx.Node, node: torch.fx.Node) -> torch.fx.Node:
    """``value`` (the copy of ``source`` in ``graph``) standing for ``node``: converted to ``node``'s dtype if it differs."""
    if _val(source).dtype == _val(node).dtype:
        return value
    return graph.call_function(prims.convert_element_type.default, (value, _val(node).dtype))


def _added_to_zero(node: torch.fx.Node, zeros: set) -> Optional[torch.fx.Node]:
    """``x`` when ``node`` is ``x + z`` with ``z`` in ``zeros`` and of ``x``'s shape (the sum is ``x``)."""
    if not (_is(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 2):
        return None
    for zero, kept in (node.args, node.args[::-1]):
        if zero in zeros and _val(kept) is not None and _val(kept).shape == _val(node).shape:
            return kept
    return None


def _summarised_id_mask(region: AttentionRegion) -> Optional[IdMask]:
    """The first id-equality mask (``matched_id_masks``) whose ids the kernel can compute (chain values or captured
    tensors): its pre-pass bounds them per tile."""
    known = set(region.chain) | set(region.captured)
    masks = matched_id_masks(region.chain, region.score_root)
    return next((mask for mask in masks if {mask.rows, mask.columns} <= known), None)


def _visible_tile_code(formula: Optional[sympy.Boolean], id_mask: Optional[IdMask], table_drops_mask: bool) -> str:
    """The test that none of the dropped masks masks any element of a tile: position masks by their formula, an
    id-equality mask alone in its ``where`` when all the tile's ids are one value, a mask tensor alone in its
    ``where`` (or an additive mask) when its table says no cell of the tile masks anything."""
    parts = [fully_visible_tile_code(formula)] if formula is not None else []
    if id_mask is not None and id_mask.alone:
        parts.append(IDS_ALL_EQUAL)
    if table_drops_mask:
        parts.append(TABLE_CELLS_UNMASKED)
    return " & ".join(f"({part})" for part in parts)


# The tables built in each graph, by the mask they summarise: the layers of a model compiled whole share their mask.
_TABLES: "weakref.WeakKeyDictionary[torch.fx.Graph, dict]" = weakref.WeakKeyDictionary()


def _shared_table(graph: torch.fx.Graph, key: tuple, build: Callable[[], torch.fx.Node], user: torch.fx.Node) -> torch.fx.Node:
    """The table of ``key``'s mask for ``user``: one built for an earlier attention of this graph, or a new one
    inserted before ``user``."""
    tables = _TABLES.setdefault(graph, {})
    table = tables.get(key)
    if table is None or getattr(table, "_erased", False) or not table < user:  # fx nodes order as in the graph
        with graph.inserting_before(user):
            table = tables[key] = build()
    return table


def _mask_table(graph: torch.fx.Graph, region: AttentionRegion, mask: Union[TensorMask, AdditiveMask]) -> torch.fx.Node:
    """The mask's cell states (``[*lead, ⌈M/c⌉, ⌈N/c⌉]``, int8; c = ``MASK_TABLE_CELL``), once per call. A bias the
    chain computes from positions and small tensors (HF's causal-and-padding mask from its ``[B, N]`` padding
    vector) gets the table kernel (``kernel/mask_cell_states.py``), which computes it tile by tile as the attention
    kernel does; a mask read from memory gets Inductor's reductions, which run at memory speed."""
    if isinstance(mask, AdditiveMask) and _computed_from_small_tensors(region, mask.bias):
        shape = tuple(_val(mask.bias).shape)
        row_invariant_when = None
        if config.row_invariant_mask_blocks:
            row_invariant_when = row_invariant_block_code(row_position_formulas(mask.bias))
        summary = MaskSummary(
            _chain_value_module(region, mask.bias, list(shape)), shape, ABSORBING_BIAS_GAP, row_invariant_when
        )
        bias, decisions = ops.mask_summary_arguments(summary)
        inputs = (list(region.captured), subgraph(graph, bias, "mask_bias"), decisions, list(region.captured_sizes))
        return call_op(graph, ops.mask_cell_states_of, inputs)
    if isinstance(mask, AdditiveMask):
        return _additive_mask_table(graph, mask)
    return _tensor_mask_table(graph, mask)


def _computed_from_small_tensors(region: AttentionRegion, value: torch.fx.Node) -> bool:
    """Whether the chain computes ``value`` and reads no tensor of ``value``'s size for it (the table kernel then
    reads next to nothing), given a tensor to run on."""
    if value not in region.chain or not region.captured:
        return False
    sizes = [_val(tensor).numel() for tensor in region.captured]
    if not all(isinstance(size, int) for size in sizes):  # a dynamic size: compared, it would add a guard
        return False
    return all(size * MASK_TABLE_CELL <= _val(value).numel() for size in sizes)


def _tensor_mask_table(graph: torch.fx.Graph, mask: TensorMask) -> torch.fx.Node:
    """Graph nodes reducing a mask tensor ``[*lead, M, N]`` to its cell states ``[*lead, ⌈M/c⌉, ⌈N/c⌉]`` (int8;
    see ``MASK_TABLE_CELL``), once per call; a mask broadcast over the rows (``[*lead, 1, N]``) to one row of
    cells, which the kernel reads for every row tile (expanded). Elements past M or N count as masked for "all
    masked" and as unmasked for "some masked": the kernel masks them by bounds anyway, and never drops its bounds
    test."""
    masked = mask.term if not mask.negated else call_op(graph, aten.logical_not.default, (mask.term,))
    masked = call_op(graph, prims.convert_element_type.default, (masked, torch.int8))
    some_masked, all_masked = (
        _cells(graph, _cells_of_rows(graph, masked, outside, reduction), outside, reduction)
        for outside, reduction in ((0, aten.amax.default), (1, aten.amin.default))
    )
    return call_op(graph, aten.add.Tensor, (some_masked, all_masked))


def _additive_mask_table(graph: torch.fx.Graph, mask: AdditiveMask) -> torch.fx.Node:
    """Graph nodes reducing an additive mask ``[*lead, M or 1, N]`` to its cell states, as ``_mask_table`` does:
    0 where all of a cell's bias is 0, 2 where all of it is absorbing (``ABSORBING_BIAS_GAP`` or more below its
    row's largest bias; that wins over 0), else 1. A NaN bias makes its cell 1."""
    bias = call_op(graph, prims.convert_element_type.default, (mask.bias, torch.float32))
    row_cell_max = _cells_of_rows(graph, bias, -math.inf, aten.amax.default)
    row_cell_min = _cells_of_rows(graph, bias, math.inf, aten.amin.default)
    row_max = call_op(graph, aten.amax.default, (row_cell_max, [-1], True))
    gap = call_op(graph, aten.sub.Tensor, (row_max, row_cell_max))  # the least gap of the row's cell elements
    absorbing = call_op(graph, aten.ge.Scalar, (_cells(graph, gap, math.inf, aten.amin.default), ABSORBING_BIAS_GAP))
    cell_max = _cells(graph, row_cell_max, -math.inf, aten.amax.default)
    cell_min = _cells(graph, row_cell_min, math.inf, aten.amin.default)
    zero = call_op(graph, aten.logical_and.default, tuple(call_op(graph, aten.eq.Scalar, (c, 0.0)) for c in (cell_max, cell_min)))
    nonzero = call_op(graph, aten.logical_not.default, (zero,))
    as_int8 = [call_op(graph, prims.convert_element_type.default, (flag, torch.int8)) for flag in (absorbing, nonzero)]
    all_masked = call_op(graph, aten.mul.Tensor, (as_int8[0], 2))
    return call_op(graph, aten.maximum.default, (all_masked, as_int8[1]))  # absorbing wins over zero


# The two reductions below read memory in order: along each row's contiguous columns first, then across the cell's
# rows (one reduction over a 4-d cell view reads 32-byte pieces and ran at ~1.2 TB/s on the H100).
def _cells_of_rows(graph: torch.fx.Graph, elements: torch.fx.Node, outside: float, reduction: Any) -> torch.fx.Node:
    """``elements [*lead, M, N]`` reduced over each row's ``MASK_TABLE_CELL`` columns of a cell, ``[*lead, M,
    ⌈N/c⌉]``; columns past N taken as ``outside``."""
    *lead, rows, columns = _val(elements).shape
    if columns % MASK_TABLE_CELL:
        elements = call_op(graph, aten.constant_pad_nd.default, (elements, [0, -columns % MASK_TABLE_CELL], outside))
    column_cells = -(-columns // MASK_TABLE_CELL)
    in_rows = call_op(graph, aten.reshape.default, (elements, [*lead, rows, column_cells, MASK_TABLE_CELL]))
    return call_op(graph, reduction, (in_rows, [-1]))


def _cells(graph: torch.fx.Graph, row_cells: torch.fx.Node, outside: float, reduction: Any) -> torch.fx.Node:
    """``row_cells [*lead, M, C]`` reduced over each cell's ``MASK_TABLE_CELL`` rows, ``[*lead, ⌈M/c⌉, C]``; rows
    past M taken as ``outside``. One row (a mask broadcast over the rows) is its own row of cells."""
    *lead, rows, column_cells = _val(row_cells).shape
    if rows == 1:
        return row_cells
    if rows % MASK_TABLE_CELL:
        row_cells = call_op(graph, aten.constant_pad_nd.default, (row_cells, [0, 0, 0, -rows % MASK_TABLE_CELL], outside))
    row_cell_count = -(-rows // MASK_TABLE_CELL)
    cells = call_op(graph, aten.reshape.default, (row_cells, [*lead, row_cell_count, MASK_TABLE_CELL, column_cells]))
    return call_op(graph, reduction, (cells, [-2]))


def _table_cells(score_shape: torch.Size, mask_table: torch.fx.Node) -> list:
    """The cells of the scores' rows and columns, as the kernel indexes them (one row of cells is expanded)."""
    return [-(-score_shape[-2] // MASK_TABLE_CELL), _val(mask_table).shape[-1]]


def _chain_value_module(region: AttentionRegion, value: torch.fx.Node, shape: list) -> torch.fx.GraphModule:
    """(scores, *captured) -> ``value`` (a node of the chain or a captured tensor), expanded to ``shape``."""
    graph, env = _chain_inputs(region)
    for node in region.chain:
        if value in env:
            break
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(graph.call_function(aten.expand.default, (env[value], shape)))
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _logits_may_near_float_max(region: AttentionRegion, absorbing_fills: frozenset, skipped: frozenset) -> bool:
    """Whether the chain reads a floating-point tensor (its values are unknown: HF's additive masks hold finfo.min)
    or computes with a constant of magnitude 2^64 or more that is not infinite. The constants of absorbing fills
    do not count: they act as -inf, so overflowing to -inf once scaled changes nothing (every row keeps a key);
    nor do those of the ``skipped`` nodes (finite guards the kernel runs without)."""
    if any(_val(tensor) is not None and _val(tensor).is_floating_point() for tensor in region.captured):
        return True
    fill_nodes = {where.args[1] if fill_is_true_branch(where) else where.args[2] for where in absorbing_fills}
    only_fills = {node for node in fill_nodes if isinstance(node, torch.fx.Node) and set(node.users) <= absorbing_fills}
    nodes = [node for node in region.chain if node not in only_fills and node not in skipped]
    constants = torch.utils._pytree.tree_leaves([(node.args, node.kwargs) for node in nodes])
    return any(isinstance(c, float) and 2.0**64 <= abs(c) < math.inf for c in constants)


def _batch_fastest(region: AttentionRegion, score_shape: torch.Size) -> int:
    """The leading batch dim's size when the chain reads score-sized tensors and all of them are shared along it
    (``ScoreChain.batch_fastest``), else 0."""
    if len(score_shape) < 3 or not isinstance(score_shape[0], int) or score_shape[0] == 1:
        return 0
    shared = []
    for tensor in region.captured:
        source, _ = _strip(tensor, (aten.expand.default,))
        shape = _val(source).shape if _val(source) is not None else ()
        if len(shape) >= 2 and tuple(shape[-2:]) == tuple(score_shape[-2:]):
            shared.append(len(shape) < len(score_shape) or shape[len(shape) - len(score_shape)] == 1)
    return score_shape[0] if shared and all(shared) else 0


def _worth_a_visible_loop(unmasked: torch.fx.GraphModule, region: AttentionRegion, drops_mask_loads: bool) -> bool:
    """A loop of its own for entirely visible tiles pays where the mask is most of the per-element work: on the
    H100 it gave 6–15% at head dim 64 when the rest of the chain is only scaling (causal, prefix-LM, GQA), and lost
    21% on Gemma-2's soft-capped window (benchmarks/results/h100_2026-11-22_split_visible_tiles/). At head dim 128
    it gives 9–15% on causal since the partial tiles share one loop (h100_2026-11-22_d128_visible_loop/): in sm90
    SASS the masked loop is ~980 instructions per 128×128 tile (the mask's 64 predicates per thread are packed and
    unpacked around the QK wait), the visible one ~550. A mask read per element from a tensor is worth it at any
    head dim: at 128 its loads, in a loop with run-time bounds, spill registers (255 used, ~500 bytes of spills in
    the loop) where the loop without them needs ~200."""
    scaling = (aten.mul.Tensor, aten.div.Tensor, prims.convert_element_type.default, aten.full.default)
    scaling_only = all(node.op != "call_function" or node.target in scaling for node in unmasked.graph.nodes)
    head_dim = _val(region.q.node).shape[-1 if not region.q.transposed else -2]
    return scaling_only and (drops_mask_loads or head_dim <= config.visible_loop_max_head_dim)


def _speculated_guards(region: AttentionRegion) -> tuple[dict, float]:
    """The finite guards the kernel runs without, speculating, and the bound on the row max that keeps it exact
    (``finite_speculation``): only for a softmax over the columns alone (no sink, no pair reduction), whose per-row
    running state the check reads."""
    if not (config.speculate_finite_scores and region.softmax and region.sink is None and region.pair is None):
        return {}, math.inf
    return speculation_bound(region.chain, region.logits, region.score_root, region.logit_scale)


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


def subgraph(graph: torch.fx.Graph, module: torch.fx.GraphModule, stem: str) -> torch.fx.Node:
    """``module`` as a subgraph of the graph's own module: a get_attr node (``score_chain_0``, ...)."""
    owner = graph.owning_module
    name = next(f"{stem}_{i}" for i in itertools.count() if not hasattr(owner, f"{stem}_{i}"))
    owner.add_submodule(name, module)
    return graph.get_attr(name)


def _subgraphs(graph: torch.fx.Graph, modules: dict) -> dict:
    """The chain's GraphModules (by ScoreChain field; the id masks' pair as a tuple) as get_attr nodes."""
    stems = {"graph_module": "score_chain", "unmasked_graph_module": "score_chain_unmasked",
             "exact_graph_module": "score_chain_exact", "mask_table_module": "mask_table_chain"}
    nodes = {}
    for field, module in modules.items():
        if field == "id_graph_modules":
            nodes[field] = tuple(subgraph(graph, part, stem) for part, stem in zip(module, ("row_ids", "column_ids")))
        else:
            nodes[field] = subgraph(graph, module, stems[field])
    return nodes


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


def _folded_chains(
    region: AttentionRegion, chain: torch.fx.GraphModule, unmasked: Optional[torch.fx.GraphModule], fills: frozenset
) -> tuple[torch.fx.GraphModule, Optional[torch.fx.GraphModule], float]:
    """The chains (whole, and without the dropped masks) with their constant scale folded into the kernel's exp2
    factor (``logit_scale.fold_constant_scale``), and that scale; the chains as they are (scale 1) unless both fold
    to the same scale. With absorbing finite ``fills`` the fold must keep them absorbing."""
    if not (region.softmax and config.fold_logit_scale):
        return chain, unmasked, 1.0
    fill_bound = ABSORBING_FILL / region.logit_scale if fills else None
    folds = [fold_constant_scale(module, fill_bound) for module in (chain, unmasked) if module is not None]
    if not all(folds) or len({scale for _, scale in folds}) != 1:
        return chain, unmasked, 1.0
    return folds[0][0], folds[1][0] if unmasked is not None else None, folds[0][1]


def fuse(region: AttentionRegion, group_coefficients: Optional[torch.fx.Node] = None) -> torch.fx.Node:
    """Replace the region by one fused node (with ``group_coefficients``, the node also combines each group of
    consecutive heads; see ``ops.py``) and return the node that now stands for ``region.pv``."""
    graph = region.pv.graph
    score_shape = _val(region.score_root).shape
    formula, mask_nodes, skippable, fills = None, [], None, frozenset()
    if region.softmax:
        fills = absorbing_fill_masks(region.chain, region.score_root, region.logits, region.logit_scale)
        formula, mask_nodes, skippable = position_masks(region.chain, fills)
    id_mask = _summarised_id_mask(region) if region.softmax and config.block_skipping else None
    summarise_tensors = region.softmax and config.block_skipping and config.mask_tensor_tables
    tensor_masks = matched_tensor_masks(region.chain, region.score_root) if summarise_tensors else []
    tensor_mask = tensor_masks[0] if tensor_masks else None
    additive_mask = None
    if summarise_tensors and tensor_mask is None and id_mask is None and skippable is None:
        # (A bias that is a position mask, ``x + triu(full(-inf), 1)``, already skips by its formula.)
        additive_mask = matched_additive_mask(region.chain, region.logits, region.score_root)
    mask_table = None
    if tensor_mask is not None or additive_mask is not None:
        mask = tensor_mask or additive_mask
        key = ("tensor", tensor_mask.term, tensor_mask.negated) if tensor_mask else ("additive", additive_mask.bias)
        mask_table = _shared_table(graph, key, lambda: _mask_table(graph, region, mask), region.pv)
    if mask_table is not None:
        region = dataclasses.replace(region, captured=[*region.captured, mask_table])
    drops_mask_loads = (tensor_mask is not None and tensor_mask.alone) or additive_mask is not None
    droppable = [*mask_nodes, *([id_mask.where] if id_mask is not None and id_mask.alone else [])]
    droppable += [tensor_mask.where if tensor_mask else additive_mask.add] if drops_mask_loads else []
    guards, row_max_bound = _speculated_guards(region)
    unmasked = None
    if droppable and config.split_visible_tiles:
        unmasked = _score_chain_module(region, frozenset(droppable), guards)
    split = unmasked is not None and _worth_a_visible_loop(unmasked, region, drops_mask_loads)
    visible_tile_code = _visible_tile_code(formula, id_mask, drops_mask_loads) if split else None
    chain_module, unmasked_module, folded_scale = _folded_chains(
        region, _score_chain_module(region, guards=guards), unmasked if visible_tile_code else None, fills
    )
    wide_logits = region.softmax and _logits_may_near_float_max(region, fills, guard_only_nodes(region.chain, guards))
    exact_module, exact_scale = None, 1.0
    if guards:
        exact_module, _, exact_scale = _folded_chains(region, _score_chain_module(region), None, fills)
    chain = ScoreChain(
        graph_module=chain_module,
        batch_shape=tuple(score_shape[:-2]) or (1,),
        score_dtype=_val(region.qk).dtype,
        probability_dtype=region.probability_dtype,
        masked_tile_code=fully_masked_tile_code(skippable) if config.block_skipping else None,
        softmax=region.softmax,
        sink_scale=region.logit_scale,
        unmasked_graph_module=unmasked_module,
        folded_scale=folded_scale,
        visible_tile_code=visible_tile_code,
        pair_dtype=_val(region.pair.result).dtype if region.pair is not None else None,
        id_graph_modules=None if id_mask is None else tuple(
            _chain_value_module(region, ids, list(score_shape)) for ids in (id_mask.rows, id_mask.columns)
        ),
        wide_logits=wide_logits,
        exact_graph_module=exact_module,
        exact_folded_scale=exact_scale,
        speculation_bound=row_max_bound,
        batch_fastest=_batch_fastest(region, score_shape),
        mask_table_module=None if mask_table is None else _chain_value_module(
            region, mask_table, [*(score_shape[:-2] or [1]), *_table_cells(score_shape, mask_table)]
        ),
    )
    # The fused node stands where the first of its outputs was computed.
    anchor = region.pv
    if region.pair is not None:
        anchor = next(n for n in graph.nodes if n is region.pv or n is region.pair.result)
        _hoist_before(region.pair.values, anchor)
    groups = 1 if group_coefficients is None else _val(group_coefficients).numel()
    output_batch = _output_batch(tuple(score_shape[:-2]) or (1,), groups, _val(region.pv).shape[-1])
    with graph.inserting_before(anchor):
        q, kt, v = (_materialise(graph, source) for source in (region.q, region.kt, region.v))
        sink = _broadcast(graph, region.sink, [*score_shape[:-1], 1]) if region.sink is not None else None
        subgraphs, decisions = ops.chain_arguments(chain)
        inputs = (q, kt, v, list(region.captured), sink, _subgraphs(graph, subgraphs), decisions)
        sizes = list(region.captured_sizes)
        if region.pair is None:
            op = ops.online_softmax_attention
            fused = call_op(graph, op, (*inputs, group_coefficients, output_batch, sizes))
        else:
            assert group_coefficients is None, "head groups do not combine a pair reduction"
            pair_shape = [*score_shape, _val(region.pair.result).shape[-1]]
            values = _broadcast(graph, region.pair.values, pair_shape)
            op = ops.online_softmax_attention_with_pair_sum
            both = call_op(graph, op, (*inputs, values, output_batch, sizes))
            fused, pair_sum = (call_op(graph, operator.getitem, (both, i)) for i in (0, 1))
            pair_result = call_op(graph, aten.view.default, (pair_sum, list(_val(region.pair.result).shape)))
            region.pair.result.replace_all_uses_with(pair_result)
        result = _as_matmul_output(graph, fused, _val(region.pv).dim(), output_batch)
    _reroute_size_reads(region)
    region.pv.replace_all_uses_with(result)
    return result


def _output_batch(batch: tuple, groups: int, dv: Any) -> Optional[list[int]]:
    """The fused output's batch dims: the scores' own (heads combined in groups of ``groups``) when they are
    static, so that the output has the shape the user's graph views the matmul's output as; None (one flattened
    batch dim) otherwise."""
    if not all(isinstance(size, int) for size in (*batch, dv)) or batch[-1] % groups:
        return None
    return [*batch[:-1], batch[-1] // groups]


def _as_matmul_output(graph: torch.fx.Graph, fused: torch.fx.Node, rank: int, output_batch: Optional[list[int]]) -> torch.fx.Node:
    """The fused output ``[*output_batch, M, Dv]`` viewed as a matmul's: ``[M, Dv]`` (rank 2) or with the batch
    flattened (``[Z, M, Dv]``; ``Z / G`` entries when heads combine in groups of G)."""
    if rank == 2:
        return call_op(graph, aten.squeeze.dim, (fused, 0))
    if output_batch is None or len(output_batch) == 1:
        return fused
    return call_op(graph, aten.view.default, (fused, [math.prod(output_batch), -1, _val(fused).shape[-1]]))


def fuse_attention(graph: torch.fx.Graph) -> None:
    """Post-grad pass: every fusable softmax→matmul becomes one fused attention node."""
    from inductor_overlay.fx_passes.sdpa_route import replace_by_sdpa, sdpa_call  # (it imports us)

    if not config.attention_fusion:
        return
    changed = False
    for pv in [n for n in graph.nodes if _is(n, _MATMULS)]:
        if _val(pv.args[0]) is None:
            continue
        outcome = find_attention(pv)
        if isinstance(outcome, Decline):
            if _looks_like_softmax_input(pv):
                counters["inductor"]["flashlight_attention_declined"] += 1
                log.info("attention not fused at %s: %s", pv.name, outcome.reason)
            continue
        changed = True
        call = sdpa_call(outcome)
        if call is not None and replace_by_sdpa(outcome, call) is not None:
            counters["inductor"]["flashlight_attention_as_sdpa"] += 1
            log.info("attention at %s runs as SDPA (%s)", pv.name, call)
            continue
        fuse(outcome)
        counters["inductor"]["flashlight_attention_fused"] += 1
        log.info(
            "attention fused at %s: scores %s, %d chain ops moved into the kernel, %d tensors read by it",
            pv.name,
            tuple(_val(outcome.score_root).shape),
            len(outcome.chain),
            len(outcome.captured),
        )
    if changed:
        graph.eliminate_dead_code()
        graph.lint()


def _looks_like_softmax_input(pv: torch.fx.Node) -> bool:
    """Only report declines for matmuls fed by a softmax-like op, not for every matmul in a model."""
    p, _ = _strip_order_preserving(pv.args[0], also=(prims.convert_element_type.default,))
    return _is(p, aten.exp.default) or (_is(p, aten.div.Tensor) and _is(p.args[0], aten.exp.default))


# How far past the scores matmul the search for the softmax's row max looks (views, casts, the user's chain).
_SCORE_CHAIN_SEARCH_NODES = 64


def reaches_row_max(product: torch.fx.Node) -> bool:
    """Whether the product reaches an ``amax`` through views and pointwise ops (the scores of a softmax)."""
    seen, frontier = {product}, [product]
    while frontier and len(seen) < _SCORE_CHAIN_SEARCH_NODES:
        node = frontier.pop()
        for user in node.users:
            if _is(user, aten.amax.default):
                return True
            if user in seen or not isinstance(user.target, torch._ops.OpOverload):
                continue
            if torch.Tag.pointwise in user.target.tags or _is(user, (*_VIEWS, prims.convert_element_type.default)):
                seen.add(user)
                frontier.append(user)
    return False


def is_matmul_fed_by(p: torch.fx.Node) -> bool:
    """Whether ``p`` is a matmul's left operand, possibly through order-preserving views and casts."""
    frontier = [p]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if _is(user, _MATMULS) and user.args[0] is node:
                return True
            if _preserves_element_order(user) or _is(user, prims.convert_element_type.default):
                frontier.append(user)
    return False
