"""Soft-capping's tanh as the GPU's ``tanh.approx.f32`` where its input is fp16/bf16 (``config.fast_tanh``).

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


def compile_as_on_the_gpu(fn, *args):
    with testing.cpu_triton(), mock.patch.object(online_softmax_attention, "approximates_tanh", lambda device: True):
        return testing.compile_and_get_code(fn, *args)


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


def test_float32_tanh_keeps_libdevice():
    """Gemma-2's idiom here soft-caps float32 scores: eager's tanh is float32-exact, so the kernel's is too."""
    args = [torch.randn(1, 2, 80, 16, dtype=torch.bfloat16) for _ in range(3)]
    out, code = compile_as_on_the_gpu(variants.gemma2_local, *args)
    text = "\n".join(code)
    FileCheck().check("libdevice.tanh").run(text)
    FileCheck().check_not("inline_asm").run(text)
    assert counters["inductor"]["flashlight_attention_fused"] == 1
    testing.assert_close_to_reference(out, reference(variants.gemma2_local, *args))


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
