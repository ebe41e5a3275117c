"""Backward product ``dx = dy · dequant(W)`` at training sizes where it is fused (M ≤ 64; above, dequantize +
cuBLAS measured faster: ``benchmarks/results/gemm_sweep_large_m.json``).

Reference: ``dy · nvfp4.codec.dequantize(W)`` (tests: ``tests/nvfp4/test_kernels.py``).

``_dgrad_kernel``: ``dx[M, K] = dy[M, N] · W[N, K]``; the weight tile ``[BLOCK_N, BLOCK_K]`` is read row-wise
exactly as above and is already the ``[reduction, output]`` operand B (portable decode: Triton 3.6 fails to compile
the PTX decode feeding operand B).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode import _dequant_tile, _grouped_tile, _mma_tile, _mma_tile_ptrs, _scale_fold, _scale_k_offset, _scale_words


@triton.jit
def _dgrad_kernel(
    dy_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    dx_ptr,
    M,
    N,
    K,
    stride_dym,
    stride_dxm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FAST: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_K]`` tile of ``dx`` = ``dy[M, N] · W[N, K]``, reducing over N in ``BLOCK_N`` steps."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_k = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = _grouped_tile(pid, num_m, num_k, GROUP_M)

    dtype = dy_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    offs_ks = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    half_k = K // 2
    nblk = K // 16
    # Clamp K columns instead of masking: out-of-range columns are computed on duplicate data and never stored.
    kb = tl.minimum(offs_kb, half_k - 1)
    ks = tl.minimum(offs_ks, nblk - 1)
    sfac, post = _scale_fold(g_ptr, FAST)

    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        nn = n0 + offs_n
        n_ok = nn < N
        rows = tl.minimum(nn, N - 1).to(tl.int64)
        p = tl.load(w_ptr + rows[:, None] * half_k + kb[None, :])
        s = tl.load(s_ptr + rows[:, None] * nblk + ks[None, :])
        w = _dequant_tile(p, s, sfac, BLOCK_N, BLOCK_K, dtype, FAST)
        g = tl.load(
            dy_ptr + offs_m[:, None].to(tl.int64) * stride_dym + nn[None, :],
            mask=m_mask[:, None] & n_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(g, w, acc)
    if FAST:
        acc = acc * post
    mask = m_mask[:, None] & (offs_k[None, :] < K)
    tl.store(
        dx_ptr + offs_m[:, None].to(tl.int64) * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _dgrad_mma_kernel(dy_ptr, w_ptr, s_ptr, g_ptr, dx_ptr, M, N, K, stride_dym, stride_dxm, BLOCK_M: tl.constexpr):
    """:func:`_dgrad_kernel` for W in the MMA layout: one ``[BLOCK_M, 256]`` tile of ``dx`` per program, reducing
    over N one 64-row tile of W at a time (portable decode, W is operand B; the scales in step A's order)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = dy_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, 64)
    offs_k = pid_k * 256 + tl.arange(0, 256)
    m_mask = offs_m < M
    sfac, post = _scale_fold(g_ptr, False)
    k0 = pid_k * 256
    w_tile, s_tile = _mma_tile_ptrs(w_ptr, s_ptr, 0, K)
    w_tile += 2 * k0
    s_tile += _scale_k_offset(k0)
    acc = tl.zeros((BLOCK_M, 256), dtype=tl.float32)
    for t in range(0, N // 64):
        w = _mma_tile(tl.load(w_tile), _scale_words(tl.load(s_tile), False), sfac, False, dtype)
        w_tile += 32 * K  # next tile row: 16 rows of 2K bytes
        s_tile += K // 2  # next tile row: 4K bytes, K/2 int64 pairs
        g = tl.load(dy_ptr + offs_m[:, None].to(tl.int64) * stride_dym + (t * 64 + offs_n)[None, :],
                    mask=m_mask[:, None], other=0.0)  # fmt: skip
        acc = tl.dot(g, w, acc)
    tl.store(dx_ptr + offs_m[:, None].to(tl.int64) * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=m_mask[:, None])  # fmt: skip
