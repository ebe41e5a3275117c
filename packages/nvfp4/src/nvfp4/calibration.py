"""Model-level calibration: :func:`calibrate_model` quantizes a whole model to NVFP4 from calibration batches.

``"awq"`` runs one forward pass collecting each linear's ``E[x²]`` and searches activation-weighted block scales;
``"gptq"`` goes decoder layer by decoder layer, each layer's Hessians taken with the layers before it already
quantized (as GPTQ does). The per-weight algorithms live one level down, in :mod:`nvfp4.methods` (which imports the
codec only), and are this module's public API too: :func:`search_block_scales`, :func:`gptq_quantize`,
:class:`ActivationStats`, :class:`HessianStats`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .codec import shared_global_scale
from .formats import NVFP4
from .linear import (
    CONVERTED_MODEL_HOOKS,
    DEFAULT_FUSED_GROUPS,
    DEFAULT_MODULES_TO_NOT_CONVERT,
    NVFP4Linear,
    _check_no_adapters,
    _fused_group_names,
    _module_names,
    _quantizable,
    _warn_unmatched,
    fused_group_of,
    quantize_model,
)
from .methods import (
    CALIBRATED_METHODS,
    DEFAULT_ALPHAS,
    ActivationStats,
    HessianStats,
    gptq_quantize,
    search_block_scales,
)

__all__ = [
    "CALIBRATED_METHODS",
    "DEFAULT_ALPHAS",
    "ActivationStats",
    "HessianStats",
    "calibrate_model",
    "gptq_quantize",
    "search_block_scales",
]


class _StopForward(Exception):
    """Raised by a hook once the calibration forward has passed the layer being calibrated."""


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the longest ``nn.ModuleList`` whose items hold linears."""
    lists = [
        m for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and any(isinstance(x, nn.Linear) for x in m[0].modules())
    ]  # fmt: skip
    if not lists:
        raise ValueError("calibrate_model(method='gptq'): found no nn.ModuleList of decoder layers in the model")
    return max(lists, key=len)


def _attention_mask(batch: Any) -> torch.Tensor | None:
    """The batch's ``attention_mask`` (``[B, T]``, 0 at padding), None for a batch without one."""
    return batch.get("attention_mask") if isinstance(batch, Mapping) else None


def _run(model: nn.Module, batches: Iterable[Any], before: Callable[[torch.Tensor | None], None] | None = None) -> None:
    """Run ``model`` on each batch; ``before(attention_mask)`` first, so that statistics count real tokens only."""
    for batch in batches:
        if before is not None:
            before(_attention_mask(batch))
        try:
            if isinstance(batch, Mapping):
                model(**batch)
            else:
                model(batch)
        except _StopForward:
            pass


@torch.no_grad()
def calibrate_model(
    model: nn.Module,
    method: str,
    batches: Iterable[Any],
    *,
    modules_to_not_convert: Iterable[str] | None = None,
    fused_groups: Iterable[Iterable[str]] | None = None,
    damp: float = 0.01,
    progress: bool = True,
) -> nn.Module:
    """Quantize ``model`` to NVFP4 in place with a calibrated method and return it.

    Args:
        model: a model with ``nn.Linear`` layers in its working dtype (not yet quantized), in eval mode.
        method: ``"awq"`` (activation-weighted block-scale search, one forward pass over ``batches``) or ``"gptq"``
            (:func:`gptq_quantize`, decoder layer by decoder layer; each layer sees the quantized layers before it).
        batches: what ``model`` is called with: token-id tensors ``[B, T]`` (int64) or dicts of keyword arguments
            (``input_ids``, ``attention_mask``; positions where the mask is 0, padding, are left out of the
            statistics). A few dozen prompts are enough for the statistics.
        modules_to_not_convert / fused_groups: as :func:`nvfp4.quantize_model` (fused groups share a global scale).
        damp: GPTQ's diagonal damping (fraction of the mean diagonal).
        progress: progress bars (over the AWQ statistics' batches, over the layers quantized).
    """
    if method not in CALIBRATED_METHODS:
        raise ValueError(f"calibrate_model: method must be one of {CALIBRATED_METHODS}, got {method!r}")
    _check_no_adapters(model, "calibrate_model")
    batches = list(batches)
    if not batches:
        raise ValueError(f"calibrate_model(method={method!r}) needs at least one calibration batch")
    skip = _module_names(DEFAULT_MODULES_TO_NOT_CONVERT if modules_to_not_convert is None else modules_to_not_convert,
                         "calibrate_model: modules_to_not_convert")  # fmt: skip
    _warn_unmatched(model, skip, "calibrate_model: modules_to_not_convert")
    groups = _fused_group_names(DEFAULT_FUSED_GROUPS if fused_groups is None else fused_groups,
                                "calibrate_model: fused_groups")  # fmt: skip
    names = [n for n, m in model.named_modules() if _quantizable(n, m, skip)]
    if not names:
        raise ValueError("calibrate_model: the model has no nn.Linear layers left to quantize")
    if method == "awq":
        stats = ActivationStats(model, names)
        try:
            # padding positions (attention mask 0) are no activations; a full forward per batch: minutes on a 32B
            bar = tqdm(batches, desc="AWQ statistics", unit="batch", disable=not progress)
            _run(model, bar, stats.real_tokens)
        finally:
            stats.remove()
        with warnings.catch_warnings():  # said once, above
            warnings.filterwarnings("ignore", message=r"quantize_model: modules_to_not_convert: .* match no module")
            return quantize_model(model, method="awq", act_sq=stats.mean_sq(), modules_to_not_convert=skip,
                                  fused_groups=groups, progress=progress)  # fmt: skip

    layers = _decoder_layers(model)
    layer_prefix = {id(m): n for n, m in model.named_modules()}
    by_layer = [[n for n in names if n.startswith(layer_prefix[id(layer)] + ".")] for layer in layers]
    outside = [n for n in names if not any(n in ls for ls in by_layer)]
    if outside:
        raise ValueError(
            f"calibrate_model(method='gptq'): linears outside the decoder layers ({outside[:3]}) are not supported; "
            "list them in modules_to_not_convert"
        )
    modules = dict(model.named_modules())

    # Inputs of the first decoder layer, caught once (a forward that stops there); each layer then runs on its
    # cached inputs, is quantized, and runs again to give the next layer its inputs: L layer forwards in all.
    # (args, kwargs, the batch's attention mask: the Hessians count its real tokens only)
    cached: list[tuple[tuple, dict, torch.Tensor | None]] = []
    mask: list[torch.Tensor | None] = [None]  # the batch being run

    def catch(module, args, kwargs):
        # each layer runs on these again, twice: a KV cache in them (transformers passes one with use_cache=True)
        # took every run's keys, and the next run attended over them too
        for key in ("past_key_values", "past_key_value"):
            if kwargs.get(key) is not None:
                kwargs = {**kwargs, key: None}
        if kwargs.get("use_cache"):
            kwargs = {**kwargs, "use_cache": False}
        cached.append((args, kwargs, mask[0]))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        _run(model, batches, lambda m: mask.__setitem__(0, m))
    finally:
        handle.remove()

    for i in tqdm(range(len(layers)), desc="GPTQ calibration", disable=not progress, unit="layer"):
        layer = layers[i]
        hess = HessianStats(model, by_layer[i])
        try:
            for args, kwargs, real in cached:
                hess.real_tokens(real)
                layer(*args, **kwargs)
        finally:
            hess.remove()
        done: set[str] = set()
        for name in by_layer[i]:
            if name in done:
                continue
            group = [n for n in (fused_group_of(name, groups) or (name,)) if n in by_layer[i] and n not in done]
            g = shared_global_scale([modules[n].weight for n in group])
            for n in group:
                lin = modules[n]
                q = gptq_quantize(lin.weight, hess.hessian(n), global_scale=g, damp=damp, name=f"{n}.weight")
                bias = lin.bias.detach() if lin.bias is not None else None
                parent, _, child = n.rpartition(".")
                setattr(model.get_submodule(parent), child, NVFP4Linear.from_weight(q, bias, lin.weight.dtype, name=n))
                done.add(n)
        del hess
        if i + 1 < len(layers):  # the quantized layer's outputs are the next layer's inputs
            nxt = []
            for args, kwargs, real in cached:
                out = layer(*args, **kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
                if args:
                    nxt.append(((hidden, *args[1:]), kwargs, real))
                else:
                    nxt.append(((), {**kwargs, "hidden_states": hidden}, real))
            cached = nxt
    for hook in CONVERTED_MODEL_HOOKS:
        hook(model, method, groups, NVFP4)
    return model
