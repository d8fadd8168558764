"""Installed, Flashlight activates from `import torch` alone, lazily, and FLASHLIGHT_DISABLE turns it off."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flashlight
import torch_patches

PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    loaded_at_import = sorted(m for m in ("torch._inductor.compile_fx", "inductor_overlay", "torch_patches")
                              if m in sys.modules)
    compiled = torch.compile(lambda x: torch.sin(x) * 2)
    x = torch.randn(16)
    ok = bool(torch.allclose(compiled(x), torch.sin(x) * 2))
    from torch._dynamo.utils import counters
    import torch_patches
    print(json.dumps({
        "loaded_at_import": loaded_at_import,
        "ok": ok,
        "entry_calls": counters["inductor"]["flashlight_compile_fx"],
        "applied": torch_patches.is_applied(),
    }))
    """
)


def run_probe(**env_overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHLIGHT_", "TRITON_INTERPRET"))}
    env.update(env_overrides)
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_plain_torch_compile_goes_through_the_overlay_entry_point():
    report = run_probe()
    assert report["ok"]
    assert report["applied"]
    assert report["entry_calls"] == 1


def test_import_torch_patches_nothing_until_inductor_is_used():
    report = run_probe()
    assert report["loaded_at_import"] == []


def test_disable_variable_turns_the_overlay_off():
    report = run_probe(FLASHLIGHT_DISABLE="1")
    assert report["ok"]
    assert not report["applied"]
    assert report["entry_calls"] == 0


def test_enabled_context_manager_scopes_the_overlay():
    counters = torch._dynamo.utils.counters
    with flashlight.enabled(False):
        assert not torch_patches.is_applied()
        torch.compile(lambda x: x.cos() + 1)(torch.randn(8))
        assert counters["inductor"]["flashlight_compile_fx"] == 0
    assert torch_patches.is_applied()
    torch._dynamo.reset()
    torch.compile(lambda x: x.cos() + 2)(torch.randn(8))
    assert counters["inductor"]["flashlight_compile_fx"] == 1


def test_enabled_context_manager_turns_it_on_for_a_scope_only():
    flashlight.disable()
    with flashlight.enabled():
        assert torch_patches.is_applied()
    assert not torch_patches.is_applied()


def test_overlay_changes_the_fx_graph_cache_key():
    from torch._inductor import config as inductor_config

    from inductor_overlay.compile_fx import _post_grad_pass_config

    on = _post_grad_pass_config(overlay_on=True)["post_grad_custom_pre_pass"]
    assert on is not None and on.uuid() is not None
    with inductor_config.patch(post_grad_custom_pre_pass=on):
        nested = _post_grad_pass_config(overlay_on=True)["post_grad_custom_pre_pass"]
        assert nested.user_pass is None, "the overlay pass must not wrap itself"
    assert _post_grad_pass_config(overlay_on=False)["post_grad_custom_pre_pass"] is None
    from inductor_overlay import config as overlay_config

    default_key = on.uuid()
    with overlay_config.patch(fault_containment=False):
        assert on.uuid() != default_key, "overlay config must be part of the cache key"
