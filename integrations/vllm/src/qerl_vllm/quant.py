"""vLLM quantization config for our NVFP4 checkpoints (``quant_method="nvfp4_w4a16"``, and the compressed-tensors
``NVFP4A16`` config they are saved with by default).

Our checkpoints hold compressed-tensors ``nvfp4-pack-quantized`` tensors (``weight_packed`` uint8 ``[out, in/2]``,
``weight_scale`` fp8-e4m3 ``[out, in/16]``, ``weight_global_scale`` fp32 ``[1]``, a divisor; fused q/k/v and gate/up
share one global scale). How a quantized linear runs is chosen by ``QERL_VLLM_NVFP4_BACKEND`` (read in every vLLM
process, so set it before the engine or server starts):

* ``qerl`` (the default on CUDA from compute capability 9.0, Hopper): :class:`NVFP4KernelLinearMethod` keeps the
  weight packed (in the kernels' MMA layout, :mod:`nvfp4.layout`, where the shape and scales allow it) and runs
  ``nvfp4::linear`` (:mod:`nvfp4.ops`): our Triton W4A16 kernels on CUDA, no host sync and static shapes, so vLLM's
  torch.compile and CUDA graphs capture it (the op has a fake implementation); dequantize + matmul elsewhere. A
  compressed-tensors NVFP4A16 checkpoint is claimed from stock vLLM for it (:meth:`override_quantization_method`).
* ``native`` (the default on CUDA below 9.0; set it on Hopper to compare): stock vLLM's compressed-tensors NVFP4A16
  scheme (Marlin on Hopper), untouched for compressed-tensors checkpoints; our older ``nvfp4_w4a16`` configs are
  delegated to it (``CompressedTensorsConfig`` built from an equivalent ``config_groups`` dict).
* ``dequant`` (the default off CUDA: vLLM's CPU engine): the packed tensors are loaded as they are, then dequantized
  once after loading with :func:`nvfp4.codec.dequantize` (per fused shard, each with its own global scale, so it is
  bit-identical to ``NVFP4Linear.dequantize``) into a dense ``weight`` handled by vLLM's ``UnquantizedLinearMethod``
  — vLLM's CPU GEMM and CPU LoRA run on it unchanged.

``rollout_precision`` (issue #51; :mod:`nvfp4.rollout_precision`): vLLM's ``additional_config``
``{"qerl_rollout_precision": "fp8" | "auto" | "w4a16"}`` (``LLM(additional_config=...)``, ``vllm serve
--additional-config '{...}'``; :class:`qerl_vllm.engine.VLLMEngine` takes ``rollout_precision=``), read once per
engine by :meth:`QeRLNVFP4Config.rollout_setting`. With ``fp8`` or ``auto`` every NVFP4 linear runs
:class:`NVFP4KernelLinearMethod` whatever the backend (on CPU: the ops' references; ``native`` and GPUs without FP8
tensor cores are refused): after loading it makes the layer's E4M3 copy (:func:`nvfp4.fp8.fp8_weight_members`,
per-output-row scales) and ``apply`` quantises the activation per token and runs :func:`nvfp4.fp8.scaled_linear`
(``fp8``; the NVFP4 tensors are then dropped) or :func:`nvfp4.fp8.w4a16_or_fp8_linear` (``auto``: W4A16 below the
model shape's crossover rows, :func:`nvfp4.rollout_precision.fp8_crossover_rows`, FP8 from there, decided inside the
op so vLLM's dynamic-shape graph keeps the choice per call). LoRA stays vLLM's, on top.

LoRA is never merged on any path: vLLM wraps the quantized linear in its LoRA layer, which calls the method's
``apply`` for the base product and adds the adapter with its own (punica) kernels.

MXFP4 (issue #22): compressed-tensors ``mxfp4-pack-quantized`` checkpoints (ours with ``NVFP4Config(format="mxfp4")``,
or llm-compressor's ``MXFP4A16``: ``weight_packed`` uint8 ``[out, in/2]``, ``weight_scale`` uint8 E8M0 ``[out, in/32]``,
no global scale) take two paths: on CUDA stock vLLM's compressed-tensors MXFP4 scheme (W4A16 through Marlin below
SM100; ``qerl`` means ``native`` for them), elsewhere this plugin dequantizes them once with
:func:`nvfp4.mxfp4.dequantize` (no per-shard scale).

Registered by :func:`register` (the ``vllm.general_plugins`` entry point ``qerl_nvfp4``), in every vLLM process.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from nvfp4 import fp8, mxfp4, ops
from nvfp4.codec import dequantize
from nvfp4.formats import (
    FORMATS,
    NVFP4,
    Format,
    compressed_tensors_format,
    compressed_tensors_untargeted,
    get_format,
)
from nvfp4.layout import (
    mma_layout_supported,
    mma_scales_supported,
    scale_rows,
    to_mma_layout,
    to_scale_mma_layout,
)
from nvfp4.rollout_precision import RolloutPrecision, get_rollout_precision, model_crossover_rows

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
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter, PerTensorScaleParameter
    from vllm.platforms import current_platform
except ImportError as err:  # the extra is not installed
    raise vllm_missing(err, "qerl_vllm.quant") from err

logger = init_logger(__name__)

QUANT_METHOD = "nvfp4_w4a16"
FORMAT = "nvfp4-pack-quantized"
BACKEND_ENV = "QERL_VLLM_NVFP4_BACKEND"  # "auto" (default) | "qerl" | "native" | "dequant"
BACKENDS = ("auto", "qerl", "native", "dequant")
QERL_MIN_CAPABILITY = 90  # auto picks our kernels from Hopper on (where they are tuned and tested)
ROLLOUT_PRECISION_KEY = "qerl_rollout_precision"  # vLLM's additional_config key (rollout_precision, issue #51)
FP8_MIN_CAPABILITY = 89  # FP8 tensor cores (torch._scaled_mm): Ada, Hopper and later

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "QUANT_METHOD",
    "ROLLOUT_PRECISION_KEY",
    "NVFP4DequantLinearMethod",
    "NVFP4KernelLinearMethod",
    "QeRLNVFP4Config",
    "resolve_backend",
]


def resolve_backend(fmt: Format = NVFP4) -> str:
    """The linear method for weights of format ``fmt`` here: ``"qerl"`` (our kernels), ``"native"`` (stock vLLM's
    compressed-tensors scheme; CUDA only) or ``"dequant"``, from ``QERL_VLLM_NVFP4_BACKEND`` (default ``auto``:
    ``qerl`` on CUDA from compute capability 9.0, ``native`` on older GPUs, ``dequant`` elsewhere)."""
    want = os.environ.get(BACKEND_ENV, "auto").lower()
    if want not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={want!r}: choose one of {', '.join(BACKENDS)}")
    cuda = current_platform.is_cuda()
    if want == "native" and not cuda:
        raise ValueError(f"{BACKEND_ENV}=native: stock vLLM's NVFP4/MXFP4 kernels need CUDA; use qerl or dequant here")
    if want == "auto":
        if not cuda:
            return "dequant"
        want = "qerl" if current_platform.has_device_capability(QERL_MIN_CAPABILITY) else "native"
    if want == "qerl" and not fmt.has_global_scale:
        # MXFP4: our kernels take NVFP4 tensors only, and stock vLLM 0.26's MXFP4A16 scheme fails on the H100
        # (marlin_gemm: "c must be passed for W4A8-FP4", 2026-11-27): the one-time dequantization, as on CPU
        return "dequant"
    return want


def _matches(name: str, patterns: list[str]) -> bool:
    # same rule as nvfp4.linear: exact name, dotted suffix or regex of the whole name; an "re:" entry (compressed-tensors'
    # ignore syntax) with re.match, a prefix, as compressed-tensors and stock vLLM apply it
    return any(
        re.match(p[3:], name) if p.startswith("re:") else name == p or name.endswith("." + p) or re.fullmatch(p, name)
        for p in patterns
    )


def _compressed_tensors_format(cfg: dict[str, Any]) -> Format | None:
    """The 4-bit :class:`~nvfp4.formats.Format` of ``cfg`` if it is a weight-only compressed-tensors
    ``nvfp4-pack-quantized`` (fp4, group 16) or ``mxfp4-pack-quantized`` (fp4, group 32) config
    (:func:`nvfp4.formats.compressed_tensors_format`, the check nvfp4's loaders use), else None."""
    try:
        return compressed_tensors_format(cfg)
    except ValueError:
        return None


def _is_compressed_tensors_nvfp4a16(cfg: dict[str, Any]) -> bool:
    """Whether ``cfg`` is a weight-only NVFP4 (or MXFP4) compressed-tensors config this plugin can load."""
    return _compressed_tensors_format(cfg) is not None


def _module_names(value: Any, key: str) -> list[str]:
    """``value`` as a list of module names / patterns (``key``: the config field it came from, for the error). A bare
    string is refused: ``list("lm_head")`` would be seven one-letter patterns that match nothing, silently."""
    if isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        return list(value)
    raise ValueError(f"{QUANT_METHOD}: {key} must be a list of module names or patterns, got {value!r}")


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
    """Weight-only NVFP4 or MXFP4 (our ``nvfp4_w4a16`` checkpoints, weight-only compressed-tensors ones) for vLLM."""

    def __init__(
        self,
        modules_to_not_convert: list[str] | None = None,
        raw: dict[str, Any] | None = None,
        format: Format = NVFP4,
    ) -> None:
        super().__init__()
        self.weight_format = format
        self.modules_to_not_convert = (
            _module_names(modules_to_not_convert, "modules_to_not_convert")
            if modules_to_not_convert is not None
            else ["lm_head"]
        )
        self.raw = dict(raw or {})
        self.quantized_modules: set[str] | None = None  # from the checkpoint's tensors (maybe_update_config)
        self._native: QuantizationConfig | None = None
        self._rollout: tuple[RolloutPrecision, int] | None = None  # rollout_setting(), read once

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
        """Claim a weight-only NVFP4 / MXFP4 compressed-tensors checkpoint (``nvfp4-pack-quantized`` fp4 group 16,
        ``mxfp4-pack-quantized`` fp4 group 32; no activation quantization) unless the user asked for another method
        or :func:`resolve_backend` says ``native`` (then stock vLLM's compressed-tensors path loads it untouched).
        With ``quantization="nvfp4_w4a16"`` asked for, another compressed-tensors config is a ``ValueError`` saying
        what in it disagrees."""
        if user_quant == QUANT_METHOD and hf_quant_cfg.get("quant_method") == "compressed-tensors":
            # asked for by name: say what in the checkpoint's config we cannot load (vLLM would only report that
            # "compressed-tensors" does not match "nvfp4_w4a16")
            try:
                compressed_tensors_format(hf_quant_cfg)
            except ValueError as err:
                raise ValueError(f"{QUANT_METHOD}: cannot load this compressed-tensors checkpoint: {err}") from None
            return QUANT_METHOD
        fmt = _compressed_tensors_format(hf_quant_cfg) if user_quant is None else None
        if fmt is None:
            return None
        return None if resolve_backend(fmt) == "native" else QUANT_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QeRLNVFP4Config:
        if config.get("quant_method") == "compressed-tensors":  # nvfp4's default serialization, or llm-compressor's
            try:
                fmt = compressed_tensors_format(config)
            except ValueError as err:  # the check's reason names what disagrees
                raise ValueError(f"{QUANT_METHOD}: cannot load this compressed-tensors checkpoint: {err}") from None
            ours = config.get("qerl") or {}
            ignore = _module_names(config.get("ignore") or [], "ignore")  # "re:" entries kept: _matches applies them
            dense = _module_names(
                ours.get("modules_to_not_convert", ignore or ["lm_head"]), "qerl.modules_to_not_convert"
            )
            untargeted = compressed_tensors_untargeted(config)  # linears no config group targets were saved dense
            return cls(dense if untargeted is None else [*dense, untargeted], raw=config, format=fmt)
        try:  # the serialized config names its format: looked up once, here
            fmt = get_format(config.get("format", FORMAT))
        except ValueError:
            raise ValueError(
                f"{QUANT_METHOD}: format must be one of {sorted(f.ct_format for f in FORMATS.values())}, "
                f"got {config.get('format')!r}"
            ) from None
        block = config.get("weight_block_size", fmt.group_size)
        if block != fmt.group_size:
            raise ValueError(
                f"{QUANT_METHOD}: weight_block_size must be {fmt.group_size} for {fmt.ct_format}, got {block}"
            )
        return cls(config.get("modules_to_not_convert"), raw=config, format=fmt)

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        try:
            self.quantized_modules = _quantized_modules_in(model_name)
        except (OSError, ValueError) as e:  # unreadable header: fall back to the config's patterns
            logger.warning("%s: could not read safetensors headers of %s (%s)", QUANT_METHOD, model_name, e)

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        """Rename the checkpoint's module names to the model's vLLM names (vLLM calls this with the model's
        ``hf_to_vllm_mapper`` renames before building its layers: a multimodal model's ``model.language_model.*``
        is ``language_model.model.*`` there). As compressed-tensors' config does, only dotted names are mapped;
        ``re:`` entries and bare names (``lm_head``, suffixes) are kept as they are."""

        def vllm_name(name: str) -> str | None:
            return hf_to_vllm_mapper._map_name(name) if "." in name and not name.startswith("re:") else name

        if self.quantized_modules is not None:
            self.quantized_modules = {m for n in self.quantized_modules if (m := vllm_name(n)) is not None}
        # the originals stay: a dotted entry may be a suffix, which the mapper's renames leave alone or misread
        mapped = [m for n in self.modules_to_not_convert if (m := vllm_name(n)) not in (None, n)]
        self.modules_to_not_convert = [*self.modules_to_not_convert, *mapped]

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
        if in_features is not None and in_features % self.weight_format.group_size:
            return False
        dense = [_matches(n, self.modules_to_not_convert) for n in names]
        if any(dense) and not all(dense):  # the fused layer is one method: neither choice loads the checkpoint
            raise ValueError(
                f"{QUANT_METHOD}: vLLM fuses {names} into {prefix}, but the config keeps only "
                f"{[n for n, d in zip(names, dense) if d]} dense; quantize all members of a fused group or none"
            )
        return not any(dense)

    def native_config(self) -> QuantizationConfig:
        """The equivalent compressed-tensors NVFP4A16 / MXFP4A16 config (vLLM's native kernels), built once."""
        if self._native is None:
            from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
                CompressedTensorsConfig,
            )

            fmt = self.weight_format
            self._native = CompressedTensorsConfig.from_config(
                {
                    "quant_method": "compressed-tensors",
                    "format": fmt.ct_format,
                    "ignore": [],  # we decide per layer which layers are quantized (see get_quant_method)
                    "config_groups": {
                        "group_0": {
                            "targets": ["Linear"],
                            "weights": {
                                "num_bits": 4,
                                "type": "float",
                                "strategy": fmt.ct_strategy,
                                "group_size": fmt.group_size,
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

    def rollout_setting(self) -> tuple[RolloutPrecision, int]:
        """``(rollout_precision, auto's crossover rows)`` of the engine being built, read once from vLLM's
        ``additional_config`` (:data:`ROLLOUT_PRECISION_KEY`; absent: ``w4a16``) and its model's shape
        (:func:`nvfp4.rollout_precision.fp8_crossover_rows`). ``ValueError`` (one line) for a bad value, a
        ``native`` backend, an MXFP4 checkpoint or a GPU without FP8 tensor cores when FP8 is asked for."""
        if self._rollout is not None:
            return self._rollout
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        precision = get_rollout_precision(extra.get(ROLLOUT_PRECISION_KEY, "w4a16"))
        rows, measured = 0, True
        if precision.fp8_copy:
            if not self.weight_format.has_global_scale or resolve_backend(self.weight_format) == "native":
                raise ValueError(f"{ROLLOUT_PRECISION_KEY}={precision.name!r} runs in qerl_vllm's linear method on "
                                 f"NVFP4 weights: not with {self.weight_format.ct_format} or {BACKEND_ENV}=native")  # fmt: skip
            if current_platform.is_cuda() and not current_platform.has_device_capability(FP8_MIN_CAPABILITY):
                raise ValueError(f"{ROLLOUT_PRECISION_KEY}={precision.name!r} needs FP8 tensor cores (compute "
                                 f"capability {FP8_MIN_CAPABILITY / 10:.1f}+): use w4a16 on this GPU")  # fmt: skip
            model_config = vllm_config.model_config
            rows, measured = model_crossover_rows(model_config.hf_config if model_config is not None else None)
            logger.info("%s: rollout_precision=%s (auto's crossover: %d rows, %s)", QUANT_METHOD, precision.name,
                        rows, "measured" if measured else "not measured for this shape: the 7B value")  # fmt: skip
        self._rollout = (precision, rows)
        return self._rollout

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, ParallelLMHead):
            # an untied lm_head quantized in the checkpoint (NVFP4Config(modules_to_not_convert=[]), an llm-compressor
            # ignore without it) runs as the linears do: vLLM computes the logits with the method's apply
            if not self.is_quantized(layer, prefix):
                return None  # vLLM's own (embedding) method
        elif not isinstance(layer, LinearBase):
            return None  # embeddings, attention: unquantized
        elif not self.is_quantized(layer, prefix):
            return UnquantizedLinearMethod()
        precision, crossover_rows = self.rollout_setting()
        if precision.fp8_copy:
            return NVFP4KernelLinearMethod(precision=precision, crossover_rows=crossover_rows)
        backend = resolve_backend(self.weight_format)
        if backend == "native":
            return self.native_config().get_quant_method(layer, prefix)
        if backend == "qerl":
            return NVFP4KernelLinearMethod()
        return NVFP4DequantLinearMethod(self.weight_format)


class _PackedLinearMethod(LinearMethodBase):
    """Creates the checkpoint's packed tensors on a linear layer (compressed-tensors names and layout; fused layers
    hold their members' rows one after the other, and one global scale per member)."""

    def __init__(self, format: Format = NVFP4) -> None:
        self.weight_format = format

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
        group = self.weight_format.group_size
        if input_size_per_partition % group:
            raise ValueError(
                f"{QUANT_METHOD}: input size per partition {input_size_per_partition} is not a multiple of {group}"
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
            data=torch.empty(out, input_size_per_partition // group, dtype=self.weight_format.scale_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight_packed", packed)
        layer.register_parameter("weight_scale", scale)
        if self.weight_format.has_global_scale:
            global_scale = PerTensorScaleParameter(
                data=torch.empty(len(output_partition_sizes), dtype=torch.float32),
                weight_loader=weight_loader,
            )
            layer.register_parameter("weight_global_scale", global_scale)


@register_weight_loader_v2_supported_method
class NVFP4DequantLinearMethod(_PackedLinearMethod):
    """Loads the packed NVFP4 (or MXFP4) tensors, dequantizes them once after loading, then runs as an unquantized
    linear."""

    def __init__(self, format: Format = NVFP4) -> None:
        super().__init__(format)
        self.dense = UnquantizedLinearMethod()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        packed = layer.weight_packed.data
        scale = layer.weight_scale.data
        if not self.weight_format.has_global_scale:  # MXFP4: no per-shard scale, one dequantization
            dense = mxfp4.dequantize(packed, scale, layer.nvfp4_dtype)
            for n in ("weight_packed", "weight_scale"):
                delattr(layer, n)
            layer.weight = torch.nn.Parameter(dense, requires_grad=False)
            self.dense.process_weights_after_loading(layer)
            return
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


@register_weight_loader_v2_supported_method
class NVFP4KernelLinearMethod(_PackedLinearMethod):
    """Keeps the NVFP4 weight packed and runs our W4A16 kernels through ``nvfp4::linear`` (:func:`nvfp4.ops.linear`).

    After loading, ``weight_packed`` is put in the kernels' MMA layout (``[out/4, 2·in]``, :mod:`nvfp4.layout`) when
    every fused member's width is a multiple of 64, ``in`` a multiple of 256 and every block scale positive and
    finite (what compressed-tensors writes); otherwise it keeps the compressed-tensors layout (exact, slower kernels).
    ``weight_scale`` and the global scale are unchanged. A fused layer whose members share one global scale (what
    ``nvfp4`` and llm-compressor write) is one product; one whose members do not is computed member by member, each
    with its own scale (exact; slower, with a warning).

    ``apply`` is one custom op per member: no host sync, no data-dependent shapes, a fake (meta) implementation, so
    vLLM's torch.compile traces it and its CUDA graphs capture it.

    ``rollout_precision`` ``fp8`` / ``auto`` (the module docstring): the E4M3 copy is made from the loaded tensors
    first (per fused member, each with its own global scale). ``fp8``: the layer then holds only ``weight`` (float8_e4m3fn
    ``[out, in]``) and ``weight_scale`` (float32 ``[out]``), vLLM's own FP8 names; ``auto``: the NVFP4 tensors as above
    plus ``weight_fp8`` and ``weight_fp8_scale`` (its fused members must share one global scale).

    Args:
        mma_layout: ``None`` (default): the MMA layout on CUDA only, unless ``NVFP4_MMA_LAYOUT=0``; ``True`` / ``False``
            force it on or off on any device (tests check the layout round trip on CPU tensors).
        precision: ``rollout_precision`` (default ``w4a16``); crossover_rows: ``auto``'s rows per call from which FP8
            runs.
    """

    def __init__(
        self,
        mma_layout: bool | None = None,
        precision: RolloutPrecision | str = "w4a16",
        crossover_rows: int = 0,
    ) -> None:
        super().__init__(NVFP4)
        self.mma_layout = mma_layout
        self.precision = get_rollout_precision(precision)
        #: rows per call from which ``apply`` takes the FP8 path (0: always; None: never)
        self.fp8_from_rows = self.precision.fp8_from_rows(crossover_rows)

    def _wants_mma(self, packed: torch.Tensor, widths: list[int], in_features: int) -> bool:
        """The MMA layout: as forced, else on CUDA unless ``NVFP4_MMA_LAYOUT=0``; only for whole 64 × 256 tiles per
        member (so that each member's rows stay a contiguous slice)."""
        if self.mma_layout is None:
            wanted = packed.is_cuda and os.environ.get("NVFP4_MMA_LAYOUT", "1") != "0"
        else:
            wanted = self.mma_layout
        return wanted and all(mma_layout_supported(w, in_features) for w in widths)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        packed = layer.weight_packed.data
        scale = layer.weight_scale.data
        gs = layer.weight_global_scale.data.reshape(-1).to(torch.float32)
        widths = [int(w) for w in layer.logical_widths]
        if len(gs) != len(widths):
            raise ValueError(f"{QUANT_METHOD}: {len(gs)} global scales for {len(widths)} fused members {widths}")
        shared = len(widths) == 1 or bool((gs == gs[0]).all())  # a host sync, once, while loading
        if not shared and self.precision.name == "auto":
            raise ValueError(f"{QUANT_METHOD}: rollout_precision='auto' needs one global scale per fused layer "
                             f"({widths} have their own): quantize them with one, or use fp8")  # fmt: skip
        if not shared and self.precision.keeps_w4a16:
            logger.warning_once(
                "%s: the members of a fused layer (%s) have different global scales; computing them one by one "
                "(exact, slower: quantize fused q/k/v and gate/up with one global scale)",
                QUANT_METHOD,
                str(widths),  # hashable: warning_once keys on its arguments
            )
        if self.fp8_from_rows is not None:
            w8, w_scale = fp8.fp8_weight_members(packed, scale, gs, widths)
            if not self.precision.keeps_w4a16:  # fp8: the E4M3 copy is all the layer computes with
                for n in ("weight_packed", "weight_scale", "weight_global_scale"):
                    delattr(layer, n)
                layer.register_parameter("weight", torch.nn.Parameter(w8, requires_grad=False))
                layer.register_parameter("weight_scale", torch.nn.Parameter(w_scale, requires_grad=False))
                return
        in_features = scale.shape[1] * self.weight_format.group_size
        mma = self._wants_mma(packed, widths, in_features)
        if mma and not mma_scales_supported(scale):  # zero/negative/NaN block scales: the MMA kernels cannot decode
            logger.warning_once("%s: block scales that are not positive and finite; compressed-tensors layout kept",
                                QUANT_METHOD)  # fmt: skip
            mma = False
        if mma:
            packed = to_mma_layout(packed)  # row-tile-wise: the members stay 64-row aligned, one after the other
            scale = to_scale_mma_layout(scale)  # step A's order, 64-row tiles too (the MMA kernels read no other)
        for n in ("weight_packed", "weight_scale", "weight_global_scale"):
            delattr(layer, n)
        layer.register_parameter("weight_packed", torch.nn.Parameter(packed.contiguous(), requires_grad=False))
        layer.register_parameter("weight_scale", torch.nn.Parameter(scale.contiguous(), requires_grad=False))
        layer.register_parameter(
            "weight_global_scale", torch.nn.Parameter((gs[:1] if shared else gs).contiguous(), requires_grad=False)
        )
        # per member: (packed rows, scale rows) of its slice; None: one product
        rows_per_output = 0.25 if mma else 1
        bounds, start = [], 0
        for w in widths:
            rows = scale_rows(packed, scale, start, start + w)
            bounds.append(((int(start * rows_per_output), int((start + w) * rows_per_output)), (rows.start, rows.stop)))
            start += w
        layer.nvfp4_members = None if shared else bounds
        layer.nvfp4_mma_layout = mma
        if self.fp8_from_rows is not None:  # auto: the E4M3 copy beside the NVFP4 tensors
            layer.register_parameter("weight_fp8", torch.nn.Parameter(w8, requires_grad=False))
            layer.register_parameter("weight_fp8_scale", torch.nn.Parameter(w_scale, requires_grad=False))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, in]`` → ``[M, out]`` in x's dtype: W4A16 (``nvfp4::linear``), FP8 (``fp8``: per-token E4M3 of x,
        ``nvfp4::fp8_scaled_linear``) or, for ``auto``, ``nvfp4::w4a16_or_fp8_linear`` (FP8 from the crossover)."""
        if self.fp8_from_rows is not None and not self.precision.keeps_w4a16:  # fp8: the layer holds its copy only
            return fp8.fp8_linear(x, layer.weight, layer.weight_scale, bias)
        if self.fp8_from_rows is not None:
            return fp8.w4a16_or_fp8_linear(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale,
                                           layer.weight_fp8, layer.weight_fp8_scale, bias, self.fp8_from_rows)  # fmt: skip
        members = layer.nvfp4_members
        if members is None:
            return ops.linear(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, bias)
        parts = [
            ops.linear(x, layer.weight_packed[p0:p1], layer.weight_scale[s0:s1], layer.weight_global_scale[i : i + 1])
            for i, ((p0, p1), (s0, s1)) in enumerate(members)
        ]
        y = torch.cat(parts, dim=-1)
        return y if bias is None else y + bias.to(y.dtype)
