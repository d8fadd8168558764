"""The glue between upstream Inductor and the overlay.

Every change Flashlight makes to a torch symbol is an entry in :mod:`torch_patches.manifest`.
:func:`apply` installs all of them or none; :func:`revert` puts every original object back.
"""

from torch_patches.core import (
    FingerprintMismatch,
    Patch,
    PatchGuardError,
    UnsupportedTorchVersion,
    apply,
    fingerprint,
    is_applied,
    revert,
    SUPPORTED_TORCH,
)

__all__ = [
    "FingerprintMismatch",
    "Patch",
    "PatchGuardError",
    "UnsupportedTorchVersion",
    "SUPPORTED_TORCH",
    "apply",
    "fingerprint",
    "is_applied",
    "revert",
]
