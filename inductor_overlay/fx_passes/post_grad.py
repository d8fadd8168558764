"""The overlay's post-grad pass, installed through Inductor's ``post_grad_custom_pre_pass`` seam.

It runs before upstream's post-grad pattern passes, so it sees softmax decomposed (amax, sub, exp, sum, div)
rather than rewritten by ``config.online_softmax`` into ``prepare_softmax_online``.

Its ``uuid()`` folds the overlay's version, config and source into Inductor's FX-graph cache key, so a
cached kernel from another overlay version (or from upstream) is never reused by mistake.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import pathlib
from typing import Any, Callable, Optional

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import stable_topological_sort

from inductor_overlay import __version__, config
from inductor_overlay.fx_passes.attention_fusion import fuse_attention
from inductor_overlay.fx_passes.attention_training import fuse_attention_for_training
from inductor_overlay.fx_passes.distance_tables import tabulate_distance_functions
from inductor_overlay.fx_passes.fx_helpers import restore_graph
from inductor_overlay.fx_passes.head_combination import distribute_matmul_over_head_combinations
from inductor_overlay.fx_passes.head_groups_pre_grad import distribute_head_groups_before_autograd
from inductor_overlay.fx_passes.pair_matmul import rewrite_pair_matmuls
from inductor_overlay.fx_passes.scaled_matmuls import split_baddbmm_scores
from inductor_overlay.fx_passes.score_views import move_batch_views_off_score_chains
from inductor_overlay.fx_passes.signed_scales import rejoin_signed_scales
from inductor_overlay.kernel import attention_backward, mask_cell_states, online_softmax_attention  # noqa: F401  (register the ops' lowerings)
from inductor_overlay.state import overlay_active

GraphPass = Callable[[torch.fx.Graph], None]

# Passes run in this order on every post-grad graph while the overlay is active.
POST_GRAD_PASSES: list[GraphPass] = [
    rejoin_signed_scales,
    split_baddbmm_scores,
    move_batch_views_off_score_chains,
    tabulate_distance_functions,
    distribute_matmul_over_head_combinations,
    rewrite_pair_matmuls,
    fuse_attention,
]


@functools.lru_cache(maxsize=1)
def overlay_source_hash() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.jinja")]):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# Passes run in this order on every joint forward+backward graph (training), after upstream's joint passes.
JOINT_PASSES: list[GraphPass] = [
    rejoin_signed_scales, split_baddbmm_scores, move_batch_views_off_score_chains, fuse_attention_for_training,
]

# Passes run on Dynamo's graph (torch IR), before AOTAutograd: each leaves the graph as it was on any failure.
PRE_GRAD_PASSES: list[GraphPass] = [distribute_head_groups_before_autograd]

log = logging.getLogger("flashlight.attention_fusion")


def _contained(graph_pass: GraphPass) -> GraphPass:
    """``graph_pass``, which on any exception leaves the graph as it found it (and logs why)."""

    def run(graph: torch.fx.Graph) -> None:
        # Upstream's joint passes sort the graph only after the custom pass: a replacement may have left a node
        # before its inputs, which a copy (and the pass) cannot follow.
        stable_topological_sort(graph)
        saved = torch.fx.Graph()
        saved.output(saved.graph_copy(graph, {}))
        try:
            graph_pass(graph)
        except Exception as error:  # noqa: BLE001  (fault containment)
            if not config.fault_containment:
                raise
            counters["inductor"]["flashlight_fault_fallback"] += 1
            log.warning("%s failed (%s: %s); the joint graph is left as upstream made it", graph_pass.__name__,
                        type(error).__name__, error)
            restore_graph(graph, saved)

    return run


class FlashlightPostGradPass(CustomGraphPass):
    def __init__(self, user_pass: Optional[CustomGraphPass] = None) -> None:
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)
        if not overlay_active():
            return
        for graph_pass in self.passes():
            graph_pass(graph)

    def passes(self) -> list[GraphPass]:
        return POST_GRAD_PASSES

    def uuid(self) -> Any:
        user_uuid = self.user_pass.uuid() if self.user_pass is not None else None
        settings = repr(sorted(config.get_config_copy().items()))
        return ("flashlight", __version__, overlay_source_hash(), settings, user_uuid)


class FlashlightJointPass(FlashlightPostGradPass):
    """The overlay's joint-graph pass, installed through Inductor's ``joint_custom_post_pass`` seam: the user's own
    pass first, as for the post-grad one. The joint graph is partitioned outside the compile step whose faults fall
    back to upstream (``compile_fx.contain_faults``): here a pass that raises has the graph put back as it was."""

    def passes(self) -> list[GraphPass]:
        return [_contained(graph_pass) for graph_pass in JOINT_PASSES]

    def uuid(self) -> Any:
        return ("joint", *super().uuid())


class FlashlightPreGradPass(FlashlightPostGradPass):
    """The overlay's pass over Dynamo's graph, installed through Inductor's ``pre_grad_custom_pass`` seam (after
    upstream's own pre-grad passes), the user's pass first."""

    def passes(self) -> list[GraphPass]:
        return PRE_GRAD_PASSES

    def uuid(self) -> Any:
        return ("pre_grad", *super().uuid())
