"""Sampling completions and comparing next-token distributions, for the entropy studies (``aqn_entropy.py``,
``entropy_quantization.py``): per-token entropy, KL and top-1 flips between two models over the same tokens."""

from __future__ import annotations

import torch

__all__ = ["completion_mask", "compare", "entropy_of", "mean_dicts", "sample", "teacher_forced_logits"]


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits → ``[...]`` entropy in nats (float64 accumulation)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[B, T]`` → bool mask of the tokens up to and including the first EOS."""
    is_eos = (completions == eos_id).int()
    return (torch.cumsum(is_eos, dim=1) - is_eos) == 0  # no EOS strictly before the position


def sample(model, enc, eos_id: int, new_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Completions of ``enc``'s prompts sampled at T = 1 (no top-k / top-p) from ``seed``: ``(completions [B, T],
    mask [B, T], logits [B, T, V] float32)``; the raw logits are the sampling distribution."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=eos_id,
                             eos_token_id=eos_id)  # fmt: skip
    completions = out.sequences[:, enc["input_ids"].shape[1] :]
    return completions, completion_mask(completions, eos_id), torch.stack(out.logits, dim=1).float()


def teacher_forced_logits(model, enc, completions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``model``'s logits ``[B, T, V]`` (float32) over the given completions of ``enc``'s prompts."""
    ids = torch.cat([enc["input_ids"], completions], dim=1)
    att = torch.cat([enc["attention_mask"], mask.long()], dim=1)
    t = completions.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att, logits_to_keep=t + 1).logits
    return logits[:, :t].float()


def compare(
    ref: torch.Tensor, other: torch.Tensor, mask: torch.Tensor, *, kl_key: str, logit_delta: bool = False
) -> dict[str, float]:
    """Over the masked tokens: ``other``'s mean entropy, the mean KL(ref ‖ other) (under ``kl_key``), the rate at which
    the top-1 token differs, and with ``logit_delta`` the largest absolute logit difference."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    out = {
        "entropy": float(entropy_of(other)[mask].mean()),
        kl_key: float(kl[mask].mean()),
        "top1_flip_rate": float((ref.argmax(-1) != other.argmax(-1))[mask].double().mean()),
    }
    if logit_delta:
        out["max_abs_logit_delta"] = float((ref - other).abs().amax(-1)[mask].max())
    return out


def mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise mean of dicts with the same keys."""
    return {k: sum(d[k] for d in ds) / len(ds) for k in ds[0]}
