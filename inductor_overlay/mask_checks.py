"""``flashlight::known_causal``: whether the mask that tensors made outside the compiled graph describe is known to
be exactly the causal one, checked once per version of those tensors, never by waiting for the device.

A mask read from tensors (a registered ``tril`` buffer sliced to the length, positions made once, a mask passed in)
can be the causal mask without the graph saying so. ``fx_passes/causal_tensor_route.py`` then puts the attention
under a ``torch.cond`` on this op: SDPA's causal kernel where the op answers True, the overlay's fused kernel
otherwise. The op decides on the host, from what it has seen before:

- the first time it sees a set of tensors (the same Python objects at the same version, address, shape and
  strides) it answers False and remembers them: tensors made anew for every call never cost a check;
- the second time it starts the check: it evaluates the mask from the tensors (``check``, the mask's own
  computation as Python source), compares it with ``n > m`` on the device, and copies the verdict to pinned host
  memory behind a CUDA event;
- once the event has completed (a later call; at once on the CPU) it answers with the verdict for as long as the
  tensors stay the same objects at the same version.

An in-place write to a tensor changes its version, so the next call answers False and the check starts over.
A write through ``tensor.data`` (or outside PyTorch) changes no version and is not seen: ``config.causal_tensor_route``
turns the route off for programs that write their masks that way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Callable, Optional

import torch


@dataclasses.dataclass
class _Sighting:
    """What the op knows about one set of tensors."""

    refs: tuple  # weak references to the tensors, in the op's order
    marks: tuple  # each tensor's (version, address, shape, strides, offset) when first seen
    verdict: Optional[torch.Tensor] = None  # 0-d bool on the host: the mask differs from the causal one somewhere
    ready: Optional[Callable[[], bool]] = None  # whether ``verdict`` holds the device's answer yet
    causal: Optional[bool] = None


# (check source, ids of the tensors) -> what the op knows; an entry leaves with the first of its tensors to die.
_SIGHTINGS: dict[tuple, _Sighting] = {}

# What a check's source may name besides its arguments (FX writes these for devices, dtypes and infinities).
_CHECK_GLOBALS = {"torch": torch, "device": torch.device, "inf": math.inf, "nan": math.nan, "NoneType": type(None)}


def _mark(tensor: torch.Tensor) -> tuple:
    return (tensor._version, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


@functools.lru_cache(maxsize=256)
def _check_function(source: str) -> Callable[..., torch.Tensor]:
    """The mask's computation from its tensors (``forward`` of an FX graph's Python source)."""
    namespace = dict(_CHECK_GLOBALS)
    exec(compile(source, "<flashlight mask check>", "exec"), namespace)  # noqa: S102  (FX's own code for the mask)
    return functools.partial(namespace["forward"], None)


def _start_check(sighting: _Sighting, tensors: list, source: str, rows: int) -> None:
    """Evaluate the mask and compare it with ``n > m`` (where SDPA's causal kernel masks), on the tensors' device,
    without waiting for the answer."""
    with torch.no_grad():
        masked = _check_function(source)(*tensors)
        positions = torch.arange(rows, device=masked.device)
        differs = (masked != (positions[None, :] > positions[:, None])).any()
    if differs.device.type == "cuda":
        verdict = torch.empty((), dtype=torch.bool, pin_memory=True)
        verdict.copy_(differs, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        sighting.verdict, sighting.ready = verdict, done.query
    else:
        sighting.verdict, sighting.ready = differs, lambda: True


def _forget(key: tuple) -> Callable[[object], None]:
    return lambda _: _SIGHTINGS.pop(key, None)


def known_causal_meaning(tensors: list, check: str, rows: int) -> bool:
    key = (check, tuple(id(tensor) for tensor in tensors))
    marks = tuple(_mark(tensor) for tensor in tensors)
    sighting = _SIGHTINGS.get(key)
    if sighting is None or sighting.marks != marks or any(ref() is not t for ref, t in zip(sighting.refs, tensors)):
        _SIGHTINGS[key] = _Sighting(tuple(weakref.ref(tensor, _forget(key)) for tensor in tensors), marks)
        return False
    if sighting.causal is None:
        if sighting.ready is None:
            _start_check(sighting, tensors, check, rows)
        if sighting.ready():
            sighting.causal = not bool(sighting.verdict)
    return bool(sighting.causal)


# Defined through torch.library.Library rather than ``custom_op``: the op runs at every call of the graph, and the
# plain registration dispatches in a third of the time (about 10 against 26 us on a 2-core host).
_LIBRARY = torch.library.Library("flashlight", "FRAGMENT")
_LIBRARY.define("known_causal(Tensor[] tensors, str check, int rows) -> Tensor")


def _known_causal(tensors: list[torch.Tensor], check: str, rows: int) -> torch.Tensor:
    """True (a 0-d bool tensor on the host) when the mask ``check`` computes from ``tensors`` is known to be exactly
    ``n > m`` over ``rows`` rows and columns; False when it is not, or not known yet."""
    return torch.tensor(known_causal_meaning(tensors, check, rows))


_LIBRARY.impl("known_causal", _known_causal, "CompositeExplicitAutograd")


@torch.library.register_fake("flashlight::known_causal", lib=_LIBRARY)
def _(tensors: list[torch.Tensor], check: str, rows: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.bool, device="cpu")


known_causal = torch.ops.flashlight.known_causal.default
