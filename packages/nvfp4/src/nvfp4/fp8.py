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
* the LoRA adapter as K columns of the FP8 GEMM (issue #51 item 3's spike, not wired into an engine yet):
  :func:`fp8_lora_weight` (``[W_fp8 | c·B]`` and the stacked A of a plain or fused layer, the site's power of two
  ``c`` by :func:`lora_scale_c`), :func:`act_quant_lora` (the quantisation with the shrink ``s = v·Aᵀ`` in it,
  ``q = [q_x | q(s / c)]`` on one row scale), :func:`fp8_lora_linear` (the two, then the K + r GEMM) and their
  references :func:`act_quant_lora_reference`, :func:`fp8_lora_linear_reference`.

Dispatch: on CUDA the quantisation is the Triton kernel and the product ``torch._scaled_mm``; elsewhere both are the
references below. CPU note: ``torch._scaled_mm`` on CPU (torch 2.11, oneDNN) takes per-tensor scales only, so the
CPU path of ``scaled_linear`` is the reference matmul (:func:`scaled_linear_reference`, float32), not an FP8 GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import ops
from .codec import dequantize
from .layout import scale_rows, weight_shape
from .ops import _use_triton

__all__ = [
    "FP8_MAX",
    "act_quant",
    "act_quant_lora",
    "act_quant_lora_reference",
    "act_quant_reference",
    "fp8_linear",
    "fp8_lora_linear",
    "fp8_lora_linear_reference",
    "fp8_lora_weight",
    "fp8_weight",
    "fp8_weight_members",
    "lora_scale_c",
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


# ------------------------------------------------------------------------------------------------------------------
# LoRA as K columns of the FP8 GEMM (issue #51 item 3's spike; docs/fp8_rollouts.md)
# ------------------------------------------------------------------------------------------------------------------
def lora_scale_c(w_scale: torch.Tensor, b: torch.Tensor) -> float:
    """The site's power of two ``c``: the largest with ``c·|B[n]| ≤ amax(W[n])`` on every output row, so ``c·B``
    quantises with W's own row scale (``w_scale[n] = amax(W[n]) / 448``) without saturating and with the most of
    E4M3's binades; the kernel then quantises ``s / c``, as small as that rule allows beside the row's ``v``.

    ``c = 2^⌊log2(min_n amax(W[n]) / amax(B[n]))⌋`` over the rows where B is not zero and W is not (an all-zero W row
    has no scale to share: its B' saturates at ``±448·w_scale``, the row's adapter lost; NVFP4 weights of trained
    models have none); every B row zero (a fresh adapter) gives ``c = 1``.

    Args:
        w_scale: float32 ``[N]`` (:func:`fp8_weight`); b: ``[N, r]``, the adapter's B times its scaling (a fused
            layer's members' B placed at their rows and columns, zeros elsewhere).
    """
    if b.dim() != 2 or b.shape[0] != w_scale.shape[0]:
        raise ValueError(f"lora_scale_c: B must be [{w_scale.shape[0]}, r], got {tuple(b.shape)}")
    w_amax = w_scale.double() * FP8_MAX
    b_amax = b.double().abs().amax(dim=1)
    keep = (b_amax > 0) & (w_amax > 2 * AMAX_FLOOR)  # an all-zero W row holds the floor, 1e-12
    if not bool(keep.any()):
        return 1.0
    ratio = (w_amax[keep] / b_amax[keep]).min().item()
    c = 2.0 ** math.floor(math.log2(ratio))
    while (b_amax[keep] * c > w_amax[keep]).any():  # log2's rounding at an exact power of two
        c /= 2
    return c


def fp8_lora_weight(
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None],
    widths: Sequence[int] | None = None,
    a_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``[W_fp8 | B'_fp8]`` for the K + r GEMM, from a layer's E4M3 copy and its PEFT-style adapters.

    Member ``i`` (rows ``[Σ widths[:i], Σ widths[:i + 1])``, rank ``r_i``) holds ``(A_i [r_i, K], B_i [widths[i],
    r_i], scaling_i)`` (PEFT: ``y += scaling · (x·Aᵀ)·Bᵀ``; vLLM's fused qkv_proj / gate_up_proj: one per member) or
    ``None`` (no adapter: no columns). ``B' = c · scaling_i · B_i`` at the member's rows and its own r_i columns,
    zeros elsewhere, quantised to E4M3 with **W's row scales** (``w8`` and ``w_scale`` are not changed).

    Args:
        w8: float8_e4m3fn ``[N, K]``; w_scale: float32 ``[N]`` (:func:`fp8_weight` / :func:`fp8_weight_members`).
        adapters: one entry a member; widths: the members' output rows (default: one member, ``[N]``).
        a_dtype: the stacked A's dtype (bf16 as the LoRA's; the interpreter tests use fp16).

    Returns:
        ``(w8_ext [N, K + r] float8_e4m3fn, lora_a [r, K] a_dtype, c)`` with ``r = Σ r_i``: the weight operand of
        :func:`fp8_lora_linear`, the A :func:`act_quant_lora` reads, the site's ``c`` (:func:`lora_scale_c`).
    """
    n, k = w8.shape
    widths = [n] if widths is None else list(widths)
    if sum(widths) != n or len(adapters) != len(widths):
        raise ValueError(f"fp8_lora_weight: {len(adapters)} adapters for members {widths} of {n} rows")
    parts_a, cols, row = [], [], 0
    for width, ad in zip(widths, adapters, strict=True):
        if ad is not None:
            a, b, scaling = ad
            if a.dim() != 2 or a.shape[1] != k or b.shape != (width, a.shape[0]):
                raise ValueError(f"fp8_lora_weight: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a "
                                 f"[{width}, {k}] member")  # fmt: skip
            parts_a.append(a)
            cols.append((row, width, b.float() * float(scaling)))
        row += width
    if not parts_a:
        raise ValueError("fp8_lora_weight: no member has an adapter")
    r = sum(p.shape[0] for p in parts_a)
    bs = torch.zeros(n, r, dtype=torch.float32, device=w8.device)
    col = 0
    for row0, width, b in cols:
        bs[row0 : row0 + width, col : col + b.shape[1]] = b
        col += b.shape[1]
    c = lora_scale_c(w_scale, bs)
    b8 = round_e4m3_reference(bs * c / w_scale.float()[:, None])
    lora_a = torch.cat(parts_a).to(device=w8.device, dtype=a_dtype).contiguous()
    return torch.cat([w8, b8], dim=1).contiguous(), lora_a, c


def act_quant_lora_reference(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_scale_c: float,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    form: int = 1,
    a_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain PyTorch reference of :func:`act_quant_lora`, in the kernel's float32 arithmetic: the shrink multiplies
    ``h·w`` (the row before the norm's ``1 / rms``) rounded to A's dtype by A in float32, then ``· (1 / c)`` and
    ``· rstd``. Form 1's amax is over ``[v·rstd, s / c]``; form 2's over ``[v·rstd, ‖v‖₂·rstd·a_norm / c]`` (v
    rounded to A's dtype in the norm, ``a_norm = max_j ‖A_j‖₂``, :func:`nvfp4.kernels.fp8.lora_a_norm`'s
    expression): a bound on ``|s / c|`` known before the shrink ends (Cauchy-Schwarz). Divisions tensor by tensor
    (correctly rounded, as the kernel's under the interpreter; torch's ``scalar / tensor`` multiplies by a
    reciprocal, an ulp off a quarter of the time).

    Returns:
        ``(q [M, K + r] float8_e4m3fn, s [M, 1] float32, y [M, K] in x's dtype, residual_out or None)``.
    """
    h, ro = _pre_norm_reference(x, mode, residual)
    v, rstd = h, torch.ones_like(h[:, :1])
    if mode == "rms_norm":
        v = h * norm_weight.float()
        ss = h.pow(2).sum(dim=-1, keepdim=True)
        ms = ss / torch.full_like(ss, h.shape[-1])  # the kernel's sum / K
        rstd = torch.ones_like(ms) / torch.sqrt(ms + eps)
    sc = (v.to(lora_a.dtype).float() @ lora_a.float().T) * (1.0 / lora_scale_c) * rstd
    if form == 2:
        if a_norm is None:
            a_norm = lora_a.float().norm(dim=1).amax().reshape(1)
        vr = v.to(lora_a.dtype).float()
        bound = torch.sqrt(vr.pow(2).sum(dim=-1, keepdim=True)) * rstd * a_norm.to(v.device) * (1.0 / lora_scale_c)
    elif form == 1:
        bound = sc.abs().amax(dim=-1, keepdim=True)
    else:
        raise ValueError(f"act_quant_lora_reference: form must be 1 or 2, got {form}")
    amax = torch.maximum(v.abs().amax(dim=-1, keepdim=True) * rstd, bound).clamp_min(AMAX_FLOOR)
    fp8_max = torch.full_like(amax, FP8_MAX)
    g = fp8_max / amax
    q = torch.cat([round_e4m3_reference(v * (rstd * g)), round_e4m3_reference(sc * g)], dim=-1)
    return q, amax / fp8_max, (v * rstd).to(x.dtype), ro


def act_quant_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_scale_c: float,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    write_y: bool = False,
    block_m: int | None = None,
    form: int = 1,
    split_k: int | None = None,
    a_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`act_quant` with the LoRA shrink in the same kernel: ``q = [q(v) | q(s / c)]`` on one row scale.

    Args:
        x: ``[M, K]`` (``[M, 2K]`` for ``"silu_mul"``); lora_a: ``[r, K]`` bf16 (:func:`fp8_lora_weight`);
            lora_scale_c: the site's ``c``; mode, norm_weight, eps, residual, write_y: as :func:`act_quant`;
            block_m: rows a kernel program (:func:`nvfp4.kernels.fp8.lora_blocks` / ``split_blocks``).
        form: 1 (one pass over K a row block; the row scale from the exact ``max|s / c|``) or 2 (split over K; the
            row scale from a Cauchy-Schwarz bound on it); split_k: form 2's K slices (default: auto); a_norm: form 2's
            ``max_j ‖A_j‖₂`` (float32 ``[1]``; :func:`nvfp4.kernels.fp8.lora_a_norm`, computed when ``None``).

    Returns:
        ``(q [M, K + r] float8_e4m3fn, s [M, 1] float32, y or None, residual_out or None)``. CUDA: the Triton
        kernel; elsewhere :func:`act_quant_lora_reference`. Not a custom op yet (the spike; no autograd).
    """
    if mode not in _MODES:
        raise ValueError(f"act_quant_lora: mode must be one of {_MODES}, got {mode!r}")
    if _use_triton(x):
        from .kernels.fp8 import act_quant_lora as launch

        return launch(x, lora_a, lora_scale_c, mode, norm_weight, eps, residual, write_y, block_m=block_m, form=form,
                      split_k=split_k, a_norm=a_norm)  # fmt: skip
    q, s, y, ro = act_quant_lora_reference(x, lora_a, lora_scale_c, mode, norm_weight, eps, residual, form, a_norm)
    return q, s, y if write_y else None, ro


def fp8_lora_linear(
    x: torch.Tensor,
    w8_ext: torch.Tensor,
    w_scale: torch.Tensor,
    lora_a: torch.Tensor,
    lora_scale_c: float,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    block_m: int | None = None,
    form: int = 1,
    a_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y ≈ v·Wᵀ + Σ_i scaling_i·(v·A_iᵀ)·B_iᵀ + bias`` as one K + r FP8 GEMM: :func:`act_quant_lora` then
    :func:`scaled_linear` (``torch._scaled_mm`` row-wise on CUDA; the float32 reference matmul elsewhere).

    Args:
        x: ``[M, K]`` (``[M, 2K]`` for ``"silu_mul"``), v its normalised / activated row (``mode``); w8_ext, lora_a,
            lora_scale_c: :func:`fp8_lora_weight`'s; w_scale: W's ``[N]`` row scales; bias: ``[N]`` or None;
            block_m, form, a_norm: :func:`act_quant_lora`'s (form 2's K slices: the default).

    Returns:
        ``[M, N]`` in x's dtype.
    """
    q, s, _, _ = act_quant_lora(x, lora_a, lora_scale_c, mode, norm_weight, eps, block_m=block_m, form=form,
                                a_norm=a_norm)  # fmt: skip
    return scaled_linear(q, s, w8_ext, w_scale, bias, x.dtype)


def fp8_lora_linear_reference(
    x: torch.Tensor,
    w8_ext: torch.Tensor,
    w_scale: torch.Tensor,
    lora_a: torch.Tensor,
    lora_scale_c: float,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    form: int = 1,
) -> torch.Tensor:
    """The whole fused linear in plain PyTorch: :func:`act_quant_lora_reference` (``form`` 1 or 2), then the K + r
    GEMM in float32 on the dequantised E4M3 values (``(q · s) · (w8_ext · w_scale)ᵀ + bias``); float32 ``[M, N]``."""
    q, s, _, _ = act_quant_lora_reference(x, lora_a, lora_scale_c, mode, norm_weight, eps, form=form)
    return scaled_linear_reference(q, s, w8_ext, w_scale, bias, torch.float32)
