"""Warnings for everything that made the overlay step aside, once per reason."""

from __future__ import annotations

import logging
import warnings

log = logging.getLogger("flashlight.fallback")


class FlashlightFallbackWarning(UserWarning):
    """The overlay failed on a graph; upstream Inductor compiled it instead."""


_warned: set[str] = set()


def warn_once(reason: str) -> None:
    log.warning("%s", reason)
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(reason, FlashlightFallbackWarning, stacklevel=3)


def describe(err: BaseException) -> str:
    """A stable one-line reason: the innermost cause's type and message."""
    while err.__cause__ is not None and err.__cause__ is not err:
        err = err.__cause__
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {message}"[:300]
