"""The engine side of weight sharing with a colocated trainer: vLLM's frozen tensors, by the trainer's module names.

In colocate mode (the engine in the trainer's process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker) the trainer's
frozen NVFP4 base and the engine's model hold the same weights. :func:`engine_weight_views` (run in the worker through
``collective_rpc``, :meth:`qerl_vllm.worker.QeRLWorkerExtension.qerl_engine_weight_views`) names the engine's tensors
the trainer could view instead of holding its own copy; the trainer side (``qerl_trl.rollout.shared_weights``) checks
each one bit for bit against its own and swaps it in.

What is offered, all as views of the engine's parameters (no copy):

* each NVFP4 linear loaded by :class:`~qerl_vllm.quant.NVFP4KernelLinearMethod` (the ``qerl`` backend: the weight
  stays packed), per HF member of a fused layer (``qkv_proj`` → ``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj``
  → ``gate_proj``, ``up_proj``): ``weight_packed`` uint8 (its rows: ``[out, in/2]`` in the compressed-tensors layout,
  ``[out/4, 2·in]`` in the MMA layout — the method keeps each member's rows a contiguous slice in both),
  ``weight_scale`` float8_e4m3fn ``[out, in/16]`` and ``weight_global_scale`` float32 ``[1]`` (the fused layer's
  one shared scale, or the member's own);
* the dense ``embed_tokens`` and ``lm_head`` weights ``[vocab, hidden]`` (in the engine's dtype; one module when tied).

Linears of the other backends (``dequant``: a dense weight, vLLM's CPU default; ``native``: stock vLLM's Marlin
layout) hold nothing the trainer holds and are listed in :attr:`EngineWeights.not_offered` with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from nvfp4.layout import scale_rows

__all__ = ["EngineWeights", "PackedViews", "engine_weight_views"]


@dataclass(frozen=True)
class PackedViews:
    """One NVFP4 linear's tensors as the engine holds them (views of its fused layer's parameters).

    ``weight_packed`` uint8 ``[out, in/2]`` and ``weight_scale`` float8_e4m3fn ``[out, in/16]`` (compressed-tensors
    layout), or ``[out/4, 2·in]`` and ``[out/64, 4·in]`` (MMA layout, then ``mma_layout``), ``weight_global_scale``
    float32 ``[1]``."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    mma_layout: bool


@dataclass
class EngineWeights:
    """The engine model's tensors a colocated trainer may view, keyed by HF module names.

    Attributes:
        pid: the worker's process id (the tensors are this process's memory only when it is the caller's).
        linears: ``{"model.layers.0.self_attn.q_proj": PackedViews}``, one per HF member of the packed linears.
        dense: ``{"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden]}`` (the engine's
            dtype; ``lm_head`` absent when it is the embedding module).
        not_offered: ``{HF module name: why}`` for the linears whose tensors are not packed NVFP4 (keyed by the
            vLLM layer's name where its members are not known).
    """

    pid: int
    linears: dict[str, PackedViews] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    not_offered: dict[str, str] = field(default_factory=dict)


def _member_names(prefix: str, count: int, packed_modules: dict[str, list[str]]) -> list[str] | None:
    """HF names of the ``count`` members of the vLLM layer ``prefix`` (itself when it is not fused); None when the
    model's ``packed_modules_mapping`` does not say."""
    if count == 1:
        return [prefix]
    parent, _, leaf = prefix.rpartition(".")
    members = packed_modules.get(leaf)
    if not members or len(members) != count:
        return None
    return [f"{parent}.{m}" if parent else m for m in members]


def _packed_member_views(layer: torch.nn.Module) -> list[PackedViews]:
    """Per fused member of a layer processed by ``NVFP4KernelLinearMethod``: views of its rows of ``weight_packed``
    and ``weight_scale``, and of its global scale (``[1]``)."""
    packed, scale = layer.weight_packed.detach(), layer.weight_scale.detach()
    global_scale = layer.weight_global_scale.detach().reshape(-1)
    mma = bool(layer.nvfp4_mma_layout)
    packed_rows_per_output = 4 if mma else 1  # the MMA layout holds 4 outputs per row
    views, start = [], 0
    for i, width in enumerate(int(w) for w in layer.logical_widths):
        p0, p1 = start // packed_rows_per_output, (start + width) // packed_rows_per_output
        gs = global_scale[:1] if global_scale.numel() == 1 else global_scale[i : i + 1]
        views.append(PackedViews(packed[p0:p1], scale[scale_rows(packed, scale, start, start + width)], gs, mma))
        start += width
    return views


def engine_weight_views(model: torch.nn.Module) -> EngineWeights:
    """The tensors of the engine ``model`` (the worker's ``model_runner.model``) a colocated trainer may view (see
    the module docstring). Runs in the worker; cheap (no tensor is copied or read)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from .quant import NVFP4KernelLinearMethod, _PackedLinearMethod

    model = getattr(model, "_orig_mod", model)
    packed_modules = dict(getattr(model, "packed_modules_mapping", None) or {})
    out = EngineWeights(pid=os.getpid())
    for name, module in model.named_modules():
        name = name.replace(".base_layer", "")  # vLLM's LoRA layers wrap the linear they replace
        if isinstance(module, LinearBase):
            prefix = getattr(module, "prefix", "") or name
            widths = list(getattr(module, "logical_widths", None) or [module.output_size])
            members = _member_names(prefix, len(widths), packed_modules)
            method = getattr(module, "quant_method", None)
            if members is None:
                out.not_offered[prefix] = f"{len(widths)} fused members that packed_modules_mapping does not name"
            elif not isinstance(method, NVFP4KernelLinearMethod):
                why = f"the engine holds it through {type(method).__name__}, not as packed NVFP4"
                out.not_offered.update(dict.fromkeys(members, why))
            elif not isinstance(getattr(module, "weight_packed", None), torch.Tensor):  # rollout_precision="fp8"
                out.not_offered.update(dict.fromkeys(members, "the engine holds its FP8 copy only"))
            else:
                out.linears.update(zip(members, _packed_member_views(module)))
        elif isinstance(module, VocabParallelEmbedding) and isinstance(getattr(module, "quant_method", None),
                                                                       _PackedLinearMethod):  # fmt: skip
            # an lm_head quantized in the checkpoint: its `weight`, if any, is the engine's dequantized or FP8 copy
            out.not_offered[name] = f"the engine holds it through {type(module.quant_method).__name__}"
        elif isinstance(module, VocabParallelEmbedding) and isinstance(getattr(module, "weight", None), torch.Tensor):
            out.dense[f"{name}.weight"] = module.weight.detach()  # embed_tokens, and lm_head unless tied
    return out
