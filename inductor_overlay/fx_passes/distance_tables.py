"""Compute values that depend on the positions only through their distance once per distance (T5's bias).

On an M×N grid the distance ``d = n − m`` between two ``arange`` positions takes only M + N − 1 values, so
anything computed from ``d`` alone (T5's log-bucketing and the gather from its learned table, a log-distance bias)
takes only M + N − 1 values too, per head say. In an attention kernel's score chain it is computed per logit: for
T5, about thirty instructions and a gather. This pass evaluates the same ops once on the vector of distances
``lo … hi`` and reads the result back at ``d − lo`` (a Toeplitz matrix stored by its diagonals). The same ops on the
same values give the same results, so the rewrite is exact, and the attention pass reads the small table as it
reads a bias tensor (``DISTANCE_TABLE`` marks it as an input, not as part of the chain).

What moves: the nodes reached from ``d`` through pointwise ops and ``table[index]`` gathers (``embedding`` too)
whose other inputs are constant along both position dims. A result moves only when it has cost more than a few
integer operations to get (a gather, a log, a division: ``_is_cheap``); ALiBi's ``slope · d`` stays per logit, where
it was measured faster (``benchmarks/results/h100_2026-11-24_consolidated_grid/NOTES.md``). Boolean results and
anything behind a non-finite constant stay too, so that masks stay visible to block skipping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Optional

import torch
from torch._dynamo.utils import counters

from inductor_overlay import config
from inductor_overlay.fx_passes.fx_helpers import call_op
from inductor_overlay.fx_passes.block_sparsity import is_op
from inductor_overlay.ops import DISTANCE_TABLE

log = logging.getLogger("flashlight.distance_tables")

aten = torch.ops.aten
prims = torch.ops.prims

_SIZE_ONE_VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default)
# Integer and comparison work a kernel does in an instruction or two per element: not worth a table read.
_CHEAP = frozenset(
    getattr(aten, name)
    for name in ("abs", "neg", "sign", "add", "sub", "mul", "eq", "ne", "lt", "le", "gt", "ge", "where", "clamp",
                 "clamp_min", "clamp_max", "maximum", "minimum", "logical_not", "logical_and", "logical_or",
                 "bitwise_and", "bitwise_or", "bitwise_not")
) | {prims.convert_element_type}


@dataclasses.dataclass(frozen=True)
class _Distance:
    """``d = a − b`` over two adjacent dims: its node, the first dim (counted from the right), its values' range."""

    node: torch.fx.Node
    pair: int
    low: int
    count: int


def _shape(node: torch.fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _position(node: torch.fx.Node) -> Optional[tuple[int, int, int]]:
    """(dim from the right, length, start) of an integer ``arange`` with step 1 seen through size-1 views."""
    shape = _shape(node)
    source = node
    while is_op(source, _SIZE_ONE_VIEWS):
        source = source.args[0]
    if not is_op(source, prims.iota.default) or source.kwargs.get("step") != 1:
        return None
    length, start = source.args[0], source.kwargs.get("start")
    if not (isinstance(length, int) and isinstance(start, int)) or length < 2:
        return None
    if sorted(shape) != [1] * (len(shape) - 1) + [length]:
        return None
    return shape.index(length) - len(shape), length, start


def _distance(node: torch.fx.Node) -> Optional[_Distance]:
    if not is_op(node, aten.sub.Tensor) or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    value = node.meta.get("val")
    if value is None or value.dtype not in (torch.int32, torch.int64):
        return None
    if not all(isinstance(arg, torch.fx.Node) and "val" in arg.meta for arg in node.args):
        return None
    first, second = _position(node.args[0]), _position(node.args[1])
    if first is None or second is None or abs(first[0] - second[0]) != 1:
        return None
    (_, first_length, first_start), (_, second_length, second_start) = first, second
    low = first_start - (second_start + second_length - 1)
    return _Distance(node, min(first[0], second[0]), low, first_length + second_length - 1)


def _gather(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """(source, index) of ``source[index]`` along its first dim: ``aten.index`` with one index, or ``embedding``."""
    if is_op(node, aten.index.Tensor) and len(node.args[1]) == 1:
        return node.args[0], node.args[1][0]
    if is_op(node, aten.embedding.default):
        return node.args[0], node.args[1]
    return None


def _constant_along(node: torch.fx.Node, rank: int, pair: int) -> bool:
    """Whether ``node`` (broadcast right-aligned to ``rank`` dims) has size 1 at both position dims."""
    shape = (1,) * (rank - len(_shape(node))) + _shape(node)
    return shape[rank + pair] == 1 and shape[rank + pair + 1] == 1


def _finite_scalars(node: torch.fx.Node) -> bool:
    scalars = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, float)]
    return all(math.isfinite(a) for a in scalars)


def _finite_full(node: torch.fx.Node) -> bool:
    """A ``full`` tensor of a finite value (HF's ``full_like``): constant everywhere; an infinite one is a mask's."""
    return is_op(node, aten.full.default) and _finite_scalars(node)


def _pair_of(node: torch.fx.Node, pairs: dict) -> Optional[int]:
    """The position dims of ``node``'s value if it is computed from the distance alone, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or "val" not in node.meta:
        return None
    gather = _gather(node)
    if gather is not None:
        source, index = gather
        if index not in pairs or source in pairs or "val" not in source.meta:
            return None
        return pairs[index] - (len(_shape(source)) - 1)
    tags = node.target.tags
    if torch.Tag.nondeterministic_seeded in tags or not (
        torch.Tag.pointwise in tags or node.target is prims.convert_element_type.default
    ):
        return None
    inside = {pairs[arg] for arg in node.all_input_nodes if arg in pairs}
    if len(inside) != 1 or not _finite_scalars(node):
        return None
    (pair,) = inside
    rank = len(_shape(node))
    outside = [arg for arg in node.all_input_nodes if arg not in pairs]
    if any("val" not in arg.meta or not (_constant_along(arg, rank, pair) or _finite_full(arg)) for arg in outside):
        return None
    return pair


def _is_cheap(node: torch.fx.Node) -> bool:
    return node.target.overloadpacket in _CHEAP


class _Tabulation:
    """The nodes computed from one distance, and their replicas over the vector of distances."""

    def __init__(self, distance: _Distance) -> None:
        self.distance = distance
        self.pairs: dict = {distance.node: distance.pair}
        self.costly: dict = {distance.node: False}
        self.replicas: dict = {}

    def grow(self) -> None:
        for node in self.distance.node.graph.nodes:
            if node in self.pairs:
                continue
            pair = _pair_of(node, self.pairs)
            if pair is not None:
                self.pairs[node] = pair
                self.costly[node] = not _is_cheap(node) or any(self.costly.get(a, False) for a in node.all_input_nodes)

    def boundary(self) -> list[torch.fx.Node]:
        """The costly values computed from the distance alone that something else reads."""
        return [
            node
            for node in self.pairs
            if self.costly[node]
            and node.meta["val"].dtype is not torch.bool
            and any(user not in self.pairs for user in node.users)
        ]

    def replica(self, node: torch.fx.Node) -> torch.fx.Node:
        """``node`` computed over the vector of distances: its two position dims become one of M + N − 1."""
        if node in self.replicas:
            return self.replicas[node]
        graph, distance = node.graph, self.distance
        with graph.inserting_before(node):
            if node is distance.node:
                value = node.meta["val"]
                with torch._guards.detect_fake_mode([value]) or contextlib.nullcontext():
                    vector = call_op(graph, prims.iota.default, (distance.count,), dict(
                        start=distance.low, step=1, dtype=value.dtype, device=value.device, requires_grad=False))
                shape = list(_shape(node))
                shape[len(shape) + distance.pair : len(shape) + distance.pair + 2] = [distance.count]
                replica = call_op(graph, aten.view.default, (vector, shape))
            elif is_op(node, aten.index.Tensor):
                replica = call_op(graph, aten.index.Tensor, (node.args[0], [self.replica(node.args[1][0])]))
            elif is_op(node, aten.embedding.default):
                replica = call_op(graph, node.target, (node.args[0], self.replica(node.args[1]), *node.args[2:]))
            else:
                replica = self._pointwise_replica(node)
        self.replicas[node] = replica
        return replica

    def _pointwise_replica(self, node: torch.fx.Node) -> torch.fx.Node:
        graph, pair, rank = node.graph, self.pairs[node], len(_shape(node))

        def collapsed(arg: torch.fx.Node) -> torch.fx.Node:
            if arg in self.pairs:
                return self.replica(arg)
            shape = list(_shape(arg))
            if len(shape) < -pair:
                return arg  # it does not reach the first position dim: right-aligned, it still broadcasts
            if is_op(arg, aten.full.default) and not _constant_along(arg, rank, pair):
                shape[len(shape) + pair : len(shape) + pair + 2] = [self.distance.count]
                return call_op(graph, aten.full.default, (shape, *arg.args[1:]), dict(arg.kwargs))
            del shape[len(shape) + pair]
            return call_op(graph, aten.view.default, (arg, shape))

        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), collapsed)
        return call_op(graph, node.target, args, kwargs)

    def tabulate(self, node: torch.fx.Node) -> torch.fx.Node:
        """Replace ``node``'s uses outside the tabulated nodes by a read of its table at ``d − lo``."""
        graph, distance = node.graph, self.distance
        rank, pair = len(_shape(node)), self.pairs[node]
        table = self.replica(node)
        distance_dim = rank + pair  # in the replica, whose rank is one less
        others = [d for d in range(rank - 1) if d != distance_dim]
        anchor = node.next
        with graph.inserting_before(anchor):
            if distance_dim != rank - 2:  # the distance dim last: consecutive columns read consecutive elements
                table = call_op(graph, aten.permute.default, (table, [*others, distance_dim]))
            table = call_op(graph, aten.clone.default, (table,), dict(memory_format=torch.contiguous_format))
            table.meta[DISTANCE_TABLE] = True
            sizes = list(_shape(node)[rank + pair : rank + pair + 2])
            offset = call_op(graph, aten.sub.Tensor, (distance.node, distance.low))
            offset = call_op(graph, aten.view.default, (offset, sizes))
            read = call_op(graph, aten.index.Tensor, (table, [None] * (rank - 2) + [offset]))
            leading = rank + pair
            trailing = rank - leading - 2
            order = [*range(leading), leading + trailing, leading + trailing + 1,
                     *range(leading, leading + trailing)]
            if order != list(range(rank)):
                read = call_op(graph, aten.permute.default, (read, order))
        node.replace_all_uses_with(read, delete_user_cb=lambda user: user not in self.pairs)
        return read


def tabulate_distance_functions(graph: torch.fx.Graph) -> None:
    """Post-grad pass: values computed from a position distance alone are computed once per distance."""
    if not config.distance_tables:
        return
    changed = False
    for node in list(graph.nodes):
        distance = _distance(node)
        if distance is None:
            continue
        tabulation = _Tabulation(distance)
        tabulation.grow()
        for value in tabulation.boundary():
            tabulation.tabulate(value)
            changed = True
            counters["inductor"]["flashlight_distance_tables"] += 1
            log.info("%s (%s) computed once per distance: %d values", value.name, value.target, distance.count)
    if changed:
        graph.eliminate_dead_code()
        graph.lint()


def distance_computing(value: torch.fx.Node) -> Optional[_Tabulation]:
    """The tabulation of a distance between the last two dims (rows m, columns n) from which ``value`` is computed
    alone (``_pair_of``), or None."""
    for node in value.graph.nodes:
        distance = _distance(node)
        if distance is None or distance.pair != -2 or len(_shape(node)) != 2:
            continue
        tabulation = _Tabulation(distance)
        tabulation.grow()
        if value in tabulation.pairs:
            return tabulation
    return None


def columns_minus_rows(tabulation: _Tabulation) -> bool:
    """Whether the tabulated distance is n − m (columns minus rows); else it is m − n."""
    first = _position(tabulation.distance.node.args[0])
    return first is not None and first[0] == -1


def over_distances(tabulation: _Tabulation, value: torch.fx.Node) -> Optional[torch.fx.GraphModule]:
    """A module of no inputs computing ``value`` once per distance (the tabulation's replica, its two position dims
    one of M + N − 1, ordered as the distance's values), where ``value`` reads nothing but constants and positions;
    else None. The module's graph is built apart: ``value``'s own graph is left as it was."""
    graph = value.graph
    before = set(graph.nodes)
    try:
        replica = tabulation.replica(value)
        needed, frontier = set(), [replica]
        while frontier:
            node = frontier.pop()
            if node not in needed:
                needed.add(node)
                frontier.extend(node.all_input_nodes)
        if not all(node.op == "call_function" for node in needed):
            return None
        copied = torch.fx.Graph()
        env: dict = {}
        for node in graph.nodes:
            if node in needed:
                env[node] = copied.node_copy(node, lambda arg: env[arg])
        copied.output(env[replica])
        return torch.fx.GraphModule(torch.nn.Module(), copied)
    finally:  # leave the graph as it was
        for node in reversed([node for node in graph.nodes if node not in before]):
            graph.erase_node(node)
        tabulation.replicas.clear()
