"""Attention programs in the input forms the fusion must accept, beyond the variant library's idioms."""

import torch

from benchmarks import variants


def causal_bshd(q, k, v):
    """[B, S, H, D] inputs, transposed to heads-first inside the graph and back."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = variants.causal_masked_fill(q, k, v)
    return out.transpose(1, 2)


def bmm_3d(q, k, v):
    return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.3, dim=-1), v)


def mm_2d(q, k, v):
    return torch.mm(torch.softmax(torch.mm(q, k.t()) * 0.3, dim=-1), v)


def scale_on_k(q, k, v):
    return torch.softmax(q @ (k * 0.25).transpose(-2, -1), dim=-1) @ v


def key_padding_bert(q, k, v, attention_mask):
    """BERT-style [B, 1, 1, N] padding mask turned additive with finfo.min."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    additive = (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
    return torch.softmax(scores + additive, dim=-1) @ v


def boolean_mask_tensor(q, k, v, keep):
    scores = q @ k.transpose(-1, -2)
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def returns_probabilities(q, k, v):
    probabilities = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return probabilities @ v, probabilities


def softmax_over_rows(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v
