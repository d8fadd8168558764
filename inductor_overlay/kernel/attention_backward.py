"""Lowering of ``ops.online_softmax_attention_backward`` to one FlashAttention-2-style Triton kernel.

The kernel (``templates/attention_backward.py.jinja``) recomputes each score tile from q, kᵀ and the forward's row
log-sum-exp, runs the user's chain on it (the forward's own subgraph) and the chain's derivative (its joint graph,
``fx_passes/attention_training.chain_vjp_module``), and accumulates dK and dV per column tile and dQ per row tile
in separate programs of one launch. Tiles the position mask leaves entirely masked, whose ids an id-equality mask
keeps apart, or all of whose cells a mask table marks masked (a mask passed in as a tensor, HF's additive masks) are
skipped as in the forward, by the same tests (``tile_tests.masked_tile_test`` of ``ScoreChain.masked_formula``, the
id and table subgraphs), from both sides.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Optional

import torch
from torch._inductor import ir
from torch._inductor.lowering import empty_strided, full, register_lowering
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate, autotune_select_algorithm
from torch._inductor.utils import expr_fits_within_32bit
from torch._inductor.virtualized import V

from inductor_overlay import config as overlay_config
from inductor_overlay import ops as fused_ops
from inductor_overlay.kernel import template_files, tile_tests
from inductor_overlay.kernel.online_softmax_attention import (
    CHAIN_CONSTANTS,
    LOG2E,
    _16_BIT_FLOATS,
    _autotuned,
    _batch_offset,
    _divides,
    _ragged,
    _interpreting,
    _lower_score_chain,
    _score_sized_bytes,
    _size_for_chain,
    _tile,
    approximates_tanh,
    score_problem,
)

@SymbolicGridFn
def _grid(z, m, n, meta, *, cdiv):
    return (cdiv(n, meta["BLOCK_N1"]) + cdiv(m, meta["BLOCK_M2"]), z, 1)


@SymbolicGridFn
def _column_grid(z, m, n, meta, *, cdiv):
    return (cdiv(n, meta["BLOCK_N1"]), z, 1)


@SymbolicGridFn
def _row_grid(z, m, n, meta, *, cdiv):
    return (cdiv(m, meta["BLOCK_M2"]), z, 1)


# Which programs the kernel launches (``ops.online_softmax_attention_backward``'s ``programs``): both kinds, the
# column programs alone (dKᵀ, dV: q frozen) or the row programs alone (dQ: k and v frozen).
_GRIDS = {"both": _grid, "columns": _column_grid, "rows": _row_grid}


@functools.lru_cache(maxsize=None)
def backward_template(
    batch_ranks: tuple[int, int, int], masked_tile_code: Optional[str], wide: bool, ids: bool,
    table: Optional[int] = None, captured_grads: tuple = (), positions: Optional[tuple] = None,
    visible_tile: Optional[tuple] = None, softmax: bool = True, ragged: bool = False, programs: str = "both",
) -> TritonTemplate:
    """The backward kernel for operands with the given numbers of batch dims (q, kᵀ, v), position-mask test, row
    statistics (``wide``: the row max and sum apart, ``ops.py``) and id-equality mask (``ids``: its row and column
    ids are subgraphs 2 and 3, bounded per tile to skip tiles whose ids are disjoint, as in the forward) and mask
    table (the subgraph of its cell states, or None: tiles all of whose cells are masked are skipped) and the captured
    tensors whose gradients the kernel sums (``_captured_grads``) and the subgraphs of the position cells a mask
    reads (row, column; None for one it does not read), as the forward's pre-pass reads them; ``visible_tile``: the
    subgraphs of the chain without its masks and of its derivative, and the tests of entirely visible tiles for each
    kind of program (``_visible_tiles``), or None; ``softmax``: False for weights that are the chain's output itself
    (sigmoid attention, (A·B)·C): no row statistics, and the gradient of the logits is dO Vᵀ; ``ragged``: the loops
    over tiles split where the tiles leave the bounds (``online_softmax_attention._ragged``); ``programs``: which
    programs run (``_GRIDS``)."""
    offsets = {f"{name.lower()}_offset": _batch_offset(name, rank) for name, rank in zip(("Q", "KT", "V"), batch_ranks)}
    source = template_files.render(
        "attention_backward.py.jinja", masked_tile=masked_tile_code, wide=wide, ids=ids, table=table,
        captured_grads=[dict(grad) for grad in captured_grads], positions=positions,
        visible_tile=None if visible_tile is None else dict(visible_tile), softmax=softmax, ragged=ragged,
        programs=programs, **offsets,
    )
    return _template_of(source, programs)


@functools.lru_cache(maxsize=None)
def _template_of(source: str, programs: str) -> TritonTemplate:
    """One template per kernel source (Inductor names must be unique; arguments that render alike share it)."""
    digest = hashlib.sha256(f"{programs}\n{source}".encode()).hexdigest()[:10]
    return TritonTemplate(name=f"flashlight_attention_backward_{digest}", grid=_GRIDS[programs], source=source)


def backward_configs(
    d: int, dv: int, device: torch.device, id_mask: bool = False, gathers: bool = False, table: bool = False
) -> list[dict[str, int]]:
    """(BLOCK_M1, BLOCK_N1): the row tiles a column program steps through and its column tile; (BLOCK_M2,
    BLOCK_N2): a row program's row tile and the column tiles it steps through; warps and stages. The first is the
    one compiled outside max-autotune. From a sweep on an H200 (bf16, 4×16×2048, causal, soft-cap and document ids;
    benchmarks/results/h200_2026-11-26_training/tile_sweep.txt): 64×64 tiles won at both head dims, by 6–23% at 64
    and 13–40% at 128, except under an id mask at head dim 64, where 32×128 skips finer along the rows (27%). A
    chain that gathers per logit (T5's distance table) at head dim 128 takes 64×128 column and 128×64 row tiles
    with 8 warps and 3 stages: 7.5–10% less time forward + backward at 2×16×8192×128 and 8×16×2048×128, where the
    other variants gained at most 5% or lost up to 5% (H100, bf16, 2026-11-27,
    results/training/backward_tiles_h100.txt). A chain that reads a mask table (``table``: HF's additive masks, a
    finfo.min padding mask) at head dims up to 64, without an id mask, first takes 64×64 tiles with 2 stages: at 3
    the kernel spilled registers (64 bytes of stack on HF's decoder mask), and the backward kernel took 3.74 ms
    against 3.31 with 2 (key padding 4.85 against 4.80; the boolean forms of the same masks, which read no table,
    took 5–7% longer with 2; H200, bf16, 4×32×4096×64, 2026-11-28,
    results/training/backward_table_stages_h200.txt)."""
    if device.type != "cuda" or _interpreting():
        return [dict(BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16, num_warps=4, num_stages=1)]
    if overlay_config.backward_tiles:
        shapes = [tuple(int(x) for x in overlay_config.backward_tiles.split(","))]
    elif max(d, dv) <= 64:
        shapes = [(64, 64, 64, 64, 4, 3), (32, 128, 128, 32, 4, 3), (32, 64, 64, 32, 4, 3)]
        if id_mask:
            shapes.sort(key=lambda shape: shape != (32, 128, 128, 32, 4, 3))
        elif table:
            shapes.insert(0, (64, 64, 64, 64, 4, 2))
    elif max(d, dv) <= 128:
        wide_gather = (64, 128, 128, 64, 8, 3)
        shapes = [(64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 4, 3), (32, 128, 128, 32, 8, 2), wide_gather]
        if gathers:
            shapes.sort(key=lambda shape: shape != wide_gather)
    else:
        shapes = [(32, 64, 64, 32, 4, 1), (16, 64, 64, 16, 4, 1)]
    return [
        dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, num_warps=w, num_stages=s)
        for m1, n1, m2, n2, w, s in shapes
    ]


def tile_constants(config: dict[str, int]) -> dict[str, int]:
    """The constants a config's tiles fix beside them: how many cells of a mask table each tile spans, and the
    tile of the per-diagonal sums."""
    cells = {f"CELLS_{dim}": max(config[f"BLOCK_{dim}"] // fused_ops.TABLE_CELL, 1) for dim in ("M1", "N1", "M2", "N2")}
    return {**cells, "DIAGONAL_TILE": 2 * max(config["BLOCK_M1"], config["BLOCK_N1"])}


def _captured_grads(reads: list, first_subgraph: int, batch_shape: list) -> tuple:
    """The template's view of each read whose gradient the kernel sums: its subgraph, kind, and for a read written
    per logit the index of its partial's batch entry (``out_z`` decomposed over the batch dims the read varies
    along) and whether programs share an entry (atomics)."""
    grads = []
    for number, read in enumerate(reads):
        terms, inner, partial_inner = [], 1, 1
        for size, kept in reversed(list(zip(batch_shape, read["kept_batch"]))):
            if kept:
                terms.append(f"((out_z // {inner}) % {size}) * {partial_inner}")
                partial_inner *= size
            inner *= size
        grads.append(tuple(dict(
            number=number, index=read["index"], subgraph=first_subgraph + number, kind=read["kind"],
            atomic=read["kind"] == "diagonals" or not all(kept or size == 1 for size, kept in zip(batch_shape, read["kept_batch"])),
            z_index=" + ".join(terms) or "0",
        ).items()))
    return tuple(grads)


def _visible_tiles(chain: Any, first_subgraph: int) -> Optional[tuple]:
    """Where the forward runs entirely visible tiles without the masks, the backward does too: the subgraphs of the
    unmasked chain and of its derivative (``first_subgraph`` and the next), and the visible-tile tests for programs
    that scan row tiles (dK, dV) and column tiles (dQ); None where no tile is known visible."""
    if chain.unmasked_graph_module is None:
        return None
    rows_scanned = tile_tests.visible_tile_test(chain, rows_scanned=True)
    columns_scanned = tile_tests.visible_tile_test(chain)
    if rows_scanned is None or columns_scanned is None:
        return None
    return tuple(dict(
        chain=first_subgraph, vjp=first_subgraph + 1, rows_scanned=rows_scanned, columns_scanned=columns_scanned
    ).items())


def _partial_buffer(read: dict, batch_shape: list, m, n, device: torch.device):
    """The float32 partial of a read's gradient (``ops.partial_shape``): zeros where the kernel adds to it or skips
    tiles of it, uninitialised where every column program writes its own columns."""
    size = fused_ops.partial_shape(read, batch_shape, m, n)
    if read["kind"] == "columns":
        return empty_strided(size, None, dtype=torch.float32, device=device)
    zeros = full(size, 0.0, dtype=torch.float32, device=device)
    zeros.realize()
    return zeros


@register_lowering(fused_ops.online_softmax_attention_backward, type_promotion_kind=None)
def online_softmax_attention_backward_lowering(
    q, kt, v, captured, score_chain, decisions, chain_vjp, lse, delta, dense, grad_out, sizes=(), read_vjps=(),
    gradient_reads=(), unmasked_vjp=None, sink=None, gradient_factor=1.0, programs="both",
):
    # (A sink needs nothing here: its column is in the forward's row statistics, and it meets no V.)
    chain = fused_ops.chain_from_arguments(score_chain, decisions)
    device, captured, (m, d, n, dv), batch_shape, z, score_size = score_problem(q, kt, v, captured, chain)
    chain_inputs = [*captured, *(_size_for_chain(size, score_size) for size in sizes)]
    fast_tanh = approximates_tanh(device)
    # The chain the forward's row statistics describe (the whole one where the forward's loops ran a faster form).
    chain_module, folded_scale = fused_ops.differentiated_chain(chain)
    logits = _lower_score_chain(chain_module, chain.score_dtype, score_size, device, chain_inputs, fast_tanh)
    # The derivative reads the gradient of the logits as one more tile-shaped input, after the chain's own; the
    # constant factor taken out of it (``gradient_factor``) multiplies dK and dQ as they are stored.
    vjp_module = fused_ops._module(chain_vjp)
    grad_logits = ir.TensorBox.create(
        ir.InputBuffer(
            name="grad",
            layout=ir.FixedLayout(device, logits.get_dtype(), score_size, ir.FlexibleLayout.contiguous_strides(score_size)),
        )
    )
    grad_scores = _lower_score_chain(
        vjp_module, chain.score_dtype, score_size, device, [*chain_inputs, grad_logits], fast_tanh
    )
    subgraphs = [logits, grad_scores]
    if chain.id_graph_modules is not None:
        subgraphs += [
            _lower_score_chain(module, chain.score_dtype, score_size, device, chain_inputs)
            for module in chain.id_graph_modules
        ]
    table = None
    if chain.mask_table_module is not None:
        table = len(subgraphs)
        cells = [-(-V.graph.sizevars.guard_int(size) // fused_ops.TABLE_CELL) for size in (m, n)]
        subgraphs.append(
            _lower_score_chain(chain.mask_table_module, chain.score_dtype, [*batch_shape, *cells], device, chain_inputs)
        )
    positions = None
    if chain.position_graph_modules is not None and chain.masked_formula is not None:
        numbers = []
        for module in chain.position_graph_modules:  # the vectors read at the rows and at the columns
            numbers.append(None if module is None else len(subgraphs))
            if module is not None:
                subgraphs.append(_lower_score_chain(module, chain.score_dtype, score_size, device, chain_inputs))
        positions = tuple(numbers)
    masked_tile = tile_tests.masked_tile_test(chain.masked_formula, reads_vectors=positions is not None)
    visible_tile = None
    if unmasked_vjp is not None and (masked_tile or chain.id_graph_modules is not None or table is not None):
        visible_tile = _visible_tiles(chain, len(subgraphs))
    if visible_tile is not None:
        unmasked_modules = [chain.unmasked_graph_module, fused_ops._module(unmasked_vjp)]
        subgraphs.append(_lower_score_chain(unmasked_modules[0], chain.score_dtype, score_size, device, chain_inputs, fast_tanh))
        subgraphs.append(_lower_score_chain(
            unmasked_modules[1], chain.score_dtype, score_size, device, [*chain_inputs, grad_logits], fast_tanh
        ))
    captured_grads = _captured_grads(list(gradient_reads), len(subgraphs), batch_shape)
    subgraphs += [
        _lower_score_chain(fused_ops._module(vjp), chain.score_dtype, score_size, device, [*chain_inputs, grad_logits], fast_tanh)
        for vjp in read_vjps
    ]
    operands = [ir.ExternKernel.realize_input(t) for t in (q, kt, v)]
    ranks = tuple(len(t.get_size()) - 2 for t in operands)
    statistics = (lse, delta, dense) if chain.softmax else ()
    operands += [ir.ExternKernel.realize_input(t) for t in (*statistics, grad_out)]
    for tensor in operands:
        tensor.freeze_layout()
    d, dv = V.graph.sizevars.guard_int(d), V.graph.sizevars.guard_int(dv)
    # (Strides compared, not specialised: a dynamic length is in kᵀ's.)
    dk_contiguous = fused_ops.writes_dk_contiguous([1 if V.graph.sizevars.statically_known_equals(s, 1) else s for s in operands[1].get_stride()])
    dkt_stride = [d * n, 1, d] if dk_contiguous else [d * n, n, 1]
    dkt = empty_strided([z, d, n], dkt_stride, dtype=kt.get_dtype(), device=device)
    dv_out = empty_strided([z, n, dv], None, dtype=v.get_dtype(), device=device)
    partials = [_partial_buffer(read, batch_shape, m, n, device) for read in gradient_reads]
    for tensor in (dkt, dv_out, *partials):
        tensor.freeze_layout()
    operands += [dkt, dv_out, *partials]
    dq_size = [z, m, d]
    layout = ir.FixedLayout(device, q.get_dtype(), dq_size, ir.FlexibleLayout.contiguous_strides(dq_size))
    fp32_dot = q.get_dtype() == torch.float32
    wide = not all(expr_fits_within_32bit(t.get_layout().storage_size()) for t in [*operands, *captured])
    logit_scale = LOG2E * folded_scale
    choices: list[Any] = []
    # (The wider tiles for a chain that gathers were measured on 16-bit operands.)
    configs = backward_configs(
        d, dv, device, id_mask=chain.id_graph_modules is not None,
        gathers=chain.gathers and q.get_dtype() in _16_BIT_FLOATS, table=table is not None,
    )
    if _score_sized_bytes(captured, chain, m, n) > 0:
        # A mask or bias read per element: Triton 3.6's pipeliner fails in make_llir on this kernel at rows of 2048
        # and more (a boolean mask tensor on the H200; 1024 compiled): its loops run unpipelined. (The failure is a
        # cp.async of 1 byte: the loops' tile starts have no known alignment. With tl.multiple_of on them every loop
        # pipelines, and ran no faster on HF's decoder mask and a boolean mask tensor; pipelining only the loop over
        # entirely visible tiles, which reads no mask, measured 0.82× and 0.98× for HF's decoder mask, 1.03× for a
        # boolean mask tensor: H100, bf16, forward + backward, 4×32×4096×64 and 2×16×8192×128, 2026-11-27,
        # results/training/bench_masks_both_shapes.txt, backward_split_h100.txt.)
        configs = [dict(config, num_stages=1) for config in configs]
    configs = _autotuned(configs)
    ragged = any(_ragged([config[f"BLOCK_{dim}{i}"] for config in configs for i in (1, 2)], size)
                 for dim, size in (("M", m), ("N", n)))
    template = backward_template(
        ranks, masked_tile, chain.wide_logits, chain.id_graph_modules is not None, table, captured_grads, positions,
        visible_tile, chain.softmax, ragged, programs,
    )
    for config in configs:
        error = template.maybe_append_choice(
            choices,
            input_nodes=operands,
            layout=layout,
            subgraphs=subgraphs,
            mutated_inputs=[dkt, dv_out, *partials],
            call_sizes=[z, m, n],
            D=d,
            DV=dv,
            D_TILE=_tile(d),
            DV_TILE=_tile(dv),
            LOGIT_SCALE=logit_scale,
            FOLDED_SCALE=folded_scale,
            GRAD_SCORES_SCALE=folded_scale * gradient_factor,
            SCAN_TILES=16,
            **CHAIN_CONSTANTS,
            POSITION_DTYPE="tl.int64" if wide else "tl.int32",
            DOT_PRECISION="'tf32'" if fp32_dot and torch.backends.cuda.matmul.allow_tf32 else "'ieee'",
            UPCAST_DOT_OPERANDS=_interpreting(),
            MASK_CELL=fused_ops.TABLE_CELL,
            **tile_constants(config),
            EVEN_M=_divides(config["BLOCK_M1"], m) and _divides(config["BLOCK_M2"], m),
            EVEN_N=_divides(config["BLOCK_N1"], n) and _divides(config["BLOCK_N2"], n),
            PROBABILITY_DTYPE=f"tl.{str(chain.probability_dtype).removeprefix('torch.')}",
            **config,
        )
        if error is not None:
            raise error
    inputs = [*operands, *captured]
    dq = autotune_select_algorithm("flashlight_attention_backward", choices, inputs, layout)
    return (dq, dkt, dv_out, *partials)
