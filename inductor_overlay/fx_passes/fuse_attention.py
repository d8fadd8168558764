"""Who takes attention that upstream's SDPA pattern matcher recognises: SDPA, or the overlay's fused kernel.

Upstream's joint-graph pass (``torch/_inductor/fx_passes/fuse_attention.py``) rewrites the plain forms of
attention into ``scaled_dot_product_attention`` before our post-grad pass sees them. ``config.sdpa_pattern_policy``
decides: ``"sdpa"`` keeps upstream's rewrite, ``"flashlight"`` declines it so the overlay fuses the program itself,
``"unmasked_sdpa"`` declines the patterns that apply a mask (an ``add`` or a ``where`` among the matched nodes) and
keeps the others. Under both SDPA policies a pattern whose K and V are repeated over query-head groups (GQA) is
declined where ``fx_passes/sdpa_route.py`` takes it: the route gives SDPA the unrepeated K/V (``enable_gqa``), where
upstream's rewrite copies the repeated ones first.

Upstream registers some of its patterns with a reference to ``_sfdp_params_check`` taken once per process, when
the first graph of a device is compiled. Patterns registered while the patches are applied hold the wrapper, which
answers as upstream whenever they are reverted; patterns registered while they were reverted hold upstream's check,
and :func:`registered_pattern_check_cells` lets the patch point those at the wrapper while it is applied.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch

from inductor_overlay import config
from inductor_overlay.state import overlay_active


# A matched pattern with one of these applies a mask (an additive one, or ``where(causal_mask, x, -inf)``).
_MASKING = (torch.ops.aten.add.Tensor, torch.ops.aten.where.self)


def wrap_sfdp_params_check(upstream_check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    @functools.wraps(upstream_check)
    def _sfdp_params_check(match: Any) -> bool:
        import torch_patches

        from inductor_overlay.fx_passes.sdpa_route import takes_repeated_kv

        policy = config.sdpa_pattern_policy
        applies_a_mask = any(node.target in _MASKING for node in match.nodes)
        declines = config.attention_fusion and (
            policy == "flashlight"
            or (policy == "unmasked_sdpa" and applies_a_mask)
            or takes_repeated_kv(match.kwargs["key"], match.kwargs["value"])
        )
        if declines and overlay_active() and torch_patches.is_applied():
            return False
        return upstream_check(match)

    return _sfdp_params_check


def registered_pattern_check_cells() -> Iterator[Any]:
    """The closure cells of the checks of the patterns registered so far in upstream's joint-graph pass: where
    upstream's ``register_replacement`` keeps the ``extra_check`` it was given."""
    from torch._inductor.fx_passes.joint_graph import patterns

    for entries in list(patterns.patterns.values()):
        for entry in entries:
            for cell in getattr(getattr(entry, "extra_check", None), "__closure__", None) or ():
                try:
                    cell.cell_contents
                except ValueError:  # a cell not yet filled
                    continue
                yield cell
