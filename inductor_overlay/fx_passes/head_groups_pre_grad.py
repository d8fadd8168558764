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
the same dim ``k`` (after ``k`` full slices, or ``select``); from each, only add, sub, neg, and mul or div by
operands that do not depend on ``X`` and are constant along the contracted dim (a number, or a tensor whose last dim
is 1) lead, through ops with no other user, to the left operand of a matmul; all those matmuls share one right
operand ``V`` of the index's rank; the result of the matmul requires grad (inference keeps the post-grad form, which
combines the heads inside the kernel); the graph mutates nothing in place.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from typing import Any, Optional

import torch

from inductor_overlay import config
from inductor_overlay.fx_passes.fx_helpers import restore_graph

log = logging.getLogger("flashlight.attention_fusion")

_MATMUL_FUNCTIONS = (operator.matmul, torch.matmul)
_LINEAR_FUNCTIONS = {
    operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub", operator.mul: "mul",
    torch.mul: "mul", operator.truediv: "div", torch.div: "div", operator.neg: "neg", torch.neg: "neg",
}
_LINEAR_METHODS = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "neg": "neg"}


def _val(node: Any) -> Any:
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
    shape = getattr(_val(heads), "shape", None)
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


def _depends_on(node: Any, target: torch.fx.Node) -> bool:
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current is target:
            return True
        if isinstance(current, torch.fx.Node) and current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return False


def _constant_along_contraction(coefficient: Any) -> bool:
    if isinstance(coefficient, (int, float)):
        return True
    value = _val(coefficient)
    return isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[-1] == 1)


def _follow_to_matmul(term: torch.fx.Node, heads: torch.fx.Node, chain: list[torch.fx.Node]) -> Optional[torch.fx.Node]:
    """The matmul whose left operand ``term`` reaches through linear ops (appended to ``chain``), or None."""
    node = term
    while True:
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        if _is_matmul(user):
            return user if user.args[0] is node and len(user.args) == 2 and not user.kwargs else None
        kind = _linear_kind(user)
        if kind is None:
            return None
        others = [a for a in (*user.args, *user.kwargs.values()) if a is not node]
        if kind in ("mul", "div"):
            if (kind == "div" and user.args[0] is not node) or not all(_constant_along_contraction(o) for o in others):
                return None
        if any(_depends_on(o, heads) for o in others if isinstance(o, torch.fx.Node)):
            if kind not in ("add", "sub"):
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
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (node.target in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))
            or "out" in node.kwargs or bool(node.kwargs.get("inplace")))


def _plan(heads: torch.fx.Node) -> Optional[tuple[int, torch.fx.Node, dict[torch.fx.Node, list[torch.fx.Node]]]]:
    """``(k, V, {matmul: linear ops from the terms to it})`` when ``heads`` may be distributed over, else None."""
    users = list(heads.users)
    splits = [_split_index(u, heads) for u in users]
    if len(users) < 2 or any(s is None for s in splits) or len({s[0] for s in splits}) != 1:
        return None
    roots: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for term in users:
        chain: list[torch.fx.Node] = []
        matmul = _follow_to_matmul(term, heads, chain)
        if matmul is None:
            return None
        roots.setdefault(matmul, []).extend(chain)
    values = {m.args[1] for m in roots}
    if len(values) != 1:
        return None
    v = values.pop()
    term_value, v_value = _val(users[0]), _val(v)
    if not all(isinstance(x, torch.Tensor) for x in (term_value, v_value, *(_val(m) for m in roots))):
        return None
    if v_value.dim() != term_value.dim() or _depends_on(v, heads) or not all(_val(m).requires_grad for m in roots):
        return None
    # The new matmul reads X and V where the first of the matmuls stands: nothing may be written in between.
    order = {n: i for i, n in enumerate(heads.graph.nodes)}
    window = range(min(order[t] for t in users), max(order[m] for m in roots) + 1)
    if any(_mutates(n) for n in heads.graph.nodes if order[n] in window):
        return None
    return splits[0][0], v, roots


def _with_value(node: torch.fx.Node) -> torch.fx.Node:
    """``node`` with its ``example_value`` computed from its inputs' (a copied node carries its original's)."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _val)
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
    """Pre-grad pass: see the module doc. Any failure leaves the graph unchanged."""
    if not (config.attention_fusion and config.distribute_head_groups_in_training):
        return
    candidates = [n for n in graph.nodes if len(n.users) >= 2 and all(
        _split_index(u, n) is not None for u in n.users)]
    for heads in candidates:
        try:
            plan = _plan(heads)
        except Exception as error:  # noqa: BLE001  (fault containment: analysis only, the graph is untouched)
            log.warning("head groups at %s not analysed (%s: %s)", heads.name, type(error).__name__, error)
            continue
        if plan is None:
            continue
        dim, v, roots = plan
        saved = torch.fx.Graph()
        saved.output(saved.graph_copy(graph, {}))
        try:
            _distribute(graph, heads, dim, v, roots)
        except Exception as error:  # noqa: BLE001
            log.warning("head groups at %s not distributed (%s: %s)", heads.name, type(error).__name__, error)
            restore_graph(graph, saved)
            return
        log.info("matmul %s distributed over the heads of %s before autograd (training)",
                 ", ".join(m.name for m in roots), heads.name)
