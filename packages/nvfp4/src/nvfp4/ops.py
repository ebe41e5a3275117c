"""NVFP4 weight-only linear algebra as ``torch.library`` custom ops.

Three ops, each with one entry point that dispatches by device:

* ``nvfp4::linear(x, packed, scale, global_scale, bias) -> y``   y = x · dequant(W)ᵀ + b,  x ``[..., in]``, y ``[..., out]``
* ``nvfp4::linear_dgrad(dy, packed, scale, global_scale) -> dx``   dx = dy · dequant(W),  dy ``[..., out]``, dx ``[..., in]``
* ``nvfp4::lora_linear(x, packed, scale, global_scale, bias, A, B, s) -> y``   y = linear(x) + s · (x·Aᵀ)·Bᵀ, one kernel on
  CUDA; inference only (no autograd formula: :class:`nvfp4.peft.LoraNVFP4Linear` uses it when no gradient is needed)

``linear`` has an autograd formula whose backward is ``linear_dgrad`` (the 4-bit weight is frozen: no weight grad),
so LoRA adapters train through it. Both carry fake (meta) implementations, so ``torch.compile`` traces them without
graph breaks and CUDA graphs capture them.

Dispatch point: on CUDA tensors the ops call the Triton kernels in :mod:`nvfp4.kernels` when they are importable
(``NVFP4_DISABLE_TRITON=1`` forces the reference); everywhere else they dequantize with the reference codec and call
``torch.nn.functional.linear`` / ``matmul``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .codec import dequantize
from .layout import checked_layout, weight_shape

__all__ = [
    "linear",
    "linear_dgrad",
    "linear_dgrad_reference",
    "linear_reference",
    "lora_linear",
    "lora_linear_reference",
]


def linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch reference of ``nvfp4::linear`` (dequantize to ``x.dtype``, then ``F.linear``)."""
    if bias is not None:  # in x's dtype, as the CUDA launcher takes it (F.linear refuses mixed dtypes)
        bias = bias.to(x.dtype)
    return F.linear(x, dequantize(packed, scale, global_scale, x.dtype), bias)


def linear_dgrad_reference(
    dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """Plain PyTorch reference of ``nvfp4::linear_dgrad``: ``dy @ dequant(W)``."""
    return dy @ dequantize(packed, scale, global_scale, dy.dtype)


def lora_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Plain PyTorch reference of ``nvfp4::lora_linear``: the base op plus PEFT's ``scaling · B(A(x))`` in ``x.dtype``."""
    y = linear_reference(x, packed, scale, global_scale, bias)
    return y + scaling * F.linear(F.linear(x, lora_a.to(x.dtype)), lora_b.to(x.dtype))


def _use_triton(t: torch.Tensor) -> bool:
    if not t.is_cuda or os.environ.get("NVFP4_DISABLE_TRITON") == "1":
        return False
    try:
        from . import kernels  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.custom_op("nvfp4::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    if _use_triton(x):
        from .kernels import nvfp4_linear

        return nvfp4_linear(x, packed, scale, global_scale, bias)
    return linear_reference(x, packed, scale, global_scale, bias)


def _linear_fake(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *_: object) -> torch.Tensor:
    """Fake (meta) implementation of both forward ops: ``[..., in]`` → ``[..., out]`` in ``x.dtype``."""
    return x.new_empty((*x.shape[:-1], weight_shape(packed, scale)[0]))


_linear_op.register_fake(_linear_fake)


@torch.library.custom_op("nvfp4::linear_dgrad", mutates_args=())
def _linear_dgrad_op(
    dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    if _use_triton(dy):
        from .kernels import nvfp4_linear_dgrad

        return nvfp4_linear_dgrad(dy, packed, scale, global_scale)
    return linear_dgrad_reference(dy, packed, scale, global_scale)


@_linear_dgrad_op.register_fake
def _(dy, packed, scale, global_scale):
    return dy.new_empty((*dy.shape[:-1], weight_shape(packed, scale)[1]))


@torch.library.custom_op("nvfp4::lora_linear", mutates_args=())
def _lora_linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    if _use_triton(x):
        from .kernels import nvfp4_lora_linear

        return nvfp4_lora_linear(x, packed, scale, global_scale, bias, lora_a, lora_b, scaling)
    return lora_linear_reference(x, packed, scale, global_scale, bias, lora_a, lora_b, scaling)


_lora_linear_op.register_fake(_linear_fake)


def _setup_context(ctx, inputs, output):
    x, packed, scale, global_scale, bias = inputs
    ctx.save_for_backward(packed, scale, global_scale)
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    packed, scale, global_scale = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0]:
        dx = _linear_dgrad_op(dy.contiguous(), packed, scale, global_scale)
    db = None
    if ctx.has_bias and ctx.needs_input_grad[4]:
        db = dy.reshape(-1, dy.shape[-1]).sum(0)
    return dx, None, None, None, db


_linear_op.register_autograd(_backward, setup_context=_setup_context)


def _check_weight(op: str, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> tuple[int, int]:
    """``(out, in)`` of the weight the three tensors hold; ValueError naming them where they disagree (the shape is
    read from ``scale``: a scale of another weight made the right ``x`` wrong, a swapped pair an IndexError)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or global_scale.dtype != torch.float32:
        # the CUDA launchers refuse these (TypeError); the reference computed with any, so CPU and GPU disagreed
        raise ValueError(f"{op}: the weight tensors must be uint8/float8_e4m3fn/float32 (weight_packed / weight_scale / "
                         f"weight_global_scale), got {packed.dtype}/{scale.dtype}/{global_scale.dtype}")  # fmt: skip
    if packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"{op}: NVFP4 tensors disagree: weight_packed {tuple(packed.shape)} and weight_scale "
                         f"{tuple(scale.shape)} must both be 2-D")  # fmt: skip
    # ValueError "NVFP4 tensors disagree" unless packed fits scale in either layout; the shape, read once
    n, k, _ = checked_layout(packed, scale)
    if global_scale.numel() != 1:
        raise ValueError(f"{op}: global_scale must hold one value (float32 [1]), got shape {tuple(global_scale.shape)}")
    return n, k


def _check_features(
    op: str,
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    # the weight is dequantized to x.dtype: integer inputs would truncate it (zeros for every value below 1)
    if not x.is_floating_point():
        raise ValueError(f"{op}: x must be floating-point (float32/float16/bfloat16), got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension ([..., in]), got a 0-dim tensor")
    n, k = _check_weight(op, packed, scale, global_scale)
    if x.shape[-1] != k:
        raise ValueError(f"{op}: x has {x.shape[-1]} input features, the weight expects {k}")
    # the kernels read [out] elements of the bias (a [1] bias would broadcast in the reference, and be read past
    # its end on CUDA)
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{op}: bias has shape {list(bias.shape)}, the weight's outputs need [{n}]")


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x · dequant(W)ᵀ + bias``.

    Args:
        x: ``[..., in]`` float32/float16/bfloat16 activations.
        packed: uint8 ``[out, in/2]`` (compressed-tensors layout) or ``[out/4, 2·in]`` (the kernels' MMA layout,
            :mod:`nvfp4.layout`); scale: float8_e4m3fn ``[out, in/16]`` (or ``[out/64, 4·in]`` beside the MMA layout); global_scale: float32 ``[1]``.
        bias: optional ``[out]``, cast to ``x.dtype``.

    Returns:
        ``[..., out]`` in ``x.dtype`` (float32 accumulation).
    """
    _check_features("nvfp4.linear", x, packed, scale, global_scale, bias)
    return _linear_op(x, packed, scale, global_scale, bias)


def linear_dgrad(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """``dx = dy · dequant(W)``: dy ``[..., out]`` → dx ``[..., in]`` in ``dy.dtype``."""
    # the weight is dequantized to dy.dtype, as in linear: an integer dy would truncate it
    if not dy.is_floating_point():
        raise ValueError(f"nvfp4.linear_dgrad: dy must be floating-point (float32/float16/bfloat16), got {dy.dtype}")
    if dy.dim() == 0:
        raise ValueError("nvfp4.linear_dgrad: dy must have at least one dimension ([..., out]), got a 0-dim tensor")
    n = _check_weight("nvfp4.linear_dgrad", packed, scale, global_scale)[0]
    if dy.shape[-1] != n:
        raise ValueError(f"nvfp4.linear_dgrad: dy has {dy.shape[-1]} features, the weight has {n} outputs")
    return _linear_dgrad_op(dy, packed, scale, global_scale)


def lora_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``y = x · dequant(W)ᵀ + bias + scaling · (x · Aᵀ) · Bᵀ`` (an NVFP4 linear and its LoRA adapter; no autograd).

    Args:
        x: ``[..., in]`` float32/float16/bfloat16.
        packed, scale, global_scale, bias: as :func:`linear`.
        lora_a: ``[r, in]``; lora_b: ``[out, r]`` (PEFT's ``lora_A`` / ``lora_B`` weights, any float dtype).
        scaling: ``lora_alpha / r``.

    Returns:
        ``[..., out]`` in ``x.dtype``.

    Raises:
        RuntimeError: if a gradient would be needed (use :func:`linear` plus the adapter's own modules to train).
    """
    _check_features("nvfp4.lora_linear", x, packed, scale, global_scale, bias)
    needs_grad = (t is not None and t.requires_grad for t in (x, bias, lora_a, lora_b))
    if torch.is_grad_enabled() and any(needs_grad):
        raise RuntimeError("nvfp4.lora_linear has no backward; call it under torch.no_grad() / inference_mode()")
    return _lora_linear_op(x, packed, scale, global_scale, bias, lora_a, lora_b, float(scaling))
