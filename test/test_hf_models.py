"""Attention as Hugging Face's models write it (``attn_implementation="eager"``), compiled whole (CPU harness).

A model is the program users bring: rotary embeddings, grouped K/V repeated in the graph, HF's own masks, a
float32 softmax, linear layers around the attention. Each case builds a one-layer model with random weights
(``benchmarks/hf_models.py``) and checks that every attention of it fuses, that nothing fell back, and that the
output matches the eager model's. The reference is the float32 model: HF's masks depend on the dtype (the float64
model gives NaN rows where a sliding window meets padding, the float32 one a uniform row, which the fused kernel
reproduces).
"""

import pytest
import torch

from flashlight import testing
from inductor_overlay import config

pytest.importorskip("transformers")

from benchmarks import hf_models  # noqa: E402  (after the skip: it needs transformers)

counters = torch._dynamo.utils.counters

# Windows shorter than the test's 40 tokens, so that some rows see only padding.
SMALL_OVERRIDES = {"mistral": dict(sliding_window=8), "gemma2": dict(sliding_window=8)}


# The CI tier compiles one form of a few families that between them cover GQA with HF's padding mask (llama), a
# finfo.min causal mask and a division by a tensor (gpt2), distance tables (t5) and views between batch groupings
# (xglm); the full tier compiles every family with and without padding.
CI_CASES = {("llama", True), ("gpt2", False), ("t5", True), ("xglm", True)}


@pytest.mark.parametrize("family,padded", [
    pytest.param(family, padded, id=f"{family.name}-{'padding_mask' if padded else 'no_mask'}",
                 marks=[] if (family.name, padded) in CI_CASES else [pytest.mark.full])
    for family in hf_models.FAMILIES for padded in (False, True)
])
def test_hf_model_attention_fuses_and_matches_eager(family, padded):
    """Fault containment off: a fault in the overlay raises here instead of falling back behind a warning."""
    torch.manual_seed(0)
    model = hf_models.build(family, hidden=128, heads=8, layers=1, **SMALL_OVERRIDES.get(family.name, {}))
    ids, mask = hf_models.token_inputs(2, 40, padded)
    with torch.no_grad():
        expected = hf_models.forward(model, ids, mask)
        with testing.cpu_triton(), config.patch(fault_containment=False):
            out, code = testing.compile_and_get_code(lambda i, m: hf_models.forward(model, i, m), ids, mask)
    assert counters["inductor"]["flashlight_attention_fused"] == family.attentions_per_layer
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    kernels = testing.triton_kernels(code)
    assert any("for start_n in range(" in text for text in kernels.values())
    assert "baddbmm" not in "\n".join(code)
    assert family.position_matmuls or "extern_kernels.bmm" not in "\n".join(code)
    testing.assert_close_to_reference(out, expected, rtol=1e-4, atol=1e-4)


def _compile_swin(model):
    """A Swin model of two blocks (the second with shifted windows) on random images, compiled with fault containment
    off: both window attentions fuse, each its own kernel, nothing falls back. Returns the output, eager's and the
    code."""
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = model(pixels).last_hidden_state
        with testing.cpu_triton(), config.patch(fault_containment=False):
            out, code = testing.compile_and_get_code(lambda x: model(x).last_hidden_state, pixels)
    assert counters["inductor"]["flashlight_attention_fused"] == 2
    assert counters["inductor"]["flashlight_fault_fallback"] == 0
    kernels = testing.triton_kernels(code)
    assert sum("for start_n in range(" in text for text in kernels.values()) == 2
    return out, expected, code


def test_swin_shifted_window_attention_fuses_without_a_fault():
    """Hugging Face's Swin (eager attention, shifted windows): the shifted blocks add the position bias (a table
    gathered per head) and the window mask (computed from positions in the graph) to the scores; the two meet inside
    the score chain, where Inductor's broadcast must not realise the gathered bias (a pointwise subgraph holds no
    buffer: the lowering faulted and the whole graph fell back). Every window attention fuses, nothing falls back,
    no buffer holds a window's scores, and the output matches eager."""
    from transformers import SwinConfig, SwinModel

    torch.manual_seed(0)
    swin = SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2], num_heads=[4],
                      window_size=4, mlp_ratio=1.0, attn_implementation="eager")
    model = SwinModel(swin).eval()
    out, expected, code = _compile_swin(model)
    # The scores: 2 images × 4 windows × 4 heads × 16 × 16 elements; the largest other tensor holds 2048.
    assert max(testing.allocated_buffer_numels(code)) < 2 * 4 * 4 * 16 * 16
    testing.assert_close_to_reference(out, expected, rtol=1e-4, atol=1e-4)


def test_swin_v2_scaled_cosine_attention_fuses():
    """Swin V2: cosine scores (normalised q and k), a learned per-head logit scale clamped and exponentiated (read
    once per program), a continuous position bias from a small MLP over a coordinate table, gathered per head and
    squashed by 16·sigmoid; in the shifted block the window mask is added on a ``[B/nW, nW, H, N, N]`` view of the
    scores (``score_views`` lifts that view to the matmul, the per-head scale and bias regrouped with it). Both
    attentions fuse, nothing falls back, no buffer holds a window's scores, and the output matches eager."""
    from transformers import Swinv2Config, Swinv2Model

    torch.manual_seed(0)
    swin = Swinv2Config(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2], num_heads=[4],
                        window_size=4, mlp_ratio=1.0, attn_implementation="eager")
    model = Swinv2Model(swin).eval()
    with torch.no_grad():
        model.embeddings.norm.weight.normal_()  # (random, so that a wrong row is visible after the norm)
    out, expected, code = _compile_swin(model)
    # The scores: 2 images × 4 windows × 4 heads × 16 × 16 = 8192 elements; the one larger buffer is the position
    # bias MLP's hidden layer, (2·4 − 1)² coordinates × 512.
    numels = testing.allocated_buffer_numels(code)
    assert 2 * 4 * 4 * 16 * 16 not in numels
    assert sorted(numels)[-2:] == [sorted(numels)[-2], 49 * 512] and sorted(numels)[-2] < 2 * 4 * 4 * 16 * 16
    testing.assert_close_to_reference(out, expected, rtol=1e-4, atol=1e-4)
