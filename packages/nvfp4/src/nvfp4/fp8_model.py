"""FP8 rollouts on a model of :class:`~nvfp4.linear.NVFP4Linear` layers (``rollout_precision`` fp8 / auto, issue #51).

The graph engine generates with the policy itself, whose training needs the W4A16 path (gradients through ``x``),
so the E4M3 copy is held *beside* the NVFP4 weights and used only while rollouts are generated:

* :func:`attach_fp8_copies` makes every layer's copy once (:func:`nvfp4.fp8.fp8_weight`, the layer's own weight and
  global scale) and records the rows from which it computes with it (``fp8``: always, ``auto``: the crossover);
* :func:`fp8_rollouts` is the block in which the layers use it (their ``fp8_active`` flag): a call with at least
  ``from_rows`` rows runs :func:`nvfp4.fp8.fp8_linear` (per-token E4M3 of ``x``, the product on FP8 tensor cores on
  CUDA, the float32 reference elsewhere), fewer rows the layer's usual W4A16 path. The choice is Python on the
  input's shape: the graph engine compiles its decode step with static shapes, one graph per batch size.

LoRA (PEFT's, on top of the layer) and AQN (noise on the RMSNorm weights) are untouched: the copy replaces only the
base product. :func:`detach_fp8_copies` frees the copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .fp8 import fp8_weight
from .linear import FP8Copy, NVFP4Linear
from .rollout_precision import RolloutPrecision, get_rollout_precision

__all__ = ["attach_fp8_copies", "detach_fp8_copies", "fp8_rollouts"]


def _layers(model: nn.Module) -> list[NVFP4Linear]:
    return [m for m in model.modules() if isinstance(m, NVFP4Linear)]


def attach_fp8_copies(model: nn.Module, precision: RolloutPrecision | str, crossover_rows: int) -> int:
    """Give every NVFP4 layer of ``model`` its E4M3 copy for rollouts (once; a layer that has one keeps it).

    Args:
        model: holds :class:`NVFP4Linear` layers (a ``PeftModel`` around them too).
        precision: ``"fp8"`` or ``"auto"`` (``"w4a16"``: nothing is made, 0 returned).
        crossover_rows: ``auto``'s rows per call from which FP8 runs (:func:`nvfp4.rollout_precision.fp8_crossover_rows`).

    Returns:
        The bytes the copies hold (1 per weight + 4 per output row).

    Raises:
        ValueError: a layer sharded by FSDP2 (its weight is whole only inside its forward; not built).
    """
    precision = get_rollout_precision(precision)
    from_rows = precision.fp8_from_rows(crossover_rows)
    if from_rows is None:
        return 0
    held = 0
    for layer in _layers(model):
        if layer.fsdp_shardable:
            raise ValueError(f"rollout_precision={precision.name!r}: {layer._label()} is sharded by FSDP2; FP8 "
                             "copies of sharded weights are not built: use rollout_precision='w4a16'")  # fmt: skip
        if not layer.uses_nvfp4_ops:  # MXFP4 on the plain reference: it keeps its path
            continue
        if layer.fp8_copy is None:
            w8, w_scale = fp8_weight(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
            layer.fp8_copy = FP8Copy(w8, w_scale, from_rows)
        else:
            layer.fp8_copy = layer.fp8_copy._replace(from_rows=from_rows)
        held += layer.fp8_copy.weight.numel() + 4 * layer.fp8_copy.scale.numel()
    return held


def detach_fp8_copies(model: nn.Module) -> None:
    """Drop the copies :func:`attach_fp8_copies` made (the layers compute W4A16 only again)."""
    for layer in _layers(model):
        layer.fp8_copy = None
        layer.fp8_active = False


@contextlib.contextmanager
def fp8_rollouts(model: nn.Module) -> Iterator[int]:
    """The block in which ``model``'s NVFP4 layers compute with their FP8 copies (from their ``from_rows``); yields
    how many layers have one (0: the block changes nothing). Restored on exit, also on an error."""
    layers = [m for m in _layers(model) if m.fp8_copy is not None]
    enclosing = [layer.fp8_active for layer in layers]  # a block inside another gives the outer one's flags back
    for layer in layers:
        layer.fp8_active = True
    try:
        yield len(layers)
    finally:
        for layer, active in zip(layers, enclosing, strict=True):
            layer.fp8_active = active
