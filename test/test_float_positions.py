"""Integer positions are converted to float before the arithmetic on them (``fx_passes/float_positions.py``).

ALiBi's ``slope · (n − m)`` converted the integer difference per logit; with the pass the score chain converts the
row and column position vectors and subtracts in float. The rewrite is exact within 2^24: every numeric test
compares with float64 eager on fresh inputs (poisoned outputs), and outside attention with eager bit for bit.
"""

import re

import pytest
import torch

from benchmarks import variants
from flashlight import testing
from inductor_overlay import config
from inductor_overlay.fx_passes.float_positions import integer_bounds
from test.test_attention_fusion import assert_fused_attention, compile_on_cpu, reference

counters = torch._dynamo.utils.counters
ASSIGNMENT = re.compile(r"^\s*(tmp\d+) = (.*)$", re.MULTILINE)


def score_chain(code) -> dict[str, str]:
    """The fused kernel's chain between the score dot and the logits: name -> expression."""
    (kernel,) = [text for text in testing.triton_kernels(code).values() if "for start_n in range(" in text]
    chain = kernel.split("scores = tl.dot(")[1].split("logits = ")[0]
    return dict(ASSIGNMENT.findall(chain))


def converted_before_subtraction(chain: dict[str, str]) -> bool:
    """Whether the chain's position difference subtracts two values converted to float32 (per row, per column),
    rather than converting an integer difference per logit."""
    for expression in chain.values():
        operands = re.fullmatch(r"(tmp\d+) - (tmp\d+)", expression)
        if operands and all(chain.get(name, "").endswith(".to(tl.float32)") for name in operands.groups()):
            return True
    return False


def converted_after_subtraction(chain: dict[str, str]) -> bool:
    subtractions = {name for name, expression in chain.items() if re.fullmatch(r"tmp\d+ - tmp\d+", expression)}
    return any(re.fullmatch(rf"({'|'.join(subtractions)})\.to\(tl\.float32\)", e) for e in chain.values()) if subtractions else False


def symmetric_alibi(q, k, v, slopes):
    """Encoder ALiBi: ``-slope · |n − m|``."""
    distance = (torch.arange(k.shape[-2])[None, :] - torch.arange(q.shape[-2])[:, None]).abs()
    return torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 - slopes[:, None, None] * distance, -1) @ v


def divided_distance(q, k, v):
    """A bias the graph divides out of an integer difference (true division gives float32)."""
    distance = torch.arange(k.shape[-2])[None, :] - 2 * torch.arange(q.shape[-2])[:, None]
    return torch.softmax(q @ k.transpose(-2, -1) + distance / 16, -1) @ v


def alibi_inputs(rows=48, columns=80, heads=4, dtype=torch.float32):
    q = torch.randn(2, heads, rows, 16, dtype=dtype)
    k, v = (torch.randn(2, heads, columns, 16, dtype=dtype) for _ in range(2))
    slopes = torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)
    return q, k, v, slopes


@pytest.mark.parametrize("program", [variants.alibi_slopes_tensor, symmetric_alibi], ids=["alibi", "symmetric"])
def test_alibi_converts_positions_per_row_and_column(program):
    q, k, v, slopes = alibi_inputs()
    out, code = compile_on_cpu(program, q, k, v, slopes)
    testing.assert_close_to_reference(out, reference(program, q, k, v, slopes))
    assert_fused_attention(code, out)
    assert counters["inductor"]["flashlight_float_positions"] == 1
    chain = score_chain(code)
    assert converted_before_subtraction(chain) and not converted_after_subtraction(chain), chain


def test_alibi_converts_per_logit_with_the_pass_off():
    q, k, v, slopes = alibi_inputs()
    with config.patch(float_positions=False):
        out, code = compile_on_cpu(variants.alibi_slopes_tensor, q, k, v, slopes)
    testing.assert_close_to_reference(out, reference(variants.alibi_slopes_tensor, q, k, v, slopes))
    assert counters["inductor"]["flashlight_float_positions"] == 0
    chain = score_chain(code)
    assert converted_after_subtraction(chain) and not converted_before_subtraction(chain), chain


def test_alibi_from_arange_in_bf16():
    q, k, v, _ = alibi_inputs(rows=64, columns=64, dtype=torch.bfloat16)
    out, code = compile_on_cpu(variants.alibi_from_arange, q, k, v)
    testing.assert_close_to_reference(out, reference(variants.alibi_from_arange, q, k, v))
    assert_fused_attention(code, out)
    assert converted_before_subtraction(score_chain(code))


def test_true_division_of_a_scaled_difference():
    q, k, v, _ = alibi_inputs()
    out, code = compile_on_cpu(divided_distance, q, k, v)
    testing.assert_close_to_reference(out, reference(divided_distance, q, k, v))
    assert_fused_attention(code, out)
    assert counters["inductor"]["flashlight_float_positions"] == 1


def difference_times(x, scale):
    rows, columns = x.shape
    return (torch.arange(columns)[None, :] * scale - torch.arange(rows)[:, None]) * x


def test_exact_outside_attention_bit_for_bit():
    x = torch.randn(33, 70)
    out, _ = compile_on_cpu(difference_times, x, 3)
    assert counters["inductor"]["flashlight_float_positions"] == 1
    assert torch.equal(out, difference_times(x, 3))


def test_values_beyond_float32_integers_keep_integer_arithmetic():
    x = torch.randn(8, 16)
    out, _ = compile_on_cpu(difference_times, x, 2**21)  # 15 · 2^21 > 2^24: not every value is a float32 integer
    assert counters["inductor"]["flashlight_float_positions"] == 0
    assert torch.equal(out, difference_times(x, 2**21))


def test_positions_read_from_a_tensor_keep_integer_arithmetic():
    def id_distance(x, ids):
        return (ids[None, :] - ids[:, None]) * x

    x, ids = torch.randn(16, 16), torch.randint(0, 1000, (16,))
    out, _ = compile_on_cpu(id_distance, x, ids)
    assert counters["inductor"]["flashlight_float_positions"] == 0
    assert torch.equal(out, id_distance(x, ids))


def test_integer_bounds_follow_views_and_arithmetic():
    graph = torch.fx.Graph()
    with torch._subclasses.FakeTensorMode():
        columns = graph.call_function(torch.ops.prims.iota.default, (7,), {"start": 3, "step": 2, "dtype": torch.int64,
                                                                          "device": "cpu", "requires_grad": False})
        columns.meta["val"] = torch.empty(7, dtype=torch.int64)
        view = graph.call_function(torch.ops.aten.unsqueeze.default, (columns, 0))
        view.meta["val"] = torch.empty(1, 7, dtype=torch.int64)
        difference = graph.call_function(torch.ops.aten.sub.Tensor, (view, 20))
        difference.meta["val"] = torch.empty(1, 7, dtype=torch.int64)
        magnitude = graph.call_function(torch.ops.aten.abs.default, (difference,))
        magnitude.meta["val"] = torch.empty(1, 7, dtype=torch.int64)
        unknown = graph.placeholder("ids")
        unknown.meta["val"] = torch.empty(7, dtype=torch.int64)
    assert integer_bounds(columns) == (3, 15)
    assert integer_bounds(view) == (3, 15)
    assert integer_bounds(difference) == (-17, -5)
    assert integer_bounds(magnitude) == (5, 17)
    assert integer_bounds(unknown) is None
