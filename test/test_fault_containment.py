"""A failure anywhere in overlay code falls back to upstream Inductor, with one warning per reason."""

import warnings

import pytest
import torch
from torch._inductor.utils import fresh_cache

from flashlight import testing
from inductor_overlay.fallback import FlashlightFallbackWarning
from inductor_overlay.fx_passes import post_grad


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


@pytest.fixture
def failing_overlay_pass(monkeypatch):
    calls = []

    def explode(graph):
        calls.append(graph)
        raise RuntimeError("injected overlay fault")

    monkeypatch.setattr(post_grad, "POST_GRAD_PASSES", [explode])
    with fresh_cache():  # a cache hit would skip the passes, and with them the injected fault
        yield calls


def test_injected_fault_falls_back_and_matches_eager(failing_overlay_pass):
    q, k, v = (torch.randn(2, 3, 24, 16) for _ in range(3))
    counters = torch._dynamo.utils.counters
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with testing.cpu_triton():
            out, code = testing.compile_and_get_code(attention, q, k, v)
    assert failing_overlay_pass, "the overlay pass never ran, so nothing was injected"
    assert counters["inductor"]["flashlight_fault_fallback"] == 1
    messages = [str(w.message) for w in caught if issubclass(w.category, FlashlightFallbackWarning)]
    assert len(messages) == 1 and "injected overlay fault" in messages[0]
    testing.assert_close_to_reference(out, attention(q.double(), k.double(), v.double()))
    assert testing.triton_kernels(code), "the fallback must still be Inductor-generated code"


def test_same_reason_warns_once(failing_overlay_pass):
    from inductor_overlay import fallback

    fallback._warned.clear()
    x = torch.randn(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn in (lambda t: t.sin() + 1, lambda t: t.cos() + 1):
            torch._dynamo.reset()
            torch.compile(fn)(x)
    assert len([w for w in caught if issubclass(w.category, FlashlightFallbackWarning)]) == 1
    assert torch._dynamo.utils.counters["inductor"]["flashlight_fault_fallback"] == 2


def test_without_containment_the_fault_surfaces(failing_overlay_pass):
    from inductor_overlay import config

    with config.patch(fault_containment=False), pytest.raises(Exception, match="injected overlay fault"):
        torch.compile(lambda t: t.sin() + 1)(torch.randn(8))
