"""Differential attention in training: the output matmul distributed over the heads' combination before autograd.

DIFF Transformer computes ``(X[:, :, 0] - λ·X[:, :, 1]) @ V`` with ``X`` one softmax over 2h heads viewed as
``[B, h, 2, M, N]`` (or ``X[:, :, 0] @ V - λ·(X[:, :, 1] @ V)``). Inference distributes the matmul after autograd
(``head_combination.py``, on aten ops). In training that is too late: autograd has already differentiated the
combination of M×N probabilities, and the backward holds M×N gradients. Here, on Dynamo's graph (torch IR), before
autograd, the same identity is applied:

    ``(Σ_j c_j·X[.., j, :, :]) @ V  =  Σ_j c_j·O[.., j, :, :]``  with  ``O = X @ V.unsqueeze(k)``

— one attention over all heads, V's head ``i`` read by the heads of group ``i`` through a broadcast (GQA's form),
which trains fused; autograd then differentiates the combination of the ``[.., M, Dv]`` outputs, λ's gradient
included.

Rule (each point checked, otherwise the graph is left as it is): every use of ``X`` is an integer index at one and
the same dim ``k`` (after ``k`` full slices, or ``select``), a term; from each term, through ops with no other user,
only these lead to the left operand of a matmul: add or sub of two values of the combination (terms, or such ops
of them; a number or another tensor added would not distribute), neg, and mul or div by an operand that does not
depend on ``X`` and is constant along the contracted dim (a number, a 0-d tensor, or a tensor whose last dim is
1), the term once among its operands; all those matmuls share one right operand ``V`` of the terms' rank and
dtype, every value of the combination has that dtype and requires grad (inference, and a combination made under
``no_grad``, keep the post-grad form, which combines the heads inside the kernel); between the first term and the
last matmul nothing is written in place and no grad-mode or autocast region begins or ends (the copies run where
the matmuls stand).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from typing import Any, Optional

import torch

from inductor_overlay import config
from inductor_overlay.fx_passes.block_sparsity import depends_on
from inductor_overlay.fx_passes.fx_helpers import restore_graph

log = logging.getLogger("flashlight.attention_fusion")

_MATMUL_FUNCTIONS = (operator.matmul, torch.matmul)
_LINEAR_FUNCTIONS = {
    operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub", operator.mul: "mul",
    torch.mul: "mul", operator.truediv: "div", torch.div: "div", operator.neg: "neg", torch.neg: "neg",
}
_LINEAR_METHODS = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "neg": "neg"}


def _example(node: Any) -> Any:
    """Dynamo's value of ``node`` (its ``example_value``; fx_helpers._val reads the post-grad ``val``)."""
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node


def _linear_kind(node: torch.fx.Node) -> Optional[str]:
    if node.op == "call_function":
        kind = _LINEAR_FUNCTIONS.get(node.target)
    elif node.op == "call_method":
        kind = _LINEAR_METHODS.get(node.target)
    else:
        return None
    if kind is None or set(node.kwargs) - ({"alpha"} if kind in ("add", "sub") else set()):
        return None
    return kind


def _is_matmul(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS) or (
        node.op == "call_method" and node.target == "matmul"
    )


def _split_index(node: torch.fx.Node, heads: torch.fx.Node) -> Optional[tuple[int, int]]:
    """``(k, j)`` when ``node`` is ``heads[:, ..k full slices.., j]`` or ``heads.select(k, j)``."""
    shape = getattr(_example(heads), "shape", None)
    if shape is None:
        return None
    if node.op == "call_function" and node.target is operator.getitem and node.args[0] is heads:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        k = 0
        while k < len(index) and index[k] == slice(None):
            k += 1
        rest = index[k + 1:]
        if k == len(index) or type(index[k]) is not int or any(i != slice(None) for i in rest):
            return None
        dim, j = k, index[k]
    elif node.op == "call_method" and node.target == "select" and node.args[0] is heads and len(node.args) == 3:
        dim, j = node.args[1], node.args[2]
        if type(dim) is not int or type(j) is not int:
            return None
        dim %= len(shape)
    else:
        return None
    if dim > len(shape) - 3 or type(shape[dim]) is not int:
        return None
    return dim, j % shape[dim]


def _constant_along_contraction(coefficient: Any) -> bool:
    if isinstance(coefficient, (int, float)):
        return True
    value = _example(coefficient)
    return isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[-1] == 1)


def _follow_to_matmul(term: torch.fx.Node, heads: torch.fx.Node, chain: list[torch.fx.Node],
                      joins: list[Any]) -> Optional[torch.fx.Node]:
    """The matmul whose left operand ``term`` reaches through linear ops (appended to ``chain``), or None. The other
    operand of each add or sub is appended to ``joins``: it must be a term or an op of the same combination."""
    node = term
    while True:
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        if _is_matmul(user):
            return user if user.args[0] is node and len(user.args) == 2 and not user.kwargs else None
        kind = _linear_kind(user)
        if kind is None or not isinstance(user.kwargs.get("alpha", 1), (int, float)):
            return None
        operands = list(user.args)
        if operands.count(node) != 1 or len(operands) != (1 if kind == "neg" else 2):
            return None
        other = next((o for o in operands if o is not node), None)
        if kind in ("add", "sub"):
            joins.append(other)
        elif kind in ("mul", "div"):
            if (kind == "div" and operands[0] is not node) or not _constant_along_contraction(other):
                return None
            if isinstance(other, torch.fx.Node) and depends_on(other, heads, {}):
                return None  # a product of two terms is not linear
        chain.append(user)
        node = user


_IN_PLACE_OPERATORS = frozenset([
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
])


def _mutates(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write a tensor in place (conservative: any ``foo_`` method or function too)."""
    if node.op not in ("call_method", "call_function"):
        return False
    if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (node.target in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
            or "out" in node.kwargs or bool(node.kwargs.get("inplace")))


def _changes_mode(node: torch.fx.Node) -> bool:
    """Whether ``node`` enters or leaves a grad-mode or autocast region (the copies must run in the originals')."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and any(
        word in name for word in ("grad_enabled", "autocast", "inference_mode", "no_grad", "enable_grad"))


def _plan(heads: torch.fx.Node) -> Optional[tuple[int, torch.fx.Node, dict[torch.fx.Node, list[torch.fx.Node]]]]:
    """``(k, V, {matmul: linear ops from the terms to it})`` when ``heads`` may be distributed over, else None."""
    users = list(heads.users)
    splits = [_split_index(u, heads) for u in users]
    if len(users) < 2 or any(s is None for s in splits) or len({s[0] for s in splits}) != 1:
        return None
    roots: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    joins: list[Any] = []
    for term in users:
        chain: list[torch.fx.Node] = []
        matmul = _follow_to_matmul(term, heads, chain, joins)
        if matmul is None:
            return None
        roots.setdefault(matmul, []).extend(chain)
    combination = {*users, *(op for chain in roots.values() for op in chain)}
    if not all(isinstance(other, torch.fx.Node) and other in combination for other in joins):
        return None  # an add of anything but the combination's own terms is not distributive
    values = {m.args[1] for m in roots}
    if len(values) != 1:
        return None
    v = values.pop()
    nodes = [*combination, v, *roots]
    if not all(isinstance(_example(n), torch.Tensor) for n in nodes):
        return None
    term_value, v_value = _example(users[0]), _example(v)
    if v_value.dim() != term_value.dim() or depends_on(v, heads, {}) or len({_example(n).dtype for n in nodes}) != 1:
        return None
    if not all(_example(n).requires_grad for n in [*combination, *roots]):
        return None
    # The new matmul reads X and V where the first of the matmuls stands, the copies run beside each matmul:
    # nothing may be written, nor a grad-mode or autocast region entered or left, in between.
    order = {n: i for i, n in enumerate(heads.graph.nodes)}
    window = range(min(order[t] for t in users), max(order[m] for m in roots) + 1)
    if any(_mutates(n) or _changes_mode(n) for n in heads.graph.nodes if order[n] in window):
        return None
    return splits[0][0], v, roots


def _with_value(node: torch.fx.Node) -> torch.fx.Node:
    """``node`` with its ``example_value`` computed from its inputs' (a copied node carries its original's)."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _example)
    modes = {id(t.fake_mode): t.fake_mode for t in (*args, *kwargs.values()) if hasattr(t, "fake_mode")}
    with next(iter(modes.values())) if len(modes) == 1 else contextlib.nullcontext():
        if node.op == "call_method":
            node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            node.meta["example_value"] = node.target(*args, **kwargs)
    return node


def _distribute(graph: torch.fx.Graph, heads: torch.fx.Node, dim: int, v: torch.fx.Node,
                roots: dict[torch.fx.Node, list[torch.fx.Node]]) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    terms = list(heads.users)
    with graph.inserting_before(min(roots, key=order.__getitem__)):
        shared = _with_value(graph.call_method("unsqueeze", (v, dim)))
        outputs = _with_value(graph.call_function(operator.matmul, (heads, shared)))
    replaced: list[torch.fx.Node] = [*terms]
    for matmul, chain in roots.items():
        with graph.inserting_before(matmul):
            mapping = {t: _with_value(graph.node_copy(t, lambda n: outputs if n is heads else n)) for t in terms}
            for op in sorted(set(chain), key=order.__getitem__):
                mapping[op] = _with_value(graph.node_copy(op, lambda n: mapping.get(n, n)))
        matmul.replace_all_uses_with(mapping[matmul.args[0]])
        replaced += [matmul, *chain, *mapping.values()]
    for node in sorted(set(replaced), key=lambda n: order.get(n, len(order)), reverse=True):
        if not node.users:
            graph.erase_node(node)


def distribute_head_groups_before_autograd(graph: torch.fx.Graph) -> None:
    """Pre-grad pass: see the module doc. Any failure leaves the graph as it was (this seam runs outside the
    compile step whose faults fall back to upstream)."""
    if not (config.attention_fusion and config.distribute_head_groups_in_training):
        return
    saved = None
    try:
        candidates = [n for n in graph.nodes if len(n.users) >= 2 and all(
            _split_index(u, n) is not None for u in n.users)]
        for heads in candidates:
            plan = _plan(heads)
            if plan is None:
                continue
            if saved is None:
                saved = torch.fx.Graph()
                saved.output(saved.graph_copy(graph, {}))
            _distribute(graph, heads, *plan)
            log.info("matmul %s distributed over the heads of %s before autograd (training)",
                     ", ".join(m.name for m in plan[2]), heads.name)
    except Exception as error:  # noqa: BLE001  (fault containment)
        if not config.fault_containment:
            raise
        log.warning("head groups not distributed (%s: %s); the graph is left as it was", type(error).__name__, error)
        if saved is not None:
            restore_graph(graph, saved)
