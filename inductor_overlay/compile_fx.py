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

    gm = _without_checked_conds(gm)
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


def _without_checked_conds(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with each ``cond`` a checked route put in a graph that trains (its branches hold overlay ops) replaced
    by its second branch, inlined: the copy that reads the tensors as the program does, right whatever the check
    answers (``fx_passes/trained_branches.py``)."""
    conds = [node for node in gm.graph.nodes if node.target is torch.ops.higher_order.cond
             and any(_holds_overlay_ops(getattr(gm, arg.target)) for arg in node.args[1:3])]
    if not conds:
        return gm
    gm = _clone_graph_module(gm)
    for node in [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.cond and n.name in {c.name for c in conds}]:
        branch = getattr(gm, node.args[2].target)
        with gm.graph.inserting_before(node):
            outputs = _inline(gm, branch, list(node.args[3]))
        for user in list(node.users):
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _inline(gm: torch.fx.GraphModule, branch: torch.fx.GraphModule, operands: list) -> list:
    """``branch``'s nodes copied into ``gm``'s graph at the insertion point, reading ``operands``; its outputs. Its
    subgraphs (get_attr) become ``gm``'s own."""
    env = dict(zip(branch.graph.find_nodes(op="placeholder"), operands))
    for node in branch.graph.nodes:
        if node.op == "get_attr":
            name = f"{branch._get_name()}_{node.target}_{len(gm._modules)}"
            gm.add_submodule(name, getattr(branch, node.target))
            env[node] = gm.graph.get_attr(name)
        elif node.op == "call_function":
            env[node] = gm.graph.node_copy(node, env.__getitem__)
    return [env[value] for value in branch.graph.find_nodes(op="output")[0].args[0]]


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
