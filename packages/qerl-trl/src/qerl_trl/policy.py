"""Loading the policy: a dense checkpoint quantized on load (NVFP4, MXFP4 or bitsandbytes NF4), an NVFP4 checkpoint as
is, or bf16 (baseline)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .quantization import QuantScheme, get_scheme

__all__ = ["OFFLINE_DEFAULT", "calibration_prompt_ids", "load_policy", "load_tokenizer", "resolve_model_path"]

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


def calibration_prompt_ids(dataset: Any, tokenizer: PreTrainedTokenizerBase, n: int) -> list[torch.Tensor]:
    """Token ids ``[1, T]`` of the first ``n`` prompts of ``dataset`` (its ``"prompt"`` column: chat messages get the
    chat template with the generation prompt, as the rollouts see them; strings are tokenized as they are)."""
    if dataset is None:
        raise ValueError("quantization '*-awq' / '*-gptq' calibrates on the training prompts: pass train_dataset")
    ids = []
    for row in itertools.islice(dataset, n):  # iterated: an IterableDataset has no len() and no rows by index
        prompt = row["prompt"]
        if isinstance(prompt, list):
            prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids.append(tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("quantization '*-awq' / '*-gptq': the training set has no prompts to calibrate on")
    return ids


def load_policy(
    name_or_path: str | Path,
    *,
    quantization: str | QuantScheme = "nvfp4-rtn",
    dtype: torch.dtype | None = None,
    device_map: str | dict | None = None,
    calibration_data: list[torch.Tensor] | None = None,
    cache_dir: str | Path | None = None,
    nf4_double_quant: bool = True,
) -> PreTrainedModel:
    """Load a causal LM as the frozen policy base.

    Args:
        name_or_path: Hub id, local folder, or ``"offline-default"``.
        quantization: a :class:`~qerl_trl.quantization.QuantScheme`, taken as it is (the trainer passes
            ``config.quant_scheme``), or its name, parsed here (:func:`~qerl_trl.quantization.get_scheme`).
            ``"nvfp4-rtn"`` / ``"nvfp4-mse"`` / ``"mxfp4-rtn"`` quantize a dense checkpoint while loading (layer group
            by layer group, so the dense model never sits in memory whole); ``"nvfp4-awq"`` / ``"nvfp4-gptq"`` load it
            dense, calibrate on ``calibration_data`` and quantize; ``"nf4"`` loads it through bitsandbytes' NF4
            quantizer (``BitsAndBytesConfig``, QLoRA's settings, compute in ``dtype``; on the GPU of this process when
            there is one); ``"none"`` keeps it dense (the bf16 LoRA baseline). A checkpoint that already is NVFP4 or
            MXFP4 loads as it is whatever this says.
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
    scheme = get_scheme(quantization)
    path = resolve_model_path(name_or_path)
    if dtype is None:
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if _is_nvfp4_checkpoint(path):
        from nvfp4.hf import load_nvfp4_checkpoint

        return load_nvfp4_checkpoint(path, dtype=dtype, **({"device_map": device_map} if device_map is not None else {}))
    return scheme.load(path, dtype=dtype, device_map=device_map, calibration_data=calibration_data, cache_dir=cache_dir,
                       double_quant=nf4_double_quant)  # fmt: skip


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer, left-padded for generation, with a pad token."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), padding_side="left", truncation_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    backend = getattr(tok, "backend_tokenizer", None)
    if getattr(tok, "clean_up_tokenization_spaces", False) and type(getattr(backend, "model", None)).__name__ == "BPE":
        # transformers ignores this setting for BPE tokenizers (it would corrupt their text) and says so at the first
        # decode, in the middle of the training panel; False gives the same text without the warning
        tok.clean_up_tokenization_spaces = False
    return tok
