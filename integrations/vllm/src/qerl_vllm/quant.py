"""vLLM quantization config for our NVFP4 checkpoints (``quant_method="nvfp4_w4a16"``, and the compressed-tensors
``NVFP4A16`` config they are saved with by default where stock vLLM has no kernel for it).

Checkpoints saved by ``nvfp4`` carry the compressed-tensors ``quantization_config`` (as llm-compressor writes for
``NVFP4A16``): on CUDA stock vLLM loads them through its own compressed-tensors scheme, and this plugin stays out of
the way. Elsewhere (vLLM's CPU engine) :meth:`QeRLNVFP4Config.override_quantization_method` claims weight-only NVFP4
compressed-tensors checkpoints, which are then loaded as below; checkpoints with the previous ``nvfp4_w4a16`` config
load here on every platform.

Our checkpoints hold compressed-tensors ``nvfp4-pack-quantized`` tensors (``weight_packed`` uint8 ``[out, in/2]``,
``weight_scale`` fp8-e4m3 ``[out, in/16]``, ``weight_global_scale`` fp32 ``[1]``, a divisor) under our own method name.

* CUDA: every quantized linear is delegated to vLLM's native compressed-tensors NVFP4A16 scheme
  (``CompressedTensorsConfig`` built from an equivalent ``config_groups`` dict; Marlin / Humming / CuTe-DSL W4A16
  kernels), so the engine runs the same kernels as for an llm-compressor ``NVFP4A16`` checkpoint.
* elsewhere (CPU, and CUDA with ``QERL_VLLM_NVFP4_BACKEND=dequant``): the packed tensors are loaded as they are, then
  dequantized once after loading with :func:`nvfp4.codec.dequantize` (per fused shard, each with its own global
  scale, so it is bit-identical to ``NVFP4Linear.dequantize``) into a dense ``weight`` handled by vLLM's
  ``UnquantizedLinearMethod`` — vLLM's CPU GEMM and CPU LoRA run on it unchanged.

Registered by :func:`register` (the ``vllm.general_plugins`` entry point ``qerl_nvfp4``), in every vLLM process.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from nvfp4.codec import BLOCK_SIZE, dequantize

from . import vllm_missing

try:
    from vllm.logger import init_logger
    from vllm.model_executor.layers.linear import (
        LinearBase,
        LinearMethodBase,
        UnquantizedLinearMethod,
        register_weight_loader_v2_supported_method,
    )
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
    from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter, PerTensorScaleParameter
    from vllm.platforms import current_platform
except ImportError as err:  # the extra is not installed
    raise vllm_missing(err, "qerl_vllm.quant") from err

logger = init_logger(__name__)

QUANT_METHOD = "nvfp4_w4a16"
FORMAT = "nvfp4-pack-quantized"
BACKEND_ENV = "QERL_VLLM_NVFP4_BACKEND"  # "auto" (default) | "native" | "dequant"

__all__ = ["BACKEND_ENV", "QUANT_METHOD", "NVFP4DequantLinearMethod", "QeRLNVFP4Config"]


def _matches(name: str, patterns: list[str]) -> bool:
    # same rule as nvfp4.linear: exact name, dotted suffix, or regex (an llm-compressor style "re:" prefix is accepted)
    for p in patterns:
        p = p[3:] if p.startswith("re:") else p
        if name == p or name.endswith("." + p) or re.fullmatch(p, name):
            return True
    return False


def _is_compressed_tensors_nvfp4a16(cfg: dict[str, Any]) -> bool:
    """Whether ``cfg`` is a compressed-tensors ``nvfp4-pack-quantized`` config with weight-only fp4 group-16 groups."""
    if cfg.get("quant_method") != "compressed-tensors" or cfg.get("format") != FORMAT:
        return False
    groups = cfg.get("config_groups") or {}
    for group in groups.values():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", BLOCK_SIZE):
            return False
        if group.get("input_activations") or group.get("format", FORMAT) != FORMAT:
            return False
    return bool(groups)


def _quantized_modules_in(path: str) -> set[str] | None:
    """Names of the modules whose ``weight_packed`` is in the local checkpoint ``path`` (None if not a local dir)."""
    p = Path(path)
    if not p.is_dir():
        return None
    names: set[str] = set()
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        names |= {k[: -len(".weight_packed")] for k in header if k.endswith(".weight_packed")}
    return names or None


@register_quantization_config(QUANT_METHOD)
class QeRLNVFP4Config(QuantizationConfig):
    """Weight-only NVFP4 (our ``nvfp4_w4a16`` checkpoints) for vLLM."""

    def __init__(self, modules_to_not_convert: list[str] | None = None, raw: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.modules_to_not_convert = list(
            modules_to_not_convert if modules_to_not_convert is not None else ["lm_head"]
        )
        self.raw = dict(raw or {})
        self.quantized_modules: set[str] | None = None  # from the checkpoint's tensors (maybe_update_config)
        self._native: QuantizationConfig | None = None

    # ------------------------------------------------------------------ QuantizationConfig API
    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75  # vLLM's NVFP4A16 kernels (Marlin) run from Turing on; the CPU path has no requirement

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the config lives in config.json's quantization_config

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        """Claim a weight-only NVFP4 compressed-tensors checkpoint (``nvfp4-pack-quantized``, fp4 group 16, no
        activation quantization) where vLLM's own scheme has no kernel (not CUDA, or ``QERL_VLLM_NVFP4_BACKEND=
        dequant``), unless the user asked for another method; on CUDA stock vLLM's compressed-tensors path runs."""
        if user_quant not in (None, QUANT_METHOD) or not _is_compressed_tensors_nvfp4a16(hf_quant_cfg):
            return None
        if user_quant == QUANT_METHOD or os.environ.get(BACKEND_ENV, "auto").lower() == "dequant":
            return QUANT_METHOD
        return None if current_platform.is_cuda() else QUANT_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QeRLNVFP4Config:
        if config.get("quant_method") == "compressed-tensors":  # nvfp4's default serialization, or llm-compressor's
            if not _is_compressed_tensors_nvfp4a16(config):
                raise ValueError(f"{QUANT_METHOD}: not a weight-only NVFP4 compressed-tensors config: {config!r}")
            ours = config.get("qerl") or {}
            ignore = [p[3:] if p.startswith("re:") else p for p in config.get("ignore", [])]
            return cls(ours.get("modules_to_not_convert", ignore or ["lm_head"]), raw=config)
        fmt = config.get("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(f"{QUANT_METHOD}: only format {FORMAT!r} is supported, got {fmt!r}")
        block = config.get("weight_block_size", BLOCK_SIZE)
        if block != BLOCK_SIZE:
            raise ValueError(f"{QUANT_METHOD}: weight_block_size must be {BLOCK_SIZE}, got {block}")
        return cls(config.get("modules_to_not_convert"), raw=config)

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        try:
            self.quantized_modules = _quantized_modules_in(model_name)
        except (OSError, ValueError) as e:  # unreadable header: fall back to the config's patterns
            logger.warning("%s: could not read safetensors headers of %s (%s)", QUANT_METHOD, model_name, e)

    # ------------------------------------------------------------------ per layer
    def _hf_names(self, prefix: str) -> list[str]:
        """HF module names behind a vLLM layer prefix (a fused qkv_proj / gate_up_proj expands to its members)."""
        parent, _, leaf = prefix.rpartition(".")
        members = self.packed_modules_mapping.get(leaf)
        if not members:
            return [prefix]
        return [f"{parent}.{m}" if parent else m for m in members]

    def is_quantized(self, layer: torch.nn.Module, prefix: str) -> bool:
        names = self._hf_names(prefix)
        if self.quantized_modules is not None:
            q = [n in self.quantized_modules for n in names]
            if any(q) and not all(q):
                raise ValueError(
                    f"{QUANT_METHOD}: vLLM fuses {names} into {prefix}, but only some of them are NVFP4 in the "
                    "checkpoint; quantize all members of a fused group or none"
                )
            return all(q)
        in_features = getattr(layer, "input_size", None)
        if in_features is not None and in_features % BLOCK_SIZE:
            return False
        return not any(_matches(n, self.modules_to_not_convert) for n in names)

    def _backend(self) -> str:
        want = os.environ.get(BACKEND_ENV, "auto").lower()
        if want not in ("auto", "native", "dequant"):
            raise ValueError(f"{BACKEND_ENV}={want!r}: choose auto, native or dequant")
        if want == "auto":
            return "native" if current_platform.is_cuda() else "dequant"
        return want

    def native_config(self) -> QuantizationConfig:
        """The equivalent compressed-tensors NVFP4A16 config (vLLM's native kernels), built once."""
        if self._native is None:
            from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
                CompressedTensorsConfig,
            )

            self._native = CompressedTensorsConfig.from_config(
                {
                    "quant_method": "compressed-tensors",
                    "format": FORMAT,
                    "ignore": [],  # we decide per layer which layers are quantized (see get_quant_method)
                    "config_groups": {
                        "group_0": {
                            "targets": ["Linear"],
                            "weights": {
                                "num_bits": 4,
                                "type": "float",
                                "strategy": "tensor_group",
                                "group_size": BLOCK_SIZE,
                                "symmetric": True,
                                "dynamic": False,
                            },
                            "input_activations": None,
                            "output_activations": None,
                        }
                    },
                }
            )
        self._native.packed_modules_mapping = self.packed_modules_mapping
        return self._native

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head (ParallelLMHead), attention: unquantized
        if not self.is_quantized(layer, prefix):
            return UnquantizedLinearMethod()
        if self._backend() == "native":
            return self.native_config().get_quant_method(layer, prefix)
        return NVFP4DequantLinearMethod()


@register_weight_loader_v2_supported_method
class NVFP4DequantLinearMethod(LinearMethodBase):
    """Loads the packed NVFP4 tensors, dequantizes them once after loading, then runs as an unquantized linear."""

    def __init__(self) -> None:
        self.dense = UnquantizedLinearMethod()

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        if input_size_per_partition % BLOCK_SIZE:
            raise ValueError(
                f"{QUANT_METHOD}: input size per partition {input_size_per_partition} is not a multiple of {BLOCK_SIZE}"
            )
        weight_loader = extra_weight_attrs.get("weight_loader")
        out = sum(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.nvfp4_dtype = params_dtype
        packed = ModelWeightParameter(
            data=torch.empty(out, input_size_per_partition // 2, dtype=torch.uint8),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        scale = GroupQuantScaleParameter(
            data=torch.empty(out, input_size_per_partition // BLOCK_SIZE, dtype=torch.float8_e4m3fn),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        global_scale = PerTensorScaleParameter(
            data=torch.empty(len(output_partition_sizes), dtype=torch.float32),
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight_packed", packed)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("weight_global_scale", global_scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        packed = layer.weight_packed.data
        scale = layer.weight_scale.data
        gs = layer.weight_global_scale.data.reshape(-1)
        parts, row = [], 0
        for i, width in enumerate(layer.logical_widths):  # each fused member with its own global scale
            parts.append(
                dequantize(packed[row : row + width], scale[row : row + width], gs[i : i + 1], layer.nvfp4_dtype)
            )
            row += width
        dense = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        for n in ("weight_packed", "weight_scale", "weight_global_scale"):
            delattr(layer, n)
        layer.weight = torch.nn.Parameter(dense, requires_grad=False)
        self.dense.process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.dense.apply(layer, x, bias)
