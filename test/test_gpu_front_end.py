"""Every kernel the overlay generates passes Triton's front end for the H100 (sm90), not only the interpreter that
runs the CPU tests: a kernel the GPU compiler rejects would silently fall back to upstream Inductor there."""

import pytest
import torch

from benchmarks.programs import PROGRAMS
from benchmarks.variants import VARIANTS, Shape, make_inputs
from flashlight import testing
from inductor_overlay import config


def _variant_code(dtype):
    code = []
    for variant in VARIANTS.values():
        q, k, v, extras = make_inputs(variant, variant.adapt(Shape(B=1, H=4, M=40, N=40, D=16)), dtype=dtype)
        with testing.cpu_triton():
            _, generated = testing.compile_and_get_code(variant.reference, q, k, v, **extras)
        code += generated
    return code


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.full)])
def test_variant_kernels_pass_the_gpu_front_end(dtype):
    testing.check_gpu_front_end(_variant_code(dtype))


def test_program_kernels_pass_the_gpu_front_end():
    code = []
    for program in PROGRAMS.values():
        inputs = program.inputs(**program.cpu_size, dtype=torch.bfloat16)
        with testing.cpu_triton(), config.patch(combine_head_groups_in_kernel=program.name == "diff_attention"):
            _, generated = testing.compile_and_get_code(program.fn, *inputs.values())
        code += generated
    # DiffAttn's causal form with its head pairs in turn (as at head dim 128): the exact redo loops over the heads.
    program = PROGRAMS["diff_transformer_causal"]
    with testing.cpu_triton(), config.patch(share_v_tile_in_head_groups=False):
        _, generated = testing.compile_and_get_code(program.fn, **program.inputs(**program.cpu_size, dtype=torch.bfloat16))
    assert any("for redo_group in range(GROUPS):" in source for source in generated)
    testing.check_gpu_front_end(code + generated)


def test_the_check_rejects_what_the_gpu_compiler_rejects():
    """A loop-carried variable that changes type runs in the interpreter but fails the front end."""
    kernel = '''
import torch
import triton
import triton.language as tl
from torch._inductor.runtime import triton_heuristics
from torch._inductor.runtime.hints import DeviceProperties

@triton_heuristics.pointwise(size_hints={"x": 16}, filename=__file__,
    triton_meta={"signature": {"out_ptr0": "*i32", "xnumel": "i32", "XBLOCK": "constexpr"}, "device": DeviceProperties.create(torch.device("cpu")), "constants": {}, "configs": []},
    inductor_meta={"kernel_name": "triton_poi_changing_type_0"}, min_elem_per_thread=0)
@triton.jit
def triton_poi_changing_type_0(out_ptr0, xnumel, XBLOCK: tl.constexpr):
    x = tl.zeros([], tl.int32)
    for i in range(0, xnumel, XBLOCK):
        x = tl.arange(0, XBLOCK)[None, :] + i
    tl.store(out_ptr0 + tl.arange(0, XBLOCK), tl.reshape(x, [XBLOCK]))
'''
    code = f"triton_poi_changing_type_0 = async_compile.triton('triton_poi_changing_type_0', '''{kernel}''', device_str='cpu')"
    with pytest.raises(AssertionError, match="Loop-carried variable x"):
        testing.check_gpu_front_end(code)


def test_written_form_kernels_pass_the_gpu_front_end():
    """Every written form of the position-based variants (captured positions, buffers, masks passed in): the
    pre-pass over position cells is Triton the GPU compiler accepts."""
    from benchmarks.written_forms import FORMS

    code = []
    for variant in FORMS.values():
        q, k, v, extras = make_inputs(variant, Shape(B=1, H=4, M=40, N=40, D=16))
        for fn in variant.idioms.values():
            with testing.cpu_triton():
                _, generated = testing.compile_and_get_code(fn, q, k, v, **extras)
            code += generated
    testing.check_gpu_front_end(code)
