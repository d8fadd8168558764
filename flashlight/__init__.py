"""Flashlight: one fused online-softmax Triton kernel per attention, from plain PyTorch, under torch.compile.

Installed, it is on by default (loaded through torch's ``torch.backends`` entry point, patched in lazily when
Inductor is first used). ``FLASHLIGHT_DISABLE=1`` turns the automatic activation off; :func:`enable`,
:func:`disable` and the :func:`enabled` context manager control it explicitly.

This module must stay cheap to import: torch imports it on every ``import torch``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

__version__ = "0.1.0"


class FlashlightDisabledWarning(UserWarning):
    """Flashlight could not activate on this torch; Inductor runs unchanged."""


_guard_warned = False


def _settle_autoload() -> None:
    """Import Inductor's entry module now, so an armed autoload hook fires before state is read or changed."""
    import torch._inductor.compile_fx  # noqa: F401


def enable() -> bool:
    """Install the overlay's patches. Returns False (with one warning) if this torch cannot take them."""
    import torch_patches

    _settle_autoload()
    try:
        torch_patches.apply()
    except torch_patches.PatchGuardError as err:
        _warn_guard(str(err))
        return False
    return True


def disable() -> None:
    """Revert every patch: Inductor is upstream again (compilations already made keep their kernels)."""
    import torch_patches

    _settle_autoload()
    torch_patches.revert()


def is_enabled() -> bool:
    import torch_patches

    _settle_autoload()
    return torch_patches.is_applied()


@contextlib.contextmanager
def enabled(active: bool = True) -> Iterator[None]:
    """Turn the overlay on (or off) for compilations that happen inside the block, then restore.

    torch.compile compiles on the first call, so the call must be inside the block; a function compiled
    before the block keeps its code (``torch._dynamo.reset()`` forces recompilation). Not thread-safe.
    """
    was_enabled = is_enabled()
    if active:
        enable()
    else:
        disable()
    try:
        yield
    finally:
        if was_enabled:
            enable()
        else:
            disable()


def _warn_guard(reason: str) -> None:
    global _guard_warned
    if not _guard_warned:
        _guard_warned = True
        warnings.warn(f"Flashlight is not active: {reason}. Inductor runs unchanged.", FlashlightDisabledWarning, 3)


def _enable_from_autoload() -> None:
    """Called by the import hook; must never break the user's import of Inductor."""
    try:
        enable()
    except Exception as err:  # an unexpected failure is reported, never raised into `import torch._inductor`
        _warn_guard(f"activation failed ({type(err).__name__}: {err})")
