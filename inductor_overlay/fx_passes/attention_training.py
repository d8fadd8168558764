"""Training: attention in a joint forward+backward graph becomes a fused forward and a fused backward.

AOTAutograd differentiates the user's program before Inductor's post-grad passes run, so a graph that trains holds
the attention twice: its forward ops, and the backward ops autograd derived from them, which read the saved
probabilities (an M×N tensor). This joint-graph pass takes both. The rule: a forward region the attention pass can
fuse (``attention_region.find_attention``) is replaced in training exactly when its backward is recognisably its
own:

1. autograd gives each backward node the ``seq_nr`` of the forward op it differentiates; the backward nodes
   carrying the seq_nr of one of the region's ops are the region's backward (``R_bwd``);
2. the region's values are used only by the region and R_bwd (nothing else needs the probabilities);
3. R_bwd reads exactly one gradient, shaped as the region's output: the gradient of its output (the constants
   autograd's formulas make, the zeros a gather's or a slice's gradient is scattered into, are not gradients);
4. every value R_bwd hands to the rest of the graph is the gradient of one of the operands of the two matmuls
   (q, kᵀ, v), of a floating tensor the chain reads or of the sink logits: it is read only by the backward of that
   tensor's producer (the producer's seq_nr; where the tensor is a shape-keeping view or expand of another, as a
   3-D ``matmul`` makes, whose backward autograd leaves out, that other's producer), or it is the graph's output
   for an input's gradient. (A gradient accumulated from several uses goes through an ``add`` that carries no
   forward op's seq_nr, so it matches no operand: such a region declines.)

An operand of the matmuls whose own op carries one of the region's numbers declines (it is computed by the
attention's own ops), unless no gradient flows to it (``_without_gradient``): an op that makes no autograd node (the
view of a frozen k or v) carries the number of the op recorded before it, which may be the attention's.

The region then becomes ``online_softmax_attention_with_lse`` (the forward, which also saves the rows'
log-sum-exp) and R_bwd ``online_softmax_attention_backward``; the chain's derivative is the joint graph of the
chain itself (``chain_vjp_module``), traced by autograd as the user's program was; the gradient of a tensor the
chain reads (a learned bias, slopes) comes from the same kernel by the rule of ``captured_gradients``. A sink's
column is in the rows' statistics; it meets no V, so its logits' gradient, ``-p_sink · delta`` per row, is a few
pointwise ops on the statistics (``ops.sink_gradient``). Weights that are the chain's output itself (sigmoid
attention, (A·B)·C) save no statistics: the logits' gradient is dO Vᵀ. Attention that the SDPA route takes in inference (plain
causal, on CUDA) takes SDPA's forward and backward kernels instead (``sdpa_training``). A symbolic length trains the same way (the
chain's sizes are inputs of its derivative too). A region outside the rule (a pair reduction, a bias read through
a gather) is left to upstream, with the reason in the log
(``TORCH_LOGS=flashlight``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import operator
from typing import Optional, Union

import torch
from torch._dynamo.utils import counters

from inductor_overlay import config, ops
from inductor_overlay.fx_passes.arange_positions_route import route_training_when_arange
from inductor_overlay.fx_passes.attention_fusion import TrainingForward, _routed, fuse
from inductor_overlay.fx_passes.attention_region import (
    AttentionRegion,
    Decline,
    _looks_like_softmax_input,
    find_attention,
    is_softmax_output,
)
from inductor_overlay.fx_passes.block_sparsity import is_op as _is
from inductor_overlay.fx_passes.causal_tensor_route import route_training_when_causal
from inductor_overlay.fx_passes.captured_gradients import FULL, gradient_of_read, gradient_read, read_vjp_module
from inductor_overlay.fx_passes.chain_modules import _score_chain_module, traced_joint
from inductor_overlay.fx_passes.fx_helpers import (
    _MATMULS,
    _operand_scale,
    _strip_order_preserving,
    _val,
    aten,
    call_op,
    call_traced,
    is_backward,
    prims,
    subgraph,
)
from inductor_overlay.fx_passes.logit_scale import fold_common_gradient_factor
from inductor_overlay.fx_passes.sdpa_route import sdpa_call
from inductor_overlay.fx_passes.sdpa_training import replace_pair_by_sdpa

log = logging.getLogger("flashlight.attention_fusion")


def _seq(node: torch.fx.Node) -> Optional[int]:
    return node.meta.get("seq_nr")


_HEAD_SLICES = (aten.select.int, aten.slice.Tensor)
_HEAD_ARITHMETIC = (aten.mul.Tensor, aten.sub.Tensor, aten.add.Tensor, aten.neg.default,
                    prims.convert_element_type.default)


def _weighs_by_head_slices(pv: torch.fx.Node) -> bool:
    """Whether the matmul's weights are slices of a softmax's heads, or a combination of them (DiffAttn's
    ``p[:, :, 0] - λ·p[:, :, 1]``), through views, selects and pointwise arithmetic with at least one select or
    slice on the way (dropout's products alone are not head slices): attention the training pass does not fuse,
    whose decline it reports."""
    pending, seen = [(pv.args[0], False)], 0
    while pending and seen < 32:
        node, sliced = pending.pop()
        seen += 1
        stripped, _ = _strip_order_preserving(node)
        if is_softmax_output(stripped):
            if sliced and _computed_from_a_matmul(stripped):
                return True
            continue
        if _is(stripped, (*_HEAD_SLICES, *_HEAD_ARITHMETIC)):
            sliced = sliced or _is(stripped, _HEAD_SLICES)
            pending.extend((a, sliced) for a in stripped.args if isinstance(a, torch.fx.Node))
    return False


def _computed_from_a_matmul(node: torch.fx.Node, steps: int = 48) -> bool:
    """Whether a matmul is among the first ``steps`` nodes ``node`` is computed from, nearest first (a softmax of
    scores, not of a router's logits)."""
    pending, seen = collections.deque([node]), set()
    while pending and len(seen) < steps:
        current = pending.popleft()
        if current in seen:
            continue
        seen.add(current)
        if _is(current, _MATMULS):
            return True
        pending.extend(a for a in current.all_input_nodes if a not in seen and a.op == "call_function")
    return False


def trains(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` is a joint forward+backward graph (it has gradient inputs)."""
    return any(node.op == "placeholder" and node.name.startswith("tangents") for node in graph.nodes)


@dataclasses.dataclass
class RegionBackward:
    nodes: set  # R_bwd
    grad_out: torch.fx.Node  # the gradient of the region's output
    grads: dict  # R_bwd's output node -> index of what it is the gradient of (``_differentiable``)


def _operands(region: AttentionRegion) -> list[torch.fx.Node]:
    return [region.qk.args[0], region.qk.args[1], region.pv.args[1]]


def _differentiable(region: AttentionRegion) -> list[Optional[torch.fx.Node]]:
    """What a gradient may be of: the operands (0 q, 1 kt, 2 v), each captured tensor (3 + j; None for one that is
    not floating), then the sink logits (``_sink_index``; None without a sink)."""
    floating = [c if _val(c) is not None and _val(c).is_floating_point() else None for c in region.captured]
    return [*_operands(region), *floating, region.sink]


def _sink_index(region: AttentionRegion) -> int:
    return 3 + len(region.captured)


def _without_gradient(operand: torch.fx.Node, scores: torch.fx.Node) -> bool:
    """Whether no gradient flows to ``operand`` (computed from no primal input whose gradient the joint graph
    returns, and not from the scores): its op made no autograd node, and carries the number of the op autograd
    recorded before it, which may be one of the attention's own (k and v of a frozen memory, q alone trained)."""
    graph = operand.graph
    output = graph.find_nodes(op="output")[0]
    slots = {node: _gradient_slot(node, output) for node in graph.find_nodes(op="placeholder")}
    trained = {node for node, slot in slots.items() if slot is not None and output.args[0][slot] is not None}
    sources = _reached({operand}, lambda node: node.all_input_nodes) | {operand}  # one walk of its inputs
    return not (sources & (trained | {scores}))


def _gradient_slot(operand: torch.fx.Node, output: torch.fx.Node) -> Optional[int]:
    """The index in the joint graph's outputs of the gradient of input ``operand`` (outputs: the forward's, then
    one gradient per primal input)."""
    primals = [n for n in operand.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
    if operand not in primals:
        return None
    return len(output.args[0]) - len(primals) + primals.index(operand)


_IDENTITIES = (aten.expand.default, aten.view.default, aten.reshape.default, aten.clone.default,
               aten.alias.default)


def _through_identities(operand: torch.fx.Node) -> tuple[torch.fx.Node, set]:
    """The node ``operand`` is the identity of (up through views, expands and clones that keep its shape: a 3-D
    ``torch.matmul``'s expands, whose backward autograd leaves out), and the sequence numbers of the nodes on the
    way, whose backward ops may take the operand's gradient."""
    seqs = {_seq(operand)}
    while (
        _is(operand, _IDENTITIES) and isinstance(operand.args[0], torch.fx.Node)
        and _val(operand.args[0]) is not None and tuple(_val(operand.args[0]).shape) == tuple(_val(operand).shape)
    ):
        operand = operand.args[0]
        seqs.add(_seq(operand))
    return operand, seqs - {None}


def _operand_of(value: torch.fx.Node, operands: list[Optional[torch.fx.Node]], backward: set) -> Union[int, Decline]:
    """Rule 4: which of ``operands`` (``_differentiable``) ``value`` (a node R_bwd hands out) is the gradient of."""
    users = [user for user in value.users if user not in backward]
    found = []
    for index, operand in enumerate(operands):
        if operand is None or tuple(_val(value).shape) != tuple(_val(operand).shape):
            continue
        operand, seqs = _through_identities(operand)
        if operand.op == "placeholder":
            slot = _gradient_slot(operand, users[0]) if users[0].op == "output" else None
            if len(users) == 1 and slot is not None and users[0].args[0][slot] is value:
                found.append(index)
        elif _seq(operand) is not None and all(is_backward(u) and _seq(u) in seqs for u in users):
            found.append(index)
    if len(found) == 1:
        return found[0]
    return Decline(f"`{value.name}` leaves the attention's backward but is not the gradient of one input of it (rule 4)")


def _convex(nodes: set) -> set:
    """``nodes`` with every backward node between two of them: the backward of an op a joint-graph pattern replaced
    in the forward, which lost its number there (a softmax's scale), and a node such a pattern made in the backward,
    which carries no label at all (the multiply by a scale computed from a symbolic head dim): one between two
    backward nodes reads what the backward computed, so it is part of it."""
    after = _reached(nodes, lambda node: node.users)
    before = _reached(nodes, lambda node: node.all_input_nodes)
    return nodes | {n for n in after & before if n.op == "call_function" and (is_backward(n) or _unlabelled(n))}


def _unlabelled(node: torch.fx.Node) -> bool:
    return "seq_nr" not in node.meta and "partitioner_tag" not in node.meta


def _reached(nodes: set, neighbours) -> set:
    """The nodes reached from ``nodes`` by following ``neighbours`` one or more times."""
    reached, frontier = set(), list(nodes)
    while frontier:
        for node in neighbours(frontier.pop()):
            if node not in reached:
                reached.add(node)
                frontier.append(node)
    return reached


def _gradients_read(backward: set) -> set:
    """The backward values ``backward`` reads from outside it: gradients, not the constants autograd's formulas
    make (the zeros a gather's gradient is scattered into)."""
    return {
        arg for node in backward for arg in node.all_input_nodes
        if arg not in backward and is_backward(arg) and not (arg.op == "call_function" and not arg.all_input_nodes)
    }


def _with_chain_backward(region: AttentionRegion, backward: set, sequence: set) -> set:
    """``backward`` with the backward of the chain's ops that do not depend on the scores (a bias made from slopes
    inside the chain), where it reads what ``backward`` computes: the gradient flowing on to a captured tensor."""
    graph = region.pv.graph
    # A forward op that makes no autograd node (an ``iota``, a comparison) carries the number of the op before it:
    # numbers that also label forward nodes outside the chain are not the chain's own.
    chain = set(region.chain)
    elsewhere = {_seq(n) for n in graph.nodes if n.op == "call_function" and not is_backward(n) and n not in chain}
    chain_sequence = {_seq(node) for node in region.chain} - sequence - elsewhere - {None}
    candidates = [n for n in graph.nodes if n.op == "call_function" and is_backward(n) and _seq(n) in chain_sequence]
    grown = True
    while grown:
        added = {n for n in candidates if n not in backward and any(a in backward for a in n.all_input_nodes)}
        backward = backward | added
        grown = bool(added)
    return _convex(backward)


def match_backward(region: AttentionRegion) -> Union[Decline, RegionBackward]:
    """Rules 1–4 of the module doc for a region found in a joint graph: with the backward of the chain's own ops
    (``_with_chain_backward``), or, where that does not match, without it (no gradient for a tensor the chain reads
    through them)."""
    matched = _match_backward(region, with_chain=True)
    if isinstance(matched, Decline):
        without = _match_backward(region, with_chain=False)
        return matched if isinstance(without, Decline) else without
    return matched


def _match_backward(region: AttentionRegion, with_chain: bool) -> Union[Decline, RegionBackward]:
    forward = region.internal | {region.pv}
    # (Nodes upstream's joint-graph patterns put in place of the user's carry none; their backward kept the
    # numbers of the ops they replaced, found through the region's other nodes, or rule 2 declines.)
    sequence = {_seq(node) for node in forward} - {None}
    operands = _operands(region)
    differentiable = _differentiable(region)
    if len(set(operands)) < 3 or any(
        _seq(operand) in sequence and not _without_gradient(operand, region.qk) for operand in operands
    ):
        return Decline("an operand of the matmuls comes from the attention's own ops")
    graph = region.pv.graph
    own = _convex({n for n in graph.nodes if n.op == "call_function" and is_backward(n) and _seq(n) in sequence})
    backward = _with_chain_backward(region, own, sequence) if with_chain else own
    if not backward:
        return Decline("the attention's backward was not found")
    # Forward nodes of the region's ops that only its backward reads (an alias of the saved probabilities).
    saved = {n for n in graph.nodes if not is_backward(n) and _seq(n) in sequence and n not in forward}
    saved = {n for n in saved if all(u in backward or u in saved for u in n.users)}
    for node in forward - {region.pv}:
        outside = [u for u in node.users if u not in forward and u not in backward and u not in saved]
        if outside and not all(_is(u, aten.sym_size.int) for u in outside):
            return Decline(f"`{node.name}` is used outside the attention and its backward (rule 2)")
    gradients = _gradients_read(backward)
    pv_shape = tuple(_val(region.pv).shape)
    if len(gradients) != 1 or tuple(_val(next(iter(gradients))).shape) != pv_shape:
        if backward != own and len(_gradients_read(own)) == 1:
            return Decline("the gradient of a tensor the chain reads flows through ops that read other gradients too "
                           "(a gather's is a scatter): not fused")
        return Decline(f"the attention's backward reads {len(gradients)} gradients, not its output's alone (rule 3)")
    grads = {}
    for node in backward:
        if all(u in backward for u in node.users):
            continue
        index = _operand_of(node, differentiable, backward) if _val(node) is not None else Decline(f"`{node.name}` has no value")
        if isinstance(index, Decline):
            return index
        if index in grads.values():
            return Decline(f"two values of the attention's backward are the gradient of operand {index} (rule 4)")
        grads[node] = index
    return RegionBackward(backward, next(iter(gradients)), grads)


def _declines_training(region: AttentionRegion) -> Optional[str]:
    if region.pair is not None:
        return "a pair reduction does not train fused"
    few = _too_few_column_programs(region)
    if few is not None:
        return few
    if _val(region.qk).shape[-1] == 0:
        return "no columns"
    return None


def _too_few_column_programs(region: AttentionRegion) -> Optional[str]:
    """Weights without a softmax may be a chain of two matmuls with no batch and few columns (``(A·B)·C`` with a
    narrow B): the backward's dK and dV come from one program per column tile, each looping over every row, which
    would leave most of a GPU idle. Those train on upstream's path when there are fewer such programs than
    multiprocessors."""
    device = _val(region.qk).device
    if region.softmax or device.type != "cuda":
        return None
    shape = _val(region.score_root).shape
    programs = math.prod(shape[:-2]) * -(-shape[-1] // 64)
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= processors:
        return None
    return f"weights without a softmax over {programs} column tiles of 64, fewer than the GPU's {processors} multiprocessors"


def chain_vjp_module(chain: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    """The chain's derivative, ``(scores, *captured, *sizes, grad_logits) -> grad_scores``: autograd's joint graph of
    the chain, traced with Inductor's decompositions (a ``where`` mask passes the gradient where it keeps the score
    and 0 elsewhere; a tanh soft-cap multiplies by 1 - tanh²)."""

    def joint(scores, *rest):
        *inputs, grad_logits = rest
        with torch.enable_grad():
            logits = ops.run_differentiably(chain, scores, *inputs)
            (grad_scores,) = torch.autograd.grad(logits, scores, grad_logits, allow_unused=True)
        if grad_scores is None:
            return torch.zeros_like(scores)
        return grad_scores

    return traced_joint(chain, example_inputs, joint, differentiate_scores=True)


def _backward_visible_loop(chain: ops.ScoreChain) -> bool:
    """Whether the backward runs the tiles its mask leaves entirely visible in a loop of their own, with the chain
    that drops the mask, as the forward does (the caller adds: not with captured gradients, whose reads stay per
    logit). Where the forward keeps wide statistics (finite logits too large to scale, e.g. a finfo.min mask), the
    loop runs the narrow form of the probabilities, in the batch entries whose rows fold log2(l) into their shifts
    (a row hidden by the mask aside: ``ops.backward_row_terms``). Not where the chain without its masks reads what the whole chain does not (the
    first values of captured positions the forward computes from the tile): that form is not the one the backward
    runs."""
    return (config.backward_visible_loop and chain.unmasked_graph_module is not None
            and (chain.exact_graph_module is None
                 or ops.inputs_read(chain.unmasked_graph_module) <= ops.inputs_read(chain.exact_graph_module)))


def _without_constant_factors(vjps: list, dtype: torch.dtype) -> tuple[list, float]:
    """The derivatives the kernel runs, their common constant factor taken out (``fold_common_gradient_factor``:
    the kernel multiplies dQ and dK by it once), where the operands are bf16 or float32, whose range holds the
    derivative's tile, rounded to their dtype for the dots, 1/factor times larger without the factor (float16's may
    not; the kernel takes no float64 operands)."""
    if dtype not in (torch.bfloat16, torch.float32) or not config.fold_gradient_factors:
        return vjps, 1.0
    return fold_common_gradient_factor(vjps)


def _insert_backward(region: AttentionRegion, matched: RegionBackward, fwd: TrainingForward) -> None:
    """``online_softmax_attention_backward`` after the output's gradient, standing for R_bwd's outputs."""
    graph = region.pv.graph
    score_shape = list(_val(region.score_root).shape)
    z, m, dv = math.prod(score_shape[:-2]) if len(score_shape) > 2 else 1, score_shape[-2], _val(region.pv).shape[-1]
    chain, _ = ops.differentiated_chain(fwd.chain)
    examples = [_val(region.score_root), *(_val(c) for c in fwd.captured), *(s.meta["val"] for s in region.captured_sizes)]
    vjp = chain_vjp_module(chain, examples)
    reads = _gradient_reads(region, matched, chain)
    if isinstance(reads, str):
        raise RuntimeError(reads)
    position = {n: i for i, n in enumerate(graph.nodes)}
    # After the output's gradient and everything the fused forward inserted (its output view may follow the
    # statistics: a 2-D attention's squeeze).
    anchor = max([matched.grad_out, fwd.result, *([fwd.lse] if fwd.lse is not None else [])], key=position.__getitem__)
    with graph.inserting_before(anchor.next):
        grad_out = call_op(graph, aten.view.default, (matched.grad_out, [z, m, dv]))
        statistics, delta, dense = _softmax_terms(fwd, grad_out, [z, m, dv]) if fwd.lse is not None else (None,) * 3
        q, kt, v = fwd.operands
        read_vjps = [subgraph(graph, read_vjp_module(chain, read, examples), "read_vjp") for read in reads]
        # Entirely visible tiles run the chain without its masks, and its derivative (_backward_visible_loop).
        unmasked = None if reads or not _backward_visible_loop(fwd.chain) else chain_vjp_module(
            fwd.chain.unmasked_graph_module, examples
        )
        (vjp, unmasked), factor = _without_constant_factors([vjp, unmasked], _val(q).dtype)
        vjp_node = subgraph(graph, vjp, "score_chain_vjp")
        unmasked_vjp = None if unmasked is None else subgraph(graph, unmasked, "score_chain_vjp_unmasked")
        both = call_op(graph, ops.online_softmax_attention_backward, (
            q, kt, v, fwd.captured, fwd.subgraphs, fwd.decisions, vjp_node, statistics, delta, dense, grad_out,
            list(region.captured_sizes), read_vjps, [read.as_data() for read in reads], unmasked_vjp, fwd.sink, factor,
            _kernel_programs(matched, reads),
        ))
        grads = {i: call_op(graph, operator.getitem, (both, i)) for i in range(3)}
        if _sink_index(region) in matched.grads.values():
            grads[_sink_index(region)] = _sink_gradient(region, fwd, delta)
        for number, read in enumerate(reads):
            partial = call_op(graph, operator.getitem, (both, 3 + number))
            captured = region.captured[read.index]
            grads[3 + read.index] = gradient_of_read(graph, chain, read, partial, captured, score_shape)
        _hand_out(region, matched, grads)


def _kernel_programs(matched: RegionBackward, reads: list) -> str:
    """Which programs the backward kernel runs: its column programs write dKᵀ and dV, its row programs dQ; where the
    graph wants only one kind (q frozen, or k and v: ``_without_gradient``) and no tensor the chain reads has its
    gradient summed, only those."""
    wanted = set(matched.grads.values())
    if reads or not wanted & {0, 1, 2}:
        return "both"
    return "rows" if not wanted & {1, 2} else "columns" if 0 not in wanted else "both"


def _softmax_terms(fwd: TrainingForward, grad_out: torch.fx.Node, shape: list) -> tuple[torch.fx.Node, ...]:
    """What the backward of a softmax reads: the rows' statistics (wide ones as ``ops.backward_row_terms`` gives
    them), ``delta = Σ_Dv grad_out · out`` per row (float32), and per batch entry whether a row is entirely masked
    (its statistics are -inf: ``dense``; with wide statistics, the flags of ``ops.backward_row_terms``)."""
    graph = grad_out.graph
    out = call_op(graph, aten.view.default, (fwd.result, shape))
    products = call_op(graph, aten.mul.Tensor, (
        call_op(graph, prims.convert_element_type.default, (grad_out, torch.float32)),
        call_op(graph, prims.convert_element_type.default, (out, torch.float32)),
    ))
    delta = call_op(graph, aten.sum.dim_IntList, (products, [-1]))
    if fwd.chain.wide_logits:
        _, folded_scale = ops.differentiated_chain(fwd.chain)  # the scale of the chain whose statistics the kernel reads
        terms, flags = call_traced(graph, lambda lse: ops.backward_row_terms(lse, folded_scale), [fwd.lse])
        return terms, delta, flags
    row_floor = call_op(graph, aten.amin.default, (fwd.lse, [-1]))
    return fwd.lse, delta, call_op(graph, aten.eq.Scalar, (row_floor, -math.inf))


def _sink_gradient(region: AttentionRegion, fwd: TrainingForward, delta: torch.fx.Node) -> torch.fx.Node:
    """The sink logits' gradient, shaped and typed as the sink node cat read (``ops.sink_gradient``)."""
    sink = _val(region.sink)
    decisions = fwd.decisions

    def formula(lse, delta, sink_logits):
        return ops.sink_gradient(lse, delta, sink_logits, decisions).reshape(sink.shape).to(sink.dtype)

    return call_traced(region.pv.graph, formula, [fwd.lse, delta, fwd.sink])


def _gradient_reads(region: AttentionRegion, matched: RegionBackward, chain: torch.fx.GraphModule) -> Union[list, str]:
    """How the kernel gives the gradient of each captured tensor R_bwd hands one out for, or why it cannot."""
    reads = []
    indices = sorted(i - 3 for i in matched.grads.values() if 3 <= i < _sink_index(region))
    for index in indices:
        read = gradient_read(chain, index, _val(region.captured[index]), _val(region.score_root))
        if isinstance(read, str):
            return read
        if not all(isinstance(size, int) for size in read.shape):
            return "the gradient of a tensor the chain reads with a dynamic shape"
        if not all(isinstance(size, int) for size in _val(region.score_root).shape[:-2]):
            # (A per-logit partial's batch entry is computed from the scores' batch sizes, which the kernel has as
            # numbers; the read's derivative is traced at the scores' shape, whose batch sizes it would read.)
            return "the gradient of a tensor the chain reads, over batch dims of a dynamic size"
        reads.append(read)
    return reads


def _hand_out(region: AttentionRegion, matched: RegionBackward, grads: Union[list, dict]) -> None:
    """R_bwd's outputs replaced by ``grads``, the gradients of the fused op's (scale-free) operands q, kᵀ, v, and
    at ``3 + j`` that of captured tensor j where R_bwd hands one out; new nodes go where the caller inserts."""
    graph = region.pv.graph
    operands = _operands(region)
    # A constant c taken off q or k (``_operand_scale``) is in the chain: the kernel's gradient is that of the
    # unscaled operand, c times the scaled one's.
    scales = [_operand_scale(region.q.node)[1], _operand_scale(region.kt.node)[1], 1.0]
    for value, index in matched.grads.items():
        if index >= 3:
            value.replace_all_uses_with(grads[index])
            continue
        shape = list(_val(operands[index]).shape)
        grad = grads[index]
        if scales[index] != 1.0:
            grad = call_op(graph, aten.div.Tensor, (grad, scales[index]))
        if list(_val(grad).shape) != shape:
            grad = call_op(graph, aten.reshape.default, (grad, shape))
        value.replace_all_uses_with(grad)


def _runs_as_sdpa(region: AttentionRegion, matched: RegionBackward) -> bool:
    """Attention SDPA computes exactly, under a policy and on a device that give it to SDPA (``sdpa_route``),
    replaced with its backward by SDPA's pair of kernels (``sdpa_training``); False when it stays ours."""
    call = sdpa_call(region)
    if call is None or any(index >= 3 for index in matched.grads.values()):
        return False
    graph = region.pv.graph
    grads = replace_pair_by_sdpa(region, call, matched.grad_out)
    if grads is None:
        return False
    position = {node: index for index, node in enumerate(graph.nodes)}
    with graph.inserting_before(max(grads, key=position.__getitem__).next):
        _hand_out(region, matched, grads)
    return True


# The checked routes a trained attention may take (``trained_branches``), tried in this order, and what the log says.
_TRAINING_ROUTES = {
    "arange": (route_training_when_arange, "runs as if the positions its chain reads were built with arange while "
                                           "they hold 0, 1, ..., reading them otherwise"),
    "causal": (route_training_when_causal, "runs with the causal formula while the tensors its masks read hold the "
                                           "causal mask, reading them otherwise"),
}


def _fuse_pair(region: AttentionRegion, matched: RegionBackward, sdpa: bool = True) -> bool:
    """The region and its backward fused as a pair: on SDPA's kernels where ``sdpa`` allows and they take it
    (returns True), else on ours."""
    if sdpa and _runs_as_sdpa(region, matched):
        return True
    _insert_backward(region, matched, fuse(region, training=True))
    return False


def _fuse_copy(region: AttentionRegion, matched: RegionBackward, copies: dict, sdpa: bool) -> bool:
    """A route's copy of ``region`` and its backward (``trained_branches``, ``copies`` the map from the joint graph's
    nodes) fused as a pair on our kernels (or SDPA's, where ``sdpa``); False where the copy is not attention that
    trains fused (a copy a route rewrote is found and checked again)."""
    found = find_attention(copies[region.pv], dead=frozenset(c for c in copies.values() if is_backward(c)))
    if isinstance(found, Decline) or _declines_training(found) is not None:
        return False
    before, after = _differentiable(region), _differentiable(found)
    grads = {}
    for value, index in matched.grads.items():
        target = copies.get(before[index])
        if not any(target is node for node in after):
            return False
        grads[copies[value]] = next(i for i, node in enumerate(after) if node is target)
    copy = RegionBackward({copies[node] for node in matched.nodes}, copies[matched.grad_out], grads)
    if isinstance(_gradient_reads(found, copy, _score_chain_module(found)), str):
        return False
    _fuse_pair(found, copy, sdpa)
    return True


def _routed_for_training(region: AttentionRegion, matched: RegionBackward) -> Optional[str]:
    """The checked route (``_TRAINING_ROUTES``) that replaced the region and its backward by two fused versions of
    them under ``cond``s, or None. A route that fails is contained (``attention_fusion._routed``): both conds are in
    place before any use is replaced, so it leaves at most dead nodes, and the region is fused without it."""
    return next((name for name, (route, _) in _TRAINING_ROUTES.items() if _routed(route, region, matched, _fuse_copy)),
                None)


def fuse_attention_for_training(graph: torch.fx.Graph) -> None:
    """Joint-graph pass: each fusable attention whose backward matches (module doc) becomes the fused forward and
    backward pair."""
    if not (config.attention_fusion and config.fused_backward and trains(graph)):
        return
    backward = frozenset(n for n in graph.nodes if is_backward(n))
    changed = False
    for pv in [n for n in graph.nodes if _is(n, _MATMULS) and not is_backward(n)]:
        if pv.graph is not graph or _val(pv.args[0]) is None:
            continue
        region = find_attention(pv, dead=backward)
        if isinstance(region, Decline) and not _looks_like_softmax_input(pv):
            if not _weighs_by_head_slices(pv):
                continue  # not attention: no decline to report
            region = Decline("the probabilities are sliced or combined across heads before V (differential "
                             "attention): head groups do not train fused; upstream's backward runs")
        reason = region.reason if isinstance(region, Decline) else _declines_training(region)
        matched = match_backward(region) if reason is None else None
        if isinstance(matched, Decline):
            reason = matched.reason
        elif matched is not None:
            reads = _gradient_reads(region, matched, _score_chain_module(region))
            reason = reads if isinstance(reads, str) else None
        if reason is not None:
            counters["inductor"]["flashlight_training_declined"] += 1
            log.info("attention not fused for training at %s: %s", pv.name, reason)
            continue
        changed = True
        routed = _routed_for_training(region, matched)
        if routed is not None:
            counters["inductor"]["flashlight_attention_fused_for_training"] += 1
            counters["inductor"][f"flashlight_attention_{routed}_route"] += 1
            log.info("attention fused for training at %s: %s", pv.name, _TRAINING_ROUTES[routed][1])
            continue
        try:
            if _fuse_pair(region, matched):
                counters["inductor"]["flashlight_attention_as_sdpa_for_training"] += 1
                log.info("attention at %s trains on SDPA's forward and backward kernels", pv.name)
                continue
        except Exception as error:  # noqa: BLE001  (counted, then contained by post_grad._contained)
            # A fault half-way leaves a fused forward whose backward is missing or partly handed out (and a forward
            # that is itself at fault): the pass gives up, and its wrapper puts the joint graph back as upstream
            # made it.
            counters["inductor"]["flashlight_training_fault"] += 1
            log.warning("attention at %s: the fused backward failed (%s)", pv.name, error)
            raise
        counters["inductor"]["flashlight_attention_fused_for_training"] += 1
        log.info("attention fused for training at %s: scores %s", pv.name, tuple(_val(region.score_root).shape))
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
