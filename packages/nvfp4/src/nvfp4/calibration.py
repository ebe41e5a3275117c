"""Calibration beyond round-to-nearest: per-block FP8 scale search, optionally activation-aware.

Round-to-nearest picks ``scale = amax / 6`` so the block maximum lands exactly on the top code. With only 8
magnitudes per sign, a slightly smaller scale often lowers the error of the other 15 values more than it costs the
clipped maximum (the same observation behind MSE observers in llm-compressor and AWQ's scale search). For each block
we try a grid of shrink factors ``alpha`` on ``amax / 6`` (each rounded to FP8, so candidates are real FP8 values) and
keep the one with the smallest squared error, optionally weighted per input channel by ``E[x²]`` measured on
calibration batches (``"awq"``), which minimises the expected output error ``E‖x (W - Ŵ)ᵀ‖²`` for channel-independent
activations.

``"gptq"`` (:func:`gptq_quantize`) goes further: it quantizes a weight one input column at a time and spreads each
column's rounding error over the columns not yet quantized, through the inverse of the layer's input Hessian
``H = E[xᵀx]`` (GPTQ, Frantar et al. 2022), so the *output* error ``E‖x (W - Ŵ)ᵀ‖²`` is what is minimised, not a
per-weight proxy. Each 16-column block's FP8 scale is chosen when the block is reached, on the error-updated
weights, by the activation-weighted search above. :func:`calibrate_model` runs either method on a whole model from
calibration batches: ``"awq"`` in one forward pass, ``"gptq"`` decoder layer by decoder layer, each layer's
Hessians taken with the layers before it already quantized (as GPTQ does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .codec import (
    BLOCK_SIZE,
    FP4_MAX,
    NVFP4Weight,
    _to_fp8_scale,
    check_weight,
    e2m1_to_float,
    pack_e2m1,
    round_to_e2m1,
    shared_global_scale,
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

#: Methods that need calibration batches (the others quantize from the weights alone).
CALIBRATED_METHODS = ("awq", "gptq")

# 1.0 is always a candidate, so the search is never worse than RTN on its own objective.
DEFAULT_ALPHAS = tuple(round(1.0 - 0.02 * i, 2) for i in range(21)) + (1.04, 1.08)


@torch.no_grad()
def search_block_scales(
    w: torch.Tensor,
    global_scale: torch.Tensor,
    act_sq: torch.Tensor | None = None,
    alphas: tuple[float, ...] = DEFAULT_ALPHAS,
    rows_per_chunk: int = 4096,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-block FP8 scales ``[out, in/16]`` minimising (weighted) squared reconstruction error.

    Args:
        w: ``[out, in]`` weight (any float dtype); computed in float32.
        global_scale: float32 ``[1]``.
        act_sq: optional float32 ``[in]`` per-channel weights (mean squared activations).
        alphas: shrink factors tried on the RTN scale.
        rows_per_chunk: rows processed at once (bounds temporary memory to ~len(alphas) x chunk x in floats).
        compute_dtype: dtype of ``amax / 6`` before the float32 product with ``global_scale`` (default ``w``'s, as RTN).
    """
    out, k = w.shape
    g = global_scale.to(w.device, torch.float32)
    weight = None
    if act_sq is not None:
        if act_sq.shape != (k,):
            raise ValueError(f"act_sq must have shape [{k}], got {tuple(act_sq.shape)}")
        weight = act_sq.to(w.device, torch.float32).clamp_min(0).reshape(1, -1, BLOCK_SIZE)
        weight = weight / weight.mean().clamp_min(1e-30)
    result = torch.empty(out, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    for r0 in range(0, out, rows_per_chunk):
        wb = w[r0 : r0 + rows_per_chunk].float().reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE)
        amax = w[r0 : r0 + rows_per_chunk].abs().reshape(wb.shape).amax(-1).to(compute_dtype or w.dtype)
        base = g * (amax / FP4_MAX).float()
        best_err = None
        best = None
        for a in alphas:
            s = _to_fp8_scale(base * a)
            step = (s.float() / g).unsqueeze(-1)
            err = (e2m1_to_float(round_to_e2m1(wb / step)) * step - wb).square()
            if weight is not None:
                err = err * weight
            err = err.sum(-1)
            if best is None:
                best, best_err = s, err
            else:
                better = err < best_err
                best = torch.where(better, s, best)
                best_err = torch.where(better, err, best_err)
        result[r0 : r0 + rows_per_chunk] = best
    return result


class _InputStats:
    """Sums a statistic of the input ``x`` (``[tokens, in]``, float32) of chosen linear layers with forward pre-hooks;
    subclasses say which (:meth:`_term`)."""

    def __init__(self, model: nn.Module, names: list[str]):
        self._sum: dict[str, torch.Tensor] = {}
        self._count: dict[str, int] = {}
        self._handles = []
        modules = dict(model.named_modules())
        for name in names:
            self._handles.append(modules[name].register_forward_pre_hook(self._hook(name)))

    @staticmethod
    def _term(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            self._sum[name] = self._sum.get(name, 0) + self._term(x)
            self._count[name] = self._count.get(name, 0) + x.shape[0]

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _mean(self, name: str) -> torch.Tensor:
        if name not in self._sum:
            raise RuntimeError(f"{name}: no calibration activations reached this layer")
        return self._sum[name] / self._count[name]


class ActivationStats(_InputStats):
    """Collects per-input-channel ``E[x²]`` of chosen linear layers with forward hooks.

    >>> stats = ActivationStats(model, names)   # names of nn.Linear modules
    >>> for batch in calib: model(**batch)
    >>> stats.remove(); act_sq = stats.mean_sq()  # {name: float32 [in_features]}
    """

    @staticmethod
    def _term(x: torch.Tensor) -> torch.Tensor:
        return x.square().sum(0)

    def mean_sq(self) -> dict[str, torch.Tensor]:
        return {n: self._mean(n).cpu() for n in self._sum}


class HessianStats(_InputStats):
    """Collects ``H = Σ xᵀx / n`` (float32 ``[in, in]``) of the input of chosen linear layers with forward hooks.

    One matrix per layer, also where layers read the same input (q/k/v): ``[in, in]`` is small next to the weights
    of the decoder layer being calibrated, and the products are cheap GEMMs.
    """

    @staticmethod
    def _term(x: torch.Tensor) -> torch.Tensor:
        return x.T @ x

    def hessian(self, name: str) -> torch.Tensor:
        """float32 ``[in, in]`` for linear ``name``; raises if the calibration batches never reached it."""
        return self._mean(name)


@torch.no_grad()
def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    *,
    global_scale: torch.Tensor | None = None,
    damp: float = 0.01,
    block_cols: int = 128,
    search_scales: bool = True,
    name: str = "weight",
) -> NVFP4Weight:
    """GPTQ for NVFP4: error-compensating rounding column by column, FP8 block scales chosen on the fly.

    Args:
        w: ``[out, in]`` float weight (``in % 16 == 0``); computed in float32 on ``w``'s device.
        hessian: float32 ``[in, in]`` ``E[xᵀx]`` of the layer's input (:class:`HessianStats`).
        global_scale: float32 ``[1]`` (shared within a fused group); default from ``amax(w)`` as RTN.
        damp: added to the diagonal, as a fraction of its mean (GPTQ's ``percdamp``), for a stable inverse.
        block_cols: columns per lazy batch update (a multiple of 16).
        search_scales: pick each block's FP8 scale by the ``E[x²]``-weighted search of :func:`search_block_scales`
            on the error-updated block (``False``: ``amax / 6`` of that block, RTN's rule).
        name: tensor name for error messages.

    Returns:
        :class:`NVFP4Weight` (compressed-tensors layout) on ``w``'s device.
    """
    check_weight(w, name)
    out, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"{name}: hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    if block_cols % BLOCK_SIZE:
        raise ValueError(f"block_cols must be a multiple of {BLOCK_SIZE}, got {block_cols}")
    if global_scale is None:
        global_scale = shared_global_scale([w])
    g = global_scale.to(w.device, torch.float32).reshape(1).clone()
    W = w.float().clone()
    H = hessian.to(w.device, torch.float32).clone()
    dead = torch.diag(H) == 0  # inputs that were always zero: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    act_sq = torch.diag(H).clone()
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, device=H.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    scale = torch.empty(out, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    codes = torch.empty(out, k, dtype=torch.uint8, device=w.device)
    for c0 in range(0, k, block_cols):
        c1 = min(c0 + block_cols, k)
        w1 = W[:, c0:c1].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[c0:c1, c0:c1]
        step = None
        for i in range(c1 - c0):
            col = c0 + i
            if col % BLOCK_SIZE == 0:  # a new block: its scale from the weights as updated so far
                blk = w1[:, i : i + BLOCK_SIZE]
                if search_scales:
                    s = search_block_scales(blk, g, act_sq[col : col + BLOCK_SIZE], compute_dtype=torch.float32)
                else:
                    s = _to_fp8_scale(g * (blk.abs().amax(-1, keepdim=True) / FP4_MAX))
                scale[:, col // BLOCK_SIZE] = s[:, 0]
                step = s[:, 0].float() / g
            q_code = round_to_e2m1(w1[:, i] / step)
            codes[:, col] = q_code
            q = e2m1_to_float(q_code) * step
            e = (w1[:, i] - q) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        W[:, c1:] -= err1 @ hinv[c0:c1, c1:]
    return NVFP4Weight(pack_e2m1(codes), scale, g)


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


def _run(model: nn.Module, batches: list[Any]) -> None:
    for batch in batches:
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
            (``input_ids``, ``attention_mask``). A few dozen prompts are enough for the statistics.
        modules_to_not_convert / fused_groups: as :func:`nvfp4.quantize_model` (fused groups share a global scale).
        damp: GPTQ's diagonal damping (fraction of the mean diagonal).
        progress: a progress bar over layers.
    """
    from .linear import (
        DEFAULT_FUSED_GROUPS,
        DEFAULT_MODULES_TO_NOT_CONVERT,
        NVFP4Linear,
        _quantizable,
        fused_group_of,
        quantize_model,
    )

    if method not in CALIBRATED_METHODS:
        raise ValueError(f"calibrate_model: method must be one of {CALIBRATED_METHODS}, got {method!r}")
    batches = list(batches)
    if not batches:
        raise ValueError(f"calibrate_model(method={method!r}) needs at least one calibration batch")
    skip = tuple(DEFAULT_MODULES_TO_NOT_CONVERT if modules_to_not_convert is None else modules_to_not_convert)
    groups = [tuple(g) for g in (DEFAULT_FUSED_GROUPS if fused_groups is None else fused_groups)]
    names = [n for n, m in model.named_modules() if _quantizable(n, m, skip)]
    if not names:
        raise ValueError("calibrate_model: the model has no nn.Linear layers left to quantize")
    if method == "awq":
        stats = ActivationStats(model, names)
        try:
            _run(model, batches)
        finally:
            stats.remove()
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
    cached: list[tuple[tuple, dict]] = []

    def catch(module, args, kwargs):
        cached.append((args, kwargs))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        _run(model, batches)
    finally:
        handle.remove()

    for i in tqdm(range(len(layers)), desc="GPTQ calibration", disable=not progress, unit="layer"):
        layer = layers[i]
        hess = HessianStats(model, by_layer[i])
        try:
            for args, kwargs in cached:
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
                setattr(model.get_submodule(parent), child, NVFP4Linear.from_weight(q, bias, lin.weight.dtype))
                done.add(n)
        del hess
        if i + 1 < len(layers):  # the quantized layer's outputs are the next layer's inputs
            nxt = []
            for args, kwargs in cached:
                out = layer(*args, **kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
                if args:
                    nxt.append(((hidden, *args[1:]), kwargs))
                else:
                    nxt.append(((), {**kwargs, "hidden_states": hidden}))
            cached = nxt
    return model
