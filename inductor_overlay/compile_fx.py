"""Flashlight's entry into Inductor: a wrapper around ``torch._inductor.compile_fx.compile_fx``.

It installs the overlay's post-grad pass for the compilation and contains faults: if a graph fails to
compile while the overlay is active, the same graph is compiled again with the overlay suspended, so the
user's program gets upstream Inductor's result instead of an exception.
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters

from inductor_overlay import config as overlay_config
from inductor_overlay.fallback import describe, warn_once
from inductor_overlay.state import overlay_active, suspended

_entered = threading.local()

# Exceptions Inductor and Dynamo use for control flow; they are not faults.
_CONTROL_FLOW = (
    torch._dynamo.exc.RestartAnalysis,
    torch._dynamo.exc.SkipFrame,
)


def _clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose graph later passes may mutate without touching ``gm`` (tensors are shared)."""
    clone = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    clone.meta = dict(gm.meta)
    return clone


def _unfused(gm: torch.fx.GraphModule, example_inputs: Any) -> torch.fx.GraphModule:
    """``gm`` with every overlay node traced into the aten ops of its meaning (``ops.py``), so that upstream's path
    can compile it: the fused forward and backward a joint-graph pass put into a graph that trains reach the inner
    compiler already in place, where a post-grad fusion does not. ``gm`` itself when it holds none."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from inductor_overlay import ops

    gm = _with_branches_unfused(gm)
    if not any(node.op == "call_function" and node.target in ops.FAKE_IMPLS for node in gm.graph.nodes):
        return gm
    inputs = list(example_inputs)
    fake_mode = torch._guards.detect_fake_mode(inputs)

    # Run node by node, not through the module's code: a size the passes wrote into a node's arguments as a SymInt
    # (a reshape to a symbolic shape) prints there as a name the code does not define.
    def interpreted(*args: Any) -> Any:
        return torch.fx.Interpreter(gm).run(*args)

    if fake_mode is None:
        return make_fx(interpreted, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs)
    with fake_mode:
        return make_fx(interpreted, decomposition_table=select_decomp_table())(*inputs)


def _holds_overlay_ops(module: Any) -> bool:
    from inductor_overlay import ops

    return isinstance(module, torch.fx.GraphModule) and any(
        node.op == "call_function" and node.target in ops.FAKE_IMPLS for node in module.graph.nodes
    )


def _with_branches_unfused(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with the branches of each checked route's ``cond`` (``checked_branches.cond_outputs``) that hold overlay
    ops traced into the aten ops of their meaning, the ``cond`` kept: the forward and the backward graphs fall back
    one at a time, and each must still take the branch the other took (the flag the forward saved)."""
    conds = [node for node in gm.graph.nodes if node.meta.get("flashlight_route")]
    branches = {arg.target for node in conds for arg in node.args[1:3] if _holds_overlay_ops(getattr(gm, arg.target))}
    if not branches:
        return gm
    gm = _clone_graph_module(gm)
    for name in branches:
        setattr(gm, name, _traced_meaning(getattr(gm, name)))
    gm.recompile()
    return gm


def _traced_meaning(branch: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``branch`` traced, node by node, into the aten ops its nodes mean, at its inputs' fake values."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    values = [node.meta["val"] for node in branch.graph.find_nodes(op="placeholder")]
    mode = torch._guards.detect_fake_mode(values) or torch._subclasses.FakeTensorMode()
    with mode:
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in values]
        return make_fx(lambda *args: torch.fx.Interpreter(branch).run(*args),
                       decomposition_table=select_decomp_table())(*inputs)


def _post_grad_pass_config(overlay_on: bool) -> dict[str, Any]:
    from torch._inductor import config as inductor_config

    from inductor_overlay.fx_passes.post_grad import FlashlightJointPass, FlashlightPostGradPass, FlashlightPreGradPass

    passes = {}
    seams = (
        ("post_grad_custom_pre_pass", FlashlightPostGradPass),
        ("joint_custom_post_pass", FlashlightJointPass),
        ("pre_grad_custom_pass", FlashlightPreGradPass),
    )
    for seam, overlay_pass in seams:
        user_pass = getattr(inductor_config, seam)
        if isinstance(user_pass, FlashlightPostGradPass):
            user_pass = user_pass.user_pass
        passes[seam] = overlay_pass(user_pass) if overlay_on else user_pass
    return passes


def contain_faults(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Inductor's inner compiler (forward and backward graphs) with the fallback to upstream."""
    if getattr(inner_compile, "_flashlight_contained", False):
        return inner_compile

    @functools.wraps(inner_compile)
    def contained(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._inductor import config as inductor_config

        if not overlay_active():
            return inner_compile(gm, example_inputs, **kwargs)
        pristine = _clone_graph_module(gm) if overlay_config.fault_containment else None
        try:
            with inductor_config.patch(_post_grad_pass_config(overlay_on=True)):
                return inner_compile(gm, example_inputs, **kwargs)
        except _CONTROL_FLOW:
            raise
        except Exception as err:
            if pristine is None:
                raise
            counters["inductor"]["flashlight_fault_fallback"] += 1
            warn_once(
                f"Flashlight: compiling a graph with the overlay failed ({describe(err)}); "
                "it was compiled again on upstream Inductor's path"
            )
            with suspended(), inductor_config.patch(_post_grad_pass_config(overlay_on=False)):
                return inner_compile(_unfused(pristine, example_inputs), example_inputs, **kwargs)

    contained._flashlight_contained = True  # type: ignore[attr-defined]
    return contained


def wrap_compile_fx(upstream_compile_fx: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(upstream_compile_fx)
    def compile_fx(model_: Any, example_inputs_: Any, inner_compile: Any = None, *args: Any, **kwargs: Any) -> Any:
        if inner_compile is None:
            from torch._inductor.compile_fx import compile_fx_inner as inner_compile
        if getattr(_entered, "depth", 0) or not overlay_active():
            return upstream_compile_fx(model_, example_inputs_, inner_compile, *args, **kwargs)
        from torch._inductor import config as inductor_config

        counters["inductor"]["flashlight_compile_fx"] += 1
        _entered.depth = 1
        try:
            # Set here, not only in the inner compiler, so AOTAutograd's cache key sees the overlay too.
            with inductor_config.patch(_post_grad_pass_config(overlay_on=True)):
                return upstream_compile_fx(model_, example_inputs_, contain_faults(inner_compile), *args, **kwargs)
        finally:
            _entered.depth = 0

    return compile_fx
