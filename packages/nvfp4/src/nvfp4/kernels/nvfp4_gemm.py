"""Triton W4A16 NVFP4 GEMMs for Hopper: ``y = x · dequant(W)ᵀ (+ b)`` and ``dx = dy · dequant(W)``.

The kernels, one family per file, each beside the PyTorch reference it is tested against
(``x · nvfp4.codec.dequantize(W)ᵀ``, ``tests/nvfp4/test_kernels.py``):

* :mod:`nvfp4.kernels.decode`: the weight layouts the kernels read, the decoders, shared epilogues;
* :mod:`nvfp4.kernels.small_m`: decode sizes (split-K, fused LoRA, the CUDA-core GEMV);
* :mod:`nvfp4.kernels.large_m`: batched rollouts, prefill and training (tensor-core bound);
* :mod:`nvfp4.kernels.dgrad`: the fused backward product; :mod:`nvfp4.kernels.dequant`: the dequantizer.

This module holds the configs, the dispatch (:func:`linear_config`, frozen per shape in
:mod:`nvfp4.kernels.dispatch_table`) and the launchers.

Everything is launched from plain Python with static shapes, no host sync and no data-dependent allocation,
so the custom ops in :mod:`nvfp4.ops` are safe under ``torch.compile`` and CUDA-graph capture.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import triton

from ..layout import is_mma_layout, weight_shape
from . import dispatch_table, hopper_ws
from .dequant import _dequant_kernel, _dequant_mma_kernel
from .dgrad import _dgrad_kernel, _dgrad_mma_kernel
from .large_m import _linear_large_m_kernel
from .small_m import _gemv_kernel, _linear_kernel, _linear_mma_kernel, _splitk_reduce_kernel

__all__ = [
    "DgradConfig",
    "JIT_KERNELS",
    "LinearConfig",
    "NUM_SMS",
    "dequantize_triton",
    "dgrad_config",
    "linear_config",
    "mma_config",
    "nvfp4_linear",
    "nvfp4_linear_dgrad",
    "nvfp4_lora_linear",
    "pick_split",
    "splitk_counters_left",
]

#: the GEMM's Triton kernels by name, for tools that compile them for sm_90 without a GPU (benchmarks/kernel_sass.py)
JIT_KERNELS = {"linear_mma": _linear_mma_kernel, "linear_large_m": _linear_large_m_kernel, "linear": _linear_kernel}

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


#: activation dtypes the fused kernels compute in; any other (float32, float64) takes dequantize + matmul, a full
#: precision product in that dtype (the reference's numbers)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# Configs (tuned on one H100 SXM, see docs/kernels.md)
# ----------------------------------------------------------------------------------------------------------------
#: the H100's SMs, which the configs below are tuned for (benchmarks/gemm.py's sweep reads it too)
NUM_SMS = 132


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
    ws: bool = False  # hopper_ws: warp-specialised persistent stream-K (block_n = 64·tiles; num_stages; sub below)
    sub: int = 1  # hopper_ws: pipeline stages (64 inputs each) per stream-K unit
    ws_fixup: bool = False  # hopper_ws: a split tile's programs each sum a share of it (launch(fixup=True))


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


def pick_split(tiles: int, k: int, block_k: int, target: int = 2 * NUM_SMS, min_k: int = 512) -> int:
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
GEMV_TARGET = 4 * NUM_SMS  # split K until ~4 programs per SM
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
        return entry_config(dispatch_table.lookup(m, n, k), m, n, k)
    return _decode_config(m, n, k)


def entry_config(entry: dispatch_table.Entry, m: int, n: int, k: int) -> LinearConfig:
    """The :class:`LinearConfig` of a :mod:`~nvfp4.kernels.dispatch_table` entry for ``(m, n, k)``."""
    if entry == "dequant":
        return LinearConfig(dequant=True, mma=True)
    if entry == "decode":
        return _decode_config(m, n, k)
    if entry[0] == "ws":
        _, bm, tiles, stages, sub, *fixup = entry
        return LinearConfig(bm, 64 * tiles, 64, 1, 4, stages, True, mma=True, ws=True, sub=sub,
                            ws_fixup=bool(fixup and fixup[0]))  # fmt: skip
    tiles, quarters, bm, warps, stages, split = entry
    return LinearConfig(bm, 64 * tiles, 64 * quarters, split, warps, stages, True, mma=True, large_m=True)


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
        split = pick_split(triton.cdiv(n, bn), k, bk, target=GEMV_TARGET, min_k=GEMV_MIN_K)
        return LinearConfig(1, bn, bk, split, GEMV_WARPS, 1, gemv=True, prefetch=GEMV_PREFETCH)
    return tc_config(m, n, k, prefetch=m <= 16 and n <= TC_PREFETCH_MAX_N)


def tc_config(m: int, n: int, k: int, prefetch: bool = False) -> LinearConfig:
    """Tensor-core (:func:`_linear_kernel`) config for ``m ≤ FUSED_MAX_M``."""
    if m <= 32:
        bm = 16 if m <= 16 else 32
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, 64)
        split = pick_split(tiles, k, 128, target=4 * NUM_SMS)
        bk = 256 if split == 1 and k <= 4096 else 128  # short rows without split: a longer K step amortises more
        return LinearConfig(bm, 64, bk, split, 4, 1, True, prefetch=prefetch)
    if m <= 64:
        tiles = triton.cdiv(n, 128)
        return LinearConfig(64, 128, 128, pick_split(tiles, k, 128), 8, 1, True, prefetch=prefetch)
    tiles = triton.cdiv(m, 128) * triton.cdiv(n, 128)
    return LinearConfig(128, 128, 64, pick_split(tiles, k, 64), 4, 1, True, prefetch=prefetch)


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
    """Dense ``[N, K]`` ``dtype`` weight from packed uint8 ``[N, K/2]`` and fp8 ``[N, K/16]`` (or the MMA layout
    ``[N/4, 2K]`` and ``[N/64, 4K]``), fp32 ``[1]`` (one kernel)."""
    n, k = weight_shape(packed, scale)
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


def _lora_args(first: str, first_tensor: torch.Tensor, b: torch.Tensor, scaling: float, r: int) -> dict:
    """Kernel arguments of a fused adapter: ``first`` is ``a_ptr`` (A ``[R, K]``) or ``t_ptr`` (``x·Aᵀ`` ``[M, R]``)."""
    return {first: first_tensor, "lb_ptr": b, "lora_scale": float(scaling), "R": r, "HAS_LORA": True,
            "BLOCK_R": max(16, triton.next_power_of_2(r))}  # fmt: skip


def _launch_tc(x2, packed, scale, global_scale, bias, y, out, m, n, k, k_per_split, split, even_k, cfg, lora=None):
    """Launch :func:`_linear_kernel` (tensor-core path) into ``out`` (``y`` or the split-K workspace).

    ``lora``: ``(A [R, K], B [N, R], scaling)`` to fuse the adapter (``cfg.swap`` must be True).
    """
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    extra = {} if lora is None else _lora_args("a_ptr", lora[0], lora[1], lora[2], lora[0].shape[0])
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


def splitk_counters_left() -> int:
    """Split-K tickets and stream-K flags still non-zero, over every device's counters: 0 whenever no launch is in
    flight (each launch leaves what it used at zero), so a non-zero count names a launch that did not
    (the run-to-run probe checked it on an H200: benchmarks/results/repro_probe_h200_b78624b.log)."""
    return sum(int(c.count_nonzero()) for c in _SPLITK_COUNTERS.values())


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
        extra.update(_lora_args("a_ptr", lora[0], lora[1], lora[2], lora[0].shape[0]))
        block_r = extra["BLOCK_R"]
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


def _launch_large_m(x2, packed, scale, global_scale, bias, y, out, m, n, k, k_per_split, split, cfg, fast, lora=None):
    """Launch :func:`~nvfp4.kernels.large_m._linear_large_m_kernel` into ``out`` (``y``, or the ``[split, m, n]`` fp32 workspace).

    ``cfg``: a :class:`LinearConfig` with ``large_m`` (``block_n = 64·TILES``,
    ``block_k = 64·QUARTERS``). ``lora``: ``(t [m, R] in x's dtype, B [n, R], scaling)``.
    """
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    extra = {} if lora is None else _lora_args("t_ptr", lora[0], lora[1], lora[2], lora[0].shape[1])
    _linear_large_m_kernel[(tiles, split)](
        x2, packed, scale, global_scale, bias if bias is not None else y, out, m, n, k, x2.stride(0),
        y.stride(0) if split == 1 else n, k_per_split,
        HAS_BIAS=bias is not None, USE_WS=split > 1, TILES=cfg.block_n // 64, QUARTERS=cfg.block_k // 64,
        BLOCK_M=cfg.block_m, GROUP_M=cfg.group_m, FAST=fast, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **extra,
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
        x: ``[..., K]`` float16/bfloat16 (float32/float64 go through the dequantize path, a full precision product).
        packed: uint8 ``[N, K/2]`` and scale float8_e4m3fn ``[N, K/16]`` (compressed-tensors layout), or the MMA
            layout's ``[N/4, 2K]`` and ``[N/64, 4K]`` (:mod:`nvfp4.layout`); global_scale: float32 ``[1]``.
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
    H100 (``benchmarks/decode_profile.py@1486a77``). Here ``x · Aᵀ`` is accumulated in the base kernel from the activation
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
    n, k = weight_shape(packed, scale)
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
    n, k = weight_shape(packed, scale)
    if x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear: x has {x.shape[-1]} features, the weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if bias is not None:
        if tuple(bias.shape) != (n,):  # the kernels read n elements of it
            raise ValueError(f"nvfp4_linear: bias has shape {list(bias.shape)}, the weight's outputs need [{n}]")
        bias = bias.to(x.dtype).contiguous()
    if m == 0:
        return x.new_empty((*lead, n))
    cfg = config or linear_config(m, n, k, mma=mma)
    if cfg.large_m and not _large_m_runs(x.dtype):
        cfg = LinearConfig(dequant=True, mma=True)
    if cfg.ws:
        flags = _ws_flags(x2, cfg) if hopper_ws.supported(x2, n, k, cfg.block_n // 64) else None
        if flags is not None:
            return _linear_ws(x2, packed, scale, global_scale, bias, lora, cfg, flags).reshape(*lead, n)
        # fp16, the interpreter, another GPU, or a first call inside a graph capture (no flags yet): the form the
        # table's rule takes without this kernel
        cfg = _without_ws(m, n, k, x.dtype)
    if cfg.dequant or x.dtype not in _KERNEL_DTYPES:
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
        if lora is not None:  # x·Aᵀ by cuBLAS once, rounded to x's dtype as PEFT's lora_A output; ·Bᵀ in the epilogue
            lora = (torch.nn.functional.linear(x2, lora[0].to(x2.dtype)).contiguous(), lora[1], lora[2])
        _launch_large_m(x2, packed, scale, global_scale, bias, y, out, m, n, k, k_per_split, split, cfg, _fast(x.dtype),
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


def _without_ws(m: int, n: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """The config of :func:`mma_config` where the warp-specialised kernel cannot run (its table row's rule)."""
    cfg = entry_config(dispatch_table.generic(m, n, k), m, n, k)
    return LinearConfig(dequant=True, mma=True) if cfg.large_m and not _large_m_runs(dtype) else cfg


def _ws_flags(x2: torch.Tensor, cfg: LinearConfig) -> torch.Tensor | None:
    """The stream-K flags of :func:`hopper_ws.launch` (the split-K tickets; None where they cannot be had)."""
    return _splitk_counters(x2.device, (4 if cfg.ws_fixup else 2) * hopper_ws.num_sms(x2.device))


def _linear_ws(x2, packed, scale, global_scale, bias, lora, cfg, flags):
    """The warp-specialised kernel (:mod:`nvfp4.kernels.hopper_ws`, round 15 step A's scale pairs); a LoRA adapter is
    added by cuBLAS after it
    (``y += scaling · (x·Aᵀ)·Bᵀ``, ``x·Aᵀ`` rounded to x's dtype as PEFT's ``lora_A`` output is)."""
    m, n = x2.shape[0], weight_shape(packed, scale)[0]
    if x2.data_ptr() % 16 or x2.stride(0) % 8:  # TMA: 16-byte aligned base and rows
        x2 = x2.contiguous()
    y = _empty((m, n), x2.dtype, x2.device)
    hopper_ws.launch(x2, packed, scale, global_scale, bias, y, flags, block_m=cfg.block_m, tiles=cfg.block_n // 64,
                     stages=cfg.num_stages, sub=cfg.sub, fixup=cfg.ws_fixup)  # fmt: skip
    if lora is not None:
        a, b, scaling = lora
        t = torch.nn.functional.linear(x2, a.to(x2.dtype))
        y = torch.addmm(y, t, b.to(x2.dtype).t(), alpha=scaling)
    return y


def nvfp4_linear_dgrad(
    dy: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    config: DgradConfig | None = None,
) -> torch.Tensor:
    """``dx = dy · dequant(W)``: dy ``[..., N]`` float16/bfloat16 → dx ``[..., K]`` in ``dy.dtype`` (fp32 accumulation)."""
    mma = _check(packed, scale, global_scale)
    n, k = weight_shape(packed, scale)
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
    if cfg.dequant or dy.dtype not in _KERNEL_DTYPES:
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
