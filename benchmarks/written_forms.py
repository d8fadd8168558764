"""The position-based variants written the ways model code writes them: positions, masks and slopes built in the
forward (``arange`` inside the compiled function), made once outside it (module-level tensors), kept as registered
buffers of an ``nn.Module`` at a longest length and sliced to the current one, precomputed masks sliced likewise, and
masks passed in as arguments. Every form of a family computes the same attention, so each should run as fast as the
best one (``python -m benchmarks.bench_attention --variants forms_causal,...``).

Tensors made "outside" are made by the variant's ``extras`` (which runs before compiling, as ``__init__`` or user code
would) and kept in ``MADE_ONCE``; the idioms read them from there, so Dynamo sees them as captured tensors, not as
arguments. The forms' reference is the in-function form (the first idiom).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from benchmarks.variants import (
    GEMMA_CAP,
    GEMMA_WINDOW,
    PREFIX,
    WINDOW,
    Shape,
    Variant,
    _document_ids,
    _document_pairs_fraction,
    _padding,
    _prefix_fraction,
    _scale,
    _window_fraction,
    document_mask,
    key_padding_bool_masked_fill,
)

Tensor = torch.Tensor
# Tensors and modules the forms read, made by ``extras`` outside the compiled function, by family.
MADE_ONCE: dict[str, dict[str, Any]] = {}
# Buffers are made this much longer than the sequence and sliced to it, as a model's ``max_position_embeddings``.
SPARE_LENGTH = 128


class PositionBuffers(nn.Module):
    """What a model's ``__init__`` registers: positions up to a longest length, the family's mask over them
    (``[1, 1, L, L]`` like GPT-2's ``bias``) or ALiBi's slopes; ``forward`` slices them to the current length."""

    def __init__(self, longest: int, heads: int, device: torch.device, family: "Family") -> None:
        super().__init__()
        position = torch.arange(longest, device=device)
        self.register_buffer("position", position, persistent=False)
        if family.keep is not None:
            self.register_buffer("mask", family.keep(position[:, None], position[None, :])[None, None], persistent=False)
        self.register_buffer("slopes", alibi_slopes(heads, device), persistent=False)
        self.family = family

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        position = self.position[: q.shape[-2]]
        return self.family.attention(q, k, v, position[:, None], position[None, :], self.slopes)


def alibi_slopes(heads: int, device: torch.device) -> Tensor:
    return torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, device=device, dtype=torch.float32) / heads)


@dataclasses.dataclass(frozen=True)
class Family:
    """One attention over positions: ``transform`` of the scaled scores (a soft-cap), then ALiBi's bias
    ``slopes · (n − m)`` in float32 (``alibi``), then the mask ``keep(rows, cols)`` (-inf where it is false)."""

    name: str
    keep: Optional[Callable[[Tensor, Tensor], Tensor]] = None
    transform: Callable[[Tensor], Tensor] = lambda scores: scores
    alibi: bool = False

    def attention(self, q, k, v, rows, cols, slopes):
        scores = self.transform(q @ k.transpose(-2, -1) * _scale(q))
        if self.alibi:
            scores = scores.float() + slopes[:, None, None] * (cols - rows)
        return self.masked(scores, None if self.keep is None else ~self.keep(rows, cols), q.dtype) @ v

    def masked(self, logits, masked, dtype):
        if masked is not None:
            logits = logits.masked_fill(masked, float("-inf"))
        return torch.softmax(logits, dim=-1).to(dtype)


def _forms(family: Family) -> dict[str, Callable[..., Tensor]]:
    """The idioms of one family: positions (and slopes) made in the forward, made once outside, or registered as
    buffers; with a mask, the mask precomputed and sliced (the buffer's ``[:, :, :T, :T] == 0``, nanoGPT's form; or
    filling ``finfo.min`` where it is false, Hugging Face's GPT-2), passed in as an argument (``keep``), or passed in
    as an additive float mask ``[1, 1, M, N]`` of 0 and ``finfo.min`` (Hugging Face's 4-D masks); for ALiBi, a
    precomputed per-head bias ``[H, 1, N]`` passed in (BLOOM's form, which drops the per-row term of ``n − m``: the
    softmax is the same)."""
    made = lambda: MADE_ONCE[family.name]  # noqa: E731

    def in_function(q, k, v, **_):
        rows = torch.arange(q.shape[-2], device=q.device)[:, None]
        cols = torch.arange(k.shape[-2], device=q.device)[None, :]
        return family.attention(q, k, v, rows, cols, alibi_slopes(q.shape[1], q.device))

    def captured_positions(q, k, v, **_):
        position = made()["position"]  # torch.arange(S, device=...) made once, outside
        return family.attention(q, k, v, position[:, None], position[None, :], made()["slopes"])

    def registered_buffer(q, k, v, **_):
        return made()["module"](q, k, v)

    forms = {"in_function": in_function, "captured_positions": captured_positions, "registered_buffer": registered_buffer}
    if family.alibi:

        def bias_passed_in(q, k, v, bias, **_):
            scores = family.transform(q @ k.transpose(-2, -1) * _scale(q)).float() + bias
            return family.masked(scores, None, q.dtype) @ v

        forms["bias_passed_in"] = bias_passed_in
    if family.keep is not None:

        def sliced_buffer_mask(q, k, v, **_):
            scores = family.transform(q @ k.transpose(-2, -1) * _scale(q))
            mask = made()["module"].mask[:, :, : q.shape[-2], : k.shape[-2]]
            return family.masked(scores, mask == 0, q.dtype) @ v

        def mask_passed_in(q, k, v, keep, **_):
            scores = family.transform(q @ k.transpose(-2, -1) * _scale(q))
            return family.masked(scores, ~keep, q.dtype) @ v

        def finfo_min_buffer(q, k, v, **_):
            scores = family.transform(q @ k.transpose(-2, -1) * _scale(q))
            keep = made()["module"].mask[:, :, : q.shape[-2], : k.shape[-2]]
            lowest = torch.full([], torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
            return family.masked(torch.where(keep, scores, lowest), None, q.dtype) @ v

        def additive_mask_passed_in(q, k, v, additive, **_):
            scores = family.transform(q @ k.transpose(-2, -1) * _scale(q))
            return family.masked(scores + additive, None, q.dtype) @ v

        forms.update(sliced_buffer_mask=sliced_buffer_mask, mask_passed_in=mask_passed_in,
                     finfo_min_buffer=finfo_min_buffer, additive_mask_passed_in=additive_mask_passed_in)
    return forms


def _made_once(family: Family) -> Callable[..., dict]:
    """``extras`` of a family: makes its captured tensors and its module (outside the compiled function, as
    ``__init__`` would) and returns what the passed-in forms take."""

    def extras(shape: Shape, device: torch.device, dtype: torch.dtype) -> dict:
        slopes = alibi_slopes(shape.H, device)
        MADE_ONCE[family.name] = {
            "position": torch.arange(shape.N, device=device),
            "slopes": slopes,
            "module": PositionBuffers(shape.N + SPARE_LENGTH, shape.H, device, family),
        }
        position = torch.arange(shape.N, device=device)
        passed = {"slopes": slopes}
        if family.alibi:
            passed["bias"] = slopes[:, None, None] * position[None, None, :]
        if family.keep is not None:
            passed["keep"] = family.keep(position[:, None], position[None, :])
            lowest = torch.finfo(dtype).min
            passed["additive"] = torch.zeros(passed["keep"].shape, device=device, dtype=dtype).masked_fill(
                ~passed["keep"], lowest)[None, None]
        return passed

    return extras


def _variant(family: Family, **variant: Any) -> Variant:
    return Variant(name=family.name, idioms=_forms(family), extras=_made_once(family), self_attention=True, **variant)


def _window(rows, cols, window):
    return (cols <= rows) & (rows - cols < window)


class DataBuffer(nn.Module):
    """A module that keeps per-token data (document ids, a padding mask) as a registered buffer."""

    def __init__(self, data: Tensor, attention: Callable[..., Tensor]) -> None:
        super().__init__()
        self.register_buffer("data", data, persistent=False)
        self.attention = attention

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.attention(q, k, v, self.data)


def _data_variant(name: str, key: str, make: Callable, attention: Callable, keep: Callable, **variant: Any) -> Variant:
    """A family whose mask comes from per-token data (``key``: document ids, a padding mask): passed in as an argument
    (the variant library's form, the reference), captured, kept as a registered buffer, or turned by user code into a
    boolean mask passed in (``keep(data)``, broadcastable to the scores)."""

    def passed_in(q, k, v, **extras):
        return attention(q, k, v, extras[key])

    def captured(q, k, v, **_):
        return attention(q, k, v, MADE_ONCE[name][key])

    def registered_buffer(q, k, v, **_):
        return MADE_ONCE[name]["module"](q, k, v)

    def mask_passed_in(q, k, v, keep, **_):
        scores = q @ k.transpose(-2, -1) * _scale(q)
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v

    def extras(shape: Shape, device: torch.device, dtype: torch.dtype) -> dict:
        data = make(shape, device, dtype)[key]
        MADE_ONCE[name] = {key: data.clone(), "module": DataBuffer(data.clone(), attention)}
        return {key: data, "keep": keep(data)}

    idioms = {f"{key}_passed_in": passed_in, "captured": captured, "registered_buffer": registered_buffer,
              "mask_passed_in": mask_passed_in}
    return Variant(name=name, idioms=idioms, extras=extras, self_attention=True, **variant)


FORMS: dict[str, Variant] = {
    variant.name: variant
    for variant in (
        _variant(
            Family("forms_causal", keep=lambda rows, cols: cols <= rows),
            flex_mask_mod=lambda extras: (lambda b, h, m, n: n <= m),
            visible_fraction=lambda shape: (shape.M + 1) / (2 * shape.M),
        ),
        _variant(
            Family("forms_sliding_window", keep=lambda rows, cols: _window(rows, cols, WINDOW)),
            flex_mask_mod=lambda extras: (lambda b, h, m, n: (n <= m) & (m - n < WINDOW)),
            visible_fraction=lambda shape: _window_fraction(shape, WINDOW),
        ),
        _variant(
            Family("forms_prefix_lm", keep=lambda rows, cols: (cols <= rows) | (cols < PREFIX)),
            flex_mask_mod=lambda extras: (lambda b, h, m, n: (n <= m) | (n < PREFIX)),
            visible_fraction=_prefix_fraction,
        ),
        _variant(
            Family(
                "forms_softcap_window", keep=lambda rows, cols: _window(rows, cols, GEMMA_WINDOW),
                transform=lambda scores: GEMMA_CAP * torch.tanh(scores / GEMMA_CAP),
            ),
            flex_score_mod=lambda extras: (lambda s, b, h, m, n: GEMMA_CAP * torch.tanh(s / GEMMA_CAP)),
            flex_mask_mod=lambda extras: (lambda b, h, m, n: (n <= m) & (m - n < GEMMA_WINDOW)),
            visible_fraction=lambda shape: _window_fraction(shape, GEMMA_WINDOW),
        ),
        _variant(
            Family(
                "forms_softcap_causal", keep=lambda rows, cols: cols <= rows,
                transform=lambda scores: GEMMA_CAP * torch.tanh(scores / GEMMA_CAP),
            ),
            flex_score_mod=lambda extras: (lambda s, b, h, m, n: GEMMA_CAP * torch.tanh(s / GEMMA_CAP)),
            flex_mask_mod=lambda extras: (lambda b, h, m, n: n <= m),
            visible_fraction=lambda shape: (shape.M + 1) / (2 * shape.M),
        ),
        _variant(
            Family("forms_alibi", alibi=True),
            flex_score_mod=lambda extras: (lambda s, b, h, m, n: s + extras["slopes"][h] * (n - m)),
        ),
        _data_variant(
            "forms_document", "document_id", _document_ids, document_mask,
            keep=lambda ids: ids[:, None, :, None] == ids[:, None, None, :],
            flex_mask_mod=lambda extras: (lambda b, h, m, n: extras["document_id"][b, m] == extras["document_id"][b, n]),
            drawn_visible_fraction=_document_pairs_fraction,
        ),
        _data_variant(
            "forms_key_padding", "attention_mask", _padding, key_padding_bool_masked_fill,
            keep=lambda mask: (mask != 0)[:, None, None, :],
            flex_mask_mod=lambda extras: (lambda b, h, m, n: extras["attention_mask"][b, n] > 0),
            drawn_visible_fraction=lambda extras: float(extras["attention_mask"].double().mean()),
        ),
    )
}


def form_variant(name: str) -> Variant:
    """``family:form``: the family's variant with that form as its only idiom (its ``reference``)."""
    family, form = name.split(":")
    return dataclasses.replace(FORMS[family], idioms={form: FORMS[family].idioms[form]})
