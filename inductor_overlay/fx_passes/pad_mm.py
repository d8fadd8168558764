"""Keep upstream's matmul padding away from the attention the overlay fuses.

Upstream's joint-graph pass (``torch/_inductor/fx_passes/pad_mm.py``) pads a matmul whose sizes are not multiples
of the alignment (S = 300 in bf16) when a benchmark, run at compile time, finds the padded matmul faster. A padded
``q @ kᵀ`` or ``p @ v`` reaches our post-grad pass sliced and padded, in a form the attention pass does not follow,
so the fusion silently gave way to upstream's kernels, and whether it did depended on a timing taken at compile
time. The fused kernel needs no aligned sizes (it masks ragged tiles), so while the overlay is active a matmul that
is part of attention is not padded: its product reaches a row max (the scores), or its left operand is a softmax (the
probabilities), or, for weights without a softmax (sigmoid attention, (A·B)·C), it is the output matmul of a region
the attention pass accepts or its product is that region's scores; in training, also the matmuls autograd made to
differentiate those (the same sequence number), which the fused backward replaces.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from inductor_overlay import config
from inductor_overlay.fx_passes.attention_region import (
    Decline,
    _looks_like_softmax_input,
    chain_uses,
    find_attention,
    reaches_op,
)
from inductor_overlay.fx_passes.block_sparsity import is_op
from inductor_overlay.fx_passes.fx_helpers import _MATMULS, aten, is_backward
from inductor_overlay.state import overlay_active



def part_of_attention(match: Any) -> bool:
    """Whether the matched matmul computes attention's scores or applies its probabilities to V (False, upstream's
    decision, should the analysis itself fail)."""
    matmuls = [node for node in match.nodes if is_op(node, _MATMULS)]
    try:
        return any(_attention_matmul(mm) or _differentiates_attention(mm) for mm in matmuls)
    except Exception:  # noqa: BLE001  (fault containment: this runs inside upstream's pattern pass)
        return False


def _attention_matmul(mm: Any) -> bool:
    # (A sink's column joins the scores through a ``cat`` before the row max.)
    if _looks_like_softmax_input(mm) or reaches_op(mm, aten.amax.default, through=(aten.cat.default,)):
        return True
    # The output matmul of weights without a softmax, or the matmul whose product those weights are made from.
    weighed = [user for user, value in chain_uses(mm) if is_op(user, _MATMULS) and user.args[0] is value]
    return any(_output_of_a_region(pv) for pv in [mm, *weighed])


def _output_of_a_region(pv: Any) -> bool:
    dead = frozenset(n for n in pv.graph.nodes if is_backward(n))
    return not isinstance(find_attention(pv, dead=dead), Decline)


def _differentiates_attention(mm: Any) -> bool:
    """A matmul of a joint graph's backward that differentiates an attention matmul (autograd's sequence number)."""
    sequence = mm.meta.get("seq_nr")
    if not is_backward(mm) or sequence is None:
        return False
    return any(
        is_op(node, _MATMULS) and not is_backward(node) and node.meta.get("seq_nr") == sequence and _attention_matmul(node)
        for node in mm.graph.nodes
    )


def wrap_should_pad(upstream_should_pad: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(upstream_should_pad)
    def should_pad(match: Any, mat1: Any, mat2: Any, op: Any, input: Any = None) -> bool:
        import torch_patches
        from torch._inductor.fx_passes.pad_mm import can_pad

        active = config.attention_fusion and overlay_active() and torch_patches.is_applied()
        # (The cheap test of whether upstream could pad at all comes first: the analysis is for the matmuls it would.)
        if active and can_pad(mat1, mat2, op, input) and part_of_attention(match):
            return False
        return upstream_should_pad(match, mat1, mat2, op, input)

    return should_pad
