"""Run as `python tools/measure_fast_tanh_error.py` on a GPU: the error of the tanh the attention kernels use for
fp16/bf16 soft-capping (``tanh.approx.f32``), against float64 tanh, over every float32 with |x| in [2^-20, 16]
(beyond 16 tanh is ±1 in float32) sampled at every 64th bit pattern, and against the bf16 rounding eager applies."""

import datetime

import torch
import triton
import triton.language as tl

from inductor_overlay.kernel.online_softmax_attention import APPROXIMATE_TANH_ASM


@triton.jit
def _approximate_tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    y = tl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(y_ptr + offsets, y, mask=offsets < n)


def main() -> None:
    low, high = (torch.tensor([2.0**-20, 16.0]).view(torch.int32)).tolist()
    bits = torch.arange(low, high, 64, dtype=torch.int32, device="cuda")
    x = torch.cat([bits.view(torch.float32), -bits.view(torch.float32)])
    y = torch.empty_like(x)
    _approximate_tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, ASM=APPROXIMATE_TANH_ASM)
    exact = torch.tanh(x.double())
    relative = ((y.double() - exact).abs() / exact.abs()).max().item()
    absolute = (y.double() - exact).abs().max().item()
    bf16_rounding = ((torch.tanh(x).bfloat16().double() - exact).abs() / exact.abs()).max().item()
    normal = x.abs() >= 2.0**-14  # fp16's smallest normal: below it fp16 rounding loses relative precision
    fp16_rounding = ((torch.tanh(x).half().double() - exact).abs() / exact.abs())[normal].max().item()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {datetime.date.today()}")
    print(f"tanh.approx.f32 over {x.numel()} float32 inputs, |x| in [2^-20, 16]:")
    print(f"  max relative error {relative:.3e} (2^{torch.tensor(relative).log2().item():.2f}), max absolute error {absolute:.3e}")
    print(f"  eager's rounding of tanh to bf16: max relative error {bf16_rounding:.3e}; to fp16 (|x| ≥ 2^-14): {fp16_rounding:.3e}")


if __name__ == "__main__":
    main()
