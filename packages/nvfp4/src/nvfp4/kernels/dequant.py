"""Dequantize a whole NVFP4 weight into the activation dtype (the dequantize + cuBLAS sizes: M ≥ 1024 forward,
dgrad above M = 64, fp32 activations).

Reference: :func:`nvfp4.codec.dequantize` (tests: ``tests/nvfp4/test_kernels.py``).

``_dequant_kernel``: writes ``dequant(W)`` in the activation dtype; used for the large-M fallback
(dequantize once, then cuBLAS), where the GEMM is compute-bound and the extra 2 bytes/weight are amortised.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode import _dequant_tile, _mma_tile, _mma_tile_ptrs, _scale_fold, _scale_k_offset, _scale_words


@triton.jit
def _dequant_mma_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K):
    """``out[N, K] = dequant(W)`` (out's dtype, contiguous) for W in the MMA layout (the scales in step A's order);
    one 64 × 256 tile per program."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    sfac, post = _scale_fold(g_ptr, False)
    w_tile, s_tile = _mma_tile_ptrs(w_ptr, s_ptr, pid_n, K)
    k0 = pid_k * 256
    s = _scale_words(tl.load(s_tile + _scale_k_offset(k0)), False)
    w = _mma_tile(tl.load(w_tile + 2 * k0), s, sfac, False, out_ptr.dtype.element_ty)
    rows = pid_n * 64 + tl.arange(0, 64)
    cols = k0 + tl.arange(0, 256)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], w)


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, g_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST: tl.constexpr
):
    """``out[N, K] = dequant(W)`` in out's dtype (contiguous)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    offs_ks = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    half_k = K // 2
    nblk = K // 16
    n_mask = offs_n[:, None] < N
    rows = offs_n[:, None].to(tl.int64)
    p = tl.load(w_ptr + rows * half_k + offs_kb[None, :], mask=n_mask & (offs_kb[None, :] < half_k), other=0)
    s = tl.load(s_ptr + rows * nblk + offs_ks[None, :], mask=n_mask & (offs_ks[None, :] < nblk), other=0.0)
    sfac, post = _scale_fold(g_ptr, FAST)
    w = _dequant_tile(p, s, sfac, BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty, FAST)
    tl.store(out_ptr + rows * K + offs_k[None, :], w, mask=n_mask & (offs_k[None, :] < K))
