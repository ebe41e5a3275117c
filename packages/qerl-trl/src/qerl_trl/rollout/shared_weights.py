"""Colocated vLLM rollouts with one copy of the frozen weights: the trainer's base becomes views of the engine's.

In colocate mode with one process (no FSDP2, ``vllm.tensor_parallel_size`` = 1) the engine runs in the trainer's
process and loads the same NVFP4 checkpoint the trainer holds, so both held every frozen weight: on the 7B GRPO recipe
~3.7 GB of packed linears and ~2.2 GB of embeddings and ``lm_head`` twice. After the engine has loaded and processed
its weights, :func:`share_engine_weights` makes the trainer's frozen tensors views of the engine's parameters
(:meth:`qerl_vllm.engine.VLLMEngine.shareable_weights`, run in the worker through ``collective_rpc``) and drops the
trainer's own copies:

* each :class:`~nvfp4.NVFP4Linear`'s ``weight_packed`` (uint8), ``weight_scale`` (float8_e4m3fn) and
  ``weight_global_scale`` (float32 ``[1]``): rows of the engine's fused ``qkv_proj`` / ``gate_up_proj`` (each
  member's rows are one contiguous slice there, in the compressed-tensors layout and in the MMA layout alike) and
  its global scale (the fused layer's one scale, or the member's own);
* the frozen dense ``embed_tokens`` and (untied) ``lm_head`` weights ``[vocab, hidden]``.

Exactness: a tensor is shared only where the engine's is bit-identical (``torch.equal``, once) with the same dtype,
shape — hence layout: ``[out, in/2]`` compressed-tensors vs ``[out/4, 2·in]`` MMA — and device. The trainer then
holds exactly the values and layout it held before, so its kernels (chosen from the shapes, :mod:`nvfp4.ops`)
and results are unchanged. Everything else keeps the trainer's copy, and one log line says what and why: a linear the
engine dequantized (vLLM's CPU default, ``QERL_VLLM_NVFP4_BACKEND=dequant``) or holds in stock vLLM's Marlin layout
(``native``), a different layout or dtype, a trainable embedding, ...

Where the engine's tensors are not this process's whole tensors, nothing is shared (silently correct, one log line):
a server (``vllm.server_url``), several trainer processes (FSDP2, DDP), a tensor-parallel engine, sleep mode.
``vllm.share_weights: false`` turns it off.

The engine's parameters outlive the engine object: a view keeps its storage alive after ``VLLMEngine.close``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from nvfp4 import NVFP4Linear
from torch import nn

if TYPE_CHECKING:
    from qerl_vllm.shared_weights import EngineWeights

__all__ = ["SharedWeights", "share_engine_weights", "share_weights_with", "unique_storage_bytes"]

logger = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."
_PACKED = ("weight_packed", "weight_scale", "weight_global_scale")
_LAYOUT = {True: "MMA layout", False: "compressed-tensors layout"}
#: bytes a packed / scale view must be aligned to: the Hopper kernels load them through TMA descriptors (a member's
#: rows start at a multiple of 64 rows in the MMA layout, so its views are; an odd-width member in the
#: compressed-tensors layout may not be)
_ALIGNMENT = 16


@dataclass
class SharedWeights:
    """What :func:`share_engine_weights` did.

    Attributes:
        shared: the trainer's tensors that are now views of the engine's (HF names, ``<module>.<tensor>``).
        not_shared: ``{name: why}``: the trainer's frozen tensors that keep their own copy (one entry ``"*"`` when
            nothing was tried: sharing off or not possible).
        bytes_freed: bytes of the trainer's own copies that were dropped.
    """

    shared: list[str] = field(default_factory=list)
    not_shared: dict[str, str] = field(default_factory=dict)
    bytes_freed: int = 0

    def summary(self) -> str:
        """One line: how much is shared, then what is not, grouped by reason (with an example name each)."""
        linears = sum(n.endswith(".weight_packed") for n in self.shared)
        dense = [n for n in self.shared if not n.endswith(_PACKED)]
        head = (
            f"vLLM weight sharing: {len(self.shared)} trainer tensors are views of the engine's ({linears} NVFP4 "
            f"linears{', ' + ', '.join(dense) if dense else ''}), {self.bytes_freed / 1e9:.3f} GB of the trainer's "
            "copies freed"
        )
        if not self.not_shared:
            return head
        by_reason: dict[str, list[str]] = defaultdict(list)
        for name, why in self.not_shared.items():
            by_reason[why].append(name)
        kept = "; ".join(f"{len(names)} x {why} (e.g. {names[0]})" for why, names in by_reason.items())
        return f"{head}; not shared (the trainer keeps its copy): {kept}"


def _hf_name(name: str) -> str:
    """The HF module / parameter name behind a (PEFT-wrapped) trainer name."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer", "")


def _why_differs(mine: torch.Tensor, engine: torch.Tensor) -> str | None:
    """None when ``engine`` can stand for ``mine`` (same dtype, shape, device, bits), else why not."""
    if mine.dtype != engine.dtype:
        return f"dtype {mine.dtype} here, {engine.dtype} in the engine"
    if mine.shape != engine.shape:
        return f"shape (layout) {tuple(mine.shape)} here, {tuple(engine.shape)} in the engine"
    if mine.device != engine.device:
        return f"device {mine.device} here, {engine.device} in the engine"
    if not torch.equal(mine, engine):  # reads both once; a host sync, at share time only
        return "values differ from the engine's"
    return None


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def unique_storage_bytes(*modules: nn.Module) -> int:
    """Bytes of the distinct storages behind every parameter and buffer of ``modules`` (what they hold together:
    a tensor viewing another's storage adds nothing)."""
    return _storage_bytes([t for m in modules for t in (*m.parameters(), *m.buffers()) if t is not None])


@torch.no_grad()
def share_weights_with(model: nn.Module, engine: EngineWeights) -> SharedWeights:
    """Make ``model``'s frozen tensors views of ``engine``'s where they are bit-identical (module docstring).

    Args:
        model: the trainer's policy (a ``PeftModel`` or a plain transformers model, unwrapped, not sharded).
        engine: the engine's tensors (:meth:`qerl_vllm.engine.VLLMEngine.shareable_weights`), in this process.

    Returns:
        :class:`SharedWeights`: what is shared, what is not and why, the bytes freed.
    """
    report = SharedWeights()
    dropped: list[torch.Tensor] = []
    for name, layer in model.named_modules():
        if not isinstance(layer, NVFP4Linear):
            continue
        hf = _hf_name(name)
        views = engine.linears.get(hf)
        if views is None or layer.fsdp_shardable:
            why = (
                "sharded by FSDP2"
                if layer.fsdp_shardable
                else engine.not_offered.get(hf, "the engine has no such linear")
            )
            report.not_shared.update({f"{hf}.{t}": why for t in _PACKED})
            continue
        for tensor_name in _PACKED:
            mine, theirs = getattr(layer, tensor_name), getattr(views, tensor_name)
            why = "not a buffer here" if tensor_name not in layer._buffers else _why_differs(mine, theirs)
            if why is None and tensor_name != "weight_global_scale" and theirs.data_ptr() % _ALIGNMENT:
                why = f"not {_ALIGNMENT}-byte aligned in the engine (the Hopper kernels' TMA loads need it)"
            if why is not None and tensor_name == "weight_packed" and layer.mma_layout != views.mma_layout:
                why = f"layout: {_LAYOUT[layer.mma_layout]} here, {_LAYOUT[views.mma_layout]} in the engine"
            if why is None:
                setattr(layer, tensor_name, theirs)
                dropped.append(mine)
                report.shared.append(f"{hf}.{tensor_name}")
            else:
                report.not_shared[f"{hf}.{tensor_name}"] = why
    for name, param in model.named_parameters():  # tied weights are listed once
        hf = _hf_name(name)
        theirs = engine.dense.get(hf)
        if theirs is None:
            continue
        why = "trainable here" if param.requires_grad else _why_differs(param, theirs)
        if why is None:
            dropped.append(param.data)
            param.data = theirs  # the same Parameter object (ties, PEFT, the optimizer keep it), the engine's storage
            report.shared.append(hf)
        else:
            report.not_shared[hf] = why
    report.bytes_freed = _storage_bytes(dropped)
    del dropped
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the dropped copies go back to the driver, whatever sizes training allocates
    return report


def share_engine_weights(trainer: Any, engine: Any, enabled: bool = True) -> SharedWeights:
    """The colocated engine's hook: after ``engine`` (a :class:`qerl_vllm.engine.VLLMEngine`) has started, make the
    frozen weights of ``trainer``'s policy views of the engine's (:func:`share_weights_with`) where the engine is
    this process's and whole; log one line saying what was shared and what was not (and why).

    Args:
        trainer: the ``QeRLGRPOTrainer`` (its ``accelerator`` and ``model``).
        engine: the colocated engine, started.
        enabled: ``vllm.share_weights``.
    """
    from qerl_vllm.engine import WeightsNotShareable

    acc = trainer.accelerator
    why = None
    if not enabled:
        why = "vllm.share_weights is off"
    elif int(acc.num_processes) > 1:
        why = f"{acc.num_processes} trainer processes (each rank's tensors are its own, or FSDP2 shards)"
    if why is None:
        try:
            report = share_weights_with(acc.unwrap_model(trainer.model), engine.shareable_weights())
        except WeightsNotShareable as e:
            why = str(e)
    if why is not None:
        report = SharedWeights(not_shared={"*": why})
        logger.info("vLLM weight sharing: nothing shared (the trainer keeps its copies): %s", why)
        return report
    (logger.warning if report.not_shared else logger.info)("%s", report.summary())
    return report
