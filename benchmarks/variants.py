"""The attention variant library, shared by tests, the demo and the GPU benchmarks.

Each variant is plain PyTorch, written in the idioms people use (several per variant), plus its FlexAttention
equivalent (score_mod / mask_mod) and its SDPA equivalent where those exist. Extra tensors a variant needs
(slopes, masks, ids) come from ``make_inputs``, so every caller draws fresh random data the same way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Shape:
    B: int
    H: int
    M: int
    N: int
    D: int
    Dv: Optional[int] = None

    @property
    def value_dim(self) -> int:
        return self.Dv or self.D


@dataclasses.dataclass
class Variant:
    name: str
    idioms: dict[str, Callable[..., Tensor]]  # idiom name -> fn(q, k, v, **extras)
    extras: Callable[[Shape, torch.device, torch.dtype], dict[str, Any]] = lambda shape, device, dtype: {}
    flex_score_mod: Optional[Callable[[dict], Callable]] = None  # extras -> score_mod
    flex_mask_mod: Optional[Callable[[dict], Callable]] = None  # extras -> mask_mod
    sdpa: Optional[Callable[..., Tensor]] = None
    visible_fraction: Callable[[Shape], float] = lambda shape: 1.0  # share of (m, n) pairs not masked

    @property
    def reference(self) -> Callable[..., Tensor]:
        return next(iter(self.idioms.values()))


def make_inputs(variant: Variant, shape: Shape, device="cpu", dtype=torch.float32, seed=None) -> tuple:
    """Fresh random q, k, v in [B, H, S, D] layout plus the variant's extra tensors."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else torch.seed() % (2**31))

    def rand(*size):
        return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

    q = rand(shape.B, shape.H, shape.M, shape.D)
    k = rand(shape.B, shape.H, shape.N, shape.D)
    v = rand(shape.B, shape.H, shape.N, shape.value_dim)
    return q, k, v, variant.extras(shape, torch.device(device), dtype)


def _scale(q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


# ---------------------------------------------------------------- vanilla
def vanilla_matmul(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * _scale(q), dim=-1) @ v


def vanilla_einsum(q, k, v):
    scores = torch.einsum("bhmd,bhnd->bhmn", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhmn,bhnd->bhmd", scores.softmax(-1), v)


def vanilla_scaled_q_fp32_softmax(q, k, v):
    scores = (q * _scale(q)) @ k.transpose(-2, -1)
    return F.softmax(scores.float(), dim=-1).to(q.dtype) @ v


VANILLA = Variant(
    name="vanilla",
    idioms={"matmul": vanilla_matmul, "einsum": vanilla_einsum, "scaled_q_fp32_softmax": vanilla_scaled_q_fp32_softmax},
    flex_score_mod=lambda extras: None,
    sdpa=lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
)


# ---------------------------------------------------------------- causal
def causal_masked_fill(q, k, v):
    scores = q @ k.transpose(-2, -1) * _scale(q)
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def causal_arange_where(q, k, v):
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    cols = torch.arange(k.shape[-2], device=q.device)[None, :]
    scores = torch.matmul(q, k.transpose(-1, -2)) * _scale(q)
    scores = torch.where(cols <= rows, scores, torch.finfo(scores.dtype).min)
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


CAUSAL = Variant(
    name="causal",
    idioms={"masked_fill": causal_masked_fill, "arange_where": causal_arange_where},
    flex_mask_mod=lambda extras: (lambda b, h, m, n: m >= n),
    sdpa=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    visible_fraction=lambda shape: (shape.M + 1) / (2 * shape.M),
)


# ---------------------------------------------------------------- ALiBi
def _alibi_slopes(shape: Shape, device, dtype):
    exponents = torch.arange(1, shape.H + 1, device=device, dtype=torch.float32)
    return {"slopes": torch.pow(2.0, -8.0 * exponents / shape.H)}


def alibi_slopes_tensor(q, k, v, slopes):
    distance = torch.arange(k.shape[-2], device=q.device)[None, :] - torch.arange(q.shape[-2], device=q.device)[:, None]
    scores = q @ k.transpose(-2, -1) * _scale(q)
    bias = slopes[:, None, None] * distance
    return torch.softmax(scores + bias.to(scores.dtype), dim=-1) @ v


ALIBI = Variant(
    name="alibi",
    idioms={"slopes_tensor": alibi_slopes_tensor},
    extras=_alibi_slopes,
    flex_score_mod=lambda extras: (lambda s, b, h, m, n: s + extras["slopes"][h] * (n - m)),
)


# ---------------------------------------------------------------- soft-capping
SOFTCAP = 50.0


def softcap_tanh(q, k, v):
    scores = q @ k.transpose(-2, -1) * _scale(q)
    return torch.softmax(SOFTCAP * torch.tanh(scores / SOFTCAP), dim=-1) @ v


SOFTCAP_VARIANT = Variant(
    name="softcap",
    idioms={"tanh": softcap_tanh},
    flex_score_mod=lambda extras: (lambda s, b, h, m, n: SOFTCAP * torch.tanh(s / SOFTCAP)),
)


# ---------------------------------------------------------------- sliding window (causal)
WINDOW = 1024


def sliding_window_masked_fill(q, k, v):
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    cols = torch.arange(k.shape[-2], device=q.device)[None, :]
    visible = (cols <= rows) & (rows - cols < WINDOW)
    scores = q @ k.transpose(-2, -1) * _scale(q)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


SLIDING_WINDOW = Variant(
    name="sliding_window",
    idioms={"masked_fill": sliding_window_masked_fill},
    flex_mask_mod=lambda extras: (lambda b, h, m, n: (n <= m) & (m - n < WINDOW)),
    visible_fraction=lambda shape: min(1.0, (WINDOW * shape.M - WINDOW * (WINDOW - 1) / 2) / (shape.M * shape.N))
    if shape.M > WINDOW
    else (shape.M + 1) / (2 * shape.M),
)


VARIANTS: dict[str, Variant] = {v.name: v for v in (VANILLA, CAUSAL, ALIBI, SOFTCAP_VARIANT, SLIDING_WINDOW)}
