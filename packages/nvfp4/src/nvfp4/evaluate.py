"""Quality measurements of a quantized model: per-layer weight error, output error, perplexity, bytes on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from .linear import NVFP4Linear

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["gsm8k_texts", "output_relative_error", "perplexity", "weight_relative_error"]


def _base_name(name: str) -> str:
    """``name`` of a module of ``quantized`` as the dense model names it: without what PEFT adds around a 4-bit layer
    carrying an adapter (``base_model.model.`` before, ``.base_layer`` after)."""
    return name.removeprefix("base_model.model.").removesuffix(".base_layer")


@torch.no_grad()
def weight_relative_error(dense: nn.Module, quantized: nn.Module) -> dict[str, float]:
    """``‖W - dequant(Ŵ)‖_F / ‖W‖_F`` per NVFP4 layer of ``quantized`` (matched by name in ``dense``; a ``PeftModel``'s
    layers by their base model's names) and ``"all"``.

    ``"all"`` is the error over all quantized weights together (sum of squared errors over sum of squared weights).
    """
    dense_modules = dict(dense.named_modules())
    out: dict[str, float] = {}
    num = den = 0.0
    for name, mod in quantized.named_modules():
        if isinstance(mod, NVFP4Linear):
            name = _base_name(name)
            w = dense_modules[name].weight.detach().float()
            e = (mod.dequantize(torch.float32) - w).square().sum().item()
            s = w.square().sum().item()
            out[name] = (e / s) ** 0.5 if s else 0.0
            num, den = num + e, den + s
    out["all"] = (num / den) ** 0.5 if den else 0.0
    return out


@torch.no_grad()
def output_relative_error(dense: nn.Module, quantized: nn.Module, batches: list[torch.Tensor]) -> dict[str, float]:
    """Output error per layer type: ``Σ‖x Wᵀ - x Ŵᵀ‖² / Σ‖x Wᵀ‖²`` (square-rooted) over every NVFP4 layer of
    ``quantized`` whose name ends in that type (``q_proj``, …, ``down_proj``), ``x`` being the layer's input in the
    *quantized* model's own forward on ``batches`` (token ids ``[1, T]``), ``W`` the dense model's weight of that name.
    """
    dense_modules = dict(dense.named_modules())
    sums: dict[str, list[float]] = {}
    handles = []

    def hook(name: str):
        def fn(module, args, output):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            ref = x @ dense_modules[name].weight.detach().float().T
            got = x @ module.dequantize(torch.float32).T
            acc = sums.setdefault(name.rsplit(".", 1)[-1], [0.0, 0.0])
            acc[0] += (got - ref).square().sum().item()
            acc[1] += ref.square().sum().item()

        return fn

    for name, mod in quantized.named_modules():
        if isinstance(mod, NVFP4Linear):
            handles.append(mod.register_forward_hook(hook(_base_name(name))))
    try:
        device = next(quantized.parameters()).device
        for ids in batches:
            quantized(ids.to(device))
    finally:
        for h in handles:
            h.remove()
    return {kind: (e / s) ** 0.5 if s else 0.0 for kind, (e, s) in sums.items()}


def gsm8k_texts(path: str | Path, n: int = 64, offset: int = 0) -> list[str]:
    """The first ``n`` question + answer texts of a GSM8K jsonl file (fields ``question``, ``answer``)."""
    texts = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            if len(texts) == n:
                break
            try:
                row = json.loads(line)
                texts.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
            except (ValueError, KeyError, TypeError) as e:  # another dataset's fields, a line cut short
                raise ValueError(f"{path}: line {i + 1}: not a GSM8K row (a JSON object with question and answer): "
                                 f"{type(e).__name__}: {e}") from None  # fmt: skip
    if not texts:
        raise ValueError(f"{path}: no GSM8K rows read")
    return texts


@torch.no_grad()
def perplexity(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int = 512, progress: bool = True
) -> float:
    """Token-level perplexity of ``model`` on ``texts`` (each text scored on its own, BOS kept, up to ``max_length``).
    ``ValueError`` when no text has a token to score (all of one token, or none)."""
    device = next(model.parameters()).device
    nll = 0.0
    count = 0
    for text in tqdm(texts, desc="perplexity", disable=not progress, leave=False):
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length).input_ids.to(device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        target = ids[:, 1:]
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
        count += target.numel()
    if count == 0:  # one-token texts have no next token to score
        raise ValueError(f"perplexity: none of the {len(texts)} texts has 2 or more tokens, so nothing to score")
    return float(torch.exp(torch.tensor(nll / count)))
