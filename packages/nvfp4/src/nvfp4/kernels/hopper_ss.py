"""Kernel v4 spike (round 12): warp-specialised W4A16 NVFP4 GEMM for Hopper with both ``wgmma`` operands in shared
memory (SS form), in Gluon. Not in the dispatch table yet.

``yᵀ = W · xᵀ``. Round 10's kernel decodes the 4-bit weight into the registers of ``wgmma``'s A operand; ptxas
serialises a register-A ``wgmma`` whose operand registers are written while any ``wgmma`` is in flight (C7515), so
each consumer warpgroup can only decode, issue, then wait. Here the roles are split so that no warpgroup both decodes
and multiplies:

* a producer warp streams x tiles, 4-bit weight tiles (MMA layout, :mod:`nvfp4.layout`) and FP8 block scales by TMA
  into a ring of ``STAGES`` load stages (exactly as :mod:`nvfp4.kernels.hopper_ws`);
* transform warpgroups decode a stage's weight tile (the same 9-instruction word decode and bf16 scale multiply as
  round 10) and store the bf16 tile into a second ring of ``ASTAGES`` shared-memory A tiles (128-byte swizzle, the
  layout ``wgmma`` reads), fence the async proxy and arrive on the tile's ``a_ready`` barrier;
* MMA warpgroups (two, each owning half of the ``64·T`` output rows of a tile) only wait on barriers and issue
  ``wgmma`` with A *and* B from shared memory, keeping one ``wgmma`` group in flight across stages
  (``warpgroup_mma_wait(1)``), so the tensor pipe is fed back to back while the transform warpgroups decode ahead.

``xf`` picks the partitions: 2 transform warpgroups (one per half) beside the producer warp, 1 (decoding both
halves), or 0 (one warpgroup that decodes and also issues the loads: three warpgroups, 384 threads, the only form
with the registers for a 64×256 accumulator, see :data:`SPIKE_CONFIGS`). The barrier protocol is replayed on the
CPU in ``tests/nvfp4/test_hopper_ss.py``; the design, its budget and the SASS are docs/kernels.md's round 12.

Scheduling (persistent grid, stream-K over (tile, unit) pairs, the serial or the parallel split-tile sum) and the
epilogue are round 10/11's (:mod:`nvfp4.kernels.hopper_ws`), so a timing difference is the mainloop's.
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

from .hopper_ws import (
    _parallel_fixup,
    _participants,
    _producer,
    _segment,
    _smem_layouts,
    _stage_operand,
    _store_rows,
    num_sms,
)

POISON = False  # tests: outputs start as NaN, so an element the kernel never writes cannot pass


@gluon.jit
def _decode_half(w_bufs, s_bufs, a_bufs, ready, a_empty, i, kk, H: gl.constexpr, TC: gl.constexpr,
                 STAGES: gl.constexpr, ASTAGES: gl.constexpr, a_layout: gl.constexpr, p_layout: gl.constexpr,
                 s_layout: gl.constexpr):  # fmt: skip
    """Wait for A slot ``i`` of half ``H`` to be free, decode the half's rows of load stage ``i`` into it."""
    sa = i % ASTAGES
    mbarrier.wait(a_empty.index(H * ASTAGES + sa), ((i // ASTAGES) & 1) ^ 1)
    w = _stage_operand(w_bufs, s_bufs, ready, i, kk, H, TC, STAGES, a_layout, p_layout, s_layout)
    a_bufs.index(H * ASTAGES + sa).store(w)


@gluon.jit
def _transform(w_bufs, s_bufs, a_bufs, ready, empty, a_ready, a_empty, u0, u1, KU, H0: gl.constexpr,
               NH: gl.constexpr, TC: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
               ASTAGES: gl.constexpr, SUB: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Decode half ``H0`` (and ``H0 + 1`` when ``NH == 2``; ``64·TC`` rows each) of every load stage's weight tile
    into the A ring."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    p_layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [WARPS, 1], [1, 0])
    s_layout: gl.constexpr = gl.SliceLayout(2, gl.reshape(gl.zeros([64 * TC, 64], gl.bfloat16, a_layout),
                                                          (64 * TC, 4, 16)).type.layout)  # fmt: skip
    i = 0
    u = u0
    while u < u1:
        tile, kb, ke = _segment(u, u1, KU)
        for kk in range(kb * SUB, ke * SUB):
            sa = i % ASTAGES
            _decode_half(w_bufs, s_bufs, a_bufs, ready, a_empty, i, kk, H0, TC, STAGES, ASTAGES, a_layout, p_layout,
                         s_layout)  # fmt: skip
            if NH == 2:
                _decode_half(w_bufs, s_bufs, a_bufs, ready, a_empty, i, kk, H0 + 1, TC, STAGES, ASTAGES, a_layout,
                             p_layout, s_layout)  # fmt: skip
            fence_async_shared()  # the generic-proxy stores before wgmma (async proxy) reads them
            mbarrier.arrive(a_ready.index(H0 * ASTAGES + sa), count=1)
            if NH == 2:
                mbarrier.arrive(a_ready.index((H0 + 1) * ASTAGES + sa), count=1)
            mbarrier.arrive(empty.index(i % STAGES), count=1)  # this stage's weight and scales are in registers
            i += 1
        u += ke - kb


@gluon.jit
def _load_stage(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, empty, ready, j, u0, KU, num_m,
                BLOCK_M: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr):  # fmt: skip
    """Issue the TMA loads of the program's load stage ``j`` (unit ``u0 + j // SUB``), as ``_producer`` does."""
    st = j % STAGES
    unit = u0 + j // SUB
    tile = unit // KU
    kk = (unit % KU) * SUB + j % SUB
    mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
    fence_async_shared()
    mbarrier.expect(ready.index(st), x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [(tile % num_m) * BLOCK_M, kk * 64], ready.index(st), x_bufs.index(st))
    tma.async_copy_global_to_shared(s_desc, [(tile // num_m) * T * 64, (kk // 4) * 4], ready.index(st), s_bufs.index(st))
    tma.async_copy_global_to_shared(w_desc, [(tile // num_m) * T, 4 * (kk % 4), 2 * (kk // 4), 0], ready.index(st),
                                    w_bufs.index(st))  # fmt: skip


@gluon.jit
def _transform_producer(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, a_bufs, ready, empty, a_ready, a_empty, u0,
                        u1, KU, num_m, TC: gl.constexpr, BLOCK_M: gl.constexpr, T: gl.constexpr,
                        STAGES: gl.constexpr, ASTAGES: gl.constexpr, SUB: gl.constexpr,
                        WARPS: gl.constexpr):  # fmt: skip
    """``xf = 0``: one warpgroup both loads and decodes (3 warpgroups, 384 threads: 168 registers a thread, room for
    a 64×256 accumulator). Stage ``i + STAGES - 2``'s loads go out before stage ``i`` is decoded: its slot held
    stage ``i - 2``, which the MMA warpgroups release once they have issued stage ``i - 1`` (decoded already); a
    lead of ``STAGES - 1`` would wait for stage ``i - 1``'s release, which needs stage ``i``'s decode: a deadlock."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    p_layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [WARPS, 1], [1, 0])
    s_layout: gl.constexpr = gl.SliceLayout(2, gl.reshape(gl.zeros([64 * TC, 64], gl.bfloat16, a_layout),
                                                          (64 * TC, 4, 16)).type.layout)  # fmt: skip
    LEAD: gl.constexpr = STAGES - 2
    n_st = (u1 - u0) * SUB
    for j in range(0, gl.minimum(LEAD, n_st)):
        _load_stage(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, empty, ready, j, u0, KU, num_m, BLOCK_M, T,
                    STAGES, SUB)  # fmt: skip
    for i in range(0, n_st):
        if i + LEAD < n_st:
            _load_stage(x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, empty, ready, i + LEAD, u0, KU, num_m,
                        BLOCK_M, T, STAGES, SUB)  # fmt: skip
        unit = u0 + i // SUB
        kk = (unit % KU) * SUB + i % SUB
        sa = i % ASTAGES
        _decode_half(w_bufs, s_bufs, a_bufs, ready, a_empty, i, kk, 0, TC, STAGES, ASTAGES, a_layout, p_layout,
                     s_layout)  # fmt: skip
        _decode_half(w_bufs, s_bufs, a_bufs, ready, a_empty, i, kk, 1, TC, STAGES, ASTAGES, a_layout, p_layout,
                     s_layout)  # fmt: skip
        fence_async_shared()
        mbarrier.arrive(a_ready.index(sa), count=1)
        mbarrier.arrive(a_ready.index(ASTAGES + sa), count=1)
        mbarrier.arrive(empty.index(i % STAGES), count=1)


@gluon.jit
def _mma(x_bufs, a_bufs, ready, empty, a_ready, a_empty, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G, U, KU,
         num_m, M, N, stride_ym, WG: gl.constexpr, TC: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
         T: gl.constexpr, STAGES: gl.constexpr, ASTAGES: gl.constexpr, WARPS: gl.constexpr, SUB: gl.constexpr,
         FIXUP: gl.constexpr):  # fmt: skip
    """One MMA warpgroup: rows ``[64·TC·WG, 64·TC·(WG+1))`` of each ``64·T``-row tile, SS ``wgmma`` only."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    rows_c = gl.arange(0, 64 * TC, layout=gl.SliceLayout(1, acc_layout))
    cols_c = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    slot = rows_c[:, None] * BLOCK_M + cols_c[None, :]
    me = gl.program_id(0)
    post = 16384.0 / gl.load(g_ptr)
    i = 0
    u = u0
    while u < u1:
        tile, kb, ke = _segment(u, u1, KU)
        n0 = (tile // num_m) * 64 * T
        acc = gl.zeros([64 * TC, BLOCK_M], gl.float32, acc_layout)
        i_first = i
        for _kk in range(kb * SUB, ke * SUB):
            st = i % STAGES
            sa = i % ASTAGES
            mbarrier.wait(a_ready.index(WG * ASTAGES + sa), (i // ASTAGES) & 1)
            mbarrier.wait(ready.index(st), (i // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(WG * ASTAGES + sa), x_bufs.index(st).permute((1, 0)), acc, is_async=True)
            # one wgmma group stays in flight: the previous stage's has retired, its buffers go back
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if i > i_first:
                mbarrier.arrive(a_empty.index(WG * ASTAGES + (i - 1) % ASTAGES), count=1)
                mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(a_empty.index(WG * ASTAGES + (i - 1) % ASTAGES), count=1)
        mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
        u += ke - kb
        if FIXUP:
            if (kb == 0) & (ke == KU):
                _store_rows(acc, rows_c, cols_c, n0, tile, post, b_ptr, y_ptr, num_m, M, N, stride_ym, WG, TC, HAS_BIAS,
                            BLOCK_M)  # fmt: skip
            else:
                j = (u - (ke - kb) != u0).to(gl.int32)
                pf, pl = _participants(tile, G, U, KU)
                slot_t = cols_c[None, :] * (64 * TC) + rows_c[:, None]
                gl.store(ws_ptr + (j * 2 * G + 2 * me + WG).to(gl.int64) * (64 * TC * BLOCK_M) + slot_t, acc)
                gl.thread_barrier()
                gl.atomic_xchg(flag_ptr + 4 * me + 2 * j + WG, pl - pf + 1, sem="release", scope="gpu")
        else:
            flag = flag_ptr + 2 * me + WG
            if kb > 0:
                gl.store(ws_ptr + (2 * me + WG).to(gl.int64) * (64 * TC * BLOCK_M) + slot, acc)
                gl.thread_barrier()
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
        t0, kb0, ke0 = _segment(u0, u1, KU)
        if (kb0 > 0) | (ke0 < KU):
            _parallel_fixup(t0, me, u0, ws_ptr, flag_ptr, post, b_ptr, y_ptr, G, U, KU, num_m, M, N, stride_ym, WG,
                            TC, HAS_BIAS, BLOCK_M, T, WARPS)  # fmt: skip
        t1 = (u1 - 1) // KU
        if (t1 != t0) & (u1 - t1 * KU < KU):
            _parallel_fixup(t1, me, u0, ws_ptr, flag_ptr, post, b_ptr, y_ptr, G, U, KU, num_m, M, N, stride_ym, WG,
                            TC, HAS_BIAS, BLOCK_M, T, WARPS)  # fmt: skip


@gluon.jit
def _ss_linear_kernel(x_desc, w_desc, s_desc, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, M, N, K, stride_ym,
                      HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, T: gl.constexpr, STAGES: gl.constexpr,
                      ASTAGES: gl.constexpr, SUB: gl.constexpr, XF: gl.constexpr, FIXUP: gl.constexpr,
                      num_warps: gl.constexpr):  # fmt: skip
    """Persistent stream-K as :func:`nvfp4.kernels.hopper_ws._ws_linear_kernel`; partitions: MMA warpgroup 0 (the
    default partition), MMA warpgroup 1, ``XF`` transform warpgroups (1: one decodes both halves; 2: one per half),
    the producer warp."""
    num_m = gl.cdiv(M, BLOCK_M)
    KU = K // (64 * SUB)
    U = num_m * (N // (64 * T)) * KU
    G = gl.num_programs(0)
    me = gl.program_id(0)
    u0 = me * U // G
    u1 = (me + 1) * U // G
    TC: gl.constexpr = T // 2

    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64 * TC, 64], gl.bfloat16)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, T, 4, 2, 256], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, 64 * T, 4], s_desc.layout)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * ASTAGES, 64 * TC, 64], a_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [2 * ASTAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [2 * ASTAGES, 1], mbarrier.MBarrierLayout())
    # a load stage is released by the MMA warpgroups (x read) and the transforms (weight read; xf = 0: one)
    NE: gl.constexpr = 4 if XF == 2 else 3
    for s in gl.static_range(STAGES):
        mbarrier.init(empty.index(s), count=NE)
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(2 * ASTAGES):
        mbarrier.init(a_empty.index(s), count=1)
        mbarrier.init(a_ready.index(s), count=1)

    if XF == 0:
        gl.warp_specialize(
            [
                (_mma, (x_bufs, a_bufs, ready, empty, a_ready, a_empty, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G,
                        U, KU, num_m, M, N, stride_ym, 0, TC, HAS_BIAS, BLOCK_M, T, STAGES, ASTAGES, num_warps, SUB,
                        FIXUP)),
                (_mma, (x_bufs, a_bufs, ready, empty, a_ready, a_empty, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G,
                        U, KU, num_m, M, N, stride_ym, 1, TC, HAS_BIAS, BLOCK_M, T, STAGES, ASTAGES, num_warps, SUB,
                        FIXUP)),
                (_transform_producer, (x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, a_bufs, ready, empty, a_ready,
                                       a_empty, u0, u1, KU, num_m, TC, BLOCK_M, T, STAGES, ASTAGES, SUB, 4)),
            ],
            [num_warps, 4],
            [168, 168],
        )  # fmt: skip
    elif XF == 2:
        gl.warp_specialize(
            [
                (_mma, (x_bufs, a_bufs, ready, empty, a_ready, a_empty, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G, U, KU, num_m, M, N,
                      stride_ym, 0, TC, HAS_BIAS, BLOCK_M, T, STAGES, ASTAGES, num_warps, SUB, FIXUP)),
                (_mma, (x_bufs, a_bufs, ready, empty, a_ready, a_empty, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G, U, KU, num_m, M, N,
                      stride_ym, 1, TC, HAS_BIAS, BLOCK_M, T, STAGES, ASTAGES, num_warps, SUB, FIXUP)),
                (_transform, (w_bufs, s_bufs, a_bufs, ready, empty, a_ready, a_empty, u0, u1, KU, 0, 1, TC, BLOCK_M, STAGES, ASTAGES, SUB, 4)),
                (_transform, (w_bufs, s_bufs, a_bufs, ready, empty, a_ready, a_empty, u0, u1, KU, 1, 1, TC, BLOCK_M, STAGES, ASTAGES, SUB, 4)),
                (_producer, (x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, empty, ready, u0, u1, KU, num_m, BLOCK_M,
                             T, STAGES, SUB)),
            ],
            [num_warps, 4, 4, 1],
            [160, 80, 80, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_mma, (x_bufs, a_bufs, ready, empty, a_ready, a_empty, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G, U, KU, num_m, M, N,
                      stride_ym, 0, TC, HAS_BIAS, BLOCK_M, T, STAGES, ASTAGES, num_warps, SUB, FIXUP)),
                (_mma, (x_bufs, a_bufs, ready, empty, a_ready, a_empty, g_ptr, b_ptr, y_ptr, ws_ptr, flag_ptr, u0, u1, G, U, KU, num_m, M, N,
                      stride_ym, 1, TC, HAS_BIAS, BLOCK_M, T, STAGES, ASTAGES, num_warps, SUB, FIXUP)),
                (_transform, (w_bufs, s_bufs, a_bufs, ready, empty, a_ready, a_empty, u0, u1, KU, 0, 2, TC, BLOCK_M, STAGES, ASTAGES, SUB, 4)),
                (_producer, (x_desc, w_desc, s_desc, x_bufs, w_bufs, s_bufs, empty, ready, u0, u1, KU, num_m, BLOCK_M,
                             T, STAGES, SUB)),
            ],
            [num_warps, 4, 1],
            [160, 120, 24],
        )  # fmt: skip


def supported(x: torch.Tensor, n: int, k: int, tiles: int) -> bool:
    """As :func:`nvfp4.kernels.hopper_ws.supported` (bf16 on sm_90, whole ``64·tiles``-row tiles, K % 256 == 0)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) == (9, 0)
            and n % (64 * tiles) == 0 and k % 256 == 0)  # fmt: skip


def launch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, y: torch.Tensor, flags: torch.Tensor, block_m: int = 128, tiles: int = 2,
           stages: int = 6, astages: int = 3, sub: int = 1, xf: int = 2, programs: int | None = None,
           fixup: bool = False) -> torch.Tensor:  # fmt: skip
    """``y = x · dequant(W)ᵀ + bias`` into ``y``; the arguments as :func:`nvfp4.kernels.hopper_ws.launch` (``packed``
    in the MMA layout), plus ``astages`` (decoded A tiles per MMA warpgroup, ≥ 2) and ``xf`` (transform
    warpgroups: 1 or 2 beside the producer warp; 0: one warpgroup that also issues the loads, ``stages`` ≥ 3)."""
    if astages < 2 or stages < (3 if xf == 0 else 2):
        # an MMA warpgroup holds two stages' tiles (one wgmma group in flight): one A tile per half deadlocks
        raise ValueError(f"hopper_ss.launch: astages={astages}, stages={stages} (needs astages >= 2, stages >= 2, 3 at xf = 0)")
    m, k = x.shape
    n = scale.shape[0]
    x_layout, w_layout, s_layout = _smem_layouts(block_m)
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, 64], x_layout)
    w_desc = TensorDescriptor(packed, [n // 64, 16, 2 * k // 256, 256], [32 * k, 2 * k, 256, 1], [tiles, 4, 2, 256],
                              w_layout)  # fmt: skip
    s_desc = TensorDescriptor(scale.view(torch.int32), [n, k // 64], [k // 64, 1], [64 * tiles, 4], s_layout)
    units = triton.cdiv(m, block_m) * (n // (64 * tiles)) * (k // (64 * sub))
    g = min(programs or num_sms(x.device), units)
    slots = 4 * g if fixup else 2 * g
    if flags.numel() < slots:
        raise ValueError(f"hopper_ss.launch: {flags.numel()} flags for {g} programs (needs {slots})")
    ws = torch.empty((slots, 32 * tiles * block_m), dtype=torch.float32, device=x.device)
    _ss_linear_kernel[(g,)](x_desc, w_desc, s_desc, global_scale, bias if bias is not None else y, y, ws, flags, m, n,
                            k, y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, T=tiles, STAGES=stages,
                            ASTAGES=astages, SUB=sub, XF=xf, FIXUP=fixup, num_warps=4)  # fmt: skip
    return y


def compile_sm90(block_m: int = 128, tiles: int = 2, stages: int = 6, astages: int = 3, sub: int = 1, xf: int = 2,
                 fixup: bool = False, has_bias: bool = True):  # fmt: skip
    """The kernel compiled for sm_90a without a GPU (``.asm["cubin"]``, ``["ptx"]``, ``["ttgir"]``, ``.metadata``):
    the CPU build check and ``benchmarks/kernel_sass.py --ss``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    xl, wl, sl = _smem_layouts(block_m)
    fn = _ss_linear_kernel
    sig = {"x_desc": f"tensordesc<bf16[{block_m}, 64],{xl!r}>", "w_desc": f"tensordesc<u8[{tiles}, 4, 2, 256],{wl!r}>",
           "s_desc": f"tensordesc<i32[{64 * tiles}, 4],{sl!r}>", "g_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "flag_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32",
           "HAS_BIAS": "constexpr", "BLOCK_M": "constexpr", "T": "constexpr", "STAGES": "constexpr",
           "ASTAGES": "constexpr", "SUB": "constexpr", "XF": "constexpr", "FIXUP": "constexpr",
           "num_warps": "constexpr"}  # fmt: skip
    consts = {"HAS_BIAS": has_bias, "BLOCK_M": block_m, "T": tiles, "STAGES": stages, "ASTAGES": astages, "SUB": sub,
              "XF": xf, "FIXUP": fixup, "num_warps": 4}  # fmt: skip
    aligned = ("g_ptr", "b_ptr", "y_ptr", "ws_ptr", "flag_ptr", "N", "K", "stride_ym")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))  # fmt: skip


_FLAGS: dict[torch.device, torch.Tensor] = {}

# The spike's configs per M (7B gate / down): (block_m, tiles, stages, astages, sub, xf, fixup). Shared memory at
# block_m = 128: 6 load stages × (16 KB x + 4 KB weight + 2 KB scales) + 2 halves × 3 decoded 64×64 bf16 A tiles
# (8 KB each) = 180 KB of the 227 KB; block_m = 256: 4 × 38 KB + 2 × 2 × 8 KB = 184 KB.
# block_m = 256 needs xf = 0: ptxas compiles every partition under the kernel's .maxnreg (65536 / threads: 96 at
# xf = 2's 640 threads — Triton pads the producer warp to a warpgroup — 128 at xf = 1's 512; a setmaxnreg region of
# 208 registers does not lift it, tried on the PTX), and a 64×256 fp32 accumulator needs ≥ 154 (C7602); xf = 0's
# three warpgroups (384 threads) get 168.
SPIKE_CONFIGS = {64: (64, 2, 8, 3, 1, 2, False), 128: (128, 2, 6, 3, 1, 2, False), 256: (256, 2, 4, 2, 1, 0, False)}
# the second arm of the spike (gemm.py --spike's ss_alt): one transform warpgroup decoding both halves at M ≤ 128;
# at M = 256 two 128-token blocks of each weight tile (adjacent in the schedule: the tile streams from HBM once)
SPIKE_ALT_CONFIGS = {64: (64, 2, 8, 3, 1, 1, False), 128: (128, 2, 6, 3, 1, 1, False),
                     256: (128, 2, 6, 3, 1, 2, False)}  # fmt: skip


def ss_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
              bias: torch.Tensor | None = None, **config) -> torch.Tensor:  # fmt: skip
    """:func:`launch` with its own output and flags (benchmarks, tests); ``config``: :func:`launch`'s tile arguments."""
    m, n = x.shape[0], scale.shape[0]
    flags = _FLAGS.get(x.device)
    if flags is None:
        flags = _FLAGS[x.device] = torch.zeros(1024, dtype=torch.int32, device=x.device)
    alloc = partial(torch.full, fill_value=float("nan")) if POISON else torch.empty
    return launch(x, packed, scale, global_scale, bias, alloc((m, n), dtype=x.dtype, device=x.device), flags, **config)


def spike_config(m: int, alt: bool = False) -> dict:
    """:data:`SPIKE_CONFIGS`'s (``alt``: :data:`SPIKE_ALT_CONFIGS`'s) entry for ``m`` (the first M at or above it;
    256's beyond) as :func:`launch` kwargs."""
    table = SPIKE_ALT_CONFIGS if alt else SPIKE_CONFIGS
    key = next((k for k in sorted(table) if m <= k), max(table))
    bm, tiles, stages, astages, sub, xf, fixup = table[key]
    return dict(block_m=bm, tiles=tiles, stages=stages, astages=astages, sub=sub, xf=xf, fixup=fixup)
