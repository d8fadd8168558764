"""The CPU harness itself: compiled Triton code runs in the interpreter, matches eager, and leaks nothing."""

import os

import pytest
import torch

from flashlight import testing


def softmax_with_bias(x, bias):
    return torch.softmax(x * 0.5 + bias, dim=-1).tanh()


def test_compiled_function_matches_eager_on_cpu():
    x, bias = torch.randn(37, 129), torch.randn(129)
    with testing.cpu_triton():
        out, code = testing.compile_and_get_code(softmax_with_bias, x, bias)
    testing.check_kernels(code, kernels=1)
    testing.assert_close_to_reference(out, softmax_with_bias(x.double(), bias.double()))


def test_a_filecheck_that_must_fail_does_fail():
    x, bias = torch.randn(8, 16), torch.randn(16)
    with testing.cpu_triton():
        _, code = testing.compile_and_get_code(softmax_with_bias, x, bias)
    with pytest.raises(RuntimeError):
        testing.check_kernels(code, kernels=2)
    with pytest.raises(RuntimeError):
        testing.check_kernels(code, dots=1)


def test_numeric_check_catches_a_wrong_result():
    x = torch.randn(4, 4)
    with pytest.raises(AssertionError):
        testing.assert_close_to_reference(x + 1e-3, x.double())
    with pytest.raises(AssertionError):
        testing.assert_close_to_reference(torch.full((2,), float("nan")), torch.zeros(2, dtype=torch.float64))


def _global_state():
    """Everything cpu_triton() changes, as it stands now."""
    from torch._inductor import config as inductor_config
    from triton.language.extra import libdevice
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    return (
        os.environ.get("TRITON_INTERPRET"),
        inductor_config.cpu_backend,
        libdevice.exp,
        JITFunction.__call__,
        driver._active,
        torch._C._dynamo.guards._empty_strided_cpu,
    )


def test_harness_changes_are_scoped():
    from torch._inductor import config as inductor_config
    from triton.language.extra import libdevice

    before = _global_state()
    with testing.cpu_triton():
        assert os.environ["TRITON_INTERPRET"] == "1"
        assert inductor_config.cpu_backend == "triton"
        assert libdevice.exp is not before[2]
    assert _global_state() == before


def test_buffer_sizes_are_read_from_the_wrapper():
    x = torch.randn(3, 50)
    with testing.cpu_triton():
        _, code = testing.compile_and_get_code(lambda t: (t.exp() @ t.T).sum(), x)
    assert 9 in testing.allocated_buffer_numels(code), "the 3x3 product must be a buffer"


def test_compiled_buffers_start_poisoned_so_unwritten_elements_show():
    from torch._inductor.utils import run_and_get_code

    with testing.cpu_triton():
        allocated = torch._C._dynamo.guards._empty_strided_cpu((3, 4), (4, 1), torch.float32)
        assert allocated.isnan().all()
        out, _ = run_and_get_code(torch.compile(lambda x: x * 2), torch.ones(5))
    assert torch.equal(out, torch.full((5,), 2.0)), "every element the kernel writes overwrites the poison"
