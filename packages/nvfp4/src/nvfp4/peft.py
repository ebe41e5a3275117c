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
    "AdapterMismatchError",
    "LoraNVFP4Linear",
    "check_adapter_fits",
    "get_peft_model",
    "load_adapter",
    "merge_and_unload",
    "register_nvfp4_lora",
    "write_adapter",
]


# Set NVFP4_DISABLE_FUSED_LORA=1 to run adapters as PEFT does even where a fused path applies (benchmarks, tests).
FUSED_LORA = os.environ.get("NVFP4_DISABLE_FUSED_LORA") != "1"


#: PEFT's ``init_lora_weights`` values (prefixes) whose initialisation reads ``base_layer.weight`` as the dense matrix
#: (PiSSA, CorDA, OLoRA, MiCA and LoftQ read, the first three rewrite it too; orthogonal takes its dtype): here the
#: packed uint8 codes
_DENSE_WEIGHT_INITS = ("pissa", "corda", "olora", "mica", "loftq", "orthogonal")


class LoraNVFP4Linear(_LoraLinear):
    """LoRA layer whose base is an :class:`NVFP4Linear` (frozen, 4-bit); the adapters are ordinary float ``nn.Linear``.

    Forward: PEFT's (base, then ``scale · B(A(dropout(x)))``), except with one plain LoRA adapter active (no dropout,
    DoRA or adapter bias) and

    * no gradient needed, on CUDA (generation): base and adapter run as one kernel (``nvfp4.ops.lora_linear``), which
      saves the four small kernels per layer that dominate a decode step's adapter cost. The adapter's product is
      then computed in the activation dtype (PEFT computes it in the adapter's dtype);
    * the base's ``dequant(W)`` cached for the input (:func:`nvfp4.cache_dequantized`, the CPU path; adapter and
      input of one dtype), training or not: :class:`_CachedLoraLinear` adds the adapter into the base's output in
      place (one output tensor instead of PEFT's four: ``B(A(x))``, its scaled copy and the sum), with a backward
      of the same sums in the same memory.

    Inside :func:`nvfp4.fp8_model.fp8_rollouts`, where the base computes with its FP8 copy, PEFT's path runs (the base's
    forward, then the adapter in its own dtype).
    """

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._plain_adapter(x, args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        bias = base.bias.to(x.dtype) if base.bias is not None else None
        lora_a, lora_b, scaling = self.lora_A[adapter].weight, self.lora_B[adapter].weight, self.scaling[adapter]
        if base.has_cached_weight(x):
            return _CachedLoraLinear.apply(x, base, bias, lora_a, lora_b, scaling)
        return ops.lora_linear(
            x, base.weight_packed, base.weight_scale, base.weight_global_scale, bias, lora_a, lora_b, scaling
        )

    def _plain_adapter(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
        """The one active plain adapter if this layer's forward can run fused (see the class docstring), else None."""
        if not FUSED_LORA or args or kwargs or self.disable_adapters or self.merged or self.fan_in_fan_out:
            return None
        base = self.get_base_layer()
        if not isinstance(base, NVFP4Linear) or base.fsdp_shardable:
            return None  # sharded by FSDP2: the base's own forward gathers its weight (nvfp4.fsdp)
        if base.fp8_applies(x):
            return None  # FP8 rollouts (nvfp4.fp8_model): the base's forward on its E4M3 copy, PEFT's adapter on top
        if base.has_cached_weight(x):
            fusable = all(self.lora_A[a].weight.dtype == x.dtype for a in self.active_adapters if a in self.lora_A)
        else:  # the fused inference kernel
            fusable = x.is_cuda and not torch.is_grad_enabled() and base.uses_nvfp4_ops
        if not fusable:
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

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs: Any) -> Any:
        # PEFT's DoRA reads base_layer.weight as the dense matrix: here the packed uint8 codes (a shape error deep in
        # PEFT when the adapter is attached)
        base = self.get_base_layer()
        if getattr(config, "use_dora", False) and isinstance(base, NVFP4Linear):
            raise ValueError(f"LoraConfig(use_dora=True): DoRA is not supported on 4-bit layers ({base._label()}); "
                             "use plain LoRA (use_dora=False)")  # fmt: skip
        # (called by PEFT's update_layer before the adapter weights are initialised)
        init = getattr(config, "init_lora_weights", True)
        if isinstance(base, NVFP4Linear) and isinstance(init, str) and init.lower().startswith(_DENSE_WEIGHT_INITS):
            raise ValueError(f"LoraConfig(init_lora_weights={init!r}) works on the base layer's dense weight (its "
                             f"values, or its dtype), which is 4-bit here ({base._label()}); initialise it on the dense "
                             "model, or use init_lora_weights=True or 'gaussian'")  # fmt: skip
        return super().resolve_lora_variant(config=config, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        base = self.get_base_layer()
        swapped = isinstance(base, NVFP4Linear)
        if swapped:
            self._nvfp4_base = base
            self.base_layer = base.to_dense()
        try:
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        finally:
            if swapped and not self.merged:  # nothing merged (refused, or no adapter named): the 4-bit base back
                self.base_layer = base
                self._nvfp4_base = None

    def unmerge(self) -> None:
        super().unmerge()
        if getattr(self, "_nvfp4_base", None) is not None and not self.merged:
            self.base_layer = self._nvfp4_base
            self._nvfp4_base = None

    def __repr__(self) -> str:
        # PEFT's is "lora." + this class's name ("LoraNVFP4Linear"); PEFT's 4-bit layers print as "lora.Linear4bit"
        return "lora.NVFP4Linear" + super().__repr__().removeprefix(f"lora.{type(self).__name__}")


class _CachedLoraLinear(torch.autograd.Function):
    """``y = x · dequant(W)ᵀ + bias + scaling · (x · Aᵀ) · Bᵀ`` with ``dequant(W)`` from the base's cache: the adapter
    term is added into the base's output by one in-place GEMM (``addmm_``), and the backward computes PEFT's
    gradients the same way — ``dx = g · W + scaling · (g · B) · A``, ``dA = scaling · (g · B)ᵀ · x``,
    ``dB = scaling · gᵀ · (x · Aᵀ)`` — saving ``x`` and ``x · Aᵀ`` as PEFT's linears do. Shapes: ``x`` ``[..., in]``,
    A ``[r, in]``, B ``[out, r]``, all one float dtype. The same sums as PEFT's path: the forward bit for bit when
    ``scaling`` is 1 (α = r, the default), the gradients to rounding (added in another order)."""

    @staticmethod
    def forward(ctx, x, base: NVFP4Linear, bias, lora_a, lora_b, scaling: float):
        y = torch.nn.functional.linear(x, base.cached_weight(x), bias)
        a = torch.nn.functional.linear(x, lora_a)
        y.view(-1, y.shape[-1]).addmm_(a.view(-1, a.shape[-1]), lora_b.t(), alpha=scaling)
        ctx.base, ctx.scaling = base, scaling
        ctx.save_for_backward(x, a, lora_a, lora_b)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, a, lora_a, lora_b = ctx.saved_tensors
        scaling = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1])
        grad_a = g.mm(lora_b)  # [N, r], before scaling
        grad_x = grad_bias = grad_lora_a = grad_lora_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g.mm(ctx.base.cached_weight(g)).addmm_(grad_a, lora_a, alpha=scaling).view(x.shape)
        if ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        if ctx.needs_input_grad[3]:
            grad_lora_a = grad_a.t().mm(x.reshape(-1, x.shape[-1])).mul_(scaling)
        if ctx.needs_input_grad[4]:
            grad_lora_b = g.t().mm(a.reshape(-1, a.shape[-1])).mul_(scaling)
        return grad_x, None, grad_bias, grad_lora_a, grad_lora_b, None


def register_nvfp4_lora(config: LoraConfig) -> LoraConfig:
    """Map ``NVFP4Linear`` to :class:`LoraNVFP4Linear` in ``config`` (PEFT's custom-module hook); returns ``config``."""
    config._register_custom_module({NVFP4Linear: LoraNVFP4Linear})
    return config


def get_peft_model(model: nn.Module, config: LoraConfig, **kwargs: Any) -> PeftModel:
    """``peft.get_peft_model`` with NVFP4 layers wrapped by :class:`LoraNVFP4Linear`; only LoRA weights train."""
    return _peft_get_peft_model(model, register_nvfp4_lora(config), **kwargs)


class AdapterMismatchError(ValueError):
    """A LoRA adapter that does not fit a model (another base model, or another rank than the run's); one line naming
    the adapter's base model and rank against the model's."""


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name → shape, from a safetensors file's header alone."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def check_adapter_fits(model: nn.Module, path: str | os.PathLike, lora_r: int | None = None) -> None:
    """Raise :class:`AdapterMismatchError` unless the adapter in ``path`` fits ``model`` (a base model or a
    ``PeftModel``): every ``lora_A`` / ``lora_B`` weight names a module of ``model`` with the matching input / output
    size, and, with ``lora_r``, the adapter's rank is ``lora_r``. Reads the adapter's config and safetensors header
    only; an adapter in another format is not checked."""
    folder = Path(path)
    config = json.loads((folder / "adapter_config.json").read_text())
    rank, base = config.get("r"), config.get("base_model_name_or_path")
    root = model.get_base_model() if isinstance(model, PeftModel) else model
    name = getattr(getattr(root, "config", None), "name_or_path", None) or type(root).__name__
    adapter = f"adapter {str(folder)!r} (LoRA rank {rank}, trained on {base!r})"
    if lora_r is not None and rank != lora_r:
        raise AdapterMismatchError(f"{adapter} does not fit this run's model {name!r} with lora_r {lora_r}: pass "
                                   f"--lora_r {rank} to use it, or another adapter")  # fmt: skip
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        return
    modules = dict(root.named_modules())
    for key, shape in _safetensors_shapes(weights).items():
        kind = "lora_A" if ".lora_A." in key else "lora_B" if ".lora_B." in key else None
        if kind is None or len(shape) != 2:
            continue
        module_name = key.split(f".{kind}.")[0].removeprefix("base_model.model.")
        module = modules.get(module_name)
        if module is None:
            raise AdapterMismatchError(f"{adapter} does not fit the model {name!r}: it has no module {module_name}")
        adapter_rank = shape[0] if kind == "lora_A" else shape[1]
        if isinstance(rank, int) and not config.get("rank_pattern") and adapter_rank != rank:
            raise AdapterMismatchError(f"{adapter}: its {module_name} {kind} has rank {adapter_rank}, not the "
                                       f"config's {rank} (adapter_config.json does not belong to these weights)")  # fmt: skip
        base_layer = getattr(module, "base_layer", module)
        want = getattr(base_layer, "in_features" if kind == "lora_A" else "out_features", None)
        have = shape[1] if kind == "lora_A" else shape[0]
        if want is not None and have != want:
            side = "inputs" if kind == "lora_A" else "outputs"
            raise AdapterMismatchError(f"{adapter} does not fit the model {name!r}: its {module_name} has {have} "
                                       f"{side}, the model's {want}")  # fmt: skip


def load_adapter(model: nn.Module, path: str, **kwargs: Any) -> PeftModel:
    """``PeftModel.from_pretrained`` for an NVFP4 base (the saved config is re-registered for NVFP4 layers); ``path``
    a local folder or a Hub id, ``kwargs`` PEFT's (``subfolder``, ``revision``, ``is_trainable``, ...). A local
    adapter of another model stops with :class:`AdapterMismatchError` (:func:`check_adapter_fits`) instead of PEFT's
    hundreds of size-mismatch lines."""
    folder = Path(path, kwargs.get("subfolder") or "")
    if folder.is_dir():  # a Hub id is PEFT's to download (and to check)
        check_adapter_fits(model, folder)
    # the keywords PEFT itself reads the config with (PeftModel.from_pretrained's hf_kwargs)
    hub = {k: kwargs[k] for k in ("subfolder", "revision", "cache_dir", "token") if kwargs.get(k) is not None}
    config = LoraConfig.from_pretrained(path, **hub)
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

    ``state``: PEFT key names (``get_peft_model_state_dict``) or a raw ``state_dict()`` of the ``PeftModel`` (its
    ``.default.`` keys are the adapter's, written under PEFT's names; the base model's tensors are left out);
    ``peft_config``: a ``LoraConfig`` or its dict. Engines (vLLM) load the folder as a LoRA adapter. Returns ``folder``.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # a raw model.state_dict() carries PEFT's adapter name in the adapter's keys, beside every tensor of the base
    # model (embeddings, norms, the 4-bit base layers): only the adapter's are written, under PEFT's names
    raw = any(".default." in k for k in state)
    tensors = {}
    for k, v in state.items():
        if raw and ".default." not in k:
            continue
        k = k.replace(".modules_to_save.default.", ".").replace(".default.weight", ".weight")
        tensors[k] = v.detach().to("cpu").contiguous()
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(_config_dict(peft_config), indent=1, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
