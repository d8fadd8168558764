import pytest
import torch

import flashlight


@pytest.fixture(autouse=True)
def _fresh_compiler_state():
    """Each test starts with the overlay enabled, fresh Dynamo caches and zeroed counters."""
    flashlight.enable()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    flashlight.enable()
    torch._dynamo.reset()
