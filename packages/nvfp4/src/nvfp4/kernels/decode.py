"""Device helpers shared by the NVFP4 kernel families: the weight layouts they read, the E2M1 / FP8-scale
decoders, the MMA-layout tile relabelling, epilogues.

Every decoder here is checked against the PyTorch reference :func:`nvfp4.codec.dequantize` through the kernels
that use it (``tests/nvfp4/test_kernels.py``, under the Triton interpreter and on the GPU) and, for the PTX
recipe of the MMA layout, replayed in PyTorch (``tests/nvfp4/test_linear.py``).

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
registers with no shared-memory round trip. Scales come in step A's order (:func:`nvfp4.layout.to_scale_mma_layout`,
``[N/64, 4K]``), read as int64 pairs of rows and turned into int32 words of 4 scales by :func:`_scale_words` (loaded as
fp8 bytes they compiled to byte loads that Triton cannot route through ``cp.async``). With ``num_stages`` 2-3, Triton
pipelines the weight tile, its scales and the activation tile with ``cp.async`` (checked in the SASS: ``LDGSTS`` for
all three).

Dequantization in registers (never in HBM)
==========================================

Three decoders. **MMA layout, bf16 activations on the GPU** (the decode-size hot path, :func:`_mma_tile`): per 32-bit
word of codes (8 weights, the four A-fragment registers of one K-step) 9 integer instructions place
``e2m1 · 2^-126`` in four bf16x2 registers (:func:`_e2m1_words_bf16`, the word's bit permutation does the rest); per
word of 4 FP8 scales, two ``cvt.f16x2.e4m3x2``, a shift and an OR put ``s · 2^112`` into bf16 bits
(:func:`_scale_words_bf16x2`); one ``mul.bf16x2`` per two weights gives ``e2m1 · s · 2^-14``, exact in bf16, and
the fp32 accumulator is multiplied once by ``2^14 / global``. The main loop at ``BLOCK_M`` = 16 has 519 SASS
instructions per warp per K step (739 with the byte-level decoder before it; ``benchmarks/kernel_sass.py@1486a77``).
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
"""

from __future__ import annotations

import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _grouped_tile(pid, num_m, num_other, GROUP_M: tl.constexpr):
    """The ``(m, other)`` tile of program ``pid`` on a ``num_m x num_other`` grid, the program ids grouped along M:
    ``GROUP_M`` m-tiles side by side, so the programs that share a weight tile (the same ``other``) run back to back
    and the weights stream from HBM about once. The one tile swizzle of the small-M, large-M and dgrad kernels."""
    group = GROUP_M * num_other
    first_m = (pid // group) * GROUP_M
    gsize = min(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % gsize, (pid % group) // gsize


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


# One bit-permuted MMA-layout word ($4: 8 codes) → four bf16x2 A-fragment registers ($0..$3) holding e2m1 · 2^-126
# (:func:`_e2m1_words_bf16`; also the Gluon kernel's decoder, :mod:`nvfp4.kernels.hopper_ws`).
#: its PTX body, shared with the Gluon kernel's round-15 decode + scale (temporaries ``r``, ``t`` declared by the caller)
E2M1_WORD_DECODE_PTX = """
        and.b32 $0, $4, 0x81C081C0;
        shf.r.wrap.b32 r, $4, $4, 4;
        and.b32 $1, r, 0x81C081C0;
        shf.r.wrap.b32 r, $4, $4, 10;
        and.b32 $2, r, 0x81C081C0;
        shf.r.wrap.b32 r, $4, $4, 30;
        shf.r.wrap.b32 t, $4, $4, 6;
        and.b32 r, r, 0x80C080C0;
        and.b32 t, t, 0x01000100;
        or.b32 $3, r, t;"""
E2M1_WORDS_BF16_ASM = tl.constexpr(
    """
        {
        .reg .b32 r, t;"""
    + E2M1_WORD_DECODE_PTX
    + """
        }
        """
)


@triton.jit
def _e2m1_words_bf16(packed):
    """uint8 MMA-layout tile (bit-permuted words, :mod:`nvfp4.layout`) → two bf16 tensors of its shape holding
    ``e2m1 · 2^-126``: per word (4 elements), ``a`` = (byte 0 low nibble, byte 0 high, byte 1 low, byte 1 high) and
    ``b`` = the same for bytes 2 and 3, i.e. each 32-bit register is one bf16x2 ``wgmma`` A-fragment register.

    9 instructions per word (8 weights): register ``j`` is ``rotr(q, t_j) & 0x81C081C0`` (sign at bit 15, ``e1 e0 m``
    at bits 8..6 of each half; ``e = 0`` lands on the exact bf16 subnormal), the last one takes two rotations.
    """
    return _bf16x2_pairs_from_word(packed, E2M1_WORDS_BF16_ASM)


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
    and the scale pairs, int64 ``[1, 4, 4, 8]`` (:func:`_scale_pair_ptrs`; add :func:`_scale_k_offset` for step
    ``k0``). ``K % 256 == 0``."""
    r = tl.arange(0, 16)
    c = tl.arange(0, 512)
    w_tile = w_ptr + (tile_n * 16 + r[:, None]).to(tl.int64) * (2 * K) + c[None, :]
    s_tile = _scale_pair_ptrs(s_ptr, tile_n + tl.arange(0, 1), K, 4)
    return w_tile, s_tile


# Scales in step A's order (nvfp4.layout.to_scale_mma_layout, [N/64, 4K]): the 8 bytes at (tile t, quarter j, warp w,
# quad q) hold rows r = 64t + 16w + q and r + 8, scales 4j..4j+3, interleaved (byte 2·g + h: scale g of row r + 8h).
@triton.jit
def _scale_pair_ptrs(s_ptr, tiles, K, QUARTERS: tl.constexpr):
    """int64 pointers ``[TILES, QUARTERS, 4, 8]`` (t, j, w, q) to the scale pairs of the 64-row tiles ``tiles``
    (int32 ``[TILES]``) at K step 0 (add :func:`_scale_k_offset` for step ``k0``): 4K bytes = K/2 int64 per tile."""
    j = tl.arange(0, QUARTERS)[None, :, None, None] * 32
    wq = tl.arange(0, 4)[None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    return s_ptr.to(tl.pointer_type(tl.int64)) + tiles[:, None, None, None].to(tl.int64) * (K // 2) + j + wq


@triton.jit
def _scale_k_offset(k0):
    """Offset of K step ``k0`` (a multiple of 64) in the scale-pair pointers: 32 int64 (256 bytes) per 64 inputs."""
    return (k0 // 64) * 32


@triton.jit
def _scale_words(v, FAST: tl.constexpr):
    """The loaded scale pairs as :func:`_mma_tiles` takes them, int32 words ``[64·TILES, QUARTERS]`` (4 fp8 scales of
    one row each), from int64 ``[TILES, QUARTERS, 4, 8]`` pairs: row ``r``'s word is ``prmt(lo, hi, 0x6420)``, row
    ``r + 8``'s ``prmt(lo, hi, 0x7531)`` (``FAST``: PTX; else shifts and masks), relabelled (t, w, h, q | j) →
    ``[64·TILES, QUARTERS]``."""
    T: tl.constexpr = v.shape[0]
    Q: tl.constexpr = v.shape[1]
    if FAST:
        r0, r8 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 lo, hi;
            mov.b64 {lo, hi}, $2;
            prmt.b32 $0, lo, hi, 0x6420;
            prmt.b32 $1, lo, hi, 0x7531;
            }
            """,
            constraints="=r,=r,l",
            args=[v],
            dtype=(tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    else:
        lo = v & 0xFFFFFFFF
        hi = (v >> 32) & 0xFFFFFFFF
        r0 = ((lo & 0xFF) | ((lo >> 8) & 0xFF00) | ((hi & 0xFF) << 16) | ((hi << 8) & 0xFF000000)).to(tl.int32)
        r8 = (((lo >> 8) & 0xFF) | ((lo >> 16) & 0xFF00) | ((hi & 0xFF00) << 8) | (hi & 0xFF000000)).to(tl.int32)
    w = tl.permute(tl.join(r0, r8), (0, 2, 4, 3, 1))  # t, j, w, q, h → t, w, h, q, j
    return tl.reshape(w, (64 * T, Q))
