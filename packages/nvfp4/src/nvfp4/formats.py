"""The 4-bit weight formats behind one interface: NVFP4 (:mod:`.codec`) and MXFP4 (:mod:`.mxfp4`).

Both store E2M1 values packed two per byte in the compressed-tensors layout (``weight_packed`` uint8
``[out, in/2]``) and differ in their scales:

* ``nvfp4``: ``weight_scale`` float8_e4m3fn ``[out, in/16]`` and ``weight_global_scale`` float32 ``[1]``;
  compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor scheme ``NVFP4A16``).
* ``mxfp4``: ``weight_scale`` uint8 E8M0 exponents ``[out, in/32]``, no global scale; compressed-tensors
  ``mxfp4-pack-quantized`` (scheme ``MXFP4A16``).

A :class:`Format` carries what code outside the codecs needs to handle a weight without knowing which format it is:
the tensors' names, dtypes and shapes (layers, checkpoint checks), the compressed-tensors strings (saved configs, the
vLLM plugin), the methods it implements, ``quantize`` / ``quantize_group`` (a fused group shares a global scale where
the format has one), the scale transcode that lets the ``nvfp4::`` ops compute it, and the reference ``dequantize`` /
``linear`` (CPU path, kernel tests). Code outside this registry asks the :class:`Format` instead of comparing format
names. Look one up with :func:`get_format` (``"nvfp4"``, ``"mxfp4"`` or a compressed-tensors format string) or
:func:`format_of` (a weight).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import torch

from . import codec, methods, mxfp4, ops

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
    """One 4-bit weight format, with everything code outside the codecs asks of it.

    Attributes:
        name: ``"nvfp4"`` or ``"mxfp4"``.
        group_size: inputs per scale (16 / 32); ``in_features`` must be a multiple of it.
        scale_dtype: dtype of ``weight_scale`` (``float8_e4m3fn`` / ``uint8`` holding E8M0 exponents).
        has_global_scale: whether a float32 ``[1]`` ``weight_global_scale`` divides the scales (NVFP4 only); the
            members of a fused group (q/k/v, gate/up) then share one (:meth:`quantize_group`).
        methods: the weight-only methods the format implements (``"rtn"`` first; model-level ``"gptq"`` included).
        ct_format: compressed-tensors format string of the checkpoint tensors.
        ct_scheme: the compressed-tensors preset (llm-compressor scheme) of weight-only quantization in this format.
        ct_strategy, ct_scale_dtype: the ``strategy`` and ``scale_dtype`` compressed-tensors writes in the config's
            weight arguments.
        weight_type: the codec's container class.
        to_nvfp4_scales / from_nvfp4_scales: for a format computed through the ``nvfp4::`` ops after an exact scale
            transcode (MXFP4: :func:`nvfp4.mxfp4.to_nvfp4` / :func:`~nvfp4.mxfp4.from_nvfp4`); ``None`` for NVFP4,
            whose tensors feed the ops as they are.
        vllm_rollouts: whether vLLM loads checkpoints of this format for rollouts and ``qerl eval --engine vllm``
            (qerl-trl's ``rollout_engine="vllm"``).
        card: ``"module:function"`` writing the model card (``README.md``) of a checkpoint in this format, imported
            when a card is written (:meth:`write_card`, :func:`nvfp4.card.write_model_card`).
    """

    name: str
    group_size: int
    scale_dtype: torch.dtype
    has_global_scale: bool
    methods: tuple[str, ...]
    ct_format: str
    ct_scheme: str
    ct_strategy: str
    ct_scale_dtype: str
    weight_type: type
    _quantize: Callable[..., QuantizedWeight] = field(repr=False)
    _linear_reference: Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor] = field(repr=False)
    to_nvfp4_scales: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] | None = field(
        default=None, repr=False
    )
    from_nvfp4_scales: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    vllm_rollouts: bool = False
    card: str = field(default="", repr=False)

    def write_card(self, folder: str | Path, **kwargs: Any) -> Path:
        """Write ``folder/README.md``, the model card of a checkpoint in this format (``base_model``, ``method``,
        ``error_table``, ``extra``: :func:`nvfp4.card.write_model_card`); returns its path."""
        if not self.card:
            raise NotImplementedError(f"{self.name}: no model card writer (Format.card)")
        module, _, function = self.card.partition(":")
        return getattr(importlib.import_module(module), function)(folder, **kwargs)

    @property
    def bytes_per_weight(self) -> float:
        """Bytes a weight takes in a checkpoint or in memory, its block scale included: a 4-bit code plus one scale
        of ``scale_dtype`` per ``group_size`` weights (the global scale is per tensor: :attr:`bytes_per_tensor`)."""
        return 0.5 + self.scale_dtype.itemsize / self.group_size

    @property
    def bytes_per_tensor(self) -> int:
        """Bytes a quantized tensor holds besides its weights: the fp32 global scale of a format that has one."""
        return 4 if self.has_global_scale else 0

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

    def check_options(
        self, where: str, method: str, *, global_scale: torch.Tensor | None = None, act_sq: object = None
    ) -> None:
        """Raise for a method no format has (ValueError), one this format does not implement (NotImplementedError
        naming the ones it does) or for options it has no use for (ValueError: a global scale without one, activation
        statistics without ``awq``)."""
        if not any(method in f.methods for f in FORMATS.values()):  # a typo is a bad value, not a missing feature
            raise ValueError(f"{where}: unknown method {method!r}; choose one of {', '.join(map(repr, self.methods))}")
        if method not in self.methods:
            elsewhere = {m: f.name.upper() for f in FORMATS.values() for m in f.methods if m not in self.methods}
            owners = "/".join(sorted(set(elsewhere.values())))
            hint = f" ({', '.join(map(repr, elsewhere))} are {owners}'s)" if elsewhere else ""
            raise NotImplementedError(
                f"{where}: method={method!r} is not implemented for {self.name.upper()}; {self.name.upper()} supports "
                f"method={' / '.join(map(repr, self.methods))} only{hint}"
            )
        unused = {
            "global_scale": None if self.has_global_scale else global_scale,
            "act_sq": None if "awq" in self.methods else act_sq,
        }
        given = [k for k, v in unused.items() if v is not None]
        if given:
            raise ValueError(
                f"{where}: {self.name.upper()} takes no {', '.join(given)} (no global scale, no calibration)"
            )

    def quantize(
        self,
        w: torch.Tensor,
        *,
        method: str = "rtn",
        global_scale: torch.Tensor | None = None,
        act_sq: torch.Tensor | None = None,
        name: str = "weight",
        compute_dtype: torch.dtype | None = None,
    ) -> QuantizedWeight:
        """Quantize one ``[out, in]`` weight in this format; RTN gives compressed-tensors' bytes for ``ct_scheme``.
        NVFP4: :func:`nvfp4.quantize` (``rtn`` / ``mse`` / ``awq``; ``global_scale`` shared by a fused group);
        MXFP4: :func:`nvfp4.mxfp4.quantize`."""
        self.check_options(name, method, global_scale=global_scale, act_sq=act_sq)
        extra = {"global_scale": global_scale, "act_sq": act_sq} if self.has_global_scale else {}
        return self._quantize(w, method=method, name=name, compute_dtype=compute_dtype, **extra)

    def quantize_group(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        method: str = "rtn",
        act_sq: Mapping[str, torch.Tensor] | None = None,
        global_scale: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> dict[str, QuantizedWeight]:
        """The weights of one fused group (``{module name: [out, in] weight}``, e.g. q/k/v) quantized together: one
        shared global scale where the format has one (``global_scale`` if given, else from the members' largest
        ``amax``), each member alone otherwise. ``act_sq``: per-member activation statistics (``awq``)."""
        if self.has_global_scale and global_scale is None:
            global_scale = codec.shared_global_scale(weights.values(), compute_dtype)
        return {
            n: self.quantize(
                w,
                method=method,
                global_scale=global_scale,
                act_sq=None if act_sq is None else act_sq.get(n),
                name=f"{n}.weight" if n else "weight",
                compute_dtype=compute_dtype,
            )  # fmt: skip
            for n, w in weights.items()
        }

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
    methods=methods.METHODS,
    ct_format="nvfp4-pack-quantized",
    ct_scheme="NVFP4A16",
    ct_strategy="tensor_group",
    ct_scale_dtype="torch.float8_e4m3fn",
    weight_type=codec.NVFP4Weight,
    _quantize=methods.quantize,
    _linear_reference=_nvfp4_linear,
    vllm_rollouts=True,
    card="nvfp4.card:_write_nvfp4_card",
)

MXFP4 = Format(
    name="mxfp4",
    group_size=mxfp4.GROUP_SIZE,
    scale_dtype=torch.uint8,
    has_global_scale=False,
    methods=("rtn",),
    ct_format="mxfp4-pack-quantized",
    ct_scheme="MXFP4A16",
    ct_strategy="group",
    ct_scale_dtype="torch.uint8",
    weight_type=mxfp4.MXFP4Weight,
    _quantize=mxfp4.quantize,
    _linear_reference=_mxfp4_linear,
    to_nvfp4_scales=mxfp4.to_nvfp4,
    from_nvfp4_scales=mxfp4.from_nvfp4,
    card="nvfp4.card:_write_mxfp4_card",
)

_REGISTRY: dict[str, Format] = {f.name: f for f in (NVFP4, MXFP4)}
#: Every format by name (read-only; :func:`register_format` adds one).
FORMATS: Mapping[str, Format] = MappingProxyType(_REGISTRY)


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` to :data:`FORMATS` (a new format is its codec module plus this one call); returns it. Its
    ``quantization`` values ``<name>-<method>`` then exist in qerl-trl too. ``ValueError`` for a name already taken."""
    if fmt.name in _REGISTRY or any(f.ct_format == fmt.ct_format for f in _REGISTRY.values()):
        raise ValueError(f"a format named {fmt.name!r} (or {fmt.ct_format!r}) is already registered")
    if any(f.weight_type is fmt.weight_type for f in _REGISTRY.values()):
        raise ValueError(f"{fmt.name}: its weight container {fmt.weight_type.__name__} is another format's")
    _REGISTRY[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format added by :func:`register_format` (tests); the built-in ones stay."""
    if name in (NVFP4.name, MXFP4.name):
        raise ValueError(f"{name} is built in")
    _REGISTRY.pop(name, None)


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
    """The :class:`Format` of a quantized weight container (its exact type: a format's container may subclass
    another's)."""
    for f in FORMATS.values():
        if type(weight) is f.weight_type:
            return f
    raise TypeError(f"not a quantized weight of a known format: {type(weight).__name__}")


#: ``quant_method`` of a compressed-tensors ``quantization_config``
CT_METHOD = "compressed-tensors"


def compressed_tensors_format(qc: Mapping[str, Any]) -> Format:
    """The :class:`Format` of a weight-only compressed-tensors ``quantization_config`` (``NVFP4A16``: fp4 codes in
    groups of 16, ``MXFP4A16``: groups of 32, no activation quantization); ``ValueError`` saying what disagrees
    otherwise. The one check of such a config (``nvfp4.hf``'s loaders and the vLLM plugin both call it)."""
    by_ct = {f.ct_format: f for f in FORMATS.values()}
    fmt = by_ct.get(qc.get("format")) if qc.get("quant_method") == CT_METHOD else None
    if fmt is None:
        raise ValueError(f"not a compressed-tensors {' / '.join(by_ct)} checkpoint (quantization_config={dict(qc)!r})")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"compressed-tensors config without config_groups: {dict(qc)!r}")
    for group in groups.values():
        w = group.get("weights") or {}
        if w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != fmt.group_size:
            raise ValueError(f"config group {group!r} is not {fmt.name.upper()} weight-only (fp4, group {fmt.group_size})")
        if group.get("format", fmt.ct_format) != fmt.ct_format:
            raise ValueError(f"config group format {group.get('format')!r} is not {fmt.ct_format!r}")
        if group.get("input_activations"):
            raise ValueError("config group quantizes activations (W4A4); only W4A16 loads here")
    return fmt


#: how the ``modules_to_not_convert`` entry of :func:`compressed_tensors_untargeted` begins (a negative lookahead)
UNTARGETED_PREFIX = "re:(?!"


def compressed_tensors_untargeted(qc: Mapping[str, Any]) -> str | None:
    """One ``re:`` entry (applied with ``re.match``, as compressed-tensors applies ``ignore``) matching every module
    that no config group of ``qc`` targets, or None when a group names a class (a bare word: ``"Linear"``, every
    linear, what ours and llm-compressor's presets write; which linears another class covers is the model's to say).
    compressed-tensors quantizes only the targeted linears (a ``re:`` target with ``re.match``, a dotted module name
    exactly) and saves the others dense, so loaders add this to what they keep dense."""
    targets = [t for group in (qc.get("config_groups") or {}).values() for t in (group.get("targets") or [])]
    if not targets or any(not t.startswith("re:") and "." not in t for t in targets):
        return None
    targeted = "|".join(f"(?:{t[3:]})" if t.startswith("re:") else f"(?:{re.escape(t)}$)" for t in targets)
    return f"{UNTARGETED_PREFIX}{targeted})"
