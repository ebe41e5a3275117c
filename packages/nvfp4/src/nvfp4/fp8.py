"""FP8 (E4M3) rollouts for a frozen NVFP4 base (issue #51's spike): the weight copy and the fused-quant FP8 linear.

Hopper has no FP4 tensor cores but runs FP8 at twice the bf16 rate; from M ≈ 256 our W4A16 kernels fall below bf16
while an FP8 GEMM stays 1.3-1.55× above it (the issue's table). This module holds the pieces of that path, in
:mod:`nvfp4.ops`' pattern (custom op + fake + plain PyTorch reference):

* :func:`fp8_weight`: the E4M3 copy of a linear's weight, made once from its NVFP4 tensors (dequantise in float32,
  one scale per output channel ``amax / 448``, round to E4M3): 1 byte a weight + 4 a row, beside NVFP4's 0.5625;
* :func:`act_quant` (``nvfp4::fp8_act_quant``): per-token E4M3 quantisation of a bf16 activation fused with what
  precedes the linear — nothing (``"plain"``), RMSNorm with an optional residual add (``"rms_norm"``: q/k/v and
  gate/up) or SiLU-and-mul (``"silu_mul"``: down) — in one Triton kernel (:mod:`nvfp4.kernels.fp8`);
* :func:`scaled_linear` (``nvfp4::fp8_scaled_linear``): ``torch._scaled_mm`` with row-wise scales (x per token, W
  per channel), bias in the epilogue, bf16 out;
* :func:`fp8_linear`: the two above for a plain bf16 input (``act_quant(x)`` then ``scaled_linear``);
* :func:`w4a16_or_fp8_linear` (``nvfp4::w4a16_or_fp8_linear``): ``rollout_precision="auto"``'s linear, W4A16 below a
  row count and FP8 from it, decided inside the op (so a dynamic-shape graph, vLLM's, keeps the choice per call);
* :func:`fp8_weight_members`: :func:`fp8_weight` of a fused layer whose members have their own global scale.

(Issue #51 item 3's spike, the LoRA adapter as K columns of the FP8 GEMM with the shrink inside the quantisation,
measured no-go on the H100 in both of its forms and left the tree: it is at ``902c614``, docs/fp8_rollouts.md.)

Dispatch: on CUDA the quantisation is the Triton kernel and the product ``torch._scaled_mm``; elsewhere both are the
references below. CPU note: ``torch._scaled_mm`` on CPU (torch 2.11, oneDNN) takes per-tensor scales only, so the
CPU path of ``scaled_linear`` is the reference matmul (:func:`scaled_linear_reference`, float32), not an FP8 GEMM.
"""

from __future__ import annotations

import torch

from . import ops
from .codec import dequantize
from .layout import scale_rows, weight_shape
from .ops import _use_triton

__all__ = [
    "FP8_MAX",
    "act_quant",
    "act_quant_reference",
    "fp8_linear",
    "fp8_weight",
    "fp8_weight_members",
    "round_e4m3_reference",
    "scaled_linear",
    "scaled_linear_reference",
    "w4a16_or_fp8_linear",
]

FP8_MAX = 448.0
AMAX_FLOOR = 1e-12
_MODES = ("plain", "rms_norm", "silu_mul")


def round_e4m3_reference(t: torch.Tensor) -> torch.Tensor:
    """``clamp(t, ±448)`` cast to float8_e4m3fn (round to nearest even; what ``cvt.rn.satfinite`` does)."""
    return t.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_weight(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, rows_per_chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 copy of an NVFP4 weight, one scale per output channel (made once, at load; plain PyTorch).

    Args:
        packed: uint8 ``[N, K/2]`` (compressed-tensors layout) or ``[N/4, 2K]`` (the MMA layout, :mod:`nvfp4.layout`);
            scale: float8_e4m3fn ``[N, K/16]`` (or ``[N/64, 4K]`` beside the MMA layout, :mod:`nvfp4.layout`);
            global_scale: float32 ``[1]``.
        rows_per_chunk: output rows dequantised at a time (bounds the float32 temporary; a multiple of 64).

    Returns:
        ``(w8, w_scale)``: float8_e4m3fn ``[N, K]`` and float32 ``[N]`` with ``w8 · w_scale[:, None] ≈ dequant(W)``
        (per element within half an E4M3 step: 2⁻⁴ relative, 2⁻¹⁰·w_scale absolute below 2⁻⁶·w_scale).
    """
    n, k = weight_shape(packed, scale)
    mma = packed.shape[0] != n  # [N/4, 2K]: 64 outputs = 16 packed rows
    if rows_per_chunk % 64:
        raise ValueError(f"fp8_weight: rows_per_chunk must be a multiple of 64, got {rows_per_chunk}")
    w8 = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=packed.device)
    w_scale = torch.empty(n, dtype=torch.float32, device=packed.device)
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        p = packed[r0 // 4 : -(-r1 // 4)] if mma else packed[r0:r1]
        w = dequantize(p, scale[scale_rows(packed, scale, r0, r1)], global_scale, torch.float32)
        amax = w.abs().amax(dim=1).clamp_min(AMAX_FLOOR)
        w8[r0:r1] = round_e4m3_reference(w * (FP8_MAX / amax)[:, None])
        w_scale[r0:r1] = amax / FP8_MAX
    return w8, w_scale


def _pre_norm_reference(
    x: torch.Tensor, mode: str, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 row before the norm's weight and ``1 / rms`` (``silu(gate) · up`` for ``"silu_mul"``, ``x +
    residual`` rounded to x's dtype with a residual, else ``x``) and the new residual (or ``None``): the references'
    shared prologue, as the kernels' ``_load_h``."""
    h = x.float()
    if mode == "silu_mul":
        g, u = h.chunk(2, dim=-1)
        h = g / (1.0 + torch.exp(-g)) * u
    ro = None
    if residual is not None:
        ro = (h + residual.float()).to(x.dtype)
        h = ro.float()
    return h, ro


def act_quant_reference(
    x: torch.Tensor,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain PyTorch reference of ``nvfp4::fp8_act_quant``, in the kernel's float32 arithmetic.

    Args:
        x: ``[M, K]`` (``[M, 2K]`` = ``[gate | up]`` for ``"silu_mul"``); mode, norm_weight, eps, residual: as
            :func:`act_quant`.

    Returns:
        ``(q, s, y, residual_out)``: q float8_e4m3fn ``[M, K]``, s float32 ``[M, 1]``, y ``[M, K]`` in x's dtype
        (the normalised / activated row before quantisation), residual_out ``[M, K]`` in x's dtype or ``None``.
    """
    h, ro = _pre_norm_reference(x, mode, residual)
    v, rstd = h, torch.ones_like(h[:, :1])
    if mode == "rms_norm":
        v = h * norm_weight.float()
        rstd = 1.0 / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    amax = (v.abs().amax(dim=-1, keepdim=True) * rstd).clamp_min(AMAX_FLOOR)
    q = round_e4m3_reference(v * (rstd * (FP8_MAX / amax)))
    return q, amax / FP8_MAX, (v * rstd).to(x.dtype), ro


@torch.library.custom_op("nvfp4::fp8_act_quant", mutates_args=())
def _act_quant_op(
    x: torch.Tensor,
    mode: str,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    write_y: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        from .kernels.fp8 import act_quant as launch

        q, s, y, ro = launch(x, mode, norm_weight, eps, residual, write_y=write_y)
    else:
        q, s, y, ro = act_quant_reference(x, mode, norm_weight, eps, residual)
    return q, s, y if write_y else x.new_empty(0), ro if ro is not None else x.new_empty(0)  # outputs never alias


@_act_quant_op.register_fake
def _(x, mode, norm_weight, eps, residual, write_y):
    m, k = x.shape[0], x.shape[1] // 2 if mode == "silu_mul" else x.shape[1]
    q = x.new_empty((m, k), dtype=torch.float8_e4m3fn)
    s = x.new_empty((m, 1), dtype=torch.float32)
    return q, s, x.new_empty((m, k) if write_y else (0,)), x.new_empty((m, k) if residual is not None else (0,))


def act_quant(
    x: torch.Tensor,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    write_y: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token E4M3 quantisation of ``x``, fused with the op before the linear (one kernel on CUDA).

    Args:
        x: ``[..., K]`` bf16/fp16/fp32 (``[..., 2K]`` = ``[gate | up]`` for ``mode="silu_mul"``).
        mode: ``"plain"`` (quantise x), ``"rms_norm"`` (quantise ``RMSNorm(x (+ residual)) · norm_weight``) or
            ``"silu_mul"`` (quantise ``silu(gate) · up``).
        norm_weight: ``[K]`` (``"rms_norm"`` only; AQN's noisy norm weight goes here unchanged); eps: the norm's
            epsilon.
        residual: ``[..., K]`` in x's dtype (``"rms_norm"`` only): the norm reads ``x + residual``, which is also
            returned as the new residual (vLLM's ``fused_add_rms_norm``).
        write_y: also return the normalised / activated row in x's dtype (the input of a bf16 LoRA on top).

    Returns:
        ``(q, s, y, residual_out)``: q float8_e4m3fn ``[..., K]``, s float32 ``[..., 1]`` (``x_row ≈ q_row · s``),
        y ``[..., K]`` or ``None``, residual_out ``[..., K]`` or ``None``.
    """
    if mode not in _MODES:
        raise ValueError(f"act_quant: mode must be one of {_MODES}, got {mode!r}")
    if (mode == "rms_norm") != (norm_weight is not None) or (residual is not None and mode != "rms_norm"):
        raise ValueError(f"act_quant: mode {mode!r} with norm_weight={norm_weight is not None}, "
                         f"residual={residual is not None}")  # fmt: skip
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    r2 = residual.reshape(-1, residual.shape[-1]) if residual is not None else None
    q, s, y, ro = _act_quant_op(x2, mode, norm_weight, float(eps), r2, write_y)
    k = q.shape[-1]
    return (q.reshape(*lead, k), s.reshape(*lead, 1), y.reshape(*lead, k) if write_y else None,
            ro.reshape(*lead, k) if residual is not None else None)  # fmt: skip


def scaled_linear_reference(
    q: torch.Tensor,
    s: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Plain PyTorch reference of ``nvfp4::fp8_scaled_linear``: ``(q · s) · (w8 · w_scale)ᵀ + bias`` in float32,
    rounded once to ``out_dtype`` (the CPU path: no row-wise ``torch._scaled_mm`` there)."""
    y = (q.float() @ w8.float().T) * s.float() * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@torch.library.custom_op("nvfp4::fp8_scaled_linear", mutates_args=())
def _scaled_linear_op(
    q: torch.Tensor,
    s: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if q.is_cuda:
        return torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=w_scale.view(1, -1), bias=bias, out_dtype=out_dtype)
    return scaled_linear_reference(q, s, w8, w_scale, bias, out_dtype)  # CPU: reference matmul (module docstring)


@_scaled_linear_op.register_fake
def _(q, s, w8, w_scale, bias, out_dtype):
    return q.new_empty((q.shape[0], w8.shape[0]), dtype=out_dtype)


def scaled_linear(
    q: torch.Tensor,
    s: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y = (q · s) · (w8 · w_scale)ᵀ + bias``: ``torch._scaled_mm`` with row-wise scales on CUDA (H100: FP8 tensor
    cores, float32 accumulation).

    Args:
        q: float8_e4m3fn ``[..., K]`` (row-major); s: float32 ``[..., 1]`` (:func:`act_quant`'s outputs).
        w8: float8_e4m3fn ``[N, K]``; w_scale: float32 ``[N]`` (:func:`fp8_weight`). CUDA: K and N multiples of 16.
        bias: optional ``[N]`` in ``out_dtype``; out_dtype: bfloat16 (what ``_scaled_mm``'s row-wise path writes).

    Returns:
        ``[..., N]`` in ``out_dtype``.
    """
    if q.shape[-1] != w8.shape[1]:
        raise ValueError(f"fp8.scaled_linear: q has {q.shape[-1]} features, the weight expects {w8.shape[1]}")
    lead = q.shape[:-1]
    y = _scaled_linear_op(q.reshape(-1, q.shape[-1]), s.reshape(-1, 1), w8, w_scale, bias, out_dtype)
    return y.reshape(*lead, w8.shape[0])


def fp8_linear(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y ≈ x · (w8 · w_scale)ᵀ + bias`` for a bf16 ``x [..., K]``: :func:`act_quant` (plain) then
    :func:`scaled_linear`; ``[..., N]`` in x's dtype (bf16 on CUDA). Inference only (no autograd formula)."""
    q, s, _, _ = act_quant(x)
    return scaled_linear(q, s, w8, w_scale, bias, x.dtype)


def fp8_weight_members(
    packed: torch.Tensor, scale: torch.Tensor, global_scales: torch.Tensor, widths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_weight` of a fused layer (vLLM's qkv_proj / gate_up_proj): the members' rows one after the other,
    each dequantised with its own global scale; the per-row scales make the copies simply concatenate.

    Args:
        packed: uint8 ``[N, K/2]`` (compressed-tensors layout); scale: float8_e4m3fn ``[N, K/16]``.
        global_scales: float32 ``[len(widths)]`` (or ``[1]``: one scale shared by every member).
        widths: the members' output rows, summing to N.

    Returns:
        ``(w8 [N, K] float8_e4m3fn, w_scale [N] float32)``.
    """
    if sum(widths) != scale.shape[0] or packed.shape[0] != scale.shape[0]:
        raise ValueError(f"fp8_weight_members: widths {widths} do not split {scale.shape[0]} rows (compressed-tensors "
                         f"layout needed, packed is {tuple(packed.shape)})")  # fmt: skip
    gs = global_scales.reshape(-1).float()
    parts, row = [], 0
    for i, width in enumerate(widths):
        parts.append(fp8_weight(packed[row : row + width], scale[row : row + width], gs[i : i + 1] if len(gs) > 1 else gs[:1]))
        row += width
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@torch.library.custom_op("nvfp4::w4a16_or_fp8_linear", mutates_args=())
def _w4a16_or_fp8_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    fp8_from_rows: int,
) -> torch.Tensor:
    if x.shape[0] >= fp8_from_rows:
        return fp8_linear(x, w8, w_scale, bias)
    return ops.linear(x, packed, scale, global_scale, bias)


@_w4a16_or_fp8_op.register_fake
def _(x, packed, scale, global_scale, w8, w_scale, bias, fp8_from_rows):
    return x.new_empty((x.shape[0], w8.shape[0]))


def w4a16_or_fp8_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    fp8_from_rows: int,
) -> torch.Tensor:
    """``rollout_precision="auto"``'s linear: :func:`nvfp4.ops.linear` (W4A16) when ``x`` has fewer than
    ``fp8_from_rows`` rows, else :func:`fp8_linear` on the E4M3 copy. The choice is made inside one custom op, at run
    time: a graph traced with a symbolic row count (vLLM's torch.compile) would otherwise bake one branch in, and a
    CUDA graph captured per batch size records the branch of its size.

    Args:
        x: ``[..., K]`` bf16/fp16/fp32; packed, scale, global_scale: the NVFP4 weight as :func:`nvfp4.ops.linear`
            takes it (``[N, K/2]`` or the MMA layout, ``[N, K/16]``, ``[1]``); w8 ``[N, K]`` float8_e4m3fn and
            w_scale ``[N]`` float32 (:func:`fp8_weight`); bias ``[N]`` in x's dtype or None.
        fp8_from_rows: rows (``x``'s leading dimensions multiplied) from which the FP8 path runs.

    Returns:
        ``[..., N]`` in x's dtype.
    """
    lead = x.shape[:-1]
    y = _w4a16_or_fp8_op(x.reshape(-1, x.shape[-1]), packed, scale, global_scale, w8, w_scale, bias, int(fp8_from_rows))
    return y.reshape(*lead, w8.shape[0])
