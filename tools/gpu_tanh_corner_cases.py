"""tanh.approx.f32 (``config.fast_tanh``) against libdevice's tanh and the CPU's at the values a run-time scale can
give a soft-cap's argument: ±inf, NaN, ±0, subnormals (results/fast_tanh_corner_cases.txt). Needs a CUDA GPU.

    python tools/gpu_tanh_corner_cases.py
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from inductor_overlay.kernel.online_softmax_attention import APPROXIMATE_TANH_ASM

INPUTS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-40, 1e-45, 1.1e-38, 3e38, -3e38, 1e-20,
          20.0, -20.0, 0.5, 1e-5]


@triton.jit
def _both_tanhs(x_ptr, approx_ptr, exact_ptr, asm: tl.constexpr, n: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, n))
    tl.store(approx_ptr + tl.arange(0, n), tl.inline_asm_elementwise(asm, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1))
    tl.store(exact_ptr + tl.arange(0, n), libdevice.tanh(x))


def main() -> None:
    x = torch.tensor(INPUTS, device="cuda")
    approx, exact = torch.empty_like(x), torch.empty_like(x)
    _both_tanhs[(1,)](x, approx, exact, APPROXIMATE_TANH_ASM, len(INPUTS))
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for value, a, e, cpu in zip(x.tolist(), approx.tolist(), exact.tolist(), torch.tanh(x.cpu()).tolist()):
        print(f"x={value!r:>12} approx={a!r:>24} libdevice={e!r:>24} torch_cpu={cpu!r}")


if __name__ == "__main__":
    main()
