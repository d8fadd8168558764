"""Tables of mask cells, built in the graph once per call and shared by the attentions that read the same mask: a
mask tensor reduced by Inductor's reductions, an additive mask reduced likewise, or a bias computed from small
tensors summarised by the table kernel (``kernel/mask_cell_states.py``). The attention kernel skips tiles whose
cells are all masked."""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Union

import torch

from inductor_overlay import config
from inductor_overlay.fx_passes.block_sparsity import (
    ABSORBING_BIAS_GAP,
    MASK_TABLE_CELL,
    AdditiveMask,
    TensorMask,
    row_position_formulas,
)
from inductor_overlay import ops
from inductor_overlay.ops import MaskSummary
from inductor_overlay.fx_passes.fx_helpers import _val, call_op, subgraph, aten, prims
from inductor_overlay.fx_passes.attention_region import AttentionRegion
from inductor_overlay.fx_passes.chain_modules import _chain_value_module

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
        formulas = row_position_formulas(mask.bias) if config.row_invariant_mask_blocks else None
        summary = MaskSummary(
            _chain_value_module(region, mask.bias, list(shape)), shape, ABSORBING_BIAS_GAP,
            None if formulas is None else tuple(formulas),
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
    test. Where the mask's fill is finite (``TensorMask.rows_keep_keys``), a cell is all masked only if every row of
    its rows keeps a key."""
    masked = mask.term if not mask.negated else call_op(graph, aten.logical_not.default, (mask.term,))
    masked = call_op(graph, prims.convert_element_type.default, (masked, torch.int8))
    # Each row's state per cell (0, 1 or 2 as for cells) is one int8 tensor between the two reductions, not two: the
    # reduction across the rows, which reads it, reads half as much.
    row_states = call_op(graph, aten.add.Tensor, tuple(
        _cells_of_rows(graph, masked, outside, reduction) for outside, reduction in ((0, aten.amax.default), (1, aten.amin.default))
    ))
    some_masked = call_op(graph, aten.gt.Scalar, (_cells(graph, row_states, 0, aten.amax.default), 0))
    all_masked = call_op(graph, aten.eq.Scalar, (_cells(graph, row_states, 2, aten.amin.default), 2))
    if mask.rows_keep_keys:
        all_masked = call_op(graph, aten.logical_and.default, (all_masked, _rows_keep_keys(graph, row_states)))
    as_int8 = [call_op(graph, prims.convert_element_type.default, (flag, torch.int8)) for flag in (some_masked, all_masked)]
    return call_op(graph, aten.add.Tensor, tuple(as_int8))


def _rows_keep_keys(graph: torch.fx.Graph, row_states: torch.fx.Node) -> torch.fx.Node:
    """Per cell of rows (``[*lead, ⌈M/c⌉, 1]``), whether each of its rows keeps a key: some cell of the row is not
    all masked (no cell lies wholly past N; rows past M count as keeping one)."""
    keeps = call_op(graph, aten.le.Scalar, (call_op(graph, aten.amin.default, (row_states, [-1], True)), 1))
    keeps = call_op(graph, prims.convert_element_type.default, (keeps, torch.int8))
    return call_op(graph, aten.eq.Scalar, (_cells(graph, keeps, 1, aten.amin.default), 1))


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


def position_cells(graph: torch.fx.Graph, vector: torch.fx.Node, rows: bool) -> torch.fx.Node:
    """Graph nodes bounding a position vector read at the rows (``[*lead, M, 1]``) or at the columns (``[*lead, 1,
    N]`` or ``[*lead, N]``) over each cell of ``MASK_TABLE_CELL`` positions: ``[*lead, ⌈L/c⌉, 2]``, the least and the
    greatest value of each cell. The kernel's pre-pass bounds a tile by its cells (``block_sparsity.PositionReads``)
    instead of reading every position of every column tile in every program."""
    shape = _val(vector).shape
    lead, length = list(shape[:-2]), shape[-2] if rows else shape[-1]
    limits = torch.iinfo(_val(vector).dtype)
    elements = call_op(graph, aten.reshape.default, (vector, [*lead, 1, length]))
    bounds = [  # [*lead, 1, cells] -> [*lead, cells, 1]
        call_op(graph, aten.permute.default, (_cells_of_rows(graph, elements, outside, reduction), [*range(len(lead)), -1, -2]))
        for outside, reduction in ((limits.max, aten.amin.default), (limits.min, aten.amax.default))
    ]
    return call_op(graph, aten.cat.default, (bounds, -1))


def _table_cells(score_shape: torch.Size, mask_table: torch.fx.Node) -> list:
    """The cells of the scores' rows and columns, as the kernel indexes them (one row of cells is expanded)."""
    return [-(-score_shape[-2] // MASK_TABLE_CELL), _val(mask_table).shape[-1]]
