"""The ``quantization`` setting of ``qerl train`` / ``qerl eval``: which 4-bit format, with which method.

Values are ``<format>-<method>``:

=================  ============================================================================================
``nvfp4-rtn``      NVFP4 (E2M1 + FP8 scale per 16 + FP32 per tensor), round to nearest (llm-compressor bytes)
``nvfp4-mse``      NVFP4, per-block scale search
``nvfp4-awq``      NVFP4, activation-weighted scale search, calibrated on the task's prompts
``nvfp4-gptq``     NVFP4, error-compensating rounding, calibrated on the task's prompts
``mxfp4-rtn``      MXFP4 (OCP microscaling: E2M1 + E8M0 scale per 32), round to nearest (compressed-tensors bytes)
``nf4``            bitsandbytes NF4 (QLoRA: blockwise absmax per 64, double-quantized absmax); needs
                   ``pip install 'qerl-trl[nf4]'`` (bitsandbytes)
``none``           the dense model (bf16 LoRA baseline)
=================  ============================================================================================

The bare NVFP4 method names of earlier versions (``rtn``, ``mse``, ``awq``, ``gptq``) stay accepted as aliases of
``nvfp4-<method>``, so recipes and saved configs written with them keep working; :func:`parse_quantization`
canonicalises either spelling.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ALIASES",
    "CALIBRATED_METHODS",
    "QUANTIZATIONS",
    "Quantization",
    "bnb_nf4_config",
    "canonical_quantization",
    "keep_nf4_exact",
    "mxfp4_config",
    "nf4_device_map",
    "parse_quantization",
    "quantize_mxfp4",
]

#: Canonical values, NVFP4 first (calibrated methods last), then the other formats and the dense baseline.
QUANTIZATIONS: tuple[str, ...] = ("nvfp4-rtn", "nvfp4-mse", "nvfp4-awq", "nvfp4-gptq", "mxfp4-rtn", "nf4", "none")
#: Earlier bare NVFP4 method names → canonical value.
ALIASES: dict[str, str] = {"rtn": "nvfp4-rtn", "mse": "nvfp4-mse", "awq": "nvfp4-awq", "gptq": "nvfp4-gptq"}
#: Methods calibrated on task prompts (the dense model runs on them before quantizing).
CALIBRATED_METHODS: tuple[str, ...] = ("awq", "gptq")


@dataclass(frozen=True)
class Quantization:
    """A parsed ``quantization`` value.

    Attributes:
        name: the canonical value (one of :data:`QUANTIZATIONS`).
        format: ``"nvfp4"``, ``"mxfp4"``, ``"nf4"``, or ``None`` for ``"none"``.
        method: ``"rtn"`` / ``"mse"`` / ``"awq"`` / ``"gptq"`` for the FP4 formats; ``None`` for ``nf4`` (its own
            blockwise absmax rounding) and ``none``.
    """

    name: str
    format: str | None
    method: str | None

    @property
    def calibrated(self) -> bool:
        """Whether the method calibrates on task prompts (``awq`` / ``gptq``)."""
        return self.method in CALIBRATED_METHODS

    @property
    def is_dense(self) -> bool:
        """``quantization="none"``."""
        return self.format is None

    @property
    def cache_tag(self) -> str:
        """The name used in cache keys (calibrated policies, vLLM checkpoints): the bare method for NVFP4, as earlier
        versions keyed them (their caches stay valid), the canonical name otherwise."""
        return self.method if self.format == "nvfp4" and self.method else self.name


def _valid_values() -> str:
    aliases = ", ".join(f"{a!r} (= {c!r})" for a, c in ALIASES.items())
    return f"{', '.join(map(repr, QUANTIZATIONS))}; aliases: {aliases}"


def parse_quantization(value: str | Quantization, what: str = "quantization") -> Quantization:
    """Parse a ``quantization`` value (canonical or alias, case-insensitive).

    Raises:
        ValueError: naming ``what``, the value and every valid value, for anything else.
    """
    if isinstance(value, Quantization):
        return value
    key = str(value).strip().lower()
    name = ALIASES.get(key, key)
    if name not in QUANTIZATIONS:
        raise ValueError(f"{what} must be one of {_valid_values()}, got {value!r}")
    if name == "none":
        return Quantization(name, None, None)
    if name == "nf4":
        return Quantization(name, "nf4", None)
    fmt, _, method = name.partition("-")
    return Quantization(name, fmt, method)


def canonical_quantization(value: str) -> str:
    """``value``'s canonical spelling (``"rtn"`` → ``"nvfp4-rtn"``); raises ValueError as :func:`parse_quantization`."""
    return parse_quantization(value).name


def bnb_nf4_config(dtype: torch.dtype, *, double_quant: bool = True) -> Any:
    """The QLoRA ``BitsAndBytesConfig``: NF4 weights, compute in ``dtype``, absmax double-quantized (QLoRA's default,
    as ``benchmarks/grpo_step.py``'s ``qlora`` arm), uint8 storage.

    Raises:
        nvfp4.MissingExtraError: bitsandbytes is not installed (names ``pip install 'qerl-trl[nf4]'``).
    """
    from nvfp4.extras import missing_extra

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise missing_extra(e, "bitsandbytes", "quantization='nf4'", "bitsandbytes", "qerl-trl[nf4]") from e
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_quant_storage=torch.uint8,
    )


def keep_nf4_exact(model: torch.nn.Module) -> int:
    """Keep bitsandbytes NF4 layers on their exact NF4 path on CPU; returns how many ``Linear4bit`` were set.

    On CPUs with AVX512-BF16, bitsandbytes (0.48 and later) repacks a ``Linear4bit`` the first time it runs in eval
    mode without gradients (generation, evaluation, AQN's norm discovery): the absmax scales are rounded to bf16 and the
    layer then computes in bf16 (``_convert_weight_packed_for_cpu``), so the model's weights silently change mid-run and
    differ from the GPU's NF4. We turn that repack off (``support_avx512bf16_for_cpu = False``): the same NF4 numbers
    in every mode, on every device.
    """
    n = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


def nf4_device_map(device_map: str | dict | None) -> str | dict | None:
    """Where an NF4 model is quantized while loading: ``device_map`` if given, else this process's GPU
    (``LOCAL_RANK`` under ``accelerate launch`` / torchrun), else ``None`` (CPU)."""
    if device_map is not None or not torch.cuda.is_available():
        return device_map
    return {"": int(os.environ.get("LOCAL_RANK", "0"))}


def mxfp4_config(method: str, **kwargs: Any) -> Any | None:
    """``NVFP4Config(method=method, format="mxfp4")``: MXFP4 quantize-on-load, or ``None`` where the installed
    :mod:`nvfp4` has no MXFP4 ``NVFP4Config`` (then :func:`quantize_mxfp4` converts a loaded dense model)."""
    from nvfp4 import NVFP4Config

    try:
        return NVFP4Config(method=method, format="mxfp4", **kwargs)
    except (TypeError, ValueError) as e:
        if "format" not in str(e):
            raise
        return None


def quantize_mxfp4(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """Convert the linears of a loaded dense ``model`` to MXFP4 in place (``nvfp4.quantize_model(format="mxfp4")``).

    Raises:
        NotImplementedError: the installed :mod:`nvfp4` has no MXFP4 ``quantize_model``.
    """
    import inspect

    import nvfp4

    if "format" not in inspect.signature(nvfp4.quantize_model).parameters:
        raise NotImplementedError(
            f"quantization='mxfp4-{method}' needs nvfp4.quantize_model(format='mxfp4'), which this nvfp4 does not have"
        )
    return nvfp4.quantize_model(model, method=method, format="mxfp4", progress=False)
