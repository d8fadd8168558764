import pytest
import torch
from torch._inductor.utils import fresh_cache

import flashlight


@pytest.fixture(autouse=True, scope="session")
def _first_compilation_with_the_overlay():
    """Upstream captures some pattern checks at the process's first compilation; make that happen with the
    overlay active, as autoload does for users (see inductor_overlay/fx_passes/fuse_attention.py)."""
    flashlight.enable()
    with fresh_cache():
        torch.compile(lambda x: torch.softmax(x @ x.transpose(-1, -2), -1) @ x)(torch.randn(2, 4, 4))
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fresh_compiler_state():
    """Each test starts with the overlay enabled, empty Dynamo and Inductor caches and zeroed counters,
    so no test passes on a kernel another test (or an earlier run) compiled."""
    flashlight.enable()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with fresh_cache():
        yield
    flashlight.enable()
    torch._dynamo.reset()
