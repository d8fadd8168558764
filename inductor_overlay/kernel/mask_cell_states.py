"""Lowering of ``ops.mask_cell_states_of`` to one Triton kernel: the table of an additive mask's cell states.

The attention kernel's pre-pass reads the table to skip tiles and to drop the add on tiles whose bias is all 0. The
bias is the user's own expression (HF's causal-and-padding mask, from a ``[B, N]`` padding vector), lowered by
Inductor at the ``modification`` site as the attention kernel's score chain is: it is computed tile by tile in
registers, once, and never written to memory. One program summarises one row of cells (TABLE_CELL rows) over all
columns. Inductor's own reductions over the same graph (three kernels) took 1.35–1.9 times longer on the H100
(``benchmarks/results/h100_2026-11-23_mask_cells/``). A mask read from memory keeps them
(``fx_passes/mask_tables._mask_table``): they run at memory speed there, and this kernel did not.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any, Optional

import torch
from torch._inductor import ir
from torch._inductor.lowering import empty_strided, lowerings, register_lowering
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate, autotune_select_algorithm
from torch._inductor.utils import expr_fits_within_32bit

from inductor_overlay.kernel.online_softmax_attention import _deeper, _lower_score_chain, _size_for_chain
from inductor_overlay import ops as fused_ops
from inductor_overlay.ops import CELL_KEEPS, CELL_MIXED, CELL_SKIPPED, TABLE_CELL, MaskSummary, cell_shape

aten = torch.ops.aten

# Columns of the mask evaluated at once (TABLE_CELL rows by this many), warps and pipeline stages of the column loop.
TILE = dict(BLOCK_N=256, num_warps=4, LOOP_STAGES=1)
# With the first-row path most blocks cost one row, so wider blocks mean fewer steps of the column loop: 512 columns
# took 17.3, 27.6 and 79.9 µs against 256's 17.2, 29.9 and 143.9 (HF's mask at 8×16×2048×128, 4×32×4096×64 and
# 1×16×16384×128 on the H100; 1024 columns or 8 warps were slower: h100_2026-11-24_row_invariant_table/).
ROW_INVARIANT_BLOCK_N = 512


@SymbolicGridFn
def _grid(z, row_cells, meta, *, cdiv):
    return (row_cells, z, 1)


# Every row of the block: the bias tile from the user's graph, each row's largest bias per cell, whether each cell is
# all 0. A NaN counts as +inf: its cell is never skipped (its row is NaN in eager anyway). Elements past M or N count
# as 0 and as -inf: the attention kernel masks them by bounds anyway.
ALL_ROWS = r"""
        {{ modification(subgraph_number=0, output_name="mask", score="fl_n", fl_z="fl_z", fl_m="fl_m", fl_n="fl_n", input_shapes={"score": ("ROW_TILE", "BLOCK_N"), "fl_z": (), "fl_m": ("ROW_TILE", "1"), "fl_n": ("1", "BLOCK_N")}) | indent_except_first(2) }}
        bias = mask.to(tl.float32)
        bias = tl.where(bias != bias, float("inf"), bias)
        if not (EVEN_M and EVEN_N):
            bias = tl.where(in_bounds, bias, float("-inf"))
        row_cell_max = tl.max(tl.reshape(bias, [ROW_TILE, BLOCK_N // CELL, CELL]), 2)
        zero = ((mask == 0) | ~in_bounds).to(tl.int32)
        all_zero = tl.min(tl.reshape(tl.min(zero, 0), [BLOCK_N // CELL, CELL]), 1)
"""

# Where the bias varies along the rows only through position formulas (``block_sparsity.row_position_formulas``),
# a block where each is constant holds the same bias on every row: it is computed and reduced on the block's first
# row alone. Only blocks the formulas' edges (the causal diagonal) cross take every row.
ROW_INVARIANT_BLOCKS = r"""
        m_lo, m_hi = row_cell * ROW_TILE, tl.minimum(row_cell * ROW_TILE + ROW_TILE, ROWS) - 1
        n_lo, n_hi = start_col, tl.minimum(start_col + BLOCK_N, COLUMNS) - 1
        if ROW_INVARIANT_WHEN:
            # Every row of this block holds the same bias: compute it on the first row alone.
            first_row = tl.full([1, 1], 0, POSITION_DTYPE) + m_lo.to(POSITION_DTYPE)
            {{ modification(subgraph_number=0, output_name="first_mask", score="fl_n", fl_z="fl_z", fl_m="first_row", fl_n="fl_n", input_shapes={"score": ("1", "BLOCK_N"), "fl_z": (), "fl_m": ("1", "1"), "fl_n": ("1", "BLOCK_N")}) | indent_except_first(3) }}
            first_bias = first_mask.to(tl.float32)
            first_bias = tl.where(first_bias != first_bias, float("inf"), first_bias)
            if not EVEN_N:
                first_bias = tl.where(col_in_bounds, first_bias, float("-inf"))
            first_cell_max = tl.max(tl.reshape(first_bias, [1, BLOCK_N // CELL, CELL]), 2)
            row_cell_max = tl.broadcast_to(first_cell_max, [ROW_TILE, BLOCK_N // CELL])
            first_zero = ((first_mask == 0) | ~col_in_bounds).to(tl.int32)
            all_zero = tl.min(tl.reshape(first_zero, [BLOCK_N // CELL, CELL]), 1)
        else:
ALL_ROWS_DEEPER"""

# A cell is skipped where each of its rows' largest bias over it lies ABSORBING_GAP below that row's largest bias over
# all columns, known only after the pass over the columns. The pass keeps each row's largest bias per cell
# (ROW_CELL_MAX) and whether each cell is all 0 (CELL_ZERO); the cells are decided after it.
MASK_CELLS = r"""
{{def_kernel("ROW_CELL_MAX", "CELL_ZERO")}}
    # This program summarises the rows [start_m, start_m + ROW_TILE) of mask entry fl_z: one row of cells.
    fl_z = tl.program_id(1).to(POSITION_DTYPE)
    row_cell = tl.program_id(0).to(INDEX_DTYPE)
    offs_m = row_cell * ROW_TILE + tl.arange(0, ROW_TILE)
    row_in_bounds = offs_m[:, None] < ROWS
    # Unclamped positions where no tile is ragged keep the bias's loads contiguous.
    if EVEN_M:
        fl_m = offs_m[:, None].to(POSITION_DTYPE)
    else:
        fl_m = tl.minimum(offs_m, ROWS - 1)[:, None].to(POSITION_DTYPE)
    row_max = tl.full([ROW_TILE], float("-inf"), tl.float32)
    scratch_rows = (fl_z * ROW_CELLS + row_cell) * ROW_TILE + tl.arange(0, ROW_TILE)[:, None]
    cells_of_rows = (fl_z * ROW_CELLS + row_cell) * COLUMN_CELLS
    for start_col in tl.range(0, COLUMNS, BLOCK_N, num_stages=LOOP_STAGES):
        offs_n = start_col + tl.arange(0, BLOCK_N)
        col_in_bounds = offs_n[None, :] < COLUMNS
        in_bounds = row_in_bounds & col_in_bounds
        if EVEN_N:
            fl_n = offs_n[None, :].to(POSITION_DTYPE)
        else:
            fl_n = tl.minimum(offs_n, COLUMNS - 1)[None, :].to(POSITION_DTYPE)
        offs_cell = start_col // CELL + tl.arange(0, BLOCK_N // CELL)
        cell_in_bounds = offs_cell < COLUMN_CELLS
ROW_BLOCKS
        row_max = tl.maximum(row_max, tl.max(row_cell_max, 1))
        tl.store(ROW_CELL_MAX + scratch_rows * COLUMN_CELLS + offs_cell[None, :], row_cell_max, mask=cell_in_bounds[None, :])
        tl.store(CELL_ZERO + cells_of_rows + offs_cell, all_zero.to(tl.int8), mask=cell_in_bounds)
    tl.debug_barrier()  # the scratch written by the pass is read by other threads of the program
    for start_cell in range(0, COLUMN_CELLS, CELL_BLOCK):
        offs_cell = start_cell + tl.arange(0, CELL_BLOCK)
        cell_in_bounds = offs_cell < COLUMN_CELLS
        row_cell_max = tl.load(ROW_CELL_MAX + scratch_rows * COLUMN_CELLS + offs_cell[None, :],
                               mask=row_in_bounds & cell_in_bounds[None, :], other=float("-inf"))
        absorbing = (row_max[:, None] - row_cell_max >= ABSORBING_GAP) | ~row_in_bounds
        all_absorbing = tl.min(absorbing.to(tl.int32), 0)
        all_zero = tl.load(CELL_ZERO + cells_of_rows + offs_cell, mask=cell_in_bounds, other=0)
        states = tl.where(all_absorbing == 1, SKIPPED, tl.where(all_zero == 1, KEEPS, MIXED)).to(tl.int8)[None, :]
        idx_z = fl_z
        idx_r = row_cell
        idx_c = offs_cell[None, :]
        store_mask = cell_in_bounds[None, :]
        {{store_output(("idx_z", "idx_r", "idx_c"), "states", "store_mask", indent_width=8, val_shape=("1", "CELL_BLOCK"))}}
"""

@functools.lru_cache(maxsize=None)
def mask_cells_template(row_invariant_when: Optional[str]) -> TritonTemplate:
    """The template, with the first-row path for blocks where ``row_invariant_when`` holds (a Triton expression
    over the block's bounds m_lo, m_hi, n_lo, n_hi), or without it (None). Built on first use, as the attention
    templates are: nothing is added to import time."""
    all_rows = ALL_ROWS.strip("\n")
    if row_invariant_when is None:
        blocks, name = all_rows, "flashlight_mask_cells"
    else:
        blocks = ROW_INVARIANT_BLOCKS.strip("\n").replace("ROW_INVARIANT_WHEN", row_invariant_when)
        blocks = blocks.replace("ALL_ROWS_DEEPER", _deeper(all_rows, first_line=True))
        name = "flashlight_mask_cells_" + hashlib.sha256(row_invariant_when.encode()).hexdigest()[:10]
    return TritonTemplate(name=name, grid=_grid, source=MASK_CELLS.replace("ROW_BLOCKS", blocks))


@register_lowering(fused_ops.mask_cell_states_of, type_promotion_kind=None)
def mask_cell_states_lowering(captured, bias, decisions, sizes=()):
    summary = MaskSummary(graph_module=bias.graph_module, **decisions)
    for tensor in captured:
        tensor.realize()
        tensor.freeze_layout()
    device = captured[0].get_device()
    *lead, rows, columns = summary.shape
    chain_inputs = [*captured, *(_size_for_chain(size, summary.shape) for size in sizes)]
    subgraph = _lower_score_chain(summary.graph_module, torch.float32, list(summary.shape), device, chain_inputs)
    cells = cell_shape(summary.shape)
    out_size = [math.prod(lead), *cells[-2:]]  # the mask's batch dims flattened, as the kernel indexes them
    layout = ir.FixedLayout(device, torch.int8, out_size, ir.FlexibleLayout.contiguous_strides(out_size))
    wide = not all(expr_fits_within_32bit(t.get_layout().storage_size()) for t in captured)
    row_tile = TABLE_CELL if rows > 1 else 1
    row_invariant_when = summary.row_invariant_when if row_tile > 1 else None
    widest = TILE["BLOCK_N"] if row_invariant_when is None else ROW_INVARIANT_BLOCK_N
    block_n = min(widest, max(TABLE_CELL, 1 << (columns - 1).bit_length()))  # a power of two ≥ CELL
    # Scratch: each row's largest bias per cell, and whether each cell is all 0.
    scratch = [
        empty_strided([out_size[0], out_size[1] * row_tile, out_size[2]], None, dtype=torch.float32, device=device),
        empty_strided(out_size, None, dtype=torch.int8, device=device),
    ]
    for buffer in scratch:
        buffer.realize()
        buffer.freeze_layout()
    choices: list[Any] = []
    error = mask_cells_template(row_invariant_when).maybe_append_choice(
        choices,
        input_nodes=scratch,
        layout=layout,
        subgraphs=[subgraph],
        mutated_inputs=scratch,
        call_sizes=out_size[:2],
        ROWS=rows,
        COLUMNS=columns,
        ROW_CELLS=out_size[1],
        COLUMN_CELLS=out_size[2],
        CELL=TABLE_CELL,
        ROW_TILE=row_tile,
        BLOCK_N=block_n,
        CELL_BLOCK=min(TILE["BLOCK_N"], 1 << (out_size[2] - 1).bit_length()),
        LOOP_STAGES=TILE["LOOP_STAGES"],
        EVEN_M=rows % row_tile == 0,
        EVEN_N=columns % block_n == 0,
        ABSORBING_GAP=summary.absorbing_gap,
        SKIPPED=CELL_SKIPPED,
        KEEPS=CELL_KEEPS,
        MIXED=CELL_MIXED,
        POSITION_DTYPE="tl.int64" if wide else "tl.int32",
        num_warps=TILE["num_warps"],
        num_stages=1,
    )
    if error is not None:
        raise error
    table = autotune_select_algorithm("flashlight_mask_cells", choices, [*scratch, *captured], layout)
    return lowerings[aten.reshape.default](table, cells)
