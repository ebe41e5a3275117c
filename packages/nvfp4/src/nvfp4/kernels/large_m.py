"""Large-M W4A16 NVFP4 GEMM (batched rollouts, prefill, training: M ≈ 32 … 4096 rows of x), weights 4-bit in HBM.

Design
======

Beyond M ≈ 74 rows the H100 GEMM is bound by the tensor cores, not by the 0.5625 bytes per weight, so what matters is
(1) that every decoded weight is reused by many rows of x, (2) that the decode and the loads overlap the MMAs, and
(3) that the activation tile, re-read once per weight tile, does not swamp L2. The decode-size kernel
(:func:`nvfp4.kernels.small_m._linear_mma_kernel`) keeps one 64-output tile per program and a whole 256-input K
step of x in shared memory: at M = 128 that is a 64 KB x tile per pipeline stage, one 4-warp program per SM, and x
streamed from L2 ``N / 64`` times.

Of the designs studied, this kernel takes Machete's and ``triton_kernels``' Hopper weight path ("swap x/w"): the
product is computed transposed, ``yᵀ = W · xᵀ``, so that the decoded weight is the *register* A operand of ``wgmma``
(no shared-memory round trip for W) while the activation tile is the shared-memory B operand, brought in by
``cp.async`` pipelining (``num_stages``). The weight is read in the MMA layout (:mod:`nvfp4.layout`): a K quarter
(64 inputs) of a 64-row tile is 4 consecutive stored rows of 512 bytes, one per warp, and a 16-byte load per thread
lands in that warp's A-fragment registers, so ``TILES`` tiles × ``QUARTERS`` quarters are one ``[4·Q·T, 512]`` load
relabelled for free (:func:`nvfp4.kernels.decode._mma_tiles`). Per program: ``BLOCK_N = 64·TILES`` weight rows
(with 8 warps, two warpgroups each own 64-row tiles) × ``BLOCK_M`` rows of x (the ``wgmma`` N dimension, up to 256),
K steps of ``64·QUARTERS``. Marlin's alternative (weights decoded by every warp into ``mma.sync`` fragments, x
through shared memory, a stream-K grid) targets Ampere's ``mma.sync``; on Hopper the ``wgmma`` with a register A
operand is the only form that skips the decoded tile's trip through shared memory, which Triton lowers from
``tl.dot`` when the A operand is computed in registers.

Large weight tiles cut the x traffic (a ``[128, 64]`` bf16 x tile feeds 128-256 weight rows per step); programs are
grouped along M (``GROUP_M``) so the programs that share a weight tile run back to back and W streams from HBM
about once. Where ``N / BLOCK_N · cdiv(M, BLOCK_M)`` leaves SMs idle (small N at M ≤ 256), K is split and the fp32
partials are summed by ``_splitk_reduce_kernel``. Tile sizes per (M, N, K) come from a measured sweep
(``benchmarks/gemm.py --sweep``), frozen in :mod:`nvfp4.kernels.dispatch_table`: nothing is tuned
at import or on the first call of a CUDA-graph capture.

A fused LoRA adds ``lora_scale · t · B[rows]ᵀ`` in the epilogue from ``t = x · Aᵀ`` (``[M, R]``, computed by one
cuBLAS call before the launch and rounded to x's dtype as PEFT's ``lora_A`` output is): at these M the adapter's
``x · Aᵀ`` inside every tile's K loop would cost ``R / BLOCK_N`` of the base MMAs, and the one extra launch is
amortised.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode import (
    _grouped_tile,
    _lora_epilogue,
    _mma_tiles,
    _scale_fold,
    _scale_k_offset,
    _scale_pair_ptrs,
    _scale_words,
    _store_output,
)

# Tiles the dispatch table was chosen from (``benchmarks/gemm.py --sweep``): (weight tiles of 64 rows, K quarters of
# 64 inputs, BLOCK_M rows of x, warps, pipeline stages). Picked from the sm_90 SASS (``benchmarks/kernel_sass.py@1486a77``:
# no shared-memory round trip of the decoded weight, no spills, ≤ 128 registers where 2-3 programs per SM should
# fit) and the shared memory of the stages.
LARGE_M_TILES = [(1, 1, 64, 4, 4), (1, 1, 128, 4, 4), (1, 2, 128, 4, 3), (2, 1, 64, 8, 4), (2, 1, 128, 8, 4),
                 (2, 2, 128, 8, 3), (4, 1, 64, 8, 4), (4, 1, 128, 8, 3), (2, 1, 256, 8, 3)]  # fmt: skip


@triton.jit
def _linear_large_m_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    K_PER_SPLIT,
    HAS_BIAS: tl.constexpr,
    USE_WS: tl.constexpr,
    TILES: tl.constexpr,
    QUARTERS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP_M: tl.constexpr,
    FAST: tl.constexpr,
    t_ptr=None,
    lb_ptr=None,
    lora_scale=1.0,
    R=0,
    HAS_LORA: tl.constexpr = False,
    BLOCK_R: tl.constexpr = 16,
):
    """``y[BLOCK_M, 64·TILES] = x_tile · W_tileᵀ`` for W in the MMA layout, over the K range of split ``program_id(1)``.

    x ``[M, K]`` (row stride ``stride_xm``, bf16/fp16); W: packed uint8 ``[N/4, 2K]`` (MMA layout), scales fp8
    ``[N/64, 4K]`` (step A's order, read as int64 pairs of rows), global fp32 ``[1]``; bias
    ``[N]``. ``N % 64 == 0``, ``K % 256 == 0``; the last weight tiles of a program past N re-read tile ``N/64 - 1``
    and are not stored. ``USE_WS`` (split-K): fp32
    partials into ``y_ptr`` viewed as ``[split, M, N]``, bias left to the reduce kernel. ``HAS_LORA``: adds
    ``lora_scale · t · Bᵀ`` with ``t`` ``[M, R]`` (``t_ptr``, contiguous, x's dtype) and B ``[N, R]`` (``lb_ptr``),
    once (by split 0).
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    BLOCK_N: tl.constexpr = 64 * TILES
    BLOCK_K: tl.constexpr = 64 * QUARTERS
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_tile(pid, num_m, num_n, GROUP_M)  # the programs sharing a weight tile back to back

    dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Stored rows (quarter, tile, warp) of the MMA layout, quarter outermost (see _mma_tiles); tiles past N re-read
    # the last one (unpredicated 16-byte loads), their outputs are masked at the store.
    i = tl.arange(0, 4 * QUARTERS * TILES)
    tile = tl.minimum(pid_n * TILES + (i // 4) % TILES, N // 64 - 1)
    stored_row = tile * 16 + 4 * (i // (4 * TILES)) + i % 4
    w_rows = w_ptr + (stored_row.to(tl.int64) * (2 * K))[:, None] + tl.arange(0, 512)[None, :]
    rows = tl.minimum(offs_n, N - 1)
    # the tiles past N clamp as the codes' rows do
    s_rows = _scale_pair_ptrs(s_ptr, tl.minimum(pid_n * TILES + tl.arange(0, TILES), N // 64 - 1), K, QUARTERS)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    sfac, _ = _scale_fold(g_ptr, False)  # 2^14 / global: the portable tile's factor, or FAST's accumulator factor

    k_lo = pid_k * K_PER_SPLIT
    k_hi = min(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # K step k0 = 256·(tile column) + 64·(first quarter): stored rows 4·quarter further down, 512 bytes per column
        p = tl.load(w_rows + ((k0 % 256) // 64) * (8 * K) + (k0 // 256) * 512)
        w = _mma_tiles(p, _scale_words(tl.load(s_rows + _scale_k_offset(k0)), FAST), sfac, TILES, QUARTERS, FAST,
                       dtype)  # fmt: skip
        xt = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(xt), acc)
    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if FAST:
        acc = acc * sfac
    if HAS_LORA:  # the adapter once, by split 0 (the splits' partials are summed linearly)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        t = tl.load(t_ptr + offs_m[:, None].to(tl.int64) * R + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :],
                    other=0.0)  # fmt: skip
        acc = _lora_epilogue(acc, tl.trans(t), lb_ptr, rows, offs_r, r_mask, R, tl.where(pid_k == 0, lora_scale, 0.0),
                             dtype)  # fmt: skip
    _store_output(acc, y_ptr, b_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, pid_k, HAS_BIAS, USE_WS)
