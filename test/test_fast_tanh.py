"""Soft-capping's tanh as the GPU's ``tanh.approx.f32`` where eager's tanh is 16-bit precise (``config.fast_tanh``).

The CPU harness forces the GPU's choice (``approximates_tanh``) and runs the instruction as NumPy's exact tanh
(``flashlight.testing``), so these tests pin the wiring and the dtype rule; the approximation's error was measured
on the GPU (benchmarks/results/h100_2026-11-23_gqa_route_fast_tanh/fast_tanh/).
"""

from unittest import mock

import pytest
import torch
from torch.testing import FileCheck

from benchmarks import variants
from flashlight import testing
from inductor_overlay import config
from inductor_overlay.kernel import online_softmax_attention
from test.test_attention_fusion import reference

counters = torch._dynamo.utils.counters


def compile_as_on_the_gpu(fn, *args, **options):
    with testing.cpu_triton(), mock.patch.object(online_softmax_attention, "approximates_tanh", lambda device: True):
        return testing.compile_and_get_code(fn, *args, **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_soft_cap_takes_the_gpu_tanh_inside_the_attention_kernel(dtype):
    args = [torch.randn(1, 2, 80, 16, dtype=dtype) for _ in range(3)]
    out, code = compile_as_on_the_gpu(variants.softcap_tanh, *args)
    kernels = testing.triton_kernels(code)
    assert len(kernels) == 1 and counters["inductor"]["flashlight_attention_fused"] == 1
    (kernel,) = kernels.values()
    FileCheck().check("for start_n").check("tl.dot").check(
        "tl.inline_asm_elementwise('tanh.approx.f32 $0, $1;', '=r,r'"
    ).check("tl.dot").run(kernel)
    FileCheck().check_not("libdevice.tanh").run(kernel)
    testing.assert_close_to_reference(out, reference(variants.softcap_tanh, *args))


def test_float32_tanh_of_the_upcast_16_bit_score_takes_the_gpu_tanh():
    """Gemma-2's idiom soft-caps the bf16 score upcast to float32: eager's tanh argument carries the score's bf16
    rounding, so the instruction adds no error of a new order."""
    args = [torch.randn(1, 2, 80, 16, dtype=torch.bfloat16) for _ in range(3)]
    out, code = compile_as_on_the_gpu(variants.gemma2_local, *args)
    (kernel,) = testing.triton_kernels(code).values()
    FileCheck().check("for start_n").check("tl.dot").check("tanh.approx.f32").check("tl.dot").run(kernel)
    FileCheck().check_not("libdevice.tanh").run(kernel)
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(variants.gemma2_local, *args))


@pytest.mark.parametrize("program", [variants.gemma2_local, variants.softcap_tanh])
def test_soft_cap_by_run_time_values_takes_the_gpu_tanh(program):
    """With every size symbolic the softmax's 1/√d and the soft-cap (a float Dynamo does not specialise there) reach
    the chain as run-time values, not constants: a 16-bit score times or over them still carries its rounding into
    eager's tanh, so the kernel takes the instruction (with libdevice's, Gemma-2's training step under
    ``dynamic=True`` took 2.6× the static graph's time on the H100, with the instruction 1.7×)."""
    args = [torch.randn(1, 2, 80, 16, dtype=torch.bfloat16) for _ in range(3)]
    out, code = compile_as_on_the_gpu(program, *args, compile_options=dict(dynamic=True))
    (kernel,) = [text for text in testing.triton_kernels(code).values() if "acc = tl.dot(p, v" in text]
    FileCheck().check("M = ks").check("tl.load(in_ptr").check("tanh.approx.f32").run(kernel)
    FileCheck().check_not("libdevice.tanh").run(kernel)
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(program, *args))


def soft_cap_after_a_bias(q, k, v, bias):
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    return torch.softmax(50.0 * torch.tanh((scores + bias) / 50.0), dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("program, dtype", [(variants.softcap_tanh, torch.float32), (soft_cap_after_a_bias, torch.bfloat16)])
def test_other_float32_tanhs_keep_libdevice(program, dtype):
    """A float32 matmul's score, or a score plus a float32 bias, is not 16-bit precise: eager's tanh is float32's."""
    args = [torch.randn(1, 2, 80, 16, dtype=dtype) for _ in range(3)]
    if program is soft_cap_after_a_bias:
        args.append(torch.randn(80, 80))
    out, code = compile_as_on_the_gpu(program, *args)
    (kernel,) = testing.triton_kernels(code).values()
    FileCheck().check("for start_n").check("libdevice.tanh").run(kernel)
    FileCheck().check_not("inline_asm").run(kernel)
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(program, *args))


def chain_graph(fn, score_dtype=torch.bfloat16):
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    graph_module = make_fx(fn, decomposition_table=select_decomp_table())(torch.randn(4, 4, dtype=score_dtype))
    (placeholder,) = graph_module.graph.find_nodes(op="placeholder")
    placeholder.target = "scores"
    return graph_module


@pytest.mark.parametrize(
    "chain, score_dtype, fast",
    [
        (lambda s: torch.tanh(-(s.float() * 0.125) / 30.0), torch.bfloat16, True),
        (lambda s: torch.tanh(s.float() * 0.125), torch.float16, True),
        (lambda s: torch.tanh(s * 0.125), torch.bfloat16, True),  # a 16-bit tanh
        (lambda s: torch.tanh(s * 0.125), torch.float32, False),
        (lambda s: torch.tanh(s.float() * torch.full((4,), 0.5)), torch.bfloat16, True),  # a tensor free of the scores
        (lambda s: torch.tanh(torch.full((), 0.5) * s.float() / torch.full((), 3.0)), torch.bfloat16, True),
        (lambda s: torch.tanh(s.float() * s.float()), torch.bfloat16, False),  # a factor that is the scores
        (lambda s: torch.tanh(s.float() / s.float().amax(-1, keepdim=True)), torch.bfloat16, False),  # through a max
        (lambda s: torch.tanh(torch.full((), 2.0) / s.float()), torch.bfloat16, False),  # the score as the divisor
        (lambda s: torch.tanh(s.float() * 0.0), torch.bfloat16, False),  # zero erases the rounding
        (lambda s: torch.tanh(s.float() + 1.0), torch.bfloat16, False),  # an add can cancel
        (lambda s: torch.tanh(s.int().float()), torch.bfloat16, False),  # through integers
    ],
)
def test_which_float32_tanhs_count_as_16_bit_precise(chain, score_dtype, fast):
    graph_module = chain_graph(chain, score_dtype)
    chosen = online_softmax_attention.tanhs_of_16_bit_precision(graph_module, score_dtype)
    assert [node.target for node in chosen] == ([torch.ops.aten.tanh.default] if fast else [])


def test_cpu_keeps_libdevice():
    args = [torch.randn(1, 2, 80, 16, dtype=torch.bfloat16) for _ in range(3)]
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(variants.softcap_tanh, *args)
    text = "\n".join(code)
    FileCheck().check("libdevice.tanh").run(text)
    FileCheck().check_not("inline_asm").run(text)
    testing.assert_close_to_reference(out, reference(variants.softcap_tanh, *args))


@pytest.mark.skipif(torch.version.hip is not None, reason="the instruction is NVIDIA's")
def test_the_flag_and_the_device_decide():
    assert online_softmax_attention.approximates_tanh(torch.device("cuda"))
    assert not online_softmax_attention.approximates_tanh(torch.device("cpu"))
    with config.patch(fast_tanh=False):
        assert not online_softmax_attention.approximates_tanh(torch.device("cuda"))


def test_the_backward_differentiates_with_libdevice_tanh():
    """In training the backward recomputes Gemma-2's logits with the forward's instruction (the same probabilities),
    but the derivative 1 − tanh² keeps libdevice's tanh: near saturation the difference of two numbers close to 1
    would turn the instruction's 2^-11 into a large relative error (its module's placeholders are not the scores)."""
    args = [torch.randn(1, 2, 80, 16, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]

    def step():
        out = torch.compile(variants.gemma2_local)(*args)
        out.backward(torch.ones_like(out))
        return out

    from torch._inductor.utils import fresh_cache

    from inductor_overlay.kernel import attention_backward

    torch._dynamo.reset()
    gpu_choice = [mock.patch.object(module, "approximates_tanh", lambda device: True)
                  for module in (online_softmax_attention, attention_backward)]
    with testing.cpu_triton(), gpu_choice[0], gpu_choice[1], fresh_cache():
        _, code = testing.run_keeping_graphs_and_get_code(step)
    (backward,) = [text for text in testing.triton_kernels(code).values() if "grad_scores" in text]
    FileCheck().check("scores = tl.dot(k, qt").check("tanh.approx.f32").check("grad_logits = ").check(
        "libdevice.tanh").check("grad_scores = ").run(backward)
