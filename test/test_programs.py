"""Programs FlexAttention cannot express (issue 6) fuse from their structure alone (CPU harness).

Each program of ``benchmarks/programs.py`` is compiled from plain PyTorch and checked against float64 eager on fresh
random inputs, with the fused structure pinned: the expected number of kernels, one N loop with two dots in the
fused one, the program's own normalisation (online softmax, a sink-initialised softmax, or none), and no buffer as
large as the score matrix.
"""

import math

import pytest
import torch
from torch.testing import FileCheck

from benchmarks import programs
from flashlight import testing
from inductor_overlay import config

counters = torch._dynamo.utils.counters


def float64(inputs):
    return {name: t.double() if t.is_floating_point() else t for name, t in inputs.items()}


def compile_on_cpu(fn, inputs, **overlay_config):
    with testing.cpu_triton(), config.patch(sdpa_pattern_policy="flashlight", **overlay_config):
        return testing.compile_and_get_code(fn, **inputs)


def outputs(value):
    return value if isinstance(value, tuple) else (value,)


def assert_outputs_close(out, expected):
    for actual, reference in zip(outputs(out), outputs(expected), strict=True):
        testing.assert_close_to_reference(actual, reference)


def fused_kernel(code):
    kernels = [k for k in testing.triton_kernels(code).values() if "for start_n in range(" in k]
    assert len(kernels) == 1, f"expected one fused kernel, found {len(kernels)}"
    return kernels[0]


def score_numel(program, size):
    if "M" in size:
        return size["M"] * size["N"]
    batch = size["B"] * size["H"] * size.get("N_seq", 1)
    return batch * size["S"] * size["S"]


@pytest.mark.parametrize("name", list(programs.PROGRAMS))
def test_program_fuses_and_matches_eager(name):
    program = programs.PROGRAMS[name]
    inputs = program.inputs(**program.cpu_size)
    out, code = compile_on_cpu(program.fn, inputs)
    assert_outputs_close(out, program.fn(**float64(inputs)))

    testing.check_kernels(code, kernels=program.kernels, extern_calls=0)
    kernel = fused_kernel(code)
    FileCheck().check_count("tl.dot(", program.dots * testing.column_tile_loops(kernel), exactly=True).run(kernel)
    scores = score_numel(program, program.cpu_size)
    assert all(n < scores for n in testing.allocated_buffer_numels(code)), "a buffer as large as the scores exists"
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    assert counters["inductor"]["flashlight_fault_fallback"] == 0


def test_diff_attention_combines_the_head_pair_in_one_kernel():
    """One program runs both softmaxes of a head pair in one loop over the column tiles: two QKᵀ dots, one V tile
    (V's head read in place) for both P·V dots, two running states; after the loop it adds A0·V − λ·A1·V into one
    output tile. No per-head output or partial-sum buffer: only the output and the two coefficients."""
    program = programs.PROGRAMS["diff_attention"]
    inputs = program.inputs(**program.cpu_size)
    out, code = compile_on_cpu(program.fn, inputs, combine_head_groups_in_kernel=True)
    testing.assert_close_to_reference(out, program.fn(**float64(inputs)))
    testing.check_kernels(code, kernels=2, extern_calls=0)  # + one two-element kernel: the coefficients 1 and -λ
    kernel = fused_kernel(code)
    FileCheck().check("for start_n in range(first_n, end_n, BLOCK_N)").check("scores0 = tl.dot(q0, kt0").check(
        "alpha0 = tl.exp2("
    ).check("scores1 = tl.dot(q1, kt1").check("alpha1 = tl.exp2(").check_count("v = tl.load(", 1, exactly=True).check(
        "acc0 = tl.dot(p0, v, acc0 * alpha0"
    ).check("acc1 = tl.dot(p1, v, acc1 * alpha1").check("acc0 = acc0 / l_i0").check("acc1 = acc1 / l_i1").check(
        "acc = tl.load(COEF + 0"
    ).check("acc += tl.load(COEF + 1").check_not("partial").check_not("debug_barrier").run(kernel)
    FileCheck().check_count("tl.dot(", program.dots * testing.column_tile_loops(kernel), exactly=True).run(kernel)
    allocated = sorted(testing.allocated_buffer_numels(code))
    assert allocated[-1:] == [out.numel()] and sum(allocated[:-1]) <= 4, allocated


@pytest.mark.parametrize("patch", [dict(share_v_tile_in_head_groups=False), dict(shared_v_max_accumulator_columns=32)])
def test_diff_attention_heads_run_in_turn_without_the_shared_pass(patch):
    """With ``share_v_tile_in_head_groups`` off, or where the two accumulators would not fit (2 × Dv 32 columns
    against a limit of 32 here; head dim 128 on the GPU), the program runs the two heads in turn; the first head's
    weighted result waits in a partial-sum buffer of the output's size that the same program reads back."""
    program = programs.PROGRAMS["diff_attention"]
    inputs = program.inputs(**program.cpu_size)
    with config.patch(**patch):
        out, code = compile_on_cpu(program.fn, inputs, combine_head_groups_in_kernel=True)
    testing.assert_close_to_reference(out, program.fn(**float64(inputs)))
    testing.check_kernels(code, kernels=2, extern_calls=0)
    kernel = fused_kernel(code)
    FileCheck().check("for group in tl.static_range(GROUPS)").check("alpha = tl.exp2(").check(
        "acc = tl.dot(p, v, acc * alpha"
    ).check("acc = acc / l_i").check("acc = tl.load(COEF").check("if group > 0:").check("tl.debug_barrier()").check(
        "acc += tl.load(partial_tile"
    ).check("if group < GROUPS - 1:").check("tl.store(partial_tile").run(kernel)
    FileCheck().check_count("tl.dot(", 2, exactly=True).run(kernel)
    allocated = sorted(testing.allocated_buffer_numels(code))
    assert allocated[-2:] == [out.numel(), out.numel()] and sum(allocated[:-2]) <= 4, allocated


def test_diff_attention_written_with_two_matmuls_combines_in_one_kernel():
    """``A0 @ V − λ·(A1 @ V)``: the two output matmuls share V and λ is constant along Dv, so they factor into
    ``(A0 − λ·A1) @ V``, which distributes over the head pair as above: one attention kernel runs both heads in one
    pass (each V tile loaded once), no per-head output buffer."""
    program = programs.PROGRAMS["diff_attention_two_matmuls"]
    inputs = program.inputs(**program.cpu_size)
    out, code = compile_on_cpu(program.fn, inputs, combine_head_groups_in_kernel=True)
    testing.assert_close_to_reference(out, program.fn(**float64(inputs)))
    testing.check_kernels(code, kernels=2, extern_calls=0)
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    FileCheck().check_count("v = tl.load(", 1, exactly=True).check("acc0 = tl.dot(p0, v, acc0 * alpha0").check(
        "acc1 = tl.dot(p1, v, acc1 * alpha1"
    ).check("acc += tl.load(COEF + 1").run(fused_kernel(code))
    allocated = sorted(testing.allocated_buffer_numels(code))
    assert allocated[-1:] == [out.numel()] and sum(allocated[:-1]) <= 4, allocated


def four_heads_one_value(q, k, v, lam):
    b, four_h, m, d = q.shape
    w = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5, dim=-1).view(b, four_h // 4, 4, m, k.shape[-2])
    return (w[:, :, 0] - lam * w[:, :, 1] + lam * lam * w[:, :, 2] - 0.5 * w[:, :, 3]) @ v


def test_a_group_of_four_heads_shares_one_pass():
    """Any number of heads that read one V share the pass while their accumulators fit (4 × Dv 32 here): four Q·Kᵀ
    and four P·V dots in one loop, one V load, the four coefficients applied after it."""
    inputs = programs.diff_inputs(B=2, H=8, S=29, D=16)
    inputs["v"] = torch.randn(2, 2, 29, 32)
    out, code = compile_on_cpu(four_heads_one_value, inputs, combine_head_groups_in_kernel=True)
    testing.assert_close_to_reference(out, four_heads_one_value(**float64(inputs)))
    kernel = fused_kernel(code)
    FileCheck().check_count("v = tl.load(", 1, exactly=True).check("acc3 = tl.dot(p3, v, acc3 * alpha3").check(
        "acc += tl.load(COEF + 3"
    ).run(kernel)
    FileCheck().check_count("tl.dot(", 8, exactly=True).run(kernel)
    assert testing.column_tile_loops(kernel) == 1


def diff_attention_two_values(q, k, v, lam):
    weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1).view(q.shape[0], -1, 2, q.shape[-2], k.shape[-2])
    return weights[:, :, 0] @ v - lam * (weights[:, :, 1] @ (2 * v))


def diff_attention_lambda_along_dv(q, k, v, lam):
    weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1).view(q.shape[0], -1, 2, q.shape[-2], k.shape[-2])
    return weights[:, :, 0] @ v - lam * (weights[:, :, 1] @ v)


@pytest.mark.parametrize("program, lam_shape", [(diff_attention_two_values, ()), (diff_attention_lambda_along_dv, (16,))])
def test_matmuls_that_do_not_factor_are_left_to_upstream(program, lam_shape):
    """Different right operands, or a coefficient that varies along Dv (``c_e·(A V)[:, e]`` is not ``(c·A) V``):
    no factoring, so the shared softmax cannot fuse into either matmul; upstream's path, same result."""
    inputs = programs.diff_inputs(B=1, H=4, S=19, D=8)
    inputs["lam"] = torch.rand(lam_shape)
    out, code = compile_on_cpu(program, inputs)
    testing.assert_close_to_reference(out, program(**float64(inputs)))
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert not any("for start_n in range(" in k for k in testing.triton_kernels(code).values())


def test_diff_transformer_code_skips_the_future_tiles():
    """The reference code's ``triu`` of -inf is built in the forward from positions: the kernel scans for the last
    visible column tile (causal skipping), runs the entirely visible tiles without the mask, and applies
    ``nan_to_num`` only in the loop that runs when the speculation on finite scores fails
    (``test_finite_speculation.py``); both heads of a pair share each loop."""
    program = programs.PROGRAMS["diff_transformer_causal"]
    inputs = program.inputs(B=1, H=2, S=300, D=16)
    out, code = compile_on_cpu(program.fn, inputs)
    testing.assert_close_to_reference(out, program.fn(**float64(inputs)))
    FileCheck().check("for scan_n in range(").check("for start_n in range(full_lo, full_hi").check(
        "for partial_n in tl.range(").check_not("libdevice.isnan").check("speculation_failed = ").check(
        "for start_n in tl.range(first_n, end_n").check("libdevice.isnan").check("acc0 = tl.dot(p0, v").check(
        "acc1 = tl.dot(p1, v"
    ).run(fused_kernel(code))


def diff_attention_per_head_lambda(q, k, v, lam):
    b, two_h, m, d = q.shape
    weights = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5, dim=-1).view(b, two_h // 2, 2, m, k.shape[-2])
    return (weights[:, :, 0] - lam.view(1, -1, 1, 1) * weights[:, :, 1]) @ v


@pytest.mark.parametrize("in_kernel", [False, True])
def test_diff_attention_with_a_per_head_lambda_combines_outside_the_kernel(in_kernel):
    """λ per head is constant along N, so the matmul still distributes; the combination is a pointwise kernel over
    the [.., M, 2d] outputs of all 2h heads (never over the M×N probabilities), even when in-kernel combination of
    scalar coefficients is on."""
    inputs = programs.diff_inputs(B=2, H=4, S=29, D=8)
    inputs["lam"] = torch.rand(2)
    out, code = compile_on_cpu(diff_attention_per_head_lambda, inputs, combine_head_groups_in_kernel=in_kernel)
    testing.assert_close_to_reference(out, diff_attention_per_head_lambda(**float64(inputs)))
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.check_kernels(code, kernels=2, extern_calls=0)
    assert sorted(testing.allocated_buffer_numels(code)) == [out.numel(), 2 * out.numel()]


def diff_attention_one_pair_in_2d(q, k, v, lam):
    """One head pair of one sequence, the output matmul in 2-D: q, k [2, S, d], v [S, 2d]. On a GPU upstream's
    joint-graph pass gives a DiffAttn of batch 1 this form (its bmm becomes an mm of the squeezed operands)."""
    weights = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    return (weights[0] - lam * weights[1]) @ v


def test_diff_attention_whose_output_matmul_is_an_mm_combines_in_one_kernel():
    """The head-combination rewrite starts from mm outputs too (found by the GPU run of the random programs)."""
    inputs = programs.diff_inputs(B=1, H=2, S=21, D=8)
    inputs = dict(q=inputs["q"][0], k=inputs["k"][0], v=inputs["v"][0, 0], lam=inputs["lam"])
    out, code = compile_on_cpu(diff_attention_one_pair_in_2d, inputs, combine_head_groups_in_kernel=True)
    testing.assert_close_to_reference(out, diff_attention_one_pair_in_2d(**float64(inputs)))
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    FileCheck().check("acc1 = tl.dot(p1, v, acc1 * alpha1").check("acc += tl.load(COEF + 1").run(fused_kernel(code))
    assert all(n < 2 * 21 * 21 for n in testing.allocated_buffer_numels(code)), "a buffer as large as the scores exists"


def diff_attention_per_column_lambda(q, k, v, lam):
    b, two_h, m, d = q.shape
    weights = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5, dim=-1).view(b, two_h // 2, 2, m, k.shape[-2])
    return (weights[:, :, 0] - lam * weights[:, :, 1]) @ v


def test_diff_attention_with_a_coefficient_varying_along_n_is_not_distributed():
    """(A0 − λ_n·A1)·V ≠ A0·V − λ·(A1·V) when λ varies along the contracted dim: upstream's path, same result."""
    inputs = programs.diff_inputs(B=1, H=4, S=19, D=8)
    inputs["lam"] = torch.rand(19)
    out, code = compile_on_cpu(diff_attention_per_column_lambda, inputs)
    testing.assert_close_to_reference(out, diff_attention_per_column_lambda(**float64(inputs)))
    assert counters["inductor"]["flashlight_attention_fused"] == 0
    assert not any("for start_n in range(" in k for k in testing.triton_kernels(code).values())


@pytest.mark.parametrize("fn", [programs.attention_sinks, programs.attention_sinks_max_subtracted])
def test_sink_starts_the_running_state_and_can_dominate(fn):
    """The sink is an extra softmax column that meets no V: a large sink drives every row towards 0."""
    inputs = programs.sinks_inputs(B=1, H=3, S=33, D=16)
    inputs["sinks"] = torch.tensor([8.0, 0.0, -8.0])
    out, code = compile_on_cpu(fn, inputs)
    expected = fn(**float64(inputs))
    testing.assert_close_to_reference(out, expected)
    assert expected[0, 0].abs().max() < 0.1 * expected[0, 2].abs().max()
    FileCheck().check("m_i = tl.load(sink_base").check("l_i = tl.where(").check("for start_n in range(").run(
        fused_kernel(code)
    )


def test_sigmoid_attention_has_no_softmax_state():
    program = programs.PROGRAMS["sigmoid_attention"]
    inputs = program.inputs(**program.cpu_size)
    _, code = compile_on_cpu(program.fn, inputs)
    kernel = fused_kernel(code)
    FileCheck().check("tl.sigmoid(").check("acc = tl.dot(p, v, acc,").run(kernel)
    for state in ("m_i = ", "l_i = ", "alpha = ", "tl.exp2("):
        FileCheck().check_not(state).run(kernel)


def chained_matmul_wide(a, b, c):
    return (a @ b) @ c


@pytest.mark.parametrize("k,p,fuses", [(24, 40, True), (256, 40, False), (24, 200, False)])
def test_chained_matmul_declines_large_inner_dims(k, p, fuses):
    """Without a softmax there is nothing to gain but the M×N round trip: inner dims above
    ``linear_fusion_max_inner_dim`` stay two GEMMs."""
    inputs = programs.chain_inputs(M=40, K=k, N=56, P=p)
    out, code = compile_on_cpu(chained_matmul_wide, inputs)
    testing.assert_close_to_reference(out, chained_matmul_wide(**float64(inputs)))
    assert counters["inductor"]["flashlight_attention_fused"] == int(fuses)
    assert any("for start_n in range(" in k for k in testing.triton_kernels(code).values()) == fuses


def test_mla_head_dims_differ():
    program = programs.PROGRAMS["mla_causal"]
    inputs = program.inputs(**program.cpu_size)
    _, code = compile_on_cpu(program.fn, inputs)
    FileCheck().check("D : tl.constexpr = 48").check("DV : tl.constexpr = 32").run(fused_kernel(code))


def test_evoformer_gate_is_fused_into_the_kernel_epilogue():
    """The sigmoid gate multiplies the output tile in registers before the store: one kernel, one output buffer."""
    program = programs.PROGRAMS["evoformer_row_attention"]
    inputs = program.inputs(**program.cpu_size)
    out, code = compile_on_cpu(program.fn, inputs)
    FileCheck().check("acc = acc / l_i").check("tl.sigmoid(").check("tl.store(").run(fused_kernel(code))
    assert testing.allocated_buffer_numels(code) == [out.numel()]
    assert math.prod(inputs["gate"].shape) == out.numel()


def test_evoformer_block_fuses_row_and_column_attention():
    """Row attention's pair bias is itself a matmul (a projection of the pair representation): the pass must
    pick q·kᵀ as the scores and read the projected bias as a tensor."""
    from benchmarks.evoformer_block import EvoformerBlock, block_inputs

    block = EvoformerBlock(c_m=32, c_z=16, heads=2, head_dim=16).eval()
    inputs = block_inputs(B=1, N_seq=5, S=19, c_m=32, c_z=16)
    with torch.no_grad():
        (msa, pair), code = compile_on_cpu(block, inputs)
        expected = block.double()(**float64(inputs))
    testing.assert_close_to_reference(msa, expected[0])
    testing.assert_close_to_reference(pair, expected[1])
    assert counters["inductor"]["flashlight_attention_fused"] == 2
    assert sum("for start_n in range(" in k for k in testing.triton_kernels(code).values()) == 2


@pytest.mark.parametrize("name", ["attention_sinks", "attention_sinks_max_subtracted", "diff_attention",
                                  "diff_attention_two_matmuls", "diff_transformer_causal", "sigmoid_attention",
                                  "chained_matmul", "ipa_attention"])
def test_program_fuses_in_bfloat16(name):
    """16-bit inputs put upcasts into the graph (a bf16 softmax computes in float32): the programs still fuse."""
    program = programs.PROGRAMS[name]
    inputs = program.inputs(**program.cpu_size, dtype=torch.bfloat16)
    out, code = compile_on_cpu(program.fn, inputs)
    for actual, expected in zip(outputs(out), outputs(program.fn(**float64(inputs))), strict=True):
        assert (actual.double() - expected).norm() / expected.norm() < 1e-2  # bf16 rounding of O(N) sums: norm-wise
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    fused_kernel(code)
