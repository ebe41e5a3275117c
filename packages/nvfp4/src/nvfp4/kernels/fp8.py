"""Per-token FP8 (E4M3) activation quantisation fused with the op before a linear (issue #51's FP8-rollout spike).

The FP8 rollout path runs the frozen base on Hopper's FP8 tensor cores: ``y = (q_x · s_x) · (q_w · s_w)ᵀ`` with
``q_x`` E4M3 per token (row scale ``s_x``), ``q_w`` E4M3 per output channel (made once from the NVFP4 weight,
:func:`nvfp4.fp8.fp8_weight`) and ``torch._scaled_mm``'s row-wise scaling. Quantising the activation with eager
PyTorch ops (amax, divide, cast: four kernels and three round trips of x) made the FP8 arm slower than bf16, so
``_act_quant_kernel`` does it in one launch, fused with what precedes the linear in a decoder layer:

* ``MODE = 0`` (plain; o_proj's input): ``h = x``;
* ``MODE = 1`` (RMSNorm; q/k/v and gate/up): ``h = x (+ residual)``, ``v = h · w``, normalised by
  ``rstd = 1 / sqrt(mean(h²) + eps)``; with a residual the new residual ``x + residual`` is written too, as vLLM's
  ``fused_add_rms_norm`` does;
* ``MODE = 2`` (SiLU-and-mul; down_proj's input): ``x = [gate | up]`` (``[M, 2K]``), ``h = silu(gate) · up``.

Then per row: ``amax = max|v| · rstd``, ``s = max(amax, 1e-12) / 448``, ``q = clamp(v · rstd · 448 / max(amax,
1e-12), ±448)`` rounded to E4M3 (round to nearest even). Everything in float32, no intermediate rounding to the
activation dtype (vLLM's RMSNorm rounds the normalised row to bf16 before the weight multiply; E4M3's 2⁻⁴ step
dwarfs that). ``WRITE_Y`` also stores ``v · rstd`` in the activation dtype: the bf16 input a LoRA adapter on top
needs, and the bf16 arms' own RMSNorm / SiLU-and-mul in the spike benchmark.

One program per row. A row that fits one ``BLOCK_K`` tile is read once; a longer row (down_proj's 18,944 inputs) is
read twice (statistics, then quantise), the second time from L2/L1.

Reference: :func:`nvfp4.fp8.act_quant_reference` (the same float32 arithmetic in PyTorch; tests:
``tests/nvfp4/test_fp8.py``, under ``TRITON_INTERPRET=1`` on the CPU and ``-m gpu`` on the H100).

**LoRA shrink in the quantisation** (issue #51 item 3's spike, ``_act_quant_lora_kernel``; docs/fp8_rollouts.md): the
adapter rides the base GEMM as ``r`` more K columns, ``[q_x | q_s] · [W_fp8 | B'_fp8]ᵀ``. The kernel computes the
shrink ``s = v·Aᵀ`` (``A [r, K]``, the members' A stacked for a fused layer; ``v`` the normalised / activated row) on
the row it quantises, and quantises ``s / c`` with **the row's own scale** (the amax taken over ``[v, s / c]``), so
``q [M, K + r]`` goes to ``torch._scaled_mm`` as it is. A sibling of ``_act_quant_kernel`` rather than a constexpr
path in it: it takes ``BLOCK_M`` rows a program (``A`` is read ``M / BLOCK_M`` times from L2, not ``M`` times: 229 KB
at K = 3584, r = 32; 1.2 MB at down's 18,944) and does the shrink as one ``tl.dot`` ``[BLOCK_M, BLOCK_K] ×
[BLOCK_K, r]`` a K tile, which changes the program's whole layout (2-D tiles, every row read twice: statistics +
shrink, then quantise); today's kernel is left as it was (its sm_90a PTX unchanged). The per-row arithmetic is
today's: ``_load_h``, ``_round_e4m3``, ``_store_row`` are shared, the amax floor and the float32 factors the same.

**Form 2** (``act_quant_lora(..., form=2)``; form 1 measured 2.65× the FP8 GEMM alone on the H100, latency-bound in
its serial K loop): ``_lora_stats_kernel`` (one program a row: ``rstd``, ``amax(v)``, ``‖v‖₂``, and a row scale from
the Cauchy-Schwarz bound ``|s_j / c| ≤ ‖v‖₂·max_j‖A_j‖₂ / c``, known before the shrink), then
``_act_quant_lora_split_kernel`` on row blocks × K slices: each program writes its slice of q and stores its shrink
partial; the last program of a row block (an atomic counter it resets) sums the partials in slice order and writes
``q[:, K:]``. Design and measurements: docs/fp8_rollouts.md, "Form 2".
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["FP8_MAX", "MODES", "act_quant", "act_quant_lora", "compile_sm90", "compile_sm90_lora",
           "compile_sm90_split", "lora_a_norm", "lora_blocks", "split_blocks"]

FP8_MAX = 448.0  # largest finite E4M3 (float8_e4m3fn)
AMAX_FLOOR = 1e-12  # an all-zero row gets s = 1e-12 / 448 and q = 0
MODES = {"plain": 0, "rms_norm": 1, "silu_mul": 2}
MAX_BLOCK_K = 8192

# Tests set this to allocate every output with NaN, so an element the kernel never writes cannot pass.
POISON_OUTPUTS = False


@triton.jit
def _load_h(x_row, r_row, offs, mask, K, MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The float32 pre-norm value ``h`` of one chunk of a row (``x + residual``, ``silu(gate) · up`` or ``x``)."""
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE == 2:
        up = tl.load(x_row + K + offs, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    if HAS_RESIDUAL:
        # the new residual is rounded to the activation dtype (it is stored so), and the norm reads that rounded value
        r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(x_row.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _round_e4m3(t):
    """``t`` (float32, ``|t| ≤ 448``) rounded to the nearest E4M3 value, ties to even, in float32 arithmetic: the
    step is ``2^(e − 3)`` for the binade ``2^e`` of ``|t|`` (``e ≥ −6``; below, the subnormal step ``2⁻⁹``), and
    ``(u + 1.5·2²³) − 1.5·2²³`` rounds ``u = t · 2^(3 − e)`` (exact: a power of two) to an integer, ties to even. The
    cast to E4M3 that follows is then exact. Hardware ``cvt.rn.satfinite`` gives the same values; the Triton
    interpreter's float → fp8 cast does not (it rounds ties up and drops the carry into the exponent: 127 → 64).
    """
    e = ((t.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # 2^(3 − e): exact, no division
    return ((t * inv_step + 12582912.0) - 12582912.0) * step


@triton.jit
def _act_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, y_ptr, ro_ptr, K, stride_x, stride_r, stride_q, stride_y,
                      stride_ro, eps, MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_Q: tl.constexpr,
                      WRITE_Y: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr):  # fmt: skip
    """Row ``pid``: ``q[pid, :K]`` (E4M3), ``s[pid]`` (fp32), optionally ``y[pid, :K]`` (x's dtype) and the new
    residual ``ro[pid, :K]`` (MODE 1 with a residual; ``ro`` may be ``r`` itself: every element is read before the
    program writes it)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    base = tl.arange(0, BLOCK_K)
    # pass 1: amax of v (= h · w for the norm) and, for the norm, the sum of h²
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    am = tl.zeros([BLOCK_K], dtype=tl.float32)
    if ONE_TILE:
        mask = base < K
        h = _load_h(x_row, r_row, base, mask, K, MODE, HAS_RESIDUAL)
        v = h
        if MODE == 1:
            v = h * tl.load(w_ptr + base, mask=mask, other=0.0).to(tl.float32)
            ss = h * h
        am = tl.abs(v)
    else:
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + base
            mask = offs < K
            h = _load_h(x_row, r_row, offs, mask, K, MODE, HAS_RESIDUAL)
            if MODE == 1:
                ss += h * h
                h = h * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            am = tl.maximum(am, tl.abs(h))
    rstd = 1.0
    if MODE == 1:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    amax = tl.maximum(tl.max(am, axis=0) * rstd, 1e-12)
    if WRITE_Q:
        tl.store(s_ptr + row, amax / 448.0)
    f = rstd * (448.0 / amax)
    # pass 2: write q (and y, the new residual)
    if ONE_TILE:
        _store_row(v, h, f, rstd, base, base < K, row, q_ptr, y_ptr, ro_ptr, stride_q, stride_y, stride_ro,
                   HAS_RESIDUAL, WRITE_Q, WRITE_Y)  # fmt: skip
    else:
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + base
            mask = offs < K
            h = _load_h(x_row, r_row, offs, mask, K, MODE, HAS_RESIDUAL)
            v = h
            if MODE == 1:
                v = h * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            _store_row(v, h, f, rstd, offs, mask, row, q_ptr, y_ptr, ro_ptr, stride_q, stride_y, stride_ro,
                       HAS_RESIDUAL, WRITE_Q, WRITE_Y)  # fmt: skip


@triton.jit
def _store_row(v, h, f, rstd, offs, mask, row, q_ptr, y_ptr, ro_ptr, stride_q, stride_y, stride_ro,
               HAS_RESIDUAL: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_Y: tl.constexpr):  # fmt: skip
    if WRITE_Q:
        q = _round_e4m3(tl.minimum(tl.maximum(v * f, -448.0), 448.0))
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    if WRITE_Y:
        tl.store(y_ptr + row * stride_y + offs, (v * rstd).to(y_ptr.dtype.element_ty), mask=mask)
    if HAS_RESIDUAL:
        tl.store(ro_ptr + row * stride_ro + offs, h.to(ro_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_quant_lora_kernel(x_ptr, r_ptr, w_ptr, a_ptr, q_ptr, s_ptr, y_ptr, ro_ptr, M, K, stride_x, stride_r, stride_a,
                           stride_q, stride_y, stride_ro, eps, inv_c, MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                           WRITE_Y: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr):  # fmt: skip
    """Rows ``[pid·BLOCK_M, (pid + 1)·BLOCK_M)``: ``q[:, :K]`` (E4M3 of v), ``q[:, K:K + R]`` (E4M3 of ``s / c``, the
    same row scale), ``s_row`` (fp32), optionally ``y`` and the new residual (as ``_act_quant_kernel``)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < M
    x_row = x_ptr + rows[:, None] * stride_x
    r_row = r_ptr + rows[:, None] * stride_r
    base = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    # pass 1: amax of v (= h · w for the norm), the sum of h² (norm), the shrink (h · w) · Aᵀ in float32
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    am = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + base
        k_ok = offs < K
        mask = row_ok[:, None] & k_ok[None, :]
        h = _load_h(x_row, r_row, offs[None, :], mask, K, MODE, HAS_RESIDUAL)
        v = h
        if MODE == 1:
            ss += h * h
            v = h * tl.load(w_ptr + offs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        am = tl.maximum(am, tl.abs(v))
        a_t = tl.load(a_ptr + rr[None, :] * stride_a + offs[:, None], mask=(rr < R)[None, :] & k_ok[:, None],
                      other=0.0)  # Aᵀ tile [BLOCK_K, BLOCK_R]  # fmt: skip
        acc = tl.dot(v.to(a_ptr.dtype.element_ty), a_t, acc)
    sc = acc * inv_c  # s / c (c a power of two: exact), before the norm's 1 / rms
    rstd = 1.0
    rstd_col = 1.0
    if MODE == 1:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
        rstd_col = rstd[:, None]
        sc = sc * rstd_col
    amax = tl.maximum(tl.maximum(tl.max(am, axis=1) * rstd, tl.max(tl.abs(sc), axis=1)), 1e-12)
    tl.store(s_ptr + rows, amax / 448.0, mask=row_ok)
    g = 448.0 / amax
    f = (rstd * g)[:, None]
    q_s = _round_e4m3(tl.minimum(tl.maximum(sc * g[:, None], -448.0), 448.0))
    tl.store(q_ptr + rows[:, None] * stride_q + K + rr[None, :], q_s.to(q_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (rr < R)[None, :])  # fmt: skip
    # pass 2: write q (and y, the new residual); the rows come from L2 this time
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + base
        mask = row_ok[:, None] & (offs < K)[None, :]
        h = _load_h(x_row, r_row, offs[None, :], mask, K, MODE, HAS_RESIDUAL)
        v = h
        if MODE == 1:
            v = h * tl.load(w_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)[None, :]
        _store_row(v, h, f, rstd_col, offs[None, :], mask, rows[:, None], q_ptr, y_ptr, ro_ptr, stride_q, stride_y,
                   stride_ro, HAS_RESIDUAL, True, WRITE_Y)  # fmt: skip


@triton.jit
def _lora_stats_kernel(x_ptr, r_ptr, w_ptr, an_ptr, s_ptr, st_ptr, K, stride_x, stride_r, eps, inv_c,
                       MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, A_DTYPE: tl.constexpr,
                       BLOCK_K: tl.constexpr):  # fmt: skip
    """Form 2's statistics, row ``pid``: ``rstd`` (the norm), ``amax(v)`` and ``‖v‖₂`` (v rounded to A's dtype, as
    the shrink multiplies it), then the row's amax ``max(amax(v)·rstd, ‖v‖₂·rstd·max_j‖A_j‖₂ / c)`` (Cauchy-Schwarz:
    ``|s_j / c| ≤`` the second term, so the split pass can write q_x before the shrink ends). Writes ``s[pid] =
    amax / 448`` and ``st[pid] = (amax, rstd)``."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    base = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    am = tl.zeros([BLOCK_K], dtype=tl.float32)
    nn = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + base
        mask = offs < K
        v = _load_h(x_row, r_row, offs, mask, K, MODE, HAS_RESIDUAL)
        if MODE == 1:
            ss += v * v
            v = v * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        am = tl.maximum(am, tl.abs(v))
        vr = v.to(A_DTYPE).to(tl.float32)
        nn += vr * vr
    rstd = 1.0
    if MODE == 1:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    bound = tl.sqrt(tl.sum(nn, axis=0)) * rstd * tl.load(an_ptr) * inv_c
    amax = tl.maximum(tl.maximum(tl.max(am, axis=0) * rstd, bound), 1e-12)
    tl.store(s_ptr + row, amax / 448.0)
    tl.store(st_ptr + 2 * row, amax)
    tl.store(st_ptr + 2 * row + 1, rstd)


@triton.jit
def _act_quant_lora_split_kernel(x_ptr, r_ptr, w_ptr, a_ptr, q_ptr, st_ptr, part_ptr, cnt_ptr, y_ptr, ro_ptr, M, K, KS,
                                 SPLIT, stride_x, stride_r, stride_a, stride_q, stride_y, stride_ro, inv_c,
                                 MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_Y: tl.constexpr,
                                 R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_K: tl.constexpr):  # fmt: skip
    """Form 2's split pass, program ``(row block pid_m, K slice pid_k)``: quantises ``q[rows, slice]`` with the
    statistics pass's row scale, writes ``y`` / the new residual on the slice, and stores its shrink partial
    ``v[:, slice]·A[:, slice]ᵀ`` (float32 ``[BLOCK_M, R]``) at ``part[pid_k]``. The program that finishes a row
    block last (an atomic counter a row block, acq_rel: the partials' stores are visible to it) sums the ``SPLIT``
    partials in slice order (deterministic), quantises ``s / c`` into ``q[:, K:K + R]`` and sets the counter back
    to 0, so the next launch (or a CUDA-graph replay) needs no host-side zeroing."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < M
    amax = tl.load(st_ptr + 2 * rows, mask=row_ok, other=1.0)
    g = 448.0 / amax
    rstd = 1.0
    if MODE == 1:
        rstd = tl.load(st_ptr + 2 * rows + 1, mask=row_ok, other=1.0)
    f = (rstd * g)[:, None]
    rstd_col = rstd
    if MODE == 1:
        rstd_col = rstd[:, None]
    x_row = x_ptr + rows[:, None] * stride_x
    r_row = r_ptr + rows[:, None] * stride_r
    base = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    k_lo = pid_k * KS
    for k0 in range(0, KS, BLOCK_K):
        offs = k_lo + k0 + base
        k_ok = offs < K
        mask = row_ok[:, None] & k_ok[None, :]
        h = _load_h(x_row, r_row, offs[None, :], mask, K, MODE, HAS_RESIDUAL)
        v = h
        if MODE == 1:
            v = h * tl.load(w_ptr + offs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        _store_row(v, h, f, rstd_col, offs[None, :], mask, rows[:, None], q_ptr, y_ptr, ro_ptr, stride_q, stride_y,
                   stride_ro, HAS_RESIDUAL, True, WRITE_Y)  # fmt: skip
        a_t = tl.load(a_ptr + rr[None, :] * stride_a + offs[:, None], mask=r_ok[None, :] & k_ok[:, None],
                      other=0.0)  # Aᵀ tile [BLOCK_K, BLOCK_R]  # fmt: skip
        acc = tl.dot(v.to(a_ptr.dtype.element_ty), a_t, acc)
    out_mask = row_ok[:, None] & r_ok[None, :]
    part = part_ptr + rows[:, None] * R + rr[None, :]
    tl.store(part + pid_k * M * R, acc, mask=out_mask)
    done = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT - 1:
        tot = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for j in range(0, SPLIT):
            # .cg: from L2, where the other programs' stores are (this SM's L1 may not have seen them)
            tot += tl.load(part + j * M * R, mask=out_mask, other=0.0, cache_modifier=".cg")
        sc = tot * inv_c
        if MODE == 1:
            sc = sc * rstd_col
        q_s = _round_e4m3(tl.minimum(tl.maximum(sc * g[:, None], -448.0), 448.0))
        tl.store(q_ptr + rows[:, None] * stride_q + K + rr[None, :], q_s.to(q_ptr.dtype.element_ty), mask=out_mask)
        tl.atomic_xchg(cnt_ptr + pid_m, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def _block(k: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps) for a row of ``k`` elements: one tile up to 8,192 (16 fp32 values a thread)."""
    block = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    return block, max(1, min(16, block // 512))


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def act_quant(
    x: torch.Tensor,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    write_q: bool = True,
    write_y: bool = False,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch ``_act_quant_kernel`` on a 2-D activation.

    Args:
        x: ``[M, K]`` (``[M, 2K]`` = ``[gate | up]`` for ``mode="silu_mul"``), float16/bfloat16/float32, last dim
            contiguous.
        mode: ``"plain"``, ``"rms_norm"`` or ``"silu_mul"`` (module docstring).
        norm_weight: ``[K]`` RMSNorm weight (``mode="rms_norm"`` only); eps: RMSNorm epsilon.
        residual: optional ``[M, K]`` in x's dtype (``rms_norm`` only): the norm reads ``x + residual``.
        write_q: write ``q`` and ``s``; write_y: write ``y`` (the normalised / activated row in x's dtype).
        residual_out: where the new residual goes (default: a new tensor; may be ``residual`` itself).

    Returns:
        ``(q, s, y, residual_out)``: q float8_e4m3fn ``[M, K]``, s float32 ``[M, 1]``, y ``[M, K]`` in x's dtype,
        residual_out ``[M, K]``; each ``None`` where not asked for.
    """
    code = MODES[mode]
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"act_quant: x must be 2-D with a contiguous last dim, got {tuple(x.shape)} {x.stride()}")
    m, k = x.shape[0], x.shape[1] // 2 if code == 2 else x.shape[1]
    if (code == 1) != (norm_weight is not None) or (residual is not None and code != 1):
        raise ValueError(f"act_quant: mode {mode!r} with norm_weight={norm_weight is not None}, "
                         f"residual={residual is not None}")  # fmt: skip
    dev = x.device
    q = _empty((m, k), torch.float8_e4m3fn, dev) if write_q else None
    s = _empty((m, 1), torch.float32, dev) if write_q else None
    y = _empty((m, k), x.dtype, dev) if write_y else None
    ro = None
    if residual is not None:
        ro = _empty((m, k), x.dtype, dev) if residual_out is None else residual_out
    block, warps = _block(k)
    dummy = x  # unused pointer arguments (their constexpr branch is off)
    _act_quant_kernel[(m,)](
        x, residual if residual is not None else dummy, norm_weight if norm_weight is not None else dummy,
        q if write_q else dummy, s if write_q else dummy, y if write_y else dummy, ro if ro is not None else dummy,
        k, x.stride(0), residual.stride(0) if residual is not None else 0, k, k, k, float(eps),
        MODE=code, HAS_RESIDUAL=residual is not None, WRITE_Q=write_q, WRITE_Y=write_y, BLOCK_K=block,
        ONE_TILE=block >= k, num_warps=warps,
    )  # fmt: skip
    return q, s, y, ro


def compile_sm90(k: int, mode: str = "rms_norm", residual: bool = False, write_y: bool = False):
    """``_act_quant_kernel`` for a ``k``-wide row compiled for sm_90a without a GPU (``.asm["cubin"]``, ``["ptx"]``):
    the CPU build check (``tests/nvfp4/test_fp8.py``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _act_quant_kernel
    block, warps = _block(k)
    sig = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
           "y_ptr": "*bf16", "ro_ptr": "*bf16", "K": "i32", "stride_x": "i32", "stride_r": "i32", "stride_q": "i32",
           "stride_y": "i32", "stride_ro": "i32", "eps": "fp32", "MODE": "constexpr", "HAS_RESIDUAL": "constexpr",
           "WRITE_Q": "constexpr", "WRITE_Y": "constexpr", "BLOCK_K": "constexpr", "ONE_TILE": "constexpr"}  # fmt: skip
    consts = {"MODE": MODES[mode], "HAS_RESIDUAL": residual, "WRITE_Q": True, "WRITE_Y": write_y, "BLOCK_K": block,
              "ONE_TILE": block >= k}  # fmt: skip
    aligned = ("x_ptr", "r_ptr", "w_ptr", "q_ptr", "y_ptr", "ro_ptr", "K", "stride_x", "stride_r", "stride_q",
               "stride_y", "stride_ro")  # fmt: skip
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))  # fmt: skip


def lora_blocks(m: int, k: int, r: int, block_m: int | None = None) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_K, BLOCK_R, num_warps)`` of :func:`act_quant_lora`.

    ``BLOCK_M`` (default 8; at most 16, and no more than M needs): rows a program; A is read ``⌈M / BLOCK_M⌉`` times
    from L2 (a program reads all of it: ``r·K`` bf16), so more rows a program cut that traffic while fewer keep more
    SMs busy at small M (M = 128: 16 programs of 8 rows). ``BLOCK_K``: a ``[BLOCK_M, BLOCK_K]`` fp32 tile of at most
    4,096 values (two accumulators beside it) and an ``Aᵀ`` tile ``[BLOCK_K, BLOCK_R]`` of at most 32 KB (bf16).
    The spike's timer (``benchmarks/fp8_lora_spike.py``) times BLOCK_M = 4 / 8 / 16 on the GPU.
    """
    bm = block_m if block_m is not None else 8
    if bm not in (1, 2, 4, 8, 16):
        raise ValueError(f"act_quant_lora: block_m must be 1, 2, 4, 8 or 16, got {bm}")
    bm = min(bm, max(1, triton.next_power_of_2(m)))
    br = max(16, triton.next_power_of_2(r))
    bk = max(16, min(4096 // bm, 16384 // br, triton.next_power_of_2(k)))
    return bm, bk, br, 4 if bm * bk >= 2048 else 2


def act_quant_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_scale_c: float,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    write_y: bool = False,
    residual_out: torch.Tensor | None = None,
    block_m: int | None = None,
    form: int = 1,
    split_k: int | None = None,
    a_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`act_quant`'s per-token E4M3 with the LoRA shrink beside it: ``form=1`` launches
    ``_act_quant_lora_kernel`` (BLOCK_M rows a program over the whole K; the row scale from the exact ``max|s / c|``),
    ``form=2`` ``_lora_stats_kernel`` then ``_act_quant_lora_split_kernel`` (row blocks × K slices; the row scale from
    the Cauchy-Schwarz bound on ``|s / c|``, :func:`lora_a_norm`; docs/fp8_rollouts.md "Form 2").

    Args:
        x: ``[M, K]`` (``[M, 2K]`` = ``[gate | up]`` for ``"silu_mul"``), float16/bfloat16/float32, last dim contiguous.
        lora_a: ``[r, K]`` bfloat16/float16 (r ≤ 256; a fused layer's members' A stacked), last dim contiguous; the
            shrink multiplies ``v`` rounded to this dtype (as a bf16 LoRA does), accumulating in float32.
        lora_scale_c: the site's power of two ``c`` (:func:`nvfp4.fp8.lora_scale_c`): the kernel quantises ``s / c``.
        mode, norm_weight, eps, residual, write_y, residual_out: as :func:`act_quant`.
        block_m: rows a program (form 1: :func:`lora_blocks`, default 8; form 2: :func:`split_blocks`, default 16).
        form: 1 or 2; split_k: form 2's K slices (default: :func:`split_blocks`'s, ~264 programs in all).
        a_norm: form 2's ``max_j ‖A_j‖₂``, float32 ``[1]`` on x's device (:func:`lora_a_norm`; computed when
            ``None``: two more small kernels a call, so callers that replay pass it).

    Returns:
        ``(q, s, y, residual_out)``: q float8_e4m3fn ``[M, K + r]`` contiguous (``q[:, :K]`` the row, ``q[:, K:]``
        ``s / c``, one scale: ``torch._scaled_mm``'s A operand as it is), s float32 ``[M, 1]`` (``amax([v, s/c]) /
        448``), y ``[M, K]`` in x's dtype or ``None``, residual_out ``[M, K]`` or ``None``.
    """
    code = MODES[mode]
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"act_quant_lora: x must be 2-D with a contiguous last dim, got {tuple(x.shape)} {x.stride()}")
    m, k = x.shape[0], x.shape[1] // 2 if code == 2 else x.shape[1]
    if lora_a.dim() != 2 or lora_a.shape[1] != k or lora_a.stride(-1) != 1 or not 1 <= lora_a.shape[0] <= 256:
        raise ValueError(f"act_quant_lora: lora_a must be [r <= 256, {k}] with a contiguous last dim, got "
                         f"{tuple(lora_a.shape)} {lora_a.stride()}")  # fmt: skip
    if lora_a.dtype not in (torch.bfloat16, torch.float16) or lora_a.device != x.device:
        raise ValueError(
            f"act_quant_lora: lora_a must be bf16/fp16 on {x.device}, got {lora_a.dtype} on {lora_a.device}"
        )
    if not (lora_scale_c > 0 and math.frexp(lora_scale_c)[0] == 0.5):
        raise ValueError(f"act_quant_lora: lora_scale_c must be a positive power of two, got {lora_scale_c}")
    if (code == 1) != (norm_weight is not None) or (residual is not None and code != 1):
        raise ValueError(f"act_quant_lora: mode {mode!r} with norm_weight={norm_weight is not None}, "
                         f"residual={residual is not None}")  # fmt: skip
    r, dev = lora_a.shape[0], x.device
    q = _empty((m, k + r), torch.float8_e4m3fn, dev)
    s = _empty((m, 1), torch.float32, dev)
    y = _empty((m, k), x.dtype, dev) if write_y else None
    ro = None
    if residual is not None:
        ro = _empty((m, k), x.dtype, dev) if residual_out is None else residual_out
    if form == 2:
        _launch_split(x, lora_a, lora_scale_c, code, norm_weight, eps, residual, q, s, y, ro, block_m, split_k, a_norm)
        return q, s, y, ro
    if form != 1:
        raise ValueError(f"act_quant_lora: form must be 1 or 2, got {form}")
    bm, bk, br, warps = lora_blocks(m, k, r, block_m)
    dummy = x
    _act_quant_lora_kernel[(triton.cdiv(m, bm),)](
        x, residual if residual is not None else dummy, norm_weight if norm_weight is not None else dummy, lora_a, q, s,
        y if write_y else dummy, ro if ro is not None else dummy, m, k, x.stride(0),
        residual.stride(0) if residual is not None else 0, lora_a.stride(0), k + r, k, k, float(eps),
        1.0 / lora_scale_c, MODE=code, HAS_RESIDUAL=residual is not None, WRITE_Y=write_y, R=r, BLOCK_R=br,
        BLOCK_M=bm, BLOCK_K=bk, num_warps=warps,
    )  # fmt: skip
    return q, s, y, ro


def lora_a_norm(lora_a: torch.Tensor) -> torch.Tensor:
    """``max_j ‖A_j‖₂`` of the stacked ``A [r, K]`` in float32 (``[1]``, A's device): form 2's Cauchy-Schwarz factor,
    made once a sync (the reference computes it the same way)."""
    return lora_a.float().norm(dim=1).amax().reshape(1)


def split_blocks(m: int, k: int, r: int, block_m: int | None = None,
                 split_k: int | None = None) -> tuple[int, int, int, int, int, int]:  # fmt: skip
    """``(BLOCK_M, BLOCK_K, BLOCK_R, SPLIT, KS, num_warps)`` of form 2's split pass.

    ``BLOCK_M`` (default 16: A is read ``⌈M / 16⌉`` times in all, each slice by its own program): rows a program;
    ``BLOCK_K`` as :func:`lora_blocks`; ``SPLIT`` K slices of ``KS`` columns (a multiple of BLOCK_K), by default as
    many as bring the grid to ~264 programs (two an H100 SM: M = 128 at K = 3584 gives 8 × 28 one-tile programs,
    at 18,944 8 × 30 five-tile programs), at most one a BLOCK_K tile.
    """
    bm = block_m if block_m is not None else 16
    if bm not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"act_quant_lora: block_m must be 1, 2, 4, 8, 16 or 32, got {bm}")
    bm = min(bm, max(1, triton.next_power_of_2(m)))
    br = max(16, triton.next_power_of_2(r))
    bk = max(16, min(4096 // bm, 16384 // br, 128, triton.next_power_of_2(k)))
    tiles = triton.cdiv(k, bk)
    if split_k is not None and split_k < 1:
        raise ValueError(f"act_quant_lora: split_k must be >= 1, got {split_k}")
    split = split_k if split_k is not None else triton.cdiv(264, triton.cdiv(m, bm))
    ks = triton.cdiv(tiles, max(1, min(split, tiles))) * bk
    return bm, bk, br, triton.cdiv(k, ks), ks, 4 if bm * bk >= 2048 else 2


# Form 2's row-block counters: zero when no launch is in flight (the last program of a row block resets its own);
# one buffer a device, grown by reallocating (the old one kept alive: a captured CUDA graph may still point at it).
# One stream at a time: two form-2 launches in flight together on two streams would share counters.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    bufs = _COUNTERS.setdefault(dev, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=dev))
    return bufs[-1]


def _launch_split(x, lora_a, c, code, norm_weight, eps, residual, q, s, y, ro, block_m, split_k, a_norm) -> None:
    m, r, k = x.shape[0], lora_a.shape[0], lora_a.shape[1]
    if a_norm is None:
        a_norm = lora_a_norm(lora_a)
    if a_norm.dtype != torch.float32 or a_norm.numel() != 1 or a_norm.device != x.device:
        raise ValueError(f"act_quant_lora: a_norm must be float32 [1] on {x.device}, got {a_norm.dtype} "
                         f"{tuple(a_norm.shape)} on {a_norm.device}")  # fmt: skip
    bm, bk, br, split, ks, warps = split_blocks(m, k, r, block_m, split_k)
    nb = triton.cdiv(m, bm)
    st = torch.empty((m, 2), dtype=torch.float32, device=x.device)  # (amax, rstd) a row: fully written
    part = torch.empty((split, m, r), dtype=torch.float32, device=x.device)  # shrink partials: fully written
    cnt = _counters(x.device, nb)
    dummy = x
    res = residual if residual is not None else dummy
    nw = norm_weight if norm_weight is not None else dummy
    a_dt = tl.bfloat16 if lora_a.dtype == torch.bfloat16 else tl.float16
    sblock, swarps = _block(k)
    _lora_stats_kernel[(m,)](
        x, res, nw, a_norm, s, st, k, x.stride(0), residual.stride(0) if residual is not None else 0, float(eps),
        1.0 / c, MODE=code, HAS_RESIDUAL=residual is not None, A_DTYPE=a_dt, BLOCK_K=sblock, num_warps=swarps,
    )  # fmt: skip
    _act_quant_lora_split_kernel[(nb, split)](
        x, res, nw, lora_a, q, st, part, cnt, y if y is not None else dummy, ro if ro is not None else dummy, m, k, ks,
        split, x.stride(0), residual.stride(0) if residual is not None else 0, lora_a.stride(0), k + r, k, k, 1.0 / c,
        MODE=code, HAS_RESIDUAL=residual is not None, WRITE_Y=y is not None, R=r, BLOCK_R=br, BLOCK_M=bm, BLOCK_K=bk,
        num_warps=warps,
    )  # fmt: skip


def compile_sm90_lora(k: int, r: int, mode: str = "rms_norm", residual: bool = False, write_y: bool = False,
                      block_m: int = 8):  # fmt: skip
    """``_act_quant_lora_kernel`` for a ``k``-wide row and rank ``r`` compiled for sm_90a without a GPU (the CPU
    build check of ``tests/nvfp4/test_fp8_lora.py``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _act_quant_lora_kernel
    bm, bk, br, warps = lora_blocks(1 << 20, k, r, block_m)
    ptrs = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", a_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32",
                y_ptr="*bf16", ro_ptr="*bf16")  # fmt: skip
    ints = ("M", "K", "stride_x", "stride_r", "stride_a", "stride_q", "stride_y", "stride_ro")
    consts = {"MODE": MODES[mode], "HAS_RESIDUAL": residual, "WRITE_Y": write_y, "R": r, "BLOCK_R": br,
              "BLOCK_M": bm, "BLOCK_K": bk}  # fmt: skip
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), "eps": "fp32", "inv_c": "fp32", **dict.fromkeys(consts, "constexpr")}
    aligned = [a for a in (*ptrs, *ints) if a not in ("s_ptr", "M")]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))  # fmt: skip


def compile_sm90_split(k: int, r: int, mode: str = "rms_norm", residual: bool = False, write_y: bool = False,
                       block_m: int = 16, m: int = 128):  # fmt: skip
    """Form 2's ``(stats, split)`` kernels for a ``k``-wide row and rank ``r`` compiled for sm_90a without a GPU
    (the CPU build check of ``tests/nvfp4/test_fp8_lora.py``); the split pass's blocks as :func:`split_blocks` picks
    them at ``m`` rows."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    sblock, swarps = _block(k)
    sfn = _lora_stats_kernel
    sptrs = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", an_ptr="*fp32", s_ptr="*fp32", st_ptr="*fp32")
    sints = ("K", "stride_x", "stride_r")
    sconsts = {"MODE": MODES[mode], "HAS_RESIDUAL": residual, "A_DTYPE": tl.bfloat16, "BLOCK_K": sblock}
    ssig = {**sptrs, **dict.fromkeys(sints, "i32"), "eps": "fp32", "inv_c": "fp32",
            **dict.fromkeys(sconsts, "constexpr")}  # fmt: skip
    saligned = ("x_ptr", "r_ptr", "w_ptr", *sints)
    sattrs = {(sfn.arg_names.index(a),): [["tt.divisibility", 16]] for a in saligned}
    stats = triton.compile(ASTSource(sfn, ssig, sconsts, sattrs), target=target, options=dict(num_warps=swarps))
    fn = _act_quant_lora_split_kernel
    bm, bk, br, _, _, warps = split_blocks(m, k, r, block_m)
    ptrs = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", a_ptr="*bf16", q_ptr="*fp8e4nv", st_ptr="*fp32",
                part_ptr="*fp32", cnt_ptr="*i32", y_ptr="*bf16", ro_ptr="*bf16")  # fmt: skip
    ints = ("M", "K", "KS", "SPLIT", "stride_x", "stride_r", "stride_a", "stride_q", "stride_y", "stride_ro")
    consts = {"MODE": MODES[mode], "HAS_RESIDUAL": residual, "WRITE_Y": write_y, "R": r, "BLOCK_R": br,
              "BLOCK_M": bm, "BLOCK_K": bk}  # fmt: skip
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), "inv_c": "fp32", **dict.fromkeys(consts, "constexpr")}
    aligned = [a for a in (*ptrs, *ints) if a not in ("st_ptr", "cnt_ptr", "M", "SPLIT")]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    split = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=dict(num_warps=warps))
    return stats, split
