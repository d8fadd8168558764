"""The README's main job must keep working: every variant and program of the library fuses and matches eager
on the CPU. The CI tier runs the demo on a few variants and programs (each variant and program is compiled and
checked in the CI tier by ``test_attention_fusion.py`` and ``test_programs.py`` already); the full tier runs it
whole."""

import pytest
import torch

from benchmarks import demo
from benchmarks.programs import PROGRAMS
from benchmarks.variants import VARIANTS, Shape


DEMO_VARIANTS = ["causal", "hf_decoder_mask", "t5_bias"]
DEMO_PROGRAMS = ["diff_attention"]


@pytest.mark.parametrize("names", [pytest.param(DEMO_VARIANTS, id="ci"), pytest.param(None, id="all", marks=pytest.mark.full)])
def test_demo_fuses_every_variant_on_the_cpu(capsys, names):
    results = demo.run(Shape(B=1, H=4, M=32, N=32, D=16), torch.float32, gpu=False, names=names)
    assert [name for name, *_ in results] == (names or list(VARIANTS))
    for name, fused, kernels, error in results:
        # A mask passed in as a tensor or added (the causal mask tensor, key padding, HF's decoder mask,
        # cross-attention's key padding) also has its tile table built per call (Inductor's reductions, or the
        # table kernel for HF's decoder mask).
        with_table = name in ("causal_mask_tensor", "key_padding", "hf_decoder_mask", "cross_attention")
        # T5's bias is computed once per distance n - m by a pointwise kernel of its own (distance tables).
        with_distance_table = name in ("t5_bias", "t5_hf")
        expected = 2 if with_distance_table else 1
        assert fused and (kernels == expected or (with_table and kernels <= 4)), (name, kernels)
        assert error < 1e-5, (name, error)
    assert "NO" not in capsys.readouterr().out


@pytest.mark.parametrize("names", [pytest.param(DEMO_PROGRAMS, id="ci"), pytest.param(None, id="all", marks=pytest.mark.full)])
def test_demo_fuses_every_program_on_the_cpu(capsys, names):
    results = demo.run_programs(gpu=False, names=names)
    assert [name for name, *_ in results] == (names or list(PROGRAMS))
    for name, fused, kernels, error in results:
        assert fused and kernels == PROGRAMS[name].kernels, (name, kernels)
        assert error < 1e-5, (name, error)
    assert "NO" not in capsys.readouterr().out
