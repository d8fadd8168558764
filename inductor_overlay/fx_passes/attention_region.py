"""Find attention in a post-grad graph and decide whether the online-softmax rewrite is legal.

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

import dataclasses
import math
import operator
from typing import Any, Iterator, Optional, Union

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from inductor_overlay import config
from inductor_overlay.fx_passes.block_sparsity import depends_on
from inductor_overlay.fx_passes.block_sparsity import is_op as _is
from inductor_overlay.ops import DISTANCE_TABLE, MAX_HEAD_DIM
from inductor_overlay.fx_passes.fx_helpers import (
    _MATMULS,
    _VIEWS,
    BatchSource,
    _batch_source,
    _matmul_operands,
    _operand_scale,
    _preserves_element_order,
    _strip_order_preserving,
    _val,
    aten,
    prims,
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


def _reduces_last_dim_keepdim(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    rank = _val(source).dim()
    return keepdim and list(dims or []) in ([-1], [rank - 1])


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


def _strip_row_shift(logits: torch.fx.Node, dead: frozenset = frozenset()) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """``x - max_N x`` written by the user before a softmax: a softmax is invariant to a shift constant along N,
    so the logits are ``x`` (a fully -inf row is NaN either way). ``max`` also gives the positions of the maxima;
    in training only the shift's own backward (in ``dead``) reads them."""
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
        positions_unused = all(u is shift or all(r in dead for r in u.users) for u in row_max.users)
        if row_max.args[0] is x and keepdim and dim % rank == rank - 1 and positions_unused:
            return x, [row_max, shift, logits, *(u for u in row_max.users if u is not shift)]
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
        unshifted, shift_nodes = _strip_row_shift(upcast[0].args[0] if upcast else logits, dead)
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
    if _val(score_root).shape[-2] != _val(p_operand).shape[-2]:
        return Decline("a view between the matmuls moves score rows into the batch (or the batch into the rows)")
    if not softmax:
        unprofitable = _match_linear(p, head_dims, math.prod(_val(score_root).shape[:-1]))
        if unprofitable is not None:
            return unprofitable
        if reaches_row_max(pv):
            return Decline("no softmax, and the product is the scores of a softmax attention, which fuses instead")

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


def _looks_like_softmax_input(pv: torch.fx.Node) -> bool:
    """Only report declines for matmuls fed by a softmax-like op, not for every matmul in a model."""
    p, _ = _strip_order_preserving(pv.args[0], also=(prims.convert_element_type.default,))
    p, dropped_column = _strip_dropped_last_column(p)  # a sink's column
    if dropped_column:
        p, _ = _strip_order_preserving(p, also=(prims.convert_element_type.default,))
    return is_softmax_output(p)


def is_softmax_output(node: torch.fx.Node) -> bool:
    """``exp(..)``, or ``exp(..) / ..``: what a softmax (normalised or not yet) leaves."""
    return _is(node, aten.exp.default) or (_is(node, aten.div.Tensor) and _is(node.args[0], aten.exp.default))


# How far past the scores matmul the search for the softmax's row max looks (views, casts, the user's chain).
_SCORE_CHAIN_SEARCH_NODES = 64


def reaches_row_max(product: torch.fx.Node) -> bool:
    """Whether the product reaches an ``amax`` through views and pointwise ops (the scores of a softmax)."""
    return reaches_op(product, aten.amax.default)


def reaches_op(product: torch.fx.Node, target: Any, through: tuple = ()) -> bool:
    """Whether the product reaches a ``target`` op through views, pointwise ops and ``through`` ops."""
    return any(_is(user, target) for user, _ in chain_uses(product, through))


def chain_uses(product: torch.fx.Node, through: tuple = ()) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """Each use ``(user, value)`` of the product and of what it becomes through views, pointwise ops and ``through``
    ops (the first ``_SCORE_CHAIN_SEARCH_NODES`` of them, breadth unordered)."""
    seen, frontier = {product}, [product]
    while frontier and len(seen) < _SCORE_CHAIN_SEARCH_NODES:
        node = frontier.pop()
        for user in node.users:
            yield user, node
            if user in seen or not isinstance(user.target, torch._ops.OpOverload):
                continue
            if torch.Tag.pointwise in user.target.tags or _is(user, (*_VIEWS, prims.convert_element_type.default, *through)):
                seen.add(user)
                frontier.append(user)


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
