"""Programs FlexAttention cannot express, written the way their authors write them in plain PyTorch.

Each program has a function, an input maker (fresh random tensors at a named size), a FLOP count of the work it
must do, and the structure we expect it to fuse into (number of kernels and of dots per kernel). The tests, the demo
and ``benchmarks/bench_programs.py`` all draw from here, so they exercise the same code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

Tensor = torch.Tensor


def _causal(m: int, n: int, device) -> Tensor:
    return torch.ones(m, n, dtype=torch.bool, device=device).triu(1)


# ---------------------------------------------------------------- differential attention (DIFF Transformer)
def diff_attention(q, k, v, lam):
    """q, k: [B, 2h, S, d]; v: [B, h, S, 2d]; lam: a 0-d tensor (λ, computed from parameters in the model).
    Two softmaxes per head, over the two halves of the query/key heads, subtracted before meeting V."""
    b, two_h, m, d = q.shape
    weights = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5, dim=-1)
    weights = weights.view(b, two_h // 2, 2, m, k.shape[-2])
    return (weights[:, :, 0] - lam * weights[:, :, 1]) @ v


def diff_attention_two_matmuls(q, k, v, lam):
    """The same, written as the issue states it: ``A0·V − λ·A1·V``, two output matmuls sharing V."""
    b, two_h, m, d = q.shape
    weights = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5, dim=-1)
    weights = weights.view(b, two_h // 2, 2, m, k.shape[-2])
    return weights[:, :, 0] @ v - lam * (weights[:, :, 1] @ v)


def diff_transformer_causal(q, k, v, lam):
    """The DIFF Transformer reference code's form (causal LM): queries scaled before the matmul, ``nan_to_num`` on
    the scores, a ``triu`` mask of -inf built in the forward and added, a float32 softmax cast back."""
    b, two_h, m, d = q.shape
    n = k.shape[-2]
    scores = torch.nan_to_num(torch.matmul(q * d**-0.5, k.transpose(-1, -2)))
    future = torch.triu(torch.zeros([m, n], device=q.device).float().fill_(float("-inf")).type_as(scores), 1)
    weights = torch.softmax(scores + future, dim=-1, dtype=torch.float32).type_as(scores)
    weights = weights.view(b, two_h // 2, 2, m, n)
    return torch.matmul(weights[:, :, 0] - lam * weights[:, :, 1], v)


def diff_inputs(B=2, H=4, S=40, D=16, device="cpu", dtype=torch.float32, generator=None):
    """H counts query/key heads (2h); V has h = H/2 heads of width 2D."""
    rand = _rand(generator, device, dtype)
    return dict(q=rand(B, H, S, D), k=rand(B, H, S, D), v=rand(B, H // 2, S, 2 * D),
                lam=torch.tensor(0.8, device=device, dtype=dtype))


def diff_flops(B, H, S, D, **_):
    # Both softmaxes: QKᵀ over H heads of width D, then each of the two P·V products over h = H/2 heads of width 2D.
    return 2.0 * B * H * S * S * D + 2 * 2.0 * B * (H // 2) * S * S * (2 * D)


def diff_causal_flops(B, H, S, D, **_):
    return diff_flops(B, H, S, D) / 2


# ---------------------------------------------------------------- Evoformer row-wise gated self-attention
def evoformer_row_attention(q, k, v, mask_bias, pair_bias, gate):
    """AlphaFold2's MSA row attention with pair bias. q, k, v, gate: [B, N_seq, S, H, D] (as projected);
    mask_bias: [B, N_seq, 1, 1, S]; pair_bias: [B, 1, H, S, S]."""
    q = q.transpose(-2, -3) * q.shape[-1] ** -0.5
    k, v = k.transpose(-2, -3), v.transpose(-2, -3)
    weights = torch.softmax(q @ k.transpose(-1, -2) + mask_bias + pair_bias, dim=-1)
    out = (weights @ v).transpose(-2, -3)
    return out * torch.sigmoid(gate)


def evoformer_inputs(B=1, N_seq=3, S=24, H=2, D=16, device="cpu", dtype=torch.float32, generator=None):
    rand = _rand(generator, device, dtype)
    msa_mask = (torch.rand(B, N_seq, 1, 1, S, generator=generator) > 0.1).to(device=device, dtype=dtype)
    return dict(
        q=rand(B, N_seq, S, H, D), k=rand(B, N_seq, S, H, D), v=rand(B, N_seq, S, H, D),
        mask_bias=1e9 * (msa_mask - 1), pair_bias=rand(B, 1, H, S, S), gate=rand(B, N_seq, S, H, D),
    )


def evoformer_flops(B, N_seq, S, H, D, **_):
    return 4.0 * B * N_seq * H * S * S * D


# ---------------------------------------------------------------- invariant point attention (AlphaFold2), its attention core
def _ipa_weights(q, k, q_pts, k_pts, pair_bias, head_weights):
    c, points = q.shape[-1], q_pts.shape[-2]
    distance = ((q_pts.unsqueeze(-3) - k_pts.unsqueeze(-4)) ** 2).sum(dim=(-1, -2))
    point_weight = head_weights.view(1, -1, 1, 1) * (2.0 / (9 * points)) ** 0.5 / 2
    logits = (q @ k.transpose(-1, -2) * c**-0.5 + pair_bias - point_weight * distance) * 3**-0.5
    return torch.softmax(logits, dim=-1)


def ipa_attention(q, k, v, q_pts, k_pts, pair_bias, head_weights, z):
    """IPA-style logits and outputs. q, k, v: [B, H, S, C]; q_pts, k_pts: [B, H, S, P, 3], points in the global
    frame; pair_bias: [B, H, S, S] (projected from z); head_weights: [H] (softplus(γ)); z: [B, S, S, Cz].
    Returns A·V and Σ_j a_ij z_ij ([B, H, S, Cz])."""
    weights = _ipa_weights(q, k, q_pts, k_pts, pair_bias, head_weights)
    return weights @ v, (weights.unsqueeze(-1) * z.unsqueeze(1)).sum(-2)


def ipa_attention_openfold(q, k, v, q_pts, k_pts, pair_bias, head_weights, z):
    """The same, with the pair output written as OpenFold does: a matmul of the transposed probabilities,
    ``[B, S, H, Cz]``."""
    weights = _ipa_weights(q, k, q_pts, k_pts, pair_bias, head_weights)
    return weights @ v, torch.matmul(weights.transpose(-2, -3), z.to(dtype=weights.dtype))


def ipa_inputs(B=1, H=4, S=24, C=16, P=4, Cz=16, device="cpu", dtype=torch.float32, generator=None):
    rand = _rand(generator, device, dtype)
    return dict(
        q=rand(B, H, S, C), k=rand(B, H, S, C), v=rand(B, H, S, C),
        q_pts=rand(B, H, S, P, 3), k_pts=rand(B, H, S, P, 3), pair_bias=rand(B, H, S, S),
        head_weights=torch.nn.functional.softplus(rand(H)), z=rand(B, S, S, Cz),
    )


def ipa_flops(B, H, S, C, P, Cz, **_):
    # QKᵀ and A·V, the squared distance (3 flops per coordinate), and the pair reduction.
    return 2.0 * B * H * S * S * 2 * C + 3.0 * B * H * S * S * P * 3 + 2.0 * B * H * S * S * Cz


# ---------------------------------------------------------------- attention sinks (gpt-oss)
def attention_sinks(q, k, v, sinks):
    """gpt-oss: a learned per-head logit joins each row's softmax as an extra column, which is then dropped."""
    b, h, m, d = q.shape
    scores = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(_causal(m, k.shape[-2], q.device), float("-inf"))
    sink = sinks.reshape(1, h, 1, 1).expand(b, h, m, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
    return weights[..., :-1] @ v


def attention_sinks_max_subtracted(q, k, v, sinks):
    """The Hugging Face form: the concatenated logits are shifted by their row max before the softmax."""
    b, h, m, d = q.shape
    scores = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(_causal(m, k.shape[-2], q.device), float("-inf"))
    combined = torch.cat([scores, sinks.reshape(1, h, 1, 1).expand(b, h, m, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


def sinks_inputs(B=2, H=4, S=40, D=16, device="cpu", dtype=torch.float32, generator=None):
    rand = _rand(generator, device, dtype)
    return dict(q=rand(B, H, S, D), k=rand(B, H, S, D), v=rand(B, H, S, D), sinks=rand(H))


def causal_flops(B, H, S, D, Dv=None, **_):
    return 2.0 * B * H * S * S * (D + (Dv or D)) * 0.5


# ---------------------------------------------------------------- sigmoid attention
def sigmoid_attention(q, k, v):
    """Sigmoid attention (Ramapuram et al. 2024): sigmoid(q·kᵀ/√d − log n) replaces the softmax; no reduction
    over N but the product with V."""
    n, d = k.shape[-2], q.shape[-1]
    return torch.sigmoid(q @ k.transpose(-1, -2) * d**-0.5 - math.log(n)) @ v


def qkv_inputs(B=2, H=4, S=40, D=16, Dv=None, device="cpu", dtype=torch.float32, generator=None):
    rand = _rand(generator, device, dtype)
    return dict(q=rand(B, H, S, D), k=rand(B, H, S, D), v=rand(B, H, S, Dv or D))


def full_flops(B, H, S, D, Dv=None, **_):
    return 2.0 * B * H * S * S * (D + (Dv or D))


# ---------------------------------------------------------------- MLA-shaped attention (QK dim 192, V dim 128)
def mla_causal(q, k, v):
    """DeepSeek MLA after decompression: queries/keys carry 128 + 64 (rotary) dims, values 128."""
    m, n = q.shape[-2], k.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(_causal(m, n, q.device), float("-inf")), dim=-1) @ v


# ---------------------------------------------------------------- chained matmuls, not attention-shaped
def chained_matmul(a, b, c):
    """(A·B)·C: the M×N product never needs to exist."""
    return (a @ b) @ c


def softmax_chained_matmul(a, b, c):
    return torch.softmax(a @ b, dim=-1) @ c


def chain_inputs(M=48, K=24, N=72, P=40, device="cpu", dtype=torch.float32, generator=None):
    rand = _rand(generator, device, dtype)
    return dict(a=rand(M, K) * K**-0.5, b=rand(K, N), c=rand(N, P))


def chain_flops(M, K, N, P, **_):
    return 2.0 * M * N * (K + P)


def _rand(generator, device, dtype) -> Callable[..., Tensor]:
    def rand(*size):
        return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

    return rand


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: Callable[..., Tensor]
    inputs: Callable[..., dict[str, Any]]  # (**size, device, dtype, generator) -> named inputs
    flops: Callable[..., float]  # (**size) -> floating-point operations of the work
    kernels: int  # Triton kernels we expect the program to compile into
    dots: int  # tl.dot calls in the fused kernel
    cpu_size: dict  # a small size for the CPU harness (ragged where it can be)
    gpu_sizes: tuple = ()  # sizes the GPU benchmark runs


# The DiffAttn grid: H32 D64 and H16 D128, sequences 512 to 16k, B·S = 16k.
_DIFF_SIZES = tuple(dict(B=max(1, 16384 // s), H=h, S=s, D=d)
                    for h, d in ((32, 64), (16, 128)) for s in (512, 1024, 2048, 4096, 8192, 16384))

PROGRAMS = {
    p.name: p
    for p in [
        # One program runs both heads of a pair in one loop over the column tiles (two QKᵀ dots, one V tile for two
        # P·V dots) and subtracts the two halves; the second kernel is one small pointwise kernel building the
        # coefficients (1, -λ). With config.combine_head_groups_in_kernel off, a pointwise kernel over the per-head
        # outputs subtracts instead. The causal form shares its loops the same way.
        Program("diff_attention", diff_attention, diff_inputs, diff_flops, kernels=2, dots=4,
                cpu_size=dict(B=2, H=4, S=37, D=16), gpu_sizes=_DIFF_SIZES),
        Program("diff_attention_two_matmuls", diff_attention_two_matmuls, diff_inputs, diff_flops, kernels=2, dots=4,
                cpu_size=dict(B=2, H=4, S=37, D=16), gpu_sizes=_DIFF_SIZES),
        Program("diff_transformer_causal", diff_transformer_causal, diff_inputs, diff_causal_flops, kernels=2, dots=4,
                cpu_size=dict(B=2, H=4, S=37, D=16), gpu_sizes=_DIFF_SIZES),
        Program("evoformer_row_attention", evoformer_row_attention, evoformer_inputs, evoformer_flops, kernels=1,
                dots=2, cpu_size=dict(B=1, N_seq=3, S=21, H=2, D=16),
                gpu_sizes=(dict(B=1, N_seq=256, S=256, H=4, D=64), dict(B=1, N_seq=256, S=256, H=4, D=128))),
        # A·V and Σ_j a_ij z_ij accumulate in one loop; the squared point distance is computed per tile element.
        Program("ipa_attention", ipa_attention, ipa_inputs, ipa_flops, kernels=1, dots=2,
                cpu_size=dict(B=1, H=3, S=21, C=16, P=4, Cz=8),
                # The second has more pair channels than pair_reduction_max_channels: upstream's path.
                gpu_sizes=(dict(B=1, H=12, S=768, C=16, P=4, Cz=32), dict(B=1, H=12, S=256, C=16, P=4, Cz=128))),
        # As above; the pair matmul becomes that sum (fx_passes/pair_matmul.py), and a pointwise kernel writes it
        # in OpenFold's [B, S, H, Cz] order.
        Program("ipa_attention_openfold", ipa_attention_openfold, ipa_inputs, ipa_flops, kernels=2, dots=2,
                cpu_size=dict(B=1, H=3, S=21, C=16, P=4, Cz=8), gpu_sizes=(dict(B=1, H=12, S=768, C=16, P=4, Cz=32),)),
        Program("attention_sinks", attention_sinks, sinks_inputs, causal_flops, kernels=1, dots=2,
                cpu_size=dict(B=2, H=4, S=37, D=16),
                gpu_sizes=(dict(B=4, H=32, S=4096, D=64), dict(B=8, H=16, S=2048, D=128))),
        Program("attention_sinks_max_subtracted", attention_sinks_max_subtracted, sinks_inputs, causal_flops,
                kernels=1, dots=2, cpu_size=dict(B=2, H=4, S=37, D=16)),
        Program("sigmoid_attention", sigmoid_attention, qkv_inputs, full_flops, kernels=1, dots=2,
                cpu_size=dict(B=2, H=4, S=37, D=16),
                gpu_sizes=(dict(B=4, H=32, S=4096, D=64), dict(B=8, H=16, S=2048, D=128))),
        Program("mla_causal", mla_causal, qkv_inputs, causal_flops, kernels=1, dots=2,
                cpu_size=dict(B=2, H=2, S=37, D=48, Dv=32),
                gpu_sizes=(dict(B=4, H=16, S=4096, D=192, Dv=128),)),
        Program("chained_matmul", chained_matmul, chain_inputs, chain_flops, kernels=1, dots=2,
                cpu_size=dict(M=48, K=24, N=72, P=40),
                # The second has an inner dim above linear_fusion_max_inner_dim: it stays two GEMMs.
                gpu_sizes=(dict(M=16384, K=64, N=16384, P=96), dict(M=16384, K=512, N=16384, P=96))),
        Program("softmax_chained_matmul", softmax_chained_matmul, chain_inputs, chain_flops, kernels=1, dots=2,
                cpu_size=dict(M=48, K=24, N=72, P=40),
                gpu_sizes=(dict(M=16384, K=64, N=16384, P=96), dict(M=8192, K=32, N=65536, P=48))),
    ]
}
