"""The patch manifest: all-or-nothing apply, identity-restoring revert, version and fingerprint guards."""

import dataclasses
import warnings

import pytest
import torch

import flashlight
import torch_patches
from torch_patches import core
from torch_patches.manifest import MANIFEST


def stored_objects(manifest):
    return [patch.current() for patch in manifest]


def test_revert_restores_every_original_object():
    flashlight.disable()
    originals = stored_objects(MANIFEST)
    flashlight.enable()
    patched = stored_objects(MANIFEST)
    assert all(p is not o for p, o in zip(patched, originals))
    flashlight.disable()
    assert all(r is o for r, o in zip(stored_objects(MANIFEST), originals))


def test_manifest_entries_name_their_target_and_reason():
    for patch in MANIFEST:
        assert patch.why, patch.target
        assert len(patch.fingerprint) == 64, patch.target
        assert core.fingerprint(patch.current()) == patch.fingerprint, f"{patch.target} changed upstream"


def test_untested_torch_version_patches_nothing_and_warns_once(monkeypatch):
    flashlight.disable()
    originals = stored_objects(MANIFEST)
    monkeypatch.setattr(torch, "__version__", "2.12.0")
    monkeypatch.setattr(flashlight, "_guard_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert flashlight.enable() is False
        assert flashlight.enable() is False
    guard_warnings = [w for w in caught if issubclass(w.category, flashlight.FlashlightDisabledWarning)]
    assert len(guard_warnings) == 1
    assert "2.12.0" in str(guard_warnings[0].message)
    assert not torch_patches.is_applied()
    assert all(r is o for r, o in zip(stored_objects(MANIFEST), originals))


def _entry(fingerprint, make_replacement=lambda original: (lambda *a, **k: original(*a, **k))):
    return core.Patch(
        module="torch._inductor.compile_fx",
        qualname="compile_fx_inner",
        make_replacement=make_replacement,
        fingerprint=fingerprint,
        why="test",
    )


def test_changed_upstream_target_patches_nothing():
    flashlight.disable()
    original_inner = torch._inductor.compile_fx.compile_fx_inner
    stale = (*MANIFEST, _entry("0" * 64))
    with pytest.raises(torch_patches.FingerprintMismatch, match="compile_fx_inner"):
        core.apply(stale)
    assert not torch_patches.is_applied()
    assert torch._inductor.compile_fx.compile_fx is MANIFEST[0].current()
    assert torch._inductor.compile_fx.compile_fx_inner is original_inner


def test_apply_is_all_or_nothing_when_a_replacement_fails():
    flashlight.disable()
    originals = stored_objects(MANIFEST)
    current = core.fingerprint(torch._inductor.compile_fx.compile_fx_inner)

    def broken(original):
        raise RuntimeError("replacement failed")

    with pytest.raises(RuntimeError, match="replacement failed"):
        core.apply((*MANIFEST, _entry(current, broken)))
    assert not torch_patches.is_applied()
    assert all(r is o for r, o in zip(stored_objects(MANIFEST), originals))


def test_class_attribute_patch_reverts_to_the_stored_descriptor():
    from torch._inductor.scheduler import Scheduler

    original = Scheduler.__dict__["can_fuse"]
    entry = core.Patch(
        module="torch._inductor.scheduler",
        qualname="Scheduler.can_fuse",
        make_replacement=lambda original: (lambda self, *a: original(self, *a)),
        fingerprint=core.fingerprint(original),
        why="test",
    )
    flashlight.disable()
    core.apply((entry,))
    assert Scheduler.__dict__["can_fuse"] is not original
    core.revert()
    assert Scheduler.__dict__["can_fuse"] is original


def test_a_reference_captured_before_apply_follows_the_patch_and_comes_back_on_revert():
    flashlight.disable()
    original_inner = torch._inductor.compile_fx.compile_fx_inner

    def register(check):  # upstream code that took the target once, as a closure does
        return lambda: check

    registered_check = register(original_inner)
    cell = registered_check.__closure__[0]
    entry = dataclasses.replace(_entry(core.fingerprint(original_inner)), captured_by=lambda: [cell])
    core.apply((entry,))
    try:
        assert registered_check() is torch._inductor.compile_fx.compile_fx_inner is not original_inner
    finally:
        core.revert()
    assert registered_check() is original_inner
    assert torch._inductor.compile_fx.compile_fx_inner is original_inner


_POLICY_AFTER_AN_OVERLAY_OFF_FIRST_COMPILE = """
import torch
import flashlight
from torch._inductor.utils import run_and_get_code
from benchmarks import variants

q, k, v = (torch.randn(2, 2, 32, 16) for _ in range(3))
mask = (torch.arange(32)[None] < torch.tensor([[20], [32]])).long()
outcome = []
for overlay in (False, True, False):
    torch._dynamo.reset()
    with flashlight.enabled(overlay):
        _, code = run_and_get_code(torch.compile(variants.key_padding_finfo_min), q, k, v, mask)
    outcome.append("sdpa" if "scaled_dot_product" in "".join(code) else "declined")
print("OUTCOME", *outcome)
"""


def test_the_sdpa_policy_reaches_patterns_registered_while_the_overlay_was_off(tmp_path):
    """A process whose first compilation runs with the overlay off registers upstream's SDPA patterns holding
    upstream's check. Under the default policy the masked key padding must still be declined (fused by the overlay)
    once the overlay is on, and go to SDPA again once it is off."""
    import os
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    result = subprocess.run([sys.executable, "-c", _POLICY_AFTER_AN_OVERLAY_OFF_FIRST_COMPILE], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OUTCOME sdpa declined sdpa" in result.stdout, result.stdout[-2000:]
