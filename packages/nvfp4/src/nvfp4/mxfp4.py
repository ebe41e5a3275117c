"""The MXFP4 codec (OCP microscaling FP4): the pure-PyTorch reference for MXFP4 weights, beside NVFP4's :mod:`.codec`.

Format (identical to compressed-tensors ``mxfp4-pack-quantized``, scheme ``MXFP4A16``, so vLLM and llm-compressor
read our tensors):

* values: E2M1, coded and packed exactly as NVFP4 (:mod:`.codec`): ``sign << 3 | index`` into
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, element ``2i`` in the low nibble of byte ``i``.
* scales: one E8M0 scale per group of 32 consecutive inputs, stored as a uint8 biased exponent ``E``:
  ``scale = 2 ** (E - 127)``, ``W ≈ e2m1 * scale``. No per-tensor scale. (``E = 255`` is NaN in the OCP spec;
  we never write it. ``torch.float8_e8m0fnu`` is the same bits: ``scale.view(torch.float8_e8m0fnu)``.)

Tensors of a quantized ``[out, in]`` weight:

=================  =======  ====================
name               dtype    shape
=================  =======  ====================
``weight_packed``  uint8    ``[out, in // 2]``
``weight_scale``   uint8    ``[out, in // 32]``
=================  =======  ====================

Rounding follows compressed-tensors 0.20 (``generate_mx_scales``, ``calculate_qparams``, ``MXFP4PackedCompressor``)
bit for bit, in the weight's own dtype (as llm-compressor runs it; ``compute_dtype`` overrides):

* the group's ``amax`` is rounded to a power of two ``p`` on its bits: up when its mantissa is ≥ 0.75
  (``amax ≥ 1.75 · 2^e`` → ``2^(e+1)``), else down; a subnormal ``amax`` becomes 0 or the dtype's smallest normal;
* ``E = 127 + log2(p) - 2`` (2 = ``floor(log2 6)``: ``amax / scale`` lies in [3.5, 7), so the group's largest
  value gets code 4 or 6, saturating at 6 for mantissas in (0.5, 0.75)), clamped to ``[0, 255]``; ``p = 0``
  (all-zero or subnormal group) gives ``E = 0``;
* float16 only: a scale below float16's range (``p = 0``) becomes 0 in float16 and compressed-tensors' zero-scale
  guard replaces it by 1.0, i.e. ``E = 127``; such a group (``amax < 0.75 · 2^-14``) decodes to zeros. A group with
  ``amax ≥ 57344`` overflows the power of two in float16 (compressed-tensors then writes garbage): we refuse it and
  name ``compute_dtype=torch.float32``;
* values: ``w / scale`` in that dtype (exact: a power of two), E2M1 round-to-nearest, ties to even, saturating at
  ±6; negative values that round to zero keep their sign (code 8) but ``-0.0`` itself gets code 0, as
  compressed-tensors (its ``torch.sign(-0.0)`` is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .codec import SUPPORTED_DTYPES, check_weight, e2m1_to_float, pack_e2m1, round_to_e2m1, unpack_e2m1

__all__ = [
    "E8M0_BIAS",
    "GROUP_SIZE",
    "MXFP4Weight",
    "dequantize",
    "e8m0_exponents",
    "e8m0_to_float",
    "from_nvfp4",
    "group_exponents",
    "linear_reference",
    "quantize",
    "quantize_with_scales",
    "to_nvfp4",
]

GROUP_SIZE = 32  # inputs per E8M0 scale (the OCP MX block size)
E8M0_BIAS = 127
E2M1_EMAX = 2  # floor(log2(6)): the exponent of the largest E2M1 value

# Bit layout per dtype: (same-width integer view, mantissa bits, exponent bias, exponent field of inf/NaN)
_FLOAT_BITS: dict[torch.dtype, tuple[torch.dtype, int, int, int]] = {
    torch.bfloat16: (torch.int16, 7, 127, 0xFF),
    torch.float16: (torch.int16, 10, 15, 0x1F),
    torch.float32: (torch.int32, 23, 127, 0xFF),
    torch.float64: (torch.int64, 52, 1023, 0x7FF),
}


def e8m0_exponents(amax: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """E8M0 exponents (uint8, same shape) for groups whose largest magnitude is ``amax`` (≥ 0, finite).

    The arithmetic is compressed-tensors' for a tensor of ``amax.dtype`` (see the module docstring), done on the bits:
    the rounding to a power of two adds ``0.25 · 2^e`` (a quarter of the mantissa range) to the bits and keeps the
    exponent field.
    Raises a ValueError naming ``name`` where the scale leaves E8M0's range (``E ≥ 255``) or the power of two
    overflows ``amax.dtype``.
    """
    if amax.dtype not in _FLOAT_BITS:
        raise ValueError(f"{name}: unsupported dtype {amax.dtype}; MXFP4 quantizes {SUPPORTED_DTYPES}")
    int_dtype, mantissa_bits, bias, inf_field = _FLOAT_BITS[amax.dtype]
    bits = amax.contiguous().view(int_dtype).to(torch.int64)  # amax ≥ 0: the sign bit is clear
    # mantissa ≥ 0.75 carries into the exponent (E2M1 has 1 mantissa bit: compressed-tensors' round_to_power_2)
    field = (bits + (1 << (mantissa_bits - 2))) >> mantissa_bits  # exponent field of p; 0 means p = 0
    if (field >= inf_field).any():
        hint = (
            " (float16 power of two ≥ 65536; pass compute_dtype=torch.float32)" if amax.dtype == torch.float16 else ""
        )
        raise ValueError(
            f"{name}: a group's amax {amax.max().item():.4g} overflows the MXFP4 scale in {amax.dtype}{hint}"
        )
    exp = (field - bias + E8M0_BIAS - E2M1_EMAX).clamp_min(0)
    # p = 0: log2 → -inf → E = 0, i.e. scale 2^-127, which float16 cannot hold: compressed-tensors then stores 1.0
    exp = torch.where(field == 0, E8M0_BIAS if amax.dtype == torch.float16 else 0, exp)
    if (exp >= 0xFF).any():
        raise ValueError(f"{name}: a group's amax {amax.max().item():.4g} exceeds the E8M0 scale range (2^127 · 6)")
    return exp.to(torch.uint8)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 exponents (uint8) to float32 ``2 ** (E - 127)`` of the same shape; ``E = 255`` → NaN.

    Built from the float32 bits (exact, ``E = 0`` is the subnormal 2^-127), not by ``pow``/``exp2``.
    """
    if scale.dtype != torch.uint8:
        raise ValueError(f"e8m0_to_float: expected uint8 exponents, got {scale.dtype}")
    e = scale.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return torch.where(e == 0xFF, torch.nan, bits.view(torch.float32))


def _compute_dtype(w: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is None:
        return w.dtype
    if compute_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"compute_dtype must be one of {SUPPORTED_DTYPES}, got {compute_dtype}")
    return compute_dtype


def group_exponents(w: torch.Tensor, compute_dtype: torch.dtype | None = None, name: str = "weight") -> torch.Tensor:
    """E8M0 scales uint8 ``[out, in/32]`` of ``w`` ``[out, in]`` (round to nearest, compressed-tensors' rule)."""
    amax = w.detach().abs().reshape(w.shape[0], -1, GROUP_SIZE).amax(-1)  # max is exact in any dtype
    return e8m0_exponents(amax.to(_compute_dtype(w, compute_dtype)), name)


def quantize_with_scales(
    w: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """E2M1 codes ``[out, in]`` (uint8, unpacked) of ``w`` ``[out, in]`` for E8M0 scales ``[out, in/32]`` (uint8).

    ``w / scale`` is computed in ``compute_dtype`` (default ``w``'s dtype) as compressed-tensors does; every scale
    :func:`group_exponents` writes is exact in that dtype, so the quotient is exact wherever it matters (≥ 0.25).
    """
    out, k = w.shape
    dtype = _compute_dtype(w, compute_dtype)
    step = e8m0_to_float(scale).to(dtype).unsqueeze(-1)  # [out, in/32, 1]
    scaled = w.detach().to(dtype).reshape(out, -1, GROUP_SIZE) / step
    codes = round_to_e2m1(scaled.float())
    codes = torch.where(scaled == 0, codes & 0x7, codes)  # -0.0 → code 0 (compressed-tensors' sign(-0.0) is 0)
    return codes.reshape(out, k)


@dataclass
class MXFP4Weight:
    """A quantized ``[out_features, in_features]`` MXFP4 weight in the compressed-tensors layout.

    Attributes:
        packed: uint8 ``[out, in // 2]``, two E2M1 codes per byte (element 2i in the low nibble).
        scale: uint8 ``[out, in // 32]`` E8M0 exponents: ``w ≈ e2m1 * 2 ** (scale - 127)``.
    """

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.scale.shape[0], self.scale.shape[1] * GROUP_SIZE))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dense ``[out, in]`` weight in ``dtype``."""
        return dequantize(self.packed, self.scale, dtype)

    def to(self, device: torch.device | str) -> MXFP4Weight:
        return MXFP4Weight(self.packed.to(device), self.scale.to(device))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale))

    def state_dict(self, prefix: str = "weight") -> dict[str, torch.Tensor]:
        """Tensors under their compressed-tensors names (``weight_packed``, ``weight_scale``)."""
        return {f"{prefix}_packed": self.packed, f"{prefix}_scale": self.scale}


def quantize(
    w: torch.Tensor,
    *,
    method: str = "rtn",
    name: str = "weight",
    compute_dtype: torch.dtype | None = None,
) -> MXFP4Weight:
    """Quantize a dense weight to MXFP4 by round to nearest.

    Args:
        w: ``[out, in]`` float32/float16/bfloat16 (or float64) weight; ``in`` must be a multiple of 32.
        method: ``"rtn"`` only (byte-identical to compressed-tensors' ``MXFP4A16`` on a weight of the same dtype);
            the calibrated methods of NVFP4 are not implemented for MXFP4 yet.
        name: tensor name used in error messages.
        compute_dtype: dtype of the scale and quotient arithmetic. Default ``None``: ``w``'s own dtype, as
            llm-compressor. Only float16 weights differ with ``torch.float32``: groups with ``amax < 4.6e-5`` get a
            real scale instead of 1.0, and groups with ``amax ≥ 57344`` quantize instead of raising.

    Returns:
        :class:`MXFP4Weight` on ``w``'s device.
    """
    check_weight(w, name, block_size=GROUP_SIZE, format_name="MXFP4")
    if method != "rtn":
        raise ValueError(f"{name}: unknown MXFP4 method {method!r}; only 'rtn' is implemented")
    scale = group_exponents(w, compute_dtype, name)
    codes = quantize_with_scales(w, scale, compute_dtype)
    return MXFP4Weight(pack_e2m1(codes), scale)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference dequantization: uint8 ``[out, in/2]`` + E8M0 uint8 ``[out, in/32]`` → ``[out, in]`` ``dtype``.

    Computed in float32 (exact: a 3-bit value times a power of two) and rounded once to ``dtype``.
    """
    out, half = packed.shape
    if scale.dtype != torch.uint8 or scale.shape != (out, half * 2 // GROUP_SIZE) or (half * 2) % GROUP_SIZE:
        raise ValueError(
            f"MXFP4 tensors disagree: weight_packed {tuple(packed.shape)} needs a uint8 weight_scale "
            f"{(out, half * 2 // GROUP_SIZE)}, got {scale.dtype} {tuple(scale.shape)}"
        )
    values = e2m1_to_float(unpack_e2m1(packed)).reshape(out, -1, GROUP_SIZE)
    return (values * e8m0_to_float(scale).unsqueeze(-1)).reshape(out, half * 2).to(dtype)


def linear_reference(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain PyTorch MXFP4 W4A16 linear: ``y = x · dequant(W)ᵀ + b`` (the reference future kernels are checked against).

    Args:
        x: ``[..., in]`` float32/float16/bfloat16 activations.
        packed: uint8 ``[out, in // 2]`` E2M1 codes (compressed-tensors layout).
        scale: uint8 ``[out, in // 32]`` E8M0 exponents.
        bias: ``[out]`` or None, cast to ``x.dtype``.

    Returns:
        ``[..., out]`` in ``x.dtype``: ``W`` is dequantized to ``x.dtype`` (exact for bf16/fp32 within its range),
        then ``F.linear``.
    """
    if not x.is_floating_point():  # W dequantized to an integer dtype truncates (zeros for every value below 1)
        raise ValueError(f"mxfp4.linear_reference: x must be floating-point (float32/float16/bfloat16), got {x.dtype}")
    return F.linear(x, dequantize(packed, scale, x.dtype), None if bias is None else bias.to(x.dtype))


# ---- exact transcode to NVFP4 scales (the NVFP4 ops and kernels then compute MXFP4 layers) -------------------------

FP8_POW2_MAX = 8  # 2^8 = 256: the largest power of two in E4M3 (448 = 1.75 · 2^8)
FP8_POW2_MIN = -9  # 2^-9: the smallest E4M3 subnormal; E4M3 holds every power of two in [2^-9, 2^8] exactly
_GLOBAL_LOG2_MAX = 126  # global = 2^c: the kernels fold 2^14 / global into fp32; keep 1 / global a normal float32
_GLOBAL_LOG2_MIN = -100  # the kernels' fast path needs 2^126 / (448 / global) ≥ 2^-100 (see kernels/decode.py)


def _zero_groups(packed: torch.Tensor) -> torch.Tensor:
    """bool ``[out, in/32]``: whether all 32 codes of each group are ±0 (magnitude bits 0 in both nibbles)."""
    out, half = packed.shape
    return ((packed.reshape(out, half * 2 // GROUP_SIZE, GROUP_SIZE // 2) & 0x77) == 0).all(-1)


def _fp8_pow2(j: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``2^j`` for int ``j`` in [-9, 8]: bits ``(j+7) << 3`` (normals), ``1 << (j+9)`` (subnormals)."""
    bits = torch.where(j >= -6, (j + 7) << 3, 1 << (j + 9).clamp_min(0))
    return bits.to(torch.uint8).view(torch.float8_e4m3fn)


def to_nvfp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Exact NVFP4 scales of an MXFP4 weight, or None where the tensor has none.

    ``2^(E-127)`` per 32 inputs becomes the FP8-E4M3 power of two ``2^(E-127+c)`` for both 16-input halves and the
    global divisor ``2^c``, ``c`` chosen so that the largest scale of a non-zero group is ``2^8``: then
    ``e2m1 · fp8 / global == e2m1 · 2^(E-127)`` exactly (:func:`nvfp4.codec.dequantize` equals :func:`dequantize`
    bit for bit) and the NVFP4 ops and kernels compute the layer. E4M3 holds the powers of two ``2^-9 … 2^8``, so the
    exponents of the non-zero groups must span at most 18 binades. A group whose codes are all ±0 decodes to zeros
    under any scale: outside the window it gets the nearest one (then :func:`from_nvfp4` does not give its byte back).

    Args:
        packed: uint8 ``[out, in/2]`` E2M1 codes (compressed-tensors layout).
        scale: uint8 ``[out, in/32]`` E8M0 exponents.

    Returns:
        ``(fp8_scale float8_e4m3fn [out, in/16], global_scale float32 [1])`` on ``scale``'s device, every scale a
        positive power of two (so :func:`nvfp4.layout.mma_scales_supported` holds); or None if a non-zero group lies
        below the window (more than 18 binades under the largest), a scale is NaN (``E = 255``), or ``c`` leaves
        [-100, 126] (scales above 2^108 or the whole tensor below 2^-118, where the kernels' folded factors would
        leave float32's normal range).
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"to_nvfp4: expected uint8 weight_packed [out, in/2] and uint8 weight_scale [out, in/32], got "
            f"{packed.dtype} {tuple(packed.shape)} and {scale.dtype} {tuple(scale.shape)}"
        )
    out, half = packed.shape
    if (half * 2) % GROUP_SIZE or tuple(scale.shape) != (out, half * 2 // GROUP_SIZE):
        raise ValueError(
            f"to_nvfp4: weight_packed {tuple(packed.shape)} needs weight_scale {(out, half * 2 // GROUP_SIZE)}, "
            f"got {tuple(scale.shape)}"
        )
    e = scale.to(torch.int32)
    if bool((e == 0xFF).any()):
        return None
    zero = _zero_groups(packed)
    live = e[~zero]
    e_max = int(live.max()) if live.numel() else int(e.max()) if e.numel() else E8M0_BIAS
    c = min(E8M0_BIAS + FP8_POW2_MAX - e_max, _GLOBAL_LOG2_MAX)
    if c < _GLOBAL_LOG2_MIN:
        return None
    j = e - E8M0_BIAS + c  # log2 of the FP8 scale; ≤ 8 for every non-zero group
    if live.numel() and int(live.min()) - E8M0_BIAS + c < FP8_POW2_MIN:
        return None
    fp8 = _fp8_pow2(j.clamp(FP8_POW2_MIN, FP8_POW2_MAX)).repeat_interleave(2, dim=1)  # both 16-halves of a group
    global_scale = torch.tensor([(c + 127) << 23], dtype=torch.int32, device=scale.device).view(torch.float32)
    return fp8, global_scale


def from_nvfp4(fp8_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents uint8 ``[out, in/32]`` of NVFP4 scales that :func:`to_nvfp4` wrote (its exact inverse).

    Args:
        fp8_scale: float8_e4m3fn ``[out, in/16]``, powers of two, equal in both 16-input halves of each 32-group.
        global_scale: float32 ``[1]``, a power of two ``2^c``.

    Raises:
        ValueError: if a scale is not a positive power of two, the halves of a group differ, or an exponent leaves
            E8M0's range.
    """
    if fp8_scale.dtype != torch.float8_e4m3fn or fp8_scale.dim() != 2 or fp8_scale.shape[1] % 2:
        raise ValueError(f"from_nvfp4: expected float8_e4m3fn [out, in/16] (in % 32 == 0), got {fp8_scale.dtype} "
                         f"{tuple(fp8_scale.shape)}")  # fmt: skip
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(f"from_nvfp4: expected a float32 [1] global scale, got {global_scale.dtype} "
                         f"{tuple(global_scale.shape)}")  # fmt: skip
    g_bits = int(global_scale.reshape(1).view(torch.int32).item())
    if g_bits & 0x807FFFFF or not 0 < (g_bits >> 23) < 0xFF:
        raise ValueError(f"from_nvfp4: global scale {global_scale.item()!r} is not a normal power of two")
    c = (g_bits >> 23) - 127
    bits = fp8_scale.view(torch.uint8).to(torch.int32)
    if not torch.equal(bits[:, 0::2], bits[:, 1::2]):
        raise ValueError("from_nvfp4: the two 16-input scales of a 32-input group differ (not an MXFP4 transcode)")
    bits = bits[:, 0::2]
    normal = bits >= 8
    # subnormal 2^j: bits 1, 2, 4 (j = -9, -8, -7); normal 2^j: exponent field (bits >> 3) = j + 7, mantissa 0
    pow2 = torch.where(normal, (bits & 7) == 0, (bits & (bits - 1)) == 0) & (bits > 0) & (bits < 0x7F)
    if not bool(pow2.all()):
        raise ValueError("from_nvfp4: a scale is not a positive power of two (not an MXFP4 transcode)")
    sub_log2 = torch.where(bits >= 4, 2, torch.where(bits >= 2, 1, 0))
    j = torch.where(normal, (bits >> 3) - 7, sub_log2 - 9)
    e = j - c + E8M0_BIAS
    if bool(((e < 0) | (e > 254)).any()):
        raise ValueError(f"from_nvfp4: an exponent leaves E8M0's range (global scale 2^{c})")
    return e.to(torch.uint8)
