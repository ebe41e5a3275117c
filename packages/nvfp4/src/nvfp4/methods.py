"""NVFP4 weight-only methods on one weight: round to nearest, per-block FP8 scale search, GPTQ.

Round-to-nearest picks ``scale = amax / 6`` so the block maximum lands exactly on the top code (:mod:`nvfp4.codec`).
With only 8 magnitudes per sign, a slightly smaller scale often lowers the error of the other 15 values more than it
costs the clipped maximum (the same observation behind MSE observers in llm-compressor and AWQ's scale search). For
each block we try a grid of shrink factors ``alpha`` on ``amax / 6`` (each rounded to FP8, so candidates are real FP8
values) and keep the one with the smallest squared error (``"mse"``), optionally weighted per input channel by
``E[x²]`` measured on calibration batches (``"awq"``), which minimises the expected output error ``E‖x (W - Ŵ)ᵀ‖²``
for channel-independent activations.

``"gptq"`` (:func:`gptq_quantize`) goes further: it quantizes a weight one input column at a time and spreads each
column's rounding error over the columns not yet quantized, through the inverse of the layer's input Hessian
``H = E[xᵀx]`` (GPTQ, Frantar et al. 2022), so the *output* error ``E‖x (W - Ŵ)ᵀ‖²`` is what is minimised, not a
per-weight proxy. Each 16-column block's FP8 scale is chosen when the block is reached, on the error-updated
weights, by the activation-weighted search above.

This module sits between the codec (the byte format and RTN, below it) and the layers and model-level calibration
(:mod:`nvfp4.linear`, :func:`nvfp4.calibration.calibrate_model`, above it): it imports the codec only.
"""

from __future__ import annotations

import torch
from torch import nn

from .codec import (
    BLOCK_SIZE,
    FP4_MAX,
    NVFP4Weight,
    _to_fp8_scale,
    check_weight,
    e2m1_to_float,
    pack_e2m1,
    prepare_global_scale,
    quantize_with_scales,
    round_to_e2m1,
    shared_global_scale,
)
from .codec import quantize as quantize_rtn

__all__ = [
    "CALIBRATED_METHODS",
    "DEFAULT_ALPHAS",
    "METHODS",
    "ActivationStats",
    "HessianStats",
    "gptq_quantize",
    "quantize",
    "search_block_scales",
]

#: Methods that need calibration batches (the others quantize from the weights alone).
CALIBRATED_METHODS = ("awq", "gptq")
#: Every NVFP4 method, from the weights alone first.
METHODS = ("rtn", "mse", *CALIBRATED_METHODS)

# 1.0 is always a candidate, so the search is never worse than RTN on its own objective.
DEFAULT_ALPHAS = tuple(round(1.0 - 0.02 * i, 2) for i in range(21)) + (1.04, 1.08)


def quantize(
    w: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    method: str = "rtn",
    act_sq: torch.Tensor | None = None,
    name: str = "weight",
    compute_dtype: torch.dtype | None = None,
) -> NVFP4Weight:
    """Quantize a dense weight to NVFP4 with a method that needs no Hessian.

    Args:
        w: ``[out, in]`` float32/float16/bfloat16 weight; ``in`` must be a multiple of 16.
        global_scale: float32 ``[1]`` (or a number) to use (shared by a fused q/k/v or gate/up group); default from
            ``amax(w)``.
        method: ``"rtn"`` (round to nearest, :func:`nvfp4.codec.quantize`: byte-identical to llm-compressor's
            ``NVFP4A16`` on a weight of the same dtype), ``"mse"`` (per-block scale search minimising the block's
            squared error) or ``"awq"`` (the same search weighting each input channel by its mean squared
            activation ``act_sq``). ``"gptq"`` needs the layer's input Hessian: :func:`gptq_quantize`.
        act_sq: float32 ``[in]`` mean of ``x**2`` per input channel over calibration batches (for ``"awq"``).
        name: tensor name used in error messages.
        compute_dtype: dtype of the scale quotients (see :func:`nvfp4.codec.quantize`).

    Returns:
        :class:`~nvfp4.codec.NVFP4Weight` on ``w``'s device.
    """
    if method == "rtn":
        return quantize_rtn(w, global_scale=global_scale, name=name, compute_dtype=compute_dtype)
    check_weight(w, name)
    if method not in ("mse", "awq"):
        hint = " ('gptq' needs the layer's input Hessian: nvfp4.methods.gptq_quantize)" if method == "gptq" else ""
        raise ValueError(f"{name}: unknown method {method!r}; choose 'rtn', 'mse' or 'awq'{hint}")
    if method == "awq" and act_sq is None:
        raise ValueError(f"{name}: method='awq' needs act_sq (per-input-channel mean x**2 from calibration data)")
    if method == "awq":
        # NaN / inf (activations that overflowed) made every weighted error NaN or 0: the search kept RTN's scales
        bad = int((~(torch.isfinite(act_sq) & (act_sq >= 0))).sum())
        if bad:
            raise ValueError(f"{name}: act_sq holds {bad} NaN, inf or negative value(s); it must be the finite mean of "
                             "x**2 per input channel (did the calibration activations overflow? calibrate in "
                             "bfloat16 or float32)")  # fmt: skip
    g = prepare_global_scale(w, global_scale, compute_dtype, name)
    scale = search_block_scales(w, g, act_sq if method == "awq" else None, compute_dtype=compute_dtype)
    return NVFP4Weight(pack_e2m1(quantize_with_scales(w, scale, g)), scale, g)


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
        self._real: torch.Tensor | None = None  # bool [B, T]: the positions counted (None: all)
        modules = dict(model.named_modules())
        for name in names:
            self._handles.append(modules[name].register_forward_pre_hook(self._hook(name)))

    def real_tokens(self, attention_mask: torch.Tensor | None) -> None:
        """Count only real tokens in the forward passes that follow: ``attention_mask`` ``[B, T]`` (nonzero for a
        token, 0 for padding) selects the positions of every layer input ``[B, T, in]`` (or ``[B·T, in]``); inputs
        of other leading shapes (tokens routed to an expert) are counted whole. None (the default): every position."""
        self._real = None if attention_mask is None else attention_mask.detach() != 0

    @staticmethod
    def _term(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0].detach()
            real = self._real
            if real is not None and x.shape[:-1].numel() == real.numel() and x.dim() in (2, real.dim() + 1):
                x = x.reshape(-1, x.shape[-1])[real.reshape(-1).to(x.device)]
            x = x.reshape(-1, x.shape[-1]).float()
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
    >>> for batch in calib: stats.real_tokens(batch.get("attention_mask")); model(**batch)  # padding left out
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
