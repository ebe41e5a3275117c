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

The LoRA shrink fused into this quantisation (issue #51 item 3's spike: the adapter as ``r`` more K columns of the
FP8 GEMM, forms 1 and 2) measured no-go on the H100 and left the tree; its kernels, references and tests are at
``902c614`` (docs/fp8_rollouts.md, item 3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["FP8_MAX", "MODES", "act_quant", "compile_sm90"]

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
