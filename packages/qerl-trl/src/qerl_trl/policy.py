"""Loading the policy: a dense checkpoint quantized on load (NVFP4, MXFP4 or bitsandbytes NF4), an NVFP4 checkpoint as
is, or bf16 (baseline)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .quantization import (
    Quantization,
    bnb_nf4_config,
    keep_nf4_exact,
    mxfp4_config,
    nf4_device_map,
    parse_quantization,
    quantize_mxfp4,
)

__all__ = [
    "OFFLINE_DEFAULT",
    "calibrated_checkpoint_path",
    "load_fp4_or_dense",
    "load_policy",
    "load_tokenizer",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)

OFFLINE_DEFAULT = "offline-default"


def resolve_model_path(name_or_path: str | Path) -> str:
    """``"offline-default"`` → the local SmolLM2-135M-Instruct folder (converted once, no Hub); else unchanged."""
    if str(name_or_path) == OFFLINE_DEFAULT:
        from nvfp4.offline import offline_default_model_path

        return str(offline_default_model_path())
    return str(name_or_path)


def _is_nvfp4_checkpoint(path: str) -> bool:
    """An NVFP4 checkpoint of either config (compressed-tensors ``NVFP4A16``, or the previous ``nvfp4_w4a16``)."""
    import nvfp4.hf

    return nvfp4.hf.nvfp4_checkpoint_kind(path) is not None


def load_policy(
    name_or_path: str | Path,
    *,
    quantization: str = "nvfp4-rtn",
    dtype: torch.dtype | None = None,
    device_map: str | dict | None = None,
    calibration_data: list[torch.Tensor] | None = None,
    cache_dir: str | Path | None = None,
    nf4_double_quant: bool = True,
) -> PreTrainedModel:
    """Load a causal LM as the frozen policy base.

    Args:
        name_or_path: Hub id, local folder, or ``"offline-default"``.
        quantization: a :mod:`qerl_trl.quantization` value. ``"nvfp4-rtn"`` / ``"nvfp4-mse"`` / ``"mxfp4-rtn"``
            quantize a dense checkpoint while loading (layer group by layer group, so the dense model never sits in
            memory whole); ``"nvfp4-awq"`` / ``"nvfp4-gptq"`` load it dense, calibrate on ``calibration_data`` and
            quantize; ``"nf4"`` loads it through bitsandbytes' NF4 quantizer (``BitsAndBytesConfig``, QLoRA's
            settings, compute in ``dtype``; on the GPU of this process when there is one); ``"none"`` keeps it
            dense (the bf16 LoRA baseline). The bare ``"rtn"`` / ``"mse"`` / ``"awq"`` / ``"gptq"`` are aliases of
            ``"nvfp4-*"``. A checkpoint that already is NVFP4 loads as it is whatever this says.
        dtype: dtype of the dense parts and of activations (default bf16 on CUDA, fp32 on CPU).
        device_map: forwarded to ``from_pretrained``.
        calibration_data: for ``"awq"`` / ``"gptq"``: token ids of the calibration prompts (int64 ``[T]`` or
            ``[1, T]`` each).
        cache_dir: for ``"awq"`` / ``"gptq"``: the calibrated policy is saved under this folder, keyed by model,
            method and calibration ids, and loaded from there next time (no second calibration).
        nf4_double_quant: ``"nf4"``: double-quantize the absmax scales (QLoRA's default).

    Raises:
        ValueError: an unknown ``quantization`` (the message lists the valid values).
        nvfp4.MissingExtraError: ``"nf4"`` without bitsandbytes.
    """
    quant = parse_quantization(quantization)
    path = resolve_model_path(name_or_path)
    if dtype is None:
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    kwargs: dict = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if _is_nvfp4_checkpoint(path):
        from nvfp4.hf import load_nvfp4_checkpoint

        return load_nvfp4_checkpoint(path, **kwargs)
    if quant.calibrated:
        if not calibration_data:
            raise ValueError(f"quantization={quant.name!r} needs calibration_data (token ids of task prompts)")
        # keyed by the bare method for NVFP4 (Quantization.cache_tag), as before formats existed: old caches stay valid
        cached = None
        if cache_dir is not None:
            cached = calibrated_checkpoint_path(path, quant.cache_tag, calibration_data, cache_dir)
        if cached is not None and (cached / "config.json").is_file():
            from nvfp4.hf import load_nvfp4_checkpoint

            logger.info("loading the %s-calibrated policy from %s (no new calibration)", quant.name, cached)
            return load_nvfp4_checkpoint(cached, **kwargs)
        cfg = _fp4_config(quant, calibration_data=list(calibration_data))
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, **kwargs)
        if cached is not None:
            tmp = cached.with_name(cached.name + ".partial")
            model.save_pretrained(tmp)
            tmp.rename(cached)  # complete or absent: an interrupted save is never taken for a calibrated policy
            logger.info("saved the %s-calibrated policy to %s", quant.name, cached)
        return model
    if quant.format == "nf4":
        kwargs["quantization_config"] = bnb_nf4_config(dtype, double_quant=nf4_double_quant)
        kwargs["device_map"] = nf4_device_map(kwargs.get("device_map"))
        if kwargs["device_map"] is None:
            del kwargs["device_map"]
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        keep_nf4_exact(model)  # no bf16 repack of the NF4 scales on AVX512-BF16 CPUs
        return model
    return load_fp4_or_dense(path, quant, **kwargs)


def load_fp4_or_dense(path: str, quant: Quantization, **kwargs: Any) -> PreTrainedModel:
    """``from_pretrained(path, **kwargs)`` quantized on load to NVFP4 / MXFP4 per ``quant`` (RTN / MSE), or dense.

    MXFP4 goes through ``NVFP4Config(format="mxfp4")`` where :mod:`nvfp4` has it, else the dense model is loaded and
    converted with ``nvfp4.quantize_model(format="mxfp4")`` (the same RTN bytes, the dense model in memory once).
    """
    from nvfp4 import NVFP4Config

    if quant.is_dense:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if quant.calibrated:
        raise ValueError(f"quantization={quant.name!r} calibrates: use load_policy(..., calibration_data=...)")
    if quant.format == "mxfp4":
        cfg = mxfp4_config(quant.method)
        if cfg is None:
            return quantize_mxfp4(AutoModelForCausalLM.from_pretrained(path, **kwargs), quant.method)
    else:
        cfg = NVFP4Config(method=quant.method)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, **kwargs)


def _fp4_config(quant: Quantization, **kwargs: Any) -> Any:
    """The ``NVFP4Config`` of a calibrated NVFP4 / MXFP4 ``quant``."""
    from nvfp4 import NVFP4Config

    if quant.format == "mxfp4":
        cfg = mxfp4_config(quant.method, **kwargs)
        if cfg is None:
            raise NotImplementedError(f"quantization={quant.name!r}: this nvfp4 has no MXFP4 NVFP4Config")
        return cfg
    return NVFP4Config(method=quant.method, **kwargs)


def calibrated_checkpoint_path(
    model_path: str, method: str, calibration_data: list[torch.Tensor], cache_dir: str | Path
) -> Path:
    """``cache_dir/<model>-<method>-<key>``: the key hashes the model path, the method and every calibration id, so a
    different model, method or prompt set never reuses a calibration."""
    digest = hashlib.sha1(f"{os.path.abspath(model_path) if os.path.exists(model_path) else model_path}|{method}".encode())
    for ids in calibration_data:
        digest.update(torch.as_tensor(ids).to(torch.int64).reshape(-1).numpy().tobytes())
        digest.update(b"|")
    return Path(cache_dir) / f"{Path(model_path.rstrip('/')).name or 'model'}-{method}-{digest.hexdigest()[:12]}"


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer, left-padded for generation, with a pad token."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), padding_side="left", truncation_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
