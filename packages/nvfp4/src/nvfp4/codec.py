"""The NVFP4 codec: the pure-PyTorch reference every kernel is checked against.

Format (identical to compressed-tensors ``nvfp4-pack-quantized``, so vLLM and llm-compressor read our tensors):

* values: E2M1 (1 sign, 2 exponent, 1 mantissa bit): ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with sign. A code is
  ``sign << 3 | index`` where ``index`` points into that list.
* packing: two codes per uint8, element ``2i`` in the LOW nibble, ``2i+1`` in the high nibble.
* scales: one FP8-E4M3 scale per block of 16 consecutive inputs, one FP32 global scale per tensor, stored as a
  *divisor*: ``global = 448 * 6 / amax(W)`` and ``W ≈ e2m1 * fp8_scale / global``.

Tensors of a quantized ``[out, in]`` weight:

=======================  =====================  ================================
name                     dtype                  shape
=======================  =====================  ================================
``weight_packed``        uint8                  ``[out, in // 2]``
``weight_scale``         float8_e4m3fn          ``[out, in // 16]``
``weight_global_scale``  float32                ``[1]``
=======================  =====================  ================================

Rounding follows compressed-tensors bit for bit: block scale ``fp8(global * amax_block / 6)`` (clamped to ±448,
round-to-nearest-even), a zero scale replaced by the FP8 epsilon 0.125 (so all-zero blocks decode to exact zeros),
E2M1 round-to-nearest with ties to even.

Arithmetic dtype. llm-compressor runs compressed-tensors on the weight in its own dtype, so for a bf16 weight
``448 * 6 / amax`` and ``amax_block / 6`` are rounded to bf16 before the float32 product and the FP8 cast. We do the
same by default (``compute_dtype=None``), which makes our RTN bytes those of llm-compressor's ``NVFP4A16`` on the same
checkpoint. ``compute_dtype=torch.float32`` computes both quotients in float32 instead (what compressed-tensors
gives for a float32 weight); it is an option, not the default: on bf16 weights its error is the same to 3-4 digits
(BENCHMARKS.md, "RTN arithmetic"). For float16 weights with ``amax < 2688 / 65504 ≈ 0.041`` the float16 quotient
overflows and compressed-tensors falls back to a global scale of 1.0 (coarse block scales, and blocks with amax below
~0.006 decode to zeros); we do too, with a warning that counts those blocks and names ``compute_dtype=torch.float32``
and a bfloat16 load.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .layout import packed_in_ct_layout, scale_in_ct_layout, weight_shape

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_MAX",
    "NVFP4Weight",
    "block_scales",
    "check_weight",
    "dequantize",
    "e2m1_to_float",
    "global_scale_from_amax",
    "pack_e2m1",
    "prepare_global_scale",
    "quantize",
    "quantize_with_scales",
    "round_to_e2m1",
    "shared_global_scale",
    "unpack_e2m1",
]

BLOCK_SIZE = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
ZERO_SCALE_EPS = 0.125  # compressed-tensors replaces a zero FP8 scale by this (torch.finfo(e4m3fn).eps)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Thresholds between neighbouring E2M1 magnitudes. Ties go to the even code: 0.25→0, 0.75→1, 1.25→1, 1.75→2,
# 2.5→2, 3.5→4, 5→4. "strict" thresholds round a tie down (code stays), the others round it up.
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIE_UP = (0.75, 1.75, 3.5)


def check_weight(
    w: torch.Tensor, name: str = "weight", *, block_size: int = BLOCK_SIZE, format_name: str = "NVFP4"
) -> None:
    """Raise a ValueError naming ``name`` if ``w`` cannot be quantized to NVFP4 (shape, dtype, NaN/Inf).

    ``block_size`` / ``format_name``: the inputs per scale and the name in messages of another 4-bit format (MXFP4:
    32, ``"MXFP4"``), which shares these checks.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name}: unsupported dtype {w.dtype}; {format_name} quantizes float32/float16/bfloat16/float64"
        )
    if w.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D [out_features, in_features] weight, got shape {tuple(w.shape)}")
    if w.numel() == 0:  # (amax of an empty tensor is torch's own error, naming nothing)
        raise ValueError(f"{name}: empty weight of shape {tuple(w.shape)}; nothing to quantize")
    if w.shape[1] % block_size != 0:
        raise ValueError(
            f"{name}: in_features={w.shape[1]} is not a multiple of the {format_name} block size {block_size}; "
            "such layers are left unquantized (add them to modules_to_not_convert)"
        )
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).sum().item()
        raise ValueError(f"{name}: contains {bad} NaN/Inf value(s); refusing to quantize")


def global_scale_from_amax(amax: torch.Tensor | float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP32 global scale ``448 * 6 / amax`` as a ``[1]`` tensor, exactly as compressed-tensors' ``generate_gparam``.

    The quotient is computed in ``dtype`` (default: ``amax``'s dtype when it is a floating tensor, else float32), then
    cast to float32; ``amax`` is clamped to ``dtype``'s smallest normal, and a non-finite quotient (float16 overflow,
    all-zero tensor) becomes 1.0.
    """
    if dtype is None:
        dtype = amax.dtype if isinstance(amax, torch.Tensor) and amax.is_floating_point() else torch.float32
    amax = torch.as_tensor(amax).to(dtype).reshape(1)
    amax = torch.clamp(amax, min=torch.finfo(dtype).tiny)
    g = FP8_MAX * FP4_MAX / amax
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def _compute_dtype(weights: Iterable[torch.Tensor], compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is not None:
        if compute_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"compute_dtype must be one of {SUPPORTED_DTYPES}, got {compute_dtype}")
        return compute_dtype
    dtype = None
    for w in weights:
        dtype = w.dtype if dtype is None else torch.promote_types(dtype, w.dtype)
    return dtype or torch.float32


def shared_global_scale(weights: Iterable[torch.Tensor], compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One FP32 global scale ``[1]`` for a fused group (q/k/v, gate/up): from the largest ``amax`` of its members.

    ``compute_dtype``: dtype of the quotient ``448 * 6 / amax`` (default the members' own dtype, as llm-compressor,
    which fuses the same groups); see the module docstring.
    """
    weights = list(weights)
    dtype = _compute_dtype(weights, compute_dtype)
    amax = torch.stack([w.detach().abs().amax().to(dtype) for w in weights]).amax()  # max is exact in any dtype
    g = global_scale_from_amax(amax, dtype)
    if dtype == torch.float16 and g.item() == 1.0 and amax.item() > 0:
        # with a global scale of 1 a block scale amax/6 below E4M3's smallest subnormal (2^-9) rounds to 0, which the
        # zero guard makes 0.125: such a block (amax < ~0.006) decodes to zeros
        blocks = torch.cat([w.detach().abs().reshape(-1, BLOCK_SIZE).amax(-1) for w in weights])
        lost = int(((blocks > 0) & (_to_fp8_scale(blocks.float() / FP4_MAX).float() == ZERO_SCALE_EPS)).sum())
        warnings.warn(
            f"NVFP4: amax={amax.item():.3g} of a float16 weight is below 2688/65504, so 448*6/amax overflows float16 "
            f"and the global scale falls back to 1.0 (compressed-tensors does the same): {lost} of its "
            f"{blocks.numel()} blocks decode to zeros and the others keep coarse scales. For a full-range scale pass "
            "compute_dtype=torch.float32 (nvfp4.quantize, quantize_model), or load the checkpoint with "
            "dtype=torch.bfloat16 (a float32 load still quantizes in the checkpoint's float16)",
            stacklevel=2,
        )
    return g


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8, ``sign << 3 | index``), saturating at ±6."""
    a = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _TIE_DOWN:
        idx += (a > t).to(torch.uint8)
    for t in _TIE_UP:
        idx += (a >= t).to(torch.uint8)
    # a value below zero keeps its sign even when it rounds to zero (code 8 = -0), while an exact -0.0 gets code 0:
    # both as compressed-tensors
    sign = (x < 0).to(torch.uint8)
    return idx | (sign << 3)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes (uint8 in [0, 16)) to float32 values of the same shape."""
    lut = torch.cat([E2M1_VALUES, -E2M1_VALUES]).to(codes.device)
    return lut.index_select(0, codes.reshape(-1).long()).reshape(codes.shape)  # ~10x faster than lut[codes] on CPU


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., 2n]`` (uint8) into ``[..., n]`` uint8: element 2i in the low nibble, 2i+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dimension must be even, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: ``[..., n]`` uint8 → ``[..., 2n]`` codes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_e2m1: expected uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def block_scales(w: torch.Tensor, global_scale: torch.Tensor, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Round-to-nearest FP8-E4M3 block scales ``[out, in/16]`` for weight ``w`` ``[out, in]``.

    ``amax / 6`` is evaluated in ``compute_dtype`` (default ``w``'s dtype) before the float32 product with
    ``global_scale``, exactly as compressed-tensors' ``calculate_qparams`` does for a weight of that dtype.
    """
    dtype = _compute_dtype([w], compute_dtype)
    amax = w.abs().reshape(w.shape[0], -1, BLOCK_SIZE).amax(-1).to(dtype)
    return _to_fp8_scale(global_scale.to(w.device, torch.float32) * (amax / FP4_MAX))


def _to_fp8_scale(s: torch.Tensor) -> torch.Tensor:
    s = torch.clamp(s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.where(s.float() == 0, torch.full_like(s, ZERO_SCALE_EPS), s)


def quantize_with_scales(w: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[out, in]`` (uint8, unpacked) of ``w`` for given FP8 block scales and global scale."""
    out, k = w.shape
    step = scale.float() / global_scale.to(w.device)  # [out, in/16]: dequantized value of code "1.0"
    scaled = w.float().reshape(out, -1, BLOCK_SIZE) / step.unsqueeze(-1)
    return round_to_e2m1(scaled).reshape(out, k)


@dataclass
class NVFP4Weight:
    """A quantized ``[out_features, in_features]`` weight in the compressed-tensors layout.

    Attributes:
        packed: uint8 ``[out, in // 2]``, two E2M1 codes per byte (element 2i in the low nibble).
        scale: float8_e4m3fn ``[out, in // 16]`` block scales.
        global_scale: float32 ``[1]``, a divisor: ``w ≈ e2m1 * scale / global_scale``.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size(weight_shape(self.packed, self.scale))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dense ``[out, in]`` weight in ``dtype``."""
        return dequantize(self.packed, self.scale, self.global_scale, dtype)

    def to(self, device: torch.device | str) -> NVFP4Weight:
        return NVFP4Weight(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.global_scale))

    def state_dict(self, prefix: str = "weight") -> dict[str, torch.Tensor]:
        """Tensors under their compressed-tensors names (``weight_packed``, ``weight_scale``, ``weight_global_scale``)."""
        return {
            f"{prefix}_packed": self.packed,
            f"{prefix}_scale": self.scale,
            f"{prefix}_global_scale": self.global_scale,
        }


def prepare_global_scale(
    w: torch.Tensor,
    global_scale: torch.Tensor | float | None,
    compute_dtype: torch.dtype | None = None,
    name: str = "weight",
) -> torch.Tensor:
    """The float32 ``[1]`` global scale ``w`` is quantized with, on ``w``'s device and never shared with the caller's
    tensor: ``global_scale`` (a fused group's; a tensor of one value or a Python number) or, when None,
    ``448 * 6 / amax(w)`` (:func:`shared_global_scale`). A given one must be a finite number > 0 (ValueError naming
    ``name``): 0, NaN or inf quantized to tensors that dequantize to NaN or zeros, silently."""
    if global_scale is None:
        global_scale = shared_global_scale([w], compute_dtype)
    g = torch.as_tensor(global_scale)
    if g.numel() != 1:  # reshape(1) failed in torch's words ("shape '[1]' is invalid for input of size 2")
        raise ValueError(f"{name}: global_scale must be one number (a float32 [1] tensor: one per tensor), got a "
                         f"tensor of shape {tuple(g.shape)}")  # fmt: skip
    g = g.to(device=w.device, dtype=torch.float32).reshape(1).clone()
    if not (torch.isfinite(g).all() and (g > 0).all()):
        raise ValueError(f"{name}: global_scale must be a finite number > 0, got {g.item()!r}")
    return g


def quantize(
    w: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    name: str = "weight",
    compute_dtype: torch.dtype | None = None,
) -> NVFP4Weight:
    """Quantize a dense weight to NVFP4 by round to nearest (byte-identical to llm-compressor's ``NVFP4A16`` /
    compressed-tensors on a weight of the same dtype). The other methods (``mse``, ``awq``, ``gptq``) build on this
    codec one level up: :func:`nvfp4.quantize` / :mod:`nvfp4.methods`.

    Args:
        w: ``[out, in]`` float32/float16/bfloat16 weight; ``in`` must be a multiple of 16.
        global_scale: float32 ``[1]`` (or a number) to use (shared by a fused q/k/v or gate/up group); default from
            ``amax(w)``.
        name: tensor name used in error messages.
        compute_dtype: dtype of the scale quotients ``448 * 6 / amax`` and ``amax_block / 6``. Default ``None``: ``w``'s
            own dtype, as llm-compressor (byte-identical checkpoints). ``torch.float32``: float32 quotients, the
            same error on bf16 weights and a full-range global scale for float16 weights with small ``amax``.

    Returns:
        :class:`NVFP4Weight` on ``w``'s device.
    """
    check_weight(w, name)
    global_scale = prepare_global_scale(w, global_scale, compute_dtype, name)
    scale = block_scales(w, global_scale, compute_dtype)
    codes = quantize_with_scales(w, scale, global_scale)
    return NVFP4Weight(pack_e2m1(codes), scale, global_scale)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Reference dequantization: uint8 ``[out, in/2]`` + fp8 ``[out, in/16]`` + fp32 ``[1]`` → ``[out, in]`` ``dtype``.

    Computed in float32 and rounded once to ``dtype``. ``packed`` may also be in the kernels' MMA layout
    (``[out/4, 2·in]``, :mod:`nvfp4.layout`) and ``scale`` beside it in :func:`~nvfp4.layout.to_scale_mma_layout`'s
    order (``[out/64, 4·in]``): both are converted back first.
    """
    if packed.dim() == 2 and scale.dim() == 2 and packed.shape[0] != scale.shape[0]:
        packed, scale = packed_in_ct_layout(packed, scale), scale_in_ct_layout(packed, scale)
    out, half = packed.shape
    if scale.shape != (out, half * 2 // BLOCK_SIZE):
        raise ValueError(
            f"NVFP4 tensors disagree: weight_packed {tuple(packed.shape)} needs weight_scale "
            f"{(out, half * 2 // BLOCK_SIZE)}, got {tuple(scale.shape)}"
        )
    values = e2m1_to_float(unpack_e2m1(packed)).reshape(out, -1, BLOCK_SIZE)
    step = scale.float() / global_scale.float().reshape(1, 1)
    return (values * step.unsqueeze(-1)).reshape(out, half * 2).to(dtype)
