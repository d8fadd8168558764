"""Give a softmax whose scale is known only at run time its logits back.

Upstream's joint-graph pattern rewrites ``softmax(x · c)`` (and ``x / c``) where c is a tensor (a temperature, or
``1/√d`` when ``torch.compile(dynamic=True)`` makes the head dim symbolic) so that the scale is applied after the row
max: with ``s = where(c ≥ 0, 1, −1)``, ``exp((x·s − max(x·s)) · (s·c))``. No node then holds the logits x·c, and the
attention pass, which looks for ``exp(logits − max logits)``, declines. The rule: where an exp's argument is
exactly that form (the same c in the sign's test and in the factor, the same ``x·s`` on both sides of the
subtraction, the sign chosen between a scalar 1 and its negation), it becomes ``exp(x·c − max(x·c))`` (``x / c``
for the division). That is the user's own program again, before upstream's rewrite, so its values are eager's,
NaN and infinities included; the kernel then scales each logit by c itself. Only a softmax whose values reach a
matmul (attention) is rewritten; nodes the rewrite leaves unused are erased.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._dynamo.utils import counters

from inductor_overlay import config
from inductor_overlay.fx_passes.attention_region import chain_uses
from inductor_overlay.fx_passes.block_sparsity import constant_value, is_op
from inductor_overlay.fx_passes.fx_helpers import _MATMULS, call_op, is_backward

aten = torch.ops.aten


def _sign_of(sign: object) -> Optional[torch.fx.Node]:
    """c when ``sign`` is ``where(c >= 0, one, -one)`` with ``one`` a scalar 1."""
    if not is_op(sign, aten.where.self):
        return None
    test, one, minus_one = sign.args
    if not (is_op(test, aten.ge.Scalar) and test.args[1] == 0):
        return None
    if not (is_op(minus_one, aten.neg.default) and minus_one.args[0] is one and constant_value(one) == 1):
        return None
    return test.args[0]


def _split_scale(argument: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]:
    """(x, c, the row max) when an exp's ``argument`` is ``(x·s − amax(x·s)) · (s·c)`` or ``/ (s·c)``."""
    if not is_op(argument, (aten.mul.Tensor, aten.div.Tensor)):
        return None
    difference, factor = argument.args
    if not (is_op(difference, aten.sub.Tensor) and is_op(factor, aten.mul.Tensor)):
        return None
    signed, row_max = difference.args
    if not (is_op(signed, aten.mul.Tensor) and is_op(row_max, aten.amax.default) and row_max.args[0] is signed):
        return None
    x, sign = signed.args
    scale = _sign_of(sign)
    if scale is None or set(factor.args) != {sign, scale} or factor.args[0] is factor.args[1]:
        return None
    return x, scale, row_max


def rejoin_signed_scales(graph: torch.fx.Graph) -> None:
    if not (config.attention_fusion and config.rejoin_signed_scales):
        return
    for exp in list(graph.find_nodes(op="call_function", target=aten.exp.default)):
        argument = exp.args[0]
        found = _split_scale(argument)
        if found is None or not _weighs_a_matmul(exp):
            continue
        x, scale, row_max = found
        with graph.inserting_before(argument):
            logits = call_op(graph, argument.target, (x, scale))
            shifted = call_op(graph, aten.sub.Tensor, (logits, call_op(graph, aten.amax.default, (logits, *row_max.args[1:]))))
        _number_as_autograd_did(logits, shifted, x, exp)
        exp.replace_input_with(argument, shifted)
        counters["inductor"]["flashlight_signed_scales_rejoined"] += 1
        _erase_unused([argument, *argument.args, row_max, *row_max.args[:1], *argument.args[1].args])


def _weighs_a_matmul(exp: torch.fx.Node) -> bool:
    """Whether the exp's values reach a forward matmul through views and pointwise ops (attention's ``P @ V``). In a
    joint graph the same walk also enters the softmax's backward, which reaches the scores' matmul's backward: those
    matmuls do not count."""
    return any(is_op(user, _MATMULS) and not is_backward(user) for user, _ in chain_uses(exp))


def _number_as_autograd_did(logits: torch.fx.Node, shifted: torch.fx.Node, x: torch.fx.Node, exp: torch.fx.Node) -> None:
    """In a joint graph, the numbers autograd gave the ops (``seq_nr``, which the training pass reads to find an op's
    backward): the softmax's for the row max and the subtraction; for the logits, the number of the user's scaling op
    that upstream's rewrite removed: the one number between x's and the exp's that labels backward nodes and no
    forward node. Where that is not one number, the logits carry none (the training pass then declines)."""
    numbers = {kind: {n.meta.get("seq_nr") for n in exp.graph.nodes if n.op == "call_function" and is_backward(n) == kind}
               for kind in (True, False)}
    low, high = x.meta.get("seq_nr", -1), exp.meta.get("seq_nr")
    if high is None:
        return
    for node in (shifted, *shifted.args[1:]):
        node.meta["seq_nr"] = high
    removed = [n for n in numbers[True] - numbers[False] if n is not None and low < n < high]
    if len(removed) == 1:
        logits.meta["seq_nr"] = removed[0]


def _erase_unused(nodes: list) -> None:
    """Erase those of ``nodes`` (in the order given, users before what they read) that nothing reads any more."""
    for node in nodes:
        if isinstance(node, torch.fx.Node) and node.op == "call_function" and not node.users:
            node.graph.erase_node(node)
