"""Installed, Flashlight activates from `import torch` alone, lazily, and FLASHLIGHT_DISABLE turns it off."""

import json
import os
import subprocess
import sys
import textwrap

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


def test_disabled_scope_as_first_use_stays_off():
    """`enabled(False)` before Inductor was ever imported must not let the autoload hook switch it on inside."""
    probe = textwrap.dedent(
        """
        import json, torch, flashlight
        from torch._dynamo.utils import counters
        with flashlight.enabled(False):
            torch.compile(lambda x: x.sin() + 1)(torch.randn(4))
            inside = counters["inductor"]["flashlight_compile_fx"]
        print(json.dumps({"inside": inside, "after": flashlight.is_enabled()}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHLIGHT_")}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"inside": 0, "after": True}


def test_cached_kernels_follow_the_overlay_state():
    """Inductor's caches key on the overlay: a cached upstream kernel is never served to the overlay or back."""
    from flashlight import testing
    from benchmarks.variants import causal_masked_fill

    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    kernels = {}
    with testing.cpu_triton():
        for overlay in (False, True, False, True):
            with flashlight.enabled(overlay):
                _, code = testing.compile_and_get_code(causal_masked_fill, q, k, v, fresh_cache=False)
            kernels.setdefault(overlay, set()).add(tuple(testing.triton_kernels(code)))
    assert len(kernels[True]) == 1 and len(kernels[False]) == 1
    (fused,), (upstream,) = kernels[True], kernels[False]
    assert len(fused) == 1 and fused[0].startswith("triton_tem_")
    assert all(not name.startswith("triton_tem_") for name in upstream)


def test_torch_logs_flashlight_shows_fused_and_declined_attention():
    probe = textwrap.dedent(
        """
        import torch
        from flashlight import testing
        from benchmarks.variants import causal_masked_fill
        q = torch.randn(1, 2, 16, 16)
        with testing.cpu_triton():
            testing.compile_and_get_code(causal_masked_fill, q, q, q)
            testing.compile_and_get_code(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) + 1, -2) @ v, q, q, q)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHLIGHT_", "TRITON_INTERPRET"))}
    env.update(TORCH_LOGS="flashlight", PYTHONPATH=os.getcwd())
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "attention fused at" in result.stderr
    assert "attention not fused at" in result.stderr and "reduce the last dim" in result.stderr
