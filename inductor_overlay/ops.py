"""``flashlight::online_softmax_attention``: the fused node the attention pass puts into the post-grad graph.

``out[z] = softmax_N(chain(q[z] @ kt[z])) @ v[z]`` where ``chain`` is the user's own pointwise program between
the two matmuls. With a ``sink`` (one logit per row) the softmax runs over one more column, which meets no V. A
chain registered with ``softmax=False`` meets V directly: ``out[z] = chain(q[z] @ kt[z]) @ v[z]``. With
``group_coefficients`` (G values) the output combines consecutive groups of G heads: ``Σ_g c[g]·out[z·G + g]``.
``online_softmax_attention_with_pair_sum`` also returns the probabilities reduced against a per-pair tensor,
``Σ_N p[z, m, n] · pair_values[z, m, n, :]`` (IPA). ``chain`` is kept (a GraphModule kept in
:data:`SCORE_CHAINS`, keyed by the op's ``chain_id``). Each operand keeps the
batch dims it had before the matmul flattened them (q ``[*bq, M, D]``, kt ``[*bk, D, N]``, v ``[*bv, N, Dv]``, each
batch flattening row-major to the same Z entries); the output is ``[Z, M, Dv]``, as the matmul's was. The chain
sees scores shaped ``[*batch, M, N]`` with ``prod(batch) == Z``, exactly as in the user's graph.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class ScoreChain:
    """The user's pointwise program from raw scores ``q @ kt`` to softmax logits."""

    graph_module: torch.fx.GraphModule
    batch_shape: tuple  # leading dims of the score tensor; their product is Z
    score_dtype: torch.dtype  # dtype of q @ kt in the user's graph
    probability_dtype: torch.dtype  # dtype the probabilities had when they met v
    masked_tile_code: Optional[str] = None  # Triton test that a tile is entirely -inf by position (block skipping)
    softmax: bool = True  # False: no normalisation, the chain's output meets V (sigmoid attention, (A·B)·C)
    # The chain without its position-mask ``where``s, and the Triton test that a tile is entirely unmasked: such
    # tiles run this chain instead (no per-element mask math). None: every tile runs the whole chain.
    unmasked_graph_module: Optional[torch.fx.GraphModule] = None
    visible_tile_code: Optional[str] = None
    sink_scale: float = 1.0  # the softmax's logit scale, applied to the sink logit as to the others
    pair_dtype: Optional[torch.dtype] = None  # dtype of the pair reduction's result, when there is one


SCORE_CHAINS: dict[int, ScoreChain] = {}
_next_chain_id = itertools.count()


def register_score_chain(chain: ScoreChain) -> int:
    chain_id = next(_next_chain_id)
    SCORE_CHAINS[chain_id] = chain
    return chain_id


_library = torch.library.Library("flashlight", "DEF")
_library.define(
    "online_softmax_attention(Tensor q, Tensor kt, Tensor v, Tensor[] captured, Tensor? sink, int chain_id, "
    "Tensor? group_coefficients=None) -> Tensor"
)
_library.define(
    "online_softmax_attention_with_pair_sum(Tensor q, Tensor kt, Tensor v, Tensor[] captured, Tensor? sink, "
    "int chain_id, Tensor pair_values) -> (Tensor, Tensor)"
)


def _probabilities(chain: ScoreChain, q, kt, v, captured, sink) -> torch.Tensor:
    """``[*batch, M, N]`` probabilities as the user's graph computes them (the unfused meaning of the op)."""
    m, d, n = q.shape[-2], q.shape[-1], v.shape[-2]
    z = math.prod(chain.batch_shape)
    scores = torch.bmm(q.reshape(z, m, d), kt.reshape(z, d, n)).view(*chain.batch_shape, m, n)
    logits = chain.graph_module(scores, *captured)
    if not chain.softmax:
        return logits.to(chain.probability_dtype)
    if sink is None:
        return torch.softmax(logits, dim=-1).to(chain.probability_dtype)
    sink_logits = sink.expand(*chain.batch_shape, m, 1).to(logits.dtype) * chain.sink_scale
    return torch.softmax(torch.cat([logits, sink_logits], -1), dim=-1)[..., :n].to(chain.probability_dtype)


def _times_values(chain: ScoreChain, probabilities: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[Z, M, Dv]``: the probabilities times V, batch entries flattened."""
    z, (m, n), dv = math.prod(chain.batch_shape), probabilities.shape[-2:], v.shape[-1]
    return torch.bmm(probabilities.reshape(z, m, n), v.reshape(z, n, dv))


@torch.library.impl(_library, "online_softmax_attention", "CompositeExplicitAutograd")
def online_softmax_attention_eager(q, kt, v, captured, sink, chain_id, group_coefficients=None):
    chain = SCORE_CHAINS[chain_id]
    probabilities = _probabilities(chain, q, kt, v, captured, sink)
    out = _times_values(chain, probabilities, v)
    if group_coefficients is None:
        return out
    groups = group_coefficients.numel()
    z, m, dv = out.shape
    weighted = out.view(z // groups, groups, m, dv).float() * group_coefficients.float().view(1, groups, 1, 1)
    return weighted.sum(1).to(out.dtype)


@torch.library.impl(_library, "online_softmax_attention_with_pair_sum", "CompositeExplicitAutograd")
def online_softmax_attention_with_pair_sum_eager(q, kt, v, captured, sink, chain_id, pair_values):
    """Also ``Σ_N p[..., m, n] · pair_values[..., m, n, c]``, as ``[Z, M, C]``."""
    chain = SCORE_CHAINS[chain_id]
    probabilities = _probabilities(chain, q, kt, v, captured, sink)
    out = _times_values(chain, probabilities, v)
    pair = (probabilities.unsqueeze(-1).to(chain.pair_dtype) * pair_values).sum(-2)
    return out, pair.reshape(out.shape[0], out.shape[1], pair_values.shape[-1])


@torch.library.register_fake("flashlight::online_softmax_attention")
def online_softmax_attention_fake(q, kt, v, captured, sink, chain_id, group_coefficients=None):
    z = math.prod(SCORE_CHAINS[chain_id].batch_shape)
    if group_coefficients is not None:
        z = z // group_coefficients.numel()
    return q.new_empty(z, q.shape[-2], v.shape[-1], dtype=v.dtype)


@torch.library.register_fake("flashlight::online_softmax_attention_with_pair_sum")
def online_softmax_attention_with_pair_sum_fake(q, kt, v, captured, sink, chain_id, pair_values):
    chain = SCORE_CHAINS[chain_id]
    z, m = math.prod(chain.batch_shape), q.shape[-2]
    return q.new_empty(z, m, v.shape[-1], dtype=v.dtype), q.new_empty(z, m, pair_values.shape[-1], dtype=chain.pair_dtype)
