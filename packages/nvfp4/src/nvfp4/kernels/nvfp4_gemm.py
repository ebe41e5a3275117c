"""Triton W4A16 NVFP4 GEMMs for Hopper: ``y = x · dequant(W)ᵀ (+ b)`` and ``dx = dy · dequant(W)``.

Weight layouts (what the kernels read)
======================================

**Compressed-tensors layout** (checkpoints, CPU, shapes that are not whole tiles, ``NVFP4_MMA_LAYOUT=0``):

* ``packed`` uint8 ``[N, K/2]``, row-major, K contiguous: byte ``j`` of row ``n`` holds ``W[n, 2j]`` in its low
  nibble and ``W[n, 2j+1]`` in its high nibble. A code is ``sign << 3 | e << 1 | m`` (E2M1).
* ``scale`` float8_e4m3fn ``[N, K/16]``: one scale per 16 consecutive inputs (8 bytes of ``packed``).
* ``global_scale`` float32 ``[1]``, a divisor.

Read by ``_linear_kernel`` / ``_gemv_kernel`` / ``_dgrad_kernel`` / ``_dequant_kernel``: a ``[BLOCK_N, BLOCK_K]``
tile is ``BLOCK_N`` rows of ``BLOCK_K/2`` contiguous bytes, coalesced 16-byte loads; but the decoded tile is in the
wrong registers for the tensor cores and goes through shared memory (``local_alloc`` + ``ldmatrix``, 2 bytes of
shared-memory traffic per weight each way) before every ``wgmma``.

**MMA layout** (:mod:`nvfp4.layout`; what ``NVFP4Linear`` holds on CUDA when ``N % 64 == 0``, ``K % 256 == 0`` and
every block scale is positive and finite): the same bytes permuted to ``[N/4, 2K]`` in 64 × 256 tiles, each stored
as 16 rows of 512 bytes, with the bits of every 32-bit word permuted for the decoder below. Loaded with 16
bytes per thread (32 threads per row, one warp per row), thread ``lane`` of warp ``w`` holds output rows
``16w + 8·i + lane // 4`` (``i`` = 0, 1) and bytes ``≡ lane % 4``: exactly the A fragment of a bf16 ``m64k16``
``wgmma`` for all 16 K-steps of the tile. The decoded tile is relabelled to ``[64, 256]`` by a
reshape/permute that Triton lowers to nothing (:func:`_mma_tile`), so ``_linear_mma_kernel`` feeds ``wgmma`` from
registers with no shared-memory round trip. Scales stay in the compressed-tensors layout and are read as int32
words (4 scales each): loaded as fp8 bytes they compiled to byte loads that Triton cannot route through ``cp.async``,
so the scale load stayed synchronous in every K step. With ``num_stages`` 2-3, Triton pipelines the weight tile, its
scales and the activation tile with ``cp.async`` (checked in the SASS: ``LDGSTS`` for all three).

Dequantization in registers (never in HBM)
==========================================

Three decoders. **MMA layout, bf16 activations on the GPU** (the decode-size hot path, :func:`_mma_tile`): per 32-bit
word of codes (8 weights, the four A-fragment registers of one K-step) 9 integer instructions place
``e2m1 · 2^-126`` in four bf16x2 registers (:func:`_e2m1_words_bf16`, the word's bit permutation does the rest); per
word of 4 FP8 scales, two ``cvt.f16x2.e4m3x2``, a shift and an OR put ``s · 2^112`` into bf16 bits
(:func:`_scale_words_bf16x2`); one ``mul.bf16x2`` per two weights gives ``e2m1 · s · 2^-14``, exact in bf16, and
the fp32 accumulator is multiplied once by ``2^14 / global``. The main loop at ``BLOCK_M`` = 16 has 519 SASS
instructions per warp per K step (739 with the byte-level decoder before it; ``benchmarks/kernel_sass.py``).
**Compressed-tensors layout, bf16 on the GPU**: inline PTX, ~4 SASS instructions per weight in the
main loop, see :func:`_dequant_tile_bf16_asm` and :func:`_scale_fold` (E2M1 placed in bf16 as ``e2m1 · 2^-126``, one
``mul.bf16x2`` by the block scale pre-folded as ``fp8 · 2^126 / global``; the decoded columns keep the PTX register
order and the activation tile is permuted to match, :func:`_perm_k`). **Portable** (fp16 activations, the fused
dgrad, the standalone dequantizer, and the Triton interpreter; on the MMA layout the same rotations first,
:func:`_e2m1_words_f16`): E2M1 → fp16 by bit placement: the 3 magnitude bits ``e m`` of a code go to fp16 bits 11..9 (the two lowest
exponent bits and the top mantissa bit) and the sign to bit 15. Read as fp16, that is ``2^(e-15)·(1+m/2)`` for
``e > 0`` and the subnormal ``m·2^-15`` for ``e = 0``: exactly ``e2m1(code) · 2^-14`` in both cases. The ``2^14``
and the global divisor are folded into the per-block scale, ``s = fp8_scale · (2^14 / global)`` (fp32, computed
in the kernel from the ``[1]`` tensor, so nothing syncs with the host). A weight then costs two shifts, one
``lop3``, one ``cvt.f32.f16``, one fp32 multiply and half a ``cvt.bf16x2.f32``. The dequantized value is the
codec's (:func:`nvfp4.codec.dequantize`: fp32 product rounded once to the activation dtype) up to the one fp32
rounding of ``fp8 · (2^14/global)`` versus ``fp8 / global``, far below the bf16/fp16 rounding of the result.

Kernels
=======

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

``_dgrad_kernel``: ``dx[M, K] = dy[M, N] · W[N, K]``; the weight tile ``[BLOCK_N, BLOCK_K]`` is read row-wise
exactly as above and is already the ``[reduction, output]`` operand B (portable decode: Triton 3.6 fails to compile
the PTX decode feeding operand B).

``_dequant_kernel``: writes ``dequant(W)`` in the activation dtype; used for the large-M fallback
(dequantize once, then cuBLAS), where the GEMM is compute-bound and the extra 2 bytes/weight are amortised.

Everything is launched from plain Python with static shapes, no host sync and no data-dependent allocation,
so the custom ops in :mod:`nvfp4.ops` are safe under ``torch.compile`` and CUDA-graph capture.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..layout import is_mma_layout
from . import dispatch_table

__all__ = [
    "DgradConfig",
    "LinearConfig",
    "dequantize_triton",
    "dgrad_config",
    "linear_config",
    "mma_config",
    "nvfp4_linear",
    "nvfp4_linear_dgrad",
    "nvfp4_lora_linear",
]

# Tests set this to allocate every output with NaN, so an element the kernels never write cannot pass.
POISON_OUTPUTS = False


def _large_m_runs(dtype: torch.dtype) -> bool:
    """The large-M kernel is built for the bf16 decode; with fp16 on a GPU its portable decode needs more shared
    memory than sm_90 has for the swept tiles (H100: 289 KB asked), so fp16 takes dequantize + cuBLAS there. The
    Triton interpreter runs it in fp16/fp32 (CPU tests)."""
    return dtype == torch.bfloat16 or os.environ.get("TRITON_INTERPRET") == "1"


def _fast(dtype: torch.dtype) -> bool:
    """Use the PTX bf16 decode (bf16 activations on a real GPU; the interpreter cannot run inline PTX)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1"


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _e2m1_f16_bits(codes):
    """E2M1 codes (uint8 in [0, 16)) → fp16 ``e2m1(code) · 2^-14``, exact, by bit placement (see module doc)."""
    c = codes.to(tl.uint16)
    return (((c << 12) & 0x8000) | ((c << 9) & 0x0E00)).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_to_f32(codes):
    """E2M1 codes → fp32 ``e2m1(code) · 2^-14`` (the portable decode)."""
    return _e2m1_f16_bits(codes).to(tl.float32)


@triton.jit
def _dequant_tile_bf16_asm(packed, sb):
    """Fast bf16 decode (sm_90 PTX): ``packed`` uint8 [R, BK/2], ``sb`` bf16 [R, BK/2] (the folded block scale of
    each byte, ``fp8 · F / global`` rounded to bf16) → (low-nibble values, high-nibble values), two bf16 [R, BK/2]
    tensors holding ``w · F · 2^-126``.

    Per 4 bytes: two ``prmt`` move byte i to bits 8-15 / 24-31 of a word, so that the high nibbles of two bytes sit
    at bits 12-15 and 28-31 and ``(w & 0x80008000) | ((w >> 6) & 0x01C001C0)`` is a bf16x2 holding
    ``e2m1 · 2^-126`` (sign, 2 exponent bits, 1 mantissa bit; ``e = 0`` lands on the exact bf16 subnormal); the low
    nibbles take a ``<< 4`` first (:func:`_e2m1_bf16_bits`). One ``mul.bf16x2`` by the folded scale finishes two
    weights: about 2.5 instructions per weight instead of ~11 for the portable path.
    """
    lo, hi = _e2m1_bf16_bits(packed)
    return _mul_bf16x2(lo, sb), _mul_bf16x2(hi, sb)


@triton.jit
def _dequant_tile(
    packed,
    scale,
    sfac,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    FAST: tl.constexpr,
    PERMUTED: tl.constexpr = False,
):
    """``packed`` uint8 [R, BK/2] + ``scale`` fp8 [R, BK/16] → [R, BK] ``OUT_DTYPE`` (CT element order).

    ``PERMUTED`` (fast path only): the columns come out in the order :func:`_perm_k` (saves one ``prmt`` per two
    weights; the caller permutes the activation tile the same way, which leaves the dot product unchanged).
    ``sfac`` comes from :func:`_scale_fold`. ``FAST`` (bf16 on a GPU): PTX decode (:func:`_dequant_tile_bf16_asm`),
    the tile holds ``W · F · 2^-126`` and the caller multiplies its fp32 accumulator by ``post``. Otherwise the
    portable path (also what the Triton interpreter runs): fp16 bit placement, fp32 multiply by
    ``fp8 · 2^14 / global``, one rounding to ``OUT_DTYPE``; the tile holds ``W``.
    """
    if FAST:
        sb = (scale.to(tl.float32) * sfac).to(tl.bfloat16)  # [R, BK/16]
        sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_ROWS, BLOCK_K // 16, 8)), (BLOCK_ROWS, BLOCK_K // 2))
        lo, hi = _dequant_tile_bf16_asm(packed, sb)
        if PERMUTED:
            # Keep the registers as the PTX wrote them: column c of the tile is input k = _perm_k(c).
            w = tl.join(tl.reshape(lo, (BLOCK_ROWS, BLOCK_K // 8, 4)), tl.reshape(hi, (BLOCK_ROWS, BLOCK_K // 8, 4)))
            return tl.reshape(tl.permute(w, (0, 1, 3, 2)), (BLOCK_ROWS, BLOCK_K))
        return tl.reshape(tl.join(lo, hi), (BLOCK_ROWS, BLOCK_K))
    else:
        lo = _e2m1_to_f32(packed & 0xF)
        hi = _e2m1_to_f32(packed >> 4)
        w = tl.interleave(lo, hi)  # [R, BK]: element 2j from the low nibble, 2j+1 from the high one
        s = scale.to(tl.float32) * sfac  # [R, BK/16]
        w = tl.reshape(w, (BLOCK_ROWS, BLOCK_K // 16, 16)) * s[:, :, None]
        return tl.reshape(w, (BLOCK_ROWS, BLOCK_K)).to(OUT_DTYPE)


@triton.jit
def _perm_k(c):
    """Input index of tile column ``c`` in the permuted fast layout: within each group of 8 inputs (4 bytes), the
    columns hold k = 0, 2, 4, 6 (low nibbles) then 1, 3, 5, 7 (high nibbles)."""
    return (c // 8) * 8 + (c % 4) * 2 + (c // 4) % 2


@triton.jit
def _pow2(e):
    """``2^e`` for an integer-valued fp32 ``e`` in [-126, 127], exactly (built from the exponent bits)."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_fold(g_ptr, FAST: tl.constexpr):
    """(sfac, post) for :func:`_dequant_tile` from the global scale ``g`` (a divisor).

    Portable: ``sfac = 2^14 / g``, ``post = 1``. Fast: the decoded E2M1 values carry ``2^-126``, so the bf16 block
    scale must carry ``F = 2^126``; if the largest block scale ``448 / g`` times ``2^126`` would overflow bf16
    (``amax(W) > 24``), ``F`` is lowered to ``2^126 / (448/g)`` rounded down to a power of two and the fp32
    accumulator is multiplied back by ``post = 2^126 / F`` (exact).
    """
    g = tl.load(g_ptr)
    if FAST:
        log_f = tl.minimum(126.0, tl.floor(126.0 - tl.log2(448.0 / g)))
        log_f = tl.maximum(log_f, -100.0)
        return _pow2(log_f) / g, _pow2(126.0 - log_f)
    else:
        return 16384.0 / g, 1.0


@triton.jit
def _store_output(acc, y_ptr, b_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, pid_k,
                  HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr):  # fmt: skip
    """Epilogue of the forward kernels: fp32 ``acc [BLOCK_M, BLOCK_N]`` → ``y`` in its dtype (bias added), or with
    ``USE_WS`` (split-K) the fp32 partial into the ``[split, M, N]`` workspace at ``y_ptr``."""
    mask = m_mask[:, None] & n_mask[None, :]
    if not USE_WS:
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _lora_init(a_ptr, K, R, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """Fused LoRA, before the K loop: rank offsets and mask, row pointers of A ``[R, K]``, and ``t = 0``
    (``[BLOCK_R, BLOCK_M]`` fp32, accumulates ``A · xᵀ``)."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_rows = a_ptr + offs_r[:, None].to(tl.int64) * K
    return offs_r, r_mask, a_rows, tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)


@triton.jit
def _lora_epilogue(acc, t_acc, lb_ptr, rows, offs_r, r_mask, R, lora_scale, DTYPE: tl.constexpr):
    """Fused LoRA, after the K loop: ``acc + lora_scale · tᵀ · B[rows]ᵀ`` with B ``[N, R]``; ``t`` is rounded to the
    activation dtype first, as PEFT's ``lora_A`` output is."""
    lb = tl.load(lb_ptr + rows[:, None].to(tl.int64) * R + offs_r[None, :], mask=r_mask[None, :], other=0.0)
    return acc + lora_scale * tl.dot(tl.trans(t_acc.to(DTYPE)), tl.trans(lb.to(DTYPE)))


# ----------------------------------------------------------------------------------------------------------------
# MMA layout (nvfp4.layout): one 64 x 256 tile of W loads straight into the wgmma A-operand registers
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _bf16x2_pairs_from_word(packed, ASM: tl.constexpr):
    """Run the PTX ``ASM`` on every 4 uint8 of ``packed`` (one 32-bit ``$4``) writing 4 registers ``$0..$3``: two bf16
    tensors of ``packed``'s shape, the first from ``$0, $1``, the second from ``$2, $3``."""
    return tl.inline_asm_elementwise(
        ASM, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
    )


@triton.jit
def _e2m1_bf16_bits(packed):
    """uint8 → (low-nibble, high-nibble) bf16 holding ``e2m1 · 2^-126`` (the bit placement of
    :func:`_dequant_tile_bf16_asm`, without the scale multiply): 2.5 instructions per two weights."""
    return _bf16x2_pairs_from_word(
        packed,
        """
        {
        .reg .b32 t0, t1, a, b;
        prmt.b32 t0, $4, 0, 0x1404;
        prmt.b32 t1, $4, 0, 0x3424;
        shl.b32 a, t0, 4;
        shr.b32 b, t0, 2;
        and.b32 a, a, 0x80008000;
        and.b32 b, b, 0x01C001C0;
        or.b32 $0, a, b;
        shl.b32 a, t1, 4;
        shr.b32 b, t1, 2;
        and.b32 a, a, 0x80008000;
        and.b32 b, b, 0x01C001C0;
        or.b32 $1, a, b;
        shr.b32 b, t0, 6;
        and.b32 a, t0, 0x80008000;
        and.b32 b, b, 0x01C001C0;
        or.b32 $2, a, b;
        shr.b32 b, t1, 6;
        and.b32 a, t1, 0x80008000;
        and.b32 b, b, 0x01C001C0;
        or.b32 $3, a, b;
        }
        """,
    )


@triton.jit
def _e2m1_words_bf16(packed):
    """uint8 MMA-layout tile (bit-permuted words, :mod:`nvfp4.layout`) → two bf16 tensors of its shape holding
    ``e2m1 · 2^-126``: per word (4 elements), ``a`` = (byte 0 low nibble, byte 0 high, byte 1 low, byte 1 high) and
    ``b`` = the same for bytes 2 and 3, i.e. each 32-bit register is one bf16x2 ``wgmma`` A-fragment register.

    9 instructions per word (8 weights): register ``j`` is ``rotr(q, t_j) & 0x81C081C0`` (sign at bit 15, ``e1 e0 m``
    at bits 8..6 of each half; ``e = 0`` lands on the exact bf16 subnormal), the last one takes two rotations.
    """
    return _bf16x2_pairs_from_word(
        packed,
        """
        {
        .reg .b32 r, t;
        and.b32 $0, $4, 0x81C081C0;
        shf.r.wrap.b32 r, $4, $4, 4;
        and.b32 $1, r, 0x81C081C0;
        shf.r.wrap.b32 r, $4, $4, 10;
        and.b32 $2, r, 0x81C081C0;
        shf.r.wrap.b32 r, $4, $4, 30;
        shf.r.wrap.b32 t, $4, $4, 6;
        and.b32 r, r, 0x80C080C0;
        and.b32 t, t, 0x01000100;
        or.b32 $3, r, t;
        }
        """,
    )


@triton.jit
def _f16_halves(v):
    """uint32 bf16x2-placed E2M1 pairs → fp16 ``[..., 2]`` (low half, high half) holding ``e2m1 · 2^-14``."""
    f = (v & 0x80008000) | ((v << 3) & 0x0E000E00)  # e1 e0 m from bits 8..6 to fp16's 11..9
    lo = (f & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (f >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _e2m1_words_f16(packed):
    """The portable twin of :func:`_e2m1_words_bf16` (no PTX; what the Triton interpreter runs): the same rotations
    on uint32 words, each half moved to fp16's bit placement (``e2m1 · 2^-14``, as :func:`_e2m1_f16_bits`), and the
    tile relabelled to ``[R, C, 2]`` (byte, nibble) fp16."""
    R: tl.constexpr = packed.shape[0]
    C: tl.constexpr = packed.shape[1]
    lo_c, hi_c = tl.split(tl.reshape(packed, (R, C // 4, 2, 2)).to(tl.uint32))  # byte 4q + 2·i1 + i0: split on i0
    b0, b2 = tl.split(lo_c)
    b1, b3 = tl.split(hi_c)
    q = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    r0 = q & 0x81C081C0
    r1 = ((q >> 4) | (q << 28)) & 0x81C081C0
    r2 = ((q >> 10) | (q << 22)) & 0x81C081C0
    r3 = (((q >> 30) | (q << 2)) & 0x80C080C0) | (((q >> 6) | (q << 26)) & 0x01000100)
    # [R, C/4, 2 (nibble), 2 (j0), 2 (j1)] → (word, j1, j0, nibble) → [R, C, 2]: byte 4·word + j, nibble
    w = tl.join(tl.join(_f16_halves(r0), _f16_halves(r1)), tl.join(_f16_halves(r2), _f16_halves(r3)))
    return tl.reshape(tl.permute(w, (0, 1, 4, 3, 2)), (R, C, 2))


@triton.jit
def _scale_words_bf16x2(words):
    """int32 words of 4 FP8 block scales (little-endian) → four int32 tensors: scale ``j`` as bf16x2 bits holding
    ``s · 2^112`` in both halves, for :func:`_mul_bf16x2_bits`.

    ``cvt`` turns two FP8 scales into fp16 exactly (subnormals included); shifted right by 3, an fp16 ``s`` has its
    exponent and mantissa in bf16's places with exponent bias 15 instead of 127, and OR-ing 224 into the exponent
    field (free of carries: fp16 exponents stay below 32) makes it ``s · 2^112``. Times ``e2m1 · 2^-126`` that is
    ``e2m1 · s · 2^-14``, exact in bf16. Valid for positive finite scales only
    (:func:`nvfp4.layout.mma_scales_supported`). 2.5 instructions per scale, its ``prmt`` broadcast included (the
    multiply's operand selector could broadcast instead, but splitting the tile by block parity to use it costs more
    ``prmt`` than it saves: checked in the SASS).
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b16 l, h;
        .reg .b32 f, g;
        mov.b32 {l, h}, $4;
        cvt.rn.f16x2.e4m3x2 f, l;
        cvt.rn.f16x2.e4m3x2 g, h;
        shr.b32 f, f, 3;
        shr.b32 g, g, 3;
        and.b32 f, f, 0x0FFF0FFF;
        and.b32 g, g, 0x0FFF0FFF;
        or.b32 f, f, 0x70007000;
        or.b32 g, g, 0x70007000;
        prmt.b32 $0, f, 0, 0x1010;
        prmt.b32 $1, f, 0, 0x3232;
        prmt.b32 $2, g, 0, 0x1010;
        prmt.b32 $3, g, 0, 0x3232;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[words],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _mul_bf16x2(a, b):
    """``a · b`` in bf16 with one ``mul.rn.bf16x2`` per two elements (Triton would round-trip through fp32)."""
    return tl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.bfloat16, is_pure=True, pack=2
    )


@triton.jit
def _mul_bf16x2_bits(a, bits):
    """``a · b`` for bf16 ``a`` and int32 ``bits`` holding ``b`` as bf16x2 (equal in adjacent elements): one
    ``mul.rn.bf16x2`` per two elements of ``a`` (the second register of ``bits`` is not read)."""
    return tl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r,r", [a, bits], dtype=tl.bfloat16, is_pure=True, pack=2
    )


@triton.jit
def _mma_tiles(p, s, sfac, TILES: tl.constexpr, QUARTERS: tl.constexpr, FAST: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """``TILES`` MMA-layout tiles (stacked along N), ``QUARTERS`` K quarters of each → ``W[64·TILES, 64·QUARTERS]`` in
    ``OUT_DTYPE``, in the registers of the ``wgmma`` A operand.

    ``p``: uint8 ``[4·QUARTERS·TILES, 512]``, the stored rows ``(quarter, tile, warp)`` in that order (quarter
    outermost), i.e. for each K quarter ``q`` and tile ``t`` the 4 rows ``t·16 + 4·q .. + 3`` of :mod:`nvfp4.layout`
    (row ``r = (b6 b5 | n5 n4)``: a quarter of a tile is 4 consecutive rows, one per warp of a warpgroup). With 16
    bytes per thread and one warp per row, row ``i`` goes to warp ``i % num_warps``: the A rows ``64t + 16w + …`` of
    the ``wgmma`` accumulator layout of ``num_warps`` warps (4 or 8) stacked along N. ``s``: int32
    ``[64·TILES, QUARTERS]`` (the 4 fp8 block scales of each row and quarter, read as words so that the load
    vectorizes and pipelines). The reshapes / permutes below only relabel registers: Triton lowers them to nothing,
    because the layout of a 16-byte-per-thread load of ``p`` already is the ``wgmma`` operand layout after them.
    ``FAST`` (bf16 on a GPU): PTX decode of codes and scales with integer instructions and one ``mul.bf16x2`` per two
    weights, exact: the tile holds ``e2m1 · s · 2^-14`` (the caller multiplies its fp32 accumulator by
    ``2^14 / global``; ``sfac`` is unused). Otherwise fp16 bit placement, fp32 multiply by ``s · sfac``
    (``sfac = 2^14 / global``), one rounding: the codec's value.
    """
    ROWS: tl.constexpr = 4 * QUARTERS * TILES
    if FAST:
        a, b = _e2m1_words_bf16(p)
        # word, i1, i0, (a|b): byte 4·word + 2·(a|b) + i1, nibble i0
        w = tl.reshape(tl.join(a, b), (ROWS, 128, 2, 2, 2))
        w = tl.reshape(tl.permute(w, (0, 1, 4, 2, 3)), (ROWS, 512, 2))  # [rows, 512, 2]: (byte, nibble)
    else:
        w = _e2m1_words_f16(p)
    w = tl.reshape(w, (QUARTERS, TILES, 4, 8, 4, 8, 2, 2))  # q, t, n54 | n210, b10, b432, n3 | k0
    w = tl.permute(w, (1, 2, 6, 3, 0, 5, 4, 7))  # t, n54, n3, n210 | q, b432, b10, k0
    w = tl.reshape(w, (64 * TILES, 64 * QUARTERS))
    if FAST:
        s0, s1, s2, s3 = _scale_words_bf16x2(s)  # [64T, Q] int32 each: scale 4·word + j
        sb = tl.reshape(tl.permute(tl.join(tl.join(s0, s1), tl.join(s2, s3)), (0, 1, 3, 2)), (64 * TILES, 4 * QUARTERS))
        sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (64 * TILES, 4 * QUARTERS, 16)), (64 * TILES, 64 * QUARTERS))
        return _mul_bf16x2_bits(w, sb)
    else:
        s = (s[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 0xFF  # little-endian bytes of each word
        sf = tl.reshape(s.to(tl.uint8).to(tl.float8e4nv, bitcast=True), (64 * TILES, 4 * QUARTERS)).to(tl.float32)
        sf = sf * sfac
        sb = tl.reshape(tl.broadcast_to(sf[:, :, None], (64 * TILES, 4 * QUARTERS, 16)), (64 * TILES, 64 * QUARTERS))
        return (w.to(tl.float32) * sb).to(OUT_DTYPE)


@triton.jit
def _mma_tile(p, s, sfac, FAST: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """One whole MMA-layout tile → ``W[64, 256]`` (:func:`_mma_tiles` with one tile and its 4 K quarters): ``p``
    uint8 ``[16, 512]`` (the tile's rows as stored), ``s`` int32 ``[64, 4]``."""
    return _mma_tiles(p, s, sfac, 1, 4, FAST, OUT_DTYPE)


@triton.jit
def _mma_tile_ptrs(w_ptr, s_ptr, tile_n, K):
    """Pointers to MMA-layout tile row ``tile_n`` at K step 0: packed ``[16, 512]`` (add ``2·k0`` for step ``k0``)
    and scales as int32 ``[64, 4]`` (add ``k0 // 64``). ``K % 256 == 0``."""
    r = tl.arange(0, 16)
    c = tl.arange(0, 512)
    w_tile = w_ptr + (tile_n * 16 + r[:, None]).to(tl.int64) * (2 * K) + c[None, :]
    words = tl.multiple_of(K // 64, 4)  # int32 words per scale row
    sn = tl.arange(0, 64)
    sk = tl.arange(0, 4)
    s_tile = s_ptr.to(tl.pointer_type(tl.int32)) + (tile_n * 64 + sn[:, None]).to(tl.int64) * words + sk[None, :]
    return w_tile, s_tile


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
    :func:`_linear_kernel`.

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
        w = _mma_tile(tl.load(w_tile + 2 * k0), tl.load(s_tile + k0 // 64), sfac, FAST, dtype)
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
def _dequant_mma_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K):
    """``out[N, K] = dequant(W)`` (out's dtype, contiguous) for W in the MMA layout; one 64 × 256 tile per program."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    sfac, post = _scale_fold(g_ptr, False)
    w_tile, s_tile = _mma_tile_ptrs(w_ptr, s_ptr, pid_n, K)
    k0 = pid_k * 256
    w = _mma_tile(tl.load(w_tile + 2 * k0), tl.load(s_tile + k0 // 64), sfac, False, out_ptr.dtype.element_ty)
    rows = pid_n * 64 + tl.arange(0, 64)
    cols = k0 + tl.arange(0, 256)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], w)


# ----------------------------------------------------------------------------------------------------------------
# y = x · Wᵀ
# ----------------------------------------------------------------------------------------------------------------
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
    # Group GROUP_M m-tiles together: the programs sharing a weight column-tile run back to back.
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gsize = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize

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


# ----------------------------------------------------------------------------------------------------------------
# dx = dy · W
# ----------------------------------------------------------------------------------------------------------------
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
    group = GROUP_M * num_k
    first_m = (pid // group) * GROUP_M
    gsize = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_k = (pid % group) // gsize

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
    over N one 64-row tile of W at a time (portable decode, W is operand B)."""
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
    s_tile += k0 // 64
    acc = tl.zeros((BLOCK_M, 256), dtype=tl.float32)
    for t in range(0, N // 64):
        w = _mma_tile(tl.load(w_tile), tl.load(s_tile), sfac, False, dtype)
        w_tile += 32 * K  # next tile row: 16 rows of 2K bytes
        s_tile += K  # 64 rows of K/64 words
        g = tl.load(dy_ptr + offs_m[:, None].to(tl.int64) * stride_dym + (t * 64 + offs_n)[None, :],
                    mask=m_mask[:, None], other=0.0)  # fmt: skip
        acc = tl.dot(g, w, acc)
    tl.store(dx_ptr + offs_m[:, None].to(tl.int64) * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=m_mask[:, None])  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Dequantize (large-M fallback)
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# Configs (tuned on one H100 SXM, see docs/kernels.md)
# ----------------------------------------------------------------------------------------------------------------
_NUM_SMS = 132


@dataclass(frozen=True)
class LinearConfig:
    """Launch parameters of :func:`nvfp4_linear`. ``dequant=True`` selects dequantize-then-cuBLAS."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True
    group_m: int = 8
    dequant: bool = False
    gemv: bool = False  # CUDA-core GEMV kernel (_gemv_kernel); block_m is then taken from M
    prefetch: bool = False  # register double-buffering of the next K step (used only when K % block_k == 0)
    mma: bool = False  # _linear_mma_kernel, for weights in the MMA layout (block_n/block_k are then 64/256)
    fused_reduce: bool = True  # MMA kernel with split-K: the last program of a tile sums the partials (one launch)
    lora_shared_t: bool = True  # ... and with a fused LoRA, x·Aᵀ is computed once per split, not per tile (SHARED_T)
    large_m: bool = False  # large_m._linear_large_m_kernel (MMA layout; block_n = 64·tiles, block_k = 64·quarters)


@dataclass(frozen=True)
class DgradConfig:
    """Launch parameters of :func:`nvfp4_linear_dgrad`."""

    block_m: int = 128
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    dequant: bool = False
    mma: bool = False  # _dgrad_mma_kernel, for weights in the MMA layout (block_n/block_k are then 64/256)


def _pick_split(tiles: int, k: int, block_k: int, target: int = 2 * _NUM_SMS, min_k: int = 512) -> int:
    """Number of K splits so that ``tiles · split`` reaches ``target`` programs, each with ≥ ``min_k`` inputs."""
    if tiles >= target:
        return 1
    split = max(1, min(target // max(tiles, 1), k // max(min_k, block_k)))
    return int(split)


# Compressed-tensors layout: largest M served by the fused kernel; above it, dequantize once and call cuBLAS
# (measured faster on the H100). The MMA layout's forms per M are in dispatch_table.
FUSED_MAX_M = 128
DGRAD_FUSED_MAX_M = 64
# CUDA-core GEMV kernel: used for M ≤ GEMV_MAX_M on weights with N ≤ GEMV_MAX_N (the k/v projections), where the
# 2026-11-22 sweep measured it faster than the tensor-core kernel (7B k/v at M=1: 6.2 µs vs 8.6 µs); on the larger
# weights, and from M=4 up, the tensor-core kernel was faster (the GEMV time grows ~linearly with M).
GEMV_MAX_M = 2
GEMV_MAX_N = 1024
GEMV_TILE = (16, 512)  # (BLOCK_N, BLOCK_K)
GEMV_WARPS = 4
GEMV_TARGET = 4 * _NUM_SMS  # split K until ~4 programs per SM
GEMV_MIN_K = 512
GEMV_PREFETCH = False  # register prefetch measured no faster for the GEMV
# Register prefetch in the tensor-core kernel: faster for small weights (N ≤ 1024) at M ≤ 16, slower on large ones.
TC_PREFETCH_MAX_N = 1024


# MMA-layout kernel: programs to aim for (split-K permitting, ≥ 2 K steps per split) and pipeline depth, per M range
# (2026-11-22 sweep on the H100, 7B/32B shapes: 3 stages and ~3.5 programs per SM at M ≤ 32, 2 stages above).
MMA_TARGET_PROGRAMS = {32: 480, 128: 240}
MMA_STAGES = {32: 3, 128: 2}
# Split-K summed in the MMA kernel up to this BLOCK_M (H100, same run: 0.5-1.3 µs faster per linear at M ≤ 16; at
# M = 64/128 the last program's serial sum of [BLOCK_M, 64] partials made it up to 13 µs slower).
FUSED_REDUCE_MAX_M = 32


# A fused LoRA's x·Aᵀ is shared by the tiles (SHARED_T) for weights of at least this many elements, or of at least
# LORA_SHARED_T_MIN_N_M32 rows from BLOCK_M = 32; smaller weights compute it beside every tile (H100, same run,
# gemm_lora_shared_t.json: 7B k at M = 1 6.7 µs per tile vs 8.6 shared, 7B q 11.1 vs 12.3; 32B q 19.9 vs 16.0, 7B
# gate 35.0 vs 26.5; 7B q at M = 32 19.6 vs 14.9).
LORA_SHARED_T_MIN_WEIGHTS = 1 << 24
LORA_SHARED_T_MIN_N_M32 = 2048


def mma_config(m: int, n: int, k: int) -> LinearConfig:
    """Config for a weight in the MMA layout (``n % 64 == 0``, ``k % 256 == 0``): the decode kernel
    (:func:`_linear_mma_kernel`) at M ≤ 16, above it the form :mod:`~nvfp4.kernels.dispatch_table` froze for
    ``(m, n, k)``: the decode kernel, the large-M kernel (:mod:`~nvfp4.kernels.large_m`) or dequantize + cuBLAS."""
    if m > 16:
        entry = dispatch_table.lookup(m, n, k)
        if entry == "dequant":
            return LinearConfig(dequant=True, mma=True)
        if entry != "decode":
            tiles, quarters, bm, warps, stages, split = entry
            return LinearConfig(bm, 64 * tiles, 64 * quarters, split, warps, stages, True, mma=True, large_m=True)
    return _decode_config(m, n, k)


def _decode_config(m: int, n: int, k: int) -> LinearConfig:
    """:func:`_linear_mma_kernel`'s config at M ≤ 128."""
    bound = 32 if m <= 32 else 128
    tiles, steps = n // 64, k // 256
    split = max(1, min(triton.cdiv(MMA_TARGET_PROGRAMS[bound], tiles), steps // 2))
    bm = max(16, triton.next_power_of_2(m))
    shared_t = n * k >= LORA_SHARED_T_MIN_WEIGHTS or (bm >= 32 and n >= LORA_SHARED_T_MIN_N_M32)
    return LinearConfig(bm, 64, 256, split, 4, MMA_STAGES[bound], True, mma=True, fused_reduce=bm <= FUSED_REDUCE_MAX_M,
                        lora_shared_t=shared_t)  # fmt: skip


def linear_config(m: int, n: int, k: int, mma: bool = False) -> LinearConfig:
    """Tile config for ``y[m, n] = x[m, k] · Wᵀ`` on sm_90, per M range (from ``benchmarks/gemm.py --sweep``).

    ``mma``: the weight is in the MMA layout (:func:`mma_config`). For the compressed-tensors layout, all fused
    configs use ``num_stages=1``: the weight tile goes straight from global memory to registers, which measured
    5-20 % faster than 2-3 stages at every M ≤ 128 for that kernel.
    """
    if mma:
        return mma_config(m, n, k)
    if m > FUSED_MAX_M:
        return LinearConfig(dequant=True)
    if m <= GEMV_MAX_M and n <= GEMV_MAX_N and k % GEMV_TILE[1] == 0:
        bn, bk = GEMV_TILE
        split = _pick_split(triton.cdiv(n, bn), k, bk, target=GEMV_TARGET, min_k=GEMV_MIN_K)
        return LinearConfig(1, bn, bk, split, GEMV_WARPS, 1, gemv=True, prefetch=GEMV_PREFETCH)
    return tc_config(m, n, k, prefetch=m <= 16 and n <= TC_PREFETCH_MAX_N)


def tc_config(m: int, n: int, k: int, prefetch: bool = False) -> LinearConfig:
    """Tensor-core (:func:`_linear_kernel`) config for ``m ≤ FUSED_MAX_M``."""
    if m <= 32:
        bm = 16 if m <= 16 else 32
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, 64)
        split = _pick_split(tiles, k, 128, target=4 * _NUM_SMS)
        bk = 256 if split == 1 and k <= 4096 else 128  # short rows without split: a longer K step amortises more
        return LinearConfig(bm, 64, bk, split, 4, 1, True, prefetch=prefetch)
    if m <= 64:
        tiles = triton.cdiv(n, 128)
        return LinearConfig(64, 128, 128, _pick_split(tiles, k, 128), 8, 1, True, prefetch=prefetch)
    tiles = triton.cdiv(m, 128) * triton.cdiv(n, 128)
    return LinearConfig(128, 128, 64, _pick_split(tiles, k, 64), 4, 1, True, prefetch=prefetch)


def dgrad_config(m: int, n: int, k: int, mma: bool = False) -> DgradConfig:
    """Tile config for ``dx[m, k] = dy[m, n] · W`` on sm_90 (dequantize + cuBLAS above ``DGRAD_FUSED_MAX_M``)."""
    if m > DGRAD_FUSED_MAX_M:
        return DgradConfig(dequant=True, mma=mma)
    if mma:
        return DgradConfig(block_m=max(16, triton.next_power_of_2(m)), block_n=64, block_k=256, num_warps=8,
                           num_stages=1, mma=True)  # fmt: skip
    return DgradConfig(block_m=max(16, triton.next_power_of_2(m)), block_n=64, block_k=128, num_warps=4, num_stages=1)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def dequantize_triton(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dense ``[N, K]`` ``dtype`` weight from packed uint8 ``[N, K/2]`` (or the MMA layout ``[N/4, 2K]``), fp8
    ``[N, K/16]``, fp32 ``[1]`` (one kernel)."""
    n, k = scale.shape[0], scale.shape[1] * 16
    out = _empty((n, k), dtype, packed.device)
    if is_mma_layout(packed, scale):
        _dequant_mma_kernel[(n // 64, k // 256)](packed, scale, global_scale, out, n, k, num_warps=4)
        return out
    bn, bk = 32, 256
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        packed, scale, global_scale, out, n, k, BLOCK_N=bn, BLOCK_K=bk, FAST=False, num_warps=4
    )
    return out


def _check(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> bool:
    """Validate the weight tensors; returns whether ``packed`` is in the MMA layout (raises if it fits neither)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or global_scale.dtype != torch.float32:
        raise TypeError(
            f"nvfp4 kernels expect uint8/float8_e4m3fn/float32 weight tensors, got {packed.dtype}/{scale.dtype}/"
            f"{global_scale.dtype}"
        )
    if not (packed.is_contiguous() and scale.is_contiguous()):
        raise ValueError("nvfp4 kernels expect contiguous weight_packed / weight_scale")
    return is_mma_layout(packed, scale)


def _launch_tc(x2, packed, scale, global_scale, bias, y, out, m, n, k, k_per_split, split, even_k, cfg, lora=None):
    """Launch :func:`_linear_kernel` (tensor-core path) into ``out`` (``y`` or the split-K workspace).

    ``lora``: ``(A [R, K], B [N, R], scaling)`` to fuse the adapter (``cfg.swap`` must be True).
    """
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    extra = {}
    if lora is not None:
        a, b, scaling = lora
        r = a.shape[0]
        extra = dict(a_ptr=a, lb_ptr=b, lora_scale=float(scaling), R=r, HAS_LORA=True,
                     BLOCK_R=max(16, triton.next_power_of_2(r)))  # fmt: skip
    _linear_kernel[(tiles, split)](
        x2,
        packed,
        scale,
        global_scale,
        bias if bias is not None else y,
        out,
        m,
        n,
        k,
        x2.stride(0),
        y.stride(0) if split == 1 else n,
        k_per_split,
        HAS_BIAS=bias is not None,
        USE_WS=split > 1,
        EVEN_K=even_k,
        SWAP=cfg.swap,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        FAST=_fast(x2.dtype),
        PREFETCH=cfg.prefetch and even_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **extra,
    )


# Split-K tickets of the fused reduction, one int32 per output tile, per device. Each kernel leaves them at zero,
# so they are allocated once, outside CUDA-graph capture (graphs keep their address), and never freed. Launches on
# one device share them: kernels on two concurrent streams must not both use the fused reduction.
_SPLITK_COUNTERS: dict[torch.device, torch.Tensor] = {}
SPLITK_COUNTERS = 1 << 16


def _splitk_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed ticket counters of ``device``, or None (separate reduce kernel) if they cannot be had here."""
    counters = _SPLITK_COUNTERS.get(device)
    if counters is None:
        if tiles > SPLITK_COUNTERS:
            return None
        if device.type != "cuda":
            counters = torch.zeros(SPLITK_COUNTERS, dtype=torch.int32, device=device)
        elif torch.cuda.is_current_stream_capturing():
            return None
        else:
            # Allocated by another thread: torch.compile's CUDA-graph trees run their warm-up with this thread's
            # allocations routed to the graphs' private pool, where a tensor that outlives the graph is an error
            # ("not tracked as outputs") and would be freed with the graph.
            box: list[torch.Tensor] = []

            def alloc() -> None:
                box.append(torch.zeros(SPLITK_COUNTERS, dtype=torch.int32, device=device))
                torch.cuda.synchronize(device)

            thread = threading.Thread(target=alloc)
            thread.start()
            thread.join()
            counters = box[0]
        _SPLITK_COUNTERS[device] = counters
    return counters if tiles <= counters.numel() else None


def _launch_mma(x2, packed, scale, global_scale, bias, y, out, m, n, k, k_per_split, split, cfg, lora=None,
                counters=None):  # fmt: skip
    """Launch :func:`_linear_mma_kernel` into ``out`` (``y`` or the split-K workspace); with ``counters`` (split-K
    only) the kernel also sums the workspace into ``y``."""
    extra = {}
    if counters is not None:
        extra.update(out_ptr=y, cnt_ptr=counters, SPLIT=split, FUSED_REDUCE=True)
    if lora is not None:
        a, b, scaling = lora
        r = a.shape[0]
        block_r = max(16, triton.next_power_of_2(r))
        extra.update(a_ptr=a, lb_ptr=b, lora_scale=float(scaling), R=r, HAS_LORA=True, BLOCK_R=block_r)
        if counters is not None and cfg.lora_shared_t:  # x·Aᵀ once per split, shared by the tiles (SHARED_T)
            mblocks = triton.cdiv(m, cfg.block_m)
            t_ws = torch.empty(mblocks * split * block_r * cfg.block_m, dtype=torch.float32, device=x2.device)
            extra.update(t_ptr=t_ws, tcnt_ptr=counters[counters.numel() - 2 * mblocks :], SHARED_T=True)
    _linear_mma_kernel[(n // 64, split, triton.cdiv(m, cfg.block_m))](
        x2, packed, scale, global_scale, bias if bias is not None else y, out, m, n, k, x2.stride(0),
        y.stride(0) if split == 1 else n, k_per_split,
        HAS_BIAS=bias is not None, USE_WS=split > 1, BLOCK_M=cfg.block_m, FAST=_fast(x2.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )  # fmt: skip


def nvfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """``y = x · dequant(W)ᵀ + bias`` on CUDA (or the Triton interpreter).

    Args:
        x: ``[..., K]`` float16/bfloat16 (float32 goes through the dequantize path, full fp32 product).
        packed: uint8 ``[N, K/2]``; scale: float8_e4m3fn ``[N, K/16]``; global_scale: float32 ``[1]``.
        bias: optional ``[N]``.
        config: override the tuned :func:`linear_config` (benchmarks, tests).

    Returns:
        ``[..., N]`` in ``x.dtype``; fp32 accumulation.
    """
    return _linear(x, packed, scale, global_scale, bias, config, None)


# Largest LoRA rank fused into the kernel (the [BLOCK_R, BLOCK_K] tile of A lives in registers beside W's).
LORA_FUSED_MAX_R = 128


def nvfp4_lora_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """``y = x · dequant(W)ᵀ + bias + scaling · (x · Aᵀ) · Bᵀ``: an NVFP4 linear and its LoRA adapter in one kernel.

    For generation (no autograd): at decode sizes a PEFT adapter costs four small kernels per layer (A product,
    its split-K reduce, B product, scale-and-add), which took as long as the 4-bit base GEMMs themselves on the
    H100 (``benchmarks/decode_profile.py``). Here ``x · Aᵀ`` is accumulated in the base kernel from the activation
    tiles it loads, and ``· Bᵀ`` is added in its epilogue. With split-K summed in the kernel (the decode sizes),
    ``x · Aᵀ`` is computed once per K split and shared by all output tiles (``SHARED_T`` in
    :func:`_linear_mma_kernel`); otherwise each tile accumulates it beside its weight tile.

    Args:
        x: ``[..., K]`` float16/bfloat16.
        packed, scale, global_scale, bias: as :func:`nvfp4_linear`.
        lora_a: ``[R, K]`` (``lora_A.weight``); lora_b: ``[N, R]`` (``lora_B.weight``); any float dtype, rounded to
            ``x.dtype`` in registers. ``x · Aᵀ`` is rounded to ``x.dtype`` before ``· Bᵀ``, as PEFT does.
        scaling: the adapter's ``lora_alpha / r``.

    Returns:
        ``[..., N]`` in ``x.dtype``. Where the fused kernel does not apply (the dequantize + cuBLAS sizes, float32 x,
        R > ``LORA_FUSED_MAX_R``) the same value is computed unfused.
    """
    n, k = scale.shape[0], scale.shape[1] * 16
    r = lora_a.shape[0]
    if lora_a.shape != (r, k) or lora_b.shape != (n, r):
        raise ValueError(
            f"nvfp4_lora_linear: LoRA A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit a [{n}, {k}] weight"
        )
    if r > LORA_FUSED_MAX_R:
        return _linear(x, packed, scale, global_scale, bias, config, None) + _lora_delta(x, lora_a, lora_b, scaling)
    return _linear(x, packed, scale, global_scale, bias, config, (lora_a.contiguous(), lora_b.contiguous(), scaling))


def _lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling · (x · Aᵀ) · Bᵀ`` unfused, in ``x.dtype`` (where the fused kernel does not apply)."""
    return scaling * torch.nn.functional.linear(torch.nn.functional.linear(x, lora_a.to(x.dtype)), lora_b.to(x.dtype))


def _linear(x, packed, scale, global_scale, bias, config, lora):
    """:func:`nvfp4_linear`, plus the adapter ``lora = (A, B, scaling)`` fused where the kernel allows it."""
    mma = _check(packed, scale, global_scale)
    n, k = scale.shape[0], scale.shape[1] * 16
    if x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear: x has {x.shape[-1]} features, the weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    if m == 0:
        return x.new_empty((*lead, n))
    cfg = config or linear_config(m, n, k, mma=mma)
    if cfg.large_m and not _large_m_runs(x.dtype):
        cfg = LinearConfig(dequant=True, mma=True)
    if cfg.dequant or x.dtype == torch.float32:
        w = dequantize_triton(packed, scale, global_scale, x.dtype)
        y = torch.nn.functional.linear(x2, w, bias)
        if lora is not None:
            y = y + _lora_delta(x2, *lora)
        return y.reshape(*lead, n)
    if cfg.mma != mma:
        raise ValueError(f"nvfp4_linear: config {cfg} does not match the weight's layout (mma={mma})")
    if lora is not None and not mma and (cfg.gemv or not cfg.swap):  # the adapter is fused into tensor-core kernels
        cfg = tc_config(m, n, k, prefetch=m <= 16 and n <= TC_PREFETCH_MAX_N)
    if (lora is not None and config is None and cfg.mma and not cfg.large_m and cfg.block_m > FUSED_REDUCE_MAX_M
            and _large_m_runs(x.dtype)):  # fmt: skip
        # Above M = 32 the decode kernel accumulates x·Aᵀ beside every 64-output tile (no shared t without the fused
        # split-K sum): the 7B layer at M = 64 took 0.305 ms with the adapter against 0.148 without (H100,
        # gemm.json). The large-M kernel takes t = x·Aᵀ from one cuBLAS call and adds t·Bᵀ in its epilogue.
        split = dispatch_table.split_for(triton.cdiv(m, 64) * (n // 64), k // 64)
        cfg = LinearConfig(64, 64, 64, split, 4, 4, True, mma=True, large_m=True)

    y = _empty((m, n), x.dtype, x.device)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    even_k = k % cfg.block_k == 0
    out = y if split == 1 else _empty((split, m, n), torch.float32, x.device)
    counters = None
    if mma and split > 1 and cfg.fused_reduce and not cfg.large_m:
        # a ticket per tile, and two LoRA counters per row block at the end
        counters = _splitk_counters(x.device, (n // 64 + 2) * triton.cdiv(m, cfg.block_m))
    if mma and cfg.large_m:
        from .large_m import launch_large_m

        if lora is not None:  # x·Aᵀ by cuBLAS once, rounded to x's dtype as PEFT's lora_A output; ·Bᵀ in the epilogue
            lora = (torch.nn.functional.linear(x2, lora[0].to(x2.dtype)).contiguous(), lora[1], lora[2])
        launch_large_m(x2, packed, scale, global_scale, bias, y, out, m, n, k, k_per_split, split, cfg, _fast(x.dtype),
                       lora)  # fmt: skip
    elif mma:
        _launch_mma(x2, packed, scale, global_scale, bias, y, out, m, n, k, k_per_split, split, cfg, lora, counters)
    elif cfg.gemv:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
            x2, packed, scale, global_scale, bias if bias is not None else y, out, m, n, k, x2.stride(0),
            y.stride(0) if split == 1 else n, k_per_split,
            HAS_BIAS=bias is not None, USE_WS=split > 1, EVEN_K=even_k, BLOCK_M=triton.next_power_of_2(m),
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FAST=_fast(x.dtype), PREFETCH=cfg.prefetch and even_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    else:
        _launch_tc(x2, packed, scale, global_scale, bias, y, out, m, n, k, k_per_split, split, even_k, cfg, lora)
    if split > 1 and counters is None:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            out, bias if bias is not None else y, y, m * n, n, split,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return y.reshape(*lead, n)


def nvfp4_linear_dgrad(
    dy: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    config: DgradConfig | None = None,
) -> torch.Tensor:
    """``dx = dy · dequant(W)``: dy ``[..., N]`` float16/bfloat16 → dx ``[..., K]`` in ``dy.dtype`` (fp32 accumulation)."""
    mma = _check(packed, scale, global_scale)
    n, k = scale.shape[0], scale.shape[1] * 16
    if dy.shape[-1] != n:
        raise ValueError(f"nvfp4_linear_dgrad: dy has {dy.shape[-1]} features, the weight has {n} outputs")
    lead = dy.shape[:-1]
    g2 = dy.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    m = g2.shape[0]
    if m == 0:
        return dy.new_empty((*lead, k))
    cfg = config or dgrad_config(m, n, k, mma=mma)
    if cfg.dequant or dy.dtype == torch.float32:
        w = dequantize_triton(packed, scale, global_scale, dy.dtype)
        return (g2 @ w).reshape(*lead, k)
    if cfg.mma != mma:
        raise ValueError(f"nvfp4_linear_dgrad: config {cfg} does not match the weight's layout (mma={mma})")
    dx = _empty((m, k), dy.dtype, dy.device)
    if mma:
        _dgrad_mma_kernel[(triton.cdiv(m, cfg.block_m), k // 256)](
            g2, packed, scale, global_scale, dx, m, n, k, g2.stride(0), dx.stride(0), BLOCK_M=cfg.block_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return dx.reshape(*lead, k)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(k, cfg.block_k),)
    _dgrad_kernel[grid](
        g2,
        packed,
        scale,
        global_scale,
        dx,
        m,
        n,
        k,
        g2.stride(0),
        dx.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        FAST=False,  # Triton 3.6 fails to compile the PTX decode feeding operand B (OptimizeDotOperands)
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return dx.reshape(*lead, k)
