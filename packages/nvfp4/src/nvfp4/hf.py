"""transformers integration: ``NVFP4Config`` and its ``HfQuantizer``, registered as ``quant_method="nvfp4_w4a16"``.

transformers ≥5.2x already owns ``"nvfp4"`` (a Blackwell-only W4A4 path), hence our own name.

* ``from_pretrained(bf16_path, quantization_config=NVFP4Config())`` quantizes on load: each linear weight is
  quantized as soon as it (and the other members of its fused q/k/v or gate/up group, which share one global scale)
  has been read, so the target device never holds more than one group in full precision. The arithmetic runs in the
  dtype the weight has *in the checkpoint* (a bf16 checkpoint loaded with ``dtype=torch.float32`` is quantized in
  bf16), so RTN gives the bytes llm-compressor's ``NVFP4A16`` gives for that checkpoint whatever the load dtype.
* ``save_pretrained`` / ``push_to_hub`` write the compressed-tensors tensors (``weight_packed``, ``weight_scale``,
  ``weight_global_scale``) plus this config, and a model card (:mod:`nvfp4.card`) when asked.
* ``from_pretrained(nvfp4_path)`` reloads after ``import nvfp4``.
* :func:`from_compressed_tensors` loads an llm-compressor ``NVFP4A16`` checkpoint (same tensors) into ``NVFP4Linear``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .codec import BLOCK_SIZE, quantize, shared_global_scale
from .linear import (
    DEFAULT_FUSED_GROUPS,
    DEFAULT_MODULES_TO_NOT_CONVERT,
    NVFP4Linear,
    _quantizable,
    fused_group_of,
)

__all__ = ["QUANT_METHOD", "NVFP4CheckpointError", "NVFP4Config", "NVFP4HfQuantizer", "from_compressed_tensors"]

QUANT_METHOD = "nvfp4_w4a16"
FORMAT = "nvfp4-pack-quantized"


class NVFP4CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unreadable/truncated safetensors, or tensors that disagree with the config."""


@register_quantization_config(QUANT_METHOD)
class NVFP4Config(QuantizationConfigMixin):
    """Weight-only NVFP4 (E2M1 values, FP8-E4M3 scale per 16 inputs, FP32 scale per tensor) for ``from_pretrained``.

    Args:
        method: calibration at load time: ``"rtn"`` (round to nearest, llm-compressor ``NVFP4A16`` byte-identical) or ``"mse"``
            (per-block scale search). The activation-aware ``"awq"`` needs data: use :func:`nvfp4.quantize_model`.
        modules_to_not_convert: names / suffixes / regexes kept in full precision (default ``["lm_head"]``;
            embeddings are never converted).
        fused_groups: sibling linears that share one global scale (engines fuse them).
        format: tensor layout, always ``"nvfp4-pack-quantized"``.
    """

    def __init__(
        self,
        method: str = "rtn",
        modules_to_not_convert: list[str] | None = None,
        fused_groups: list[list[str]] | None = None,
        format: str = FORMAT,
        **kwargs: Any,
    ) -> None:
        self.quant_method = QUANT_METHOD
        if method not in ("rtn", "mse"):
            raise ValueError(
                f"NVFP4Config(method={method!r}): on-load calibration supports 'rtn' and 'mse'; "
                "activation-aware 'awq' needs calibration batches, see nvfp4.quantize_model"
            )
        if format != FORMAT:
            raise ValueError(f"NVFP4Config(format={format!r}): only {FORMAT!r} is supported")
        self.method = method
        self.modules_to_not_convert = (
            list(modules_to_not_convert) if modules_to_not_convert is not None else list(DEFAULT_MODULES_TO_NOT_CONVERT)
        )
        self.fused_groups = [list(g) for g in (fused_groups or DEFAULT_FUSED_GROUPS)]
        self.format = format
        self.weight_block_size = BLOCK_SIZE
        self.extra = {k: v for k, v in kwargs.items() if k not in ("quant_method", "weight_block_size")}

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": QUANT_METHOD,
            "format": self.format,
            "method": self.method,
            "weight_block_size": BLOCK_SIZE,
            "modules_to_not_convert": self.modules_to_not_convert,
            "fused_groups": self.fused_groups,
            **self.extra,
        }


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _mark_initialized(module: nn.Module) -> None:
    # transformers re-initialises tensors without this flag after loading (and nn.Linear gets normal_ init).
    module._is_hf_initialized = True
    for t in list(module.buffers()) + list(module.parameters()):
        t._is_hf_initialized = True


def check_safetensors_files(files: list[str] | None) -> None:
    """Raise :class:`NVFP4CheckpointError` if a safetensors file is unreadable or shorter than its header says."""
    for f in files or []:
        if not str(f).endswith(".safetensors"):
            continue
        size = os.path.getsize(f)
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if n <= 0 or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit in a {size}-byte file")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise NVFP4CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        if 8 + n + end > size:
            raise NVFP4CheckpointError(
                f"{f}: truncated safetensors file: tensors need {8 + n + end} bytes, the file has {size}"
            )


_SAFETENSORS_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def _safetensors_float_dtypes(files: list[str] | None) -> dict[str, torch.dtype]:
    """Floating dtype of every tensor in the safetensors ``files``, read from their headers (no tensor is loaded)."""
    dtypes: dict[str, torch.dtype] = {}
    for f in files or []:
        if not str(f).endswith(".safetensors"):
            continue
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for key, info in header.items():
            if key != "__metadata__" and info.get("dtype") in _SAFETENSORS_FLOAT_DTYPES:
                dtypes[key] = _SAFETENSORS_FLOAT_DTYPES[info["dtype"]]
    return dtypes


@register_quantizer(QUANT_METHOD)
class NVFP4HfQuantizer(HfQuantizer):
    """Quantize on load (bf16 checkpoint + :class:`NVFP4Config`) or load our NVFP4 checkpoints."""

    requires_calibration = False

    def __init__(self, quantization_config: NVFP4Config, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._pending: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        self._targets: set[str] = set()
        self._stored_dtypes: dict[str, torch.dtype] = {}  # checkpoint key -> dtype of that tensor in the file

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        return torch.bfloat16 if dtype is None else dtype

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        if self.param_needs_quantization(model, param_name):
            return 0.5 + 1 / BLOCK_SIZE  # packed nibbles + one FP8 scale per 16
        return super().param_element_size(model, param_name, param)

    def param_needs_quantization(self, model, param_name: str, **kwargs: Any) -> bool:
        if self.pre_quantized:
            return False
        module_name, _, tensor = param_name.rpartition(".")
        return tensor == "weight" and module_name in self._targets

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs: Any):
        check_safetensors_files(checkpoint_files)
        cfg = self.quantization_config
        eligible = [n for n, m in model.named_modules() if _quantizable(n, m, cfg.modules_to_not_convert)]
        if self.pre_quantized:
            for name in eligible:
                lin = model.get_submodule(name)
                new = NVFP4Linear(
                    lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype, device="meta"
                )
                _replace(model, name, new)
            if checkpoint_files:
                self._check_prequantized_tensors(model, checkpoint_files)
        else:
            self._targets = set(eligible)
            self._stored_dtypes = _safetensors_float_dtypes(checkpoint_files)
            self._prefix = getattr(model, "base_model_prefix", "")
        return model

    def _quantization_input(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """``w`` back in its checkpoint dtype when the loader widened it (exact), so RTN sees the stored values in the
        dtype llm-compressor would quantize them in; otherwise ``w`` itself."""
        key = f"{name}.weight"
        prefix = getattr(self, "_prefix", "")
        stored = self._stored_dtypes.get(key)
        if stored is None and prefix:
            alt = key[len(prefix) + 1 :] if key.startswith(prefix + ".") else f"{prefix}.{key}"
            stored = self._stored_dtypes.get(alt)
        if stored is not None and stored.itemsize < w.dtype.itemsize:
            return w.to(stored)
        return w

    def _check_prequantized_tensors(self, model, files: list[str]) -> None:
        from safetensors import safe_open

        names = set()
        for f in files:
            if str(f).endswith(".safetensors"):
                with safe_open(f, "pt") as fh:
                    names |= set(fh.keys())
        prefix = getattr(model, "base_model_prefix", "")
        missing = []
        for name, mod in model.named_modules():
            if isinstance(mod, NVFP4Linear):
                key = f"{name}.weight_packed"
                alt = key[len(prefix) + 1 :] if prefix and key.startswith(prefix + ".") else f"{prefix}.{key}"
                if key not in names and alt not in names:
                    missing.append(key)
        if missing:
            raise NVFP4CheckpointError(
                f"the checkpoint's quantization_config ({QUANT_METHOD}) says {len(missing)} linear layer(s) are NVFP4, "
                f"but their tensors are absent, e.g. {missing[:3]}; the config disagrees with the tensors"
            )

    def get_quantize_ops(self):
        return _QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        for _group, got in list(self._pending.items()):  # a group whose other members were never loaded
            self._flush(model, tuple(got), got, None)
        self._pending.clear()
        bad = [
            n
            for n, m in model.named_modules()
            if isinstance(m, NVFP4Linear) and any(t.is_meta for t in m.buffers())
        ]
        if bad:
            raise NVFP4CheckpointError(f"NVFP4 tensors were not loaded for {len(bad)} layer(s), e.g. {bad[:3]}")
        for m in model.modules():
            if isinstance(m, NVFP4Linear):
                m.use_kernel_layout()  # pre-quantized tensors arrive in the checkpoint layout
        return model

    def _flush(self, model, group: tuple[str, ...], weights: dict[str, torch.Tensor], missing_keys) -> None:
        """Quantize a complete fused group with one shared global scale and swap its ``nn.Linear``s for ours."""
        cfg = self.quantization_config
        g = shared_global_scale(weights.values())
        for name, w in weights.items():
            old = model.get_submodule(name)
            dtype = old.weight.dtype  # the load dtype; `w` may be in the narrower checkpoint dtype
            q = quantize(w, global_scale=g, method=cfg.method, name=f"{name}.weight")
            bias = old.bias.detach().to(w.device) if old.bias is not None and not old.bias.is_meta else None
            new = NVFP4Linear.from_weight(q, bias, dtype)
            if old.bias is not None and bias is None:  # bias not read yet: keep a slot for the loader
                new.bias = nn.Parameter(torch.empty(old.out_features, dtype=dtype, device="meta"), False)
            _mark_initialized(new)
            _replace(model, name, new)
            if missing_keys is not None:
                missing_keys.discard(f"{name}.weight")
            self._targets.discard(name)

    def is_serializable(self, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # LoRA adapters train through NVFP4Linear

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return False


class _QuantizeOnLoad(ConversionOps):
    """transformers ``ConversionOps``: collects a fused group's bf16 weights, then quantizes them together."""

    def __init__(self, quantizer: NVFP4HfQuantizer) -> None:
        self.q = quantizer

    def convert(self, input_dict: dict[str, Any], model=None, full_layer_name: str | None = None, missing_keys=None, **_):
        for key, value in input_dict.items():
            w = value[0] if isinstance(value, list) else value
            name = key.rpartition(".")[0]
            # members stay in `_targets` until their group is flushed, so this is the group still to be collected
            full = fused_group_of(name, self.q.quantization_config.fused_groups) or (name,)
            group = tuple(n for n in full if n in self.q._targets)
            got = self.q._pending.setdefault(group, {})
            got[name] = self.q._quantization_input(name, w)
            if all(n in got for n in group):
                del self.q._pending[group]
                self.q._flush(model, group, got, missing_keys)
        return {}


def from_compressed_tensors(path: str | Path, **kwargs: Any) -> nn.Module:
    """Load an llm-compressor / compressed-tensors ``NVFP4A16`` checkpoint (``nvfp4-pack-quantized``) into NVFP4Linear.

    The tensors are the same as ours; only the config differs (``quant_method="compressed-tensors"`` with
    ``config_groups``). Modules listed in the checkpoint's ``ignore`` stay dense. Other ``kwargs`` go to
    ``AutoModelForCausalLM.from_pretrained``.
    """
    config = AutoConfig.from_pretrained(path)
    qc = getattr(config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) else (qc.to_dict() if qc is not None else None)
    if not qc or qc.get("quant_method") != "compressed-tensors" or qc.get("format") != FORMAT:
        raise NVFP4CheckpointError(
            f"{path}: not a compressed-tensors {FORMAT} checkpoint (quantization_config={qc!r})"
        )
    for group in qc.get("config_groups", {}).values():
        w = group.get("weights") or {}
        if w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != BLOCK_SIZE:
            raise NVFP4CheckpointError(f"{path}: config group {group!r} is not NVFP4 weight-only (fp4, group 16)")
    ignore = [p[3:] if p.startswith("re:") else p for p in qc.get("ignore", [])]
    config.quantization_config = NVFP4Config(modules_to_not_convert=ignore or ["lm_head"]).to_dict()
    return AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
