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
    flex_scale: Optional[float] = None  # Flex's scale argument; None: its default 1/sqrt(D), as the programs scale
    # A mask passed in as a tensor: the formula it was built from, which the program does not carry. The
    # `flex_formula` implementation gives Flex that formula instead of the tensor: a stricter baseline.
    flex_formula_mask_mod: Optional[Callable[[dict], Callable]] = None
    sdpa: Optional[Callable[..., Tensor]] = None
    visible_fraction: Callable[[Shape], float] = lambda shape: 1.0  # share of (m, n) pairs not masked
    # For masks drawn at random (document ids, padding): the share of this draw's pairs not masked, from its extras.
    drawn_visible_fraction: Optional[Callable[[dict], float]] = None
    self_attention: bool = False  # queries and keys are the same sequence (M == N), e.g. one document_id per token
    kv_groups: int = 1  # query heads per key/value head (GQA): k and v get H // kv_groups heads; 0 means MQA (one)
    key_fraction: float = 1.0  # cross-attention: N = key_fraction * the shape's sequence length

    def adapt(self, shape: Shape) -> Shape:
        """The shape this variant really runs at (its own key length for cross-attention)."""
        return dataclasses.replace(shape, N=max(1, int(shape.N * self.key_fraction)))

    @property
    def reference(self) -> Callable[..., Tensor]:
        return next(iter(self.idioms.values()))


def make_inputs(variant: Variant, shape: Shape, device="cpu", dtype=torch.float32, seed=None) -> tuple:
    """Fresh random q, k, v in [B, H, S, D] layout plus the variant's extra tensors, at exactly ``shape``
    (callers that start from a square benchmark shape apply ``variant.adapt`` first)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else torch.seed() % (2**31))

    def rand(*size):
        return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

    kv_heads = max(1, shape.H // variant.kv_groups) if variant.kv_groups else 1
    q = rand(shape.B, shape.H, shape.M, shape.D)
    k = rand(shape.B, kv_heads, shape.N, shape.D)
    v = rand(shape.B, kv_heads, shape.N, shape.value_dim)
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


# ---------------------------------------------------------------- GPT-2's causal attention
def gpt2_causal_where(q, k, v):
    """GPT-2's eager attention as HF writes it: scores divided by a 0-d tensor √d, then ``where(causal, w,
    finfo(dtype).min)`` (a finite fill, not -inf), softmax cast to V's dtype."""
    w = torch.matmul(q, k.transpose(-1, -2))
    w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
    rows, columns = q.size(-2), k.size(-2)
    causal = torch.tril(torch.ones((rows, columns), dtype=torch.bool, device=q.device)).view(1, 1, rows, columns)
    w = torch.where(causal, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
    return torch.matmul(torch.nn.functional.softmax(w, dim=-1).type(v.dtype), v)


GPT2_CAUSAL = Variant(
    name="gpt2_causal",
    idioms={"where_finfo_min": gpt2_causal_where},
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


def sliding_window_one_arange(q, k, v):
    """One position vector for rows and columns (self-attention), as in code that builds a distance matrix."""
    position = torch.arange(q.shape[-2], device=q.device)
    distance = position[:, None] - position[None, :]
    scores = q @ k.transpose(-2, -1) * _scale(q)
    return torch.softmax(scores.masked_fill((distance < 0) | (distance >= WINDOW), float("-inf")), dim=-1) @ v


def _window_fraction(shape: Shape, window: int) -> float:
    """Share of (m, n) pairs with 0 <= m - n < window (square self-attention)."""
    visible = sum(min(row + 1, window) for row in range(shape.M))
    return visible / (shape.M * shape.N)


SLIDING_WINDOW = Variant(
    name="sliding_window",
    idioms={"masked_fill": sliding_window_masked_fill, "one_arange": sliding_window_one_arange},
    flex_mask_mod=lambda extras: (lambda b, h, m, n: (n <= m) & (m - n < WINDOW)),
    visible_fraction=lambda shape: _window_fraction(shape, WINDOW),
    self_attention=True,  # the one-arange idiom reads one position vector for queries and keys
)


# ---------------------------------------------------------------- causal, more idioms
def causal_triu_additive(q, k, v):
    """An additive -inf mask tensor built with triu."""
    bias = torch.full((q.shape[-2], k.shape[-2]), float("-inf"), device=q.device).triu(1)
    return torch.softmax(q @ k.transpose(-2, -1) * _scale(q) + bias.to(q.dtype), dim=-1) @ v


def _causal_mask_tensors(shape: Shape, device, dtype):
    keep = torch.ones(shape.M, shape.N, dtype=torch.bool, device=device).tril()
    additive = torch.zeros(shape.M, shape.N, device=device, dtype=dtype).masked_fill(~keep, float("-inf"))
    return {"keep": keep, "additive": additive}


def causal_boolean_mask_passed_in(q, k, v, keep, additive):
    scores = q @ k.transpose(-2, -1) * _scale(q)
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def causal_additive_mask_passed_in(q, k, v, keep, additive):
    return torch.softmax(q @ k.transpose(-2, -1) * _scale(q) + additive, dim=-1) @ v


CAUSAL.idioms["triu_additive"] = causal_triu_additive

CAUSAL_MASK_TENSOR = Variant(
    name="causal_mask_tensor",
    idioms={"boolean_passed_in": causal_boolean_mask_passed_in, "additive_passed_in": causal_additive_mask_passed_in},
    extras=_causal_mask_tensors,
    flex_mask_mod=lambda extras: (lambda b, h, m, n: extras["keep"][m, n]),
    flex_formula_mask_mod=lambda extras: (lambda b, h, m, n: m >= n),
    visible_fraction=CAUSAL.visible_fraction,
)


# ---------------------------------------------------------------- prefix-LM
PREFIX = 256


def prefix_lm_where(q, k, v):
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    cols = torch.arange(k.shape[-2], device=q.device)[None, :]
    scores = q @ k.transpose(-2, -1) * _scale(q)
    return torch.softmax(torch.where((cols <= rows) | (cols < PREFIX), scores, float("-inf")), dim=-1) @ v


def _prefix_fraction(shape: Shape) -> float:
    rows = torch.arange(shape.M)[:, None]
    cols = torch.arange(shape.N)[None, :]
    return float(((cols <= rows) | (cols < PREFIX)).double().mean())


PREFIX_LM = Variant(
    name="prefix_lm",
    idioms={"where": prefix_lm_where},
    flex_mask_mod=lambda extras: (lambda b, h, m, n: (n <= m) | (n < PREFIX)),
    visible_fraction=_prefix_fraction,
)


# ---------------------------------------------------------------- document masking (data-dependent)
def _document_ids(shape: Shape, device, dtype):
    boundaries = torch.sort(torch.randint(1, shape.N, (shape.B, 3))).values
    ids = (torch.arange(shape.N)[None, :, None] >= boundaries[:, None, :]).sum(-1)
    return {"document_id": ids.to(device)}


def _document_pairs_fraction(extras: dict) -> float:
    """Mean over the batch of Σ_documents length² / N²."""
    ids = extras["document_id"]
    lengths = torch.stack([torch.bincount(row, minlength=int(ids.max()) + 1) for row in ids]).double()
    return float((lengths**2).sum(-1).mean() / ids.shape[-1] ** 2)


def document_mask(q, k, v, document_id):
    same = document_id[:, None, :, None] == document_id[:, None, None, :]
    scores = q @ k.transpose(-2, -1) * _scale(q)
    return torch.softmax(scores.masked_fill(~same, float("-inf")), dim=-1) @ v


DOCUMENT = Variant(
    name="document",
    idioms={"ids_equal": document_mask},
    extras=_document_ids,
    flex_mask_mod=lambda extras: (lambda b, h, m, n: extras["document_id"][b, m] == extras["document_id"][b, n]),
    self_attention=True,
    drawn_visible_fraction=_document_pairs_fraction,
)


# ---------------------------------------------------------------- key padding (BERT)
def _padding(shape: Shape, device, dtype):
    lengths = torch.randint(shape.N // 2, shape.N + 1, (shape.B,))
    return {"attention_mask": (torch.arange(shape.N)[None, :] < lengths[:, None]).long().to(device)}


def key_padding_finfo_min(q, k, v, attention_mask):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    additive = (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
    return torch.softmax(scores + additive, dim=-1) @ v


def key_padding_bool_masked_fill(q, k, v, attention_mask):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf")), dim=-1) @ v


KEY_PADDING = Variant(
    name="key_padding",
    idioms={"finfo_min": key_padding_finfo_min, "bool_masked_fill": key_padding_bool_masked_fill},
    extras=_padding,
    flex_mask_mod=lambda extras: (lambda b, h, m, n: extras["attention_mask"][b, n] > 0),
    drawn_visible_fraction=lambda extras: float(extras["attention_mask"].double().mean()),
)


# ---------------------------------------------------------------- ALiBi from arange, per-head bias
def alibi_from_arange(q, k, v):
    heads = q.shape[1]
    slopes = torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, device=q.device) / heads)
    distance = torch.arange(k.shape[-2], device=q.device)[None, :] - torch.arange(q.shape[-2], device=q.device)[:, None]
    scores = (q @ k.transpose(-2, -1)).float() * _scale(q)
    return torch.softmax(scores + slopes[:, None, None] * distance, dim=-1).to(q.dtype) @ v


ALIBI_ARANGE = Variant(
    name="alibi_arange",
    idioms={"slopes_from_arange_fp32": alibi_from_arange},
    # FlexAttention's version is the slopes-tensor one: the `alibi` variant.
)


def _head_bias(shape: Shape, device, dtype):
    return {"bias": torch.randn(shape.H, shape.M, shape.N, device=device, dtype=dtype)}


def per_head_bias(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-2, -1) * _scale(q) + bias, dim=-1) @ v


HEAD_BIAS = Variant(
    name="head_bias",
    idioms={"broadcast_add": per_head_bias},
    extras=_head_bias,
    flex_score_mod=lambda extras: (lambda s, b, h, m, n: s + extras["bias"][h, m, n]),
)


# ---------------------------------------------------------------- T5 relative position bias
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128


def _t5_table(shape: Shape, device, dtype):
    return {"table": torch.randn(T5_BUCKETS, shape.H, device=device, dtype=dtype)}


def _t5_bucket(relative: torch.Tensor) -> torch.Tensor:
    """Bidirectional T5 bucketing of key-minus-query distances (exact for small, logarithmic for large)."""
    half = T5_BUCKETS // 2
    bucket = (relative > 0).long() * half
    distance = relative.abs()
    exact = half // 2
    large = exact + (
        torch.log(distance.float().clamp(min=1) / exact) / math.log(T5_MAX_DISTANCE / exact) * (half - exact)
    ).long()
    return bucket + torch.where(distance < exact, distance, large.clamp(max=half - 1))


def t5_relative_bias(q, k, v, table):
    relative = torch.arange(k.shape[-2], device=q.device)[None, :] - torch.arange(q.shape[-2], device=q.device)[:, None]
    bias = table[_t5_bucket(relative)].permute(2, 0, 1)  # [H, M, N] gathered from the learned table
    return torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v


def _t5_score_mod(extras: dict) -> Callable:
    table = extras["table"]
    return lambda s, b, h, m, n: s + table[_t5_bucket(n - m), h]


T5_BIAS = Variant(
    name="t5_bias",
    idioms={"bucket_gather": t5_relative_bias},
    extras=_t5_table,
    flex_score_mod=_t5_score_mod,
    flex_scale=1.0,  # T5 does not scale its scores
)


def hf_t5_bucket(relative: torch.Tensor, bidirectional: bool = True) -> torch.Tensor:
    """T5's bucketing written as Hugging Face's T5 code writes it (``full_like``, ``torch.min``)."""
    buckets, max_distance = T5_BUCKETS, T5_MAX_DISTANCE
    relative_buckets = 0
    if bidirectional:
        buckets //= 2
        relative_buckets += (relative > 0).to(torch.long) * buckets
        relative = torch.abs(relative)
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    max_exact = buckets // 2
    is_small = relative < max_exact
    if_large = max_exact + (
        torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact) * (buckets - max_exact)
    ).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, buckets - 1))
    return relative_buckets + torch.where(is_small, relative, if_large)


def hf_t5_attention(q, k, v, table, bidirectional=True):
    """T5's attention as Hugging Face writes it (the encoder's bidirectional buckets by default): the bias from an
    ``nn.Embedding`` of buckets, no scale, the softmax in float32."""
    context = torch.arange(q.shape[-2], device=q.device)[:, None]
    memory = torch.arange(k.shape[-2], device=q.device)[None, :]
    bias = F.embedding(hf_t5_bucket(memory - context, bidirectional), table).permute([2, 0, 1]).unsqueeze(0)
    scores = q @ k.transpose(-2, -1) + bias
    return torch.softmax(scores.float(), dim=-1).type_as(scores) @ v


# The same attention, table and Flex form as T5_BIAS; only the program differs.
T5_HF = dataclasses.replace(T5_BIAS, name="t5_hf", idioms={"embedding_fp32_softmax": hf_t5_attention})


# ---------------------------------------------------------------- Gemma-2: causal + sliding window + soft-cap
GEMMA_WINDOW, GEMMA_CAP = 512, 50.0


def gemma2_local(q, k, v):
    scores = (q @ k.transpose(-2, -1)).float() * _scale(q)
    scores = GEMMA_CAP * torch.tanh(scores / GEMMA_CAP)
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    cols = torch.arange(k.shape[-2], device=q.device)[None, :]
    visible = (cols <= rows) & (rows - cols < GEMMA_WINDOW)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(q.dtype) @ v


GEMMA2 = Variant(
    name="gemma2",
    idioms={"softcap_window_fp32": gemma2_local},
    flex_score_mod=lambda extras: (lambda s, b, h, m, n: GEMMA_CAP * torch.tanh(s / GEMMA_CAP)),
    flex_mask_mod=lambda extras: (lambda b, h, m, n: (n <= m) & (m - n < GEMMA_WINDOW)),
    visible_fraction=lambda shape: _window_fraction(shape, GEMMA_WINDOW),
)


# ---------------------------------------------------------------- GQA / MQA
def gqa_expand(q, k, v):
    batch, kv_heads, length, dim = k.shape
    groups = q.shape[1] // kv_heads
    k = k[:, :, None].expand(batch, kv_heads, groups, length, dim).reshape(batch, q.shape[1], length, dim)
    v = v[:, :, None].expand(batch, kv_heads, groups, length, v.shape[-1]).reshape(batch, q.shape[1], length, -1)
    return torch.softmax(q @ k.transpose(-2, -1) * _scale(q), dim=-1) @ v


def gqa_repeat_interleave(q, k, v):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) * _scale(q)
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


GQA = Variant(
    name="gqa",
    idioms={"expand": gqa_expand},
    kv_groups=4,
    flex_score_mod=lambda extras: None,
    sdpa=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
)
GQA_CAUSAL = Variant(
    name="gqa_causal",
    idioms={"repeat_interleave": gqa_repeat_interleave},
    kv_groups=4,
    flex_mask_mod=CAUSAL.flex_mask_mod,
    visible_fraction=CAUSAL.visible_fraction,
    sdpa=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
)
# ---------------------------------------------------------------- cross-attention (M != N) to a padded memory
def _memory_padding(shape: Shape, device, dtype):
    lengths = torch.randint(shape.N // 2, shape.N + 1, (shape.B,))
    return {"memory_mask": (torch.arange(shape.N)[None, :] < lengths[:, None]).to(device)}


def cross_attention_padded(q, k, v, memory_mask):
    scores = q @ k.transpose(-2, -1) * _scale(q)
    scores = scores.masked_fill(~memory_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


MQA = Variant(
    name="mqa",
    idioms={"expand": gqa_expand},
    kv_groups=0,
    flex_score_mod=lambda extras: None,
    sdpa=GQA.sdpa,
)

CROSS = Variant(
    name="cross_attention",
    idioms={"padded_memory": cross_attention_padded},
    extras=_memory_padding,
    flex_mask_mod=lambda extras: (lambda b, h, m, n: extras["memory_mask"][b, n]),
    key_fraction=0.25,
    drawn_visible_fraction=lambda extras: float(extras["memory_mask"].double().mean()),
)


# ---------------------------------------------------------------- HF decoder: causal and padding in one additive mask
def hf_causal_padding_4d(q, k, v, attention_mask):
    """Hugging Face's eager decoder attention: a ``[B, 1, M, N]`` float mask, finfo.min above the diagonal and at
    padded keys, added to the scores; softmax in float32."""
    lowest = torch.finfo(q.dtype).min
    causal = torch.full((q.shape[-2], k.shape[-2]), lowest, device=q.device, dtype=q.dtype).triu(1)
    mask = causal[None, None].masked_fill(attention_mask[:, None, None, :] == 0, lowest)
    scores = q @ k.transpose(-1, -2) * _scale(q) + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _causal_padding_fraction(extras: dict) -> float:
    kept = extras["attention_mask"].double()
    n = kept.shape[-1]
    return float((kept * (n - torch.arange(n, device=kept.device))).sum() / (kept.shape[0] * n * n))


HF_DECODER_MASK = Variant(
    name="hf_decoder_mask",
    idioms={"additive_4d": hf_causal_padding_4d},
    extras=_padding,
    flex_mask_mod=lambda extras: (lambda b, h, m, n: (m >= n) & (extras["attention_mask"][b, n] > 0)),
    drawn_visible_fraction=_causal_padding_fraction,
    self_attention=True,
)

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        VANILLA, CAUSAL, GPT2_CAUSAL, CAUSAL_MASK_TENSOR, ALIBI, ALIBI_ARANGE, SOFTCAP_VARIANT, SLIDING_WINDOW, PREFIX_LM, DOCUMENT,
        KEY_PADDING, HF_DECODER_MASK, HEAD_BIAS, T5_BIAS, T5_HF, GEMMA2, GQA, GQA_CAUSAL, MQA, CROSS,
    )
}
