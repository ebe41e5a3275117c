"""Split-KV decode attention (flash-decoding) for rollouts on a static KV cache, as a transformers attention function.

Why: ``graph_generate`` decodes against a static cache of ``max_cache_len`` slots (prompt + all new tokens, fixed so
that one CUDA graph serves every step). SDPA attends over every slot and masks the unused ones: on the H100, at
batch 8 with a 1280-slot cache, attention took 3.5-4.9 ms of a 7B decode step (``benchmarks/decode_profile.py@1486a77 --cache-len
1280``), more than the NVFP4 GEMMs of all 28 layers (3.5 ms). Here each program reads the mask of its block of 64
slots first and skips the block's keys and values when none is attended, so the cost follows the tokens written so
far; and the keys are split over ``S`` programs per (row, KV head) so that batch 1 fills the GPU too.

Layout: ``q [B, H, 1, D]``, ``k``/``v`` ``[B, Hkv, L, D]`` (the cache), ``keep [B, L]`` bool (True = attend; the
``[B, 1, 1, L]`` mask transformers builds for SDPA), ``H = G · Hkv`` (GQA: query head ``h`` reads KV head
``h // G``). Program ``(b · Hkv + j, s)`` computes the ``G`` query heads of KV head ``j`` over blocks
``[s · BPS, (s + 1) · BPS)`` with an online softmax in fp32 (``exp2``) and writes ``(max, sum, acc)``; the combine
kernel merges the ``S`` partials per (row, KV head). Only ``q_len == 1`` takes this path; everything else (prefill,
training, CPU without Triton, dropout, soft-capping, sliding windows) goes to transformers' SDPA function.

Use it with :func:`register_decode_attention` and ``model.set_attn_implementation(DECODE_ATTENTION)``, or let
:func:`qerl_trl.rollout.graph.generate.graph_generate` switch it on for its decode loop (its default on CUDA).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

__all__ = [
    "DECODE_ATTENTION",
    "decode_attention",
    "decode_attention_forward",
    "decode_attention_reference",
    "register_decode_attention",
]

DECODE_ATTENTION = "qerl_decode"
BLOCK_N = 64  # cache slots per block (the unit of skipping)
TARGET_PROGRAMS = 4 * 132  # split the slots until about this many programs (H100: 132 SMs)
_LOG2E = 1.4426950408889634
# Tests set this to allocate the output with NaN, so an element the kernels never write cannot pass.
POISON_OUTPUTS = False


def decode_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain PyTorch: ``softmax(q·kᵀ·scale, masked by keep) · v`` in fp32, GQA by repeating KV heads.

    Args: q ``[B, H, 1, D]``; k, v ``[B, Hkv, L, D]``; keep ``[B, L]`` bool; scale: the softmax scale.
    Returns: ``[B, 1, H, D]`` in ``q.dtype`` (zeros for a row with no attended slot).
    """
    g = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale  # [B, H, 1, L]
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2).to(q.dtype)


@triton.jit
def _decode_attention_split_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, m_ptr, l_ptr, acc_ptr, L, HKV, G, S, BPS,
                                   qk_scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb,
                                   stride_vh, stride_vl, stride_mb, stride_ml, BLOCK_G: tl.constexpr,
                                   BLOCK_N: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """Partial attention of the ``G`` query heads of one (row, KV head) over one split of the cache slots."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    b = pid // HKV
    j = pid % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    q = tl.load(q_ptr + b * stride_qb + (j * G + offs_g)[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None],
                other=0.0)  # fmt: skip
    k_base = k_ptr + b * stride_kb + j * stride_kh
    v_base = v_ptr + b * stride_vb + j * stride_vh
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, D), dtype=tl.float32)
    lo = s * BPS * BLOCK_N
    hi = tl.minimum(lo + BPS * BLOCK_N, L)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        keep = tl.load(keep_ptr + b * stride_mb + offs_n * stride_ml, mask=offs_n < hi, other=0) != 0
        if tl.max(keep.to(tl.int32), axis=0) > 0:  # a block no query attends to is never read
            kt = tl.load(k_base + offs_n[:, None] * stride_kl + offs_d[None, :], mask=keep[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(kt)) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
            sc = tl.where(keep[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_base + offs_n[:, None] * stride_vl + offs_d[None, :], mask=keep[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
    row = (pid * S + s) * BLOCK_G + offs_g
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)
    tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc)


@triton.jit
def _decode_attention_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, HKV, G, S, stride_ob, stride_oh,
                                     BLOCK_G: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """Merge the ``S`` partials of one (row, KV head) into ``o[b, j·G + g, :]``."""
    pid = tl.program_id(0)
    b = pid // HKV
    j = pid % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    for s in range(0, S):
        m = tl.maximum(m, tl.load(m_ptr + (pid * S + s) * BLOCK_G + offs_g))
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no attended slot: every weight below is exp2(-inf) = 0
    l_tot = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, D), dtype=tl.float32)
    for s in range(0, S):
        row = (pid * S + s) * BLOCK_G + offs_g
        w = tl.exp2(tl.load(m_ptr + row) - m_safe)
        l_tot += w * tl.load(l_ptr + row)
        acc += w[:, None] * tl.load(acc_ptr + row[:, None] * D + offs_d[None, :])
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    o = o_ptr + b * stride_ob + (j * G + offs_g)[:, None] * stride_oh + offs_d[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=(offs_g < G)[:, None])


def _split_plan(batch: int, hkv: int, length: int) -> tuple[int, int]:
    """(blocks per split, number of splits) so that ``batch · hkv · splits`` is about ``TARGET_PROGRAMS``."""
    blocks = triton.cdiv(length, BLOCK_N)
    bps = max(1, triton.cdiv(batch * hkv * blocks, TARGET_PROGRAMS))
    return bps, triton.cdiv(blocks, bps)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step of attention over a static cache, skipping unattended blocks of 64 slots.

    Args:
        q: ``[B, H, 1, D]`` float16/bfloat16/float32 (any strides with a contiguous last dim).
        k, v: ``[B, Hkv, L, D]``, same dtype, last dim contiguous; ``H % Hkv == 0``; ``D`` a power of two, 16-256.
        keep: ``[B, L]`` bool, True where the query attends (broadcast rows allowed).
        scale: softmax scale (``1/sqrt(D)`` for the models here).

    Returns:
        ``[B, 1, H, D]`` in ``q.dtype`` (transformers' attention-output layout); zeros for a row with no attended slot.
    """
    b, h, q_len, d = q.shape
    if q_len != 1:
        raise ValueError(f"decode_attention: one query token per row, got q of shape {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(f"decode_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"decode_attention: head dim {d} is not a power of two in [16, 256]")
    if keep.dim() != 2 or keep.shape[-1] != k.shape[2] or keep.dtype != torch.bool:
        raise ValueError(f"decode_attention: keep must be bool [B, L={k.shape[2]}], got {keep.dtype} {tuple(keep.shape)}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise TypeError(f"decode_attention: dtypes differ (q {q.dtype}, k {k.dtype}, v {v.dtype})")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention: the head dim of q, k and v must be contiguous")
    hkv, length = k.shape[1], k.shape[2]
    g = h // hkv
    block_g = max(16, triton.next_power_of_2(g))
    bps, splits = _split_plan(b, hkv, length)
    keep = keep.expand(b, length)
    ws = b * hkv * splits * block_g
    m = torch.empty(ws, dtype=torch.float32, device=q.device)
    lsum = torch.empty(ws, dtype=torch.float32, device=q.device)
    acc = torch.empty(ws * d, dtype=torch.float32, device=q.device)
    out = torch.empty((b, 1, h, d), dtype=q.dtype, device=q.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    _decode_attention_split_kernel[(b * hkv, splits)](
        q, k, v, keep.view(torch.uint8), m, lsum, acc, length, hkv, g, splits, bps, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        keep.stride(0), keep.stride(1), BLOCK_G=block_g, BLOCK_N=BLOCK_N, D=d, num_warps=4, num_stages=2,
    )  # fmt: skip
    _decode_attention_combine_kernel[(b * hkv,)](m, lsum, acc, out, hkv, g, splits, out.stride(0), out.stride(2),
                                                 BLOCK_G=block_g, D=d, num_warps=4)  # fmt: skip
    return out


@torch.library.custom_op("qerl::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    return decode_attention(q, k, v, keep, scale)


@_decode_attention_op.register_fake
def _(q, k, v, keep, scale):
    return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))


def _usable(query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> bool:
    return (
        query.shape[2] == 1
        and attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[2] == 1
        and dropout == 0.0
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and (query.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    )


def decode_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface``): :func:`decode_attention` for one-token decode steps
    with an SDPA-style mask, transformers' ``sdpa_attention_forward`` for everything else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _usable(query, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    keep = attention_mask[:, 0, 0, :]
    keep = keep if keep.dtype == torch.bool else keep == 0  # additive float mask: 0 = attend
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    return _decode_attention_op(query, key, value, keep, float(scale)), None


def register_decode_attention() -> str:
    """Register :func:`decode_attention_forward` with transformers (attention and SDPA-style mask) under
    :data:`DECODE_ATTENTION`; idempotent. Returns the name, for ``model.set_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention_forward)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    return DECODE_ATTENTION
