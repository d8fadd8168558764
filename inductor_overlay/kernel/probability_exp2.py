"""The exp2 that turns logits into probabilities, spread over two kinds of GPU unit.

Each logit costs one exp2 on the special-function unit (MUFU), which retires 16 a cycle per SM on the H100, an eighth
of the fma rate. At head dim 64 that unit, not the tensor cores, bounds an attention kernel, and a soft-cap's tanh
doubles its load. Where the probabilities are rounded to 16 bits for P·V anyway, a share of them can take exp2 as a
short polynomial on the fma units instead: one logit in every ``pack`` (``config.exp2_pack``), through one inline
PTX block that also runs the others' ``ex2.approx.ftz.f32``.

The polynomial: x clamped to [-127, 128] (NaN kept), split as x = k + f with k = round(x) (a magic-number add, no
conversion instruction) and f in [-0.5, 0.5]; 2^f by a degree-4 polynomial; 2^k built from k's bits. At k = -127
the factor is exactly 0, so -inf (a masked logit) weighs 0 as ``tl.exp2`` gives it, and at k = 128 it is inf.
"""

from __future__ import annotations

import re
import struct

import torch

from inductor_overlay import config as overlay_config

# 2^f ≈ Σ c_i f^i on [-0.5, 0.5]: a least-squares fit of the relative error reweighted towards minimax (Lawson),
# made for this module. Largest relative error, evaluated in float32 by Horner's rule: 2.7e-6, against fp16's 4.9e-4
# and bf16's 3.9e-3 rounding of the probabilities that follows.
EXP2_POLYNOMIAL = (0.9999992847442627, 0.6931217908859253, 0.240247443318367, 0.05591785907745361,
                   0.009570101276040077)

_ROUNDING_MAGIC = 12582912.0  # 1.5 * 2^23: x + this has round(x) in its low mantissa bits


def _ptx_float(value: float) -> str:
    return "0f" + struct.pack(">f", value).hex().upper()


def _polynomial_exp2(out: str, x: str) -> str:
    """PTX for ``out = 2^x`` on the fma units (x, out: operand names)."""
    c0, c1, c2, c3, c4 = map(_ptx_float, EXP2_POLYNOMIAL)
    magic = _ptx_float(_ROUNDING_MAGIC)
    return " ".join([
        f"max.NaN.f32 x, {x}, {_ptx_float(-127.0)};",
        f"min.NaN.f32 x, x, {_ptx_float(128.0)};",
        f"add.rn.f32 k, x, {magic};",
        f"sub.rn.f32 f, k, {magic};",
        "sub.rn.f32 f, x, f;",
        f"fma.rn.f32 r, f, {c4}, {c3};",
        f"fma.rn.f32 r, r, f, {c2};",
        f"fma.rn.f32 r, r, f, {c1};",
        f"fma.rn.f32 r, r, f, {c0};",
        "mov.b32 bits, k;",
        "add.s32 bits, bits, 127;",
        "shl.b32 bits, bits, 23;",
        "mov.b32 scale, bits;",
        f"mul.rn.f32 {out}, r, scale;",
    ])


def exp2_asm(pack: int) -> tuple[str, str]:
    """The PTX and constraints of one ``tl.inline_asm_elementwise`` instance over ``pack`` float32 elements: the
    last through the polynomial (for pack >= 2), the others through ``ex2.approx.ftz.f32``."""
    hardware = pack if pack == 1 else pack - 1
    lines = [f"ex2.approx.ftz.f32 ${i}, ${pack + i};" for i in range(hardware)]
    if pack > 1:
        lines = ["{ .reg .f32 x, k, f, r, scale; .reg .b32 bits;", *lines,
                 _polynomial_exp2(f"${pack - 1}", f"${2 * pack - 1}"), "}"]
    constraints = ",".join(["=r"] * pack + ["r"] * pack)
    return " ".join(lines), constraints


def probability_exp2_pack(device: torch.device, probability_dtype: torch.dtype) -> int:
    """``config.exp2_pack`` where it applies (CUDA, probabilities rounded to fp16/bf16), else 0: ``tl.exp2``."""
    if device.type != "cuda" or torch.version.hip is not None:
        return 0
    if probability_dtype not in (torch.float16, torch.bfloat16):
        return 0
    return max(overlay_config.exp2_pack, 0)


_PROBABILITY_EXP2 = re.compile(r"^(?P<lead>\s*)(?P<name>p\d*) = tl\.exp2\((?P<arg>.*)\)(?P<comment>\s+#.*)?$", re.M)


def with_probability_exp2(source: str) -> str:
    """``source`` with each ``p = tl.exp2(...)`` line taking the inline PTX (template constants EXP2_ASM,
    EXP2_CONSTRAINTS and EXP2_PACK)."""
    call = ("{lead}{name} = tl.inline_asm_elementwise(EXP2_ASM, EXP2_CONSTRAINTS, [{arg}], dtype=tl.float32, "
            "is_pure=True, pack=EXP2_PACK){comment}")
    return _PROBABILITY_EXP2.sub(lambda found: call.format(**{k: v or "" for k, v in found.groupdict().items()}), source)
