"""The table kernel of additive masks (``kernel/mask_cell_states.py``) against the op's reference meaning
(``ops.mask_cell_states``), cell for cell: a bias read from a tensor, and one computed from positions and a padding
vector, on ragged sizes, with NaN, ±inf and finfo.min in the bias."""

import math

import pytest
import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from flashlight import testing
from inductor_overlay import ops
from inductor_overlay.fx_passes import block_sparsity, post_grad  # noqa: F401  (registers the lowerings)
from inductor_overlay.fx_passes.fx_helpers import call_op, subgraph
from inductor_overlay.kernel import tile_tests

LOWEST = torch.finfo(torch.float32).min


def _summary_of(fn, captured, shape) -> ops.MaskSummary:
    """A summary whose mask is ``fn(*captured)``, as the fusion pass builds it: (scores, *captured) -> mask."""
    traced = make_fx(fn, decomposition_table=select_decomp_table())(*captured)
    graph, env = torch.fx.Graph(), {}
    graph.placeholder("scores")
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        else:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    module = torch.fx.GraphModule(traced, graph)
    return ops.MaskSummary(module, tuple(shape), block_sparsity.ABSORBING_BIAS_GAP)


class _TableNode(CustomGraphPass):
    """A post-grad pass that makes the graph's output the table node of ``summary`` over the graph's inputs, as
    the fusion pass inserts it (a subgraph of the graph's module and the summary's plain data)."""

    def __init__(self, summary):
        self.summary = summary

    def __call__(self, graph):
        inputs = [node for node in graph.nodes if node.op == "placeholder"]
        output = next(node for node in graph.nodes if node.op == "output")
        bias, decisions = ops.mask_summary_arguments(self.summary)
        with graph.inserting_before(output):
            table = call_op(graph, ops.mask_cell_states_of, (inputs, subgraph(graph, bias, "mask_bias"), decisions, []))
        output.replace_input_with(output.args[0][0], table)
        graph.eliminate_dead_code()

    def uuid(self):
        return None  # not cached


def _kernel_table(summary, captured):
    """The table as the compiled graph computes it, the reference's, and the generated code."""

    def placeholder_table(*tensors):  # replaced by the table node (same shape and dtype)
        total = sum(t.sum() for t in tensors)
        return (total * 0).to(torch.int8).expand(ops.cell_shape(summary.shape)).clone()

    bias, decisions = ops.mask_summary_arguments(summary)
    reference = ops.mask_cell_states_of(list(captured), bias, decisions, [])
    with testing.cpu_triton(), inductor_config.patch(post_grad_custom_post_pass=_TableNode(summary)):
        out, code = testing.compile_and_get_code(placeholder_table, *captured)
    assert any("flashlight_mask_cells" in text or "ROW_CELL_MAX" in text for text in code), "no table kernel"
    return out, reference, code


def _blocky_bias(lead, rows, columns):
    """Cells of 0, finfo.min and -inf, the first row of cells holding a kept cell then a skipped one; NaN, +inf and
    other values sprinkled past column 64, and the last row masked throughout (no cell of it is skipped)."""
    choices = torch.tensor([0.0, LOWEST, -math.inf, 0.0])
    blocks = choices[torch.randint(0, 4, (*lead, -(-rows // 32), -(-columns // 32)))]
    blocks[..., 0, :2] = torch.tensor([0.0, LOWEST])
    bias = blocks.repeat_interleave(32, -2).repeat_interleave(32, -1)[..., :rows, :columns].clone()
    sprinkled = bias[..., 64:].clone()
    for value, count in ((float("nan"), 1), (math.inf, 1), (3.5, 2), (-1e30, 2)):
        sprinkled.view(-1)[torch.randint(0, sprinkled.numel(), (count,))] = value
    bias[..., 64:] = sprinkled
    if rows > 32:
        bias[..., -1, :] = LOWEST
    return bias


@pytest.mark.parametrize("shape", [(2, 1, 70, 300), (3, 1, 1, 100), (1, 96, 160)])
def test_bias_passed_in_matches_the_reference(shape):
    """A bias read from a tensor (the fusion pass leaves those to Inductor's reductions, but the kernel takes any
    bias): every cell as the reference says, ragged row and column cells included; one kernel, whose scratch holds
    one value per row and cell (no M×N buffer)."""
    bias = _blocky_bias(shape[:-2], *shape[-2:])
    summary = _summary_of(lambda b: b * 1, [bias], shape)
    out, reference, code = _kernel_table(summary, [bias])
    assert torch.equal(out, reference)
    assert set(reference.unique().tolist()) == {0, 1, 2}
    kernels = testing.triton_kernels(code)
    assert len(kernels) == 1
    FileCheck().check("for start_col in tl.range(0, COLUMNS, BLOCK_N, num_stages=LOOP_STAGES):").check(
        "row_cell_max = tl.max(tl.reshape(bias, [ROW_TILE, BLOCK_N // CELL, CELL]), 2)"
    ).check(
        "row_max = tl.maximum(row_max, tl.max(row_cell_max, 1))"
    ).check("tl.debug_barrier()").check("for start_cell in range(0, COLUMN_CELLS, CELL_BLOCK):").check(
        "absorbing = (row_max[:, None] - row_cell_max >= ABSORBING_GAP)"
    ).run(next(iter(kernels.values())))
    rows, columns = shape[-2:]
    cells = math.prod(shape[:-2]) * -(-rows // 32) * 32 * -(-columns // 32)
    assert max(testing.allocated_buffer_numels(code)) <= cells < bias.numel() or rows == 1


def _hf_bias(attention_mask, rows=200):
    causal = torch.full((rows, rows), LOWEST, dtype=torch.float32).triu(1)
    return causal[None, None].masked_fill(attention_mask[:, None, None, :] == 0, LOWEST)


def test_computed_bias_is_never_written():
    """HF's causal-and-padding bias computed from a ``[B, N]`` padding vector (left and right padding, and a batch
    entry with no key kept): the kernel computes it tile by tile from the vector and matches the reference; the only
    buffers are the table and its scratch."""
    attention_mask = torch.ones(3, 200, dtype=torch.long)
    attention_mask[0, :45] = 0
    attention_mask[1, 150:] = 0
    attention_mask[2] = 0
    summary = _summary_of(lambda mask: _hf_bias(mask), [attention_mask], (3, 1, 200, 200))
    out, reference, code = _kernel_table(summary, [attention_mask])
    assert torch.equal(out, reference)
    assert (reference[2] == ops.CELL_MIXED).all()  # no key kept: nothing skipped, the rows average V
    assert (reference[1, 0, 0, 1:] == ops.CELL_SKIPPED).all()  # above the diagonal
    assert max(testing.allocated_buffer_numels(code)) <= 3 * 7 * 32 * 7


def _traced_value(fn, captured):
    """The traced graph's nodes and the node of its output, as the fusion pass sees a bias in the chain."""
    traced = make_fx(fn, decomposition_table=select_decomp_table())(*captured)
    nodes = list(traced.graph.nodes)
    return nodes, nodes[-1].args[0][0] if isinstance(nodes[-1].args[0], (tuple, list)) else nodes[-1].args[0]


def _formulas(fn, captured):
    nodes, value = _traced_value(fn, captured)
    return block_sparsity.row_position_formulas(value)


_PAD = torch.ones(2, 60, dtype=torch.long)


def _window_bias(mask):
    position = torch.arange(60)
    near = (position[:, None] - position[None, :]).abs() <= 8
    return torch.where(near[None, None] & (mask[:, None, None, :] > 0), 0.0, LOWEST)


def _row_padding_bias(mask):
    return _hf_bias(mask, rows=60).masked_fill(mask[:, None, :, None] == 0, LOWEST)  # padded queries: per-row data


def _distance_bias(mask):
    position = torch.arange(60)
    return -(position[:, None] - position[None, :]).abs().float()[None, None] + (mask[:, None, None, :] - 1) * 1e9


def _transposed_causal_bias(mask):
    position = torch.arange(60)
    above = (position[:, None] > position[None, :]).T  # n > m, computed on the transposed grid
    return torch.where(above[None, None] | (mask[:, None, None, :] == 0), LOWEST, 0.0)


@pytest.mark.parametrize(
    "fn, varies_through",
    [
        (lambda mask: _hf_bias(mask, rows=60), "n - m >= 1"),
        (_window_bias, "Abs(m - n) <= 8"),
        (_transposed_causal_bias, "n > m"),
        (_row_padding_bias, None),
        (_distance_bias, None),
    ],
    ids=["hf_causal_padding", "window_and_padding", "transposed_causal", "padded_query_rows", "distance"],
)
def test_rows_vary_only_through_position_formulas(fn, varies_through):
    """The analysis finds the position formulas through which a bias varies along the rows, or declines (None):
    a bias that reads per-row data, or uses positions in arithmetic, may differ between any two rows."""
    formulas = _formulas(fn, [_PAD])
    if varies_through is None:
        assert formulas is None
        return
    assert formulas is not None and len(formulas) == 1
    m, n = ops.ROW, ops.COL
    expected = sympy.sympify(varies_through, locals={"m": m, "n": n})
    at = sympy.lambdify((m, n), formulas[0])
    want = sympy.lambdify((m, n), expected)
    assert all(bool(at(i, j)) == bool(want(i, j)) for i in range(20) for j in range(20))


@pytest.mark.parametrize("fn", [lambda mask: _hf_bias(mask, rows=60), _window_bias, _transposed_causal_bias])
def test_blocks_called_row_invariant_hold_one_row_of_bias(fn):
    """Soundness against brute force: wherever the generated test calls a block row-invariant, every row of the
    block holds the bias of its first row; and it says so for most blocks away from the formula's edges."""
    mask = torch.randint(0, 2, (2, 60))
    code = tile_tests.row_invariant_test(_formulas(fn, [mask]))
    bias = fn(mask)
    called = 0
    for m_lo in range(0, 60, 5):
        for n_lo in range(0, 60, 7):
            m_hi, n_hi = min(m_lo + 4, 59), min(n_lo + 6, 59)
            bounds = {"m_lo": m_lo, "m_hi": m_hi, "n_lo": n_lo, "n_hi": n_hi}
            if eval(code.replace("tl.where", "_where").replace("tl.maximum", "max"),
                    {"_where": lambda c, a, b: a if c else b, "max": max}, bounds):
                called += 1
                block = bias[..., m_lo:m_hi + 1, n_lo:n_hi + 1]
                assert torch.equal(block, block[..., :1, :].expand_as(block)), bounds
    assert called > 60


def _summary_with_row_blocks(fn, captured, shape) -> ops.MaskSummary:
    summary = _summary_of(fn, captured, shape)
    formulas = tuple(_formulas(fn, captured))
    assert tile_tests.row_invariant_test(formulas) is not None
    return ops.MaskSummary(summary.graph_module, summary.shape, summary.absorbing_gap, formulas)


@pytest.mark.parametrize("rows", [200, 256, 300])
def test_first_row_blocks_match_the_reference(rows):
    """The table with the first-row path for blocks off the diagonal: cell for cell the reference's, on ragged and
    whole sizes, with left and right padding and an entry with no key kept; the kernel takes every row only in the
    blocks the diagonal crosses."""
    attention_mask = torch.ones(4, rows, dtype=torch.long)
    attention_mask[0, :45] = 0
    attention_mask[1, rows - 50:] = 0
    attention_mask[2] = 0
    attention_mask[3, torch.randint(0, rows, (rows // 3,))] = 0
    summary = _summary_with_row_blocks(lambda mask: _hf_bias(mask, rows), [attention_mask], (4, 1, rows, rows))
    out, reference, code = _kernel_table(summary, [attention_mask])
    assert torch.equal(out, reference)
    assert set(reference.unique().tolist()) == {0, 1, 2}
    kernel = next(iter(testing.triton_kernels(code).values()))
    FileCheck().check("n_lo, n_hi = start_col, tl.minimum(start_col + BLOCK_N, COLUMNS) - 1").check(
        "if ((("
    ).check("first_row = ").check("first_mask = ").check(
        "row_cell_max = tl.broadcast_to(first_cell_max, [ROW_TILE, BLOCK_N // CELL])"
    ).check("else:").check("mask = ").check("row_cell_max = tl.max(tl.reshape(bias, [ROW_TILE, BLOCK_N // CELL, CELL]), 2)").run(kernel)
