"""Warp-specialised W4A16 NVFP4 GEMM for Hopper, in Gluon (spike).

``yᵀ = W · xᵀ``: a producer warp streams x tiles, 4-bit weight tiles (MMA layout, :mod:`nvfp4.layout`) and FP8
block scales by TMA into a ring of shared-memory stages guarded by mbarriers; the consumer warpgroups decode the
weight tile from shared memory into the registers of ``wgmma``'s A operand and keep one ``wgmma`` group in flight
while they decode the next stage.

The scales come in round 15 step A's order (:func:`nvfp4.layout.to_scale_mma_layout`, issue #50, docs/kernels.md):
each k16 step's scale pair is decoded with the weight word in one ``inline_asm``. (The int32 ``[N, K/16]`` scale path
left at stage 2's end; ``hopper_ws.py@6ee5805`` has it.)
"""

from __future__ import annotations

from functools import partial

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..layout import is_mma_layout, weight_shape
from .decode import E2M1_WORD_DECODE_PTX, E2M1_WORDS_BF16_ASM

#: a k16 step's scale pair (l: row r, h: row r + 8) → f, bf16x2 of s·2^112 (round 15 steps A and B)
SCALE_PAIR_PTX = """
        cvt.rn.f16x2.e4m3x2 f, l;
        shr.b32 f, f, 3;
        lop3.b32 f, f, 0x0FFF0FFF, 0x70007000, 0xea;"""
#: round 15 step A: round 5's E2M1 word decode ($4 → $0..$3), then the k16 step's scale pair ($5's
#: low 16 bits: row r, row r + 8) → bf16x2 of s·2^112 (``cvt`` to f16x2, ``>> 3``, re-bias: ``lop3`` LUT 0xEA is
#: ``(a & b) | c``; exact for positive finite E4M3) and the four multiplies, $0/$2 by row r's scale and $1/$3 by
#: row r + 8's. (The first GPU run computed zeros: LUT 0xF8 is ``a | (b & c)``, and ``0x0FFF0FFF & 0x70007000 = 0``,
#: so the re-bias was dropped, s·2^-112 instead of s·2^112, and every product underflowed bf16 to 0.)
E2M1_SCALED_ASM = gl.constexpr(
    """
        {
        .reg .b32 r, t, f, bl, bh;
        .reg .b16 l, h, sl, sh;"""
    + E2M1_WORD_DECODE_PTX
    + """
        mov.b32 {l, h}, $5;"""
    + SCALE_PAIR_PTX
    + """
        mov.b32 {sl, sh}, f;
        mov.b32 bl, {sl, sl};
        mov.b32 bh, {sh, sh};
        mul.rn.bf16x2 $0, $0, bl;
        mul.rn.bf16x2 $1, $1, bh;
        mul.rn.bf16x2 $2, $2, bl;
        mul.rn.bf16x2 $3, $3, bh;
        }
        """
)

#: round 15 step B (``INFLIGHT``): step A's asm split at the wgmma wait. ``PAIR_ASM``: the scale pair ($1's low half)
#: → bf16x2 of s·2^112 (no operand register written; runs while the previous k16 step's wgmma is in flight);
#: ``MUL_ASM``: round 5's decoded words ($4..$7) times it ($0/$2 by row r's scale, $1/$3 by row r + 8's, as step A).
PAIR_ASM = gl.constexpr(
    """
        {
        .reg .b32 f;
        .reg .b16 l, h;
        mov.b32 {l, h}, $1;"""
    + SCALE_PAIR_PTX
    + """
        mov.b32 $0, f;
        }
        """
)
MUL_ASM = gl.constexpr(
    """
        {
        .reg .b32 bl, bh;
        .reg .b16 l, h;
        mov.b32 {l, h}, $8;
        mov.b32 bl, {l, l};
        mov.b32 bh, {h, h};
        mul.rn.bf16x2 $0, $4, bl;
        mul.rn.bf16x2 $1, $5, bh;
        mul.rn.bf16x2 $2, $6, bl;
        mul.rn.bf16x2 $3, $7, bh;
        }
        """
)

POISON = False  # tests: outputs start as NaN, so an element the kernel never writes cannot pass


@gluon.jit
def _e2m1_words_bf16(p):
    """uint8 MMA-layout bytes (4 per thread-register word) → two bf16 tensors (``e2m1 · 2^-126``), as
    :func:`nvfp4.kernels.decode._e2m1_words_bf16`."""
    return gl.inline_asm_elementwise(
        E2M1_WORDS_BF16_ASM,
        "=r,=r,=r,=r,r",
        [p],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _decode_tile_a(p, q, T: gl.constexpr, a_layout: gl.constexpr):
    """``p`` uint8 ``[4T, 512]`` (one K quarter of ``T`` MMA-layout tiles, rows (tile, warp)), ``q`` uint8
    ``[4T, 512]`` (word ``w`` of a thread: the scale pair (row r, row r + 8) of its k16 step ``w``, twice) → bf16
    ``[64T, 64]`` ``e2m1 · s · 2^-14`` in ``a_layout`` (the wgmma A operand)."""
    a, b = gl.inline_asm_elementwise(E2M1_SCALED_ASM, "=r,=r,=r,=r,r,r", [p, q], dtype=(gl.bfloat16, gl.bfloat16),
                                     is_pure=True, pack=4)  # fmt: skip
    w = gl.reshape(gl.join(a, b), (4 * T, 128, 2, 2, 2))
    w = gl.reshape(gl.permute(w, (0, 1, 4, 2, 3)), (4 * T, 512, 2))
    w = gl.reshape(w, (T, 4, 8, 4, 8, 2, 2))
    w = gl.permute(w, (0, 1, 5, 2, 4, 3, 6))
    return gl.convert_layout(gl.reshape(w, (64 * T, 64)), a_layout, assert_trivial=True)


@gluon.jit
def _stage_words(w_bufs, s_bufs, st, WG: gl.constexpr, TC: gl.constexpr, p_layout: gl.constexpr,
                 s_layout: gl.constexpr):  # fmt: skip
    """Round 15 steps A and B: this consumer's words of stage ``st``, both uint8 ``[4TC, 512]`` in ``p_layout``: the
    weights (one ``LDS.128`` per thread) and the scale pairs ``[4TC (tile, warp), 8 quads, 4 k16 steps, 2 rows]``
    (one 8-byte load per thread: a quad's 4 lanes read the same bytes), each pair widened to a word (the asm reads
    its low half)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    plain4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    p = w_bufs.index(st).slice(TC * WG, TC, dim=0)._reinterpret(gl.uint8, [4 * TC, 512], plain).load(p_layout)
    q = s_bufs.index(st).slice(TC * WG, TC, dim=0)._reinterpret(gl.uint8, [4 * TC, 8, 4, 2], plain4).load(
        gl.SliceLayout(3, gl.SliceLayout(2, s_layout)))  # fmt: skip
    q = gl.expand_dims(q, 3).broadcast_to((4 * TC, 8, 4, 2, 2))  # byte (copy, row) of the step's word
    q = gl.reshape(gl.expand_dims(q, 2).broadcast_to((4 * TC, 8, 4, 4, 2, 2)), (4 * TC, 512))
    return p, gl.convert_layout(q, p_layout, assert_trivial=True)


@gluon.jit
def _stage_k16(w_bufs, s_bufs, st, WG: gl.constexpr, TC: gl.constexpr, p_layout: gl.constexpr,
               s_layout: gl.constexpr):  # fmt: skip
    """Round 15 step B: stage ``st``'s loads as step A's (:func:`_stage_words`), split into the 4 k16 steps (word
    ``j`` of a thread: step ``j``; ``gl.split`` renames registers): ``p0..p3`` weight words, ``q0..q3`` scale-pair
    words, each uint8 ``[4TC, 32, 4]``."""
    p, q = _stage_words(w_bufs, s_bufs, st, WG, TC, p_layout, s_layout)
    # [4TC, 32 lanes, 2, 2 (word = k16 step), 4 bytes] → bytes first, the word's bits last; split twice
    p01, p23 = gl.split(gl.permute(gl.reshape(p, (4 * TC, 32, 2, 2, 4)), (0, 1, 4, 3, 2)))
    q01, q23 = gl.split(gl.permute(gl.reshape(q, (4 * TC, 32, 2, 2, 4)), (0, 1, 4, 3, 2)))
    p0, p1 = gl.split(p01)
    p2, p3 = gl.split(p23)
    q0, q1 = gl.split(q01)
    q2, q3 = gl.split(q23)
    return p0, p1, p2, p3, q0, q1, q2, q3


@gluon.jit
def _k16_int(p, q, TC: gl.constexpr, WARPS: gl.constexpr):
    """Round 15 step B: the half of a k16 step's decode that writes no wgmma operand (it runs while the previous
    step's wgmma is in flight): round 5's E2M1 words (``a``, ``b``: bf16 ``e2m1 · 2^-126``) and the scale pair."""
    p16_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    p = gl.convert_layout(gl.reshape(p, (4 * TC, 128)), p16_layout, assert_trivial=True)
    q = gl.convert_layout(gl.reshape(q, (4 * TC, 128)), p16_layout, assert_trivial=True)
    a, b = _e2m1_words_bf16(p)
    pair = gl.inline_asm_elementwise(PAIR_ASM, "=r,r", [q], dtype=gl.uint8, is_pure=True, pack=4)
    return a, b, pair


@gluon.jit
def _k16_mul(a, b, pair, TC: gl.constexpr, a_layout: gl.constexpr):
    """Round 15 step B: the scale multiply (it writes the k16 step's A operand: after the wait), then the operand's
    layout, bf16 ``[64TC, 16]`` in ``a_layout``."""
    a, b = gl.inline_asm_elementwise(MUL_ASM, "=r,=r,=r,=r,r,r,r,r,r", [a, b, pair], dtype=(gl.bfloat16, gl.bfloat16),
                                     is_pure=True, pack=4)  # fmt: skip
    w = gl.reshape(gl.join(a, b), (4 * TC, 32, 2, 2, 2))
    w = gl.reshape(gl.permute(w, (0, 1, 4, 2, 3)), (TC, 4, 8, 4, 2, 2, 2))  # t, n54 | n210, b10, k3, n3 | k0
    w = gl.permute(w, (0, 1, 5, 2, 4, 3, 6))
    return gl.convert_layout(gl.reshape(w, (64 * TC, 16)), a_layout, assert_trivial=True)


@gluon.jit
def _segment(u, u_end, KS):
    """The run of K stages a program does next from unit ``u`` (units are (tile, 64-input stage), tile-major):
    (tile, first stage, end stage)."""
    tile = u // KS
    kb = u % KS
    return tile, kb, gl.minimum(KS, kb + (u_end - u))


@gluon.jit
def _producer(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, empty, ready, u0, u1, KU, num_m, BLOCK_M: gl.constexpr,
              T: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr):  # fmt: skip
    i = 0
    u = u0
    while u < u1:
        tile, kb, ke = _segment(u, u1, KU)
        off_m = (tile % num_m) * BLOCK_M
        tile0 = (tile // num_m) * T
        for kk in range(kb * SUB, ke * SUB):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            fence_async_shared()  # the consumers' shared-memory reads of this stage before the TMA overwrites it
            mbarrier.expect(ready.index(st), x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, kk * 64], ready.index(st), x_bufs.index(st))
            # the stage's 256 scale bytes per 64-row tile (nvfp4.layout.to_scale_mma_layout)
            tma.async_copy_global_to_shared(s_desc, [tile0, kk * 256], ready.index(st), s_bufs.index(st))
            tma.async_copy_global_to_shared(w_desc, [tile0, 4 * (kk % 4), 2 * (kk // 4), 0], ready.index(st),
                                            w_bufs.index(st))  # fmt: skip
            i += 1
        u += ke - kb


@gluon.jit
def _stage_operand(w_bufs, s_bufs, ready, i, WG: gl.constexpr, TC: gl.constexpr, STAGES: gl.constexpr,
                   a_layout: gl.constexpr, p_layout: gl.constexpr, s_layout: gl.constexpr):  # fmt: skip
    """Wait for stage ``i`` and decode this consumer's rows of its weight tile: the wgmma A operand (the weight and
    scale-pair words, decoded and scaled in one asm)."""
    st = i % STAGES
    mbarrier.wait(ready.index(st), (i // STAGES) & 1)
    p, q = _stage_words(w_bufs, s_bufs, st, WG, TC, p_layout, s_layout)
    return _decode_tile_a(p, q, TC, a_layout)


@gluon.jit
def _consumer(x_bufs, w_bufs, s_bufs, empty, ready, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G, U, KU, num_m, M,
              N, K, stride_ym, WG: gl.constexpr, TC: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
              T: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, SUB: gl.constexpr,
              FIXUP: gl.constexpr, INFLIGHT: gl.constexpr = False):  # fmt: skip
    """One consumer partition of ``WARPS`` warps: rows ``[64·TC·WG, 64·TC·(WG+1))`` of each ``64·T``-row tile."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    p_layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [WARPS, 1], [1, 0])
    # the scale pairs' layout: [4TC, 8 quads, 4 lanes, 4 k16 steps, 2 copies, 2 rows] bytes, p_layout's order
    s_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4, 2, 2], [1, 8, 4, 1, 1, 1], [WARPS, 1, 1, 1, 1, 1],
                                              [5, 4, 3, 2, 1, 0])  # fmt: skip
    rows_c = gl.arange(0, 64 * TC, layout=gl.SliceLayout(1, acc_layout))
    cols_c = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    # a partial tile's fp32 slot in the workspace: one per (program, consumer), [64·TC, BLOCK_M] row-major
    slot = rows_c[:, None] * BLOCK_M + cols_c[None, :]
    me = gl.program_id(0)
    post = 16384.0 / gl.load(g_ptr)
    i = 0
    u = u0
    while u < u1:
        tile, kb, ke = _segment(u, u1, KU)
        n0 = (tile // num_m) * 64 * T
        acc = gl.zeros([64 * TC, BLOCK_M], gl.float32, acc_layout)
        for _ in range(kb, ke):
            if INFLIGHT:
                # round 15 step B (Humming's in-flight decode): per k16 step, issue its wgmma, decode the next step's
                # E2M1 words and scale pair while it is in flight (no operand register written), wait, scale, issue
                for sb in gl.static_range(SUB):
                    st = (i + sb) % STAGES
                    mbarrier.wait(ready.index(st), ((i + sb) // STAGES) & 1)
                    p0, p1, p2, p3, q0, q1, q2, q3 = _stage_k16(w_bufs, s_bufs, st, WG, TC, p_layout, s_layout)
                    ai, bi, pr = _k16_int(p0, q0, TC, WARPS)
                    aop = _k16_mul(ai, bi, pr, TC, a_layout)
                    acc = warpgroup_mma(aop, x_bufs.index(st).slice(0, 16, dim=1).permute((1, 0)), acc, is_async=True)
                    ai, bi, pr = _k16_int(p1, q1, TC, WARPS)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    aop = _k16_mul(ai, bi, pr, TC, a_layout)
                    acc = warpgroup_mma(aop, x_bufs.index(st).slice(16, 16, dim=1).permute((1, 0)), acc, is_async=True)
                    ai, bi, pr = _k16_int(p2, q2, TC, WARPS)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    aop = _k16_mul(ai, bi, pr, TC, a_layout)
                    acc = warpgroup_mma(aop, x_bufs.index(st).slice(32, 16, dim=1).permute((1, 0)), acc, is_async=True)
                    ai, bi, pr = _k16_int(p3, q3, TC, WARPS)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    aop = _k16_mul(ai, bi, pr, TC, a_layout)
                    acc = warpgroup_mma(aop, x_bufs.index(st).slice(48, 16, dim=1).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index(st), count=1)
            else:
                # ptxas serialises register-A wgmmas whose operands are written while a wgmma is in flight (C7515), so
                # the unit's SUB stages are decoded first, their wgmmas go out back to back and retire before the next
                # decode; the other consumer partition decodes meanwhile.
                a0 = _stage_operand(w_bufs, s_bufs, ready, i, WG, TC, STAGES, a_layout, p_layout, s_layout)
                if SUB == 2:
                    a1 = _stage_operand(w_bufs, s_bufs, ready, i + 1, WG, TC, STAGES, a_layout, p_layout, s_layout)
                    acc = warpgroup_mma(a0, x_bufs.index(i % STAGES).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma(a1, x_bufs.index((i + 1) % STAGES).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index(i % STAGES), count=1)
                    mbarrier.arrive(empty.index((i + 1) % STAGES), count=1)
                else:
                    acc = warpgroup_mma(a0, x_bufs.index(i % STAGES).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index(i % STAGES), count=1)
            i += SUB
        u += ke - kb
        if FIXUP:
            if (kb == 0) & (ke == KU):  # a whole tile: straight to y
                _store_rows(acc, rows_c, cols_c, n0, tile, post, b_ptr, y_ptr, num_m, M, N, stride_ym, WG, TC, HAS_BIAS,
                            BLOCK_M)  # fmt: skip
            else:
                # a part of a split tile: into this program's slot (token-major, so that the reduction's reads and
                # y's stores are contiguous along the output rows) with its flag set to the number of readers
                j = (u - (ke - kb) != u0).to(gl.int32)  # slot 0: the program's first segment; 1: its last
                pf, pl = _participants(tile, G, U, KU)
                slot_t = cols_c[None, :] * (64 * TC) + rows_c[:, None]
                gl.store(ws_ptr + (j * 2 * G + 2 * me + WG).to(gl.int64) * (64 * TC * BLOCK_M) + slot_t, acc)
                gl.thread_barrier()  # every thread's part is out before the flag goes up
                gl.atomic_xchg(flag_ptr + 4 * me + 2 * j + WG, pl - pf + 1, sem="release", scope="gpu")
        else:
            # Stream-K: a tile split between programs is summed by the program holding its first stages (it reaches
            # them last, so the others' parts are written by then), in program order: deterministic.
            flag = flag_ptr + 2 * me + WG
            if kb > 0:
                gl.store(ws_ptr + (2 * me + WG).to(gl.int64) * (64 * TC * BLOCK_M) + slot, acc)
                gl.thread_barrier()  # every thread's part is out before the flag goes up
                gl.atomic_xchg(flag, 1, sem="release", scope="gpu")
            else:
                covered = ke
                other = me + 1
                while covered < KU:
                    oflag = flag_ptr + 2 * other + WG
                    while gl.atomic_add(oflag, 0, sem="acquire", scope="gpu") == 0:
                        pass
                    acc += gl.load(ws_ptr + (2 * other + WG).to(gl.int64) * (64 * TC * BLOCK_M) + slot,
                                   cache_modifier=".cg")  # fmt: skip
                    gl.atomic_xchg(oflag, 0, sem="relaxed", scope="gpu")
                    covered = gl.minimum(KU, (other + 1) * U // G - tile * KU)
                    other += 1
                _store_rows(acc, rows_c, cols_c, n0, tile, post, b_ptr, y_ptr, num_m, M, N, stride_ym, WG, TC, HAS_BIAS,
                            BLOCK_M)  # fmt: skip
    if FIXUP:
        # every program sums a share of each split tile it worked on (after all its MMAs, so nobody waits on a
        # program that is still waiting): its first segment's tile and its last segment's tile, if partial
        t0, kb0, ke0 = _segment(u0, u1, KU)
        if (kb0 > 0) | (ke0 < KU):
            _parallel_fixup(t0, me, u0, ws_ptr, flag_ptr, post, b_ptr, y_ptr, G, U, KU, num_m, M, N, stride_ym, WG,
                            TC, HAS_BIAS, BLOCK_M, T, WARPS)  # fmt: skip
        t1 = (u1 - 1) // KU
        if (t1 != t0) & (u1 - t1 * KU < KU):
            _parallel_fixup(t1, me, u0, ws_ptr, flag_ptr, post, b_ptr, y_ptr, G, U, KU, num_m, M, N, stride_ym, WG,
                            TC, HAS_BIAS, BLOCK_M, T, WARPS)  # fmt: skip


@gluon.jit
def _wait_nonzero(ptrs, live):
    """Spin until the int32 at each ``live`` pointer is non-zero (acquire, gpu scope), each thread on its own:
    a loop inside the thread, since a cross-warp ``gl.sum`` of "still waiting" would need shared scratch, which
    Triton places at the same offset for both consumer partitions."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 v; setp.eq.s32 p, $2, 0; @p bra DONE; LOOP: ld.acquire.gpu.global.b32 v, [$1];"
        " setp.eq.s32 p, v, 0; @p bra LOOP; DONE: mov.b32 $0, 0; }",
        "=r,l,r",
        [ptrs, live.to(gl.int32)],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _participants(tile, G, U, KU):
    """First and last program whose units (``[p·U/G, (p+1)·U/G)``) meet ``tile``'s ``[tile·KU, (tile+1)·KU)``."""
    return ((tile * KU + 1) * G - 1) // U, ((tile + 1) * KU * G - 1) // U


@gluon.jit
def _store_rows(acc, rows_c, cols_c, n0, tile, post, b_ptr, y_ptr, num_m, M, N, stride_ym, WG: gl.constexpr,
                TC: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr):  # fmt: skip
    """``y[tile's tokens, this consumer's rows] = acc · post (+ bias)`` (acc ``[64·TC, BLOCK_M]`` fp32; the tile's
    rows start at ``n0``)."""
    offs_n = n0 + 64 * TC * WG + rows_c
    offs_m = (tile % num_m) * BLOCK_M + cols_c
    out = acc * post
    if HAS_BIAS:
        out += gl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    ptrs = y_ptr + offs_m[None, :].to(gl.int64) * stride_ym + offs_n[:, None]
    gl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _parallel_fixup(tile, me, u0, ws_ptr, flag_ptr, post, b_ptr, y_ptr, G, U, KU, num_m, M, N, stride_ym,
                    WG: gl.constexpr, TC: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
                    T: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Sum this program's share of split ``tile`` (this consumer's rows): the ``n`` programs that worked on it take
    every ``n``-th group of ``WARPS`` tokens; each group adds the ``n`` slots (16 at a time: one round of
    loads) in a fixed order (deterministic) and goes to y. The serial form has one program read all ``n - 1``
    other slots after the last of them is written (the tail of the kernel); here each reads ``1/n`` of each."""
    ROWS: gl.constexpr = 64 * TC
    QB: gl.constexpr = 32 * WARPS
    QN: gl.constexpr = 16  # parts loaded per round
    red: gl.constexpr = gl.BlockedLayout([QN, 1, 2 * TC], [1, 1, 32], [1, WARPS, 1], [2, 1, 0])
    f_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    pf, pl = _participants(tile, G, U, KU)
    n = pl - pf + 1
    j_first = (pf * U // G < tile * KU).to(gl.int32)  # the first program's part is its last segment: slot 1
    # wait for every part: each thread polls one program's flag
    for qb in range(pf, pl + 1, QB):
        q = qb + gl.arange(0, QB, layout=f_layout)
        live = q <= pl
        _wait_nonzero(flag_ptr + 4 * q + 2 * gl.where(q == pf, j_first, 0) + WG, live)
    gl.thread_barrier()  # all flags seen before anyone reads a part
    red2: gl.constexpr = gl.SliceLayout(0, red)
    tok = gl.arange(0, WARPS, layout=gl.SliceLayout(1, red2))
    rr = gl.arange(0, ROWS, layout=gl.SliceLayout(0, red2))
    qq = gl.arange(0, QN, layout=gl.SliceLayout(1, gl.SliceLayout(2, red)))
    offs_n = (tile // num_m) * 64 * T + ROWS * WG + rr
    if HAS_BIAS:
        bias = gl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
    for c in range(me - pf, BLOCK_M // WARPS, n):
        cols = c * WARPS + tok
        off = gl.expand_dims(cols[:, None] * ROWS + rr[None, :], 0)
        acc = gl.zeros([WARPS, ROWS], gl.float32, red2)
        # QN programs' parts in one round of loads, added in program order (the sum runs within each thread)
        for qb in range(pf, pl + 1, QN):
            q = qb + qq
            base = (gl.where(q == pf, j_first, 0) * 2 * G + 2 * q + WG).to(gl.int64) * (ROWS * BLOCK_M)
            part = gl.load(ws_ptr + base[:, None, None] + off, mask=(q <= pl)[:, None, None], other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            acc += gl.sum(part, axis=0)
        out = acc * post
        if HAS_BIAS:
            out += bias[None, :]
        offs_m = (tile % num_m) * BLOCK_M + cols
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        gl.store(y_ptr + offs_m[:, None].to(gl.int64) * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    # each reader takes one off each flag: the last leaves it zero for the next launch
    for qb in range(pf, pl + 1, QB):
        q = qb + gl.arange(0, QB, layout=f_layout)
        live = q <= pl
        gl.atomic_add(flag_ptr + 4 * q + 2 * gl.where(q == pf, j_first, 0) + WG, gl.full([QB], -1, gl.int32, f_layout),
                      mask=live, sem="relaxed", scope="gpu")  # fmt: skip


@gluon.jit
def _ws_linear_kernel(x_desc, w_desc, s_desc, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, M, N, K, stride_ym,
                      HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr,
                      SUB: gl.constexpr, FIXUP: gl.constexpr, num_warps: gl.constexpr,
                      INFLIGHT: gl.constexpr = False):  # fmt: skip
    """Persistent stream-K: ``num_programs(0)`` programs share the ``tiles × K/(64·SUB)`` units of work evenly
    (tile-major, the M blocks of a weight tile side by side so that it streams from HBM about once). Two consumer
    partitions of 4 warps split each tile's ``64·T`` rows; one producer warp feeds them."""
    num_m = gl.cdiv(M, BLOCK_M)
    KU = K // (64 * SUB)  # units of SUB stages of 64 inputs per tile
    U = num_m * (N // (64 * T)) * KU
    G = gl.num_programs(0)
    me = gl.program_id(0)
    u0 = me * U // G
    u1 = (me + 1) * U // G

    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, T, 4, 2, 256], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, T, 256], s_desc.layout)  # 256 bytes per 64-row tile
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=2)
        mbarrier.init(ready.index(i), count=1)

    gl.warp_specialize(
        [
            (_consumer, (x_bufs, w_bufs, s_bufs, empty, ready, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G, U, KU,
                         num_m, M, N, K, stride_ym, 0, T // 2, HAS_BIAS, BLOCK_M, T, STAGES, num_warps, SUB, FIXUP,
                         INFLIGHT)),
            (_consumer, (x_bufs, w_bufs, s_bufs, empty, ready, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G, U, KU,
                         num_m, M, N, K, stride_ym, 1, T // 2, HAS_BIAS, BLOCK_M, T, STAGES, num_warps, SUB, FIXUP,
                         INFLIGHT)),
            (_producer, (x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, empty, ready, u0, u1, KU, num_m, BLOCK_M, T,
                         STAGES, SUB)),
        ],
        [num_warps, 1],
        [232, 40],
    )  # fmt: skip


#: the launch's register cap: two consumer warpgroups and the producer's (a warp padded to a warpgroup), 384 threads,
#: share the SM's 64K registers (65536 // 384 = 170, down to a multiple of 8); in the specialised region the consumers
#: take 232 and the producer 40 (``warp_specialize``'s counts)
MAXNREG = 168

_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached: the persistent grid is one program per SM)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def supported(x: torch.Tensor, n: int, k: int, tiles: int) -> bool:
    """Whether the kernel runs here: bf16 activations on a Hopper GPU (sm_90: TMA, wgmma, setmaxnreg), whole
    ``64·tiles``-row tiles and 256-input K tiles of the MMA layout."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) == (9, 0)
            and n % (64 * tiles) == 0 and k % 256 == 0)  # fmt: skip


def launch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, y: torch.Tensor, flags: torch.Tensor, block_m: int = 128, tiles: int = 2,
           stages: int = 8, sub: int = 2, programs: int | None = None, fixup: bool = False,
           inflight: bool = False) -> torch.Tensor:  # fmt: skip
    """``y = x · dequant(W)ᵀ + bias`` into ``y``.

    Args:
        x: bf16 ``[M, K]``, row stride a multiple of 8, 16-byte aligned (TMA).
        packed: uint8 ``[N/4, 2K]`` (MMA layout); scale: fp8 ``[N/64, K/64·256]`` in
            :func:`nvfp4.layout.to_scale_mma_layout`'s order (read as one 8-byte scale-pair load per thread and
            stage); global_scale: fp32 ``[1]``.
        bias: optional ``[N]`` in x's dtype.
        y: ``[M, N]`` output in x's dtype, row-contiguous.
        flags: int32, at least ``2·programs`` zeros (each launch leaves them zero).
        block_m, tiles, stages, sub: rows of x per tile (the wgmma N), weight tiles of 64 rows (``64·tiles``
            output rows, split between the two consumer warpgroups), pipeline stages of 64 inputs, stages per
            scheduling unit.
        programs: persistent programs (default: one per SM, the most that are resident at once: a split tile's
            programs wait on each other).
        fixup: the programs that share a split tile each sum a share of it at the end (needs ``4·programs``
            flags) instead of the tile's first program summing all the others' parts (``2·programs``): the serial
            sum is the kernel's tail where a tile is split many ways (256-row tiles, long K).
        inflight: round 15 step B on top of step A: one wgmma per k16 step, the next step's decode while it is in
            flight.
    """
    if not is_mma_layout(packed, scale):  # (it refuses MMA packed codes with [N, K/16] scales)
        raise ValueError(f"hopper_ws.launch: needs the MMA layout, got weight_packed {tuple(packed.shape)}")
    m, k = x.shape
    n = weight_shape(packed, scale)[0]
    x_layout, w_layout, s_layout = _smem_layouts(block_m)
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, 64], x_layout)
    w_desc = TensorDescriptor(packed, [n // 64, 16, 2 * k // 256, 256], [32 * k, 2 * k, 256, 1], [tiles, 4, 2, 256],
                              w_layout)  # fmt: skip
    s_desc = TensorDescriptor(scale.view(torch.uint8), [n // 64, 4 * k], [4 * k, 1], [tiles, 256], s_layout)
    units = triton.cdiv(m, block_m) * (n // (64 * tiles)) * (k // (64 * sub))
    g = min(programs or num_sms(x.device), units)
    slots = 4 * g if fixup else 2 * g  # (first/last segment ×) program × consumer
    if flags.numel() < slots:
        raise ValueError(f"hopper_ws.launch: {flags.numel()} flags for {g} programs (needs {slots})")
    ws = torch.empty((slots, 32 * tiles * block_m), dtype=torch.float32, device=x.device)
    _ws_linear_kernel[(g,)](x_desc, w_desc, s_desc, global_scale, bias if bias is not None else y, y, ws, flags, m, n,
                            k, y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, T=tiles, STAGES=stages,
                            SUB=sub, FIXUP=fixup, num_warps=4, INFLIGHT=inflight,
                            maxnreg=MAXNREG)  # fmt: skip
    return y


def _smem_layouts(block_m: int):
    """The TMA boxes' shared-memory layouts: x (128-byte swizzle, the wgmma B operand), packed weight and scales
    (plain rows of bytes: each consumer warp reads whole 512-byte weight rows, conflict-free without a swizzle)."""
    return (gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.bfloat16),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=4),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))  # fmt: skip


def compile_sm90(block_m: int, tiles: int, stages: int, sub: int, fixup: bool = False, has_bias: bool = True,
                 inflight: bool = False):
    """The kernel compiled for sm_90a without a GPU (Triton's compiler with a ``GPUTarget``; CI's build check and
    ``benchmarks/kernel_sass.py@1486a77 --ws``): ``.asm["cubin"]``, ``["ptx"]``, ``["ttgir"]``, ``.metadata.shared``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    xl, wl, sl = _smem_layouts(block_m)
    s_type = f"u8[{tiles}, 256]"
    fn = _ws_linear_kernel
    sig = {"x_desc": f"tensordesc<bf16[{block_m}, 64],{xl!r}>", "w_desc": f"tensordesc<u8[{tiles}, 4, 2, 256],{wl!r}>",
           "s_desc": f"tensordesc<{s_type},{sl!r}>", "g_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "flag_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32",
           "HAS_BIAS": "constexpr", "BLOCK_M": "constexpr", "T": "constexpr", "STAGES": "constexpr", "SUB": "constexpr",
           "FIXUP": "constexpr", "num_warps": "constexpr", "INFLIGHT": "constexpr"}  # fmt: skip
    consts = {"HAS_BIAS": has_bias, "BLOCK_M": block_m, "T": tiles, "STAGES": stages, "SUB": sub, "FIXUP": fixup,
              "num_warps": 4, "INFLIGHT": inflight}  # fmt: skip
    aligned = ("g_ptr", "b_ptr", "y_ptr", "ws_ptr", "flag_ptr", "N", "K", "stride_ym")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=MAXNREG))  # fmt: skip


_FLAGS: dict[torch.device, torch.Tensor] = {}


def ws_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
              bias: torch.Tensor | None = None, **config) -> torch.Tensor:  # fmt: skip
    """:func:`launch` with its own output and flags (benchmarks, tests); ``config``: :func:`launch`'s tile arguments."""
    m, n = x.shape[0], weight_shape(packed, scale)[0]
    flags = _FLAGS.get(x.device)
    if flags is None:
        flags = _FLAGS[x.device] = torch.zeros(1024, dtype=torch.int32, device=x.device)
    alloc = partial(torch.full, fill_value=float("nan")) if POISON else torch.empty
    return launch(x, packed, scale, global_scale, bias, alloc((m, n), dtype=x.dtype, device=x.device), flags, **config)
