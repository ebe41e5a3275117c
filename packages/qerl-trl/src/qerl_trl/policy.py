"""Loading the policy: a dense checkpoint quantized to NVFP4 on load, an NVFP4 checkpoint as is, or bf16 (baseline)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["OFFLINE_DEFAULT", "load_policy", "load_tokenizer", "resolve_model_path"]

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
) -> PreTrainedModel:
    """Load a causal LM as the frozen policy base.

    Args:
        name_or_path: Hub id, local folder, or ``"offline-default"``.
        quantization: ``"rtn"`` / ``"mse"`` quantize a dense checkpoint to NVFP4 while loading (layer group by layer
            group, so the dense model never sits in memory whole); ``"none"`` keeps it dense (the bf16 LoRA
            baseline). A checkpoint that already is NVFP4 loads as it is whatever this says.
        dtype: dtype of the dense parts and of activations (default bf16 on CUDA, fp32 on CPU).
        device_map: forwarded to ``from_pretrained``.
    """
    from nvfp4 import NVFP4Config

    if quantization not in ("rtn", "mse", "none"):
        raise ValueError(f"quantization must be 'rtn', 'mse' or 'none', got {quantization!r}")
    path = resolve_model_path(name_or_path)
    if dtype is None:
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    kwargs: dict = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if _is_nvfp4_checkpoint(path):
        from nvfp4.hf import load_nvfp4_checkpoint

        return load_nvfp4_checkpoint(path, **kwargs)
    if quantization != "none":
        kwargs["quantization_config"] = NVFP4Config(method=quantization)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer, left-padded for generation, with a pad token."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), padding_side="left", truncation_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
