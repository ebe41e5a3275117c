"""Loading the policy: a dense checkpoint quantized to NVFP4 on load, an NVFP4 checkpoint as is, or bf16 (baseline)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["OFFLINE_DEFAULT", "calibrated_checkpoint_path", "load_policy", "load_tokenizer", "resolve_model_path"]

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
    quantization: str = "rtn",
    dtype: torch.dtype | None = None,
    device_map: str | dict | None = None,
    calibration_data: list[torch.Tensor] | None = None,
    cache_dir: str | Path | None = None,
) -> PreTrainedModel:
    """Load a causal LM as the frozen policy base.

    Args:
        name_or_path: Hub id, local folder, or ``"offline-default"``.
        quantization: ``"rtn"`` / ``"mse"`` quantize a dense checkpoint to NVFP4 while loading (layer group by layer
            group, so the dense model never sits in memory whole); ``"awq"`` / ``"gptq"`` load it dense, calibrate on
            ``calibration_data`` and quantize; ``"none"`` keeps it dense (the bf16 LoRA baseline). A checkpoint that
            already is NVFP4 loads as it is whatever this says.
        dtype: dtype of the dense parts and of activations (default bf16 on CUDA, fp32 on CPU).
        device_map: forwarded to ``from_pretrained``.
        calibration_data: for ``"awq"`` / ``"gptq"``: token ids of the calibration prompts (int64 ``[T]`` or
            ``[1, T]`` each).
        cache_dir: for ``"awq"`` / ``"gptq"``: the calibrated policy is saved under this folder, keyed by model,
            method and calibration ids, and loaded from there next time (no second calibration).
    """
    from nvfp4 import NVFP4Config
    from nvfp4.calibration import CALIBRATED_METHODS

    if quantization not in ("rtn", "mse", *CALIBRATED_METHODS, "none"):
        raise ValueError(f"quantization must be 'rtn', 'mse', 'awq', 'gptq' or 'none', got {quantization!r}")
    path = resolve_model_path(name_or_path)
    if dtype is None:
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    kwargs: dict = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if _is_nvfp4_checkpoint(path):
        from nvfp4.hf import load_nvfp4_checkpoint

        return load_nvfp4_checkpoint(path, **kwargs)
    if quantization in CALIBRATED_METHODS:
        if not calibration_data:
            raise ValueError(f"quantization={quantization!r} needs calibration_data (token ids of task prompts)")
        cached = None if cache_dir is None else calibrated_checkpoint_path(path, quantization, calibration_data, cache_dir)
        if cached is not None and (cached / "config.json").is_file():
            from nvfp4.hf import load_nvfp4_checkpoint

            logger.info("loading the %s-calibrated policy from %s (no new calibration)", quantization, cached)
            return load_nvfp4_checkpoint(cached, **kwargs)
        cfg = NVFP4Config(method=quantization, calibration_data=list(calibration_data))
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, **kwargs)
        if cached is not None:
            tmp = cached.with_name(cached.name + ".partial")
            model.save_pretrained(tmp)
            tmp.rename(cached)  # complete or absent: an interrupted save is never taken for a calibrated policy
            logger.info("saved the %s-calibrated policy to %s", quantization, cached)
        return model
    if quantization != "none":
        kwargs["quantization_config"] = NVFP4Config(method=quantization)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


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
