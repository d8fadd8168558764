"""Host checks of tensors made outside the compiled graph, once per version of those tensors, never by waiting for
the device:

- ``flashlight::known_causal``: whether the mask the tensors describe is exactly the causal one. A mask read from
  tensors (a registered ``tril`` buffer sliced to the length, positions made once, a mask passed in) can be the
  causal mask without the graph saying so; ``fx_passes/causal_tensor_route.py`` then puts the attention under a
  ``torch.cond`` on this op: the in-function causal form's kernel where it answers True (SDPA's for plain causal
  attention), the kernel that reads the mask otherwise.
- ``flashlight::known_band``: whether that mask is exactly a band ``~(((n <= m) & (m - n < W)) | (n < P))``
  (a causal sliding window of W keys, a prefix of P keys seen by every row, or both) whose W and P
  ``band_parameters`` reads off the mask's first and last rows, with some key kept in each row;
  ``fx_passes/band_tensor_route.py`` then runs the attention with that formula, W and P computed from the mask's
  rows in the graph by the same function.
- ``flashlight::known_arange``: whether 1-D tensors (positions made once, a registered position buffer) hold
  0, 1, ..., len − 1; ``fx_passes/arange_positions_route.py`` then runs the attention as if they were built in the
  graph with ``arange``.

An op decides on the host, from what it has seen before:

- the first time it sees a set of tensors (the same Python objects at the same version, address, shape and
  strides) it answers False and remembers them: tensors made anew for every call never cost a check;
- the second time it starts the check on the device (for a mask: its own computation, given as Python source,
  compared with ``n > m``), and copies the verdict to pinned host memory behind a CUDA event;
- once the event has completed (a later call; at once on the CPU) it answers with the verdict for as long as the
  tensors stay the same objects at the same version.

An in-place write to a tensor changes its version, so the next call answers False and the check starts over: the
trust autograd places in version counters when it checks a tensor saved for backward. Writes that change no version
are not seen: through ``tensor.data``, through another tensor on the same storage made by ``set_`` or
``untyped_storage()``, through NumPy or DLPack aliases, by kernels given the raw pointer, by CUDA graph replays.
``config.causal_tensor_route`` and ``config.arange_positions_route`` turn the routes off for programs that write
their tensors that way. Tensors made under ``torch.inference_mode`` have no version counter, and a call being
captured into a CUDA graph would fix its answer in the graph: both are answered False, unchecked. A check that
fails (out of memory) answers False.
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
    verdict: Optional[torch.Tensor] = None  # 0-d bool on the host: the property fails somewhere
    ready: Optional[Callable[[], bool]] = None  # whether ``verdict`` holds the device's answer yet
    holds: Optional[bool] = None


# (property, its arguments, ids of the tensors) -> what the ops know; an entry leaves with the first of its tensors
# to die.
_SIGHTINGS: dict[tuple, _Sighting] = {}

# What a check's source may name besides its arguments (FX writes these for devices, dtypes and infinities).
CHECK_GLOBALS = {"torch": torch, "device": torch.device, "inf": math.inf, "nan": math.nan, "NoneType": type(None)}

# The check compares this many elements of the mask with the causal one at a time (a slab of rows).
_COMPARED_AT_ONCE = 2**26


def _mark(tensor: torch.Tensor) -> tuple:
    return (tensor._version, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


@functools.lru_cache(maxsize=256)
def _check_function(source: str) -> Callable[..., torch.Tensor]:
    """The mask's computation from its tensors (``forward`` of an FX graph's Python source)."""
    namespace = dict(CHECK_GLOBALS)
    exec(compile(source, "<flashlight mask check>", "exec"), namespace)  # noqa: S102  (FX's own code for the mask)
    return functools.partial(namespace["forward"], None)


def _start_check(sighting: _Sighting, tensors: list, source: str, rows: int) -> None:
    """Evaluate the mask and compare it with ``n > m`` (where SDPA's causal kernel masks), a slab of rows at a time,
    on the tensors' device, without waiting for the answer. The mask is boolean, or the int8 states of an additive
    mask (0 zero, 1 absorbing, 2 neither: a 2 equals neither True nor False, so it never matches)."""
    with torch.no_grad():
        masked = _check_function(source)(*tensors)
        masked = masked.reshape((1,) * (2 - masked.dim()) + tuple(masked.shape))  # a row or a scalar: broadcast
        masked = masked.expand(*masked.shape[:-2], rows, rows)
        positions = torch.arange(rows, device=masked.device)
        slab = max(1, _COMPARED_AT_ONCE // max(1, masked[..., :1, :].numel()))
        differs = torch.zeros((), dtype=torch.bool, device=masked.device)
        for first in range(0, rows, slab):
            causal = positions[None, :] > positions[first : first + slab, None]
            differs |= (masked[..., first : first + slab, :] != causal).any()
    _verdict_later(sighting, differs)


def band_parameters(masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, P), int32 0-d tensors (at most R), of the band a mask ``[..., R, R]`` (True, or nonzero, where masked) would be, read
    off its first entry's first and last rows: P the keys the first row keeps when more than one, else 0; W the keys
    from P on that the last row keeps. The check and the graph both compute them with this function."""
    entry = masked
    while entry.dim() > 2:
        entry = entry[0]
    # (The rows are taken before any op on them: the graph then computes two rows, not the whole mask.)
    first_kept = (entry[0] == 0).sum(dtype=torch.int64)
    prefix = torch.where(first_kept > 1, first_kept, 0)
    columns = torch.arange(entry.shape[-1], device=entry.device)
    width = ((entry[-1] == 0) & (columns >= prefix)).sum(dtype=torch.int64)
    return width.to(torch.int32), prefix.to(torch.int32)


def band_masked(rows: torch.Tensor, columns: torch.Tensor, width: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """Where the band of ``band_parameters`` masks, for row positions ``rows`` ``[R', 1]`` and column positions
    ``columns`` ``[1, R]`` (integers below 2^31 - R in magnitude: exact in int32, as the graph computes it): not (a
    key at most W − 1 before its row and not after it, or among the first P). The graph's copy computes it with W
    and P as scalars its kernel reads once."""
    return ~(((columns <= rows) & (columns >= rows - width + 1)) | (columns - prefix < 0))


def _start_band_check(sighting: _Sighting, tensors: list, source: str, rows: int) -> None:
    """Evaluate the mask, read its band's parameters off it and compare it with that band, a slab of rows at a
    time, on the tensors' device, without waiting for the answer; a band that keeps no key in some row (W < 1 and
    P < 1) does not hold. As for ``_start_check``, an additive mask's states 2 never match."""
    with torch.no_grad():
        masked = _check_function(source)(*tensors)
        if masked.dim() < 2 or tuple(masked.shape[-2:]) != (rows, rows):
            raise ValueError("not a square mask")
        width, prefix = band_parameters(masked)
        positions = torch.arange(rows, device=masked.device)
        slab = max(1, _COMPARED_AT_ONCE // max(1, masked[..., :1, :].numel()))
        differs = (width < 1) & (prefix < 1)
        for first in range(0, rows, slab):
            band = band_masked(positions[first : first + slab, None], positions[None, :], width, prefix)
            differs |= (masked[..., first : first + slab, :] != band).any()
    _verdict_later(sighting, differs)


def _start_arange_check(sighting: _Sighting, tensors: list) -> None:
    """Compare each (1-D) tensor with 0, 1, ..., len − 1 on its device, without waiting for the answer."""
    with torch.no_grad():
        differs = torch.zeros((), dtype=torch.bool, device=tensors[0].device)
        for tensor in tensors:
            differs |= (tensor != torch.arange(tensor.numel(), device=tensor.device)).any()
    _verdict_later(sighting, differs)


def _verdict_later(sighting: _Sighting, differs: torch.Tensor) -> None:
    """Keep the device's answer (``differs``, 0-d bool) for a later call: copied to pinned host memory behind a
    CUDA event, or at once on the CPU."""
    if differs.device.type == "cuda":
        verdict = torch.ones((), dtype=torch.bool, pin_memory=True)
        verdict.copy_(differs, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(differs.device))
        sighting.verdict, sighting.ready = verdict, done.query
    else:
        sighting.verdict, sighting.ready = differs, lambda: True


def _forget(key: tuple) -> Callable[[object], None]:
    return lambda _: _SIGHTINGS.pop(key, None)


def _known(key: tuple, tensors: list, start: Callable[[_Sighting], None]) -> bool:
    """Whether the property ``start`` checks (its verdict: it fails somewhere) is known to hold of ``tensors``:
    False at the first sighting of these tensors at their version, the check started at the second, its answer
    from the first call after the device has given it (see the module's rules). ``key`` names the property."""
    if any(tensor.is_inference() for tensor in tensors) or _capturing_graph():
        return False
    key = (*key, tuple(id(tensor) for tensor in tensors))
    marks = tuple(_mark(tensor) for tensor in tensors)
    sighting = _SIGHTINGS.get(key)
    if sighting is None or sighting.marks != marks or any(ref() is not t for ref, t in zip(sighting.refs, tensors)):
        _SIGHTINGS[key] = _Sighting(tuple(weakref.ref(tensor, _forget(key)) for tensor in tensors), marks)
        return False
    if sighting.holds is None:
        if sighting.ready is None:
            try:
                start(sighting)
            except Exception:  # noqa: BLE001  (out of memory, a mask the source cannot compute: it does not hold)
                sighting.holds = False
                return False
        if sighting.ready():
            sighting.holds = not bool(sighting.verdict)
    return bool(sighting.holds)


def is_known_causal(tensors: list, check: str, rows: int) -> bool:
    """Whether the mask ``check`` computes from ``tensors`` is known to be exactly ``n > m`` (see the module's
    rules)."""
    return _known(("causal", check, rows), tensors, lambda sighting: _start_check(sighting, tensors, check, rows))


def is_known_band(tensors: list, check: str, rows: int) -> bool:
    """Whether the mask ``check`` computes from ``tensors`` is known to be exactly the band of its
    ``band_parameters`` (see the module's rules)."""
    return _known(("band", check, rows), tensors, lambda sighting: _start_band_check(sighting, tensors, check, rows))


def is_known_arange(tensors: list) -> bool:
    """Whether each of ``tensors`` (1-D) is known to hold 0, 1, ..., len − 1 (see the module's rules)."""
    return _known(("arange",), tensors, lambda sighting: _start_arange_check(sighting, tensors))


def _capturing_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# Defined through torch.library.Library rather than ``custom_op``: the op runs at every call of the graph, and the
# plain registration dispatches in a third of the time (about 10 against 26 us on a 2-core host).
_LIBRARY = torch.library.Library("flashlight", "FRAGMENT")
_LIBRARY.define("known_causal(Tensor[] tensors, str check, int rows) -> Tensor")


def _known_causal(tensors: list[torch.Tensor], check: str, rows: int) -> torch.Tensor:
    """True (a 0-d bool tensor on the host) when the mask ``check`` computes from ``tensors`` is known to be exactly
    ``n > m`` over ``rows`` rows and columns; False when it is not, or not known yet."""
    return torch.tensor(is_known_causal(tensors, check, rows))


_LIBRARY.impl("known_causal", _known_causal, "CompositeExplicitAutograd")


@torch.library.register_fake("flashlight::known_causal", lib=_LIBRARY)
def _(tensors: list[torch.Tensor], check: str, rows: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.bool, device="cpu")


_LIBRARY.define("known_band(Tensor[] tensors, str check, int rows) -> Tensor")


def _known_band(tensors: list[torch.Tensor], check: str, rows: int) -> torch.Tensor:
    """True (a 0-d bool tensor on the host) when the mask ``check`` computes from ``tensors`` is known to be exactly
    the band ``band_parameters`` reads off it; False when it is not, or not known yet."""
    return torch.tensor(is_known_band(tensors, check, rows))


_LIBRARY.impl("known_band", _known_band, "CompositeExplicitAutograd")


@torch.library.register_fake("flashlight::known_band", lib=_LIBRARY)
def _(tensors: list[torch.Tensor], check: str, rows: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.bool, device="cpu")


_LIBRARY.define("known_arange(Tensor[] tensors) -> Tensor")


def _known_arange(tensors: list[torch.Tensor]) -> torch.Tensor:
    """True (a 0-d bool tensor on the host) when each of ``tensors`` is known to hold 0, 1, ..., len − 1."""
    return torch.tensor(is_known_arange(tensors))


_LIBRARY.impl("known_arange", _known_arange, "CompositeExplicitAutograd")


@torch.library.register_fake("flashlight::known_arange", lib=_LIBRARY)
def _(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty((), dtype=torch.bool, device="cpu")


known_causal = torch.ops.flashlight.known_causal.default
known_band = torch.ops.flashlight.known_band.default
known_arange = torch.ops.flashlight.known_arange.default
