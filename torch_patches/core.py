"""Apply and revert the patch manifest as one unit, behind a version and fingerprint guard."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import threading
from typing import Any, Callable, Iterable, Optional, Sequence

SUPPORTED_TORCH = "2.11."


class PatchGuardError(RuntimeError):
    """Raised by :func:`apply` when the manifest must not be applied to this torch."""


class UnsupportedTorchVersion(PatchGuardError):
    pass


class FingerprintMismatch(PatchGuardError):
    pass


@dataclasses.dataclass(frozen=True)
class Patch:
    """One upstream symbol replaced by overlay code.

    ``make_replacement(original)`` returns the object installed in place of ``module.qualname``;
    wrappers receive the original so they can call it. ``fingerprint`` is the sha256 of the
    upstream target's source when the patch was written (``tools/refresh_fingerprints.py``).

    Upstream code that took a reference to the target before the patch applied (a closure registered once per
    process) keeps calling the original. ``captured_by()``, where given, lists the closure cells that may hold such a
    reference: those holding the original point at the replacement while the patch is applied.
    """

    module: str
    qualname: str
    make_replacement: Callable[[Any], Any]
    fingerprint: str
    why: str = ""
    captured_by: Optional[Callable[[], Iterable[Any]]] = None

    @property
    def target(self) -> str:
        return f"{self.module}.{self.qualname}"

    def owner_and_name(self) -> tuple[Any, str]:
        owner: Any = importlib.import_module(self.module)
        *path, name = self.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def current(self) -> Any:
        """The object now stored under the symbol, as stored (unbound, descriptors kept)."""
        owner, name = self.owner_and_name()
        if inspect.isclass(owner):
            return owner.__dict__[name]
        return getattr(owner, name)


def fingerprint(obj: Any) -> str:
    """sha256 of an upstream object's source; changes whenever upstream edits the target."""
    target = getattr(obj, "__func__", obj)
    return hashlib.sha256(inspect.getsource(target).encode()).hexdigest()


_lock = threading.RLock()
_originals: dict[str, tuple[Patch, Any]] = {}
_rebound_cells: list[tuple[Any, Any, Any]] = []  # (cell, original, replacement)


def is_applied() -> bool:
    return bool(_originals)


def check(manifest: Sequence[Patch]) -> None:
    """Raise a :class:`PatchGuardError` naming every reason the manifest cannot apply here."""
    import torch

    if not torch.__version__.startswith(SUPPORTED_TORCH):
        raise UnsupportedTorchVersion(
            f"torch {torch.__version__} is not a tested version (Flashlight supports {SUPPORTED_TORCH}x)"
        )
    changed = []
    for patch in manifest:
        try:
            found = fingerprint(patch.current())
        except Exception as err:  # missing module/attribute counts as a changed target
            changed.append(f"{patch.target} (cannot read: {type(err).__name__}: {err})")
            continue
        if found != patch.fingerprint:
            changed.append(f"{patch.target} (fingerprint {found[:12]} != {patch.fingerprint[:12]})")
    if changed:
        raise FingerprintMismatch("upstream targets changed since the patches were written: " + "; ".join(changed))


def apply(manifest: Sequence[Patch] | None = None) -> None:
    """Install every patch, or none: guard first, then swap all symbols, undoing on any failure."""
    if manifest is None:
        from torch_patches.manifest import MANIFEST as manifest
    for patch in manifest:
        # Import targets first: importing Inductor may itself trigger the autoload hook's apply().
        importlib.import_module(patch.module)
    with _lock:
        if _originals:
            return
        check(manifest)
        try:
            for patch in manifest:
                original = patch.current()
                owner, name = patch.owner_and_name()
                _originals[patch.target] = (patch, original)
                replacement = patch.make_replacement(original)
                setattr(owner, name, replacement)
                _rebind_captured(patch, original, replacement)
        except BaseException:
            revert()
            raise


def revert() -> None:
    """Put every original object back (identity, not a copy)."""
    with _lock:
        for cell, original, replacement in reversed(_rebound_cells):
            if cell.cell_contents is replacement:
                cell.cell_contents = original
        _rebound_cells.clear()
        for patch, original in reversed(list(_originals.values())):
            owner, name = patch.owner_and_name()
            setattr(owner, name, original)
        _originals.clear()


def _rebind_captured(patch: Patch, original: Any, replacement: Any) -> None:
    if patch.captured_by is None:
        return
    for cell in patch.captured_by():
        if cell.cell_contents is original:
            cell.cell_contents = replacement
            _rebound_cells.append((cell, original, replacement))
