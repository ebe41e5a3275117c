"""``NVFP4Linear`` and model conversion (``quantize_model``), in the spirit of torchao's ``quantize_(model, config)``."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from . import fp8, ops
from .codec import BLOCK_SIZE, NVFP4Weight, dequantize, e2m1_to_float, unpack_e2m1
from .formats import UNTARGETED_PREFIX, Format, QuantizedWeight, format_of, get_format
from .layout import (
    from_mma_layout,
    from_scale_mma_layout,
    is_mma_layout,
    mma_layout_supported,
    mma_scales_supported,
    packed_in_ct_layout,
    scale_in_ct_layout,
    to_mma_layout,
    to_scale_mma_layout,
)
from .methods import CALIBRATED_METHODS

__all__ = [
    "DEFAULT_FUSED_GROUPS",
    "FP8Copy",
    "DEFAULT_MODULES_TO_NOT_CONVERT",
    "NVFP4Linear",
    "cache_dequantized",
    "fused_group_of",
    "quantize_model",
]

# Linears an inference engine fuses into one GEMM; members must share one global scale (vLLM and llm-compressor
# require it for fused NVFP4 layers).
DEFAULT_FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
DEFAULT_MODULES_TO_NOT_CONVERT: tuple[str, ...] = ("lm_head",)
#: Called as ``hook(model, method, fused_groups, format)`` once :func:`quantize_model` or
#: :func:`nvfp4.calibration.calibrate_model` has converted ``model`` in place. :mod:`nvfp4.hf` (which builds on this
#: module, so this one cannot import it) records there the ``quantization_config`` that a transformers model's
#: ``save_pretrained`` must write: without one the 4-bit tensors were saved under a dense config.
CONVERTED_MODEL_HOOKS: list[Callable[[nn.Module, str, list[tuple[str, ...]], Format], None]] = []


class FP8Copy(NamedTuple):
    """The E4M3 copy of one :class:`NVFP4Linear` for rollouts (:func:`nvfp4.fp8.fp8_weight`): ``weight``
    float8_e4m3fn ``[out, in]``, ``scale`` float32 ``[out]``, and ``from_rows``: the rows per call from which the
    layer computes with it (0: always; ``rollout_precision="auto"``: its crossover)."""

    weight: torch.Tensor
    scale: torch.Tensor
    from_rows: int


def _float8_from_bytes(data: torch.Tensor, dtype: torch.dtype, requires_grad: bool | None) -> torch.Tensor:
    """The float8 tensor a :class:`_Float8Bytes` pickled: ``data`` (uint8, its bytes) viewed as ``dtype``, a frozen or
    trainable parameter where ``requires_grad`` is not None."""
    t = data.view(dtype)
    return t if requires_grad is None else nn.Parameter(t, requires_grad=requires_grad)


class _Float8Bytes:
    """Stands for a 1-byte floating tensor (float8: block scales, an FP8 rollout copy) in the pickled state of an
    :class:`NVFP4Linear`, and unpickles (or deep-copies) as that tensor again, bit for bit. Plain pickle writes a
    tensor's storage in torch's legacy format, whose reader cannot give a float8 storage back ("'UntypedStorage' has
    no attribute 'dtype'"); the same bytes viewed as uint8 pickle everywhere."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self):
        t = self.tensor
        requires_grad = t.requires_grad if isinstance(t, nn.Parameter) else None
        return _float8_from_bytes, (t.detach().view(torch.uint8), t.dtype, requires_grad)


def _picklable(value: object) -> object:
    """``value``, or a :class:`_Float8Bytes` for a plain 1-byte floating tensor or parameter (a DTensor is left to
    its own pickling)."""
    if type(value) in (torch.Tensor, nn.Parameter) and value.is_floating_point() and value.element_size() == 1:
        return _Float8Bytes(value)
    return value


class NVFP4Linear(nn.Linear):
    """A frozen linear layer whose weight is stored in NVFP4 or MXFP4 (compressed-tensors layout).

    Buffers (saved in the state dict under compressed-tensors names):
        ``format="nvfp4"`` (default): weight_packed: uint8 ``[out, in/2]``; weight_scale: float8_e4m3fn
        ``[out, in/16]``; weight_global_scale: float32 ``[1]``.
    ``bias`` (if any) is a frozen parameter in the activation dtype.

    ``format="mxfp4"``: the state dict holds compressed-tensors ``mxfp4-pack-quantized`` tensors (weight_packed uint8
    ``[out, in/2]``, weight_scale uint8 E8M0 ``[out, in/32]``, no global scale). Once the tensors are on a device
    (quantization, loading, ``.to``) the layer transcodes the E8M0 scales exactly into NVFP4 scales
    (:func:`nvfp4.mxfp4.to_nvfp4`: FP8 powers of two per 16 inputs and a power-of-two ``weight_global_scale``), so it
    computes through the same ops and kernels as an NVFP4 layer (and takes the MMA layout on CUDA). A weight whose
    group exponents span more than E4M3's 18 binades of powers of two keeps its E8M0 tensors and computes with the
    plain reference (:func:`nvfp4.mxfp4.linear_reference`), with a warning naming the layer.

    On CUDA, ``weight_packed`` holds the same bytes in the kernels' MMA layout (``[out/4, 2·in]``,
    :mod:`nvfp4.layout`) when the shape allows it (out % 64 == 0, in % 256 == 0): the layer converts it when it
    lands on a GPU (``.to``/``.cuda``, quantization, loading). The state dict, :attr:`nvfp4_weight` and
    :meth:`dequantize` always give the compressed-tensors layout; ``NVFP4_MMA_LAYOUT=0`` keeps that layout on GPU too.

    Forward: ``x [..., in]`` (float32/float16/bfloat16) → ``[..., out]`` in ``x.dtype``, through ``nvfp4::linear``
    (Triton on CUDA, dequantize + matmul elsewhere). Backward reaches the input only, so LoRA trains through it.

    Under FSDP2 (several GPUs, a policy larger than one): :func:`nvfp4.fsdp.make_shardable` turns ``weight_packed`` and
    ``weight_scale`` into frozen parameters that ``fully_shard`` splits by output rows (the global scale stays a
    replicated buffer), see :mod:`nvfp4.fsdp`; a layer that is not sharded keeps its buffers and this class.

    It subclasses ``nn.Linear`` so that tools which look for linear layers (PEFT's ``"all-linear"``, TRL) find it;
    ``.weight`` is the packed uint8 buffer, which makes any code that tries to use it as a float matrix fail loudly
    instead of computing garbage. Use :meth:`dequantize` for the dense weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        format: str | Format = "nvfp4",
        name: str | None = None,
    ) -> None:
        nn.Module.__init__(self)
        fmt = get_format(format)  # a Format is taken as it is; a name (the public API's) is looked up once, here
        if in_features % fmt.group_size:
            raise ValueError(
                f"NVFP4Linear({fmt.name}): in_features={in_features} must be a multiple of {fmt.group_size}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.format = fmt.name  # "nvfp4" | "mxfp4": what the state dict holds
        #: the :class:`nvfp4.formats.Format` of the tensors the state dict holds (:attr:`format` is its name)
        self.weight_format: Format = fmt
        self.layer_name = name  # the module's name in its model, for messages
        self.orig_dtype = dtype  # dtype of the dense weight it replaced: what dequantize/merge export to
        # the format's tensors as stored (MXFP4: E8M0 exponents until they are transcoded, use_kernel_layout)
        for buf, (buf_dtype, shape) in fmt.tensor_specs(out_features, in_features).items():
            init = torch.ones if buf == "weight_global_scale" else torch.zeros
            self.register_buffer(buf, init(shape, dtype=buf_dtype, device=device))
        if not fmt.has_global_scale:
            self.register_buffer("weight_global_scale", None)
        # MXFP4 only: the E8M0 scales where the transcode cannot give them back (all-zero groups outside its window),
        # so that the state dict keeps the checkpoint's bytes. A plain attribute moved by _apply, not a buffer:
        # transformers' loader re-creates non-persistent buffers empty after quantize-on-load.
        self.weight_scale_e8m0: torch.Tensor | None = None
        self._mxfp4_reference = False  # MXFP4 only: the transcode was tried and the tensors have none
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._load_hook = self.register_load_state_dict_pre_hook(self._check_loaded_tensors)
        if fmt.to_nvfp4_scales is not None:
            self.register_load_state_dict_post_hook(_transcode_after_loading)

    _QUANT_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")
    #: True for layers prepared for FSDP2 (:class:`nvfp4.fsdp.ShardableNVFP4Linear`): their 4-bit tensors are frozen
    #: parameters that FSDP2 shards and gathers around the module's own forward
    fsdp_shardable = False

    def __getstate__(self) -> dict:
        # pickle / deepcopy / torch.save of the module: float8 tensors travel as their bytes (see _Float8Bytes)
        state = {k: _picklable(v) for k, v in super().__getstate__().items()}
        for key in ("_buffers", "_parameters"):
            state[key] = type(state[key])((n, _picklable(t)) for n, t in state[key].items())
        copy8 = state.get("fp8_copy")
        if copy8 is not None:
            state["fp8_copy"] = copy8._replace(weight=_picklable(copy8.weight), scale=_picklable(copy8.scale))
        return state

    @property
    def uses_nvfp4_ops(self) -> bool:
        """Whether the layer computes through the ``nvfp4::`` ops / kernels: NVFP4, or MXFP4 transcoded to NVFP4
        scales (:func:`nvfp4.mxfp4.to_nvfp4`); False for MXFP4 tensors not (yet) transcoded (the plain reference)."""
        return self.weight_scale.dtype == torch.float8_e4m3fn

    def _label(self) -> str:
        return f"{self.layer_name or 'NVFP4Linear'} ({self.format}, {self.out_features}x{self.in_features})"

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` must move the NVFP4 tensors but never cast them (fp8 scales and the fp32 global
        # scale are floating point, so nn.Module would convert them and corrupt the format).
        saved = {n: self._buffers[n] for n in self._QUANT_BUFFERS if n in self._buffers}
        # made frozen parameters for FSDP2 (nvfp4.fsdp): nn.Module may convert a parameter in place (`.data`)
        params = {n: (p, p.detach()) for n in self._QUANT_BUFFERS if (p := self._parameters.get(n)) is not None}
        # a cast of the model (.float(), .to(torch.bfloat16)) casts the dense weight this layer stands for too:
        # dequantize / to_dense / a PEFT merge then give the model's dtype (else a merged model mixes dtypes and fails)
        probe = fn(torch.empty(0, dtype=self.orig_dtype, device=self.weight_packed.device))
        if probe.is_floating_point():
            self.orig_dtype = probe.dtype
        super()._apply(fn, recurse)
        if self.weight_scale_e8m0 is not None:  # uint8: moved, never cast
            self.weight_scale_e8m0 = fn(self.weight_scale_e8m0)
        if self.fp8_copy is not None:  # a plain attribute: moved with the layer (else FP8 rollouts meet another
            # device's weight after model.to(gpu)), never cast (float8 weight, float32 scale)
            moved = [fn(t) for t in (self.fp8_copy.weight, self.fp8_copy.scale)]
            w8, scale = (new if new.dtype == old.dtype else old.to(new.device)
                         for new, old in zip(moved, (self.fp8_copy.weight, self.fp8_copy.scale)))  # fmt: skip
            self.fp8_copy = self.fp8_copy._replace(weight=w8, scale=scale)
        for n, old in saved.items():
            new = self._buffers[n]
            if new is not None and old is not None and new.dtype != old.dtype:
                self._buffers[n] = old.to(new.device)
        for n, (param, old) in params.items():
            new = self._parameters[n]
            if new.dtype != old.dtype:
                if new is param:
                    param.data = old.to(new.device)
                else:
                    self._parameters[n] = nn.Parameter(old.to(new.device), requires_grad=False)
        self.use_kernel_layout()
        return self

    @property
    def mma_layout(self) -> bool:
        """Whether ``weight_packed`` is currently in the kernels' MMA layout (see :mod:`nvfp4.layout`)."""
        return self.uses_nvfp4_ops and is_mma_layout(self.weight_packed, self.weight_scale)

    @torch.no_grad()
    def use_kernel_layout(self) -> bool:
        """Put ``weight_packed`` in the layout the kernels read fastest on its device: the MMA layout on CUDA when
        the shape allows it and every block scale is positive and finite (what compressed-tensors writes; the
        MMA-layout kernels decode scales with integer instructions, see :mod:`nvfp4.layout`), unless
        ``NVFP4_MMA_LAYOUT=0``; ``weight_scale`` then takes :func:`~nvfp4.layout.to_scale_mma_layout`'s order
        (``[out/64, 4·in]``, the only order the MMA-layout kernels read). An MXFP4 layer first transcodes its
        E8M0 scales to NVFP4 scales (on every device; see the class docstring). Idempotent; returns
        :attr:`mma_layout`."""
        packed = self.weight_packed
        if packed.is_meta:
            return self.mma_layout
        if self.weight_format.to_nvfp4_scales is not None and not self.uses_nvfp4_ops and not self._mxfp4_reference:
            self._transcode_mxfp4()
        if not self.uses_nvfp4_ops or self.mma_layout:
            return self.mma_layout
        if (
            packed.is_cuda
            and os.environ.get("NVFP4_MMA_LAYOUT", "1") != "0"
            and mma_layout_supported(self.out_features, self.in_features)
        ):
            if mma_scales_supported(self.weight_scale):
                self.weight_packed = to_mma_layout(packed)
                self.weight_scale = to_scale_mma_layout(self.weight_scale)  # step A's order (docs/kernels.md)
            else:
                self._warn_ct_layout_kept()
        return self.mma_layout

    def _warn_ct_layout_kept(self) -> None:
        warnings.warn(
            f"{self._label()}: weight_scale holds zero, negative or NaN block "
            "scales; kept in the compressed-tensors layout (exact, slower kernels)",
            stacklevel=3,
        )

    def _transcode_mxfp4(self) -> None:
        """E8M0 ``weight_scale`` → exact FP8 scales + power-of-two ``weight_global_scale`` (:func:`mxfp4.to_nvfp4`);
        where the tensors have none, keep them, compute with the reference and warn once."""
        scale = self.weight_scale
        fmt = self.weight_format
        transcoded = fmt.to_nvfp4_scales(self.weight_packed, scale)
        if transcoded is None:
            self._mxfp4_reference = True
            warnings.warn(
                f"{self._label()}: its MXFP4 scales span more than the 18 binades of powers of two FP8-E4M3 holds "
                "(or hold NaN), so they have no exact NVFP4 transcode; the layer keeps its E8M0 tensors and "
                "computes with the plain PyTorch reference (dequantize + F.linear: exact, not the Triton kernels)",
                stacklevel=3,
            )
            return
        fp8, global_scale = transcoded
        # the state dict must give the checkpoint's bytes back: keep the E8M0 tensor where the transcode cannot
        lossless = torch.equal(fmt.from_nvfp4_scales(fp8, global_scale), scale)
        self.weight_scale_e8m0 = None if lossless else scale
        self.weight_scale = fp8
        self.weight_global_scale = global_scale

    def _e8m0_scale(self) -> torch.Tensor:
        """The MXFP4 ``weight_scale`` (uint8 E8M0 ``[out, in/32]``) whatever the layer holds now."""
        if not self.uses_nvfp4_ops:
            return self.weight_scale
        if self.weight_scale_e8m0 is not None:
            return self.weight_scale_e8m0
        return self.weight_format.from_nvfp4_scales(self._ct_scale(), self.weight_global_scale)

    def _ct_scale(self) -> torch.Tensor:
        """``weight_scale`` as ``[out, in/16]`` (converted back from step A's order where the layer holds it)."""
        return scale_in_ct_layout(self.weight_packed, self.weight_scale)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.weight_packed

    @property
    def nvfp4_weight(self) -> NVFP4Weight:
        """The weight in the compressed-tensors layout (a converted copy of ``weight_packed`` in the MMA layout);
        for a transcoded MXFP4 layer its exact NVFP4 form. Raises ValueError for MXFP4 tensors without one."""
        if not self.uses_nvfp4_ops:
            raise ValueError(f"{self._label()}: MXFP4 tensors without an NVFP4 transcode; use quantized_weight")
        packed = from_mma_layout(self.weight_packed) if self.mma_layout else self.weight_packed
        return NVFP4Weight(packed, self._ct_scale(), self.weight_global_scale)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        """The weight in its own format and the compressed-tensors layout: :class:`NVFP4Weight` or
        :class:`nvfp4.mxfp4.MXFP4Weight` (what the state dict holds)."""
        fmt = self.weight_format
        if fmt.to_nvfp4_scales is None:
            return self.nvfp4_weight
        packed = from_mma_layout(self.weight_packed) if self.mma_layout else self.weight_packed
        return fmt.weight_type(packed, self._e8m0_scale())

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.fsdp_shardable:  # the stored floating views of integer bytes (nvfp4.fsdp) → the tensors' own dtypes
            from .sharded import view_stored

            for name, dtype in self._storage_dtypes.items():
                t = destination.get(prefix + name)
                if t is not None and t.dtype != dtype:  # a DTensor too: full state dicts gather it in its own dtype
                    destination[prefix + name] = view_stored(t.detach(), dtype)
        key = prefix + "weight_packed"
        if key in destination and self.mma_layout:  # checkpoints hold the compressed-tensors layout
            scale_key = prefix + "weight_scale"
            if scale_key in destination:
                destination[scale_key] = from_scale_mma_layout(destination[scale_key].detach())
            destination[key] = from_mma_layout(destination[key].detach())
        if self.weight_format.from_nvfp4_scales is not None and prefix + "weight_scale" in destination:  # as stored
            scale = destination[prefix + "weight_scale"]
            if self.weight_scale_e8m0 is None and type(scale) not in (torch.Tensor, nn.Parameter):
                from .sharded import map_rows  # sharded FP8 rows (DTensor) → their E8M0 rows, each rank its own

                to_e8m0 = self.weight_format.from_nvfp4_scales
                destination[prefix + "weight_scale"] = map_rows(scale, lambda s: to_e8m0(s, self.weight_global_scale))
            else:
                destination[prefix + "weight_scale"] = self._e8m0_scale().detach()
            destination.pop(prefix + "weight_global_scale", None)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        global_scale: torch.Tensor | float | None = None,
        method: str = "rtn",
        act_sq: torch.Tensor | None = None,
        name: str = "weight",
        format: str = "nvfp4",
        compute_dtype: torch.dtype | None = None,
    ) -> NVFP4Linear:
        """Quantize a dense ``nn.Linear`` ``[out, in]``.

        ``format="nvfp4"``: see :func:`nvfp4.quantize` for ``method`` / ``act_sq`` / ``global_scale``.
        ``format="mxfp4"``: round to nearest (:func:`nvfp4.mxfp4.quantize`, compressed-tensors ``MXFP4A16`` bytes);
        ``method`` must be ``"rtn"`` and there is no global scale. ``compute_dtype``: the scale arithmetic's dtype
        (default the weight's own, as llm-compressor).
        """
        w = linear.weight.detach()
        q = get_format(format).quantize(w, method=method, global_scale=global_scale, act_sq=act_sq, name=name,
                                        compute_dtype=compute_dtype)  # fmt: skip
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_weight(q, bias, linear.weight.dtype, name=None if name == "weight" else name.removesuffix(".weight"))

    @classmethod
    def from_weight(
        cls,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        name: str | None = None,
    ) -> NVFP4Linear:
        """The layer holding ``weight`` (its format follows the container: NVFP4 or MXFP4), ``bias`` ``[out]`` (cast
        to ``dtype``), ``dtype`` the dense dtype it replaces; ``name`` its module name, for messages."""
        fmt = format_of(weight)
        try:  # the tensors are stored as given: a float32 [1] global scale, fp8 block scales, ... (tensor_specs)
            fmt.weight_from_tensors(weight.state_dict())
        except ValueError as e:
            raise ValueError(f"NVFP4Linear.from_weight({name or fmt.name}): {e}") from None
        out, k = weight.shape
        mod = cls(k, out, bias=bias is not None, dtype=dtype, device="meta", format=fmt, name=name)
        mod.weight_packed = weight.packed
        mod.weight_scale = weight.scale
        if fmt.has_global_scale:
            mod.weight_global_scale = weight.global_scale
        if bias is not None:
            mod.bias = nn.Parameter(bias.to(dtype).clone(), requires_grad=False)
        mod.use_kernel_layout()
        return mod

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense ``[out, in]`` weight in ``dtype`` (default: the dtype of the layer it replaced)."""
        if not self.uses_nvfp4_ops:  # MXFP4 tensors as stored (the transcode gives the same values bit for bit)
            return self.quantized_weight.dequantize(dtype or self.orig_dtype)
        return dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype or self.orig_dtype)

    def to_dense(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding ``dequant(W)`` (and the bias) in the dtype of the layer it replaced."""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        dense.weight = nn.Parameter(self.dequantize(), requires_grad=False)
        if self.bias is not None:
            dense.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return dense

    _dense_cache: torch.Tensor | None = None
    _codes_cache: _CodesCache | None = None

    def has_cached_weight(self, x: torch.Tensor) -> bool:
        """Whether :func:`cache_dequantized` holds this layer's ``dequant(W)`` for inputs like ``x`` (dtype, device)."""
        dense, codes = self._dense_cache, self._codes_cache
        if dense is not None and dense.dtype == x.dtype and dense.device == x.device:
            return True
        return codes is not None and x.dtype == torch.float32 and codes.codes.device == x.device

    def cached_weight(self, x: torch.Tensor) -> torch.Tensor:
        """``dequant(W)`` ``[out, in]`` from the cache, for inputs like ``x`` (see :meth:`has_cached_weight`).

        A compact cache rebuilds it into a scratch buffer shared by the layers of this shape: use it before the next
        layer's call overwrites it (within one op), never keep it.
        """
        dense = self._dense_cache
        if dense is not None and dense.dtype == x.dtype and dense.device == x.device:
            return dense
        if not self.has_cached_weight(x):
            raise RuntimeError(f"{self._label()}: no cached dequant(W) for {x.dtype} inputs on {x.device}")
        return self._codes_cache.fill()

    #: the E4M3 copy rollouts may compute with (:func:`nvfp4.fp8_model.attach_fp8_copies`; None: none made)
    fp8_copy: FP8Copy | None = None
    #: whether :attr:`fp8_copy` is in use: only inside :func:`nvfp4.fp8_model.fp8_rollouts` (generation); training's
    #: forward and backward, and the trainer's logprobs, always run the W4A16 path
    fp8_active: bool = False

    def fp8_applies(self, x: torch.Tensor) -> bool:
        """Whether a forward on ``x [..., in]`` computes with :attr:`fp8_copy`: inside ``fp8_rollouts`` and with at
        least its ``from_rows`` rows (the leading dimensions multiplied)."""
        copy = self.fp8_copy
        return self.fp8_active and copy is not None and x.numel() >= copy.from_rows * x.shape[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.fp8_applies(x):  # rollouts, rows >= the crossover: FP8 (no autograd formula: generation only)
            return fp8.fp8_linear(x, self.fp8_copy.weight, self.fp8_copy.scale, bias)
        dense = self._dense_cache
        if dense is not None and dense.dtype == x.dtype and dense.device == x.device:
            return F.linear(x, dense, bias)  # == the reference op, minus re-dequantizing (see cache_dequantized)
        codes = self._codes_cache
        if codes is not None and x.dtype == torch.float32 and codes.codes.device == x.device:
            return _CodesLinear.apply(x, codes, bias)  # the same numbers, dequant(W) rebuilt in a scratch buffer
        if not self.uses_nvfp4_ops:  # MXFP4 without an NVFP4 transcode: the plain reference (autograd reaches x)
            return self.weight_format.linear_reference(x, self.quantized_weight, bias)
        return ops.linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.format}")  # fmt: skip

    def _check_loaded_tensors(self, module, state_dict, prefix, *args, **kwargs) -> None:
        """Fail with one clear error when a checkpoint's tensors disagree with this layer (shape or dtype); convert
        a compressed-tensors ``weight_packed`` to the MMA layout when this layer holds that layout."""
        fmt = self.weight_format
        if self.fsdp_shardable and fmt.to_nvfp4_scales is not None and prefix + "weight_packed" in state_dict:
            raise ValueError(f"{prefix}: load MXFP4 tensors before nvfp4.fsdp.make_shardable (they are transcoded)")
        if fmt.to_nvfp4_scales is not None:
            return self._check_loaded_mxfp4(state_dict, prefix)
        for name, (dtype, shape) in fmt.tensor_specs(self.out_features, self.in_features).items():
            t = state_dict.get(prefix + name)
            if t is None:
                continue
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(
                    f"{prefix}{name}: checkpoint has {t.dtype} {tuple(t.shape)}, the layer expects {dtype} {shape} "
                    f"(in_features={self.in_features}, out_features={self.out_features})"
                )
        if self.fsdp_shardable:  # loaded into the stored floating views, byte for byte (nvfp4.fsdp)
            for name, stored in self._parameters.items():
                t = state_dict.get(prefix + name)
                if name in self._storage_dtypes and t is not None and t.dtype != stored.dtype:
                    state_dict[prefix + name] = t.view(stored.dtype)
            return
        key = prefix + "weight_packed"
        if key in state_dict and not self.weight_packed.is_meta and self.mma_layout:
            scale_key = prefix + "weight_scale"
            with_scale = scale_key in state_dict
            if mma_scales_supported(state_dict.get(scale_key, self.weight_scale)):
                if with_scale:
                    state_dict[scale_key] = to_scale_mma_layout(state_dict[scale_key])
                state_dict[key] = to_mma_layout(state_dict[key])
            else:  # the MMA-layout kernels cannot decode these scales: back to the compressed-tensors layout
                self.weight_packed = torch.empty_like(state_dict[key], device=self.weight_packed.device)
                if with_scale:
                    self.weight_scale = torch.empty_like(state_dict[scale_key], device=self.weight_scale.device)
                self._warn_ct_layout_kept()

    def _check_loaded_mxfp4(self, state_dict, prefix: str) -> None:
        """MXFP4: check the compressed-tensors tensors, then give the layer E8M0-shaped buffers for them; the post-hook
        transcodes after loading (:meth:`use_kernel_layout`)."""
        if prefix + "weight_global_scale" in state_dict:
            raise ValueError(
                f"{prefix}weight_global_scale: the checkpoint holds NVFP4 tensors, this layer is MXFP4 "
                "(load it with format='nvfp4')"
            )
        got = {n: state_dict.get(prefix + n) for n in ("weight_packed", "weight_scale")}
        if all(t is None for t in got.values()):
            return
        for name, (dtype, shape) in self.weight_format.tensor_specs(self.out_features, self.in_features).items():
            t = got[name]
            if t is None:
                raise ValueError(f"{prefix}{name}: missing; an MXFP4 layer loads weight_packed and weight_scale together")
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(
                    f"{prefix}{name}: checkpoint has {t.dtype} {tuple(t.shape)}, the MXFP4 layer expects {dtype} "
                    f"{shape} (in_features={self.in_features}, out_features={self.out_features})"
                )
        device = self.weight_packed.device
        self.weight_packed = torch.empty_like(got["weight_packed"], device=device)
        self.weight_scale = torch.empty_like(got["weight_scale"], device=device)
        self.weight_global_scale = None
        self.weight_scale_e8m0 = None
        self._mxfp4_reference = False


def _transcode_after_loading(module: NVFP4Linear, _incompatible_keys: object) -> None:
    module.use_kernel_layout()  # MXFP4: E8M0 → NVFP4 scales (and the MMA layout on CUDA)


class _CodesCache:
    """``dequant(W)`` of one NVFP4 layer as int8 ``2 × E2M1 value`` ``[out, in/16, 16]`` and float32 ``step / 2``
    ``[out, in/16, 1]`` (``step = weight_scale / weight_global_scale``, as :func:`nvfp4.codec.dequantize` computes
    it): 1.25 bytes a weight instead of float32's 4. :meth:`fill` writes ``codes · half_step`` — one rounding of the
    same product the reference rounds (``value · step``) — into a float32 buffer shared by the block's layers of
    this shape, and returns it as ``[out, in]``."""

    __slots__ = ("codes", "half_step", "scratch")

    def __init__(self, codes: torch.Tensor, half_step: torch.Tensor, scratch: dict) -> None:
        self.codes, self.half_step, self.scratch = codes, half_step, scratch

    def fill(self) -> torch.Tensor:
        out, groups, size = self.codes.shape
        key = (out, groups * size, self.codes.device)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = torch.empty(out, groups, size, dtype=torch.float32, device=self.codes.device)
        # Two in-place passes, no temporary: `torch.mul(codes, half_step, out=buf)` casts the int8 codes to a float32
        # copy first — a weight-sized allocation freed on every call (a fresh mmap and its page faults under
        # qerl's pinned mmap threshold). The codes are small integers, exact in float32: the same product, rounded once.
        buf.copy_(self.codes)
        buf.mul_(self.half_step)
        return buf.view(out, groups * size)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.half_step.numel() * self.half_step.element_size()


class _CodesLinear(torch.autograd.Function):
    """``F.linear(x, dequant(W), bias)`` with ``dequant(W)`` rebuilt from a :class:`_CodesCache` in the forward and
    again in the backward, so no dense weight is held between them (the buffer is shared and overwritten by the next
    layer). The backward is linear's own for the input, ``grad @ W`` (the weight is frozen)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cache: _CodesCache, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.cache, ctx.x_shape = cache, x.shape
        return F.linear(x, cache.fill(), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = flat.mm(ctx.cache.fill()).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_bias = flat.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


def _codes_cache(layer: NVFP4Linear, scratch: dict) -> _CodesCache | None:
    """The layer's :class:`_CodesCache`, or None when it would not give exactly ``layer.dequantize(float32)`` (an
    MXFP4 layer on the plain reference, or a half step that underflows float32)."""
    if not layer.uses_nvfp4_ops:
        return None
    packed = packed_in_ct_layout(layer.weight_packed, layer.weight_scale)
    out = packed.shape[0]
    values = e2m1_to_float(unpack_e2m1(packed)).reshape(out, -1, BLOCK_SIZE)
    step = layer._ct_scale().float() / layer.weight_global_scale.float().reshape(1, 1)
    cache = _CodesCache((values * 2).to(torch.int8), (step / 2).unsqueeze(-1), scratch)
    del values
    return cache if torch.equal(cache.fill(), layer.dequantize(torch.float32)) else None


@contextlib.contextmanager
def cache_dequantized(model: nn.Module, dtype: torch.dtype, *, compact: bool = False) -> Iterator[int]:
    """Hold ``dequant(W)`` (``[out, in]``, ``dtype``) of every :class:`NVFP4Linear` in ``model`` for the block.

    For the PyTorch reference path (CPU), which otherwise dequantizes each weight on every call — decode calls every
    linear once per token, and training forward + backward twice per step. Results are bit-identical to the uncached
    reference (``F.linear(x, dequant(W))`` is what the reference computes); the price is dense memory for the block.
    Never use it where the Triton kernels run: they read the 4-bit weight directly. Yields the bytes held.

    ``compact=True`` (float32 only): hold each weight as int8 codes and float32 half-steps per 16 inputs (1.25 bytes
    a weight instead of 4; 133 MB instead of 425 MB on SmolLM2-135M) and rebuild ``dequant(W)`` into a scratch
    buffer on every call, forward and backward (a float32 multiply, ~0.1 ms for a 576 × 1536 weight on one CPU
    core). The same products, rounded once as :func:`nvfp4.codec.dequantize` rounds them: the same outputs and input
    gradients (zeros of the weight are +0). A layer where that is not exact keeps the dense cache.
    """
    # layers sharded by FSDP2 are left out: their weight exists whole only inside their forward (nvfp4.fsdp)
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear) and not m.fsdp_shardable]
    held = 0
    scratch: dict = {}
    # an enclosing block's caches (an evaluation inside a CPU training run), given back on leaving this one
    enclosing = [(layer._dense_cache, layer._codes_cache) for layer in layers]
    try:
        for layer in layers:
            codes = _codes_cache(layer, scratch) if compact and dtype == torch.float32 else None
            if codes is not None:
                layer._codes_cache = codes
                held += codes.nbytes
            else:
                layer._dense_cache = layer.dequantize(dtype)
                held += layer._dense_cache.numel() * layer._dense_cache.element_size()
        yield held
    finally:
        for layer, (dense, codes) in zip(layers, enclosing, strict=True):
            layer._dense_cache = dense
            layer._codes_cache = codes
        scratch.clear()


def fused_group_of(name: str, groups: Iterable[Iterable[str]] = DEFAULT_FUSED_GROUPS) -> tuple[str, ...] | None:
    """Full names of the fused group ``name`` belongs to (e.g. ``a.q_proj`` → ``(a.q_proj, a.k_proj, a.v_proj)``)."""
    parent, _, leaf = name.rpartition(".")
    for group in groups:
        if leaf in group:
            return tuple(f"{parent}.{m}" if parent else m for m in group)
    return None


def _module_names(value: Iterable[str], option: str) -> tuple[str, ...]:
    """``value`` (module names, suffixes or regexes) as a tuple, read once; a bare string is refused (TypeError):
    iterated, it gives its letters, and ``"lm_head"`` silently meant ``["l", "m", ...]``. ``option`` names the caller's
    argument in the message."""
    if isinstance(value, str):
        raise TypeError(f"{option} takes a list of module names, got the string {value!r}: pass [{value!r}]")
    names = tuple(value)
    _check_strings(names, option)
    for p in names:  # each is also matched as a regex (_matches): a glob such as "*.mlp.*" failed there in re's words
        try:
            re.compile(p.removeprefix("re:"))
        except re.error as e:
            raise ValueError(f"{option}: {p!r} is not a valid regular expression ({e}); entries are module names, "
                             "name suffixes or regexes of the whole name (e.g. '.*mlp.*' or 're:.*mlp', not a glob "
                             "'*.mlp.*')") from None  # fmt: skip
    return names


def _fused_group_names(value: Iterable[Iterable[str]], option: str) -> list[tuple[str, ...]]:
    """``value`` (groups of sibling linear names) as a list of tuples, read once; a group given as one string is
    refused (TypeError): ``["q_proj", "k_proj"]`` (one group written flat) silently fused nothing."""
    groups = [value] if isinstance(value, str) else list(value)
    flat = next((g for g in groups if isinstance(g, str)), None)
    if flat is not None:
        raise TypeError(f"{option} takes a list of groups, each a list of sibling names (e.g. [['q_proj', 'k_proj', "
                        f"'v_proj']]), got the string {flat!r} as a group")  # fmt: skip
    groups = [tuple(g) for g in groups]
    for g in groups:
        _check_strings(g, option)
    return groups


def _check_strings(names: tuple[object, ...], option: str) -> None:
    """Refuse (TypeError, one line) an entry of ``names`` that is no string: ``None`` failed deep in the matching
    (``'NoneType' object has no attribute 'removeprefix'``) and a number matched no module, silently."""
    for bad in names:
        if isinstance(bad, str):
            continue
        raise TypeError(f"{option}: {bad!r} ({type(bad).__name__}) is not a string; entries are module names, "
                        "name suffixes or regexes (e.g. 'lm_head', 'q_proj', 're:.*mlp.*')")  # fmt: skip


def _warn_unmatched(model: nn.Module, names: Iterable[str], option: str) -> None:
    """Warn (one line) naming the entries of ``names`` (a ``modules_to_not_convert``) that match no module of
    ``model``: a typo (``"lm_haed"``) or another architecture's name kept nothing dense, silently. The default
    ``lm_head`` and the untargeted entry of a loaded compressed-tensors config are not the caller's words."""
    modules = [n for n, _ in model.named_modules() if n]
    lost = [p for p in names if p not in DEFAULT_MODULES_TO_NOT_CONVERT and not p.startswith(UNTARGETED_PREFIX)
            and not any(_matches(n, (p,)) for n in modules)]  # fmt: skip
    if lost:
        warnings.warn(f"{option}: {lost!r} match no module of the model, so they keep nothing dense; entries are module "
                      "names ('model.layers.0.mlp.down_proj', 'model.layers.0'), name suffixes ('down_proj') or regexes "
                      "of the whole name", stacklevel=3)  # fmt: skip


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` is one of ``patterns``: an exact name, a dotted suffix, the name of a module above it
    (``model.layers.0`` keeps that block's linears, as transformers' quantizers read the option), a regex of the whole
    name, or an ``re:`` entry (compressed-tensors' ``ignore`` syntax, which a saved config passes on as is) applied
    as compressed-tensors applies it, with ``re.match``."""
    return any(
        re.match(p[3:], name)
        if p.startswith("re:")
        else name == p or name.endswith("." + p) or name.startswith(p + ".") or re.fullmatch(p, name)
        for p in patterns
    )


def _quantizable(name: str, module: nn.Module, skip: Iterable[str], group_size: int = BLOCK_SIZE) -> bool:
    return type(module) is nn.Linear and module.in_features % group_size == 0 and not _matches(name, skip)


def _check_no_adapters(model: nn.Module, where: str) -> None:
    """Refuse a model that carries PEFT adapters (ValueError): their own ``lora_A`` / ``lora_B`` are plain linears
    and were quantized with the rest (frozen 4-bit buffers, nothing left to train)."""
    # PEFT's tuner layers name their adapter modules in `adapter_layer_names` (duck-typed: peft is an extra)
    layer = next((n for n, m in model.named_modules() if getattr(type(m), "adapter_layer_names", None)), None)
    if layer is not None:
        raise ValueError(f"{where}: the model carries PEFT adapters ({layer}), whose own linears would be quantized "
                         "too: quantize the base model first, then attach them (nvfp4.peft.get_peft_model)")  # fmt: skip


def _tied_linears(model: nn.Module) -> list[str]:
    """Names of the linears whose weight is also another parameter of ``model`` (a tied lm_head: the embedding)."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    modules = dict(model.named_modules())
    return sorted(
        module
        for names in names_of.values() if len(names) > 1
        for name in names
        if (module := name.removesuffix(".weight")) != name and isinstance(modules.get(module), nn.Linear)
    )  # fmt: skip


def nothing_to_quantize(model: nn.Module, fmt: Format) -> str:
    """The message for a model none of whose linears is quantized (what is quantized, and what is not a linear)."""
    return (f"{type(model).__name__} has no nn.Linear layer to quantize (quantized: plain torch.nn.Linear with "
            f"in_features % {fmt.group_size} == 0, outside modules_to_not_convert; other layer types, such as GPT-2's "
            "transformers Conv1D, stay dense)")  # fmt: skip


def _warn_if_nothing_quantized(model: nn.Module, fmt: Format) -> None:
    """Warn when ``model`` holds no 4-bit layer after a conversion that took none (nor any linear still on the meta
    device: :func:`nvfp4.hf.save_pretrained_by_blocks` fills a model block by block)."""
    if any(isinstance(m, NVFP4Linear) or (isinstance(m, nn.Linear) and m.weight.is_meta) for m in model.modules()):
        return
    warnings.warn(f"quantize_model: {nothing_to_quantize(model, fmt)}; the model is returned unchanged", stacklevel=3)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    *,
    method: str = "rtn",
    modules_to_not_convert: Iterable[str] | None = DEFAULT_MODULES_TO_NOT_CONVERT,
    fused_groups: Iterable[Iterable[str]] | None = DEFAULT_FUSED_GROUPS,
    act_sq: dict[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    compute_dtype: torch.dtype | None = None,
    format: str = "nvfp4",
) -> nn.Module:
    """Replace every eligible ``nn.Linear`` of ``model`` by an :class:`NVFP4Linear`, in place, and return ``model``.

    Eligible: plain ``nn.Linear`` with ``in_features % 16 == 0``, not matched by ``modules_to_not_convert``
    (exact names, name suffixes, the name of a module above it such as ``model.layers.0``, or regexes; ``lm_head`` by
    default or for None; embeddings are never linears), not tied to another parameter (a tied lm_head: the
    embedding), and accepted by ``filter_fn``. Members of a fused group present in the same parent share one global
    scale (the default groups for ``fused_groups=None``). Layers are quantized one at a time (optionally moved to ``device``
    first), so peak memory is the quantized model plus one group in full precision. A transformers model without a
    ``quantization_config`` gets the :class:`nvfp4.NVFP4Config` of this conversion, so its ``save_pretrained`` writes
    a checkpoint that reloads (:data:`CONVERTED_MODEL_HOOKS`).

    RTN runs in each weight's dtype as the model holds it (``compute_dtype=None``), as llm-compressor does: a model
    loaded in bf16 gives llm-compressor's ``NVFP4A16`` bytes. ``compute_dtype=torch.float32`` computes the scale
    quotients in float32 instead (see :mod:`nvfp4.codec`).

    ``format="mxfp4"``: MXFP4 layers (compressed-tensors ``MXFP4A16`` bytes; ``in_features % 32 == 0``), round to
    nearest only (``method="rtn"``, no ``act_sq``); fused groups share nothing (MXFP4 has no global scale).
    """
    fmt = get_format(format)
    fmt.check_options("quantize_model", method, act_sq=act_sq)
    if method in CALIBRATED_METHODS and (method != "awq" or act_sq is None):  # (gptq needs each layer's Hessian)
        raise ValueError(f"quantize_model(method={method!r}) calibrates on data: use "
                         f"nvfp4.calibration.calibrate_model(model, {method!r}, batches), or NVFP4Config(method="
                         f"{method!r}, calibration_data=...) on load")  # fmt: skip
    _check_no_adapters(model, "quantize_model")
    # None is the default, as in NVFP4Config and calibrate_model ([] / () means none)
    if modules_to_not_convert is None:
        modules_to_not_convert = DEFAULT_MODULES_TO_NOT_CONVERT
    if fused_groups is None:
        fused_groups = DEFAULT_FUSED_GROUPS
    # read once: every module is checked against it (a generator was used up by the first module's check)
    modules_to_not_convert = _module_names(modules_to_not_convert, "quantize_model: modules_to_not_convert")
    _warn_unmatched(model, modules_to_not_convert, "quantize_model: modules_to_not_convert")
    given_groups = _fused_group_names(fused_groups, "quantize_model: fused_groups")
    groups = given_groups if fmt.has_global_scale else []  # members share a global scale
    tied = set(_tied_linears(model))  # a tied lm_head's weight is the embedding's: it stays dense, as on load
    named = [
        (n, m)
        for n, m in model.named_modules()
        if _quantizable(n, m, modules_to_not_convert, fmt.group_size)
        and n not in tied
        and not m.weight.is_meta
        and (filter_fn is None or filter_fn(n, m))
    ]
    if not named:
        _warn_if_nothing_quantized(model, fmt)
    chosen = dict(named)
    done: set[str] = set()
    for name, _ in tqdm(named, desc=f"Quantizing to {fmt.name.upper()}", disable=not progress, unit="layer"):
        if name in done:
            continue
        group = [n for n in (fused_group_of(name, groups) or (name,)) if n in chosen and n not in done] or [name]
        weights = {n: chosen[n].weight.to(device) if device is not None else chosen[n].weight for n in group}
        quantized = fmt.quantize_group(weights, method=method, act_sq=act_sq, compute_dtype=compute_dtype)
        for n, q in quantized.items():
            lin_n = chosen[n]
            bias = lin_n.bias.detach().to(q.packed.device) if lin_n.bias is not None else None
            new = NVFP4Linear.from_weight(q, bias, lin_n.weight.dtype, name=n)
            parent_name, _, child = n.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
            done.add(n)
        del weights, quantized
    for hook in CONVERTED_MODEL_HOOKS:
        hook(model, method, given_groups, fmt)
    return model
