"""Random attention programs for differential testing: random compositions of score mods, masks, biases, GQA,
odd shapes, dtypes, layouts and strides, each compiled and compared with float64 eager.

    python -m benchmarks.random_programs --count 10000 --seed 0      # the documented long run (CPU harness)
    python -m benchmarks.random_programs --count 100 --device cuda   # the same programs compiled for the GPU

Every program is built from a seed, so a mismatch is reproduced by ``--count 1 --seed <seed>``; each mismatch
ever found becomes a regression test in test/test_random_programs.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from typing import Callable, Optional

import torch

SCORE_MODS = ["none", "scale_scores", "softcap", "alibi_arange", "bias_tensor", "relu_bias", "abs_distance"]
MASKS = ["none", "causal", "window", "prefix", "bool_tensor", "additive_tensor", "padding_finfo", "doc_ids", "causal_1e10"]
LAYOUTS = ["bhsd", "bshd", "3d", "noncontiguous_k"]
# How the row and column positions of position masks and distance terms are built: an arange each (indexed, viewed
# or expanded to the score grid), or, when M == N, one arange read as both (the idiom that once hid a window mask).
POSITIONS = ["separate", "viewed", "expanded", "one_arange", "one_arange_unsqueezed"]
# What turns logits into the weights of V: a softmax (most programs), a softmax with a sink column (gpt-oss, and the
# form that subtracts the row max first), a sigmoid, or nothing (a plain chained matmul; drawn without a mask).
NORMALISATIONS = ["softmax"] * 4 + ["sinks", "sinks_shifted", "sigmoid", "none"]
# Captured tensors that meet each other before they meet the scores (Swin's shifted windows): a per-head bias plus a
# per-batch mask of another broadcast shape, a table gathered at the relative position plus that mask, a table
# gathered through a captured index buffer plus a mask computed from positions (Swin's form), or the mask added on a
# view of the scores that splits the batch dim (windows), viewed back for the softmax.
COMBINED = ["none"] * 6 + ["bias_plus_mask", "gathered_plus_mask", "indexed_plus_region_mask", "window_view"]
# Positions read from tensors made outside the program (a captured ``arange``, a buffer) instead of built with
# ``arange`` inside it: consecutive from 0, consecutive from an offset, or increasing with gaps (not consecutive:
# the kernel must read them). One vector for rows and columns where M == N, as models share one.
READ_POSITIONS = ["none"] * 3 + ["consecutive", "offset", "gapped"]
# The rows of a boolean mask tensor passed in: random keys, or each row one interval of keys (a window, a prefix, a
# random interval, some rows none), or such intervals with one key kept outside one row's interval.
KEEP_ROWS = ["random"] * 2 + ["intervals", "intervals_stray"]
# In training, which of q, k, v are frozen (require no grad): none, or some (a frozen memory, q alone trained).
FROZEN = ["none"] * 4 + ["q", "k", "v", "kv", "qk"]


@dataclasses.dataclass
class Program:
    seed: int
    B: int
    H: int
    M: int
    N: int
    D: int
    Dv: int
    kv_groups: int
    dtype: torch.dtype
    score_mod: str
    mask: str
    layout: str
    upcast: bool
    scale_on: str  # "scores", "q", "k"
    normalisation: str = "softmax"
    diff_heads: bool = False  # DiffAttn: heads in pairs, weights w0 - λ·w1 meet every other V head
    points: int = 0  # IPA: minus a squared distance between P query and key points (3-d) joins the logits
    pair_channels: int = 0  # IPA: a second output, the probabilities reduced against a [B, M, N, C] pair tensor
    finite_fill: bool = False  # position masks fill with finfo.min (GPT-2's idiom) instead of -inf
    positions: str = "separate"  # one of POSITIONS
    combined: str = "none"  # one of COMBINED
    scale_v: bool = False  # V scaled by a constant before the output matmul
    read_positions: str = "none"  # one of READ_POSITIONS
    keep_rows: str = "random"  # one of KEEP_ROWS
    frozen: str = "none"  # one of FROZEN: the operands that require no grad in training
    baddbmm: bool = False  # 3-D scores scaled by baddbmm over a zero key bias (GPT-NeoX's and BLOOM's call)

    @property
    def kv_heads(self) -> int:
        return self.H // self.kv_groups if self.H % self.kv_groups == 0 else self.H

    def describe(self) -> str:
        return (f"seed={self.seed} {self.layout} B{self.B} H{self.H}/{self.kv_heads} M{self.M} N{self.N} "
                f"D{self.D} Dv{self.Dv} {str(self.dtype)[6:]} mod={self.score_mod} mask={self.mask} "
                f"upcast={self.upcast} scale_on={self.scale_on} norm={self.normalisation} diff={int(self.diff_heads)} "
                f"points={self.points} pair={self.pair_channels} finite_fill={int(self.finite_fill)} positions={self.positions}"
                f"{'' if self.combined == 'none' else ' combined=' + self.combined}{' scale_v=1' if self.scale_v else ''}"
                f"{'' if self.read_positions == 'none' else ' read_positions=' + self.read_positions}"
                f"{' keep_rows=' + self.keep_rows if self.mask == 'bool_tensor' and self.keep_rows != 'random' else ''}"
                f"{'' if self.frozen == 'none' else ' frozen=' + self.frozen}{' baddbmm=1' if self.baddbmm else ''}")


def draw(seed: int, positions: str | None = None, **fixed: object) -> Program:
    """The program of ``seed``. Fields added after a seed was recorded come from random streams of their own, so they
    leave its other fields as they were; ``positions`` and ``fixed`` (``combined="none"``, ``scale_v=False``) pin
    such fields, so that a regression seed keeps the program it failed with, and a recorded run can be replayed."""
    rng = random.Random(seed)
    self_attention_mask = ["causal", "window", "prefix", "doc_ids", "causal_1e10"]
    mask = rng.choice(MASKS)
    m = rng.choice([1, 3, 16, 17, 33, 40])
    n = m if mask in self_attention_mask or rng.random() < 0.5 else rng.choice([2, 5, 16, 31, 48])
    program = Program(
        seed=seed,
        B=rng.choice([1, 2]),
        H=rng.choice([1, 2, 4]),
        M=m,
        N=n,
        D=rng.choice([8, 16, 24, 32]),
        Dv=rng.choice([8, 16, 20]),
        kv_groups=rng.choice([1, 1, 2]),
        dtype=rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16]),
        score_mod=rng.choice(SCORE_MODS),
        mask=mask,
        layout=rng.choice(LAYOUTS),
        upcast=rng.random() < 0.5,
        scale_on=rng.choice(["scores", "q", "k"]),
    )
    # Drawn after the fields above so that older seeds keep their programs (regression seeds stay valid).
    program.normalisation = rng.choice(NORMALISATIONS)
    if program.normalisation == "none":
        program.mask = "none"
    program.diff_heads = program.H % 2 == 0 and program.layout != "3d" and rng.random() < 0.25
    program.points = rng.choice([0, 0, 0, 2, 5])
    if program.normalisation in ("softmax", "sinks", "sinks_shifted") and not program.diff_heads and program.layout != "3d":
        program.pair_channels = rng.choice([0, 0, 0, 4, 9])
    # (Drawn after the mask: a seed's earlier fields keep their values; only the fill of its position mask may differ.)
    program.finite_fill = program.mask in ("causal", "window", "prefix") and rng.random() < 0.4
    # A random stream of its own, so that this field leaves every other field of every seed as it is.
    program.positions = positions or random.Random(f"positions:{seed}").choice(POSITIONS)
    if program.positions.startswith("one_arange") and program.M != program.N:
        program.positions = "viewed"
    # A stream of its own too; drawn only where the scores reach a softmax over [B, H, M, N] with nothing after it.
    combined = random.Random(f"combined:{seed}").choice(COMBINED)
    if program.normalisation == "softmax" and not program.diff_heads and not program.pair_channels:
        program.combined = combined
    program.scale_v = random.Random(f"scale_v:{seed}").random() < 0.2
    program.read_positions = random.Random(f"read_positions:{seed}").choice(READ_POSITIONS)
    if program.combined == "gathered_plus_mask" and program.read_positions == "gapped":
        program.read_positions = "offset"  # it gathers a table at n - m, whose range gaps would leave
    program.keep_rows = random.Random(f"keep_rows:{seed}").choice(KEEP_ROWS)
    program.frozen = random.Random(f"frozen:{seed}").choice(FROZEN)
    baddbmm = random.Random(f"baddbmm:{seed}").random() < 0.5
    program.baddbmm = baddbmm and program.layout == "3d" and program.scale_on == "scores"
    for name, value in fixed.items():
        assert hasattr(program, name), name
        setattr(program, name, value)
    return program


def make_inputs(p: Program) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(p.seed)

    def rand(*size):
        return torch.randn(*size, generator=generator).to(p.dtype)

    kv_heads = p.kv_heads
    if p.layout == "bshd":
        q, k, v = rand(p.B, p.M, p.H, p.D), rand(p.B, p.N, kv_heads, p.D), rand(p.B, p.N, kv_heads, p.Dv)
    elif p.layout == "noncontiguous_k":
        q, v = rand(p.B, p.H, p.M, p.D), rand(p.B, kv_heads, p.N, p.Dv)
        k = rand(p.B, kv_heads, p.D, p.N).transpose(-1, -2)
    else:
        q, k, v = rand(p.B, p.H, p.M, p.D), rand(p.B, kv_heads, p.N, p.D), rand(p.B, kv_heads, p.N, p.Dv)
    extras = {
        "bias": torch.randn(p.H, 1, p.N, generator=generator).to(p.dtype),
        "keep": torch.rand(p.B, 1, p.M, p.N, generator=generator) > 0.3,
        "additive": torch.where(torch.rand(p.M, p.N, generator=generator) > 0.3, 0.0, float("-inf")).to(p.dtype),
        "lengths": torch.randint(1, p.N + 1, (p.B,), generator=generator),
        "doc": torch.sort(torch.randint(0, 3, (p.B, p.N), generator=generator)).values,
        "sinks": torch.randn(p.H, generator=generator).to(p.dtype),
        "lam": torch.rand((), generator=generator).to(p.dtype),
        "q_points": rand(p.B, p.H, p.M, max(p.points, 1), 3),
        "k_points": rand(p.B, p.H, p.N, max(p.points, 1), 3),
        "pair": rand(p.B, p.M, p.N, max(p.pair_channels, 1)),
    }
    # From a generator of their own, so that adding them left every other input of every seed as it was.
    combined = torch.Generator().manual_seed(p.seed + 1_000_003)
    extras["head_bias"] = torch.randn(p.H, p.M, p.N, generator=combined).to(p.dtype)
    extras["window_mask"] = torch.where(torch.rand(p.B, 1, p.M, p.N, generator=combined) > 0.25, 0.0, -100.0).to(p.dtype)
    extras["table"] = torch.randn(p.M + p.N - 1, p.H, generator=combined).to(p.dtype)
    extras["relative_index"] = torch.arange(p.N)[None, :] - torch.arange(p.M)[:, None] + p.M - 1  # a buffer, [M, N]
    extras["row_positions"], extras["col_positions"] = _read_positions(p)
    if p.mask == "bool_tensor" and p.keep_rows != "random":
        extras["keep"] = _interval_rows(p)
    if _causal_additive(p):
        fill = float("-inf") if _causal_additive(p) == "-inf" else torch.finfo(p.dtype).min
        extras["additive"] = torch.zeros(p.M, p.N).masked_fill(torch.ones(p.M, p.N).tril() == 0, fill).to(p.dtype)
    return [q, k, v], extras


def _causal_additive(p: Program) -> str:
    """For half the programs with an additive mask over square scores, drawn from a stream of their own: the causal
    mask, filled with "-inf" or "finfo.min" (as ``nn.Transformer``'s and Hugging Face's 4-D masks are), not learned
    in training, where the causal route takes it (but float16's ``finfo.min``, which does not absorb); else ""."""
    if p.mask != "additive_tensor" or p.M != p.N:
        return ""
    draw = float(torch.rand((), generator=torch.Generator().manual_seed(p.seed + 4_000_037)))
    return "" if draw < 0.5 else "-inf" if draw < 0.75 else "finfo.min"


def _interval_rows(p: Program) -> torch.Tensor:
    """``p.keep_rows``: a ``[B, 1, M, N]`` boolean mask each of whose rows keeps one interval of keys (a causal window
    of a random width, a prefix, a random interval, or none), with one key more outside one row's interval for
    ``intervals_stray``."""
    generator = torch.Generator().manual_seed(p.seed + 3_000_003)
    columns = torch.arange(p.N)
    keep = torch.zeros(p.B, 1, p.M, p.N, dtype=torch.bool)
    for b in range(p.B):
        form = int(torch.randint(0, 3, (), generator=generator))
        width = int(torch.randint(1, p.N + 1, (), generator=generator))
        last = (torch.arange(p.M) * p.N // p.M).clamp(max=p.N - 1)
        if form == 0:  # a causal window
            first = (last - width + 1).clamp(min=0)
        elif form == 1:  # a prefix
            first, last = torch.zeros(p.M, dtype=torch.long), torch.full((p.M,), width - 1)
        else:  # anywhere, or nowhere (drawn row by row)
            first, last = torch.empty(p.M, dtype=torch.long), torch.empty(p.M, dtype=torch.long)
            for m in range(p.M):
                first[m], last[m] = sorted(torch.randint(0, p.N, (2,), generator=generator).tolist())
                if torch.rand((), generator=generator) < 0.1:
                    first[m], last[m] = p.N, -1
        keep[b, 0] = (columns >= first[:, None]) & (columns <= last[:, None])
    if p.keep_rows == "intervals_stray":
        b, m = int(torch.randint(0, p.B, (), generator=generator)), int(torch.randint(0, p.M, (), generator=generator))
        outside = (~keep[b, 0, m]).nonzero().flatten()
        if len(outside) and keep[b, 0, m].any():
            keep[b, 0, m, outside[int(torch.randint(0, len(outside), (), generator=generator))]] = True
    return keep


def _read_positions(p: Program) -> tuple[torch.Tensor, torch.Tensor]:
    """``p.read_positions``: the row and column positions as int64 tensors made outside the program."""
    generator = torch.Generator().manual_seed(p.seed + 2_000_003)
    if p.read_positions == "gapped":
        rows = torch.cumsum(torch.randint(1, 3, (p.M,), generator=generator), 0)
        cols = rows if p.M == p.N else torch.cumsum(torch.randint(1, 3, (p.N,), generator=generator), 0)
        return rows, cols
    offset = 5 if p.read_positions == "offset" else 0
    return torch.arange(p.M) + offset, torch.arange(p.N) + offset


def _positions(p: Program, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row positions [M, 1] (or [M, N]) and column positions [1, N] (or [M, N]), built the way p.positions says."""
    if p.positions == "one_arange":
        position = torch.arange(p.N, device=device)
        return position[:, None], position[None, :]
    if p.positions == "one_arange_unsqueezed":
        position = torch.arange(p.N, device=device)
        return position.unsqueeze(-1), position.unsqueeze(0)
    if p.positions == "viewed":
        return torch.arange(p.M, device=device).view(p.M, 1), torch.arange(p.N, device=device).view(1, p.N)
    rows, cols = torch.arange(p.M, device=device)[:, None], torch.arange(p.N, device=device)[None, :]
    if p.positions == "expanded":
        return rows.expand(p.M, p.N), cols.expand(p.M, p.N)
    return rows, cols


def _combined_captured(p: Program, s, rows, cols, head_bias, window_mask, table, relative_index):
    """``p.combined``: captured tensors that meet before the scores."""
    if p.combined == "bias_plus_mask":
        return s + (head_bias + window_mask).to(s.dtype)  # [H, M, N] + [B, 1, M, N]
    if p.combined == "gathered_plus_mask":
        relative = table[(cols - rows + p.M - 1).expand(p.M, p.N)].permute(2, 0, 1)  # [H, M, N]
        return s + (relative + window_mask).to(s.dtype)
    if p.combined == "indexed_plus_region_mask":
        region_mask = torch.where(rows // 4 != cols // 4, -100.0, 0.0)  # [M, N], from positions in the graph
        return s + (table[relative_index].permute(2, 0, 1) + region_mask).to(s.dtype)
    if p.combined == "window_view":  # Swin's block: a gathered bias, then the window mask on a view of the scores
        s = s + table[relative_index].permute(2, 0, 1).to(s.dtype)
        windows = s.view(1, p.B, p.H, p.M, p.N) + window_mask.unsqueeze(0).to(s.dtype)  # [1, nW, 1, M, N]
        return windows.view(p.B, p.H, p.M, p.N)
    return s


def build(p: Program) -> Callable:
    """The program as plain PyTorch, the way a user would write it for this combination."""
    kv_heads = p.kv_heads

    def program(q, k, v, bias, keep, additive, lengths, doc, sinks, lam, q_points, k_points, pair, head_bias,
                window_mask, table, relative_index, row_positions, col_positions):
        if p.layout == "bshd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_heads != p.H:
            k, v = k.repeat_interleave(p.H // kv_heads, dim=1), v.repeat_interleave(p.H // kv_heads, dim=1)
        scale = 1.0 / math.sqrt(p.D)
        if p.scale_v:
            v = v * 0.5
        if p.scale_on == "q":
            q = q * scale
        elif p.scale_on == "k":
            k = k * scale
        if p.layout == "3d":
            q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        if p.baddbmm:  # the scale and a zero key bias in the matmul's call
            zero = torch.zeros(1, 1, k.shape[-2], dtype=q.dtype, device=q.device)
            s = torch.baddbmm(zero, q, k.transpose(-2, -1), beta=1.0, alpha=scale)
        else:
            s = q @ k.transpose(-2, -1)
        if p.layout == "3d":
            s = s.view(p.B, p.H, p.M, p.N)
        if p.scale_on == "scores" and not p.baddbmm:
            s = s * scale
        if p.upcast:
            s = s.float()
        rows, cols = _positions(p, q.device)
        if p.read_positions != "none":
            rows, cols = row_positions[:, None], (row_positions if p.M == p.N else col_positions)[None, :]
        if p.score_mod == "scale_scores":
            s = s * 1.7
        elif p.score_mod == "softcap":
            s = 5.0 * torch.tanh(s / 5.0)
        elif p.score_mod == "alibi_arange":
            slopes = torch.pow(2.0, -torch.arange(1, p.H + 1, dtype=torch.float32, device=q.device))
            s = s + (slopes[:, None, None] * (cols - rows)).to(s.dtype)
        elif p.score_mod == "bias_tensor":
            s = s + bias.to(s.dtype)
        elif p.score_mod == "relu_bias":
            s = s + torch.relu(bias).to(s.dtype) * 2
        elif p.score_mod == "abs_distance":
            s = s - (0.1 * (rows - cols).abs()).to(s.dtype)
        s = _combined_captured(p, s, rows, cols, head_bias, window_mask, table, relative_index)
        if p.points:
            distance = ((q_points.unsqueeze(-3) - k_points.unsqueeze(-4)) ** 2).sum(dim=(-1, -2))
            s = s - (0.05 * distance).to(s.dtype)
        position_fill = torch.finfo(s.dtype).min if p.finite_fill else float("-inf")
        if p.mask == "causal":
            s = s.masked_fill(cols > rows, position_fill)
        elif p.mask == "window":
            s = s.masked_fill((cols > rows) | (rows - cols >= 7), position_fill)
        elif p.mask == "prefix":
            s = torch.where((cols <= rows) | (cols < 5), s, position_fill)
        elif p.mask == "bool_tensor":
            s = s.masked_fill(~keep, float("-inf"))
        elif p.mask == "additive_tensor":
            s = s + additive.to(s.dtype)
        elif p.mask == "padding_finfo":
            padded = (torch.arange(p.N, device=q.device)[None, :] >= lengths[:, None])[:, None, None, :]
            s = s.masked_fill(padded, torch.finfo(s.dtype).min)
        elif p.mask == "doc_ids":
            s = s.masked_fill(doc[:, None, :, None] != doc[:, None, None, :], float("-inf"))
        elif p.mask == "causal_1e10":
            s = torch.where(cols <= rows, s, torch.full_like(s, -1e10) if s.dtype == torch.float32 else -1e4)
        if p.normalisation in ("sinks", "sinks_shifted"):
            s = torch.cat([s, sinks.reshape(1, p.H, 1, 1).expand(p.B, p.H, p.M, 1).to(s.dtype)], dim=-1)
            if p.normalisation == "sinks_shifted":
                s = s - s.max(dim=-1, keepdim=True).values
            probabilities = torch.softmax(s, dim=-1)[..., :-1]
        elif p.normalisation == "sigmoid":
            probabilities = torch.sigmoid(s - math.log(p.N))
        elif p.normalisation == "none":
            probabilities = s
        else:
            probabilities = torch.softmax(s, dim=-1)
        if p.upcast:
            probabilities = probabilities.to(v.dtype)
        if p.diff_heads:
            pairs = probabilities.view(p.B, p.H // 2, 2, p.M, p.N)
            out = (pairs[:, :, 0] - lam * pairs[:, :, 1]) @ v[:, ::2]
            return out.transpose(1, 2) if p.layout == "bshd" else out
        if p.layout == "3d":
            out = probabilities.reshape(-1, p.M, p.N) @ v
            return out.view(p.B, p.H, p.M, -1)
        out = probabilities @ v
        out = out.transpose(1, 2) if p.layout == "bshd" else out
        if p.pair_channels:
            return out, (probabilities.unsqueeze(-1) * pair.unsqueeze(1).to(probabilities.dtype)).sum(-2)
        return out

    return program


TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (3e-2, 3e-2), torch.bfloat16: (8e-2, 8e-2)}


# In training, the biases and masks a chain adds to its scores, the sink logits and DiffAttn's λ require grad too
# (their gradients come from the fused backward, λ's from the combination of the heads' outputs). Not the others: a
# table read through a gather (its gradient is a scatter-add, whose duplicates the Triton interpreter of the CPU
# harness loses on upstream's path too), nor the tensors of programs that train on upstream's path anyway (IPA's
# points and pair tensor; in float16 upstream's compiled gradient of the pair tensor can be NaN where eager's is
# not, with Flashlight off as well: seed 240051).
LEARNED = frozenset({"bias", "additive", "head_bias", "window_mask", "sinks", "lam"})


def _run(program: Callable, args: list, extras: dict, grad: Optional[torch.Tensor]) -> tuple:
    """The program's outputs, and with ``grad`` (training) the gradients of q, k and v and of the floating tensors
    the program reads (a bias, slopes: they require grad too) at that upstream gradient."""
    out = program(*args, **extras)
    outs = out if isinstance(out, tuple) else (out,)
    if grad is None:
        return outs
    learned = [t for _, t in sorted(extras.items()) if t.requires_grad]
    for tensor in (*args, *learned):
        tensor.grad = None  # (a program called again: this call's gradients alone)
    outs[0].backward(grad.to(outs[0].dtype))
    return (*(o.detach() for o in outs), *(_grad_or_zeros(a) for a in args), *(_grad_or_zeros(t) for t in learned))


def _grad_or_zeros(tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(tensor) if tensor.grad is None else tensor.grad


def check(p: Program, device: str = "cpu", training: bool = False, dynamic: bool = False) -> tuple[bool, bool, str]:
    """Compile for ``device`` (the CPU harness, or a GPU) and compare with float64 eager on the CPU: (matches,
    fused, detail). An overlay fault that fell back to upstream counts as a mismatch too: the program ran, but the
    overlay broke on it. In ``training`` q, k, v and the floating tensors the program reads require grad: the first
    output's backward runs at a fresh random upstream gradient, and every gradient is compared too (fused: forward
    and backward). ``dynamic``: compiled with every size symbolic (``torch.compile(dynamic=True)``)."""
    from flashlight import testing

    program = build(p)
    args, extras = make_inputs(p)
    grad = None
    if training:
        with torch.no_grad():
            first = program(*args, **extras)
        first = first[0] if isinstance(first, tuple) else first
        grad = torch.randn(first.shape, generator=torch.Generator().manual_seed(p.seed + 1))

    def leaves(dtype=None, to=None):
        made = [a.detach().to(dtype or a.dtype).to(to or a.device) for a in args]
        if not training:
            return made
        return [a.requires_grad_(name not in p.frozen) for name, a in zip("qkv", made)] + [
            a.requires_grad_() for a in made[3:]]

    def tensors(dtype=None, to=None):
        """The tensors the program reads; in training the floating ones require grad."""
        made = {}
        for name, t in extras.items():
            t = t.detach().to(dtype if dtype is not None and t.is_floating_point() else t.dtype).to(to or t.device)
            learned = name in LEARNED and not (name == "additive" and _causal_additive(p))
            made[name] = t.requires_grad_() if training and learned else t
        return made

    from torch._inductor.utils import fresh_cache

    counters = torch._dynamo.utils.counters
    counters.clear()
    torch._dynamo.reset()
    # Programs that read positions from tensors (and, in training, a boolean mask tensor or a causal additive mask)
    # are called three times with the same tensors: the first call reads them, the second starts the checked routes'
    # check, the third runs the branch the check chose (at once on the CPU).
    masks_checked = p.mask == "bool_tensor" or _causal_additive(p)
    calls = 3 if p.read_positions != "none" or (masks_checked and (training or _ROUTES_AT_ANY_SIZE)) else 1
    outs = []
    if device == "cpu":
        with testing.cpu_triton(), fresh_cache():
            compiled, inputs = torch.compile(program, dynamic=dynamic or None), (leaves(), tensors())
            outs = [_run(compiled, *inputs, grad) for _ in range(calls)]
    else:
        with fresh_cache():
            compiled, inputs = torch.compile(program, dynamic=dynamic or None), (leaves(to=device), tensors(to=device))
            outs = [tuple(t.cpu() for t in _run(compiled, *inputs, None if grad is None else grad.to(device)))
                    for _ in range(calls)]
    expected = _run(program, leaves(torch.float64), tensors(torch.float64), grad)
    eager = _run(program, leaves(), tensors(), grad)
    rtol, atol = TOLERANCE[p.dtype]
    fused_counter = "flashlight_attention_fused_for_training" if training else "flashlight_attention_fused"
    fused = counters["inductor"][fused_counter] >= 1
    faulted = counters["inductor"]["flashlight_fault_fallback"] + counters["inductor"]["flashlight_training_fault"] > 0
    matches, details = not faulted, []
    for actual, reference, own in (pair for out in outs for pair in zip(out, expected, eager, strict=True)):
        # Half-precision eager itself rounds; the bar is the float64 reference with eager's own error as slack. So
        # it is for gradients (and outputs) in training at any precision: they sum over a whole row or column.
        # A float32 program with no normalisation sums products of any size too: eager's own error there (2.9e-5 on
        # values up to 158, seed 410519) is above the tolerance of an element its sum cancels; with a softmax, eager's
        # float32 error is ~1e-7 and the slack next to nothing.
        own_error = (own.double() - reference).abs().nan_to_num(0).max().item()
        slack = own_error
        same_nans = torch.equal(actual.isnan(), reference.isnan())
        close = torch.allclose(actual.double(), reference, rtol=rtol, atol=atol + 2 * slack, equal_nan=True)
        matches = matches and same_nans and close
        verdict = "" if same_nans and close else " NaNs differ" if not same_nans else " NOT CLOSE"
        details.append(f"max error {(actual.double() - reference).abs().nan_to_num(0).max().item():.2e} (slack {slack:.1e}){verdict}")
    as_sdpa = " (as SDPA)" if counters["inductor"]["flashlight_attention_as_sdpa"] else ""
    routed = "".join(f" ({name} route)" for name in ("arange", "causal", "band")
                     if counters["inductor"][f"flashlight_attention_{name}_route"])
    return matches, fused, "; ".join(details) + as_sdpa + routed + (" OVERLAY FAULT (fell back)" if faulted else "")


# ``--routes-at-any-size``: the checked routes taken whatever the work (in inference they need ``MIN_WORK``, far above
# these programs' sizes), and programs with mask tensors called three times in inference too.
_ROUTES_AT_ANY_SIZE = False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=None, help="append one line per program to this file")
    parser.add_argument("--device", default="cpu", help="cpu (the CPU harness) or cuda")
    parser.add_argument("--training", action="store_true", help="q, k, v require grad: gradients are checked too")
    parser.add_argument("--dynamic", action="store_true", help="compile with every size symbolic (dynamic=True)")
    parser.add_argument("--mask", default=None, help="run only the seeds whose program draws this mask (bool_tensor, ...)")
    parser.add_argument("--score-mod", default=None, help="and this score mod (bias_tensor, ...)")
    parser.add_argument("--baddbmm", action="store_true", help="only the seeds whose scores come from baddbmm")
    parser.add_argument("--routes-at-any-size", action="store_true",
                        help="in inference, the checked routes (causal, band, arange) at these small sizes too")
    args = parser.parse_args()
    if args.routes_at_any_size:
        from inductor_overlay.fx_passes import arange_positions_route, causal_tensor_route

        global _ROUTES_AT_ANY_SIZE
        _ROUTES_AT_ANY_SIZE = True
        causal_tensor_route.MIN_WORK = arange_positions_route.MIN_WORK = 0
    import warnings

    import flashlight

    warnings.filterwarnings("ignore")
    flashlight.enable()
    log = open(args.log, "a") if args.log else None
    mismatches, fused_count, run, start = [], 0, 0, time.time()
    for seed in range(args.seed, args.seed + args.count):
        program = draw(seed)
        if args.mask is not None and program.mask != args.mask:
            continue
        if args.score_mod is not None and program.score_mod != args.score_mod:
            continue
        if args.baddbmm and not program.baddbmm:
            continue
        run += 1
        try:
            ok, fused, detail = check(program, args.device, args.training, args.dynamic)
        except Exception as error:  # a program that does not compile or run is a mismatch, not the end of the run
            ok, fused, detail = False, False, f"RAISED {type(error).__name__}: {str(error)[:200]}"
        fused_count += fused
        line = f"{'ok ' if ok else 'MISMATCH'} fused={int(fused)} {program.describe()} {detail}"
        if not ok:
            mismatches.append(line)
            print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()
    mode = (" in training" if args.training else "") + (" with every size symbolic" if args.dynamic else "")
    mode += " with the checked routes at any size" if args.routes_at_any_size else ""
    drawn = [f"{name}={value}" for name, value in (("mask", args.mask), ("mod", args.score_mod)) if value]
    drawn += ["baddbmm"] if args.baddbmm else []
    which = f" drawing {', '.join(drawn)}" if drawn else ""
    summary = (f"{run} programs{mode} on {args.device} (seeds {args.seed}..{args.seed + args.count - 1}{which}), "
               f"{len(mismatches)} mismatches, {fused_count} fused, {time.time() - start:.0f} s")
    print(summary)
    if log:
        log.write(summary + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
