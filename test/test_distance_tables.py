"""Values computed from the distance n − m alone are computed once per distance (``fx_passes/distance_tables.py``).

T5's bucketed bias costs a log, a division, a dozen integer ops and a gather per logit inside the attention
kernel; with the pass a pointwise kernel writes it once per distance and head, and the attention kernel reads that
table per logit. The rewrite is exact: every test compares with float64 eager on fresh inputs (poisoned outputs).
"""

import pytest
import torch
from torch.testing import FileCheck

from benchmarks import variants
from flashlight import testing
from inductor_overlay import config
from test.test_attention_fusion import assert_fused_attention, compile_on_cpu, reference

counters = torch._dynamo.utils.counters


def kernels_of(code):
    kernels = testing.triton_kernels(code)
    attention = [text for text in kernels.values() if "for start_n in range(" in text]
    tables = [text for text in kernels.values() if "for start_n in range(" not in text]
    return attention, tables


def log_distance_bias(q, k, v, r1, r2):
    """KERPLE's logarithmic bias, ``-r1·log(1 + r2·|m − n|)`` with two learned values per head."""
    rows = torch.arange(q.shape[-2], device=q.device)
    distance = (rows[:, None] - torch.arange(k.shape[-2], device=q.device)[None, :]).abs()
    bias = -r1[:, None, None] * torch.log1p(r2[:, None, None] * distance)
    return torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias, dim=-1) @ v


def t5_decoder(q, k, v, table):
    """T5's bias under a causal mask written with the same distance: the mask must stay a mask (tiles skipped)."""
    relative = torch.arange(k.shape[-2], device=q.device)[None, :] - torch.arange(q.shape[-2], device=q.device)[:, None]
    bias = table[variants._t5_bucket(relative)].permute(2, 0, 1)
    scores = (q @ k.transpose(-2, -1) + bias).masked_fill(relative > 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_t5_bias_is_read_from_a_table_written_once_per_distance():
    shape = variants.Shape(B=2, H=4, M=80, N=80, D=16)
    q, k, v, extras = variants.make_inputs(variants.VARIANTS["t5_bias"], shape)
    out, code = compile_on_cpu(variants.t5_relative_bias, q, k, v, **extras)
    testing.assert_close_to_reference(out, reference(variants.t5_relative_bias, q, k, v, **extras))
    assert_fused_attention(code, out)
    (attention,), (table,) = kernels_of(code)
    assert counters["inductor"]["flashlight_distance_tables"] == 1
    # The table kernel buckets the 159 distances of each head; the attention kernel only reads the table at d − lo.
    FileCheck().check("tl_math.log").check("tl.load").check("tl.store").run(table)
    assert "159" in table and "xnumel = 636" in table, table  # 4 heads × (80 + 80 − 1) distances
    FileCheck().check("for start_n").check("scores = tl.dot(").check("tl.full([1], -79").check(
        "tl.load(in_ptr3 + "
    ).check("acc = tl.dot(").run(attention)
    chain = attention.split("scores = tl.dot(")[1].split("logits = ")[0]
    FileCheck().check_not("tl_math.log").check_not("tl.where(").check_not("//").run(chain)


@pytest.mark.parametrize("bidirectional, lengths", [(True, (48, 80)), (False, (80, 48))], ids=["encoder", "decoder"])
def test_hugging_face_t5_bucket_and_embedding(bidirectional, lengths):
    rows, columns = lengths
    q, k, v = torch.randn(2, 4, rows, 16), torch.randn(2, 4, columns, 16), torch.randn(2, 4, columns, 16)
    weight = torch.randn(32, 4)
    out, code = compile_on_cpu(variants.hf_t5_attention, q, k, v, weight, bidirectional)
    testing.assert_close_to_reference(out, reference(variants.hf_t5_attention, q, k, v, weight, bidirectional))
    assert_fused_attention(code, out)
    assert counters["inductor"]["flashlight_distance_tables"] == 1
    (attention,), (table,) = kernels_of(code)
    assert f"xnumel = {4 * (rows + columns - 1)}" in table
    FileCheck().check_not("tl_math.log").run(attention)


def test_per_head_log_distance_bias_is_tabulated_per_head():
    q, k, v = (torch.randn(2, 3, 40, 16) for _ in range(3))
    r1, r2 = torch.rand(3) + 0.5, torch.rand(3) + 0.5
    out, code = compile_on_cpu(log_distance_bias, q, k, v, r1, r2)
    testing.assert_close_to_reference(out, reference(log_distance_bias, q, k, v, r1, r2))
    assert_fused_attention(code, out)
    assert counters["inductor"]["flashlight_distance_tables"] == 1
    (attention,), (table,) = kernels_of(code)
    assert "xnumel = 237" in table  # 3 heads × 79 distances
    FileCheck().check("libdevice.log1p").run(table)
    FileCheck().check_not("log1p").run(attention)


def test_mask_from_the_same_distance_stays_a_mask_and_skips_tiles():
    shape = variants.Shape(B=1, H=2, M=96, N=96, D=16)
    q, k, v, extras = variants.make_inputs(variants.VARIANTS["t5_bias"], shape)
    out, code = compile_on_cpu(t5_decoder, q, k, v, **extras)
    testing.assert_close_to_reference(out, reference(t5_decoder, q, k, v, **extras))
    assert counters["inductor"]["flashlight_distance_tables"] == 1
    (attention,), _ = kernels_of(code)
    # Block skipping still reads the mask's formula: the loop ends at the diagonal's last tile, and the chain still
    # masks with -inf after adding the bias it reads from the table.
    assert "first_n, end_n = 0, N" not in attention
    chain = attention.split("scores = tl.dot(")[1].split("logits = ")[0]
    FileCheck().check("float(\"-inf\")").check("tl.load(in_ptr3 + ").check("tl.where(").run(chain)


def test_the_tile_choice_knows_the_chain_gathers(monkeypatch):
    from inductor_overlay.kernel import online_softmax_attention as kernel

    told, choose = [], kernel.kernel_configs
    monkeypatch.setattr(kernel, "kernel_configs", lambda *args, **kwargs: told.append(kwargs["gathers"]) or choose(*args, **kwargs))
    for name, program in (("t5_bias", variants.t5_relative_bias), ("alibi", variants.alibi_slopes_tensor)):
        q, k, v, extras = variants.make_inputs(variants.VARIANTS[name], variants.Shape(B=1, H=2, M=40, N=40, D=16))
        compile_on_cpu(program, q, k, v, **extras)
    assert told == [True, False]


def distance_masked_by_a_full_tensor(q, k, v):
    """A log-distance bias masked beyond a distance of 8 with ``where(far, full(-inf), bias)``: the mask stays in the
    chain, where block skipping reads it."""
    relative = torch.arange(k.shape[-2], device=q.device)[None, :] - torch.arange(q.shape[-2], device=q.device)[:, None]
    distance = relative.abs().float()
    bias = torch.where(distance > 8, torch.full_like(distance, float("-inf")), -torch.log1p(distance))
    return torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v


def test_an_infinite_full_tensor_is_not_moved_into_the_table():
    shape = variants.Shape(B=1, H=2, M=96, N=96, D=16)
    q, k, v, _ = variants.make_inputs(variants.VARIANTS["t5_bias"], shape)
    out, code = compile_on_cpu(distance_masked_by_a_full_tensor, q, k, v)
    testing.assert_close_to_reference(out, reference(distance_masked_by_a_full_tensor, q, k, v))
    assert counters["inductor"]["flashlight_distance_tables"] == 1
    (attention,), _ = kernels_of(code)
    chain = attention.split("scores = tl.dot(")[1].split("logits = ")[0]
    FileCheck().check("float(\"-inf\")").check("tl.where(").run(chain)
    assert "first_n, end_n = 0, N" not in attention  # the window skips tiles


def test_alibi_product_stays_per_logit():
    """``slope · d`` is a conversion and a multiply per logit: cheaper than a table read (measured on the H100)."""
    shape = variants.Shape(B=1, H=2, M=40, N=40, D=16)
    q, k, v, extras = variants.make_inputs(variants.VARIANTS["alibi"], shape)
    out, code = compile_on_cpu(variants.alibi_slopes_tensor, q, k, v, **extras)
    testing.assert_close_to_reference(out, reference(variants.alibi_slopes_tensor, q, k, v, **extras))
    assert counters["inductor"]["flashlight_distance_tables"] == 0
    assert len(testing.triton_kernels(code)) == 1


def distance_functions(x):
    """Not attention: values of a distance (with offsets, both orders) used as they are."""
    rows = torch.arange(3, x.shape[0] + 3)[:, None]
    columns = torch.arange(x.shape[1])[None, :]
    forward = torch.log1p((columns - rows).abs().float())
    backward = torch.exp(-((rows - columns).float() / 7.0) ** 2)
    return x * forward + backward


def test_rewrite_is_exact_outside_attention():
    x = torch.randn(37, 53)
    torch._dynamo.reset()
    out = torch.compile(distance_functions)(x)
    assert counters["inductor"]["flashlight_distance_tables"] == 2
    torch.testing.assert_close(out, distance_functions(x), rtol=1e-6, atol=1e-6)


def test_config_off_keeps_the_per_logit_chain():
    shape = variants.Shape(B=1, H=2, M=40, N=40, D=16)
    q, k, v, extras = variants.make_inputs(variants.VARIANTS["t5_bias"], shape)
    with config.patch(distance_tables=False):
        out, code = compile_on_cpu(variants.t5_relative_bias, q, k, v, **extras)
    testing.assert_close_to_reference(out, reference(variants.t5_relative_bias, q, k, v, **extras))
    (kernel,) = testing.triton_kernels(code).values()
    FileCheck().check("for start_n").check("tl_math.log").run(kernel)
    assert counters["inductor"]["flashlight_distance_tables"] == 0


def test_symbolic_lengths_keep_the_per_logit_chain():
    """A symbolic length gives no static distance range: the chain stays in the kernel, and still fuses."""
    fn = torch.compile(variants.t5_relative_bias, dynamic=True)
    table = torch.randn(variants.T5_BUCKETS, 2)
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight"):
        for length in (40, 56):
            q, k, v = (torch.randn(1, 2, length, 16) for _ in range(3))
            out = fn(q, k, v, table)
            testing.assert_close_to_reference(out, reference(variants.t5_relative_bias, q, k, v, table))
    assert counters["inductor"]["flashlight_distance_tables"] == 0
    assert counters["inductor"]["flashlight_attention_fused"] >= 1
