"""The overlay's post-grad pass, installed through Inductor's ``post_grad_custom_post_pass`` seam.

Its ``uuid()`` folds the overlay's version, config and source into Inductor's FX-graph cache key, so a
cached kernel from another overlay version (or from upstream) is never reused by mistake.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Any, Callable, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from inductor_overlay import __version__, config
from inductor_overlay.state import overlay_active

GraphPass = Callable[[torch.fx.Graph], None]

# Passes run in this order on every post-grad graph while the overlay is active.
POST_GRAD_PASSES: list[GraphPass] = []


@functools.lru_cache(maxsize=1)
def overlay_source_hash() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class FlashlightPostGradPass(CustomGraphPass):
    def __init__(self, user_pass: Optional[CustomGraphPass] = None) -> None:
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)
        if not overlay_active():
            return
        for graph_pass in POST_GRAD_PASSES:
            graph_pass(graph)

    def uuid(self) -> Any:
        user_uuid = self.user_pass.uuid() if self.user_pass is not None else None
        settings = repr(sorted(config.get_config_copy().items()))
        return ("flashlight", __version__, overlay_source_hash(), settings, user_uuid)
