"""Attention masked by tensors made outside the graph runs as the in-function causal form (on SDPA's causal kernel
where the SDPA route takes that form) while those tensors hold exactly the causal mask, reading them otherwise.

Legality. A softmax region over a square score matrix (with no pair output) computes exactly its copy in which its
masks are the causal formula whenever its masks mask exactly ``n > m`` for every batch entry. Its masks are either
- every ``where`` on the score path that fills where a condition computed without the scores says so, with -inf or
  with a finite constant that absorbs wherever every row keeps a key (``fills_absorbing_where_rows_keep_keys``:
  Hugging Face GPT-2's ``where(bias[..., :T, :T], w, finfo.min)``), the chain having no other -inf ``where``; they
  mask where the OR of their conditions holds, which then keeps each row's own key; or
- one float bias ``[..., M, M]`` added to the logits as the last op on the score path, whatever the chain computes
  before it from the scores without reading another floating tensor or a constant of 2^64 or more (``additive_bias``,
  ``_bounded_logits``: Hugging Face's 4-D masks, ``nn.Transformer``'s float masks, a causal mask added after a
  soft-cap or after ALiBi's bias computed in the graph), which masks ``n > m`` when it is 0 on and below the
  diagonal (each row's largest bias, at its own key) and ``ABSORBING_BIAS_GAP`` or more below 0 above it (in the
  logits' units and, scaled by the softmax's factor, in the softmax's).
A fill or bias that absorbs does so for logits (before the bias) of magnitude up to 2^124
(``block_sparsity.ABSORBING_FILL``), as the fused kernel's own tile skipping assumes: beyond that, or for a NaN or
infinite logit above the diagonal, which the causal attention never reads, the two may differ.
The graph cannot know which: the masks read tensors made outside it (a registered ``tril`` buffer sliced to the
length, positions made once, a mask passed in). So the region becomes
``torch.cond(known_causal(tensors), causal_branch, fused_branch, operands)``, where ``mask_checks.known_causal``
answers on the host from checks it ran, on the device, on earlier calls with the same tensors at the same version
(for a bias, of its elements' states: 0, absorbing, or neither, which never matches). Both branches are copies of
the region's own nodes: the first with its masks made the causal formula (each condition replaced by ``~(n <= m)``
over iotas, a bias's add by a -inf ``where`` of it), then fused as the in-function causal form is (SDPA's causal
kernel where ``sdpa_route`` takes it: a constant scale, fp16/bf16, the operands SDPA reads; else ours, with its
tiles skipped by the formula); the second fused as any region is. A region whose masks read no tensor the graph is
given (positions built in the graph, decided at compile time) or read one through a random op is left to the fused
kernel alone. Regions of one graph whose masks read the same tensors the same way share one check.

In training (a joint graph, ``route_training_when_causal``) each copy holds the region's forward and its backward:
the first's backward computes the region's gradients wherever the check holds (a logit masked, by -inf or an
absorbing fill, adds exactly 0 to its row's sums either way), as long as no tensor the chain reads is learned where
the mask is a bias (the copy would not compute that gradient). Each copy is fused as a pair (the first as the
in-function causal form trains: on SDPA's forward and backward kernels where SDPA takes it, else on ours);
``trained_branches`` puts the forward and the backward each under a ``cond`` on the one check. Only where the
graph's code runs in Python outside CUDA graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import torch

from inductor_overlay import config
from inductor_overlay.fx_passes.attention_region import AttentionRegion
from inductor_overlay.fx_passes.block_sparsity import (
    ABSORBING_BIAS_GAP,
    additive_bias,
    constant_value,
    depends_on,
    fill_is_true_branch,
    fills_a_score,
    fills_absorbing_where_rows_keep_keys,
    masked_terms,
    position_masks,
)
from inductor_overlay.fx_passes.checked_branches import (
    ancestors,
    branch_on,
    branch_output,
    finished,
    is_input,
    python_wrapper_without_graphs,
    region_branch,
    shared_check,
)
from inductor_overlay.fx_passes.fx_helpers import call_op, prims
from inductor_overlay.fx_passes.trained_branches import route_pair
from inductor_overlay.fx_passes.sdpa_route import _FUSED_SDPA_OPS, _logical_shape
from inductor_overlay.mask_checks import CHECK_GLOBALS, known_causal

aten = torch.ops.aten

# The least work (batch · rows · columns · head dim) the route takes. Below it the call is bound by the host, where
# the check (~13 us a call) and cuDNN's own host work (70-100 us a call, against ~10 us a Triton launch) cost more
# than SDPA's kernel saves: on the H200 at 16x16x1024x64 (2^34) a mask passed in took 0.18-0.33 ms a call under the
# route and 0.155 ms fused; at 2^36 and more (8x16x2048x128, 4x32x4096x64, 1x16x16384x128) the route took 12-32% less
# time (results/written_forms/causal_route_h200/route_on_off.txt).
MIN_WORK = 2**35


@dataclasses.dataclass(frozen=True)
class CausalMasks:
    """What masks a region's logits where tensors the graph is given say so: ``where`` nodes, or one bias added to
    the scores (``additive_bias``), whose elements count as masked at most ``absorbing``."""

    wheres: tuple = ()
    bias: Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]] = None  # the add, its scores' side, the bias
    absorbing: float = 0.0


def causal_route_masks(region: AttentionRegion) -> Optional[CausalMasks]:
    """The region's masks when they mask as the module's rule says and read tensors the graph is given, with work
    enough for the route to pay (``MIN_WORK``)."""
    masks = _tensor_masks(region)
    return masks if masks is not None and attention_work(region) >= MIN_WORK else None


def _tensor_masks(region: AttentionRegion) -> Optional[CausalMasks]:
    """The region's masks where each masks the scores as the rule says and some read tensors the graph is given,
    over a square score matrix, with the switch on and the graph's code in Python; else None."""
    if not config.causal_tensor_route or region.captured_sizes or not python_wrapper_without_graphs():
        return None
    if not region.softmax or region.pair is not None:  # (a pair output reads the probabilities outside the copy)
        return None
    if not all(isinstance(size, int) for size in region.score_root.meta["val"].shape):
        return None  # (a symbolic length: the check and the formula are built for one size)
    *_, rows, columns = region.score_root.meta["val"].shape
    fills = fills_absorbing_where_rows_keep_keys(region.chain, region.score_root, region.logits, region.logit_scale)
    wheres = [node for node in region.chain if masked_terms(node, fills) is not None]
    if not wheres:
        masks = _additive_mask(region)
        return masks if masks is not None and rows == columns else None
    if rows != columns or not all(_masks_the_scores(node, region) for node in wheres):
        return None
    if len(position_masks(region.chain, region.score_root, fills)[1]) == len(wheres):  # decided when compiling
        return None
    return CausalMasks(tuple(wheres))


def _additive_mask(region: AttentionRegion) -> Optional[CausalMasks]:
    """A bias ``[..., M, N]`` added last to the logits as ``additive_bias`` finds it (HF's 4-D ``finfo.min`` masks,
    ``nn.Transformer``'s float masks), read from tensors the graph is given: masked where it lies
    ``ABSORBING_BIAS_GAP`` below 0 in the softmax's units. Where the check finds it 0 on and below the diagonal and
    that low above it, every row keeps its own key with bias 0, its row's largest, and the keys above it add exactly
    0 to every sum, as -inf's do."""
    found = additive_bias(region.chain, region.logits, region.score_root, scaled_scores_only=False)
    if found is None or found[2].meta["val"].shape[-2] == 1 or not _bounded_logits(region, found[1]):
        return None
    return CausalMasks(bias=found, absorbing=-ABSORBING_BIAS_GAP / min(1.0, region.logit_scale))


def _bounded_logits(region: AttentionRegion, logits: torch.fx.Node) -> bool:
    """Whether the chain computes the logits the bias is added to without reading a floating tensor the graph is
    given (another mask of ``finfo.min``) or a constant of magnitude 2^64 or more (a finite fill, -inf): then they
    are of the scores' size, far below 2^124, as the rule needs."""
    chain, pending, seen = set(region.chain), [logits], set()
    while pending:
        node = pending.pop()
        if node in seen or node is region.score_root:
            continue
        seen.add(node)
        if node in region.captured and node.meta["val"].is_floating_point():
            return False
        if node in chain:
            constants = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
            if any(isinstance(c, float) and abs(c) >= 2.0**64 for c in constants):
                return False
            pending += node.all_input_nodes
    return True


def attention_work(region: AttentionRegion) -> int:
    """Batch · rows · columns · head dim of ``region``."""
    return math.prod(region.score_root.meta["val"].shape) * _logical_shape(region.q)[-1]


def _masks_the_scores(where: torch.fx.Node, region: AttentionRegion) -> bool:
    """A ``where`` (-inf, or a fill that absorbs) that masks a logit (``block_sparsity.fills_a_score``) where a
    condition computed without the scores says so."""
    memo: dict = {}
    scores = region.score_root
    return fills_a_score(where, scores, frozenset(region.chain), memo) and not depends_on(where.args[0], scores, memo)


def _mask_check(masks: CausalMasks) -> Optional[tuple[list[torch.fx.Node], str]]:
    """The graph inputs the masks read and the Python source of ``forward(self, *inputs)``, which computes from them
    where the logits are masked (for a bias: 0 where it is 0, 1 where it absorbs, 2 elsewhere, which no causal
    element equals); None when a mask reads no input or runs a random op."""
    graph = torch.fx.Graph()
    env: dict = {}
    inputs: list[torch.fx.Node] = []

    def copy(node: torch.fx.Node) -> torch.fx.Node:
        for ancestor in ancestors(node, is_input):
            if ancestor in env:
                continue
            if is_input(ancestor):
                if not isinstance(ancestor.meta.get("val"), torch.Tensor):
                    raise ValueError(f"{ancestor} is not a tensor")
                env[ancestor] = graph.placeholder(f"input_{len(inputs)}")
                inputs.append(ancestor)
            elif torch.Tag.nondeterministic_seeded in getattr(ancestor.target, "tags", ()):
                raise ValueError(f"{ancestor.target} is random")
            else:
                args, kwargs = torch.fx.node.map_arg((ancestor.args, ancestor.kwargs), env.__getitem__)
                # Named by position, so that regions computing the same mask write the same source and share a check.
                env[ancestor] = graph.create_node("call_function", ancestor.target, args, kwargs, name=f"v{len(env)}")
        return env[node]

    try:
        masked = masked_by(graph, masks, copy, graph.call_function)
    except ValueError:
        return None
    if not any(node.op == "placeholder" for node in inputs):
        return None
    graph.output(masked)
    code = graph.python_code("self")
    if not set(code.globals) <= set(CHECK_GLOBALS) | {"fx_pytree", "pytree"}:  # the last two: unused imports
        return None
    return inputs, code.src


def masked_by(graph: torch.fx.Graph, masks: CausalMasks, node_of, call) -> torch.fx.Node:
    """Nodes of ``graph`` computing where ``masks`` mask the logits, from ``node_of`` the graph's node for each of
    their conditions or bias, by ``call(target, args)``: the OR of the conditions that mask (a ``where`` keeping
    where its condition holds masks where it does not), or the bias's states (``_bias_states``)."""
    masked = None if masks.bias is None else _bias_states(call, node_of(masks.bias[2]), masks.absorbing)
    for where in masks.wheres:
        condition = node_of(where.args[0])
        if not fill_is_true_branch(where):
            condition = call(aten.bitwise_not.default, (condition,))
        masked = condition if masked is None else call(aten.bitwise_or.Tensor, (masked, condition))
    return masked


def _bias_states(call, bias: torch.fx.Node, absorbing: float) -> torch.fx.Node:
    """``2 · (bias != 0) − (bias <= absorbing)`` as int8 (``absorbing`` < 0): 0 where the bias is 0, 1 where it
    absorbs, 2 where it is neither (NaN too); ops Inductor lowers, for the graph as for the check."""
    nonzero = call(aten.ne.Scalar, (bias, 0))
    low = call(aten.le.Scalar, (bias, absorbing))
    as_int8 = [call(prims.convert_element_type.default, (flag, torch.int8)) for flag in (nonzero, low)]
    return call(aten.sub.Tensor, (call(aten.mul.Tensor, (as_int8[0], 2)), as_int8[1]))


def route_when_causal(
    region: AttentionRegion, masks: CausalMasks, fuse_branch, fuse_read_branch=None
) -> Optional[torch.fx.Node]:
    """Replace the region by a ``cond`` between its copy with the causal formula, fused by ``fuse_branch`` (as the
    in-function causal form is: SDPA's causal kernel where the SDPA route takes it, else ours), and its copy that
    reads the masks, fused by ``fuse_read_branch`` (by default ``fuse_branch``; a mask that is not causal may still
    be a band, ``band_tensor_route``), on ``known_causal`` of its masks' tensors; return the node standing for the
    branches' output, or None (the region left as it was)."""

    def names(branch: torch.fx.GraphModule) -> tuple[str, str]:
        on_sdpa = any(node.target in _FUSED_SDPA_OPS for node in branch.graph.nodes)
        return "causal_sdpa" if on_sdpa else "causal_formula", "causal_fused"

    return route_on_mask_check(
        region, masks, lambda graph, copies, rows: _as_causal_formula(copies, masks, rows), known_causal,
        (fuse_branch, fuse_read_branch or fuse_branch), names,
    )


def route_on_mask_check(
    region: AttentionRegion, masks: CausalMasks, rewrite, check_op, fuse: tuple, names
) -> Optional[torch.fx.Node]:
    """Replace the region by ``cond(check_op(tensors, source, rows), first, second, operands)``: two copies of the
    region, the first rewritten by ``rewrite(graph, copies, rows)`` (False declines), fused by ``fuse``'s two
    functions in turn, named by ``names(first)``; the tensors and source those of ``_mask_check``. The node standing
    for the branches' output, or None (the region left as it was)."""
    check = _mask_check(masks)
    if check is None:
        return None
    output = branch_output(region)
    first, second = region_branch(region, output), region_branch(region, output)
    if first is None or second is None:
        return None
    (formula_branch, operands, copies), (read_branch, _, read_copies) = first, second
    rows = region.score_root.meta["val"].shape[-2]
    if not rewrite(formula_branch.graph, copies, rows):
        return None
    for branch, fuse_branch in zip((formula_branch, read_branch), fuse):
        fuse_branch(branch.graph)
    if not all(getattr(copied[region.pv], "_erased", False) for copied in (copies, read_copies)):
        return None  # a branch did not fuse (its matmuls are still there): it would be the unfused attention
    result = finished(formula_branch)
    finished(read_branch)
    inputs, source = check
    flag = shared_check(region.pv.graph, check_op, (inputs, source, rows), output, result)
    return branch_on(flag, dict(zip(names(formula_branch), (formula_branch, read_branch))), operands, output)


def _as_causal_formula(copies: dict, masks: CausalMasks, rows: int) -> bool:
    """The copies of the masks made the causal formula over ``rows`` rows and columns (``as_formula``)."""
    return as_formula(
        copies, masks, lambda graph, device, masked, shape: _causal_formula(graph, rows, device, masked, shape)
    )


def as_formula(copies: dict, masks: CausalMasks, formula, minus_inf_fills: bool = False) -> bool:
    """The copies of the masks made ``formula(graph, device, masked, shape)`` (a node inserted at the graph's
    insertion point, True where it masks, or where it keeps when not ``masked``, expanded to ``shape``): a bias's
    add replaced by a -inf ``where`` of it on the scores (always possible), each ``where``'s condition by the formula
    (its fill by -inf with ``minus_inf_fills``); False (a copy left unusable) where a ``where`` would change shape."""
    if masks.bias is not None:
        _where_for_bias(copies[masks.bias[0]], copies[masks.bias[1]], formula)
    for original in masks.wheres:
        where = copies[original]
        condition = where.args[0]
        value = condition.meta["val"]
        rows, columns = where.meta["val"].shape[-2:]
        shape = list(torch.broadcast_shapes(value.shape, (rows, columns)))
        others = [arg.meta["val"].shape for arg in where.args[1:] if isinstance(arg, torch.fx.Node)]
        if tuple(torch.broadcast_shapes(shape, *others)) != tuple(where.meta["val"].shape):
            return False
        with where.graph.inserting_before(where), _fake_mode_of(value):
            where.replace_input_with(condition, formula(where.graph, value.device, fill_is_true_branch(where), shape))
            if minus_inf_fills:
                _fill_with_minus_inf(where)
    return True


def _fill_with_minus_inf(where: torch.fx.Node) -> None:
    """``where``'s fill (an absorbing finite constant) made -inf, in the fill's dtype and shape."""
    index = 1 if fill_is_true_branch(where) else 2
    fill = where.args[index]
    if constant_value(fill) == -math.inf:
        return
    if isinstance(fill, torch.fx.Node):
        value = fill.meta["val"]
        fill = call_op(where.graph, aten.full.default, (list(value.shape), -math.inf),
                       dict(dtype=value.dtype, device=value.device, pin_memory=False))
    else:
        fill = -math.inf
    where.update_arg(index, fill)


def _causal_formula(graph: torch.fx.Graph, rows: int, device: torch.device, masked: bool, shape: list) -> torch.fx.Node:
    """``n <= m`` over iotas (``~(n <= m)`` where ``masked``, as ``masked_fill(~causal, -inf)`` writes it), expanded
    to ``shape``."""
    kwargs = dict(start=0, step=1, dtype=torch.int64, device=device, requires_grad=False)
    positions = call_op(graph, prims.iota.default, (rows,), kwargs)
    columns = call_op(graph, aten.unsqueeze.default, (positions, 0))
    row_positions = call_op(graph, aten.unsqueeze.default, (positions, 1))
    formula = call_op(graph, aten.le.Tensor, (columns, row_positions))  # kept: n <= m
    if masked:
        formula = call_op(graph, aten.bitwise_not.default, (formula,))
    return call_op(graph, aten.expand.default, (formula, shape))


def _where_for_bias(add: torch.fx.Node, scores: torch.fx.Node, formula) -> None:
    """``scores + bias`` (a copy's) replaced by ``where(masked, -inf, scores)`` in the add's dtype and shape, where
    ``masked`` is ``formula``'s (see ``as_formula``)."""
    value = add.meta["val"]
    graph = add.graph
    with graph.inserting_before(add), _fake_mode_of(value):
        if scores.meta["val"].dtype != value.dtype:
            scores = call_op(graph, prims.convert_element_type.default, (scores, value.dtype))
        masked = formula(graph, value.device, True, list(value.shape))
        fill = call_op(graph, aten.full.default, ([], -math.inf), dict(dtype=value.dtype, device=value.device,
                                                                        pin_memory=False))
        masked = call_op(graph, aten.where.self, (masked, fill, scores))
    add.replace_all_uses_with(masked)
    graph.erase_node(add)  # (the scores' other use would keep the region from being found)


def route_training_when_causal(region: AttentionRegion, matched, fuse_copy) -> Optional[torch.fx.Node]:
    """In a joint graph: the region and its backward (``matched``) as ``cond``s between their copy whose masks are
    the causal formula and their copy reading the masks' tensors (``trained_branches.route_pair``), on
    ``known_causal`` of those tensors; the node standing for the region's output, or None where the route does not
    apply."""
    masks = _tensor_masks(region) if region.softmax else None  # (the module's rule without SDPA's conditions)
    learned = any(3 <= index < 3 + len(region.captured) for index in matched.grads.values())
    if masks is not None and masks.bias is not None and learned:
        return None  # a tensor the chain reads is learned: the causal copy would not give its gradient
    check = None if masks is None else _mask_check(masks)
    if check is None:
        return None
    inputs, source = check
    rows = region.score_root.meta["val"].shape[-2]
    return route_pair(region, matched, lambda copies: _as_causal_formula(copies, masks, rows), fuse_copy,
                      (known_causal, (inputs, source, rows)), ("causal", "causal_mask_read"))


def _fake_mode_of(value: torch.Tensor):
    return torch._guards.detect_fake_mode([value]) or contextlib.nullcontext()
