"""Lowering of ``ops.mask_cell_states_of`` to one Triton kernel: the table of an additive mask's cell states.

The attention kernel's pre-pass reads the table to skip tiles and to drop the add on tiles whose bias is all 0. The
bias is the user's own expression (HF's causal-and-padding mask, from a ``[B, N]`` padding vector), lowered by
Inductor at the ``modification`` site as the attention kernel's score chain is: it is computed tile by tile in
registers, once, and never written to memory. One program summarises one row of cells (TABLE_CELL rows) over all
columns. Inductor's own reductions over the same graph (three kernels) took 1.35–1.9 times longer on the H100
(``benchmarks/results/h100_2026-11-23_mask_cells/``). A mask read from memory keeps them
(``fx_passes/mask_tables._mask_table``): they run at memory speed there, and this kernel did not. The kernel's
text is ``templates/mask_cell_states.py.jinja``.
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

from inductor_overlay.kernel import template_files, tile_tests
from inductor_overlay.kernel.online_softmax_attention import CHAIN_CONSTANTS, _lower_score_chain, _size_for_chain
from inductor_overlay import ops as fused_ops
from inductor_overlay.ops import CELL_KEEPS, CELL_MIXED, CELL_SKIPPED, TABLE_CELL, cell_shape

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


@functools.lru_cache(maxsize=None)
def mask_cells_template(row_invariant_when: Optional[str]) -> TritonTemplate:
    """The template (``templates/mask_cell_states.py.jinja``), with the first-row path for blocks where
    ``row_invariant_when`` holds (a Triton expression over the block's bounds m_lo, m_hi, n_lo, n_hi), or without it
    (None). Built on first use, as the attention templates are: nothing is added to import time."""
    source = template_files.render("mask_cell_states.py.jinja", row_invariant_when=row_invariant_when)
    name = "flashlight_mask_cells"
    if row_invariant_when is not None:
        name += "_" + hashlib.sha256(row_invariant_when.encode()).hexdigest()[:10]
    return TritonTemplate(name=name, grid=_grid, source=source)


@register_lowering(fused_ops.mask_cell_states_of, type_promotion_kind=None)
def mask_cell_states_lowering(captured, bias, decisions, sizes=()):
    summary = fused_ops.summary_from_arguments(bias, decisions)
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
    row_invariant_when = tile_tests.row_invariant_test(summary.row_formulas) if row_tile > 1 else None
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
        **CHAIN_CONSTANTS,
        num_warps=TILE["num_warps"],
        num_stages=1,
    )
    if error is not None:
        raise error
    table = autotune_select_algorithm("flashlight_mask_cells", choices, [*scratch, *captured], layout)
    return lowerings[aten.reshape.default](table, cells)
