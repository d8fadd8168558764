"""Run as `PYTHONPATH=. python tools/measure_probability_exp2_error.py` on a GPU: the error of the exp2 the attention
kernels take for the probabilities (``kernel/probability_exp2.py``), each pack size, against float64 exp2, over
every 16th float32 bit pattern in [-130, 2] and the special values; exits 1 if a special value comes out wrong."""

import datetime
import math
import sys

import torch
import triton
import triton.language as tl

from inductor_overlay.kernel.probability_exp2 import exp2_asm


@triton.jit
def _probability_exp2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr,
                             PACK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    y = tl.inline_asm_elementwise(ASM, CONSTRAINTS, [x], dtype=tl.float32, is_pure=True, pack=PACK)
    tl.store(y_ptr + offsets, y, mask=offsets < n)


def probability_exp2(x: torch.Tensor, pack: int) -> torch.Tensor:
    asm, constraints = exp2_asm(pack)
    y = torch.full_like(x, float("nan"))
    _probability_exp2_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, ASM=asm,
                                                              CONSTRAINTS=constraints, PACK=pack)
    return y


SPECIALS = [(-math.inf, 0.0), (0.0, 1.0), (-0.0, 1.0), (1.0, 2.0), (-1.0, 0.5), (-126.0, 2.0**-126), (-150.0, 0.0),
            (128.0, math.inf), (200.0, math.inf), (math.inf, math.inf), (math.nan, math.nan)]


def main() -> int:
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {datetime.date.today()}")
    negative = torch.arange(torch.tensor(-0.0).view(torch.int32).item(), torch.tensor(-130.0).view(torch.int32).item(),
                            16, dtype=torch.int64)
    positive = torch.arange(0, torch.tensor(2.0).view(torch.int32).item(), 16, dtype=torch.int64)
    x = torch.cat([negative, positive]).to(torch.int32).cuda().view(torch.float32)
    exact = torch.exp2(x.double())
    normal = exact >= 2.0**-126
    failures = 0
    for pack in (1, 2, 4):
        y = probability_exp2(x, pack).double()
        relative = ((y - exact).abs() / exact)[normal]
        # The polynomial takes the last element of each pack.
        lane = torch.arange(x.numel(), device="cuda") % pack == pack - 1
        worst_polynomial = relative[lane[normal]].max().item() if pack > 1 else float("nan")
        print(f"pack {pack}: {x.numel()} inputs in [-130, 2], results ≥ 2^-126: max relative error "
              f"{relative.max().item():.3e}; the polynomial's lanes {worst_polynomial:.3e}; below 2^-126 max "
              f"absolute {(y - exact)[~normal].abs().max().item():.3e}")
        specials = torch.tensor([value for value, _ in SPECIALS] * pack, device="cuda")
        got = probability_exp2(specials, pack).tolist()
        for index, value in enumerate(got):
            given, want = SPECIALS[index % len(SPECIALS)]
            good = math.isnan(value) if math.isnan(want) else (value == want or abs(value - want) <= 1e-6 * abs(want))
            if given == -126.0 and value == 0.0:  # flushed, as ex2.approx.ftz may: weighs nothing either way
                good = True
            if not good:
                failures += 1
                print(f"  pack {pack} lane {index % pack}: exp2({given}) = {value}, expected {want}")
    print("special values:", "all as expected" if not failures else f"{failures} wrong")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
