"""Decode-size W4A16 NVFP4 GEMMs (M ≤ 64, the rollouts' decode steps): weight-streaming, split-K, fused LoRA.

Reference: ``x · nvfp4.codec.dequantize(W)ᵀ`` (tests: ``tests/nvfp4/test_kernels.py``). Layouts and decoders:
:mod:`nvfp4.kernels.decode`; launch and dispatch: :mod:`nvfp4.kernels.nvfp4_gemm`.

``_linear_mma_kernel`` (MMA layout, M ≤ 128, the CUDA default): one 64-output tile per program, all rows of x
(``BLOCK_M`` = M rounded up to a power of two ≥ 16), ``yᵀ = W · xᵀ`` with W as the register A operand; split-K to
~3.5 programs per SM at M ≤ 32 (2 at M ≤ 128) with ≥ 2 K steps per split (:func:`mma_config`), fp32 partials summed
in the same kernel by the last program of each tile at M ≤ 32 (a ticket counter, ``FUSED_REDUCE``), by
``_splitk_reduce_kernel`` above; optional fused LoRA as below. ``_dgrad_mma_kernel`` / ``_dequant_mma_kernel``: the
backward product (M ≤ 64) and the dequantizer (large-M fallback) on the same tiles.

``_linear_kernel``: tiles of ``[BLOCK_N, BLOCK_M]`` outputs. Hopper has no FP4 tensor cores, so the tile of W is
dequantized to bf16 in registers and fed to ``tl.dot``. With ``SWAP`` the product is computed transposed,
``yᵀ = W · xᵀ``: the dequantized weight is operand A, which Hopper's ``wgmma`` (and ``mma``) take from registers,
while the activation tile (operand B) is staged through shared memory — the same trick Triton's own mxfp4 matmul
uses on Hopper ("swap x/w"). Small M (decode) pads M to 16 and splits K over ``SPLIT_K`` programs so that
``N / BLOCK_N · SPLIT_K`` fills the 132 SMs; the fp32 partials go to a ``[SPLIT_K, M, N]`` workspace that
``_splitk_reduce_kernel`` sums (adding the bias and casting). Program ids are grouped along M (``GROUP_M``) so
the programs that share a weight tile run together and W streams from HBM once.

``PREFETCH`` (both forward kernels, ``K % BLOCK_K == 0`` only): the loads of step ``i+1`` are issued before step
``i`` is decoded (register double buffering; the last step re-reads its own tile). Measured faster only on small
weights (N ≤ 1024) at M ≤ 16, so that is where the dispatch turns it on.

``_gemv_kernel`` (small M, small N): no tensor cores and no shared memory. Every program owns ``BLOCK_N`` output
columns for all ``M ≤ BLOCK_M`` rows of x; the weight tile is decoded into its even-k (low nibble) and odd-k (high
nibble) halves, x is loaded as ``[M, BLOCK_K/2, 2]`` and split the same way, and ``lo·x_even + hi·x_odd`` is
accumulated in fp32 and reduced over K once per step. Split-K as above. On the H100 it beat the tensor-core kernel
only on the k/v projections (N ≤ 1024) at M ≤ 2: one fp32 FMA per weight per row of x makes it instruction-bound
from M = 4 (see ``docs/kernels.md``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode import (
    _dequant_tile,
    _dequant_tile_bf16_asm,
    _e2m1_to_f32,
    _grouped_tile,
    _lora_epilogue,
    _lora_init,
    _mma_tile,
    _mma_tile_ptrs,
    _scale_fold,
    _scale_k_offset,
    _scale_words,
    _store_output,
)


@triton.jit
def _linear_mma_kernel(
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
    BLOCK_M: tl.constexpr,
    FAST: tl.constexpr,
    a_ptr=None,
    lb_ptr=None,
    lora_scale=1.0,
    R=0,
    HAS_LORA: tl.constexpr = False,
    BLOCK_R: tl.constexpr = 16,
    out_ptr=None,
    cnt_ptr=None,
    SPLIT=1,
    FUSED_REDUCE: tl.constexpr = False,
    t_ptr=None,
    tcnt_ptr=None,
    SHARED_T: tl.constexpr = False,
):
    """``yᵀ[64, BLOCK_M] = W_tile · xᵀ`` for W in the MMA layout: one 64-output tile over the K range of split
    ``program_id(1)``, all ``M ≤ BLOCK_M`` rows of x (``program_id(2)`` walks row blocks when M > BLOCK_M).

    Each K step of 256 loads the tile's 8 KB of codes, 1 KB of scales and the x tile; with ``num_stages ≥ 2``
    Triton pipelines all three with ``cp.async``. Outputs, split-K workspace, bias and ``HAS_LORA`` as in
    :func:`_linear_kernel`. The scales are in step A's order ``[N/64, 4K]`` (:func:`_scale_words`).

    ``FUSED_REDUCE`` (split-K): the workspace at ``y_ptr`` is summed in this kernel instead of by
    ``_splitk_reduce_kernel``. Each program stores its fp32 partial, then takes a ticket from the tile's counter
    (``cnt_ptr``, int32, zero on entry); the program that arrives last sums the ``SPLIT`` partials in split order
    (deterministic, whatever the arrival order), writes ``out_ptr`` and puts the counter back to zero for the next
    launch. That saves the second launch, which at decode sizes cost as much as the GEMM of a small weight.

    ``SHARED_T`` (``HAS_LORA`` with ``FUSED_REDUCE``): the adapter's ``t = x · Aᵀ`` is computed once per K split,
    not by every tile. Accumulated beside each weight tile (the plain ``HAS_LORA``), A is read once per 64 outputs:
    at R = 32 that is twice the weight tile's bytes per K step, and its pipeline buffers cut the programs per SM from
    4 to 3 (the 7B gate projection went from 22.5 to 34.9 µs at M = 1). Here the program of tile 0 of each split
    first computes that split's ``[BLOCK_R, BLOCK_M]`` partial of ``t``, stores it in the fp32 workspace ``t_ptr``
    and counts it in ``tcnt_ptr[2·pid_m]`` (release); the program that sums a tile's partials then waits for all
    ``SPLIT`` of them (acquire; tile 0's programs are dispatched before every tile's last one, so they are running or
    done), sums them in split order, rounds ``t`` to the activation dtype once (as PEFT's ``lora_A`` output is) and
    adds ``lora_scale · tᵀ · B[tile]ᵀ``. The last of the ``N / 64`` readers puts both counters back to zero.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * 64 + tl.arange(0, 64)
    offs_k = tl.arange(0, 256)
    m_mask = offs_m < M
    # sfac = 2^14 / global: the portable tile's factor; FAST multiplies the accumulator by it instead (its tile holds
    # W · global · 2^-14), so the folded-scale pair of the compressed-tensors kernels (_scale_fold(g, True)) is unused
    sfac, _ = _scale_fold(g_ptr, False)
    w_tile, s_tile = _mma_tile_ptrs(w_ptr, s_ptr, pid_n, K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    k_lo = pid_k * K_PER_SPLIT
    k_hi = min(k_lo + K_PER_SPLIT, K)
    if not (HAS_LORA and not SHARED_T):
        # every split has work (the launcher's split = cdiv(K, K_PER_SPLIT)): without it LLVM may lay the loop's
        # zero-trip path (acc = 0) out after the loop, and ptxas serialises every wgmma (C7515, checked in SASS).
        # Not with x·Aᵀ beside every tile: its wgmmas in flight keep both register-A operands live (255 registers, spills from
        # BLOCK_M = 32 against 144-191 serialised), which cost the 7B q/o projections 20-25 % at M <= 16 (H100,
        # 4e1d05a: 392 programs at 2 CTAs per SM instead of 3)
        tl.assume(k_hi > k_lo)
    acc = tl.zeros((64, BLOCK_M), dtype=tl.float32)
    if HAS_LORA:
        offs_r, r_mask, a_rows, t_acc = _lora_init(a_ptr, K, R, BLOCK_R, BLOCK_M)
        if SHARED_T:
            t_ws = t_ptr + ((pid_m * SPLIT) * BLOCK_R + offs_r[:, None]) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            if pid_n == 0:  # this split's x · Aᵀ, for the last program of every tile
                for k0 in range(k_lo, k_hi, 256):
                    xt = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
                    at = tl.load(a_rows + (k0 + offs_k)[None, :], mask=r_mask[:, None], other=0.0).to(dtype)
                    t_acc = tl.dot(at, tl.trans(xt), t_acc)
                tl.store(t_ws + pid_k * BLOCK_R * BLOCK_M, t_acc)
                tl.debug_barrier()
                tl.atomic_add(tcnt_ptr + 2 * pid_m, 1, sem="release", scope="gpu")
    for k0 in range(k_lo, k_hi, 256):
        w = _mma_tile(tl.load(w_tile + 2 * k0), _scale_words(tl.load(s_tile + _scale_k_offset(k0)), FAST), sfac, FAST,
                      dtype)  # fmt: skip
        xt = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(xt), acc)
        if HAS_LORA and not SHARED_T:
            at = tl.load(a_rows + (k0 + offs_k)[None, :], mask=r_mask[:, None], other=0.0).to(dtype)
            t_acc = tl.dot(at, tl.trans(xt), t_acc)
    acc = tl.trans(acc)  # [BLOCK_M, 64]
    if FAST:
        acc = acc * sfac
    if HAS_LORA and not SHARED_T:
        acc = _lora_epilogue(acc, t_acc, lb_ptr, offs_n, offs_r, r_mask, R, lora_scale, dtype)
    n_mask = offs_n < N
    _store_output(acc, y_ptr, b_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, pid_k, HAS_BIAS, USE_WS)
    if FUSED_REDUCE:
        # Every thread's partial must be in L2 before the ticket is taken (one thread does the atomic, acq_rel).
        tl.debug_barrier()
        counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            mask = m_mask[:, None] & n_mask[None, :]
            ws = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            total = tl.zeros((BLOCK_M, 64), dtype=tl.float32)
            for s in range(0, SPLIT):  # split order: the same sum whichever program arrived last
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if SHARED_T:
                ready = tcnt_ptr + 2 * pid_m
                n_ready = tl.atomic_add(ready, 0, sem="acquire", scope="gpu")
                while n_ready < SPLIT:
                    n_ready = tl.atomic_add(ready, 0, sem="acquire", scope="gpu")
                t = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
                for s in range(0, SPLIT):
                    t += tl.load(t_ws + s * BLOCK_R * BLOCK_M, cache_modifier=".cg")
                total = _lora_epilogue(total, t, lb_ptr, offs_n, offs_r, r_mask, R, lora_scale, dtype)
            _store_output(total, out_ptr, b_ptr, offs_m, offs_n, m_mask, n_mask, M, N, N, 0, HAS_BIAS, False)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            if SHARED_T:  # the last reader of t resets its counters for the next launch
                if tl.atomic_add(tcnt_ptr + 2 * pid_m + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
                    tl.atomic_xchg(tcnt_ptr + 2 * pid_m, 0, sem="relaxed", scope="gpu")
                    tl.atomic_xchg(tcnt_ptr + 2 * pid_m + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _linear_kernel(
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
    EVEN_K: tl.constexpr,
    SWAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FAST: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    a_ptr=None,
    lb_ptr=None,
    lora_scale=1.0,
    R=0,
    HAS_LORA: tl.constexpr = False,
    BLOCK_R: tl.constexpr = 16,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``y`` over the K range of split ``program_id(1)``.

    x ``[M, K]`` (row stride ``stride_xm``), packed ``[N, K/2]``, scale ``[N, K/16]``, global ``[1]``, bias ``[N]``.
    ``USE_WS`` False: writes ``y[M, N]`` in x's dtype (bias added). True (split-K): writes fp32 partials to
    ``y_ptr`` viewed as ``[split, M, N]`` (contiguous, ``stride_ym == N``).
    ``HAS_LORA`` (``SWAP`` only): also adds ``lora_scale · (x · Aᵀ) · Bᵀ`` with A ``[R, K]`` (``a_ptr``) and B
    ``[N, R]`` (``lb_ptr``), contiguous: ``t = A · xᵀ`` (``[BLOCK_R, BLOCK_M]``) is accumulated in the same K loop
    from the activation tile already in registers, and ``B_tile · t`` is added once at the end. Under split-K each
    split adds ``B · t_split``, which sums to the same product (it is linear in ``t``).
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_tile(pid, num_m, num_n, GROUP_M)  # the programs sharing a weight tile back to back

    dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Clamp rows instead of masking the weight loads along N: loads stay unpredicated and vectorised.
    rows = tl.minimum(offs_n, N - 1)

    half_k = K // 2
    nblk = K // 16
    sfac, post = _scale_fold(g_ptr, FAST)

    w_rows = w_ptr + rows[:, None].to(tl.int64) * half_k
    s_rows = s_ptr + rows[:, None].to(tl.int64) * nblk
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm

    k_lo = pid_k * K_PER_SPLIT
    k_hi = min(k_lo + K_PER_SPLIT, K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        offs_r, r_mask, a_rows, t_acc = _lora_init(a_ptr, K, R, BLOCK_R, BLOCK_M)
    if PREFETCH:  # (EVEN_K only) registers hold the next step's tiles while this step computes
        pn = tl.load(w_rows + (k_lo // 2 + offs_kb)[None, :])
        sn = tl.load(s_rows + (k_lo // 16 + offs_ks)[None, :])
        xn = tl.load(x_rows + (k_lo + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kb = k0 // 2 + offs_kb
        ks = k0 // 16 + offs_ks
        kk = k0 + offs_k
        if PREFETCH:
            p, s, xt = pn, sn, xn
            kn = tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K)
            pn = tl.load(w_rows + (kn // 2 + offs_kb)[None, :])
            sn = tl.load(s_rows + (kn // 16 + offs_ks)[None, :])
            xn = tl.load(x_rows + (kn + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        elif EVEN_K:
            p = tl.load(w_rows + kb[None, :])
            s = tl.load(s_rows + ks[None, :])
            xt = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
        else:
            p = tl.load(w_rows + kb[None, :], mask=kb[None, :] < half_k, other=0)
            s = tl.load(s_rows + ks[None, :], mask=ks[None, :] < nblk, other=0.0)
            xt = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K), other=0.0)
        if HAS_LORA:  # t += A · xᵀ on the activation tile in its natural column order
            a_mask = r_mask[:, None] if EVEN_K else r_mask[:, None] & (kk[None, :] < K)
            at = tl.load(a_rows + kk[None, :], mask=a_mask, other=0.0).to(dtype)
            t_acc = tl.dot(at, tl.trans(xt), t_acc)
        w = _dequant_tile(p, s, sfac, BLOCK_N, BLOCK_K, dtype, FAST, PERMUTED=FAST)
        if FAST:  # same column order as w (see _perm_k), shuffled in registers after a contiguous load
            xt = tl.reshape(tl.permute(tl.reshape(xt, (BLOCK_M, BLOCK_K // 8, 4, 2)), (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))
        if SWAP:
            acc = tl.dot(w, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if FAST:
        acc = acc * post
    if HAS_LORA:
        acc = _lora_epilogue(acc, t_acc, lb_ptr, rows, offs_r, r_mask, R, lora_scale, dtype)
    _store_output(acc, y_ptr, b_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, pid_k, HAS_BIAS, USE_WS)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, MN, N, SPLIT_K, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``y[M, N] = sum_s ws[s, M, N] (+ bias[N])`` cast to y's dtype (y contiguous)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(
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
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FAST: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):
    """Small-M path (decode): ``y[:M, n-tile] = x · Wᵀ`` on the CUDA cores, no tensor cores, no shared memory.

    All ``M ≤ BLOCK_M`` rows of x are handled by every program (``BLOCK_M`` = next power of two of M). The weight
    tile ``[BLOCK_N, BLOCK_K/2]`` bytes is loaded with 16-byte vectors (K contiguous) and decoded in registers into
    the even-k (low nibble) and odd-k (high nibble) halves; x is loaded as ``[BLOCK_M, BLOCK_K/2, 2]`` and split the
    same way, so no interleave/shuffle of the weight is needed. Products are accumulated in fp32 and reduced over K
    once per step (in-thread adds, then a few lane shuffles). Split-K as in :func:`_linear_kernel` (fp32 workspace +
    :func:`_splitk_reduce_kernel`).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)
    offs_s = tl.arange(0, BLOCK_K // 16)
    offs_2 = tl.arange(0, 2)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1)
    half_k = K // 2
    nblk = K // 16
    sfac, post = _scale_fold(g_ptr, FAST)

    w_rows = w_ptr + rows[:, None].to(tl.int64) * half_k
    s_rows = s_ptr + rows[:, None].to(tl.int64) * nblk
    x_rows = x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm
    xk = 2 * offs_j[None, :, None] + offs_2[None, None, :]  # [1, BK/2, 2]

    k_lo = pid_k * K_PER_SPLIT
    k_hi = min(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:  # (EVEN_K only) registers hold the next step's tiles while this step computes
        pn = tl.load(w_rows + (k_lo // 2 + offs_j)[None, :])
        sn = tl.load(s_rows + (k_lo // 16 + offs_s)[None, :])
        xn = tl.load(x_rows + (k_lo + xk), mask=m_mask[:, None, None], other=0.0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        jb = k0 // 2 + offs_j
        sb = k0 // 16 + offs_s
        if PREFETCH:
            p, s, xx = pn, sn, xn
            kn = tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K)  # the last step re-reads its own tile (never used)
            pn = tl.load(w_rows + (kn // 2 + offs_j)[None, :])
            sn = tl.load(s_rows + (kn // 16 + offs_s)[None, :])
            xn = tl.load(x_rows + (kn + xk), mask=m_mask[:, None, None], other=0.0)
        elif EVEN_K:
            p = tl.load(w_rows + jb[None, :])
            s = tl.load(s_rows + sb[None, :])
            xx = tl.load(x_rows + (k0 + xk), mask=m_mask[:, None, None], other=0.0)
        else:
            p = tl.load(w_rows + jb[None, :], mask=jb[None, :] < half_k, other=0)
            s = tl.load(s_rows + sb[None, :], mask=sb[None, :] < nblk, other=0.0)
            xx = tl.load(x_rows + (k0 + xk), mask=m_mask[:, None, None] & (k0 + xk < K), other=0.0)
        xe, xo = tl.split(xx.to(tl.float32))  # [BM, BK/2]: inputs 2j and 2j+1
        if FAST:
            sc = (s.to(tl.float32) * sfac).to(tl.bfloat16)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)), (BLOCK_N, BLOCK_K // 2))
            lo, hi = _dequant_tile_bf16_asm(p, sc)
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        else:
            sc = s.to(tl.float32) * sfac
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)), (BLOCK_N, BLOCK_K // 2))
            lo = _e2m1_to_f32(p & 0xF) * sc
            hi = _e2m1_to_f32(p >> 4) * sc
        prod = lo[None, :, :] * xe[:, None, :] + hi[None, :, :] * xo[:, None, :]
        acc += tl.sum(prod, axis=2)
    acc = acc * post
    _store_output(acc, y_ptr, b_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, pid_k, HAS_BIAS, USE_WS)
