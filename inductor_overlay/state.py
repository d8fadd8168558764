"""Whether overlay code may act in the current compilation."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_suspended: contextvars.ContextVar[bool] = contextvars.ContextVar("flashlight_suspended", default=False)


def overlay_active() -> bool:
    from inductor_overlay import config

    return config.enabled and not _suspended.get()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Run the enclosed compilation exactly as upstream Inductor would."""
    token = _suspended.set(True)
    try:
        yield
    finally:
        _suspended.reset(token)
