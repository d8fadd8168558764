"""An Evoformer block (AlphaFold2, Jumper et al. 2021, Alg. 6) in plain PyTorch, for end-to-end timing.

MSA row-wise gated self-attention with pair bias, MSA column-wise gated self-attention, MSA transition, and pair
transition, with random weights. The outer product mean and the triangle updates are left out: they contain no
attention, so the overlay does not change them.
"""

from __future__ import annotations

import torch
from torch import nn


class GatedAttention(nn.Module):
    """Gated multi-head self-attention over the second-to-last axis of ``x`` [*, S, c]."""

    def __init__(self, c_in: int, heads: int, head_dim: int, c_pair: int = 0) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm = nn.LayerNorm(c_in)
        self.q, self.k, self.v = (nn.Linear(c_in, heads * head_dim, bias=False) for _ in range(3))
        self.gate = nn.Linear(c_in, heads * head_dim)
        self.out = nn.Linear(heads * head_dim, c_in)
        self.pair = nn.Sequential(nn.LayerNorm(c_pair), nn.Linear(c_pair, heads, bias=False)) if c_pair else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pair: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm(x)
        split = (*x.shape[:-1], self.heads, self.head_dim)
        q, k, v = (proj(x).view(split).transpose(-2, -3) for proj in (self.q, self.k, self.v))
        logits = q @ k.transpose(-1, -2) * self.head_dim**-0.5 + (1e9 * (mask - 1))[..., None, None, :]
        if self.pair is not None:
            logits = logits + self.pair(pair).permute(0, 3, 1, 2).unsqueeze(1)  # [B, 1, H, S, S]
        out = (torch.softmax(logits, dim=-1) @ v).transpose(-2, -3).reshape(*x.shape[:-1], -1)
        return self.out(out * torch.sigmoid(self.gate(x)))


class Transition(nn.Module):
    def __init__(self, c: int, factor: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, factor * c), nn.ReLU(), nn.Linear(factor * c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class EvoformerBlock(nn.Module):
    def __init__(self, c_m: int = 256, c_z: int = 128, heads: int = 8, head_dim: int = 32) -> None:
        super().__init__()
        self.row = GatedAttention(c_m, heads, head_dim, c_pair=c_z)
        self.column = GatedAttention(c_m, heads, head_dim)
        self.msa_transition = Transition(c_m)
        self.pair_transition = Transition(c_z)

    def forward(self, msa: torch.Tensor, pair: torch.Tensor, msa_mask: torch.Tensor):
        """msa [B, N_seq, S, c_m], pair [B, S, S, c_z], msa_mask [B, N_seq, S] (1 = residue present)."""
        msa = msa + self.row(msa, msa_mask, pair)
        msa = msa + self.column(msa.transpose(-2, -3), msa_mask.transpose(-1, -2)).transpose(-2, -3)
        msa = msa + self.msa_transition(msa)
        return msa, pair + self.pair_transition(pair)


def block_inputs(B=1, N_seq=128, S=256, c_m=256, c_z=128, device="cpu", dtype=torch.float32, generator=None):
    def rand(*size):
        return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

    mask = (torch.rand(B, N_seq, S, generator=generator) > 0.05).to(device=device, dtype=dtype)
    return dict(msa=rand(B, N_seq, S, c_m), pair=rand(B, S, S, c_z), msa_mask=mask)
