"""The attention pass: every legal region (``attention_region.find_attention``) becomes one fused node,
``ops.online_softmax_attention``, with its chain as subgraphs (``chain_modules``), its mask tables
(``mask_tables``) and the decisions of the kernel (block skipping, speculation, scales, tile-choice inputs) as
plain data; an unmasked form that SDPA serves better goes to SDPA instead (``sdpa_route``)."""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Any, Optional

import torch
from torch._dynamo.utils import counters

from inductor_overlay import config
from inductor_overlay.fx_passes.block_sparsity import (
    ABSORBING_FILL,
    IdMask,
    PositionReads,
    absorbing_fill_masks,
    depends_on,
    fill_is_true_branch,
    fills_absorbing_where_rows_keep_keys,
    masked_terms,
    matched_additive_mask,
    matched_id_masks,
    matched_tensor_masks,
    position_masks,
    reads_scalars,
    reads_vectors,
)
from inductor_overlay.fx_passes.block_sparsity import _COPIES, _DIM_VIEWS
from inductor_overlay.fx_passes.block_sparsity import is_op as _is
from inductor_overlay.fx_passes.arange_positions_route import arange_positions, route_when_arange
from inductor_overlay.fx_passes.band_tensor_route import band_route_masks, route_when_band
from inductor_overlay.fx_passes.causal_tensor_route import causal_route_masks, route_when_causal
from inductor_overlay.fx_passes.finite_speculation import MAX_BOUND, guard_only_nodes, speculation_bound
from inductor_overlay.fx_passes.logit_scale import fold_constant_scale
from inductor_overlay.fx_passes.sdpa_route import replace_by_sdpa, sdpa_call
from inductor_overlay import ops
from inductor_overlay.ops import ScoreChain
from inductor_overlay.fx_passes.fx_helpers import (
    _MATMULS,
    _broadcast,
    _hoist_before,
    _materialise,
    _strip,
    _val,
    call_op,
    subgraph,
    aten,
    prims,
)
from inductor_overlay.fx_passes.attention_region import (
    AttentionRegion,
    Decline,
    _looks_like_softmax_input,
    find_attention,
)
from inductor_overlay.fx_passes.chain_modules import (
    _chain_value_module,
    _reroute_size_reads,
    _score_chain_module,
    affine_positions,
    position_differences,
)
from inductor_overlay.fx_passes.mask_tables import _mask_table, _shared_table, _table_cells, position_cells

# TORCH_LOGS=flashlight shows every fused attention and every declined one with its reason.
log = logging.getLogger("flashlight.attention_fusion")


# Chain ops that read a tensor at an index computed per logit (T5's distance table, DeBERTa's relative positions).
_GATHERS = (aten.index.Tensor, aten.gather.default)
# Functions that cost a special-function-unit instruction or a libdevice call per element, as the softmax's exp2 does.
_SPECIAL_FUNCTIONS = frozenset(
    getattr(aten, name).default
    for name in ("tanh", "sigmoid", "exp", "exp2", "expm1", "log", "log1p", "log2", "erf", "sin", "cos", "sqrt",
                 "rsqrt", "reciprocal", "atan")
) | {aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor}
# Chain ops that do no arithmetic: views, copies and dtype conversions (the scores' upcast).
_NO_ARITHMETIC = frozenset(_DIM_VIEWS + _COPIES)


def score_chain_weight(chain: torch.fx.GraphModule) -> str:
    """How much the chain (scores, *captured) -> logits does per logit, for the choice of tiles: "none" (plain
    attention, its scale folded into exp2), "light" (arithmetic alone: ALiBi, whose slopes may come from a ``pow``
    of the head index, constant over a tile) or "heavy" (a gather, or a special function of the scores)."""
    scores = next(node for node in chain.graph.nodes if node.op == "placeholder")
    on_scores, arithmetic = {scores}, 0
    for node in chain.graph.nodes:
        if node.op != "call_function":
            continue
        arithmetic += node.target not in _NO_ARITHMETIC
        if node.target in _GATHERS:
            return "heavy"
        if any(arg in on_scores for arg in node.all_input_nodes):
            if node.target in _SPECIAL_FUNCTIONS:
                return "heavy"
            on_scores.add(node)
    return "light" if arithmetic else "none"


def reads_gathers(chain: torch.fx.GraphModule) -> bool:
    return any(node.target in _GATHERS for node in chain.graph.nodes)


def _position_reads(region: AttentionRegion, training: bool) -> Optional[PositionReads]:
    """What the mask formulas may read from memory as positions: an integer vector of static length computed from
    the chain's own values or a captured tensor, not from the scores (None with a symbolic length); outside training
    (the forward kernel reads them, the backward does not) an integer scalar too."""
    known, memo = set(region.chain) | set(region.captured), {}
    if not all(isinstance(size, int) for size in _val(region.score_root).shape):
        return None

    def readable(node: torch.fx.Node) -> bool:
        return node in known and not depends_on(node, region.score_root, memo) and all(
            isinstance(size, int) for size in _val(node).shape
        )

    return PositionReads(region.score_root, readable, scalars=not training)


def _position_vectors(region: AttentionRegion) -> list:
    """The position vectors worth computing from the tile's own positions when they are consecutive: the operands
    of a difference of positions read as float32 (ALiBi's ``pos[n] - pos[m]``, an int64 subtraction and conversion
    per logit). Positions a mask alone reads stay read: a vector per tile, compared only on partial tiles; computing
    them cost 2–5% on causal and prefix-LM masks over captured positions and gained nothing on windows (H100,
    bf16, forward, 8×16×2048×128 and 4×32×4096×64, and 9% on a causal forward in training at 2×16×8192×128,
    2026-11-27, results/written_forms/affine_positions.txt)."""
    vectors = []
    for difference in position_differences(region):
        vectors += [arg for arg in difference.args[:2] if isinstance(arg, torch.fx.Node)]
    return vectors


def _position_cell_tables(graph: torch.fx.Graph, region: AttentionRegion, reads: PositionReads, user: torch.fx.Node) -> tuple:
    """The bounds per cell (``mask_tables.position_cells``) of the vectors the formulas read at the rows and at the
    columns (None for an axis they do not read), once per call: attentions that read the same vector share them."""
    return tuple(
        None if vector is None else _shared_table(
            graph, ("positions", vector, rows), lambda v=vector, r=rows: position_cells(graph, v, r), user
        )
        for vector, rows in ((reads.rows, True), (reads.columns, False))
    )


def _scalar_modules(region: AttentionRegion, reads: Optional[PositionReads], formula, shape: list) -> Optional[tuple]:
    """The modules computing the scalars the mask formulas read (``PositionReads.scalars``), for the kernel to read
    once; None where they read none."""
    if reads is None or not reads.scalars or not reads_scalars(formula):
        return None
    nodes = [*reads.scalars, None][:2]
    return tuple(None if node is None else _chain_value_module(region, node, shape) for node in nodes)


def _summarised_id_mask(region: AttentionRegion) -> Optional[IdMask]:
    """The first id-equality mask (``matched_id_masks``) whose ids the kernel can compute (chain values or captured
    tensors): its pre-pass bounds them per tile."""
    known = set(region.chain) | set(region.captured)
    masks = matched_id_masks(region.chain, region.score_root)
    return next((mask for mask in masks if {mask.rows, mask.columns} <= known), None)


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


def _lone_finite_fill(region: AttentionRegion) -> frozenset:
    """The chain's only mask, when it is a ``where`` of one term whose finite fill absorbs wherever every row keeps a
    key (``fills_absorbing_where_rows_keep_keys``: Hugging Face GPT-2's ``where(bias, w, finfo.min)``, a padding mask
    filled with ``finfo.min``); else nothing. Its table skips only the cells whose rows each keep a key
    (``TensorMask.rows_keep_keys``): with no other mask, such a row's largest logit is a kept key's."""
    if not region.softmax:
        return frozenset()
    fills = fills_absorbing_where_rows_keep_keys(region.chain, region.score_root, region.logits, region.logit_scale)
    masks = [node for node in region.chain if masked_terms(node, fills) is not None]
    if len(fills) != 1 or set(masks) != fills or len(masked_terms(masks[0], fills)) != 1:
        return frozenset()
    return fills


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


def _broadcast_over_rows(mask: torch.fx.Node) -> bool:
    """Whether a mask or bias the chain reads is the same on every row of the scores (``[.., 1, N]``)."""
    shape = _val(mask).shape
    return len(shape) >= 2 and shape[-2] == 1


def _worth_a_visible_loop(unmasked: torch.fx.GraphModule, region: AttentionRegion, drops_mask_loads: bool) -> bool:
    """A loop of its own for entirely visible tiles pays where the mask is most of the per-element work: on the
    H100 it gave 6–15% at head dim 64 when the rest of the chain is only scaling (causal, prefix-LM, GQA), and lost
    21% on Gemma-2's soft-capped window (benchmarks/results/h100_2026-11-22_split_visible_tiles/). At head dim 128
    it gives 9–15% on causal since the partial tiles share one loop (h100_2026-11-22_d128_visible_loop/): in sm90
    SASS the masked loop is ~980 instructions per 128×128 tile (the mask's 64 predicates per thread are packed and
    unpacked around the QK wait), the visible one ~550. A mask read per element from a tensor is worth it at any
    head dim: at 128 its loads, in a loop with run-time bounds, spill registers (255 used, ~500 bytes of spills in
    the loop) where the loop without them needs ~200; with a soft-cap too, the loads dominate (a mask tensor passed
    to Gemma-2's soft-capped window ran 0.51–0.53× of the same window from positions without a visible loop)."""
    if drops_mask_loads:
        return True
    scaling = (aten.mul.Tensor, aten.div.Tensor, prims.convert_element_type.default, aten.full.default)
    scaling_only = all(node.op != "call_function" or node.target in scaling for node in unmasked.graph.nodes)
    head_dim = _val(region.q.node).shape[-1 if not region.q.transposed else -2]
    return scaling_only and head_dim <= config.visible_loop_max_head_dim


def _speculated_guards(region: AttentionRegion, training: bool) -> tuple[dict, float]:
    """The finite guards the kernel runs without, speculating, and the bound on the row max that keeps it exact
    (``finite_speculation``): only for a softmax over the columns alone (no sink, no pair reduction), whose per-row
    running state the check reads, and not in training (the backward recomputes the chain tile by tile, exactly)."""
    speculates = config.speculate_finite_scores and not training
    if not (speculates and region.softmax and region.sink is None and region.pair is None):
        return {}, math.inf
    return speculation_bound(region.chain, region.logits, region.score_root, region.logit_scale)


def _subgraphs(graph: torch.fx.Graph, modules: dict) -> dict:
    """The chain's GraphModules (by ScoreChain field; the id masks' pair as a tuple) as get_attr nodes."""
    nodes = {}
    for field, module in modules.items():
        name = ops.SUBGRAPH_NAMES[field]
        if isinstance(name, tuple):
            nodes[field] = tuple(None if part is None else subgraph(graph, part, stem) for part, stem in zip(module, name))
        else:
            nodes[field] = subgraph(graph, module, name)
    return nodes


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


@dataclasses.dataclass
class TrainingForward:
    """What ``fuse(..., training=True)`` inserted, which the fused backward reads too."""

    result: torch.fx.Node  # the node that now stands for ``region.pv``
    lse: Optional[torch.fx.Node]  # the rows' statistics (``ops.online_softmax_attention_with_lse``); None with no softmax
    operands: tuple  # q, kt, v as the fused node reads them
    captured: list  # the tensors the chain reads (with the mask table, when there is one)
    subgraphs: dict  # the chain's subgraphs (get_attr nodes), by ScoreChain field
    decisions: dict
    chain: ScoreChain
    sink: Optional[torch.fx.Node]  # the sink logits broadcast to [*batch, M, 1], when the softmax has a sink


def fuse(
    region: AttentionRegion, group_coefficients: Optional[torch.fx.Node] = None, training: bool = False
) -> Any:
    """Replace the region by one fused node (with ``group_coefficients``, the node also combines each group of
    consecutive heads; see ``ops.py``) and return the node that now stands for ``region.pv``. In ``training`` the
    node also returns the rows' log-sum-exp: the result is a :class:`TrainingForward`."""
    graph = region.pv.graph
    score_shape = _val(region.score_root).shape
    # The fused node stands where the first of its outputs was computed; what it reads is built before that.
    anchor = region.pv
    if region.pair is not None:
        anchor = next(n for n in graph.nodes if n is region.pv or n is region.pair.result)
    formula, mask_nodes, skippable, fills = None, [], None, frozenset()
    reads = _position_reads(region, training) if region.softmax and config.block_skipping else None
    if region.softmax:
        fills = absorbing_fill_masks(region.chain, region.score_root, region.logits, region.logit_scale)
        formula, mask_nodes, skippable = position_masks(region.chain, region.score_root, fills, reads)
    guards, row_max_bound = _speculated_guards(region, training)
    wide_logits = region.softmax and _logits_may_near_float_max(region, fills, guard_only_nodes(region.chain, guards))
    id_mask = _summarised_id_mask(region) if region.softmax and config.block_skipping else None
    summarise_tensors = region.softmax and config.block_skipping and config.mask_tensor_tables
    tensor_masks = []
    if summarise_tensors:
        tensor_masks = matched_tensor_masks(region.chain, region.score_root, reads, _lone_finite_fill(region))
    tensor_mask = tensor_masks[0] if tensor_masks else None
    additive_mask = None
    if summarise_tensors and tensor_mask is None and id_mask is None and skippable is None:
        # (A bias that is a position mask, ``x + triu(full(-inf), 1)``, already skips by its formula.)
        additive_mask = matched_additive_mask(region.chain, region.logits, region.score_root)
    mask_table, mask_rows_alike = None, False
    if tensor_mask is not None or additive_mask is not None:
        mask = tensor_mask or additive_mask
        key = ("tensor", tensor_mask.term, tensor_mask.negated, tensor_mask.rows_keep_keys) if tensor_mask else (
            "additive", additive_mask.bias)
        mask_table = _shared_table(graph, key, lambda: _mask_table(graph, region, mask), anchor)
        mask_rows_alike = _broadcast_over_rows(key[1])
    if mask_table is not None:
        region = dataclasses.replace(region, captured=[*region.captured, mask_table])
    cells = _position_cell_tables(graph, region, reads, anchor) if reads_vectors(skippable) else None
    if cells is not None:
        region = dataclasses.replace(region, captured=[*region.captured, *[c for c in cells if c is not None]])
    drops_mask_loads = (tensor_mask is not None and tensor_mask.alone) or additive_mask is not None
    droppable = [*mask_nodes, *([id_mask.where] if id_mask is not None and id_mask.alone else [])]
    droppable += [tensor_mask.where if tensor_mask else additive_mask.add] if drops_mask_loads else []
    # Captured positions computed from the tile where they are consecutive speculate like the finite guards, where
    # the kernel may redo a row tile exactly. In training too: the forward's redo keeps the rows' statistics in the
    # units the backward reads, and the backward recomputes the chain that reads the positions (``ops.differentiated_chain``).
    redoable = region.softmax and region.sink is None and region.pair is None and group_coefficients is None
    firsts, affine_flag = {}, None
    if config.affine_positions and redoable:
        with graph.inserting_before(anchor):
            firsts, affine_flag = affine_positions(graph, region, _position_vectors(region))
    if affine_flag is not None:
        region = dataclasses.replace(region, captured=[*region.captured, *firsts.values(), affine_flag])
    if firsts and not guards:
        row_max_bound = MAX_BOUND  # only a NaN or an empty row fails the check
    unmasked = None
    if droppable and config.split_visible_tiles:
        unmasked = _score_chain_module(region, frozenset(droppable), guards, firsts)
    split = unmasked is not None and _worth_a_visible_loop(unmasked, region, drops_mask_loads)
    chain_module, unmasked_module, folded_scale = _folded_chains(
        region, _score_chain_module(region, guards=guards, affine=firsts), unmasked if split else None, fills
    )
    exact_module, exact_scale = None, 1.0
    if guards or firsts:
        exact_module, _, exact_scale = _folded_chains(region, _score_chain_module(region), None, fills)
        if training and exact_scale != folded_scale:  # the forward's row statistics are in the whole chain's units
            raise RuntimeError("the fast and the whole chain fold different scales: the rows' statistics would not match")
    chain = ScoreChain(
        graph_module=chain_module,
        batch_shape=tuple(score_shape[:-2]) or (1,),
        score_dtype=_val(region.qk).dtype,
        probability_dtype=region.probability_dtype,
        masked_formula=skippable if config.block_skipping else None,
        softmax=region.softmax,
        sink_scale=region.logit_scale,
        unmasked_graph_module=unmasked_module,
        folded_scale=folded_scale,
        # What the unmasked chain dropped: position masks (their formula), an id-equality mask alone in its
        # ``where``, a mask tensor alone in its ``where`` or an additive mask (its table).
        visible_formula=formula if split else None,
        drops_id_mask=split and id_mask is not None and id_mask.alone,
        drops_table_mask=split and drops_mask_loads,
        pair_dtype=_val(region.pair.result).dtype if region.pair is not None else None,
        id_graph_modules=None if id_mask is None else tuple(
            _chain_value_module(region, ids, list(score_shape)) for ids in (id_mask.rows, id_mask.columns)
        ),
        wide_logits=wide_logits,
        exact_graph_module=exact_module,
        exact_folded_scale=exact_scale,
        speculation_bound=row_max_bound,
        batch_fastest=_batch_fastest(region, score_shape),
        chain_weight=score_chain_weight(chain_module),
        gathers=reads_gathers(chain_module),
        mask_rows_alike=mask_rows_alike,
        mask_table_module=None if mask_table is None else _chain_value_module(
            region, mask_table, [*(score_shape[:-2] or [1]), *_table_cells(score_shape, mask_table)]
        ),
        affine_graph_module=None if affine_flag is None else _chain_value_module(region, affine_flag, list(score_shape)),
        position_graph_modules=None if cells is None else tuple(
            None if table is None else _chain_value_module(region, table, [*(score_shape[:-2] or [1]), *_val(table).shape[-2:]])
            for table in cells
        ),
        scalar_graph_modules=_scalar_modules(region, reads, skippable, list(score_shape)),
    )
    log.info("attention at %s: %s", region.pv.name, describe_tiles(chain, training, additive_mask is not None))
    if region.pair is not None:
        _hoist_before(region.pair.values, anchor)
    groups = 1 if group_coefficients is None else _val(group_coefficients).numel()
    output_batch = _output_batch(tuple(score_shape[:-2]) or (1,), groups, _val(region.pv).shape[-1])
    with graph.inserting_before(anchor):
        q, kt = (_materialise(graph, source) for source in (region.q, region.kt))
        v = _materialise(graph, region.v, unscaled=False)
        sink = _broadcast(graph, region.sink, [*score_shape[:-1], 1]) if region.sink is not None else None
        subgraphs, decisions = ops.chain_arguments(chain)
        inputs = (q, kt, v, list(region.captured), sink, _subgraphs(graph, subgraphs), decisions)
        sizes = list(region.captured_sizes)
        if training and not region.softmax:  # weights that are the chain's output: no statistics to save
            assert region.pair is None and group_coefficients is None
            fused, lse = call_op(graph, ops.online_softmax_attention, (*inputs, None, output_batch, sizes)), None
        elif training:
            assert region.pair is None and group_coefficients is None
            op = ops.online_softmax_attention_with_lse
            both = call_op(graph, op, (q, kt, v, list(region.captured), inputs[5], decisions, output_batch, sizes, sink))
            fused, lse = (call_op(graph, operator.getitem, (both, i)) for i in (0, 1))
        elif region.pair is None:
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
    if training:
        return TrainingForward(result, lse, (q, kt, v), list(region.captured), inputs[5], decisions, chain, sink)
    return result


def describe_tiles(chain: ScoreChain, training: bool, additive: bool) -> str:
    """How the kernel decides which tiles to visit, for the fusion log: what a user reads to see why one written
    form of a mask skips tiles and another does not (``additive``: the mask table summarises an additive mask or a
    bias); in ``training``,
    positions read from memory that the forward computes from the tile where they are consecutive
    (``affine_positions``) are read and converted per logit in the backward; and whether the rows' running max
    stays in the logits' own units (a floating tensor read, whose values may come near -FLT_MAX)."""
    parts = []
    if chain.masked_formula is not None:
        read = " (positions read from memory, bounded per tile from their values)" if reads_vectors(chain.masked_formula) else ""
        parts.append(f"tiles skipped where {chain.masked_formula}{read}")
    if chain.id_graph_modules is not None:
        parts.append("document ids bounded per tile at run time")
    if chain.mask_table_module is not None:
        table = "an additive mask or bias tensor" if additive else "a mask tensor"
        parts.append(f"{table} summarised per call into cells of 32x32 (a read of the whole tensor)")
    notes = ""
    if training and chain.affine_graph_module is not None:
        notes += "; the backward reads the positions from memory and converts them per logit (the forward computes consecutive ones from the tile)"
    if chain.wide_logits:
        notes += ("; the rows' running max kept in the logits' own units with a scale per row (a floating tensor "
                  "is read whose values may come near -FLT_MAX)")
    if not parts:
        return "every tile visited (no mask whose tiles the analysis can bound)" + notes
    split = chain.unmasked_graph_module is not None
    parts.append("entirely visible tiles run without the mask" if split else "every visited tile runs the whole chain")
    return "; ".join(parts) + notes


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


def _fuse_branch(graph: torch.fx.Graph) -> None:
    fuse_attention(graph, routes=())


def _fuse_with_causal_route(graph: torch.fx.Graph) -> None:
    """The branch that reads positions which do not hold 0, 1, ...: their mask may still be causal (positions from
    another start)."""
    fuse_attention(graph, routes=("causal",))


def _fuse_with_band_route(graph: torch.fx.Graph) -> None:
    """The branch whose mask tensors are not causal: their mask may still be a band (a window, a prefix)."""
    fuse_attention(graph, routes=("band",))


def _routed(route, region: AttentionRegion, *args) -> bool:
    """Whether ``route`` replaced ``region`` (by a ``cond`` between two copies of it, fused by the functions among
    ``args``). A route works on copies until both branches are built, then adds its check and ``cond``: one that
    fails leaves at most unused nodes behind (removed with the pass's dead code). The region is then fused without
    it, with the reason in the log, and the graph's other attention keeps its fusion."""
    try:
        return route(region, *args) is not None
    except Exception as error:  # noqa: BLE001  (fault containment: the plain fused kernel stays)
        if not config.fault_containment:
            raise
        counters["inductor"]["flashlight_route_fault"] += 1
        log.warning("attention at %s: %s failed (%s: %s); fused without it", region.pv.name, route.__name__,
                    type(error).__name__, error)
        return False


def fuse_attention(graph: torch.fx.Graph, routes: tuple = ("arange", "causal")) -> None:
    """Post-grad pass: every fusable softmax→matmul becomes one fused attention node (or SDPA's, ``sdpa_route``;
    with ``routes``, two of them under a ``cond`` on a check of tensors made outside the graph: the positions the
    chain reads, ``arange_positions_route``, or its masks' tensors, ``causal_tensor_route`` and, in its branch for
    masks that are not causal, ``band_tensor_route``)."""
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
        positions = arange_positions(outcome) if "arange" in routes else []
        if positions and _routed(route_when_arange, outcome, positions, _fuse_with_causal_route, _fuse_branch):
            counters["inductor"]["flashlight_attention_arange_route"] += 1
            log.info("attention at %s runs as if the positions its chain reads were built with arange while they "
                     "hold 0, 1, ..., reading them otherwise", pv.name)
            continue
        masks = causal_route_masks(outcome) if "causal" in routes else None
        if masks is not None and _routed(route_when_causal, outcome, masks, _fuse_branch, _fuse_with_band_route):
            counters["inductor"]["flashlight_attention_causal_route"] += 1
            log.info("attention at %s runs as the in-function causal form while the tensors its masks read hold the "
                     "causal mask, reading them otherwise", pv.name)
            continue
        masks = band_route_masks(outcome) if "band" in routes else None
        if masks is not None and _routed(route_when_band, outcome, masks, _fuse_branch):
            counters["inductor"]["flashlight_attention_band_route"] += 1
            log.info("attention at %s runs with a band's formula (a window, a prefix) while the tensors its masks read "
                     "hold that band, reading them otherwise", pv.name)
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
