"""``NVFP4Linear`` and model conversion (``quantize_model``), in the spirit of torchao's ``quantize_(model, config)``."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from . import ops
from .codec import BLOCK_SIZE, NVFP4Weight, dequantize, quantize, shared_global_scale
from .layout import from_mma_layout, is_mma_layout, mma_layout_supported, mma_scales_supported, to_mma_layout

__all__ = [
    "DEFAULT_FUSED_GROUPS",
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


class NVFP4Linear(nn.Linear):
    """A frozen linear layer whose weight is stored in NVFP4 (compressed-tensors layout).

    Buffers (saved in the state dict under compressed-tensors names):
        weight_packed: uint8 ``[out, in/2]``; weight_scale: float8_e4m3fn ``[out, in/16]``;
        weight_global_scale: float32 ``[1]``.
    ``bias`` (if any) is a frozen parameter in the activation dtype.

    On CUDA, ``weight_packed`` holds the same bytes in the kernels' MMA layout (``[out/4, 2·in]``,
    :mod:`nvfp4.layout`) when the shape allows it (out % 64 == 0, in % 256 == 0): the layer converts it when it
    lands on a GPU (``.to``/``.cuda``, quantization, loading). The state dict, :attr:`nvfp4_weight` and
    :meth:`dequantize` always give the compressed-tensors layout; ``NVFP4_MMA_LAYOUT=0`` keeps that layout on GPU too.

    Forward: ``x [..., in]`` (float32/float16/bfloat16) → ``[..., out]`` in ``x.dtype``, through ``nvfp4::linear``
    (Triton on CUDA, dequantize + matmul elsewhere). Backward reaches the input only, so LoRA trains through it.

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
    ) -> None:
        nn.Module.__init__(self)
        if in_features % BLOCK_SIZE:
            raise ValueError(f"NVFP4Linear: in_features={in_features} must be a multiple of {BLOCK_SIZE}")
        self.in_features = in_features
        self.out_features = out_features
        self.orig_dtype = dtype  # dtype of the dense weight it replaced: what dequantize/merge export to
        self.register_buffer(
            "weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._load_hook = self.register_load_state_dict_pre_hook(self._check_loaded_tensors)

    _QUANT_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` must move the NVFP4 tensors but never cast them (fp8 scales and the fp32 global
        # scale are floating point, so nn.Module would convert them and corrupt the format).
        saved = {n: self._buffers[n] for n in self._QUANT_BUFFERS}
        super()._apply(fn, recurse)
        for n, old in saved.items():
            new = self._buffers[n]
            if new is not None and old is not None and new.dtype != old.dtype:
                self._buffers[n] = old.to(new.device)
        self.use_kernel_layout()
        return self

    @property
    def mma_layout(self) -> bool:
        """Whether ``weight_packed`` is currently in the kernels' MMA layout (see :mod:`nvfp4.layout`)."""
        return is_mma_layout(self.weight_packed, self.weight_scale)

    @torch.no_grad()
    def use_kernel_layout(self) -> bool:
        """Put ``weight_packed`` in the layout the kernels read fastest on its device: the MMA layout on CUDA when
        the shape allows it and every block scale is positive and finite (what compressed-tensors writes; the
        MMA-layout kernels decode scales with integer instructions, see :mod:`nvfp4.layout`), unless
        ``NVFP4_MMA_LAYOUT=0``. Idempotent; returns :attr:`mma_layout`."""
        packed = self.weight_packed
        if packed.is_meta or self.mma_layout:
            return self.mma_layout
        if (
            packed.is_cuda
            and os.environ.get("NVFP4_MMA_LAYOUT", "1") != "0"
            and mma_layout_supported(self.out_features, self.in_features)
        ):
            if mma_scales_supported(self.weight_scale):
                self.weight_packed = to_mma_layout(packed)
            else:
                self._warn_ct_layout_kept()
        return self.mma_layout

    def _warn_ct_layout_kept(self) -> None:
        warnings.warn(
            f"NVFP4Linear {self.out_features}x{self.in_features}: weight_scale holds zero, negative or NaN block "
            "scales; kept in the compressed-tensors layout (exact, slower kernels)",
            stacklevel=3,
        )

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.weight_packed

    @property
    def nvfp4_weight(self) -> NVFP4Weight:
        """The weight in the compressed-tensors layout (a converted copy of ``weight_packed`` in the MMA layout)."""
        packed = from_mma_layout(self.weight_packed) if self.mma_layout else self.weight_packed
        return NVFP4Weight(packed, self.weight_scale, self.weight_global_scale)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight_packed"
        if key in destination and self.mma_layout:  # checkpoints hold the compressed-tensors layout
            destination[key] = from_mma_layout(destination[key].detach())

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        global_scale: torch.Tensor | None = None,
        method: str = "rtn",
        act_sq: torch.Tensor | None = None,
        name: str = "weight",
    ) -> NVFP4Linear:
        """Quantize a dense ``nn.Linear`` (see :func:`nvfp4.codec.quantize` for ``method``/``act_sq``)."""
        q = quantize(linear.weight.detach(), global_scale=global_scale, method=method, act_sq=act_sq, name=name)
        return cls.from_weight(q, linear.bias.detach() if linear.bias is not None else None, linear.weight.dtype)

    @classmethod
    def from_weight(
        cls, weight: NVFP4Weight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> NVFP4Linear:
        out, k = weight.shape
        mod = cls(k, out, bias=bias is not None, dtype=dtype, device="meta")
        mod.weight_packed = weight.packed
        mod.weight_scale = weight.scale
        mod.weight_global_scale = weight.global_scale
        if bias is not None:
            mod.bias = nn.Parameter(bias.to(dtype).clone(), requires_grad=False)
        mod.use_kernel_layout()
        return mod

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dense ``[out, in]`` weight in ``dtype`` (default: the dtype of the layer it replaced)."""
        return dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype or self.orig_dtype)

    def to_dense(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding ``dequant(W)`` (and the bias) in the dtype of the layer it replaced."""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        dense.weight = nn.Parameter(self.dequantize(), requires_grad=False)
        if self.bias is not None:
            dense.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return dense

    _dense_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        dense = self._dense_cache
        if dense is not None and dense.dtype == x.dtype and dense.device == x.device:
            return F.linear(x, dense, bias)  # == the reference op, minus re-dequantizing (see cache_dequantized)
        return ops.linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"

    def _check_loaded_tensors(self, module, state_dict, prefix, *args, **kwargs) -> None:
        """Fail with one clear error when a checkpoint's tensors disagree with this layer (shape or dtype); convert
        a compressed-tensors ``weight_packed`` to the MMA layout when this layer holds that layout."""
        expected = {
            "weight_packed": (torch.uint8, (self.out_features, self.in_features // 2)),
            "weight_scale": (torch.float8_e4m3fn, (self.out_features, self.in_features // BLOCK_SIZE)),
            "weight_global_scale": (torch.float32, (1,)),
        }
        for name, (dtype, shape) in expected.items():
            t = state_dict.get(prefix + name)
            if t is None:
                continue
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(
                    f"{prefix}{name}: checkpoint has {t.dtype} {tuple(t.shape)}, the layer expects {dtype} {shape} "
                    f"(in_features={self.in_features}, out_features={self.out_features})"
                )
        key = prefix + "weight_packed"
        if key in state_dict and not self.weight_packed.is_meta and self.mma_layout:
            if mma_scales_supported(state_dict.get(prefix + "weight_scale", self.weight_scale)):
                state_dict[key] = to_mma_layout(state_dict[key])
            else:  # the MMA-layout kernels cannot decode these scales: back to the compressed-tensors layout
                self.weight_packed = torch.empty_like(state_dict[key], device=self.weight_packed.device)
                self._warn_ct_layout_kept()


@contextlib.contextmanager
def cache_dequantized(model: nn.Module, dtype: torch.dtype) -> Iterator[int]:
    """Hold ``dequant(W)`` (``[out, in]``, ``dtype``) of every :class:`NVFP4Linear` in ``model`` for the block.

    For the PyTorch reference path (CPU), which otherwise dequantizes each weight on every call — decode calls every
    linear once per token, and training forward + backward twice per step. Results are bit-identical to the uncached
    reference (``F.linear(x, dequant(W))`` is what the reference computes); the price is dense memory for the block.
    Never use it where the Triton kernels run: they read the 4-bit weight directly. Yields the bytes held.
    """
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    held = 0
    try:
        for layer in layers:
            layer._dense_cache = layer.dequantize(dtype)
            held += layer._dense_cache.numel() * layer._dense_cache.element_size()
        yield held
    finally:
        for layer in layers:
            layer._dense_cache = None


def fused_group_of(name: str, groups: Iterable[Iterable[str]] = DEFAULT_FUSED_GROUPS) -> tuple[str, ...] | None:
    """Full names of the fused group ``name`` belongs to (e.g. ``a.q_proj`` → ``(a.q_proj, a.k_proj, a.v_proj)``)."""
    parent, _, leaf = name.rpartition(".")
    for group in groups:
        if leaf in group:
            return tuple(f"{parent}.{m}" if parent else m for m in group)
    return None


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(name == p or name.endswith("." + p) or re.fullmatch(p, name) for p in patterns)


def _quantizable(name: str, module: nn.Module, skip: Iterable[str]) -> bool:
    return type(module) is nn.Linear and module.in_features % BLOCK_SIZE == 0 and not _matches(name, skip)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    *,
    method: str = "rtn",
    modules_to_not_convert: Iterable[str] = DEFAULT_MODULES_TO_NOT_CONVERT,
    fused_groups: Iterable[Iterable[str]] = DEFAULT_FUSED_GROUPS,
    act_sq: dict[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Replace every eligible ``nn.Linear`` of ``model`` by an :class:`NVFP4Linear`, in place, and return ``model``.

    Eligible: plain ``nn.Linear`` with ``in_features % 16 == 0``, not matched by ``modules_to_not_convert``
    (exact names, name suffixes, or regexes; ``lm_head`` by default; embeddings are never linears), and accepted by
    ``filter_fn``. Members of a fused group present in the same parent share one global scale. Layers are quantized
    one at a time (optionally moved to ``device`` first), so peak memory is the quantized model plus one group in
    full precision.

    RTN runs in each weight's dtype as the model holds it (``compute_dtype=None``), as llm-compressor does: a model
    loaded in bf16 gives llm-compressor's ``NVFP4A16`` bytes. ``compute_dtype=torch.float32`` computes the scale
    quotients in float32 instead (see :mod:`nvfp4.codec`).
    """
    groups = [tuple(g) for g in fused_groups]
    named = [
        (n, m)
        for n, m in model.named_modules()
        if _quantizable(n, m, modules_to_not_convert)
        and not m.weight.is_meta
        and (filter_fn is None or filter_fn(n, m))
    ]
    chosen = dict(named)
    done: set[str] = set()
    for name, _lin in tqdm(named, desc="Quantizing to NVFP4", disable=not progress, unit="layer"):
        if name in done:
            continue
        group = [n for n in (fused_group_of(name, groups) or (name,)) if n in chosen and n not in done] or [name]
        weights = {n: chosen[n].weight.to(device) if device is not None else chosen[n].weight for n in group}
        g = shared_global_scale(weights.values(), compute_dtype)
        for n in group:
            lin_n = chosen[n]
            q = quantize(
                weights[n],
                global_scale=g,
                method=method,
                act_sq=None if act_sq is None else act_sq.get(n),
                name=f"{n}.weight",
                compute_dtype=compute_dtype,
            )
            bias = lin_n.bias.detach().to(q.packed.device) if lin_n.bias is not None else None
            new = NVFP4Linear.from_weight(q, bias, lin_n.weight.dtype)
            parent_name, _, child = n.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
            done.add(n)
        del weights
    return model
