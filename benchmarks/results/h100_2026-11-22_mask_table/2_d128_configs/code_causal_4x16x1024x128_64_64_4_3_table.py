# AOT ID: ['0_inference']
from ctypes import c_void_p, c_long, c_int
import torch
import math
import random
import os
import tempfile
from math import inf, nan
from cmath import nanj
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels
from torch._C import _cuda_getCurrentRawStream as get_raw_stream
import triton
import triton.language as tl
from torch._inductor.runtime.triton_heuristics import start_graph, end_graph
from torch._C import _cuda_getCurrentRawStream as get_raw_stream

aten = torch.ops.aten
inductor_ops = torch.ops.inductor
_quantized = torch.ops._quantized
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
empty_strided_cpu_pinned = torch._C._dynamo.guards._empty_strided_cpu_pinned
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
empty_strided_xpu = torch._C._dynamo.guards._empty_strided_xpu
empty_strided_mtia = torch._C._dynamo.guards._empty_strided_mtia
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
alloc_from_pool = torch.ops.inductor._alloc_from_pool
async_compile = AsyncCompile()
empty_strided_p2p = torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p


# kernel path: /tmp/tmpl9lqw8rf/bx/cbxzbpn6g5aj7nnnhjmj4uoi2f4lnyqeqruuqr56q3rhmilgdjbv.py
# Topologically Sorted Source Nodes: [], Original ATen: []
# Source node to ATen node mapping:
# Graph fragment:
#   %arg1_1 : Tensor "bf16[4, 16, 1024, 128][2097152, 131072, 128, 1]cuda:0" = PlaceHolder[target=arg1_1]
#   %arg0_1 : Tensor "bf16[4, 16, 1024, 128][2097152, 131072, 128, 1]cuda:0" = PlaceHolder[target=arg0_1]
#   %arg2_1 : Tensor "bf16[4, 16, 1024, 128][2097152, 131072, 128, 1]cuda:0" = PlaceHolder[target=arg2_1]
#   %permute_default : Tensor "bf16[4, 16, 128, 1024][2097152, 131072, 1, 128]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%arg0_1, [0, 1, 3, 2]), kwargs = {})
#   %online_softmax_attention_default : Tensor "bf16[4, 16, 1024, 128][2097152, 131072, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.flashlight.online_softmax_attention.default](args = (%arg1_1, %permute_default, %arg2_1, [], None, 0, None, [4, 16]), kwargs = {})
#   return %online_softmax_attention_default
triton_tem_fused_0 = async_compile.triton('triton_tem_fused_0', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties

@triton_heuristics.template(

num_stages=3,
num_warps=4,
triton_meta={'signature': {'arg_Q': '*bf16', 'arg_KT': '*bf16', 'arg_V': '*bf16', 'out_ptr0': '*bf16'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]]}]},
inductor_meta={'kernel_name': 'triton_tem_fused_0', 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'grid_type': 'FixedGrid', 'fixed_grid': ['_grid_0', '_grid_1', '_grid_2'], 'extra_launcher_args': ['_grid_0', '_grid_1', '_grid_2'], 'config_args': {'D': 128, 'DV': 128, 'D_TILE': 128, 'DV_TILE': 128, 'C': 0, 'C_TILE': 0, 'LOG2E': 1.4426950408889634, 'SINK_SCALE': 1.4426950408889634, 'GROUPS': 1, 'SCAN_TILES': 64, 'MASK_CELL': 32, 'CELLS_M': 2, 'CELLS_N': 2, 'DOT_PRECISION': "'ieee'", 'UPCAST_DOT_OPERANDS': False, 'EVEN_M': True, 'EVEN_N': True, 'PROBABILITY_DTYPE': 'tl.bfloat16', 'BLOCK_M': 64, 'BLOCK_N': 64}},

)
@triton.jit
def triton_tem_fused_0(arg_Q, arg_KT, arg_V, out_ptr0):
    D : tl.constexpr = 128
    DV : tl.constexpr = 128
    D_TILE : tl.constexpr = 128
    DV_TILE : tl.constexpr = 128
    C : tl.constexpr = 0
    C_TILE : tl.constexpr = 0
    LOG2E : tl.constexpr = 1.4426950408889634
    SINK_SCALE : tl.constexpr = 1.4426950408889634
    GROUPS : tl.constexpr = 1
    SCAN_TILES : tl.constexpr = 64
    MASK_CELL : tl.constexpr = 32
    CELLS_M : tl.constexpr = 2
    CELLS_N : tl.constexpr = 2
    DOT_PRECISION : tl.constexpr = 'ieee'
    UPCAST_DOT_OPERANDS : tl.constexpr = False
    EVEN_M : tl.constexpr = True
    EVEN_N : tl.constexpr = True
    PROBABILITY_DTYPE : tl.constexpr = tl.bfloat16
    BLOCK_M : tl.constexpr = 64
    BLOCK_N : tl.constexpr = 64
    INDEX_DTYPE : tl.constexpr = tl.int32
    Q = arg_Q
    KT = arg_KT
    V = arg_V

    M = 1024
    N = 1024

    # This program owns rows [start_m, start_m + BLOCK_M) of one (flattened) output batch entry out_z.
    out_z = tl.program_id(1).to(INDEX_DTYPE)
    start_m = tl.program_id(0).to(INDEX_DTYPE) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_TILE)
    offs_dv = tl.arange(0, DV_TILE)
    row_in_bounds = offs_m[:, None] < M
    # Positions used by the user's score chain; clamped so its loads stay in bounds on ragged tiles (when M is a
    # multiple of BLOCK_M there are none, and unclamped positions keep the chain's loads contiguous).
    if EVEN_M:
        fl_m = offs_m[:, None]
    else:
        fl_m = tl.minimum(offs_m, M - 1)[:, None]
    fl_z = out_z
    # Each operand keeps its own batch dims and strides (transposed, expanded for GQA, ...): no copies.
    q_base = Q + (fl_z // (16)) * 2097152 + (fl_z % 16) * 131072
    kt_base = KT + (fl_z // (16)) * 2097152 + (fl_z % 16) * 131072
    v_base = V + (fl_z // (16)) * 2097152 + (fl_z % 16) * 131072
    # The Q tile stays in registers for the whole N loop (the D loop is eliminated: D is one tile).
    q = tl.load(q_base + offs_m[:, None] * 128 + offs_d[None, :] * 1,
                mask=row_in_bounds & (offs_d[None, :] < D), other=0.0)
    if UPCAST_DOT_OPERANDS:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of the logits (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_M, DV_TILE], tl.float32)  # running sum of exp2(logit - m_i) * V

    # Block skipping: tiles whose every element the mask sets to -inf contribute nothing; visit only the
    # range between the first and the last tile that is not entirely masked.
    m_lo = start_m
    m_hi = tl.minimum(start_m + BLOCK_M, M) - 1
    first_n = tl.zeros([], tl.int32) + N
    end_n = tl.zeros([], tl.int32)
    for scan_n in range(0, N, BLOCK_N * SCAN_TILES):
        n_lo = scan_n + tl.arange(0, SCAN_TILES) * BLOCK_N  # SCAN_TILES tiles' column ranges [n_lo, n_hi]
        n_hi = tl.minimum(n_lo + BLOCK_N, N) - 1
        masked = (((n_lo + (-1 * m_hi)) > 0)) | (n_lo >= N)
        first_n = tl.minimum(first_n, tl.min(tl.where(masked, N, n_lo), 0))
        end_n = tl.maximum(end_n, tl.max(tl.where(masked, 0, n_lo + BLOCK_N), 0))
    for start_n in range(first_n, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_in_bounds = offs_n[None, :] < N
        if EVEN_N:
            fl_n = offs_n[None, :]
        else:
            fl_n = tl.minimum(offs_n, N - 1)[None, :]

        # scores = Q Kᵀ for this tile, never written to memory.
        kt = tl.load(kt_base + offs_d[:, None] * 1 + offs_n[None, :] * 128,
                     mask=(offs_d[:, None] < D) & col_in_bounds, other=0.0)
        if UPCAST_DOT_OPERANDS:
            kt = kt.to(tl.float32)
        scores = tl.dot(q, kt, input_precision=DOT_PRECISION)

        # The user's pointwise chain from scores to logits (generated by Inductor from the user's graph).
        tmp0 = (fl_z)
        tmp1 = (fl_m)
        tmp2 = (fl_n)
        tmp3 = tmp2
        tmp4 = tmp3.to(tl.int32)
        tmp5 = tmp1
        tmp6 = tmp5.to(tl.int32)
        tmp7 = tmp4 - tmp6
        tmp8 = tl.full([1], 0, tl.int64)
        tmp9 = tmp7 <= tmp8
        tmp10 = tl.full([1], True, tl.int1)
        tmp11 = tmp9 & tmp10
        tmp12 = tmp11 == 0
        tmp13 = tl.full([1], float("-inf"), tl.float32)
        tmp14 = (scores)
        tmp15 = tl.full([1], 0.08838834764831843, tl.float32)
        tmp16 = tmp14 * tmp15
        tmp17 = tl.where(tmp12, tmp13, tmp16)
        tmp18 = tmp17.to(tl.float32)
        logits = tmp18

        if EVEN_N:
            logits = logits.to(tl.float32) * LOG2E
        else:
            logits = tl.where(col_in_bounds, logits.to(tl.float32), float("-inf")) * LOG2E

        # Online softmax: new running max; alpha rescales everything accumulated under the old max.
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows masked so far: keep exp2 finite
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(logits - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        # acc = alpha * acc + P V (the sum over N of the unnormalised probabilities times V).
        v = tl.load(v_base + offs_n[:, None] * 128 + offs_dv[None, :] * 1,
                    mask=(offs_n[:, None] < N) & (offs_dv[None, :] < DV), other=0.0)
        if UPCAST_DOT_OPERANDS:
            p = p.to(PROBABILITY_DTYPE).to(tl.float32)
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new


    # Normalise once, after the loop (a row whose logits were all -inf gives 0/0 = NaN, as eager does).
    acc = acc / l_i[:, None]

    idx_b0 = out_z // 16
    idx_b1 = (out_z) % 16
    idx_m = offs_m[:, None]
    idx_d = offs_dv[None, :]
    mask = row_in_bounds & (idx_d < DV)
    xindex = idx_d + 128*idx_m + 131072*idx_b1 + 2097152*idx_b0
    tl.store(out_ptr0 + (tl.broadcast_to(xindex, [BLOCK_M, DV_TILE])), acc, mask)
''', device_str='cuda')


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        arg0_1, arg1_1, arg2_1 = args
        args.clear()
        assert_size_stride(arg0_1, (4, 16, 1024, 128), (2097152, 131072, 128, 1))
        assert_size_stride(arg1_1, (4, 16, 1024, 128), (2097152, 131072, 128, 1))
        assert_size_stride(arg2_1, (4, 16, 1024, 128), (2097152, 131072, 128, 1))
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf0 = empty_strided_cuda((4, 16, 1024, 128), (2097152, 131072, 128, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [], Original ATen: []
            stream0 = get_raw_stream(0)
            triton_tem_fused_0.run(arg1_1, arg0_1, arg2_1, buf0, 16, 64, 1, stream=stream0)
            del arg0_1
            del arg1_1
            del arg2_1
        return (buf0, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = rand_strided((4, 16, 1024, 128), (2097152, 131072, 128, 1), device='cuda:0', dtype=torch.bfloat16)
    arg1_1 = rand_strided((4, 16, 1024, 128), (2097152, 131072, 128, 1), device='cuda:0', dtype=torch.bfloat16)
    arg2_1 = rand_strided((4, 16, 1024, 128), (2097152, 131072, 128, 1), device='cuda:0', dtype=torch.bfloat16)
    return [arg0_1, arg1_1, arg2_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
