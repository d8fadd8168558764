"""A minimal hand-written causal attention kernel, to ask what a Hopper feature would give our template before
building it in: TMA tensor descriptors for K and V (``USE_TMA``) and the next tile's QK dot issued before this
tile's softmax (``PREFETCH``), across tile configs, against SDPA (and, with ``--ours``, the fused kernel).

    PYTHONPATH=. python tools/hopper_kernel_probe.py --ours

H100 answer (benchmarks/results/h100_2026-11-22_hopper_probe/probe.txt): neither helped (TMA from 2% faster to
11% slower by config; the prefetch 4-51% slower, or out of shared memory at 3 stages). The plain kernel with
128x128 tiles, 8 warps and 3 stages beat our template by 13% at D128, which led to the visible-tile loop there.
With ``--ws`` it asks the same of Triton's automatic warp specialization (``tl.range(..., warp_specialize=True)`` with
on-device descriptors): on the H100 with triton 3.6 every config ran within 2% of the same config without it, except
one (1x32x16384x128, 128x128, 8 warps, 3 stages) 4% faster (benchmarks/results/h100_2026-11-23_additive_masks/hopper_probe_warp_specialize.txt)."""

import datetime
import itertools
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _load_k(K, k_desc, start_n, offs_n, offs_d, N, stride_n, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA:
        return k_desc.load([start_n, 0]).T
    return tl.load(K + (start_n + offs_n)[None, :] * stride_n + offs_d[:, None], mask=(start_n + offs_n)[None, :] < N, other=0.0)


@triton.jit
def _load_v(V, v_desc, start_n, offs_n, offs_d, N, stride_n, USE_TMA: tl.constexpr):
    if USE_TMA:
        return v_desc.load([start_n, 0])
    return tl.load(V + (start_n + offs_n)[:, None] * stride_n + offs_d[None, :], mask=(start_n + offs_n)[:, None] < N, other=0.0)


@triton.jit
def _columns(q, K, V, k_desc, v_desc, m_i, l_i, acc, lo, hi, offs_m, offs_n, offs_d, N, stride_kn, stride_vn, scale,
             MASKED: tl.constexpr, PREFETCH: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr,
             WARP_SPECIALIZE: tl.constexpr = False):
    if PREFETCH:
        scores = tl.dot(q, _load_k(K, k_desc, lo, offs_n, offs_d, N, stride_kn, BLOCK_N, USE_TMA))
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        if PREFETCH:
            # the next tile's QK dot is issued before this tile's softmax (its wgmma can overlap the exp2s)
            next_n = tl.minimum(start_n + BLOCK_N, hi - BLOCK_N)
            next_scores = tl.dot(q, _load_k(K, k_desc, next_n, offs_n, offs_d, N, stride_kn, BLOCK_N, USE_TMA))
        else:
            scores = tl.dot(q, _load_k(K, k_desc, start_n, offs_n, offs_d, N, stride_kn, BLOCK_N, USE_TMA))
        if MASKED:
            scores = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1) * scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores * scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_v(V, v_desc, start_n, offs_n, offs_d, N, stride_vn, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        if PREFETCH:
            scores = next_scores
    return m_i, l_i, acc


@triton.jit
def causal_attention(Q, K, V, O, M, N, scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PREFETCH: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False):
    row_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    start_m = row_tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + z * M * D + offs_m[:, None] * D + offs_d[None, :])
    K = K + z * N * D
    V = V + z * N * D
    k_desc = None
    v_desc = None
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(K, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(V, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if start_m > 0:
        m_i, l_i, acc = _columns(q, K, V, k_desc, v_desc, m_i, l_i, acc, 0, start_m, offs_m, offs_n, offs_d, N, D, D,
                                 scale, False, PREFETCH, USE_TMA, BLOCK_N, WARP_SPECIALIZE)
    m_i, l_i, acc = _columns(q, K, V, k_desc, v_desc, m_i, l_i, acc, start_m, start_m + BLOCK_M, offs_m, offs_n, offs_d,
                             N, D, D, scale, True, PREFETCH, USE_TMA, BLOCK_N)
    acc = acc / l_i[:, None]
    tl.store(O + z * M * D + offs_m[:, None] * D + offs_d[None, :], acc.to(O.dtype.element_ty))


def run(q, k, v, block_m, block_n, warps, stages, prefetch, tma, ws=False):
    b, h, m, d = q.shape
    out = torch.full_like(q, float("nan"))
    grid = (m // block_m, b * h)
    causal_attention[grid](q, k, v, out, m, m, d ** -0.5 * 1.4426950408889634, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                           PREFETCH=prefetch, USE_TMA=tma, WARP_SPECIALIZE=ws, num_warps=warps, num_stages=stages)
    return out


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {datetime.date.today()}", flush=True)
    shapes = [(4, 32, 4096, 128), (1, 32, 16384, 128), (4, 32, 4096, 64)]
    for b, h, s, d in shapes:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        flops = 2 * b * h * s * s * 2 * d / 2
        sdpa_ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), rep=300)
        print(f"{b}x{h}x{s}x{d} sdpa {sdpa_ms:.4f} ms {flops / sdpa_ms / 1e9:.0f} TF", flush=True)
        if "--ours" in sys.argv:
            import flashlight
            flashlight.enable()

            def causal(q, k, v):
                s_ = q.shape[-2]
                scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
                mask = torch.ones(s_, s_, dtype=torch.bool, device=q.device).tril()
                return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v

            fn = torch.compile(causal)
            out = fn(q, k, v)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            ms = triton.testing.do_bench(lambda: fn(q, k, v), rep=300)
            print(f"  flashlight: {ms:.4f} ms {flops / ms / 1e9:.0f} TF x{sdpa_ms / ms:.2f} sdpa err {err:.1e}", flush=True)
        configs = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3)] if d == 128 else [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)]
        # --ws: warp specialization of the unmasked loop (Triton needs on-device TMA descriptors for it on Hopper).
        variants = [(False, True, ws) for ws in (False, True)] if "--ws" in sys.argv else [
            (prefetch, tma, False) for prefetch, tma in itertools.product((False, True), (False, True))]
        if "--ws" in sys.argv:
            configs = [(128, 128, 4, 2), (128, 128, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3)]
        for (bm, bn, w, st), (prefetch, tma, ws) in itertools.product(configs, variants):
            label = f"{bm}x{bn} w{w} s{st} prefetch={int(prefetch)} tma={int(tma)} ws={int(ws)}"
            try:
                out = run(q, k, v, bm, bn, w, st, prefetch, tma, ws)
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                ms = triton.testing.do_bench(lambda: run(q, k, v, bm, bn, w, st, prefetch, tma, ws), rep=300)
                print(f"  {label}: {ms:.4f} ms {flops / ms / 1e9:.0f} TF x{sdpa_ms / ms:.2f} sdpa err {err:.1e}", flush=True)
            except Exception as error:  # noqa: BLE001 (a probe: report the config's failure and go on)
                print(f"  {label}: FAILED {type(error).__name__}: {str(error)[:200]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
