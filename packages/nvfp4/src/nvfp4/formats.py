"""The 4-bit weight formats behind one interface: NVFP4 (:mod:`.codec`) and MXFP4 (:mod:`.mxfp4`).

Both store E2M1 values packed two per byte in the compressed-tensors layout (``weight_packed`` uint8
``[out, in/2]``) and differ in their scales:

* ``nvfp4``: ``weight_scale`` float8_e4m3fn ``[out, in/16]`` and ``weight_global_scale`` float32 ``[1]``;
  compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor scheme ``NVFP4A16``).
* ``mxfp4``: ``weight_scale`` uint8 E8M0 exponents ``[out, in/32]``, no global scale; compressed-tensors
  ``mxfp4-pack-quantized`` (scheme ``MXFP4A16``).

A :class:`Format` carries what code outside the codecs needs to handle a weight without knowing which format it is:
the tensors' names, dtypes and shapes (layers, checkpoint checks), the compressed-tensors strings (saved configs, the
vLLM plugin), ``quantize`` and the reference ``dequantize`` / ``linear`` (CPU path, kernel tests). Look one up with
:func:`get_format` (``"nvfp4"``, ``"mxfp4"`` or a compressed-tensors format string) or :func:`format_of` (a weight).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import torch

from . import codec, mxfp4, ops

__all__ = ["FORMATS", "MXFP4", "NVFP4", "Format", "QuantizedWeight", "format_of", "get_format"]


@runtime_checkable
class QuantizedWeight(Protocol):
    """A quantized ``[out, in]`` weight: :class:`nvfp4.codec.NVFP4Weight` or :class:`nvfp4.mxfp4.MXFP4Weight`."""

    packed: torch.Tensor  # uint8 [out, in/2], E2M1 codes, element 2i in the low nibble
    scale: torch.Tensor  # [out, in/group_size], the format's scale dtype

    @property
    def shape(self) -> torch.Size: ...

    @property
    def nbytes(self) -> int: ...

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor: ...

    def state_dict(self, prefix: str = "weight") -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class Format:
    """One 4-bit weight format.

    Attributes:
        name: ``"nvfp4"`` or ``"mxfp4"``.
        group_size: inputs per scale (16 / 32); ``in_features`` must be a multiple of it.
        scale_dtype: dtype of ``weight_scale`` (``float8_e4m3fn`` / ``uint8`` holding E8M0 exponents).
        has_global_scale: whether a float32 ``[1]`` ``weight_global_scale`` divides the scales (NVFP4 only).
        ct_format: compressed-tensors format string of the checkpoint tensors.
        ct_scheme: the compressed-tensors preset (llm-compressor scheme) of weight-only quantization in this format.
        weight_type: the codec's container class.
        quantize: ``(w [out, in], *, method="rtn", name="weight", compute_dtype=None, ...) -> weight``; RTN gives
            compressed-tensors' bytes for ``ct_scheme``.
    """

    name: str
    group_size: int
    scale_dtype: torch.dtype
    has_global_scale: bool
    ct_format: str
    ct_scheme: str
    weight_type: type
    quantize: Callable[..., QuantizedWeight]
    _linear_reference: Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor] = field(repr=False)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Suffixes of the tensors a quantized ``weight`` is saved as (``weight_packed``, ...)."""
        return ("weight_packed", "weight_scale") + (("weight_global_scale",) if self.has_global_scale else ())

    def tensor_specs(self, out_features: int, in_features: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{name: (dtype, shape)}`` of the tensors of an ``[out_features, in_features]`` weight."""
        if in_features % self.group_size:
            raise ValueError(f"{self.name}: in_features={in_features} is not a multiple of {self.group_size}")
        specs = {
            "weight_packed": (torch.uint8, (out_features, in_features // 2)),
            "weight_scale": (self.scale_dtype, (out_features, in_features // self.group_size)),
        }
        if self.has_global_scale:
            specs["weight_global_scale"] = (torch.float32, (1,))
        return specs

    def weight_from_tensors(self, tensors: Mapping[str, torch.Tensor], prefix: str = "weight") -> QuantizedWeight:
        """The weight held under ``{prefix}_packed``, ``{prefix}_scale`` (, ``{prefix}_global_scale``) in ``tensors``
        (a state dict), checked against :meth:`tensor_specs`; raises ValueError naming the tensor that disagrees."""
        keys = {n: prefix + n.removeprefix("weight") for n in self.tensor_names}  # weight_scale → {prefix}_scale
        missing = [k for k in keys.values() if k not in tensors]
        if missing:
            raise ValueError(f"{self.name}: missing tensor(s) {missing}")
        got = {n: tensors[k] for n, k in keys.items()}
        out, half = got["weight_packed"].shape
        for n, (dtype, shape) in self.tensor_specs(out, half * 2).items():
            if got[n].dtype != dtype or tuple(got[n].shape) != shape:
                raise ValueError(
                    f"{keys[n]}: {got[n].dtype} {tuple(got[n].shape)}, {self.name} needs {dtype} {shape} "
                    f"for a [{out}, {half * 2}] weight"
                )
        return self.weight_type(*got.values())  # the containers take (packed, scale[, global_scale]) in this order

    def _check(self, weight: QuantizedWeight) -> None:
        if not isinstance(weight, self.weight_type):
            raise TypeError(f"{self.name}: expected a {self.weight_type.__name__}, got {type(weight).__name__}")

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dense ``[out, in]`` weight in ``dtype`` (the codec's reference dequantization)."""
        self._check(weight)
        return weight.dequantize(dtype)

    def linear_reference(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Plain PyTorch W4A16 linear: ``x [..., in]`` → ``x · dequant(W)ᵀ + b`` ``[..., out]`` in ``x.dtype``."""
        self._check(weight)
        return self._linear_reference(x, weight, bias)


def _nvfp4_linear(x: torch.Tensor, w: codec.NVFP4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return ops.linear_reference(x, w.packed, w.scale, w.global_scale, bias)


def _mxfp4_linear(x: torch.Tensor, w: mxfp4.MXFP4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return mxfp4.linear_reference(x, w.packed, w.scale, bias)


NVFP4 = Format(
    name="nvfp4",
    group_size=codec.BLOCK_SIZE,
    scale_dtype=torch.float8_e4m3fn,
    has_global_scale=True,
    ct_format="nvfp4-pack-quantized",
    ct_scheme="NVFP4A16",
    weight_type=codec.NVFP4Weight,
    quantize=codec.quantize,
    _linear_reference=_nvfp4_linear,
)

MXFP4 = Format(
    name="mxfp4",
    group_size=mxfp4.GROUP_SIZE,
    scale_dtype=torch.uint8,
    has_global_scale=False,
    ct_format="mxfp4-pack-quantized",
    ct_scheme="MXFP4A16",
    weight_type=mxfp4.MXFP4Weight,
    quantize=mxfp4.quantize,
    _linear_reference=_mxfp4_linear,
)

FORMATS: Mapping[str, Format] = MappingProxyType({f.name: f for f in (NVFP4, MXFP4)})


def get_format(name: str | Format) -> Format:
    """The :class:`Format` called ``name`` (``"nvfp4"`` / ``"mxfp4"``, any case) or whose compressed-tensors format
    string is ``name`` (``"mxfp4-pack-quantized"``); a :class:`Format` is returned as is."""
    if isinstance(name, Format):
        return name
    key = str(name).lower()
    for f in FORMATS.values():
        if key in (f.name, f.ct_format):
            return f
    raise ValueError(f"unknown 4-bit format {name!r}; choose one of {sorted(FORMATS)}")


def format_of(weight: QuantizedWeight) -> Format:
    """The :class:`Format` of a quantized weight container."""
    for f in FORMATS.values():
        if isinstance(weight, f.weight_type):
            return f
    raise TypeError(f"not a quantized weight of a known format: {type(weight).__name__}")
