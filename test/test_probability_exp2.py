"""The probabilities' exp2 as inline PTX (kernel/probability_exp2.py). The PTX itself runs only on a GPU
(tools/measure_probability_exp2_error.py, tools/gpu_smoke.py); here: where it applies, how the template takes it,
and the polynomial's error bound."""

import re

import pytest
import torch

from inductor_overlay import config
from inductor_overlay.kernel import online_softmax_attention as kernel
from inductor_overlay.kernel.probability_exp2 import EXP2_POLYNOMIAL, exp2_asm, probability_exp2_pack


def test_it_applies_on_cuda_to_16_bit_probabilities_only():
    with config.patch(exp2_pack=2):
        assert probability_exp2_pack(torch.device("cuda"), torch.bfloat16) == 2
        assert probability_exp2_pack(torch.device("cuda"), torch.float16) == 2
        assert probability_exp2_pack(torch.device("cuda"), torch.float32) == 0
        assert probability_exp2_pack(torch.device("cpu"), torch.bfloat16) == 0
    with config.patch(exp2_pack=0):
        assert probability_exp2_pack(torch.device("cuda"), torch.bfloat16) == 0


@pytest.mark.parametrize("shared_v", [False, True])
def test_every_probability_exp2_of_the_template_takes_the_ptx_and_the_rescale_does_not(shared_v, monkeypatch):
    monkeypatch.setattr(kernel, "_template_of", lambda source: source)  # the source, not the TritonTemplate

    def source(pack):
        return kernel.online_softmax_attention_template.__wrapped__(
            (2, 2, 2), None, groups=2 if shared_v else 1, shared_v=shared_v, exp2_pack=pack)

    plain, emulated = source(0), source(2)
    probabilities = re.findall(r"^\s*p\d* = tl\.exp2\(", plain, re.M)
    assert len(probabilities) == (2 if shared_v else 1)
    assert not re.findall(r"^\s*p\d* = tl\.exp2\(", emulated, re.M)
    calls = re.findall(r"^\s*p\d* = tl\.inline_asm_elementwise\(EXP2_ASM, EXP2_CONSTRAINTS, \[.*\], dtype=tl\.float32, "
                       r"is_pure=True, pack=EXP2_PACK\)", emulated, re.M)
    assert len(calls) == len(probabilities)
    assert emulated.count("tl.exp2(") == plain.count("tl.exp2(") - len(probabilities) > 0  # the rescales stay


def test_the_ptx_runs_the_polynomial_on_the_last_element_of_each_pack():
    assert exp2_asm(1) == ("ex2.approx.ftz.f32 $0, $1;", "=r,r")
    asm, constraints = exp2_asm(4)
    assert constraints == "=r,=r,=r,=r,r,r,r,r"
    assert [f"${i}, ${4 + i}" for i in range(3)] == re.findall(r"ex2\.approx\.ftz\.f32 (\$\d, \$\d);", asm)
    assert "max.NaN.f32 x, $7," in asm and asm.rstrip(" }").endswith("mul.rn.f32 $3, r, scale;")
    assert asm.count("fma.rn.f32") == len(EXP2_POLYNOMIAL) - 1


def test_the_polynomial_is_within_its_stated_bound_in_float32():
    f = torch.linspace(-0.5, 0.5, 100001, dtype=torch.float64)
    value = torch.full_like(f, EXP2_POLYNOMIAL[-1]).float()
    for coefficient in reversed(EXP2_POLYNOMIAL[:-1]):
        value = torch.addcmul(torch.tensor(coefficient, dtype=torch.float32), value, f.float())
    relative = ((value.double() - torch.exp2(f)) / torch.exp2(f)).abs().max().item()
    assert relative < 2.8e-6
