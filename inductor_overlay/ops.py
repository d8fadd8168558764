"""``online_softmax_attention``: the fused node the attention pass puts into the post-grad graph.

``out[z] = softmax_N(chain(q[z] @ kt[z])) @ v[z]`` where ``chain`` is the user's own pointwise program between
the two matmuls. With a ``sink`` (one logit per row) the softmax runs over one more column, which meets no V. A
chain registered with ``softmax=False`` meets V directly: ``out[z] = chain(q[z] @ kt[z]) @ v[z]``. With
``group_coefficients`` (G values) the output combines consecutive groups of G heads: ``Σ_g c[g]·out[z·G + g]``.
``online_softmax_attention_with_pair_sum`` also returns the probabilities reduced against a per-pair tensor,
``Σ_N p[z, m, n] · pair_values[z, m, n, :]`` (IPA).

The node describes itself: ``chain`` and the other GraphModules of its :class:`ScoreChain` (the chain without its
masks, the id and table subgraphs, the exact chain of speculation) are subgraphs of the graph's own module, passed
as get_attr nodes (``score_chain``), and the pass's decisions (block-skipping formulas, scales, dtypes, flags) are a
plain dict beside them (``decisions``; a formula as ``sympy.srepr`` text, since FX writes a node's arguments into
Python code, where a sympy object would not read back). The node's target is the Python function that computes its meaning eagerly;
Inductor lowers it to the kernel (``kernel/online_softmax_attention.py``). Nothing lives in process state, so the
graph can be printed, copied or compiled again on its own. Each operand keeps the
batch dims it had before the matmul flattened them (q ``[*bq, M, D]``, kt ``[*bk, D, N]``, v ``[*bv, N, Dv]``, each
batch flattening row-major to the same Z entries). The chain sees scores shaped ``[*batch, M, N]`` with
``prod(batch) == Z``, exactly as in the user's graph. The output is ``[*output_batch, M, Dv]``, contiguous: with
``output_batch`` None it is ``[Z, M, Dv]``, as the matmul's was; given the scores' own batch dims it is the tensor
the user's graph views the matmul's output as, so that a consumer reading it through that view indexes it exactly
as the kernel writes it (on the GPU Inductor matches an epilogue to its producer by those indices).

``mask_cell_states_of`` is the table of an additive mask the graph computes (HF's decoder mask), which the
attention kernel reads to skip tiles: its bias is a subgraph of the graph's module too, its summary plain data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import sympy
import torch


# Dimension elimination keeps a whole head dim in one tile; above this a tile would not fit in registers.
MAX_HEAD_DIM = 256

# The positions a mask's formula speaks of, a score's row m and column n: ``fx_passes/block_sparsity.py`` derives
# formulas over them from the user's own mask expression, ``kernel/tile_tests.py`` bounds them over a tile.
ROW = sympy.Symbol("m", integer=True, nonnegative=True)
COL = sympy.Symbol("n", integer=True, nonnegative=True)
# The value of an integer vector read from memory at the row and at the column (positions made once outside the
# compiled function, a buffer of positions): the kernel bounds them over a tile from the values themselves, read in
# its pre-pass (``ScoreChain.position_graph_modules``). Any sign.
ROW_READ = sympy.Symbol("pm", integer=True)
COL_READ = sympy.Symbol("pn", integer=True)
# The values of integer scalars read from memory (a band's width and prefix computed from a mask in the graph,
# ``fx_passes/band_tensor_route.py``): the kernel reads each once before its pre-pass (``ScoreChain.scalar_graph_modules``).
SCALAR_READS = (sympy.Symbol("ps0", integer=True), sympy.Symbol("ps1", integer=True))


@dataclasses.dataclass(frozen=True)
class ScoreChain:
    """The user's pointwise program from raw scores ``q @ kt`` to softmax logits."""

    graph_module: torch.fx.GraphModule
    batch_shape: tuple  # leading dims of the score tensor; their product is Z
    score_dtype: torch.dtype  # dtype of q @ kt in the user's graph
    probability_dtype: torch.dtype  # dtype the probabilities had when they met v
    # Where the chain sets a logit to -inf by position, a formula over ROW and COL (block skipping): the kernel skips
    # the tiles on every element of which it holds. None: no position mask, or block skipping off.
    masked_formula: Optional[sympy.Boolean] = None
    softmax: bool = True  # False: no normalisation, the chain's output meets V (sigmoid attention, (A·B)·C)
    # The chain without the masks it may drop on tiles they leave entirely visible: such tiles run this chain
    # instead (no per-element mask math). None: every tile runs the whole chain. What it dropped tells the kernel
    # which tiles those are: position masks (their formula holds nowhere on the tile), an id-equality mask alone in
    # its ``where`` (all the tile's ids are one value), the mask a table summarises (no cell of the tile masks).
    unmasked_graph_module: Optional[torch.fx.GraphModule] = None
    visible_formula: Optional[sympy.Boolean] = None
    drops_id_mask: bool = False
    drops_table_mask: bool = False
    sink_scale: float = 1.0  # the softmax's logit scale, applied to the sink logit as to the others
    # A positive constant factor of the chain's output that the fusion pass took out of the chain: the kernel
    # applies it with log2(e) (``fx_passes/logit_scale.py``).
    folded_scale: float = 1.0
    pair_dtype: Optional[torch.dtype] = None  # dtype of the pair reduction's result, when there is one
    # (scores, *captured, *sizes) -> per-row ids and -> per-column ids, each broadcast to the score shape, of a mask that
    # keeps a logit only where the two are equal (document masking): the kernel skips tiles whose ids are disjoint.
    id_graph_modules: Optional[tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = None
    # (scores, *captured, *sizes) -> the integer vectors the formulas read as ROW_READ and COL_READ, each broadcast to
    # the score shape, or None for one the formulas do not read: the kernel's pre-pass bounds them per tile.
    position_graph_modules: Optional[tuple[Optional[torch.fx.GraphModule], Optional[torch.fx.GraphModule]]] = None
    # (scores, *captured, *sizes) -> the integer scalars the formulas read as SCALAR_READS, each broadcast to the score
    # shape (None for one they do not read): the kernel reads them once, before its pre-pass.
    scalar_graph_modules: Optional[tuple[Optional[torch.fx.GraphModule], Optional[torch.fx.GraphModule]]] = None
    # (scores, *captured, *sizes) -> whether every captured position tensor the fast chain rebuilt from an ``iota``
    # holds consecutive values (``chain_modules.affine_positions``): where it does not, the kernel skips the fast
    # loops and runs the exact chain (``exact_graph_module``).
    affine_graph_module: Optional[torch.fx.GraphModule] = None
    # (scores, *captured, *sizes) -> the cell states of a mask passed in as a tensor (``block_sparsity.TensorMask``), as
    # ``[*batch, ⌈M/c⌉, ⌈N/c⌉]`` with c = MASK_TABLE_CELL: the kernel skips tiles all of whose cells are masked.
    mask_table_module: Optional[torch.fx.GraphModule] = None
    # The logits may come near -FLT_MAX (a finfo.min constant, a float tensor read): the kernel keeps its running
    # max unscaled and scales each row so that it cannot overflow (the kernel's ``softmax_step``).
    wide_logits: bool = False
    # The size of the leading batch dim when every score-sized tensor the chain reads is shared along it (a per-head
    # bias [H, M, N] under [B, H, M, N] scores): the kernel launches that dim fastest, 0 otherwise.
    batch_fastest: int = 0
    # The whole chain, when ``graph_module`` (and ``unmasked_graph_module``) run without its finite guards
    # (``fx_passes/finite_speculation.py``): a row tile whose check fails runs again with it. Its folded scale.
    exact_graph_module: Optional[torch.fx.GraphModule] = None
    exact_folded_scale: float = 1.0
    speculation_bound: float = math.inf  # the fast chain's result is exact where |row max| stays below this
    # Tile-choice inputs: the chain's work per logit ("none", "light", "heavy": ``attention_fusion.score_chain_weight``),
    # whether it gathers from a tensor at a per-logit index, whether its table's mask is the same on every row.
    chain_weight: str = "heavy"
    gathers: bool = False
    # The mask a table summarises is broadcast over the rows (``[.., 1, N]``: key padding): every
    # row tile meets its partial tiles at the same columns.
    mask_rows_alike: bool = False


# The fields of a ScoreChain that hold GraphModules (a pair of them for the id masks), with the names their subgraphs
# take in the graph's module: the fused node carries them as get_attr nodes, every other field as plain data.
SUBGRAPH_NAMES = {
    "graph_module": "score_chain",
    "unmasked_graph_module": "score_chain_unmasked",
    "id_graph_modules": ("row_ids", "column_ids"),
    "position_graph_modules": ("row_positions", "column_positions"),
    "scalar_graph_modules": ("scalar_read_0", "scalar_read_1"),
    "mask_table_module": "mask_table_chain",
    "exact_graph_module": "score_chain_exact",
    "affine_graph_module": "positions_affine",
}


# The fields of a ScoreChain that hold position formulas: the fused node carries them as text.
FORMULA_FIELDS = ("masked_formula", "visible_formula")


def formula_text(formula: Optional[sympy.Basic]) -> Optional[str]:
    """A formula as plain data for a node's arguments: its ``sympy.srepr``, which ``formula_of`` reads back."""
    return None if formula is None else sympy.srepr(formula)


def formula_of(text: Optional[str]) -> Optional[sympy.Basic]:
    return None if text is None else sympy.sympify(text)


def chain_arguments(chain: ScoreChain) -> tuple[dict, dict]:
    """``chain`` as the fused node's two arguments: its subgraphs (by field) and its decisions (plain data)."""
    decisions = {field.name: getattr(chain, field.name) for field in dataclasses.fields(chain)}
    subgraphs = {name: decisions.pop(name) for name in SUBGRAPH_NAMES}
    decisions.update({name: formula_text(decisions[name]) for name in FORMULA_FIELDS})
    return {name: module for name, module in subgraphs.items() if module is not None}, decisions


def _module(subgraph):
    """A GraphModule from what a subgraph argument holds: the module itself (the graph run eagerly), or Inductor's
    ``ir.Subgraph`` of it (lowering)."""
    if isinstance(subgraph, tuple):
        return tuple(_module(part) for part in subgraph)
    return getattr(subgraph, "graph_module", subgraph)


class _Differentiable(torch.fx.Interpreter):
    """Runs a chain with its dtype conversions as ``Tensor.to``: ``prims.convert_element_type`` has no autograd
    formula, and the backward's meaning differentiates the chain."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.prims.convert_element_type.default:
            return args[0].to(args[1])
        return super().call_function(target, args, kwargs)


def run_differentiably(module: torch.fx.GraphModule, *args) -> torch.Tensor:
    return _Differentiable(module).run(*args)


def chain_from_arguments(subgraphs: dict, decisions: dict) -> ScoreChain:
    formulas = {name: formula_of(decisions[name]) for name in FORMULA_FIELDS}
    modules = {name: _module(subgraph) for name, subgraph in subgraphs.items()}
    return ScoreChain(**{**decisions, **formulas}, **modules)


def inputs_read(module: torch.fx.GraphModule) -> set:
    """The names of a chain module's inputs that it reads (``captured_<i>`` for the captured tensors)."""
    return {node.name for node in module.graph.find_nodes(op="placeholder") if node.users}


def differentiated_chain(chain: ScoreChain) -> tuple[torch.fx.GraphModule, float]:
    """The chain (and its folded scale) whose logits the forward's row statistics describe and the backward
    recomputes: the whole chain where the kernel's loops run a faster form of it (finite guards speculated, captured
    positions computed from the tile, ``exact_graph_module``), else the chain itself."""
    if chain.exact_graph_module is not None:
        return chain.exact_graph_module, chain.exact_folded_scale
    return chain.graph_module, chain.folded_scale


def output_shape(batch_shape, m, dv, groups: int = 1, output_batch=None) -> list:
    """``[*output_batch, M, Dv]``, or ``[Z / groups, M, Dv]`` (Z = prod(batch_shape)) without ``output_batch``."""
    batch = list(output_batch) if output_batch is not None else [math.prod(batch_shape) // groups]
    return [*batch, m, dv]


def _scores(chain: ScoreChain, q, kt) -> torch.Tensor:
    """``q @ kt`` as ``[*batch, M, N]``, each operand's batch flattened to Z entries."""
    m, d, n = q.shape[-2], q.shape[-1], kt.shape[-1]
    z = math.prod(chain.batch_shape)
    return torch.bmm(q.reshape(z, m, d), kt.reshape(z, d, n)).view(*chain.batch_shape, m, n)


def _probabilities(chain: ScoreChain, q, kt, v, captured, sink, sizes=()) -> torch.Tensor:
    """``[*batch, M, N]`` probabilities as the user's graph computes them (the unfused meaning of the op)."""
    scores = _scores(chain, q, kt)
    module, folded_scale = differentiated_chain(chain)  # the kernel's fast chain is checked against the whole one
    logits = run_differentiably(module, scores, *captured, *sizes) if torch.is_grad_enabled() else module(scores, *captured, *sizes)
    if folded_scale != 1.0:  # the factor the pass took out of the chain (the kernel applies it with log2(e))
        logits = logits * folded_scale
    return _softmax(chain, logits, sink)


def _softmax(chain: ScoreChain, logits: torch.Tensor, sink) -> torch.Tensor:
    """The rows' softmax, a sink's logit (when there is one) as one more column that is then dropped; the logits
    themselves for a chain with no softmax."""
    if not chain.softmax:
        return logits.to(chain.probability_dtype)
    if sink is None:
        return torch.softmax(logits, dim=-1).to(chain.probability_dtype)
    m, n = logits.shape[-2:]
    sink_logits = sink.expand(*chain.batch_shape, m, 1).to(logits.dtype) * chain.sink_scale
    return torch.softmax(torch.cat([logits, sink_logits], -1), dim=-1)[..., :n].to(chain.probability_dtype)


def _times_values(chain: ScoreChain, probabilities: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[Z, M, Dv]``: the probabilities times V, batch entries flattened."""
    z, (m, n), dv = math.prod(chain.batch_shape), probabilities.shape[-2:], v.shape[-1]
    return torch.bmm(probabilities.reshape(z, m, n), v.reshape(z, n, dv))


def online_softmax_attention(q, kt, v, captured, sink, score_chain, decisions, group_coefficients=None, output_batch=None, sizes=()):
    """The fused node's meaning, run eagerly (``score_chain``: the chain's subgraphs by field; ``decisions``: the
    rest of its ScoreChain, plain data). Inductor lowers it to the kernel instead."""
    chain = chain_from_arguments(score_chain, decisions)
    probabilities = _probabilities(chain, q, kt, v, captured, sink, sizes)
    out = _times_values(chain, probabilities, v)
    z, m, dv = out.shape
    if group_coefficients is None:
        return out.view(output_shape(chain.batch_shape, m, dv, 1, output_batch))
    groups = group_coefficients.numel()
    weighted = out.view(z // groups, groups, m, dv).float() * group_coefficients.float().view(1, groups, 1, 1)
    return weighted.sum(1).to(out.dtype).view(output_shape(chain.batch_shape, m, dv, groups, output_batch))


def online_softmax_attention_with_pair_sum(q, kt, v, captured, sink, score_chain, decisions, pair_values, output_batch=None, sizes=()):
    """Also ``Σ_N p[..., m, n] · pair_values[..., m, n, c]``, as ``[Z, M, C]``."""
    chain = chain_from_arguments(score_chain, decisions)
    probabilities = _probabilities(chain, q, kt, v, captured, sink, sizes)
    out = _times_values(chain, probabilities, v)
    z, m, dv = out.shape
    pair = (probabilities.unsqueeze(-1).to(chain.pair_dtype) * pair_values).sum(-2)
    return out.view(output_shape(chain.batch_shape, m, dv, 1, output_batch)), pair.reshape(z, m, pair_values.shape[-1])


# The table of cell states of an additive mask (``fx_passes/block_sparsity.py``): the attention kernel skips tiles
# whose cells are all skipped and drops the add on tiles whose cells all keep the scores as they are.
TABLE_CELL = 32
CELL_KEEPS, CELL_MIXED, CELL_SKIPPED = 0, 1, 2

# FX node meta key: a table of a value computed once per position distance (fx_passes/distance_tables.py). The
# attention pass passes it to the kernel as an input, as a bias tensor, rather than moving its computation in.
DISTANCE_TABLE = "flashlight_distance_table"


@dataclasses.dataclass(frozen=True)
class MaskSummary:
    """An additive mask ``[*lead, M or 1, N]`` the graph computes, as ``mask_cell_states_of`` summarises
    it: cells all 0 keep the scores; cells ``absorbing_gap`` or more below their rows' largest bias are skipped."""

    graph_module: torch.fx.GraphModule  # (scores, *captured, *sizes) -> the bias; the scores are not read
    shape: tuple
    absorbing_gap: float
    # The position formulas over ROW and COL through which the bias varies along the rows
    # (``block_sparsity.row_position_formulas``): every row of a block where each is constant holds the same bias
    # (``kernel/tile_tests.row_invariant_test``). None where that is not known.
    row_formulas: Optional[tuple] = None


def cell_shape(shape) -> list:
    """``[*lead, ⌈M/c⌉, ⌈N/c⌉]`` for a mask ``[*lead, M, N]`` (c = TABLE_CELL)."""
    return [*shape[:-2], *(-(-size // TABLE_CELL) for size in shape[-2:])]


def _all_per_cell(flags: torch.Tensor) -> torch.Tensor:
    """Whether every flag of each cell holds; elements past M or N hold (the kernel masks them by bounds)."""
    *lead, rows, columns = flags.shape
    padded = torch.nn.functional.pad(flags, [0, -columns % TABLE_CELL, 0, -rows % TABLE_CELL], value=True)
    cells = padded.reshape(*lead, padded.shape[-2] // TABLE_CELL, TABLE_CELL, padded.shape[-1] // TABLE_CELL, TABLE_CELL)
    return cells.all(-1).all(-2)


def mask_cell_states(summary: MaskSummary, bias: torch.Tensor) -> torch.Tensor:
    """The reference meaning of the table: per cell, CELL_SKIPPED where every element lies ``absorbing_gap`` or
    more below its row's largest bias, else CELL_KEEPS where every element is 0, else CELL_MIXED (int8). A NaN
    counts as +inf for the gaps: its cell is never skipped (its row is NaN in eager anyway)."""
    bias = bias.float()
    keeps = bias == 0
    bias = torch.where(bias.isnan(), math.inf, bias)
    skipped = bias.amax(-1, keepdim=True) - bias >= summary.absorbing_gap
    states = torch.where(_all_per_cell(keeps), CELL_KEEPS, CELL_MIXED)
    return torch.where(_all_per_cell(skipped), CELL_SKIPPED, states).to(torch.int8)


def mask_cell_states_of(captured, bias, decisions, sizes=()):
    """The table node's meaning, run eagerly: ``bias`` is the summary's subgraph, ``decisions`` the rest of its
    MaskSummary (plain data). Inductor lowers it to the table kernel instead."""
    summary = summary_from_arguments(bias, decisions)
    return mask_cell_states(summary, summary.graph_module(None, *captured, *sizes))


def mask_summary_arguments(summary: MaskSummary) -> tuple[torch.fx.GraphModule, dict]:
    """``summary`` as the table node's arguments: its bias's subgraph and the rest (plain data)."""
    fields = {field.name: getattr(summary, field.name) for field in dataclasses.fields(summary)}
    if summary.row_formulas is not None:
        fields["row_formulas"] = tuple(formula_text(formula) for formula in summary.row_formulas)
    return fields.pop("graph_module"), fields


def summary_from_arguments(bias, decisions: dict) -> MaskSummary:
    rows = decisions["row_formulas"]
    formulas = None if rows is None else tuple(formula_of(text) for text in rows)
    return MaskSummary(graph_module=_module(bias), **{**decisions, "row_formulas": formulas})


def mask_cell_states_fake(captured, bias, decisions, sizes=()):
    return captured[0].new_empty(cell_shape(decisions["shape"]), dtype=torch.int8)


def online_softmax_attention_fake(q, kt, v, captured, sink, score_chain, decisions, group_coefficients=None, output_batch=None, sizes=()):
    groups = 1 if group_coefficients is None else group_coefficients.numel()
    shape = output_shape(decisions["batch_shape"], q.shape[-2], v.shape[-1], groups, output_batch)
    return q.new_empty(shape, dtype=v.dtype)


def online_softmax_attention_with_pair_sum_fake(q, kt, v, captured, sink, score_chain, decisions, pair_values, output_batch=None, sizes=()):
    z, m = math.prod(decisions["batch_shape"]), q.shape[-2]
    out = q.new_empty(output_shape(decisions["batch_shape"], m, v.shape[-1], 1, output_batch), dtype=v.dtype)
    return out, q.new_empty(z, m, pair_values.shape[-1], dtype=decisions["pair_dtype"])


# What the fusion pass computes a new node's fake value with, by the node's target.
FAKE_IMPLS = {
    online_softmax_attention: online_softmax_attention_fake,
    online_softmax_attention_with_pair_sum: online_softmax_attention_with_pair_sum_fake,
    mask_cell_states_of: mask_cell_states_fake,
}


# Training. The forward saves, besides q, kᵀ and v, the rows' statistics of its softmax, float32, from which the
# backward recomputes each tile's probabilities instead of reading saved ones: the log-sum-exp of the logits in the
# kernel's log2 units, ``lse = log2(Σ_N exp2(logits · log2(e)))`` ``[Z, M]`` (-inf for a row whose logits are all
# -inf), so that ``P = exp2(logits · log2(e) − lse)``; or, for logits that may come near -FLT_MAX (``wide_logits``),
# the row max in the logits' own units and the sum apart, ``[Z, 2, M]``: there ``m · scale + log2(l)`` would round
# ``l`` away, and the kernel scales such rows by a power of two (the kernel's ``softmax_step``).
LOG2E = 1.4426950408889634
WIDE_ROW_LIMIT = 2.0**30  # |m · scale| from which a row of wide logits takes the smaller, exact scale


def wide_row_scale(row_max: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """The scale of each row of wide logits: ``logit_scale``, or the largest power of two at most it for rows
    whose scaled max reaches ``WIDE_ROW_LIMIT``."""
    tiny = 2.0 ** math.floor(math.log2(logit_scale))
    return torch.where((row_max * logit_scale).abs() < WIDE_ROW_LIMIT, logit_scale, tiny)


def _known_max_and_scale(row_max: torch.Tensor, logit_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max of wide logits with -inf (a row entirely masked) taken as 0, and the row's scale."""
    known = torch.where(row_max == -math.inf, 0.0, row_max)
    return known, wide_row_scale(known, logit_scale)


def _row_statistics(chain: ScoreChain, q, kt, captured, sizes=(), sink=None) -> torch.Tensor:
    scores = _scores(chain, q, kt)
    z, (m, n) = math.prod(chain.batch_shape), scores.shape[-2:]
    module, folded_scale = differentiated_chain(chain)
    logits = module(scores, *captured, *sizes).float().reshape(z, m, n)
    logit_scale = LOG2E * folded_scale
    if sink is not None:  # the sink is one more column of each row's softmax, in the chain's logit units
        logits = torch.cat([logits, sink.float().reshape(z, m, 1) * (chain.sink_scale / folded_scale)], -1)
    if not chain.wide_logits:
        return torch.logsumexp(logits * folded_scale, -1) * LOG2E
    row_max = logits.amax(-1)
    known, row_scale = _known_max_and_scale(row_max, logit_scale)
    total = torch.exp2(logits * row_scale[..., None] - known[..., None] * row_scale[..., None]).sum(-1)
    return torch.stack([row_max, total], 1)


# What the backward kernel reads of wide statistics: three terms per row ``[Z, 3, M]``, computed once per row in the
# graph rather than in every tile of the kernel's column programs, so that ``P = exp2(logits · scale − shift) · norm``.
# A row whose scaled max is below FOLDED_ROW_LIMIT in magnitude (a row that keeps a key of a finfo.min mask, its
# logits of ordinary size) takes log2(l) into its shift, as the narrow ``lse`` does, and a norm of 1; the others (a
# row the mask hides entirely, a row of logits near 2^10 or beyond) keep 1/l apart, where ``shift + log2(l)`` would
# round ``l`` away, and folding costs the exponent up to 2^-15 there (about 2e-5 of p, as the narrow ``lse`` does).
FOLDED_ROW_LIMIT = 2.0**10
# A row whose max, as the softmax sees it, lies below HIDDEN_ROW_MAX has every logit masked by an absorbing fill or
# bias: the rows' kept logits lie above -2^123 (``block_sparsity.ABSORBING_FILL``, ``ABSORBING_BIAS_GAP``), so no
# tile the mask leaves entirely visible holds it, and it does not keep its batch entry from the visible tiles'
# narrow form (HF's left padding).
HIDDEN_ROW_MAX = -(2.0**124)


def backward_row_terms(lse: torch.Tensor, folded_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Wide statistics ``[Z, 2, M]`` as the backward kernel reads them: each row's (scale, shift, norm) ``[Z, 3, M]``
    (above), and per batch entry its flags (int32): 1 where a row is entirely -inf (``dense``), 2 where a row that a
    visible tile may hold keeps its norm apart (no tile of that entry runs in the visible tiles' narrow form)."""
    row_max, row_sum = lse[:, 0], lse[:, 1]
    known, scale = _known_max_and_scale(row_max, LOG2E * folded_scale)
    shift = known * scale
    folds = shift.abs() < FOLDED_ROW_LIMIT
    terms = torch.stack([scale, torch.where(folds, shift + torch.log2(row_sum), shift), torch.where(folds, 1.0, 1.0 / row_sum)], 1)
    hidden = known * folded_scale < HIDDEN_ROW_MAX
    dense = (row_max == -math.inf).any(-1)
    flags = dense.to(torch.int32) + 2 * (~folds & ~hidden).any(-1).to(torch.int32)
    return terms, flags


def row_statistics_shape(decisions: dict, m) -> list:
    z = math.prod(decisions["batch_shape"])
    return [z, 2, m] if decisions["wide_logits"] else [z, m]


def online_softmax_attention_with_lse(q, kt, v, captured, score_chain, decisions, output_batch=None, sizes=(), sink=None):
    """The fused forward of a graph that trains: the output as ``online_softmax_attention``'s, and the rows'
    statistics that the backward reads (above), a sink's column included."""
    chain = chain_from_arguments(score_chain, decisions)
    out = online_softmax_attention(q, kt, v, captured, sink, score_chain, decisions, None, output_batch, sizes)
    return out, _row_statistics(chain, q, kt, captured, sizes, sink)


def sink_gradient(lse, delta, sink, decisions: dict) -> torch.Tensor:
    """The gradient of each row's sink logit ``[Z, M]`` (float32) from the forward's row statistics (the sink's column
    included; ``row_statistics_shape``) and ``delta = Σ_Dv grad_out · out``: the sink is a column that meets no V, so
    its logit's gradient is ``p_sink · (0 − delta)``, with p_sink its probability as the backward kernel computes
    one (``exp2(logit · LOGIT_SCALE − lse)``, or per row's scale for wide logits)."""
    sink_scale, folded_scale = decisions["sink_scale"], decisions["folded_scale"]
    sink = sink.float().reshape(delta.shape)
    if not decisions["wide_logits"]:
        probability = torch.exp2(sink * (sink_scale * LOG2E) - lse)
    else:
        row_max, row_sum = lse[:, 0], lse[:, 1]
        known, row_scale = _known_max_and_scale(row_max, LOG2E * folded_scale)
        probability = torch.exp2((sink * (sink_scale / folded_scale) - known) * row_scale) / row_sum
    return -(probability * delta) * sink_scale


def writes_dk_contiguous(kt_strides) -> bool:
    """Whether the backward writes dKᵀ as the transpose of a contiguous dK: where kᵀ is a transposed k (its D dim
    contiguous), as attention's is, so that k's gradient needs no copy; else dKᵀ is contiguous itself ((A·B)·C's B)."""
    return kt_strides[-2] == 1 and kt_strides[-1] != 1


def dkt_in_layout(dkt: torch.Tensor, kt_strides) -> torch.Tensor:
    """``dkt`` ``[Z, D, N]`` in the layout the backward kernel writes (``writes_dk_contiguous``)."""
    if writes_dk_contiguous(kt_strides):
        return dkt.transpose(1, 2).contiguous().transpose(1, 2)
    return dkt.contiguous()


def _propagating_below_autograd(tensor: torch.Tensor) -> bool:
    """Whether the op runs on fake tensors, for their shapes alone, where autograd records nothing: a ``cond``'s
    fake propagation runs its branches below autograd (Inductor's, before lowering). Never while tracing (a proxy
    mode), where the op's meaning is being written down."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if not isinstance(tensor, torch._subclasses.FakeTensor) or get_proxy_mode() is not None:
        return False
    with torch.enable_grad():
        return tensor.detach().requires_grad_().sum().grad_fn is None


def online_softmax_attention_backward(
    q, kt, v, captured, score_chain, decisions, chain_vjp, lse, delta, dense, grad_out, sizes=(), read_vjps=(), gradient_reads=(),
    unmasked_vjp=None, sink=None, gradient_factor=1.0, programs="both",
):
    """The fused backward: the gradients of ``online_softmax_attention`` at ``grad_out`` ``[Z, M, Dv]`` with respect
    to the operands as the scores and output matmuls read them: ``dq [Z, M, D]``, ``dkt [Z, D, N]``, ``dv [Z, N, Dv]``.
    ``chain_vjp`` is the derivative of the chain, ``(scores, *captured, *sizes, grad_logits) -> grad_scores``;
    ``lse`` the forward's row statistics (wide ones as ``backward_row_terms``' ``[Z, 3, M]`` terms), ``delta`` the rows'
    ``Σ_Dv grad_out · out`` (float32), ``dense`` per batch entry whether a row is entirely masked (its backward
    visits every tile, as eager's gives NaN or 0 there; with wide statistics, ``backward_row_terms``' int32 flags). The kernel reads
    those; run eagerly, the gradients come from autograd through the op's meaning, which needs none of them.
    ``read_vjps`` and ``gradient_reads`` (plain data): for each captured tensor whose gradient is wanted, the
    derivative of its read broadcast to the score shape and how the kernel sums it; one float32 partial each follows
    the three gradients (``fx_passes/captured_gradients.py``). ``unmasked_vjp``: the derivative of the chain without
    its masks, which the kernel runs on entirely visible tiles. ``sink``: the sink logits the forward's softmax had
    (the kernel reads them through ``lse``; their own gradient is ``sink_gradient``'s). ``gradient_factor``: a
    constant taken out of both derivatives (``logit_scale.fold_gradient_factors``), which the kernel applies to
    dQ and dK once. ``programs``: "columns" or "rows" where only dKᵀ and dV, or only dQ, are wanted (the others
    are then not written by the kernel); eagerly all three are computed."""
    z = math.prod(decisions["batch_shape"])
    m, d, n, dv = q.shape[-2], q.shape[-1], kt.shape[-1], v.shape[-1]
    if _propagating_below_autograd(q):
        return online_softmax_attention_backward_fake(
            q, kt, v, captured, score_chain, decisions, chain_vjp, lse, delta, dense, grad_out, sizes, read_vjps,
            gradient_reads, unmasked_vjp, sink, gradient_factor, programs,
        )
    operands = [t.detach().reshape(shape).requires_grad_() for t, shape in ((q, (z, m, d)), (kt, (z, d, n)), (v, (z, n, dv)))]
    with torch.enable_grad():
        out = online_softmax_attention(*operands, captured, sink, score_chain, decisions, None, None, sizes)
        grads = torch.autograd.grad(out, operands, grad_out.reshape(z, m, dv), allow_unused=True)
    dq, dkt, dv = (torch.zeros_like(t) if g is None else g for t, g in zip(operands, grads))
    grads = (dq, dkt_in_layout(dkt, kt.stride()), dv)
    if not gradient_reads:
        return grads
    chain = chain_from_arguments(score_chain, decisions)
    scores, grad_logits = _chain_output_gradient(chain, *operands, captured, sizes, grad_out, sink)
    partials = [
        _partial(_module(vjp)(scores, *captured, *sizes, grad_logits), read, chain.batch_shape)
        for vjp, read in zip(read_vjps, gradient_reads)
    ]
    return (*grads, *partials)


def _chain_output_gradient(chain: ScoreChain, q, kt, v, captured, sizes, grad_out, sink=None) -> tuple:
    """The scores and the gradient of the output at ``grad_out`` with respect to the chain's output."""
    scores = _scores(chain, q.detach(), kt.detach())
    with torch.enable_grad():
        module, folded_scale = differentiated_chain(chain)
        chained = module(scores, *captured, *sizes).detach().requires_grad_()
        logits = chained * folded_scale if folded_scale != 1.0 else chained
        probabilities = _softmax(chain, logits, sink)
        out = _times_values(chain, probabilities, v.detach())
        (grad,) = torch.autograd.grad(out, chained, grad_out.reshape(out.shape))
    return scores, grad


def partial_shape(read: dict, batch_shape, m, n) -> list:
    """The float32 partial the backward kernel writes for a captured tensor's read (``captured_gradients``): per
    logit over the batch dims the read varies along (``full``), summed per diagonal n − m over them (``diagonals``,
    from n − m = 1 − M), or summed per row (``rows``) or per column (``columns``) of each batch entry."""
    kept = math.prod(size for size, kept in zip(batch_shape, read["kept_batch"]) if kept)
    if read["kind"] == "full":
        return [kept, m, n]
    if read["kind"] == "diagonals":
        return [kept, m + n - 1]
    return [math.prod(batch_shape), m if read["kind"] == "rows" else n]


def _partial(grad_read: torch.Tensor, read: dict, batch_shape) -> torch.Tensor:
    """The kernel's partial of a read's gradient (``partial_shape``) from its value per logit."""
    z, (m, n) = math.prod(batch_shape), grad_read.shape[-2:]
    grad_read = grad_read.float()
    if read["kind"] in ("full", "diagonals"):
        shared = [i for i, kept in enumerate(read["kept_batch"]) if not kept]
        grad_read = (grad_read.sum(shared) if shared else grad_read).reshape(-1, m, n)
        if read["kind"] == "full":
            return grad_read
        diagonal = (torch.arange(n, device=grad_read.device) - torch.arange(m, device=grad_read.device)[:, None]) + (m - 1)
        sums = grad_read.new_zeros(grad_read.shape[0], m + n - 1)
        return sums.index_add_(1, diagonal.flatten(), grad_read.reshape(grad_read.shape[0], m * n))
    return grad_read.sum(-1).reshape(z, m) if read["kind"] == "rows" else grad_read.sum(-2).reshape(z, n)


def online_softmax_attention_with_lse_fake(q, kt, v, captured, score_chain, decisions, output_batch=None, sizes=(), sink=None):
    out = online_softmax_attention_fake(q, kt, v, captured, None, score_chain, decisions, None, output_batch, sizes)
    return out, q.new_empty(row_statistics_shape(decisions, q.shape[-2]), dtype=torch.float32)


def online_softmax_attention_backward_fake(
    q, kt, v, captured, score_chain, decisions, chain_vjp, lse, delta, dense, grad_out, sizes=(), read_vjps=(), gradient_reads=(),
    unmasked_vjp=None, sink=None, gradient_factor=1.0, programs="both",
):
    z = math.prod(decisions["batch_shape"])
    m, d, n, dv = q.shape[-2], q.shape[-1], kt.shape[-1], v.shape[-1]
    partials = [q.new_empty(partial_shape(read, decisions["batch_shape"], m, n), dtype=torch.float32) for read in gradient_reads]
    dkt = dkt_in_layout(kt.new_empty(z, d, n), kt.stride())
    return (q.new_empty(z, m, d), dkt, v.new_empty(z, n, dv), *partials)


FAKE_IMPLS[online_softmax_attention_with_lse] = online_softmax_attention_with_lse_fake
FAKE_IMPLS[online_softmax_attention_backward] = online_softmax_attention_backward_fake
