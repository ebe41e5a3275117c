"""PEFT LoRA on top of :class:`~nvfp4.NVFP4Linear`, in the way PEFT's own ``tuners/lora/bnb.py`` wraps 4-bit layers.

The frozen 4-bit base computes ``x · dequant(W)ᵀ``; the bf16/fp32 adapter adds ``scale · B(A(dropout(x)))``. The adapter
is never merged into the 4-bit weights (that would re-quantize it away): :meth:`LoraNVFP4Linear.merge` swaps the base
for a dense ``nn.Linear`` holding ``dequant(W) + ΔW``, so ``merge_and_unload`` exports a plain full-precision model.

Registration goes through PEFT's public custom-module hook (``LoraConfig._register_custom_module``):

>>> from peft import LoraConfig
>>> from nvfp4.peft import get_peft_model
>>> model = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, target_modules="all-linear"))

Plain ``peft.get_peft_model`` also trains correctly (``NVFP4Linear`` is an ``nn.Linear``), but its merge would try to
add a float delta to packed uint8 and fails loudly; use this module's helpers to merge or export.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import ops
from .extras import missing_extra
from .linear import NVFP4Linear

try:
    from peft import LoraConfig, PeftModel
    from peft import get_peft_model as _peft_get_peft_model
    from peft.tuners.lora.layer import Linear as _LoraLinear
except ImportError as err:  # the extra is not installed
    raise missing_extra(err, "peft", "nvfp4.peft", "PEFT", "nvfp4[peft]") from err

__all__ = [
    "LoraNVFP4Linear",
    "get_peft_model",
    "load_adapter",
    "merge_and_unload",
    "register_nvfp4_lora",
    "write_adapter",
]


# Set NVFP4_DISABLE_FUSED_LORA=1 to run adapters as PEFT does even where the fused kernel applies (benchmarks).
FUSED_LORA = os.environ.get("NVFP4_DISABLE_FUSED_LORA") != "1"


class LoraNVFP4Linear(_LoraLinear):
    """LoRA layer whose base is an :class:`NVFP4Linear` (frozen, 4-bit); the adapters are ordinary float ``nn.Linear``.

    Forward: PEFT's (base, then ``scale · B(A(dropout(x)))``), except when no gradient is needed on CUDA with one
    plain LoRA adapter active (generation): then base and adapter run as one kernel (``nvfp4.ops.lora_linear``),
    which saves the four small kernels per layer that dominate a decode step's adapter cost. The adapter's product
    is then computed in the activation dtype (PEFT computes it in the adapter's dtype); training always takes
    PEFT's path.
    """

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._fusable_adapter(x, args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        bias = base.bias.to(x.dtype) if base.bias is not None else None
        return ops.lora_linear(
            x,
            base.weight_packed,
            base.weight_scale,
            base.weight_global_scale,
            bias,
            self.lora_A[adapter].weight,
            self.lora_B[adapter].weight,
            self.scaling[adapter],
        )

    def _fusable_adapter(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
        """The one active adapter if the fused inference kernel computes exactly this layer's forward, else None."""
        if not FUSED_LORA or args or kwargs or not x.is_cuda or torch.is_grad_enabled():
            return None
        if self.disable_adapters or self.merged or self.fan_in_fan_out:
            return None
        base = self.get_base_layer()
        cached = isinstance(base, NVFP4Linear) and (base._dense_cache is not None or base._codes_cache is not None)
        if not isinstance(base, NVFP4Linear) or cached or not base.uses_nvfp4_ops:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1:
            return None
        name = active[0]
        if name in self.lora_variant or self.lora_bias.get(name, False):
            return None  # DoRA and other variants, adapter bias: PEFT's path
        dropout = self.lora_dropout[name]
        if not isinstance(dropout, nn.Identity) and dropout.training and getattr(dropout, "p", 0.0) > 0:
            return None
        return name

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        base = self.get_base_layer()
        if isinstance(base, NVFP4Linear):
            self._nvfp4_base = base
            self.base_layer = base.to_dense()
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def unmerge(self) -> None:
        super().unmerge()
        if getattr(self, "_nvfp4_base", None) is not None and not self.merged:
            self.base_layer = self._nvfp4_base
            self._nvfp4_base = None

    def __repr__(self) -> str:
        return "lora.NVFP4" + super().__repr__()[len("lora.") :]


def register_nvfp4_lora(config: LoraConfig) -> LoraConfig:
    """Map ``NVFP4Linear`` to :class:`LoraNVFP4Linear` in ``config`` (PEFT's custom-module hook); returns ``config``."""
    config._register_custom_module({NVFP4Linear: LoraNVFP4Linear})
    return config


def get_peft_model(model: nn.Module, config: LoraConfig, **kwargs: Any) -> PeftModel:
    """``peft.get_peft_model`` with NVFP4 layers wrapped by :class:`LoraNVFP4Linear`; only LoRA weights train."""
    return _peft_get_peft_model(model, register_nvfp4_lora(config), **kwargs)


def load_adapter(model: nn.Module, path: str, **kwargs: Any) -> PeftModel:
    """``PeftModel.from_pretrained`` for an NVFP4 base (the saved config is re-registered for NVFP4 layers)."""
    config = LoraConfig.from_pretrained(path)
    return PeftModel.from_pretrained(model, path, config=register_nvfp4_lora(config), **kwargs)


def merge_and_unload(model: PeftModel) -> nn.Module:
    """Merge the adapters into dequantized weights and return a plain full-precision model (for export).

    Every ``NVFP4Linear`` that carried an adapter becomes ``nn.Linear(dequant(W) + ΔW)``; layers without an adapter
    are dequantized too, and the quantization config is removed, so ``save_pretrained`` writes an ordinary checkpoint.
    """
    merged = model.merge_and_unload()
    for name, mod in list(merged.named_modules()):
        if isinstance(mod, NVFP4Linear):
            parent, _, child = name.rpartition(".")
            setattr(merged.get_submodule(parent) if parent else merged, child, mod.to_dense())
    config = getattr(merged, "config", None)
    if config is not None and getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    for attr in ("hf_quantizer", "is_quantized", "quantization_method"):
        if hasattr(merged, attr):
            try:
                delattr(merged, attr)
            except AttributeError:
                setattr(merged, attr, None)
    return merged


def _config_dict(peft_config: Any) -> dict[str, Any]:
    if isinstance(peft_config, Mapping):
        d = dict(peft_config)
    elif hasattr(peft_config, "to_dict"):
        d = peft_config.to_dict()
    else:
        raise TypeError(f"peft_config: expected a LoraConfig or dict, got {type(peft_config).__name__}")
    out = {}
    for k, v in d.items():  # JSON-safe (sets → sorted lists, enums → values)
        if isinstance(v, set):
            v = sorted(v)
        elif hasattr(v, "value") and not isinstance(v, (int, float, str)):
            v = v.value
        out[k] = v
    out.setdefault("peft_type", "LORA")
    return out


def write_adapter(folder: str | Path, state: Mapping[str, torch.Tensor], peft_config: Any) -> Path:
    """Write a PEFT adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``) atomically.

    ``state``: PEFT key names (``get_peft_model_state_dict``) or a raw ``state_dict()`` (``.default.weight`` keys);
    ``peft_config``: a ``LoraConfig`` or its dict. Engines (vLLM) load the folder as a LoRA adapter. Returns ``folder``.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    for k, v in state.items():
        k = k.replace(".default.weight", ".weight")  # a raw model.state_dict() carries PEFT's adapter name
        tensors[k] = v.detach().to("cpu").contiguous()
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(_config_dict(peft_config), indent=1, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
