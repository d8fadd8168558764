"""Lowering of ``ops.online_softmax_attention`` to one FlashAttention-style Triton kernel.

The loop skeleton below is what the algebraic rewrite (``fx_passes/attention_fusion.py``) derives for one softmax
feeding one matmul: the N dimension of the scores is demoted to a sequential loop over column tiles (dimension
demotion), the head dims D and Dv are each one whole tile (dimension elimination, so QKᵀ and P·V are single
``tl.dot`` calls), and the three dependent reductions over N run in one pass with running state
``(m_i, l_i, acc)`` rescaled by ``alpha``. What happens to a score tile between the dots is not part of the
skeleton: it is the user's own pointwise chain, lowered by Inductor (``PointwiseSubgraphLowering``) and generated
by Inductor's Triton pointwise codegen at the ``modification`` site, indexed by the tile's (z, m, n) positions.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import os
import re
from typing import Any, Optional, Sequence
from unittest import mock

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.lowering import empty_strided, register_lowering
from torch._inductor.select_algorithm import (
    SymbolicGridFn,
    TritonTemplate,
    autotune_select_algorithm,
)
from torch._inductor.subgraph_lowering import PointwiseSubgraphLowering
from torch._inductor.utils import expr_fits_within_32bit
from torch._inductor.virtualized import V
from torch._inductor.virtualized import ops
from torch.utils._sympy.functions import ModularIndexing

from inductor_overlay import config as overlay_config
from inductor_overlay import ops as fused_ops


aten = torch.ops.aten

LOG2E = fused_ops.LOG2E  # exp(x) = exp2(x * LOG2E)

# Template variables holding the tile's positions, read by the user's chain: flattened batch entry, rows, columns
# (their block shapes are given to the modification site in the template).
TILE_POSITIONS = ("fl_z", "fl_m", "fl_n")


@SymbolicGridFn
def _grid(z, m, n, meta, *, cdiv):
    return (cdiv(m, meta["BLOCK_M"]), z, 1)


ATTENTION_HEAD = r"""
{{def_kernel(INPUT_NAMES)}}
    M = {{size("Q", -2)}}
    N = {{size("KT", -1)}}

    # This program owns rows [start_m, start_m + BLOCK_M) of one (flattened) output batch entry out_z.
    out_z = tl.program_id(1).to(INDEX_DTYPE)
    if BATCH_FASTEST > 1:
        # The chain reads a score-sized tensor shared by the batch entries (a per-head bias): launch the entries of
        # one head side by side, so that they read its tiles from L2 rather than each from memory.
        out_z = (out_z % BATCH_FASTEST) * (tl.num_programs(1) // BATCH_FASTEST) + out_z // BATCH_FASTEST
    row_tile = tl.program_id(0)
    if LAST_ROWS_FIRST:
        # The GPU starts programs in launch order: under a causal mask the last rows see the most columns, so
        # launching them first leaves the short row tiles to fill the machine at the end.
        row_tile = tl.num_programs(0) - 1 - row_tile
    start_m = row_tile.to(INDEX_DTYPE) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_TILE)
    offs_dv = tl.arange(0, DV_TILE)
    row_in_bounds = offs_m[:, None] < M
    # Positions used by the user's score chain; clamped so its loads stay in bounds on ragged tiles (when M is a
    # multiple of BLOCK_M there are none, and unclamped positions keep the chain's loads contiguous). Int64 when a
    # tensor the chain reads has more elements than int32 counts (a [H, S, S] bias at S = 16k).
    if EVEN_M:
        fl_m = offs_m[:, None].to(POSITION_DTYPE)
    else:
        fl_m = tl.minimum(offs_m, M - 1)[:, None].to(POSITION_DTYPE)
"""

# One head: the online-softmax pass over the column tiles for batch entry fl_z, leaving its result in acc.
Q_AND_KT_BASES = r"""    # Each operand keeps its own batch dims and strides (transposed, expanded for GQA, ...): no copies.
    q_base = Q + BATCH_OFFSET_Q
    kt_base = KT + BATCH_OFFSET_KT
"""

V_BASE = "    v_base = V + BATCH_OFFSET_V\n"

Q_TILE = r"""    # The Q tile stays in registers for the whole N loop (the D loop is eliminated: D is one tile).
    q = tl.load(q_base + offs_m[:, None] * {{stride("Q", -2)}} + offs_d[None, :] * {{stride("Q", -1)}},
                mask=row_in_bounds & (offs_d[None, :] < D), other=0.0)
    if UPCAST_DOT_OPERANDS:
        q = q.to(tl.float32)
"""

ONE_HEAD = Q_AND_KT_BASES + V_BASE + Q_TILE + r"""
    ROW_STATE

    TILE_RANGE
    N_LOOPS

    FINISH
"""

# Dimension demotion: N, a parallel dim of the scores, is a sequential loop over column tiles (tiles START to END).
TILE_COLUMNS = r"""for start_n in range(START, END, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_in_bounds = offs_n[None, :] < N
        if EVEN_N:
            fl_n = offs_n[None, :].to(POSITION_DTYPE)
        else:
            fl_n = tl.minimum(offs_n, N - 1)[None, :].to(POSITION_DTYPE)
"""

TILE_SCORES = r"""
        # scores = Q Kᵀ for this tile, never written to memory.
        kt = tl.load(kt_base + offs_d[:, None] * {{stride("KT", -2)}} + offs_n[None, :] * {{stride("KT", -1)}},
                     mask=(offs_d[:, None] < D) & col_in_bounds, other=0.0, eviction_policy=KV_EVICTION)
        if UPCAST_DOT_OPERANDS:
            kt = kt.to(tl.float32)
        scores = tl.dot(q, kt, input_precision=DOT_PRECISION)

        # The user's pointwise chain from scores to logits (generated by Inductor from the user's graph).
        {{ modification(subgraph_number=CHAIN, output_name="logits", score="scores", fl_z="fl_z", fl_m="fl_m", fl_n="fl_n", input_shapes={"score": ("BLOCK_M", "BLOCK_N"), "fl_z": (), "fl_m": ("BLOCK_M", "1"), "fl_n": ("1", "BLOCK_N")}) | indent_except_first(2) }}
"""

N_LOOP = TILE_COLUMNS + TILE_SCORES + "        ACCUMULATE\n"

ONE_LOOP = N_LOOP.replace("START", "first_n").replace("END", "end_n").replace("CHAIN", "0")

# Tiles the mask leaves entirely visible (contiguous between full_lo and full_hi, found by the pre-pass) run the
# user's chain without its mask; the tiles the mask cuts through, on either side, run the whole chain in one more
# loop (one loop, not one per side: a loop costs a pipeline fill and drain, and compile time).
PARTIAL_TILES_HEADER = """partial_before = full_lo - first_n  # partial tiles before the visible ones, in columns
    for partial_n in tl.range(0, partial_before + (end_n - full_hi), BLOCK_N, num_stages=PARTIAL_STAGES):
        start_n = tl.where(partial_n < partial_before, first_n + partial_n, full_hi + (partial_n - partial_before))"""

SPLIT_LOOPS = (
    "# Entirely visible tiles: the chain without its mask (no per-element mask math).\n    "
    + N_LOOP.replace("START", "full_lo").replace("END", "full_hi").replace("CHAIN", "1")
    + "    # Tiles the mask cuts through, before and after the entirely visible ones: the whole chain.\n    "
    + N_LOOP.replace("for start_n in range(START, END, BLOCK_N):", PARTIAL_TILES_HEADER).replace("CHAIN", "0")
)

ATTENTION_TAIL = r"""
    OUTPUT_BATCH_INDEX
    idx_m = offs_m[:, None]
    idx_d = offs_dv[None, :]
    mask = row_in_bounds & (idx_d < DV)
    {{store_output((OUTPUT_INDEX_NAMES, "idx_m", "idx_d"), "acc", "mask", val_shape=("BLOCK_M", "DV_TILE"))}}
"""


def _attention_tail(output_batch: tuple[int, ...]) -> str:
    """The store of the output tile: out_z split into the output's batch dims (one dim: out_z itself)."""
    lines = []
    for dim, size in enumerate(output_batch):
        inner = math.prod(output_batch[dim + 1 :])
        index = "out_z" if inner == 1 else f"out_z // {inner}"
        lines.append(f"idx_b{dim} = {index}" if dim == 0 else f"idx_b{dim} = ({index}) % {size}")
    names = ", ".join(f'"idx_b{dim}"' for dim in range(len(output_batch)))
    return ATTENTION_TAIL.replace("OUTPUT_BATCH_INDEX", "\n    ".join(lines)).replace("OUTPUT_INDEX_NAMES", names)


SOFTMAX_STATE = """m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of the logits (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_M, DV_TILE], tl.float32)  # running sum of exp2(logit - m_i) * V"""

SINK_STATE = """sink_base = SINK + BATCH_OFFSET_SINK
    # The sink is one more column of every row's softmax that meets no V: the running state starts from it.
    m_i = tl.load(sink_base + offs_m * {{stride("SINK", -2)}}, mask=offs_m < M, other=0.0).to(tl.float32) * (SINK_SCALE / RUNNING_MAX_UNIT)
    l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)  # exp2(sink - m_i)
    acc = tl.zeros([BLOCK_M, DV_TILE], tl.float32)  # running sum of exp2(logit - m_i) * V"""

SOFTMAX_UPDATE = """if EVEN_N:
            logits = logits.to(tl.float32)
        else:
            logits = tl.where(col_in_bounds, logits.to(tl.float32), float("-inf"))

        # Online softmax in the log2 domain (LOGIT_SCALE: log2(e) times the chain's folded constant scale, > 0, so
        # it commutes with the max): new running max; alpha rescales everything accumulated under the old max.
        RUNNING_MAX_AND_P
        l_i = l_i * alpha + tl.sum(p, 1)"""

PV_UPDATE = """acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new"""

SOFTMAX_ACCUMULATE = SOFTMAX_UPDATE + """

        # acc = alpha * acc + P V (the sum over N of the unnormalised probabilities times V).
        LOAD_V
        """ + PV_UPDATE

RUNNING_MAX_AND_P = """m_new = tl.maximum(m_i, tl.max(logits, 1) * LOGIT_SCALE)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows masked so far: keep exp2 finite
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(logits * LOGIT_SCALE - m_shift[:, None])  # one fma per logit"""

# Logits that may come near ±FLT_MAX (an additive finfo.min mask, a bias read from memory, nan_to_num of infinite
# scores) break the fma above: m·LOGIT_SCALE overflows, or rounds by up to 2^103, which exp2 turns into inf or 0 for
# the row's largest logits (0/0 where eager gives the mean of V). Such kernels keep the running max in the logits' own
# units and pick a scale per row: LOGIT_SCALE, or for a row whose scaled max reaches 2^30, TINY_LOGIT_SCALE, the
# largest power of two at most LOGIT_SCALE, by which m scales exactly. Floats that far out are more than 64/LOGIT_SCALE
# apart, so the row's logits differ from its max by 0 or by more than exp2 can weigh at either scale: 1 or 0, as in
# eager. (Below 2^30 the fma's rounding of m·LOGIT_SCALE is at most 2^6, a factor common to the row's terms.) Still
# one fma per logit; the extra work is per row.
RUNNING_MAX_AND_P_WIDE = """m_new = tl.maximum(m_i, tl.max(logits, 1))  # in the logits' own units
        m_known = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows masked so far: keep exp2 finite
        row_scale = tl.where(tl.abs(m_known * LOGIT_SCALE) < 1073741824.0, LOGIT_SCALE, TINY_LOGIT_SCALE)  # 2^30
        alpha = tl.exp2((m_i - m_known) * LOGIT_SCALE)
        p = tl.exp2(logits * row_scale[:, None] - (m_known * row_scale)[:, None])  # one fma per logit"""

SOFTMAX_FINISH = """# Normalise once, after the loop (a row whose logits were all -inf gives 0/0 = NaN, as eager does).
    acc = acc / l_i[:, None]"""

# Training: the rows' log-sum-exp in log2 units, m + log2(l), saved for the backward (-inf + -inf = -inf for a row
# whose logits were all -inf).
LSE_STORE = """
    tl.store(LSE + out_z * {{stride("LSE", 0)}} + offs_m * {{stride("LSE", 1)}}, m_i + tl.log2(l_i), mask=offs_m < M)"""

# With logits that may come near -FLT_MAX, the row max (the logits' units) and the sum apart (``ops.py``).
ROW_STATISTICS_STORE = """
    row_statistics = LSE + out_z * {{stride("LSE", 0)}} + offs_m * {{stride("LSE", 2)}}
    tl.store(row_statistics, m_i, mask=offs_m < M)
    tl.store(row_statistics + {{stride("LSE", 1)}}, l_i, mask=offs_m < M)"""

# Speculation (fx_passes/finite_speculation.py): the loops ran a chain without its guards against NaN and infinity.
ROW_MET_NO_GUARD = """~((l_i > 0.0) & (l_i < float("inf")) & (tl.abs(m_i) < SPECULATION_MAX_BOUND))"""

SPECULATION_CHECK = """
    # The loops above ran the chain without its guards against NaN and infinity, which change no finite score. A row
    # whose running max stayed moderate and whose sum finite and positive met none (a -inf weighs 0 with or without
    # them); otherwise this row tile runs again with the whole chain.
    speculation_failed = ROW_MET_NO_GUARD
    if tl.max(speculation_failed.to(tl.int32), 0) > 0:
        STATE
        EXACT_LOOP"""


def _exact_loop(exact_subgraph: int, shared_heads: int = 0) -> str:
    """The loop over the row tile's columns that runs the whole chain (``exact_subgraph``), in the logits' own units
    (the guards' ±FLT_MAX must not overflow once scaled). It is not pipelined: it rarely runs, and its stages'
    buffers would cost the fast loops shared memory."""
    exact_loop = N_LOOP.replace("range(START, END, BLOCK_N)", "tl.range(first_n, end_n, BLOCK_N, num_stages=1)")
    exact_loop = exact_loop.replace("CHAIN", str(exact_subgraph))
    if shared_heads:
        exact_loop = _shared_tiles(exact_loop, shared_heads, RUNNING_MAX_AND_P_WIDE)
    else:
        accumulate = SOFTMAX_ACCUMULATE.replace("LOAD_V", LOAD_V).replace("RUNNING_MAX_AND_P", RUNNING_MAX_AND_P_WIDE)
        exact_loop = exact_loop.replace("ACCUMULATE", accumulate)
    return exact_loop.replace("LOGIT_SCALE", "EXACT_LOGIT_SCALE")


def _speculation_check(exact_subgraph: int, shared_heads: int = 0) -> str:
    """The check after the loops, and the loop over the same tiles that runs the whole chain from a fresh state.
    With ``shared_heads``, for the heads of a shared pass (``SHARED_V_INTRO``): a row tile any of them failed runs
    again for all of them."""
    exact_loop = _exact_loop(exact_subgraph, shared_heads)
    states = [_for_head(SOFTMAX_STATE, g) for g in range(shared_heads)] or [SOFTMAX_STATE]
    row_checks = [_for_head(ROW_MET_NO_GUARD, g) for g in range(shared_heads)] or [ROW_MET_NO_GUARD]
    state = "\n    ".join(states)
    check = SPECULATION_CHECK.replace("ROW_MET_NO_GUARD", " | ".join(row_checks))
    return check.replace("STATE", _deeper(state)).replace("EXACT_LOOP", _deeper(exact_loop))


def _deeper(source: str, first_line: bool = False) -> str:
    """``source`` placed one block deeper: four more spaces on each line (blank lines stay blank), the first only
    with ``first_line`` (else it continues a line of the template), and its Inductor-generated code
    (``indent_except_first``) one level deeper too."""
    lines = source.split("\n")
    lines = [line if not line or (index == 0 and not first_line) else "    " + line for index, line in enumerate(lines)]
    return re.sub(r"indent_except_first\((\d)\)", lambda level: f"indent_except_first({int(level[1]) + 1})", "\n".join(lines))


# A pair reduction (IPA's Σ_j a_ij z_ij) is linear in the probabilities like P·V: same rescaling, same normaliser.
PAIR_STATE = """
    pair_base = PAIR + BATCH_OFFSET_PAIR
    offs_c = tl.arange(0, C_TILE)
    pair_acc = tl.zeros([BLOCK_M, C_TILE], tl.float32)  # running sum of exp2(logit - m_i) * y, y the per-pair tensor"""

PAIR_ACCUMULATE = """# pair_acc = alpha * pair_acc + sum over the tile's columns of p[m, n] * y[m, n, :].
        y = tl.load(pair_base + offs_m[:, None, None] * {{stride("PAIR", -3)}} + offs_n[None, :, None] * {{stride("PAIR", -2)}}
                    + offs_c[None, None, :] * {{stride("PAIR", -1)}},
                    mask=row_in_bounds[:, :, None] & (offs_n[None, :, None] < N) & (offs_c[None, None, :] < C), other=0.0)
        pair_acc = pair_acc * alpha[:, None] + tl.sum(p[:, :, None] * y.to(tl.float32), 1)

        """

PAIR_FINISH = """
    pair_acc = pair_acc / l_i[:, None]
    tl.store(PAIR_OUT + out_z * {{stride("PAIR_OUT", 0)}} + offs_m[:, None] * {{stride("PAIR_OUT", 1)}}
             + offs_c[None, :] * {{stride("PAIR_OUT", 2)}},
             pair_acc.to(PAIR_OUT.dtype.element_ty), mask=row_in_bounds & (offs_c[None, :] < C))"""

# No softmax (sigmoid attention, (A·B)·C): the chain's output weighs V directly; nothing to rescale or normalise.
LINEAR_STATE = """acc = tl.zeros([BLOCK_M, DV_TILE], tl.float32)  # running sum of chain(scores) * V"""

LINEAR_ACCUMULATE = """# acc += P V, with P the chain's output (columns past N weigh nothing).
        if EVEN_N:
            p = logits
        else:
            p = tl.where(col_in_bounds, logits, 0.0)
        LOAD_V
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)"""

LINEAR_FINISH = "# No normaliser: the sum over N is the result."

V_TILE = """v = tl.load(v_base + offs_n[:, None] * {{stride("V", -2)}} + offs_dv[None, :] * {{stride("V", -1)}},
                    mask=(offs_n[:, None] < N) & (offs_dv[None, :] < DV), other=0.0, eviction_policy=KV_EVICTION)"""

LOAD_V = V_TILE + """
        if UPCAST_DOT_OPERANDS:
            p = p.to(PROBABILITY_DTYPE).to(tl.float32)
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)"""


def _batch_offset(name: str, rank: int) -> str:
    """Template code for the offset of batch entry fl_z in an operand with ``rank`` batch dims (row-major)."""
    terms, inner = [], []
    for dim in reversed(range(rank)):
        size, stride = f'{{{{size("{name}", {dim})}}}}', f'{{{{stride("{name}", {dim})}}}}'
        index = f"(fl_z // ({' * '.join(inner)}))" if inner else "fl_z"
        terms.append(f"({index} % {size}) * {stride}" if dim > 0 else f"{index} * {stride}")
        inner.append(size)
    return " + ".join(reversed(terms)) or "0"


ALL_TILES = "first_n, end_n = 0, N"

# Block skipping: a pre-pass over the column tiles finds the first and last one the position mask leaves
# visible; the main loop runs over that range only. The pre-pass tests SCAN_TILES tiles at once (vectors of tile
# bounds), so at long sequences it costs a few vector steps, not one scalar step per tile.
VISIBLE_TILES = """# Block skipping: tiles whose every element the mask sets to -inf contribute nothing; visit only the
    # range between the first and the last tile that is not entirely masked.
    m_lo = start_m
    m_hi = tl.minimum(start_m + BLOCK_M, M) - 1
    first_n = tl.zeros([], tl.int32) + N
    end_n = tl.zeros([], tl.int32)SCAN_STATE
    for scan_n in range(0, N, BLOCK_N * SCAN_TILES):
        n_lo = scan_n + tl.arange(0, SCAN_TILES) * BLOCK_N  # SCAN_TILES tiles' column ranges [n_lo, n_hi]
        n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1COLUMN_TESTS
        masked = (FULLY_MASKED)SUMMARY_MASKED | (n_lo >= N)
        first_n = tl.minimum(first_n, tl.min(tl.where(masked, N, n_lo), 0))
        end_n = tl.maximum(end_n, tl.max(tl.where(masked, 0, n_lo + BLOCK_N), 0))"""

# A mask that keeps a logit only where a per-row id equals a per-column id (document masking) cannot be bounded
# from positions: the pre-pass reads the ids (a block-level summary computed at run time, with the user's own
# indexing, generated by Inductor from the chain) and skips column tiles whose ids the row tile does not have.
ROW_ID_RANGE = """
    # The ids this program's rows keep span [row_id_lo, row_id_hi].
    {{ modification(subgraph_number=ROW_IDS, output_name="row_ids", score="scores", fl_z="fl_z", fl_m="fl_m", fl_n="0", input_shapes={"score": ("BLOCK_M", "1"), "fl_z": (), "fl_m": ("BLOCK_M", "1"), "fl_n": ()}) | indent_except_first(1) }}
    row_id_lo = tl.min(row_ids)
    row_id_hi = tl.max(row_ids)"""

COLUMN_ID_TEST = """
        # A column tile whose ids all lie outside [row_id_lo, row_id_hi] shares none with the rows: entirely masked.
        scan_cols = tl.minimum(n_lo[:, None] + tl.arange(0, BLOCK_N)[None, :], N - 1)
        {{ modification(subgraph_number=COLUMN_IDS, output_name="col_ids", score="scores", fl_z="fl_z", fl_m="0", fl_n="scan_cols", input_shapes={"score": ("SCAN_TILES", "BLOCK_N"), "fl_z": (), "fl_m": (), "fl_n": ("SCAN_TILES", "BLOCK_N")}) | indent_except_first(2) }}
        ids_disjoint = (tl.max(col_ids, 1) < row_id_lo) | (tl.min(col_ids, 1) > row_id_hi)"""


# A mask passed in as a tensor is summarised by the graph, once per call, into a table of cell states (0 none of a
# cell's elements masked, 1 some, 2 all; ``ops.TABLE_CELL``): the pre-pass reads the cells of each
# tile instead of the mask's elements.
TABLE_STATE = """
    # This program's rows lie in CELLS_M rows of the mask table, from first_row_cell.
    table_rows = (M + MASK_CELL - 1) // MASK_CELL
    table_columns = (N + MASK_CELL - 1) // MASK_CELL
    first_row_cell = m_lo // MASK_CELL"""

TABLE_TEST = """
        # Each column tile lies in CELLS_N columns of the table: the tile is entirely masked when all its cells are.
        col_cells = tl.minimum(n_lo[:, None] // MASK_CELL + tl.arange(0, CELLS_N)[None, :], table_columns - 1)
        table_lo = tl.full([SCAN_TILES], 2, tl.int32)
        table_hi = tl.zeros([SCAN_TILES], tl.int32)
        for row_cell in tl.static_range(CELLS_M):
            row_cells = tl.minimum(first_row_cell + row_cell, table_rows - 1)
            {{ modification(subgraph_number=MASK_TABLE, output_name="cell_states", score="scores", fl_z="fl_z", fl_m="row_cells", fl_n="col_cells", input_shapes={"score": ("SCAN_TILES", "CELLS_N"), "fl_z": (), "fl_m": (), "fl_n": ("SCAN_TILES", "CELLS_N")}) | indent_except_first(3) }}
            # (A table of one column has a constant index there: the load is a scalar.)
            cell_states = tl.broadcast_to(cell_states.to(tl.int32), [SCAN_TILES, CELLS_N])
            table_lo = tl.minimum(table_lo, tl.min(cell_states, 1))
            table_hi = tl.maximum(table_hi, tl.max(cell_states, 1))"""


def _skips_tiles(*tile_tests: object) -> bool:
    """Whether any of a chain's tile tests (position masks, visible tiles, id summaries, a mask table) is present:
    the kernel then decides per tile which to visit."""
    return any(test is not None for test in tile_tests)


def _tile_range(
    masked_tile_code: Optional[str], visible_tile_code: Optional[str], id_subgraphs: Optional[tuple[int, int]],
    table_subgraph: Optional[int] = None,
) -> str:
    """The code that sets [first_n, end_n) (and, with a visible-tile test, [full_lo, full_hi))."""
    if not _skips_tiles(masked_tile_code, visible_tile_code, id_subgraphs, table_subgraph):
        return ALL_TILES
    ids, table = id_subgraphs is not None, table_subgraph is not None
    tile_range = (
        VISIBLE_TILES.replace("FULLY_MASKED", masked_tile_code or "(n_lo < 0)")
        .replace(
            "SCAN_STATE",
            (ROW_ID_RANGE if ids else "") + (TABLE_STATE if table else "")
            + (VISIBLE_RANGE_STATE if visible_tile_code is not None else ""),
        )
        .replace("COLUMN_TESTS", (COLUMN_ID_TEST if ids else "") + (TABLE_TEST if table else ""))
        .replace("SUMMARY_MASKED", (" | ids_disjoint" if ids else "") + (" | (table_lo == 2)" if table else ""))
    )
    if ids:
        tile_range = tile_range.replace("ROW_IDS", str(id_subgraphs[0])).replace("COLUMN_IDS", str(id_subgraphs[1]))
    if table:
        tile_range = tile_range.replace("MASK_TABLE", str(table_subgraph))
    if visible_tile_code is not None:
        tile_range += VISIBLE_RANGE.replace("FULLY_VISIBLE", visible_tile_code)
    return tile_range


# With a visible-tile test the pre-pass also finds the entirely visible tiles; they get a loop of their own when
# they are contiguous (causal, windows, prefix-LM), otherwise the range is empty and every tile runs the whole chain.
VISIBLE_RANGE = """
        visible = ~masked & (FULLY_VISIBLE)
        full_lo = tl.minimum(full_lo, tl.min(tl.where(visible, n_lo, N), 0))
        full_hi = tl.maximum(full_hi, tl.max(tl.where(visible, n_lo + BLOCK_N, 0), 0))
        full_count += tl.sum(visible.to(tl.int32), 0)
    contiguous = (full_count > 0) & (full_count * BLOCK_N == full_hi - full_lo)
    full_lo = tl.where(contiguous, full_lo, first_n)
    full_hi = tl.where(contiguous, full_hi, first_n)"""

VISIBLE_RANGE_STATE = """
    full_lo = tl.zeros([], tl.int32) + N
    full_hi = tl.zeros([], tl.int32)
    full_count = tl.zeros([], tl.int32)"""


# Heads whose outputs the user combines linearly (DiffAttn's A0·V − λ·A1·V, distributed by
# fx_passes/head_combination.py), where their accumulators do not fit together for the shared pass below (head dim
# 128): one program runs the pass for each head of its group in turn (the group loop is
# unrolled) and adds the normalised result, times the head's coefficient, into a partial sum. Until the last head
# the partial sum waits in PARTIAL, rows this program alone writes and reads back, not in registers: held there
# through the next head's loop it doubled the live accumulators and spilled at head dim 128. It is rounded to the
# output dtype there, as the per-head outputs of the two-kernel form are; the per-head outputs never reach memory.
# (A loop that is not unrolled compiled faster but ran up to 16% slower at head dim 128 on the H100:
# benchmarks/results/h100_2026-11-23_diff_partial_sum/.)
GROUP_PARTIAL_TILE = """    partial_tile = PARTIAL + out_z * {{stride("PARTIAL", 0)}} + offs_m[:, None] * {{stride("PARTIAL", 1)}} + offs_dv[None, :] * {{stride("PARTIAL", 2)}}
    partial_in_bounds = row_in_bounds & (offs_dv[None, :] < DV)
"""

GROUP_LOOP = """    for group in GROUP_RANGE:
        fl_z = (out_z * GROUPS + group).to(POSITION_DTYPE)
ONE_HEAD
        acc = tl.load(COEF + group * {{stride("COEF", 0)}}).to(tl.float32) * acc
        if group > 0:
            # Every thread of the program sees the partial sum the others stored.
            tl.debug_barrier()
            acc += tl.load(partial_tile, mask=partial_in_bounds, other=0.0).to(tl.float32)
        if group < GROUPS - 1:
            tl.store(partial_tile, acc.to(PARTIAL.dtype.element_ty), mask=partial_in_bounds)
"""

# Speculation for heads that run in turn: each head's fast loops only note whether a row failed; if any did, every
# head of the group runs again with the whole chain after the unrolled loop, in a loop over the heads that is not
# unrolled: one copy of the exact loop, not one per head. For DiffAttn's causal kernel at head dim 128 on the H100
# host, ptxas took 1.7 s instead of 2.3 s and LLVM's optimiser 1.5 s instead of 1.0 s; the first call's compile
# time and the kernel's speed stayed level (benchmarks/results/h100_2026-11-24_exact_redo/).
GROUP_SPECULATION_FLAG = f"""
    any_speculation_failed = tl.maximum(any_speculation_failed, tl.max(({ROW_MET_NO_GUARD}).to(tl.int32), 0))"""

GROUP_EXACT_REDO = """    if any_speculation_failed > 0:
        # A row of some head met a guard of the chain (a NaN or infinite score): all heads again, whole chain.
EXACT_GROUP_LOOP"""


def _grouped_heads(one_head: str, exact_head: Optional[str]) -> str:
    """The heads of a group in turn (``GROUP_LOOP`` unrolled), each ``one_head``; with ``exact_head`` (speculation),
    followed by their exact redo."""
    unrolled = GROUP_LOOP.replace("GROUP_RANGE", "tl.static_range(GROUPS)").replace("ONE_HEAD", _deeper(one_head, first_line=True))
    if exact_head is None:
        return GROUP_PARTIAL_TILE + unrolled
    # Its own name for the head index: the unrolled loop's is a constexpr, which a branch may not rebind to a tensor.
    redo = re.sub(r"\bgroup\b", "redo_group", GROUP_LOOP).replace("GROUP_RANGE", "range(GROUPS)")
    redo = redo.replace("ONE_HEAD", _deeper(exact_head, first_line=True))
    return (GROUP_PARTIAL_TILE + "    any_speculation_failed = tl.zeros([], tl.int32)\n" + unrolled
            + GROUP_EXACT_REDO.replace("EXACT_GROUP_LOOP", _deeper(redo, first_line=True)))


# Heads of a group that also read one V (DiffAttn's pair: heads 2i and 2i+1 both read V's head i) can share a single
# pass over the column tiles instead: each V tile is loaded once and meets every head's probabilities. Each head keeps
# its own Q tile, running max, sum and accumulator, so GROUPS accumulators are live at once; the lowering picks this
# only where they fit in registers. No partial sum, one pipeline fill, and the combination is in float32.
SHARED_V_INTRO = """    # All GROUPS heads of this program's group in one pass over the column tiles: V's offset is the same for each
    # (its head-in-group dim has stride 0), so every V tile is loaded once for all of their accumulators.
"""

SHARED_V_LOOP = """    # One V tile for every head of the group.
        V_TILE
        if UPCAST_DOT_OPERANDS:
            v = v.to(tl.float32)
"""

P_CAST = """if UPCAST_DOT_OPERANDS:
            p = p.to(PROBABILITY_DTYPE).to(tl.float32)
        else:
            p = p.to(v.dtype)
        """

# The per-head names of the pass; the shared pass gives each head its own copy, suffixed by its index in the group.
HEAD_STATE_NAMES = (
    "fl_z", "q_base", "kt_base", "q", "kt", "scores", "logits", "m_i", "l_i", "acc", "m_new", "m_shift", "m_known",
    "row_scale", "alpha", "p",
)
_HEAD_STATE_NAME = re.compile(r"\b(" + "|".join(HEAD_STATE_NAMES) + r")\b(?!=[^=]|\":)")
_COMMENT = re.compile(r"(^\s*#.*$)|(\s+# .*$)")


def _for_head(source: str, group: int) -> str:
    """``source`` for head ``group`` of the shared pass: its per-head names suffixed (not the keywords and keys of a
    modification site, ``fl_z=`` and ``"fl_z":``); the first head keeps the comments, the others drop them."""
    lines = []
    for line in source.split("\n"):
        code, comment = line, ""
        found = _COMMENT.search(line)
        if found is not None:
            code, comment = line[: found.start()], line[found.start():]
        if group > 0 and comment and not code.strip():
            continue
        lines.append(_HEAD_STATE_NAME.sub(lambda name: f"{name[1]}{group}", code) + (comment if group == 0 else ""))
    return "\n".join(lines)


def _shared_tiles(loops: str, groups: int, running_max_and_p: str) -> str:
    """Single-head column loops (``N_LOOP``s with their ACCUMULATE site) doing each tile's work for every head of
    a shared pass: each head's scores, chain and softmax update, one V tile, each head's P·V."""
    update = "        " + SOFTMAX_UPDATE.replace("RUNNING_MAX_AND_P", running_max_and_p)

    def tile_work(found: "re.Match[str]") -> str:
        chain = TILE_SCORES.replace("CHAIN", found[1])
        scores = "".join(_for_head(chain + update + "\n", g) for g in range(groups))
        shared_v = "\n    " + SHARED_V_LOOP.replace("V_TILE", V_TILE)
        return scores + shared_v + "".join("        " + _for_head(P_CAST + PV_UPDATE, g) + "\n" for g in range(groups))

    site = re.escape(TILE_SCORES).replace("CHAIN", r"(\d+)") + re.escape("        ACCUMULATE\n")
    return re.sub(site, tile_work, loops)


def _shared_v_heads(groups: int, state: str, running_max_and_p: str, offsets: Any, tile_range: str, loops: str) -> str:
    """The shared pass over the column tiles for the ``groups`` heads of one group (``SHARED_V_INTRO``), leaving
    their combination, Σ_g COEF[g]·acc_g, in acc. ``offsets`` puts the operands' batch offsets into a source;
    ``tile_range`` and ``loops`` are the single-head pass's (its speculation check already shared)."""
    operands = offsets(Q_AND_KT_BASES + Q_TILE)
    heads = range(groups)
    head_z = "    fl_z = (out_z * GROUPS + {g}).to(POSITION_DTYPE)\n"
    setup = "\n".join(_for_head(head_z.format(g=g) + operands + "\n    " + state + "\n", g) for g in heads)
    v_base = "\n" + _for_head(offsets(V_BASE), 0)
    loop = "    " + tile_range + "\n    " + _shared_tiles(loops, groups, running_max_and_p)
    finish = "".join("    " + _for_head(SOFTMAX_FINISH, g).strip() + "\n" for g in heads)
    coefficient = 'tl.load(COEF + {g} * {{{{stride("COEF", 0)}}}}).to(tl.float32)'
    combination = "    # The group's combination, in registers.\n" + "".join(
        f"    acc {'=' if g == 0 else '+='} {coefficient.format(g=g)} * acc{g}\n" for g in heads
    )
    return SHARED_V_INTRO + setup + v_base + loop + "\n" + finish + combination


@functools.lru_cache(maxsize=None)
def online_softmax_attention_template(
    batch_ranks: tuple[int, ...],
    masked_tile_code: Optional[str],
    softmax: bool = True,
    groups: int = 1,
    visible_tile_code: Optional[str] = None,
    pair_rank: Optional[int] = None,
    output_batch: tuple[int, ...] = (0,),
    id_subgraphs: Optional[tuple[int, int]] = None,
    table_subgraph: Optional[int] = None,
    wide_logits: bool = False,
    exact_subgraph: Optional[int] = None,
    shared_v: bool = False,
    stores_lse: bool = False,
) -> TritonTemplate:
    """The kernel template for operands with the given numbers of batch dims (q, kᵀ, v and, if there is a fourth,
    the sink), position mask (tests for entirely masked and entirely visible tiles), normalisation (softmax, or
    none), head groups (1: no combination), pair reduction (the per-pair tensor's batch dims, or None), output
    batch dims (their sizes; one dim, of any size, for a flattened batch), id-equality mask (the subgraphs of
    its row and column ids, or None), mask tensor (the subgraph of its cell states, or None) and whether logits
    may come near -FLT_MAX (``RUNNING_MAX_AND_P_WIDE``), and the subgraph of the whole chain when the loops run
    it without its finite guards (``SPECULATION_CHECK``), or None; ``shared_v``: the heads of a group share one
    pass (``SHARED_V_INTRO``; a softmax with no sink, pair reduction, id mask or mask table); ``stores_lse``: the
    kernel also writes the rows' log-sum-exp (``LSE_STORE``, training; one head, a softmax in the log2 domain)."""
    names = ["Q", "KT", "V", "SINK"][: len(batch_ranks)] + (["COEF"] if groups > 1 else [])
    names += ["PARTIAL"] if groups > 1 and not shared_v else []
    if not softmax:
        state, accumulate, finish = LINEAR_STATE, LINEAR_ACCUMULATE, LINEAR_FINISH
    else:
        state, accumulate, finish = SINK_STATE if "SINK" in names else SOFTMAX_STATE, SOFTMAX_ACCUMULATE, SOFTMAX_FINISH
    if pair_rank is not None:
        names += ["PAIR", "PAIR_OUT"]
        batch_ranks = (*batch_ranks, pair_rank)
        state, finish = state + PAIR_STATE, finish + PAIR_FINISH
        accumulate = accumulate.replace("# acc = alpha * acc + P V", PAIR_ACCUMULATE + "# acc = alpha * acc + P V")
    if stores_lse:
        assert softmax and groups == 1 and pair_rank is None and exact_subgraph is None
        names += ["LSE"]
        finish = (ROW_STATISTICS_STORE if wide_logits else LSE_STORE) + "\n    " + finish
    tile_range = _tile_range(masked_tile_code, visible_tile_code, id_subgraphs, table_subgraph)
    loops = ONE_LOOP if visible_tile_code is None else SPLIT_LOOPS
    heads_in_turn = groups > 1 and not shared_v
    if exact_subgraph is not None:
        if heads_in_turn:
            loops += GROUP_SPECULATION_FLAG
        else:
            loops += _speculation_check(exact_subgraph, shared_heads=groups if shared_v else 0)
    running_max_and_p = RUNNING_MAX_AND_P_WIDE if wide_logits else RUNNING_MAX_AND_P

    def with_offsets(source: str) -> str:
        for name, rank in zip(names, batch_ranks):
            source = source.replace(f"BATCH_OFFSET_{name}\n", f"{_batch_offset(name, rank)}\n")
        return source

    if shared_v:
        assert softmax and groups > 1 and id_subgraphs is None and table_subgraph is None and pair_rank is None
        assert "SINK" not in names
        heads = _shared_v_heads(groups, state, running_max_and_p, with_offsets, tile_range, loops)
    else:
        def head_with(head_loops: str) -> str:
            return with_offsets(
                ONE_HEAD.replace("N_LOOPS", head_loops)
                .replace("ROW_STATE", state)
                .replace("ACCUMULATE", accumulate.replace("LOAD_V", LOAD_V))
                .replace("RUNNING_MAX_AND_P", running_max_and_p)
                .replace("FINISH", finish)
                .replace("TILE_RANGE", tile_range)
            )

        if groups == 1:
            heads = "    fl_z = out_z.to(POSITION_DTYPE)\n" + head_with(loops)
        else:
            exact_head = head_with(_exact_loop(exact_subgraph)) if exact_subgraph is not None else None
            heads = _grouped_heads(head_with(loops), exact_head)
    source = ATTENTION_HEAD.replace("INPUT_NAMES", ", ".join(f'"{name}"' for name in names)) + heads + _attention_tail(output_batch)
    return _template_of(source)


@functools.lru_cache(maxsize=None)
def _template_of(source: str) -> TritonTemplate:
    """One template per kernel source: keys that render alike share it (Inductor refuses two of one name)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:10]
    return TritonTemplate(name=f"flashlight_attention_{digest}", grid=_grid, source=source)


def _score_sized_bytes(captured: Sequence[Any], m: Any, n: Any) -> int:
    """Bytes per score element of the captured tensors the chain reads at every (m, n): a [.., M, N] mask or bias
    (not broadcast over rows or columns)."""
    total = 0
    for tensor in captured:
        size, stride = tensor.get_size(), tensor.get_stride()
        full = len(size) >= 2 and all(
            V.graph.sizevars.statically_known_equals(size[dim], extent) and stride[dim] != 0
            for dim, extent in ((-2, m), (-1, n))
        )
        total += tensor.get_dtype().itemsize if full else 0
    return total


def _size_for_chain(size: Any, score_size: Sequence[Any]) -> Any:
    """A size the score chain computes with: symbolic when it is one of the scores' dims, else specialised."""
    if any(V.graph.sizevars.statically_known_equals(size, dim) for dim in score_size):
        return size
    return V.graph.sizevars.guard_int(size)


def _divides(block: int, size: Any) -> bool:
    """Whether ``size`` is statically a multiple of ``block`` (no ragged tile; False when unknown)."""
    return V.graph.sizevars.statically_known_true(sympy.Eq(sympy.Mod(size, block), 0))


def _tile(dim: int) -> int:
    return max(16, 1 << (dim - 1).bit_length())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# A pair reduction holds a [BLOCK_M, BLOCK_N, C] tile of the per-pair tensor: the first tile keeping it near 128
# fp32 registers per thread (BLOCK_M·BLOCK_N·C ≤ 4096·warps) is the one config. On the H100, autotuning among
# several of these configs ended in an illegal memory access during Inductor's benchmarking of the choices (not yet
# understood), while each config alone compiles and matches float32 (benchmarks/results/h100_2026-11-22_ipa/);
# one config means no benchmarking step. (32, 16) was the fastest at S 768, C 32.
PAIR_TILES = [(32, 16, 4, 2), (16, 16, 8, 2)]

H100_SHARED_MEMORY_BYTES = 232448


def _shared_memory_bytes(device: torch.device) -> int:
    """Shared memory one program may use (the H100's when no GPU is present, as in the CPU tests)."""
    if not torch.cuda.is_available():
        return H100_SHARED_MEMORY_BYTES
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _fitting_stages(config: tuple[int, int, int, int], d: int, dv: int, element_bytes: int, shared_bytes: int) -> tuple[int, int, int, int]:
    """The config with its pipeline stages cut until its shared memory fits: each stage holds a K and a V tile
    (16-bit) and the score-sized tensors' tiles the chain reads (``element_bytes`` per score), beside the Q tile."""
    m, n, warps, stages = config
    while stages > 1 and stages * n * (2 * (d + dv) + m * element_bytes) + 2 * m * d > shared_bytes:
        stages -= 1
    return m, n, warps, stages


def kernel_configs(
    d: int, dv: int, device: torch.device, pair_channels: int = 0, element_bytes: int = 0,
    columns: int = 0, visible_loop: bool = False, mask_table: bool = False, shared_v_heads: int = 1,
    gathers: bool = False, chain_weight: str = "heavy", id_mask: bool = False,
) -> list[dict[str, int]]:
    """Tile sizes to autotune over (BLOCK_M, BLOCK_N, warps, stages), pruned by the head dims (QK, V), by the
    channels of a pair reduction, and by the shared memory left beside the tiles of score-sized tensors the chain
    reads (``element_bytes`` per score: a mask or a bias, whose loads are pipelined too) and by the row length
    (``columns``, N), by whether most tiles run in a loop without mask math (``visible_loop``) and whether a mask
    table decides which (``mask_table``), by the heads sharing one pass (``shared_v_heads``), and by whether the
    chain reads a tensor at an index it computes per logit (``gathers``: T5's distance table), and by the chain's
    per-logit work (``chain_weight``, ``attention_fusion.score_chain_weight``: none, arithmetic alone, or more; "heavy" for any
    chain that is masked, not 16-bit or not a softmax), and by whether a
    run-time summary of id masks decides the tiles (``id_mask``: document ids). The first is
    the one compiled alone outside max-autotune (``config.tile_autotuning``): the config that won most often for
    its case on the H100."""
    if device.type != "cuda" or _interpreting():
        return [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)]
    if pair_channels:
        fitting = [t for t in PAIR_TILES if t[0] * t[1] * _tile(pair_channels) <= 4096 * t[2]] or PAIR_TILES[-1:]
        m, n, w, s = fitting[0]
        return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)]
    # From H100 sweeps (bf16): benchmarks/results/h100_2026-11-22_tile_sweep (causal and soft-cap),
    # h100_2026-11-22_programs/sweep.txt and h100_2026-11-23_diff_partial_sum/sweep (DiffAttn's D/Dv = 64/128 and
    # 128/256, Evoformer), and the winners of autotuning in h100_2026-11-23_tile_autotuning.
    fewer_partial_stages = False
    if shared_v_heads > 1:
        # Heads sharing one pass (DiffAttn's pair at head dims 64/128) hold all their accumulators at once: 64 rows
        # (4 warps) over rows up to 1024, 128 rows (8 warps) over longer ones; each by 1-12% over the other
        # (h100_2026-11-24_shared_v/sweep.txt).
        shapes = [(64, 64, 4, 3), (128, 64, 8, 3)] if columns <= 1024 else [(128, 64, 8, 3), (64, 64, 4, 3)]
        d *= shared_v_heads  # each stage holds every head's K tile
    elif max(d, dv) <= 64:
        shapes = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 4, 3)]
        # Arithmetic per logit with no mask and no score-sized tensor (ALiBi) over rows longer than 1024: 128×128
        # (4 warps), 5–7% less time at 4×32×4096×64 in three processes, 4% at 1×16×16384×64. Plain attention (no
        # per-logit work) keeps 64×64: at 4×32×4096×64 it ran 8% faster in one process and 4% slower in another
        # (h100_2026-11-26_alibi_tiles/sweeps/light_sweep.txt, final/probe_vanilla_tiles.txt).
        if chain_weight == "light" and not (visible_loop or element_bytes) and columns > 1024:
            shapes.sort(key=lambda shape: shape != (128, 128, 4, 3))
    elif d <= 64 and dv <= 128:
        # DiffAttn's head pairs run in turn (the shared pass off or declined): four stages, by 4% at 32×32×512×64
        # and 4×32×4096×64 (h100_2026-11-24_causal_diff_warps/stages_sweep.txt).
        shapes = [(128, 64, 4, 4), (64, 64, 4, 3), (128, 128, 8, 3)]
        # DiffAttn under a causal mask (three column loops with the speculation fallback): 8 warps, by 12% at
        # 4×32×4096×64 and 44% at 32×32×512×64 (h100_2026-11-24_causal_diff_warps/).
        if visible_loop:
            shapes.insert(0, (128, 64, 8, 3))
    elif max(d, dv) <= 128:
        # A score-sized bias or mask read on every tile: over long rows 128×64 (8 warps) won by 9% over the
        # runner-up at 2×16×8192×128 (h100_2026-11-22_stages_and_scale/sweep_d128.txt); over short ones 32 columns,
        # with 64 rows at rows of 256 (Evoformer's pair bias: 3–5% less time than 128 rows in two sweeps,
        # h100_2026-11-22_evoformer_epilogue/sweep.txt and h100_2026-11-23_ncu_and_baselines/evoformer_sweep/).
        # Without one, 64×64 (soft-cap, and rows up to 1024).
        if element_bytes > 0:
            short = (64, 32, 4, 3) if columns <= 256 else (128, 32, 4, 3)
            shapes = [(128, 64, 8, 3) if columns > 1024 else short, (64, 64, 4, 3), (128, 128, 8, 3)]
        elif gathers:
            # A gather per logit (T5's bias from its distance table, DeBERTa's relative positions): 128×32 (4 warps), 1.40× and 1.47× less time
            # than 64×64 at 8×16×2048×128 and 16×16×1024×128 (h100_2026-11-25_distance_tables/sweeps/).
            shapes = [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)]
        else:
            shapes = [(64, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 3)]
            # No more than arithmetic per logit, no mask, over rows longer than 1024: 128×128 (8 warps); at 1×16×16384×128
            # plain attention 11%, GQA 8%, ALiBi 6% less time than 64×64, at 8×16×2048×128 0–3%
            # (h100_2026-11-26_alibi_tiles/sweeps/light_sweep.txt).
            if chain_weight != "heavy" and not visible_loop and columns > 1024:
                shapes.sort(key=lambda shape: shape != (128, 128, 8, 3))
        # Chains whose tiles mostly run the visible loop (causal-like masks, a mask tensor outside its partial
        # tiles) over rows longer than 1024 do best on 128×128 (8 warps), as plain attention does
        # (h100_2026-11-23_tile_autotuning/).
        # An id mask (document ids) leaves partial tiles along every boundary of its blocks, a share that grows with
        # the tile's side over the block's: 64×64 up to rows of 4096 (12% and 4.5% less time at 8×16×2048×128 and
        # 4×16×4096×128, level at 8192, 15% more at 16384; h100_2026-11-26_alibi_tiles/sweeps/mask_sweep.txt and
        # document_sweep.txt).
        if visible_loop and columns > (4096 if id_mask else 1024):
            shapes.sort(key=lambda shape: shape != (128, 128, 8, 3))
        # Under a mask table (h100_2026-11-23_additive_masks/sweeps): a mask tensor read per element on the partial
        # tiles keeps 128×128 (8 warps, 2 stages fit) at rows of 1024 too, by 25% over the runner-up there; a mask
        # computed in the chain (HF's decoder mask, key padding), with partial tiles on every padding edge, does
        # best on 128×64 (8 warps) over rows longer than 1024, by 1–9% over 128×128.
        if visible_loop and mask_table:
            best = (128, 128, 8, 3) if element_bytes > 0 else (128, 64, 8, 3) if columns > 1024 else (64, 64, 4, 3)
            shapes = [best, *[shape for shape in shapes if shape != best]]
            fewer_partial_stages = True
    else:
        shapes = [(128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2)]
    shared_bytes = _shared_memory_bytes(device)
    configs = [
        dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
        for m, n, w, s in (_fitting_stages(shape, d, dv, element_bytes, shared_bytes) for shape in shapes)
    ]
    if fewer_partial_stages:
        # Only the partial tiles' loop reads the mask: the visible loop keeps the stages that fit without it (Triton
        # reuses the shared memory between the two loops), the partial loop gets two. 128×128 with a mask tensor:
        # 13% and 7% less time at 8×16×2048×128 and 16×16×1024×128 than 2 stages throughout; a computed mask, 1–3%
        # (h100_2026-11-23_additive_masks/sweeps/partial_stages_*.txt).
        visible_stages = _fitting_stages(shapes[0], d, dv, 0, shared_bytes)[3]
        partial_stages = min(2, _fitting_stages(shapes[0], d, dv, element_bytes, shared_bytes)[3])
        configs[0] = dict(configs[0], num_stages=visible_stages, partial_stages=partial_stages)
    return configs


def _autotuned(configs: list[dict[str, int]]) -> list[dict[str, int]]:
    """The configs to autotune among: all of them, or the first alone (``config.tile_autotuning``)."""
    if overlay_config.tile_autotuning == "always" or inductor_config.max_autotune:
        return configs
    return configs[:1]


def causal_cell_states(sizes: Sequence[int], strides: Sequence[int], device: Any = "cpu") -> torch.Tensor:
    """The mask table of a causal mask (``ops.TABLE_CELL``): all masked above the diagonal, some
    on it, none below; int8 with the given sizes and strides."""
    rows, columns = torch.arange(sizes[-2])[:, None], torch.arange(sizes[-1])[None, :]
    states = (columns > rows).to(torch.int8) + (columns >= rows).to(torch.int8)
    table = torch.empty_strided(sizes, strides, dtype=torch.int8, device=device)
    written = table  # one copy per memory location: dims of stride 0 (broadcast) are written once
    for dim, stride in enumerate(strides):
        if stride == 0:
            written = written.narrow(dim, 0, 1)
    written.copy_(states.expand(written.shape))
    return table


def _causal_shaped_table(table: ir.Buffer) -> torch.Tensor:
    hints = V.graph.sizevars.size_hint
    return causal_cell_states([hints(s) for s in table.get_size()], [hints(s) for s in table.get_stride()], table.get_device())


class _ConstantIndexAsConstant(V.WrapperHandler):  # type: ignore[name-defined]
    """A position that is constant over the tile (a size-1 dim) becomes a scalar constant: inside a template,
    Inductor would otherwise give a symbol-free index expression the shape of the template's own x range."""

    def index_expr(self, expr: Any, dtype: torch.dtype) -> Any:
        if not sympy.sympify(expr).free_symbols:
            return self._inner.constant(int(expr), dtype)
        return self._inner.index_expr(expr, dtype)


def _score_index(batch_shape: Sequence[Any], m: Any, n: Any) -> list[Any]:
    """The score tensor's index at the tile's positions: the flattened batch entry split back into batch dims."""
    z, rows, cols = (
        ops.indirect_indexing(ops.load(name, sympy.Integer(0)), size, check=False)
        for name, size in zip(TILE_POSITIONS, (math.prod(batch_shape), m, n))
    )
    index = []
    inner: Any = sympy.Integer(1)
    for size in reversed(batch_shape):
        index.append(ModularIndexing(z, inner, size))
        inner = inner * size
    return [*reversed(index), rows, cols]


def _unrolled_sum(x: Any, dims: Sequence[int], keepdim: bool = False) -> Any:
    """A small sum the fusion pass moved into the score chain (``_is_small_reduction``: a squared distance between
    points, say): per tile element, its few terms are loaded and added in turn, in float32."""
    size = x.get_size()
    reduced = sorted(d % len(size) for d in dims)
    counts = [V.graph.sizevars.guard_int(size[d]) for d in reduced]
    out_size = [1 if i in reduced else s for i, s in enumerate(size)] if keepdim else [
        s for i, s in enumerate(size) if i not in reduced
    ]
    load, dtype = x.make_loader(), x.get_dtype()

    def inner_fn(index: Sequence[Any]) -> Any:
        kept = [i for position, i in enumerate(index) if position not in reduced] if keepdim else list(index)
        total = None
        for term in itertools.product(*(range(count) for count in counts)):
            full = list(kept)
            for dim, position in zip(reduced, term):
                full.insert(dim, sympy.Integer(position))
            value = ops.to_dtype(load(full), torch.float32)
            total = value if total is None else ops.add(total, value)
        return ops.to_dtype(total, dtype)

    return ir.Pointwise.create(device=x.get_device(), dtype=dtype, inner_fn=inner_fn, ranges=out_size)


# The GPU's own tanh: one MUFU instruction, relative error at most 2^-11 by the PTX ISA (``tanh.approx.f32``; 9.9e-6
# measured on the H100, tools/measure_fast_tanh_error.py), where libdevice's tanhf takes two MUFU instructions and
# about twenty others per logit.
APPROXIMATE_TANH_ASM = "tanh.approx.f32 $0, $1;"


def approximates_tanh(device: torch.device) -> bool:
    """Whether the score chains on ``device`` take ``tanh.approx.f32`` where eager's tanh works at 16-bit precision
    (``config.fast_tanh``; see ``tanhs_of_16_bit_precision``)."""
    return overlay_config.fast_tanh and device.type == "cuda" and torch.version.hip is None


_16_BIT_FLOATS = (torch.float16, torch.bfloat16)
# Ops that change a value's relative error by at most one float32 rounding: a tanh reached from a 16-bit score
# through them sees, in eager, an argument that carries the score's 16-bit rounding.
_RELATIVE_ERROR_PRESERVING = {
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.div.Tensor,
    torch.ops.aten.neg.default,
}


def _scaled_from_16_bit_score(node: torch.fx.Node, score_dtype: torch.dtype) -> bool:
    """Whether ``node`` is the 16-bit score placeholder times or over finite non-zero constants (any casts between)."""
    while node.op == "call_function" and node.target in _RELATIVE_ERROR_PRESERVING:
        operand, *others = node.args
        if node.target is torch.ops.prims.convert_element_type.default:
            if not others[0].is_floating_point:
                return False
        elif not all(isinstance(c, (int, float)) and math.isfinite(c) and c != 0 for c in others):
            return False
        node = operand
    return node.op == "placeholder" and node.target == "scores" and score_dtype in _16_BIT_FLOATS


def tanhs_of_16_bit_precision(graph_module: torch.fx.GraphModule, score_dtype: torch.dtype) -> set[torch.fx.Node]:
    """The chain's tanh nodes whose eager result is only as precise as a 16-bit value, so that ``tanh.approx.f32``
    (relative error at most 2^-11 by the PTX ISA) adds no error of a new order:

    * a 16-bit tanh: eager rounds its result to 16 bits (bf16: relative 2^-9, fp16: 2^-11);
    * a float32 tanh of the 16-bit score (an fp16/bf16 ``q @ kᵀ``) upcast and scaled by constants (Gemma-2's
      ``50 * tanh(scores.float() / 50)``): eager's argument carries the score's rounding (2^-9, 2^-11 relative),
      which moves tanh by as much relatively (its relative condition number ``2x / sinh(2x)`` is at most 1).

    A float32 tanh of anything else (float32 scores, an added bias) keeps libdevice's."""
    chosen = set()
    for node in graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.tanh.default):
        argument = node.args[0]
        if not isinstance(argument, torch.fx.Node):
            continue
        value = argument.meta.get("val")
        if (value is not None and value.dtype in _16_BIT_FLOATS) or _scaled_from_16_bit_score(argument, score_dtype):
            chosen.add(node)
    return chosen


def approximate_tanh(x: Any) -> Any:
    """tanh as ``tanh.approx.f32``, for the tanhs ``tanhs_of_16_bit_precision`` picks."""
    load = x.make_loader()

    def inner_fn(index: Sequence[Any]) -> Any:
        value = ops.to_dtype(load(index), torch.float32)
        return ops.inline_asm_elementwise(
            value, asm=APPROXIMATE_TANH_ASM, constraints="=r,r", dtype=torch.float32, is_pure=True, pack=1
        )

    # Kept in float32, as Inductor keeps its own 16-bit pointwise results (``codegen_upcast_to_fp32``).
    return ir.Pointwise.create(device=x.get_device(), dtype=x.get_dtype(), inner_fn=inner_fn, ranges=x.get_size())


def _computed_per_element(self: Any, users: int) -> None:
    """``StorageBox.mark_reuse`` inside the score chain: nothing is realised, the value is recomputed where read."""


class _ScoreChainLowering(PointwiseSubgraphLowering):
    """Inductor's pointwise subgraph lowering, with the tanhs in ``fast_tanhs`` lowered as ``tanh.approx.f32``."""

    def __init__(self, graph_module: torch.fx.GraphModule, fast_tanhs: set[torch.fx.Node], **kwargs: Any) -> None:
        super().__init__(graph_module, **kwargs)
        self.fast_tanhs = fast_tanhs

    def run_node(self, n: torch.fx.Node) -> Any:
        if n in self.fast_tanhs:
            return approximate_tanh(self.env[n.args[0]])
        return super().run_node(n)


def _power_of_two_below(scale: float) -> float:
    """The largest power of two at most ``scale`` (``RUNNING_MAX_AND_P_WIDE``'s TINY_LOGIT_SCALE)."""
    return 2.0 ** math.floor(math.log2(scale))


def _lower_score_chain(
    graph_module: torch.fx.GraphModule, score_dtype: torch.dtype, score_size: list[Any], device: torch.device,
    captured: list[Any], fast_tanh: bool = False,
) -> ir.ComputedBuffer:
    """Lower the user's chain with Inductor's pointwise lowerings, then read it at the tile's positions."""
    score = ir.TensorBox.create(
        ir.InputBuffer(
            name="score",
            layout=ir.FixedLayout(device, score_dtype, score_size, ir.FlexibleLayout.contiguous_strides(score_size)),
        )
    )
    lowering = _ScoreChainLowering(
        graph_module,
        tanhs_of_16_bit_precision(graph_module, score_dtype) if fast_tanh else set(),
        root_graph_lowering=V.graph,
        additional_lowerings={aten.sum.dim_IntList: _unrolled_sum},
    )
    # Every value of the chain is computed per tile element: a broadcast inside it (an ``expand``, or the
    # ``broadcast_tensors`` of an add of two values of different shapes: DeBERTa's gather index computed from
    # positions, Swin's position bias plus its window mask) must not realise its input, as Inductor does for a value
    # it expects to read many times; a pointwise subgraph cannot hold a buffer.
    with V.set_graph_handler(lowering), mock.patch.object(ir.StorageBox, "mark_reuse", _computed_per_element):
        lowering.run(score, *captured)
    outputs = lowering.graph_outputs
    logits = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    read_logits = logits.make_loader()
    batch_shape, (m, n) = score_size[:-2], score_size[-2:]

    def logits_at_tile(_: Any) -> Any:
        with V.set_ops_handler(_ConstantIndexAsConstant(V.ops)):
            return read_logits(_score_index(batch_shape, m, n))

    at_tile = ir.Pointwise(device=device, dtype=logits.get_dtype(), inner_fn=logits_at_tile, ranges=[])
    buffer = ir.ComputedBuffer(name=None, layout=ir.FlexibleLayout(device=device, dtype=logits.get_dtype(), size=[]), data=at_tile)
    buffer.freeze_layout()
    return buffer


@register_lowering(fused_ops.online_softmax_attention, type_promotion_kind=None)
def online_softmax_attention_lowering(q, kt, v, captured, sink, score_chain, decisions, group_coefficients=None, output_batch=None, sizes=()):
    chain = fused_ops.chain_from_arguments(score_chain, decisions)
    return _lower_attention(q, kt, v, captured, sink, chain, group_coefficients, output_batch=output_batch, sizes=sizes)


@register_lowering(fused_ops.online_softmax_attention_with_lse, type_promotion_kind=None)
def online_softmax_attention_with_lse_lowering(q, kt, v, captured, score_chain, decisions, output_batch=None, sizes=()):
    chain = fused_ops.chain_from_arguments(score_chain, decisions)
    return _lower_attention(q, kt, v, captured, None, chain, output_batch=output_batch, sizes=sizes, stores_lse=True)


@register_lowering(fused_ops.online_softmax_attention_with_pair_sum, type_promotion_kind=None)
def online_softmax_attention_with_pair_sum_lowering(q, kt, v, captured, sink, score_chain, decisions, pair_values, output_batch=None, sizes=()):
    chain = fused_ops.chain_from_arguments(score_chain, decisions)
    return _lower_attention(q, kt, v, captured, sink, chain, pair_values=pair_values, output_batch=output_batch, sizes=sizes)


def _shares_v_tile(chain: Any, groups: int, operands: Sequence[Any], dv: Any, plain_operands: bool) -> bool:
    """Whether the heads of a group can share one pass (``SHARED_V_INTRO``): a softmax with no sink or pair
    reduction whose tile range depends on positions only (no id mask or mask table), a V whose offset is the same for
    each head of a group (its innermost batch dim has stride 0 and spans whole groups), and accumulators that fit in
    registers."""
    if not (overlay_config.share_v_tile_in_head_groups and plain_operands and chain.softmax):
        return False
    if chain.id_graph_modules is not None or chain.mask_table_module is not None:
        return False  # the tile range would depend on the head's batch entry
    v = operands[2]
    batch_sizes, batch_strides = v.get_size()[:-2], v.get_stride()[:-2]
    if not batch_sizes or not V.graph.sizevars.statically_known_equals(batch_strides[-1], 0):
        return False
    if not _divides(groups, batch_sizes[-1]):
        return False
    dv_tile = _tile(V.graph.sizevars.guard_int(dv))
    return groups * dv_tile <= overlay_config.shared_v_max_accumulator_columns


def _with_fixed_layout(tensor: Any) -> Any:
    """A captured tensor realised with the layout the chain indexes it by. A view Inductor keeps over a buffer (BLOOM's
    positions, ``cumsum`` of a ``full`` of ones expanded per row, on the GPU) becomes that buffer read through its
    strides, or a copy."""
    tensor.realize()
    try:
        tensor.freeze_layout()
        return tensor
    except NotImplementedError:
        return ir.TensorBox(ir.ExternKernel.realize_input(tensor))


def score_problem(q, kt, v, captured, chain) -> tuple:
    """What every lowering of an attention node starts from: the device, the captured tensors realised with fixed
    layouts, the sizes (m, d, n, dv), the batch dims, their product z and the score tensor's size."""
    captured = [_with_fixed_layout(tensor) for tensor in captured]
    m, d = q.get_size()[-2:]
    n, dv = kt.get_size()[-1], v.get_size()[-1]
    batch_shape = [size.node.expr if isinstance(size, torch.SymInt) else size for size in chain.batch_shape]
    return q.get_device(), captured, (m, d, n, dv), batch_shape, sympy.Mul(*batch_shape), [*batch_shape, m, n]


def _lower_attention(q, kt, v, captured, sink, chain, group_coefficients=None, pair_values=None, output_batch=None, sizes=(), stores_lse=False):
    device, captured, (m, d, n, dv), batch_shape, z, score_size = score_problem(q, kt, v, captured, chain)
    chains = [chain.graph_module] + ([chain.unmasked_graph_module] if chain.unmasked_graph_module is not None else [])
    id_subgraphs = None
    if chain.id_graph_modules is not None:
        id_subgraphs = (len(chains), len(chains) + 1)
        chains += list(chain.id_graph_modules)
    # The chains' inputs after the scores: the tensors they read, then the sizes they compute with. A size that is
    # not a dim of the scores (the head dim in a 1/sqrt(D) scale) is specialised, as the head dims are: the chain
    # may use it as a scalar, which Inductor's template codegen would give a tile's shape.
    chain_inputs = [*captured, *(_size_for_chain(size, score_size) for size in sizes)]
    fast_tanh = approximates_tanh(device)
    subgraphs = [
        _lower_score_chain(module, chain.score_dtype, score_size, device, chain_inputs, fast_tanh) for module in chains
    ]
    table_subgraph = None
    if chain.mask_table_module is not None:
        table_subgraph = len(subgraphs)
        cells = [-(-V.graph.sizevars.guard_int(size) // fused_ops.TABLE_CELL) for size in (m, n)]
        subgraphs.append(_lower_score_chain(chain.mask_table_module, chain.score_dtype, [*batch_shape, *cells], device, chain_inputs))
    exact_subgraph, speculation = None, {}
    if chain.exact_graph_module is not None:
        exact_subgraph = len(subgraphs)
        subgraphs.append(_lower_score_chain(chain.exact_graph_module, chain.score_dtype, score_size, device, chain_inputs, fast_tanh))
        exact_scale = LOG2E * chain.exact_folded_scale
        speculation = dict(
            EXACT_LOGIT_SCALE=exact_scale,
            TINY_EXACT_LOGIT_SCALE=_power_of_two_below(exact_scale),
            # The bound in the running max's units: the fast chain's own with wide logits (the logits over the folded
            # scale), else log2 units (the logits times log2(e)).
            SPECULATION_MAX_BOUND=chain.speculation_bound / chain.folded_scale if chain.wide_logits
            else chain.speculation_bound * LOG2E,
        )
    # Realised as they are: the kernel reads any strides (no stride-1 copy, unlike ``realize_inputs``).
    operands = [ir.ExternKernel.realize_input(t) for t in (q, kt, v, sink) if t is not None]
    ranks = tuple(len(t.get_size()) - 2 for t in operands)
    groups, partial, shared_v = 1, None, False
    if group_coefficients is not None:
        groups = int(group_coefficients.get_size()[0])
        z = z // groups
        shared_v = _shares_v_tile(chain, groups, operands, dv, sink is None and pair_values is None)
        operands.append(ir.ExternKernel.realize_input(group_coefficients))
        if not shared_v:
            partial = empty_strided([z, m, dv], None, dtype=v.get_dtype(), device=device)
            operands.append(partial)
    channels, pair_out, pair_rank = 0, None, None
    if pair_values is not None:
        channels = V.graph.sizevars.guard_int(pair_values.get_size()[-1])
        pair_rank = len(pair_values.get_size()) - 3
        pair_out = empty_strided([z, m, channels], None, dtype=chain.pair_dtype, device=device)
        operands += [ir.ExternKernel.realize_input(pair_values), pair_out]
    lse_size = [z, 2, m] if chain.wide_logits else [z, m]
    lse = empty_strided(lse_size, None, dtype=torch.float32, device=device) if stores_lse else None
    if lse is not None:
        operands.append(lse)
    for tensor in operands:
        tensor.freeze_layout()
    q, kt, v = operands[:3]
    d, dv = V.graph.sizevars.guard_int(d), V.graph.sizevars.guard_int(dv)
    out_size = [*output_batch, m, dv] if output_batch is not None else [z, m, dv]
    layout = ir.FixedLayout(device, v.get_dtype(), out_size, ir.FlexibleLayout.contiguous_strides(out_size))
    fp32_dot = v.get_dtype() == torch.float32
    # Inductor sizes a template's index dtype by its named inputs and output only; the chain also indexes the
    # captured tensors, at positions the template computes.
    wide = not all(expr_fits_within_32bit(t.get_layout().storage_size()) for t in [*operands, *captured])
    visible_loop = chain.unmasked_graph_module is not None
    template_key = (
        ranks, chain.masked_tile_code, chain.softmax, groups, chain.visible_tile_code if visible_loop else None, pair_rank,
        tuple(output_batch) if output_batch is not None else (0,), id_subgraphs, table_subgraph, chain.wide_logits,
        exact_subgraph, shared_v, stores_lse,
    )
    logit_scale, sink_scale = LOG2E * chain.folded_scale, chain.sink_scale * LOG2E
    tiny_logit_scale = _power_of_two_below(logit_scale)
    choices: list[Any] = []
    element_bytes, columns = _score_sized_bytes(captured, m, n), V.graph.sizevars.size_hint(n)
    # A chain whose tiles a mask may skip keeps the tiles its mask's rules give it, however light its arithmetic.
    skips_tiles = _skips_tiles(chain.masked_tile_code, chain.visible_tile_code, id_subgraphs, table_subgraph)
    configs = kernel_configs(
        d, dv, device, channels, element_bytes=element_bytes, columns=columns, visible_loop=visible_loop,
        mask_table=chain.mask_table_module is not None, shared_v_heads=groups if shared_v else 1,
        gathers=chain.gathers,
        chain_weight=chain.chain_weight if chain.softmax and not fp32_dot and not skips_tiles else "heavy",
        id_mask=id_subgraphs is not None,
    )
    for config in _autotuned(configs):
        error = online_softmax_attention_template(*template_key).maybe_append_choice(
            choices,
            input_nodes=operands,
            layout=layout,
            subgraphs=subgraphs,
            mutated_inputs=[t for t in (partial, pair_out, lse) if t is not None] or None,
            call_sizes=[z, m, n],
            D=d,
            DV=dv,
            D_TILE=_tile(d),
            DV_TILE=_tile(dv),
            C=channels,
            C_TILE=_tile(channels) if channels else 0,
            LOGIT_SCALE=logit_scale,
            SINK_SCALE=sink_scale,
            TINY_LOGIT_SCALE=tiny_logit_scale,
            RUNNING_MAX_UNIT=logit_scale if chain.wide_logits else 1.0,
            GROUPS=groups,
            LAST_ROWS_FIRST=overlay_config.last_rows_first,
            BATCH_FASTEST=chain.batch_fastest,
            SCAN_TILES=64 if overlay_config.vector_tile_scan else 1,
            POSITION_DTYPE="tl.int64" if wide else "tl.int32",
            MASK_CELL=fused_ops.TABLE_CELL,
            CELLS_M=max(config["BLOCK_M"] // fused_ops.TABLE_CELL, 1),
            CELLS_N=max(config["BLOCK_N"] // fused_ops.TABLE_CELL, 1),
            DOT_PRECISION="'tf32'" if fp32_dot and torch.backends.cuda.matmul.allow_tf32 else "'ieee'",
            # Triton's interpreter multiplies 16-bit dot operands wrongly; it gets exact float32 ones instead.
            UPCAST_DOT_OPERANDS=_interpreting(),
            EVEN_M=_divides(config["BLOCK_M"], m),
            EVEN_N=_divides(config["BLOCK_N"], n),
            PROBABILITY_DTYPE=f"tl.{str(chain.probability_dtype).removeprefix('torch.')}",
            # The partial tiles' loop pipelines a score-sized mask's loads too: it may get fewer stages than the rest.
            PARTIAL_STAGES=config.get("partial_stages", config["num_stages"]),
            # K and V tiles are read again by every row tile of their head; a score-sized tensor the chain streams
            # through (a per-head bias, a mask) is read once: K and V get to stay in L2.
            KV_EVICTION="'evict_last'" if element_bytes > 0 else "''",
            **speculation,
            **{key: value for key, value in config.items() if key != "partial_stages"},
        )
        if error is not None:
            raise error
    inputs = [*operands, *captured]
    # Autotuning would time the kernel on random bytes for the mask table (a computed buffer), which skip nothing:
    # it gets a causal-shaped table instead, the common mask passed in.
    input_gen_fns = {len(inputs) - 1: _causal_shaped_table} if chain.mask_table_module is not None else None
    out = autotune_select_algorithm("flashlight_attention", choices, inputs, layout, input_gen_fns=input_gen_fns)
    if lse is not None:
        return out, lse
    return out if pair_out is None else (out, pair_out)
