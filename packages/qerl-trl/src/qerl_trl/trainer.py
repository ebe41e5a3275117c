"""``QeRLGRPOTrainer``: TRL's ``GRPOTrainer`` with an NVFP4 policy, LoRA adapters and AQN on the rollout model.

What the subclass adds, each through a method TRL's own trainers override:

* ``__init__``: a model id or path becomes a 4-bit policy (``quantization="nvfp4-rtn"|"nvfp4-mse"``,
  ``"nvfp4-awq"|"nvfp4-gptq"`` calibrated on the first training prompts and cached, ``"mxfp4-rtn"``, ``"nf4"``
  through bitsandbytes (QLoRA), or ``"none"`` for the bf16 baseline; :mod:`qerl_trl.quantization`); the PEFT ``LoraConfig`` (paper defaults) maps ``NVFP4Linear`` to :class:`nvfp4.peft.LoraNVFP4Linear`
  through PEFT's custom-module hook, so only the bf16 adapters train and merges export ``dequant(W) + ΔW``.
* ``_generate_single_turn``: AQN noise goes on the RMSNorm weights of the generating model for one generation step
  (σ from the schedule at ``global_step``; restored bit-identically afterwards, before scoring and the loss);
  generation tokens/s are logged. With ``rollout_seed_per_prompt``, each prompt group is generated in its own call
  from a seed that depends only on (seed, step, the group's index in the global batch): the same rollouts on 1 or N
  processes.
* the rollouts come from one :class:`~qerl_trl.rollout.RolloutEngine` (``self.rollout``, :mod:`qerl_trl.rollout`,
  chosen by ``rollout_engine``): ``"transformers"`` (the policy's ``generate``), ``"graph"`` (opt-in:
  :func:`~qerl_trl.rollout.graph.generate.graph_generate`, one compiled CUDA graph per decode step, sampling included, no host
  sync per step; it returns its sampling logprobs) or ``"vllm"`` (colocate or server, LoRA synced as an adapter each
  step, AQN on the engine's norms). On the engines that return sampling logprobs (graph, vLLM) TRL's
  importance-sampling correction runs. The trainer calls the engine's interface only: ``sync_lora`` once per
  ``global_step``, ``set_noise`` and ``generate`` per generation call, ``close``.
* ``train``: on CPU the NVFP4 weights are dequantized once for the run; under DDP the 4-bit buffers are left out of
  DDP's broadcasts (every rank loads the same frozen base; only the LoRA gradients are all-reduced).
* ``_prepare_inputs``: where the optimizer step does not depend on it (:meth:`QeRLGRPOTrainer._regroups_micro_batches`),
  a generation batch's micro-batches are re-split: on GPUs by completion length, each cut to its longest row
  (:func:`micro_batches_by_length`; TRL pads every micro-batch to the batch's longest completion), on CPU by prompt.
* ``_generate_and_score_completions`` / ``_compute_loss``: on-policy vLLM steps take TRL's sampling correction from
  the loss forward's own logprobs (:func:`sampling_correction`) instead of a second, no-grad forward over the batch.
* ``training_step``: training tokens/s (prompt + completion tokens over the time spent outside generation).
* ``_save_checkpoint`` / ``_load_optimizer_and_scheduler``: checkpoints are written into a staging folder, fsynced and
  renamed into place (:mod:`qerl_trl.checkpoints`: a crash never leaves a half-written ``checkpoint-N``; with several
  processes the main one renames it once every rank has written its RNG state), with the AQN controller state beside
  the optimizer (written once), so ``resume_from_checkpoint`` continues in the same σ stage with the same noise;
  ``save_total_limit`` rotates older ones only after the new one is in place, and never the newest.
* ``train(resume_from_checkpoint=True)``: the newest checkpoint that is complete and readable, not the newest folder.

Metrics added to TRL's (reward mean/std, ``entropy``, ``clip_ratio/*``, ``completions/mean_length``):
``aqn/sigma``, ``aqn/stage``, ``tokens_per_second/generation``, ``tokens_per_second/training``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
from aqn import AQNController, make_schedule
from nvfp4 import NVFP4Linear, cache_dequantized
from nvfp4.fsdp import fully_shard_quantized
from nvfp4.peft import register_nvfp4_lora
from peft import LoraConfig, PeftModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from .checkpoints import (
    AQN_STATE_NAME,
    STAGING_DIR,
    CheckpointError,
    check_checkpoint,
    find_resume_checkpoint,
    later_checkpoints,
    publish_checkpoint,
    required_checkpoint_files,
    rotate_checkpoints,
    write_manifest,
)
from .config import QeRLConfig
from .memory_plan import fsdp2_requested
from .policy import calibration_prompt_ids, load_policy, load_tokenizer
from .rollout import RolloutEngine
from .run import CALIBRATED_DIR
from .validation import check_enough_prompts

#: SDPA backends of a training step: every one but cuDNN, whose backward returns NaN in dQ when an explicit mask meets
#: a sequence length % 128 == 64 and a row whose logsumexp is below -88.7, e.g. a left-padded prompt position
#: (pytorch/pytorch#196678; torch 2.11 on the H100 picks cuDNN by default). The forward and the loss stay finite, so
#: the LoRA weights silently turn NaN: GSM8K seed 0 did so at step 31 in every arm, the batch of 448 tokens. The whole
#: step runs under it because gradient checkpointing recomputes the forward inside the backward.
TRAINING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

logger = logging.getLogger(__name__)

__all__ = [
    "AQN_STATE_NAME",
    "GROUPING_FREE_LOSSES",
    "TOKEN_SUM_LOSSES",
    "balanced_sizes",
    "completion_aligned",
    "NonFiniteGradientError",
    "QeRLGRPOTrainer",
    "StopOnNonFiniteGradients",
    "TRAINING_SDPA_BACKENDS",
    "lora_config_from_args",
    "micro_batches_by_length",
    "micro_batches_by_prompt",
    "prompt_groups",
    "quantized_buffer_names",
    "rollout_seed",
    "sampling_correction",
    "score_completions",
    "trim_completion_padding",
]


class NonFiniteGradientError(FloatingPointError):
    """A training step's gradients were NaN or infinite; raised before the optimizer step, so no weight changed."""


class StopOnNonFiniteGradients(TrainerCallback):
    """Raise :class:`NonFiniteGradientError` before an optimizer step whose gradients are not all finite.

    Why: the loss can be finite while the backward is not (see :data:`TRAINING_SDPA_BACKENDS`); one such step turns
    every LoRA weight NaN, and the run then goes on for hundreds of steps logging zero rewards and saving NaN adapters.
    Stopping keeps the weights and the checkpoints already written as they were. Cost: one norm over the trainable
    gradients and one device sync per optimizer step.
    """

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # after gradient clipping, which spreads one NaN to every tensor: only the norm says anything here
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else None
        if norm is None or torch.isfinite(norm):
            return
        raise NonFiniteGradientError(
            f"step {state.global_step + 1}: the gradient norm is {norm.item()}; stopped before the optimizer step, so "
            f"the weights and the checkpoints in {args.output_dir} are unchanged. If the model runs outside "
            "QeRLGRPOTrainer.training_step on CUDA, turn cuDNN SDPA off there too "
            "(qerl_trl.trainer.TRAINING_SDPA_BACKENDS, pytorch/pytorch#196678)"
        )


def _named_rewards(reward_funcs: Any) -> Any:
    """``reward_funcs`` with each string that names a QeRL reward (:data:`qerl_trl.rewards.REWARD_FUNCS`, the names
    ``--reward_funcs`` and the recipes take) and is no local path replaced by its function; TRL reads any other string
    as a reward model's id or path."""
    from .rewards import REWARD_FUNCS

    if reward_funcs is None:
        return None
    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    return [REWARD_FUNCS[f] if isinstance(f, str) and f in REWARD_FUNCS and not os.path.exists(f) else f for f in funcs]


def _check_prompt_column(dataset: Any, what: str) -> None:
    """Raise ``ValueError`` when ``dataset`` (a ``datasets`` data set whose columns are known) has no ``prompt``
    column, the one column TRL's GRPO reads."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and "prompt" not in columns:
        raise ValueError(f"{what} has no 'prompt' column (columns: {', '.join(columns) or 'none'}); GRPO generates "
                         "from it: rename the column holding the prompts, e.g. dataset.rename_column('question', "
                         "'prompt')")  # fmt: skip


def _check_chat_template(processing_class: Any, dataset: Any) -> None:
    """Raise ``ValueError`` when the prompts of ``dataset`` (its first row) are chat messages and ``processing_class``
    has no chat template: transformers refuses it at the first prompt, after the policy loaded and quantized."""
    if processing_class is None or getattr(processing_class, "chat_template", None):
        return
    try:
        first = next(iter(dataset))["prompt"] if dataset is not None else None
    except (StopIteration, KeyError, TypeError):
        return
    if isinstance(first, list):
        raise ValueError("train_dataset's prompts are chat messages and the tokenizer has no chat template (a base "
                         "model's): use an instruct/chat model, a processing_class with a chat template, or "
                         "plain-text prompts")  # fmt: skip


def _is_quantized(model: torch.nn.Module) -> bool:
    """Whether a loaded model's base weights are 4-bit: NVFP4 / MXFP4 (``NVFP4Linear``) or quantized by transformers
    (bitsandbytes NF4 and the like)."""
    if any(getattr(model, flag, False) for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit", "is_quantized")):
        return True
    return any(isinstance(m, NVFP4Linear) for m in model.modules())


def lora_config_from_args(args: QeRLConfig) -> LoraConfig:
    """The paper's LoRA: rank ``lora_r``, α = ``lora_alpha`` (= r by default), every attention and MLP projection."""
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.lora_target_modules,
        task_type="CAUSAL_LM",
    )


def rollout_seed(seed: int, step: int, call: int, index: int) -> int:
    """The sampling seed of one prompt group (``rollout_seed_per_prompt``): a hash of the run's ``seed``, the
    ``global_step``, the generation call within that step (DAPO refill rounds) and the group's index in the global
    batch — nothing that depends on the number of processes."""
    digest = hashlib.blake2b(f"{seed}:{step}:{call}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def quantized_buffer_names(model: torch.nn.Module) -> list[str]:
    """Fully qualified names of the NVFP4 buffers (packed weights, block and global scales) of ``model``."""
    from nvfp4.linear import NVFP4Linear

    return [
        f"{name}.{buf}" if name else buf
        for name, module in model.named_modules()
        if isinstance(module, NVFP4Linear)
        for buf in NVFP4Linear._QUANT_BUFFERS
    ]


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Which distinct prompt each row holds: ``[B]`` int64 indices ``0..U-1``, equal where the first ``prompt_len``
    tokens and mask of two rows are (a GRPO group: ``num_generations`` rows of one prompt, padded alike), numbered
    in order of first appearance."""
    key = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].to(input_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first_seen = torch.full((int(inverse.max()) + 1,), input_ids.size(0), dtype=torch.long)
    first_seen.scatter_reduce_(0, inverse, torch.arange(input_ids.size(0)), reduce="amin")
    return first_seen.argsort().argsort()[inverse]


def packs_prompts(model: torch.nn.Module, attention_mask: torch.Tensor, logits_to_keep: int) -> bool:
    """Whether :func:`packed_completion_logits` computes what one forward over the whole sequences would: SDPA or
    eager attention (a custom 4-D mask is taken as given), no sliding window narrower than the sequence (the packed
    mask does not apply one), no gradient checkpointing (the checkpointed layers rebuild their own masks), and every
    prompt ending in a real token (it predicts the first completion token)."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    return (
        getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
        and (window is None or window >= attention_mask.size(1))
        and not getattr(model, "is_gradient_checkpointing", False)
        and attention_mask.size(1) > logits_to_keep
        and bool(attention_mask[:, -logits_to_keep - 1].all())
    )


def packed_completion_logits(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, logits_to_keep: int, group: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits that predict the scored completion tokens of ``ids`` (``[b, T]``, prompt then ``logits_to_keep``
    completion tokens), from one forward over one packed row: each distinct prompt once (``group``: ``[b]``, which
    prompt each row holds, 0..U-1), each completion after it without its trailing padding.

    A 4-D mask lets a prompt token see its prompt's earlier tokens and a completion token its prompt and its own
    earlier tokens; tokens whose ``mask`` is 0 are never seen; every token keeps its position id in the unpacked
    row (``0..T-1``, as the whole-sequence forward numbers them). So each scored logit is the one a forward over the
    whole ``[b, T]`` batch computes (to float rounding), for ``Σ prompt + Σ completion`` token rows instead of
    ``b·T`` and no per-row copy of a prompt's keys and values; gradients reach the prompt through attention.
    Returns the logits ``[K, vocab]`` of the ``K`` completion positions whose ``mask`` is 1, and their row and column
    (``[K]`` each, into ``[b, logits_to_keep]``).
    """
    b, total = ids.shape
    prompt_len = total - logits_to_keep
    device = ids.device
    ids, mask, group = ids.cpu(), mask.cpu(), group.cpu()  # the packing is index bookkeeping
    kept = _kept_lengths(mask[:, prompt_len:]).tolist()  # completion tokens kept per row: through the last real one
    # per packed token: id, position, seen at all, prompt group, owner (a completion's row, -1 for a prompt token)
    tokens, positions, valid, groups, owners = [], [], [], [], []
    score_rows, score_cols, predictors = [], [], []  # per scored token: row, column, the packed index predicting it
    n = 0
    for g in range(int(group.max()) + 1):
        rows = (group == g).nonzero().squeeze(-1).tolist()
        real = mask[rows[0], :prompt_len].bool()
        length = int(real.sum())
        tokens.append(ids[rows[0], :prompt_len][real])
        positions.append(real.nonzero().squeeze(-1))
        valid.append(torch.ones(length, dtype=torch.bool))
        groups.append(torch.full((length,), g))
        owners.append(torch.full((length,), -1))
        n += length
        prompt_end = n - 1  # its last token predicts each completion's first
        for r in rows:
            length = kept[r]
            real = mask[r, prompt_len : prompt_len + length].bool()  # masked tokens inside the span are never seen
            tokens.append(ids[r, prompt_len : prompt_len + length])
            positions.append(torch.arange(prompt_len, prompt_len + length))
            valid.append(real)
            groups.append(torch.full((length,), g))
            owners.append(torch.full((length,), r))
            cols = real.nonzero().squeeze(-1)
            score_rows.append(torch.full_like(cols, r))
            score_cols.append(cols)
            predictors.append(torch.where(cols == 0, prompt_end, n + cols - 1))
            n += length
    flat_ids = torch.cat(tokens).to(device)[None]
    position_ids = torch.cat(positions).to(device)[None]
    group_of, owner_of, valid = torch.cat(groups), torch.cat(owners), torch.cat(valid)
    order = torch.arange(n)
    allowed = ((group_of[:, None] == group_of[None, :]) & (order[None, :] <= order[:, None])
               & ((owner_of[None, :] == -1) | (owner_of[None, :] == owner_of[:, None])) & valid[None, :])  # fmt: skip
    if model.config._attn_implementation == "eager":  # eager adds the mask to the scores
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        mask_4d = torch.zeros(n, n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    else:
        mask_4d = allowed
    score_rows, score_cols = torch.cat(score_rows), torch.cat(score_cols)
    logits = model(input_ids=flat_ids, attention_mask=mask_4d[None, None].to(device), position_ids=position_ids,
                   use_cache=False, logits_to_keep=torch.cat(predictors).to(device)).logits[0]  # fmt: skip
    return logits, score_rows.to(device), score_cols.to(device)


def score_completions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    share_prompts: bool = True,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """Per-token log-probabilities (and entropies) of the last ``logits_to_keep`` tokens of each sequence, as TRL's
    ``_get_per_token_logps_and_entropies`` returns them, from logits of those positions only.

    ``input_ids`` / ``attention_mask``: ``[B, T]`` (prompt + completion). The LM head runs on the completion positions
    only, not on TRL's CPU path's every position (``[b·(T-1), vocab]``: 6x the work for the offline default's
    62-token prompts and 12-token completions). With ``share_prompts``, rows that hold the same prompt
    (:func:`prompt_groups`; a GRPO group) are packed into one row where the prompt appears once and each completion
    follows it without its padding (:func:`packed_completion_logits`, where :func:`packs_prompts` allows): the
    offline default's micro-batch of one group is 62 + 8 × ≤ 12 token rows in one forward instead of 8 × 74. Each
    forward takes whole prompt groups of at most ``batch_size`` sequences (default all; a larger group goes alone),
    else (and where the packed row would cost more than the whole sequences, :func:`_packing_pays`) ``batch_size``
    sequences. Log-softmax of ``logits / temperature`` in float32, the model's own logit
    transforms (softcapping, scales) included. Positions whose ``attention_mask`` is 0 get 0, as TRL's.
    ``entropy_grad=False`` computes the entropies outside autograd (metrics and masks: no vocabulary-sized tensor
    kept for the backward). Returns float32 ``[B, logits_to_keep]`` log-probabilities, the entropies (or None) and
    None (no MoE aux loss).
    """
    rows = input_ids.size(0)
    batch_size = batch_size or rows
    inv_t = 1 / temperature  # TRL's fused head multiplies by it
    prompt_len = input_ids.size(1) - logits_to_keep
    group = prompt_groups(input_ids, attention_mask, prompt_len) if prompt_len > 0 else torch.arange(rows)
    packed = share_prompts and int(group.max()) + 1 < rows and packs_prompts(model, attention_mask, logits_to_keep)
    chunks = [(index, False) for index in torch.arange(rows).split(batch_size)]  # (rows, packed?) per forward
    if packed:
        chunks = []
        for index in _group_chunks(group, batch_size):
            if _packing_pays(attention_mask[index], group[index], prompt_len, model.config.hidden_size):
                chunks.append((index, True))
            else:  # long completions behind a short prompt: whole sequences
                chunks += [(piece, False) for piece in index.split(batch_size)]
    logps = torch.zeros(rows, logits_to_keep, dtype=torch.float32, device=input_ids.device)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    for index, pack in chunks:
        index = index.to(input_ids.device)
        ids, mask = input_ids[index], attention_mask[index]
        if pack:  # logits [K, vocab] of the K scored positions (at_row, at_col)
            local_group = group[index.cpu()].unique(return_inverse=True)[1]
            logits, at_row, at_col = packed_completion_logits(model, ids, mask, logits_to_keep, local_group)
            where = (index[at_row], at_col)
            targets = ids[at_row, prompt_len + at_col]
        else:  # logits [b, logits_to_keep, vocab]; padding scored as 0 below
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep + 1,
                           use_cache=False).logits[:, :-1]  # fmt: skip  # position i predicts token i + 1
            where = (index,)
            targets = ids[:, -logits_to_keep:]
        logits = logits.float()
        log_p = (logits * inv_t if inv_t != 1 else logits).log_softmax(-1)
        del logits
        token_logps = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = -(log_p.exp() * log_p).sum(-1) if compute_entropy else None
        del log_p
        if not pack:
            scored = mask[:, -logits_to_keep:].bool()
            token_logps = token_logps.masked_fill(~scored, 0)
            entropy = entropy.masked_fill(~scored, 0) if compute_entropy else None
        logps = logps.index_put(where, token_logps)
        if compute_entropy:
            entropies = entropies.index_put(where, entropy)
    return logps, entropies, None


def _packing_pays(mask: torch.Tensor, group: torch.Tensor, prompt_len: int, hidden_size: int) -> bool:
    """Whether the packed row of these rows (:func:`packed_completion_logits`; ``mask`` ``[b, T]``, ``group`` ``[b]``
    which prompt each row holds) costs no more than a forward over the ``b`` whole sequences. Per layer a token's
    projections cost ~24·H² FLOPs (Llama-style: 4·H² of attention, 16·H²-20·H² of MLP) and a query-key pair ~4·H
    (QKᵀ and PV), so a token weighs ``6·H`` pairs: packed ``n`` tokens (each prompt's real tokens once, every
    completion through its last real one) and ``n²`` pairs against ``b·T`` tokens and ``b·T²`` pairs. Long
    completions behind a short prompt would pack into a row whose attention grows with the square of the group's
    total length."""
    prompt_tokens = mask[:, :prompt_len].sum(1)
    n = sum(int(prompt_tokens[group == g][0]) for g in group.unique().tolist())
    n += int(_kept_lengths(mask[:, prompt_len:]).sum())
    b, t = mask.shape
    return n * 6 * hidden_size + n * n <= b * t * 6 * hidden_size + b * t * t


def _kept_lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """``[b]`` int64: the completion positions of each row through its last real token (``completion_mask`` ``[b, C]``;
    0 for a row with none), what :func:`packed_completion_logits` packs."""
    c = completion_mask.size(1)
    return torch.where(completion_mask.any(1), c - completion_mask.flip(1).int().argmax(1), 0)


def _group_chunks(group: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Row indices of each forward: whole prompt groups, in order, while they fit ``batch_size`` rows."""
    chunks, current, size = [], [], 0
    for g in range(int(group.max()) + 1):
        members = (group == g).nonzero().squeeze(-1)
        if current and size + len(members) > batch_size:
            chunks.append(torch.cat(current))
            current, size = [], 0
        current.append(members)
        size += len(members)
    chunks.append(torch.cat(current))
    return chunks


#: TRL loss types whose optimizer-step gradient does not depend on which rows of a generation batch share a
#: micro-batch (micro-batches of equal size): a mean over sequences, or a sum normalized by the whole generation batch's
#: token count. ``bnpo`` normalizes by each micro-batch's own tokens; ``vespo``'s weights are left out to be safe.
GROUPING_FREE_LOSSES = frozenset({"grpo", "sapo", "dr_grpo", "dapo", "cispo", "luspo"})
#: The loss types among those that sum over tokens and divide by the whole generation batch's token count
#: (``num_items_in_batch``): their step does not depend on the micro-batches' sizes either.
TOKEN_SUM_LOSSES = frozenset({"dapo", "cispo"})


def _merged_micro_batches(micro_batches: list[dict[str, Any]]) -> dict[str, Any] | None:
    """TRL's buffered micro-batches of one generation batch concatenated back into one batch of rows, or None where a
    value is not one row per sequence (images) and the rows cannot be re-split."""
    merged: dict[str, Any] = {}
    for key, first in micro_batches[0].items():
        values = [b[key] for b in micro_batches]
        if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
            merged[key] = first
        elif isinstance(first, torch.Tensor) and all(v.shape[1:] == first.shape[1:] for v in values):
            merged[key] = torch.cat(values)
        elif isinstance(first, list):
            merged[key] = [x for v in values for x in v]
        else:
            return None
    rows = merged["prompt_ids"].size(0)
    if any(isinstance(v, torch.Tensor | list) and len(v) != rows for v in merged.values() if v is not None
           and not (isinstance(v, torch.Tensor) and v.ndim == 0)) or "pixel_values" in merged:  # fmt: skip
        return None
    return merged


def _resplit(merged: dict[str, Any], order: torch.Tensor, sizes: list[int]) -> list[dict[str, Any]]:
    """The rows of ``merged`` in ``order`` (``[B]`` int64), split into consecutive micro-batches of ``sizes`` rows
    (summing to ``B``); values that are not one per row (``None``, scalars) go to every micro-batch."""
    ordered = {k: v if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0)
               else v[order.to(v.device)] if isinstance(v, torch.Tensor) else [v[i] for i in order.tolist()]
               for k, v in merged.items()}  # fmt: skip
    bounds = [0, *itertools.accumulate(sizes)]
    return [{k: v if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0) else v[a:b] for k, v in ordered.items()}
            for a, b in itertools.pairwise(bounds)]  # fmt: skip


def balanced_sizes(lengths: list[int], width: int, parts: int, fewest: bool = False) -> list[int]:
    """Sizes of ``parts`` consecutive micro-batches of rows sorted by length (``lengths`` ascending, each row's kept
    completion length; ``width`` the prompt columns every row carries) that make the largest micro-batch's padded
    positions, ``rows × (width + its longest length)``, as small as it can be: short rows many to a micro-batch, long
    rows few. Each size ≥ 1 (``len(lengths) >= parts``).

    With ``fewest``, as few micro-batches as hold the rows under that same largest size, then empty ones (size 0) up
    to ``parts``: the peak positions of a micro-batch are unchanged, the micro-batches fuller. The 32B DAPO recipe
    trains one row per micro-batch (its worst case, a 8,192-token completion, must fit alone), so 128 micro-batches of
    ~1,300 positions; packed under the longest row's positions they are ~25-45 of up to ~7,600."""
    n = len(lengths)

    def chunks(bound: int) -> list[int] | None:  # greedy from the longest row: as many rows as fit the bound
        sizes, end = [], n
        while end > 0:
            cost = width + lengths[end - 1]
            take = min(end, max(1, bound // cost))
            if take * cost > bound:
                return None
            sizes.append(take)
            end -= take
        return sizes[::-1]

    low, high = width + lengths[-1], n * (width + lengths[-1])
    while low < high:
        mid = (low + high) // 2
        sizes = chunks(mid)
        low, high = (low, mid) if sizes is not None and len(sizes) <= parts else (mid + 1, high)
    sizes = chunks(low)  # greedy from the longest row: the fewest consecutive micro-batches under the bound
    if fewest:
        return sizes + [0] * (parts - len(sizes))
    while len(sizes) < parts:  # halving a micro-batch never raises the largest one's padded positions
        i = max(range(len(sizes)), key=lambda j: sizes[j])
        sizes[i : i + 1] = [sizes[i] // 2, sizes[i] - sizes[i] // 2]
    return sizes


def micro_batches_by_prompt(micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's buffered micro-batches of one generation batch (``_buffered_inputs``: the rows shuffled, then split)
    re-split with the rows of each prompt together: groups in the order the shuffle left them, the same number of
    micro-batches of the same size.

    For the loss types of :data:`GROUPING_FREE_LOSSES`, when the micro-batches of a generation batch make one
    optimizer step, the step's gradient does not depend on which rows share a micro-batch; together they let
    :func:`score_completions` run each prompt once. Returned unchanged when a value is not one row per sequence
    (images) or the batch is not split.
    """
    merged = _merged_micro_batches(micro_batches) if len(micro_batches) > 1 else None
    if merged is None:
        return micro_batches
    group = prompt_groups(merged["prompt_ids"].cpu(), merged["prompt_mask"].cpu(), merged["prompt_ids"].size(1))
    return _resplit(merged, torch.sort(group, stable=True).indices, [b["prompt_ids"].size(0) for b in micro_batches])


def completion_aligned(batch: dict[str, Any]) -> list[str]:
    """The keys of ``batch``'s per-completion-token tensors: those whose first two dimensions are ``completion_mask``'s
    ``[b, C]`` (``completion_ids``, ``old_per_token_logps``, ``sampling_per_token_logps``, a token-level
    ``importance_sampling_ratio``, ...), the prompt's aside."""
    shape = tuple(batch["completion_mask"].shape)
    return [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.ndim >= 2
            and tuple(v.shape[:2]) == shape and not k.startswith("prompt")]  # fmt: skip


def trim_completion_padding(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with its completion columns cut after the last real token of its longest row.

    TRL pads every completion of a generation batch to the batch's longest (``completion_ids`` / ``completion_mask``
    ``[b, C]``, and per-token tensors such as ``old_per_token_logps`` beside them), so a micro-batch of short rows
    still runs ``C`` positions through the loss forward and backward. The columns cut are padding in every row of
    this micro-batch: under causal attention no kept position sees them and the loss masks them, so the loss and its
    gradient are unchanged. Every tensor of :func:`completion_aligned` is cut alike.
    """
    mask = batch["completion_mask"]
    columns = mask.size(1)
    keep = max(int(_kept_lengths(mask).max()), 1) if mask.numel() else columns
    if keep == columns:
        return batch
    return batch | {k: batch[k][:, :keep] for k in completion_aligned(batch)}


def micro_batches_by_length(
    micro_batches: list[dict[str, Any]], balance: bool = False, fewest: bool = False
) -> list[dict[str, Any]]:
    """TRL's buffered micro-batches of one generation batch re-split by completion length (rows sorted by their
    last real token, the same number of micro-batches), each cut to its own longest row
    (:func:`trim_completion_padding`).

    With TRL's shuffle every micro-batch carries the generation batch's longest completion: the 7B GSM8K recipe's
    128 completions (mean ~300 tokens, longest ~1,100-1,500) made every micro-batch ~1,400 positions long. Sorted, the
    short rows run together at their own length. Micro-batches keep their size, or with ``balance`` (losses summed
    over tokens and normalized by the whole batch's count, :data:`TOKEN_SUM_LOSSES`) get sizes that even out their
    padded positions (:func:`balanced_sizes`): the longest rows go few to a micro-batch, which bounds the loss's
    activation memory by ~1/``parts`` of the batch's tokens instead of ``rows × longest``. The step's gradient is
    unchanged for the loss types of :data:`GROUPING_FREE_LOSSES` (sizes kept) or :data:`TOKEN_SUM_LOSSES` (balanced)
    when the micro-batches make one optimizer step (the caller checks). With ``fewest`` (balanced sizes only) the rows
    go into as few micro-batches as hold them under the balanced split's largest padded size, the rest left empty
    (0 rows; :meth:`QeRLGRPOTrainer.compute_loss` skips them). A batch that cannot be re-split (images) keeps its split
    and is only trimmed.
    """
    merged = _merged_micro_batches(micro_batches) if len(micro_batches) > 1 else None
    if merged is not None:
        length = _kept_lengths(merged["completion_mask"]).cpu()
        order = torch.sort(length, stable=True).indices
        sizes = [b["prompt_ids"].size(0) for b in micro_batches]
        if balance:
            sizes = balanced_sizes(length[order].tolist(), merged["prompt_ids"].size(1), len(sizes), fewest)
        micro_batches = _resplit(merged, order, sizes)
    return [trim_completion_padding(b) for b in micro_batches]


def sampling_correction(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's importance-sampling correction for the gap between the engine that sampled and the trainer (its
    ``vllm_importance_sampling_*`` settings), from the trainer's logprobs of the sampled tokens.

    ``trainer_logps`` / ``sampling_logps`` / ``mask``: ``[b, C]`` (float32 log-probabilities; ``sampling_logps`` NaN
    where the engine gave none: ratio 1 there). ``mode``: ``token_truncate`` | ``token_mask`` | ``sequence_truncate`` |
    ``sequence_mask``. Returns the ratio ``exp(trainer - sampling)``, ``[b, C]`` for token modes and ``[b, 1]`` for
    sequence modes (summed over the sequence), clamped to ``[clip_min, clip_max]`` (truncate) or zeroed outside it
    (mask), as ``GRPOTrainer._generate_and_score_completions`` computes it.
    """
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    level, _, how = mode.partition("_")
    if level not in ("token", "sequence") or how not in ("truncate", "mask"):
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}: token_truncate, token_mask, "
                         "sequence_truncate or sequence_mask")  # fmt: skip
    ratio = (diff.sum(-1, keepdim=True) if level == "sequence" else diff).exp()
    if how == "truncate":
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


class QeRLGRPOTrainer(GRPOTrainer):
    """GRPO on a 4-bit NVFP4 policy with LoRA and Adaptive Quantization Noise.

    Args:
        model: a model id / local path / ``"offline-default"`` (loaded with ``args.quantization``), or a loaded
            ``PreTrainedModel`` (4-bit, or dense with ``quantization="none"``) or ``PeftModel``.
        reward_funcs: TRL reward functions (see :mod:`qerl_trl.rewards`; a name of its ``REWARD_FUNCS`` is that
            function, any other string a reward model's id or path, as in TRL).
        args: :class:`~qerl_trl.QeRLConfig`.
        train_dataset: rows with a ``prompt`` column (see :mod:`qerl_trl.tasks`).
        peft_config: default :func:`lora_config_from_args`; not with a ``model`` that already is a ``PeftModel``.
        aqn_controller: an :class:`aqn.AQNController` to use instead of the one built from ``args`` (e.g. shared with
            an external engine); ``None`` and ``args.aqn`` builds one over ``max_steps`` when training starts.
        Other arguments go to ``trl.GRPOTrainer``.
    """

    _tag_names = ["trl", "grpo", "qerl", "nvfp4", "aqn"]

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: Callable | list[Callable] | None = None,
        args: QeRLConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list[TrainerCallback] | None = None,
        peft_config: LoraConfig | None = None,
        aqn_controller: AQNController | None = None,
        **kwargs: Any,
    ) -> None:
        if args is None:
            args = QeRLConfig(output_dir="runs/qerl-grpo")
        if not isinstance(args, QeRLConfig):
            raise TypeError(
                f"args must be a qerl_trl.QeRLConfig (a GRPOConfig with QeRL fields), got {type(args).__name__}"
            )
        args.rollout_engine_class.check_environment(args)  # a missing vLLM stops here, before the policy loads
        reward_funcs = _named_rewards(reward_funcs)
        _check_prompt_column(train_dataset, "train_dataset")  # TRL reads it only in the first step: KeyError 'prompt'
        for name, dataset in (eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]):
            _check_prompt_column(dataset, f"eval_dataset[{name!r}]" if name else "eval_dataset")
        check_enough_prompts(train_dataset, args)  # else TRL's sampler yields no batch: 0 steps, an untrained adapter
        model_name = model if isinstance(model, str) else None
        if model_name is not None and processing_class is None:
            processing_class = load_tokenizer(model_name)
        _check_chat_template(processing_class, train_dataset)  # else transformers says so after the load
        if isinstance(model, str):
            calibration = None
            if args.quant_scheme.calibrated:
                calibration = calibration_prompt_ids(train_dataset, processing_class, args.calibration_samples)
            model = load_policy(model, quantization=args.quant_scheme, calibration_data=calibration,
                                cache_dir=args.calibration_cache_dir or os.path.join(args.output_dir, CALIBRATED_DIR),
                                nf4_double_quant=args.nf4_double_quant)  # fmt: skip
        elif not args.quant_scheme.is_dense and not _is_quantized(model):
            # a loaded dense model is not quantized here: it would train as the bf16 baseline under a 4-bit config
            raise ValueError(
                f"model is a dense {type(model).__name__} but quantization={args.quantization!r}: pass its path to "
                f"quantize it on load, convert it first (qerl_trl.quantization.SCHEMES[{args.quantization!r}]"
                ".quantize_(model)), or set quantization='none' for the bf16 LoRA baseline"
            )
        if isinstance(model, PeftModel) and peft_config is not None:  # TRL refuses it too; the config was dropped
            raise ValueError(
                "model is a PeftModel and peft_config was given too: the model's own adapter would train and "
                "peft_config be ignored; pass the base model with peft_config, or the PeftModel without it"
            )
        engine_cls = args.rollout_engine_class
        prepared = engine_cls.prepare(model_name, model, args.quant_scheme, args)  # before PEFT wraps the model
        if isinstance(model, PeftModel):
            peft_config = None
        elif peft_config is None:
            peft_config = lora_config_from_args(args)
        if peft_config is not None:
            register_nvfp4_lora(peft_config)  # NVFP4Linear → LoraNVFP4Linear (PEFT's custom-module hook)
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            peft_config=peft_config,
            **kwargs,
        )
        if peft_config is not None and getattr(self.model, "is_loaded_in_4bit", False):
            # bitsandbytes NF4 (quantization="nf4"): TRL casts a k-bit model's new adapters to bf16 (its QLoRA recipe);
            # PEFT keeps them in fp32 for every other policy here (NVFP4, MXFP4, bf16), so do the same: the formats
            # then differ only in the frozen base weights, not in the precision of what trains
            for param in self.model.parameters():
                if param.requires_grad and param.dtype != torch.float32:
                    param.data = param.data.float()
        self.add_callback(StopOnNonFiniteGradients())
        self.aqn: AQNController | None = aqn_controller
        self._generation_seconds = 0.0
        #: ((mode, global_step), generation calls made in that step): counted per mode, so that an evaluation at
        #: step N does not shift the seeds of step N's training calls (a resumed run replays no evaluation)
        self._rollout_calls: tuple[tuple[str, int], int] = (("", -1), 0)
        #: the deferred sampling correction: the micro-batch whose loss forward fills its ratio, and the statistics of
        #: the generation batch's micro-batches scored so far (:meth:`_deferred_correction`)
        self._pending_correction: dict[str, Any] | None = None
        self._correction_stats: list[torch.Tensor] = []
        if engine_cls.sampling_logprobs:
            # TRL 1.16 runs its importance-sampling correction (vllm_importance_sampling_*, sampling/* metrics) under
            # its use_vllm attribute only; TRL's vLLM generation branch is never entered (_generate_single_turn is
            # this class's), but its tool loop and rollout_func path would look for TRL's own engine
            if self.tools or self.rollout_func is not None:
                raise ValueError(f"rollout_engine={engine_cls.name!r} does not support TRL's tools, "
                                 "environment_factory or rollout_func")  # fmt: skip
            self.use_vllm = True
        #: the engine that generates the rollouts (``args.rollout_engine``), :mod:`qerl_trl.rollout`
        self.rollout: RolloutEngine = engine_cls(self, prepared)
        self._lora_synced_step = -1  # the global_step whose adapter the engine has (RolloutEngine.sync_lora)

    # ------------------------------------------------------------------ AQN
    def build_aqn_controller(self, total_steps: int) -> AQNController | None:
        """The controller ``args`` describes, with the schedule spread over ``total_steps``; ``None`` if AQN is off."""
        if not self.args.aqn:
            return None
        schedule = make_schedule(
            self.args.aqn_schedule,
            self.args.aqn_sigma_start,
            self.args.aqn_sigma_end,
            self.args.aqn_num_stages,
            total_steps=max(int(total_steps), 1),
        )
        empty = [k for k, (first, end) in enumerate(schedule.stage_bounds()) if first >= end]
        if empty:  # more stages than steps: the schedule skips some (aqn's rule), which the arguments did not ask for
            noisy = [k for k in range(1, schedule.num_stages) if k not in empty]
            what = (f"their sigmas ({', '.join(f'{schedule.sigma_for_stage(k):g}' for k in empty if k)}) never used"
                    if noisy or schedule.noise_in_stage0 else "AQN adds no noise at all")  # fmt: skip
            logger.warning("aqn_num_stages %d over %d training steps: stage(s) %s get no step, %s; set "
                           "aqn_num_stages <= %d (or train more steps) to place every stage", schedule.num_stages,
                           schedule.total_steps, ", ".join(map(str, empty)), what, schedule.total_steps)  # fmt: skip
        norm_dtype = torch.float32 if self.model.dtype in (torch.bfloat16, torch.float16) else None
        # bf16 norm weights round σ ≤ 1e-3 away; the noisy norms are kept in fp32 while they are on.
        return AQNController(schedule, seed=self.args.seed, mode=self.args.aqn_mode, norm_dtype=norm_dtype)

    def _ensure_aqn(self) -> AQNController | None:
        if self.aqn is None and self.args.aqn:
            self.aqn = self.build_aqn_controller(self.state.max_steps)
        return self.aqn

    def _rollout_noise(self):
        """Context manager: AQN noise on the generating model's norms for this step (nothing when σ = 0 or AQN off)."""
        ctl = self._ensure_aqn()
        if ctl is None or not self.model.training:
            return contextlib.nullcontext()
        return self.rollout.set_noise(ctl, self.accelerator.unwrap_model(self.model), self.state.global_step)

    def close(self) -> None:
        """Release what the rollout engine holds (vLLM: its engine and GPU memory); the trainer generates no more."""
        self.rollout.close()

    # ------------------------------------------------------------------ hooks
    def create_accelerator_and_postprocess(self) -> None:
        """transformers' accelerator; and FSDP2 on CPU processes too when the launch asked for it.

        accelerate turns an FSDP config on for GPU-type backends only: with CPU processes (gloo) ``AcceleratorState``
        stays ``MULTI_CPU`` and ``prepare`` would wrap the model in DDP instead. FSDP2 itself runs on CPU over gloo
        (``fully_shard`` on a CPU device mesh; ``tests/nvfp4/test_fsdp.py``), so here the state is given the FSDP
        plugin the launch described (``FullyShardedDataParallelPlugin()`` reads the ``FSDP_*`` variables
        ``accelerate launch`` exported) and the FSDP distributed type, before anything was prepared: ``prepare`` then
        runs accelerate's own ``fsdp2_prepare_model``. That is how CI runs this path without GPUs; GPU launches
        never reach it.
        """
        super().create_accelerator_and_postprocess()
        from accelerate import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if fsdp2_requested() and state.distributed_type == DistributedType.MULTI_CPU:
            plugin = FullyShardedDataParallelPlugin()
            if state.mixed_precision != "no":
                plugin.set_mixed_precision(state.mixed_precision)
            state.fsdp_plugin = plugin
            state.distributed_type = DistributedType.FSDP
            # as AcceleratorState.__init__ does after choosing the type: an AcceleratorState() made later (TRL makes
            # some) takes the process state's
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

    @property
    def uses_fsdp2(self) -> bool:
        """Whether the policy is sharded by FSDP2 (an FSDP2 launch on several processes)."""
        return bool(getattr(self, "is_fsdp_enabled", False)) and self.accelerator.is_fsdp2

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; on CPU the NVFP4 weights are dequantized once for the run (see below).

        ``resume_from_checkpoint=True`` resumes from the newest checkpoint of ``output_dir`` that is complete and
        readable (:func:`qerl_trl.checkpoints.find_resume_checkpoint`; newer damaged ones are skipped with a warning),
        not from the newest folder; a checkpoint path is checked the same way first. Either raises
        :class:`~qerl_trl.checkpoints.CheckpointError` naming the file and the problem.

        With several processes, DDP is told to leave the NVFP4 buffers alone (``_ddp_params_and_buffers_to_ignore``):
        they are frozen and identical on every rank (each loads the same checkpoint), so neither the broadcast of
        module states when DDP wraps the model nor ``broadcast_buffers`` has anything to do with them — and gloo
        cannot send float8 tensors anyway. Only the LoRA gradients are all-reduced.
        """
        resume_from_checkpoint = self._checked_resume_checkpoint(resume_from_checkpoint)
        # a new run of the loop (e.g. resumed after an exception): the generation calls of its first step count from 0
        # (rollout_seed_per_prompt: as a fresh process resumed there) and the adapter is pushed to the engine again
        self._rollout_calls, self._lora_synced_step = (("", -1), 0), -1
        # a failed step's half-gathered sampling statistics would shift when each process gathers the next batch's
        self._correction_stats, self._pending_correction = [], None
        model = self.accelerator.unwrap_model(self.model)
        if self.uses_fsdp2 and not any(m.fsdp_shardable for m in model.modules() if isinstance(m, NVFP4Linear)):
            # the 4-bit weights in their own no-cast FSDP groups, one per decoder layer (nvfp4.fsdp), before
            # accelerate's fully_shard of the decoder layers and the root takes the rest (LoRA, norms, embeddings)
            fully_shard_quantized(model)
        if self.accelerator.num_processes > 1 and not self.uses_fsdp2:
            ignored = set(getattr(self.model, "_ddp_params_and_buffers_to_ignore", ()))
            self.model._ddp_params_and_buffers_to_ignore = sorted(ignored | set(quantized_buffer_names(self.model)))
        self.rollout.before_train()
        cache = contextlib.nullcontext()
        if next(model.parameters()).device.type == "cpu":
            # The CPU reference path would dequantize every weight on every call (each decoded token, forward and
            # backward); hold dequant(W) for the run instead. Same numbers. In float32 it is held compact (int8 codes
            # + half-steps, rebuilt per call into a scratch buffer): 425 → 133 MB on the offline default model, the
            # largest block of the job's peak RSS (BENCHMARKS.md, "Host memory"). CUDA runs the 4-bit kernels.
            cache = cache_dequantized(model, model.get_input_embeddings().weight.dtype, compact=True)
        with cache:
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def _checked_resume_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | None:
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        required = required_checkpoint_files(self.args)
        if resume_from_checkpoint is True:
            found = find_resume_checkpoint(self.args.output_dir, required)
            if found.path is None:
                why = f": {found.skipped_line()}" if found.skipped else ""
                raise CheckpointError(self.args.output_dir, f"no complete checkpoint-N folder{why}")
            if found.skipped:
                logger.warning("resuming from %s; skipped %s", found.path, found.skipped_line())
            return found.path
        check_checkpoint(resume_from_checkpoint, required)
        later = later_checkpoints(resume_from_checkpoint, self.args.output_dir)
        if later:
            logger.warning("resuming from %s; %s are of the run it rolls back: this run replaces each as it reaches "
                           "its step, save_total_limit deletes them first, and until then resume_from_checkpoint=True "
                           "would take that run back up", resume_from_checkpoint,
                           ", ".join(f.name for f in later))  # fmt: skip
        return str(resume_from_checkpoint)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        mode = "train" if self.model.training else "eval"
        start = time.perf_counter()
        with self._rollout_noise():
            if self._lora_synced_step != self.state.global_step:  # the adapter changed at most once per step
                self.rollout.sync_lora()
                self._lora_synced_step = self.state.global_step  # only once it is there: a failed push is retried
            if self.args.rollout_seed_per_prompt:  # QeRLConfig allows it with the torch-RNG engines only
                completion_ids, logprobs = self._generate_seeded(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
            else:
                completion_ids, logprobs = self._generate_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
        seconds = time.perf_counter() - start
        self._generation_seconds += seconds
        tokens = sum(len(ids) for ids in completion_ids)
        self._metrics[mode]["tokens_per_second/generation"].append(tokens / max(seconds, 1e-9))
        if self.aqn is not None and mode == "train":
            for key, value in self.aqn.metrics(self.state.global_step).items():
                self._metrics[mode][key].append(value)
        return completion_ids, logprobs

    def _generate_seeded(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        """``rollout_seed_per_prompt``: one ``generate`` per prompt group, each under its own :func:`rollout_seed`.

        TRL hands each process a contiguous, equal slice of the global generation batch (its ``RepeatSampler`` +
        accelerate's batch sharding; ``_generate_and_score_completions`` slices the advantages the same way), in which
        each prompt appears ``num_generations`` times in a row. The group's global index is therefore
        ``(process_index * len(prompt_ids) + offset) // num_generations``; batches that are not made of whole groups
        (tool-call continuations) are seeded row by row. A group is generated alone, so there is no padding either.
        """
        if (images is not None and any(im is not None for im in images)) or multimodal_fields:
            raise NotImplementedError("rollout_seed_per_prompt does not support multimodal prompts")
        n, g = len(prompt_ids), num_generations
        if g <= 1 or n % g or any(list(prompt_ids[i]) != list(prompt_ids[i - i % g]) for i in range(n)):
            g = 1
        step = int(self.state.global_step)
        key = ("train" if self.model.training else "eval", step)
        call = self._rollout_calls[1] if self._rollout_calls[0] == key else 0
        self._rollout_calls = (key, call + 1)
        base = self.accelerator.process_index * n
        device = self.accelerator.device
        fork_devices = [device] if device.type == "cuda" else []
        turns = []  # (completion ids, sampling logprobs or None) of each prompt group's call
        for start in range(0, n, g):
            with torch.random.fork_rng(devices=fork_devices):
                torch.manual_seed(rollout_seed(self.args.seed, step, call, (base + start) // g))
                turns.append(self._generate_turn(prompt_ids[start : start + g], None, {}, num_generations,
                                                 has_tool_images))  # fmt: skip
        completion_ids = [c for ids, _ in turns for c in ids]
        if any(lps is None for _, lps in turns):  # an engine without sampling logprobs (transformers)
            return completion_ids, None
        return completion_ids, [lp for _, lps in turns for lp in lps]

    def _generate_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """One generation call of the rollout engine, without this class's AQN / timing wrapper."""
        return self.rollout.generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        """TRL's, scoring ``logprob_batch_size`` sequences per forward when the caller gives no ``batch_size``.

        On CPU, text-only batches are scored by :func:`score_completions` (the LM head on the completion positions
        only): TRL's fused LM head scores every position of the sequence off Triton devices, prompt included. Inside
        the loss of a micro-batch whose sampling correction was deferred (:meth:`_defers_sampling_correction`), the
        correction is computed here from the loss forward's own logprobs.
        """
        batch_size = batch_size or self.args.logprob_batch_size
        if input_ids.device.type == "cpu" and not compute_aux_loss and all(v is None for v in kwargs.values()):
            with self.accelerator.autocast():
                out = score_completions(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                        temperature=self.temperature, compute_entropy=compute_entropy,
                                        entropy_grad=getattr(self, "_entropy_bonus_enabled", True))  # fmt: skip
        else:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss, **kwargs
            )  # fmt: skip
        pending = self._pending_correction
        if pending is not None:
            self._pending_correction = None
            self._deferred_correction(out[0].detach(), pending)
        return out

    # ------------------------------------------------------------------ the step's batches and its correction
    def _regroups_micro_batches(self) -> bool:
        """Whether the rows of a generation batch may be re-split into other micro-batches of the same size without
        changing the optimizer step: its micro-batches make exactly one optimizer step, the loss is one of
        :data:`GROUPING_FREE_LOSSES`, and nothing is normalized per micro-batch (entropy bonus, entropy mask)."""
        args = self.args
        return (
            args.steps_per_generation == args.gradient_accumulation_steps
            and self.loss_type in GROUPING_FREE_LOSSES
            and not getattr(self, "_entropy_bonus_enabled", False)
            and getattr(self, "top_entropy_quantile", 1.0) >= 1.0
        )

    def _prepare_inputs(self, generation_batch):
        """TRL's, with each new generation batch's micro-batches re-split where that leaves the optimizer step as it
        is (:meth:`_regroups_micro_batches`): off Triton devices by prompt (:func:`micro_batches_by_prompt`, so that
        :func:`score_completions` scores each prompt once), on GPUs by completion length, each cut to its longest row
        (:func:`micro_batches_by_length`: no micro-batch carries the generation batch's longest completion as
        padding; for token-summed losses in one process, as few micro-batches as the balanced split's largest allows,
        the rest empty)."""
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not buffered and self._regroups_micro_batches():
            if self.accelerator.device.type == "cpu":
                self._buffered_inputs = micro_batches_by_prompt(self._buffered_inputs)
            else:
                balance = self.loss_type in TOKEN_SUM_LOSSES
                # empty micro-batches only in one process: elsewhere every rank must run each forward (FSDP gathers)
                fewest = balance and self.accelerator.num_processes == 1
                self._buffered_inputs = micro_batches_by_length(self._buffered_inputs, balance=balance, fewest=fewest)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _defers_sampling_correction(self) -> bool:
        """Whether the engine-vs-trainer gap (TRL's ``sampling/*`` metrics) and the sampling correction, when it is
        on (``vllm_importance_sampling_correction``), come from the loss forward instead of a forward of their own.

        TRL scores every completion of a vLLM generation batch in an extra no-grad forward (``old_per_token_logps``),
        to compare the trainer's logprobs with the engine's. When the weights cannot change between generation and
        loss (one policy iteration, whole generation batches per optimizer step) those logprobs are the loss
        forward's own, detached: the 7B GSM8K step spent 7.7 s of 45 s in that forward
        (``benchmarks/results/grpo_7b_gsm8k_vllm.json``). The ratio, its clipping and its metrics are the same. With
        the correction off (QeRL's default under AQN, :func:`qerl_trl.config.default_sampling_correction`) the gap
        and the ratio it would apply are still logged, at no extra forward; the loss leaves the ratio out."""
        args = self.args
        return (
            bool(getattr(self, "use_vllm", False))
            and self.num_iterations == 1
            and args.gradient_accumulation_steps % args.steps_per_generation == 0
            and self.loss_type != "vespo"
        )

    def _generate_and_score_completions(self, inputs):
        if not (self.model.training and self._defers_sampling_correction()):
            return super()._generate_and_score_completions(inputs)
        # TRL computes old_per_token_logps, the ratio and its metrics only under this flag; the loss reads it again
        correction, self.vllm_importance_sampling_correction = self.vllm_importance_sampling_correction, False
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.vllm_importance_sampling_correction = correction

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's, except for an empty micro-batch (:func:`micro_batches_by_length` with ``fewest``): a zero loss on the
        trainable parameters, so that the trainer's backward runs without a forward (no rows, no gradient)."""
        if not return_outputs and inputs["completion_ids"].size(0) == 0:
            return sum(p.reshape(-1)[0] * 0.0 for p in model.parameters() if p.requires_grad)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _compute_loss(self, model, inputs):
        if (
            self.model.training
            and "importance_sampling_ratio" not in inputs
            and "sampling_per_token_logps" in inputs
            and self._defers_sampling_correction()
        ):
            self._pending_correction = inputs  # filled by _get_per_token_logps_and_entropies before TRL reads it
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._pending_correction = None

    def _deferred_correction(self, trainer_logps: torch.Tensor, inputs: dict[str, Any]) -> None:
        """``inputs["importance_sampling_ratio"]`` from the loss forward's logprobs (``[b, C]``, detached), and TRL's
        ``sampling/*`` metrics of the generation batch, logged once its last micro-batch has been scored."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        sampling = inputs["sampling_per_token_logps"]
        mode = self.vllm_importance_sampling_mode
        ratio = sampling_correction(trainer_logps, sampling, mask, mode, self.vllm_importance_sampling_clip_min,
                                    self.vllm_importance_sampling_clip_max)  # fmt: skip
        inputs["importance_sampling_ratio"] = ratio
        real = mask.bool()
        delta = (trainer_logps - sampling).abs()[real & ~torch.isnan(sampling)]
        ratios = ratio.flatten() if mode.startswith("sequence") else ratio[real]
        stats = torch.stack([delta.sum(), torch.tensor(float(delta.numel()), device=delta.device),
                             delta.max() if delta.numel() else delta.new_zeros(()),
                             ratios.sum(), torch.tensor(float(ratios.numel()), device=ratios.device),
                             ratios.min() if ratios.numel() else ratios.new_full((), math.inf),
                             ratios.max() if ratios.numel() else ratios.new_full((), -math.inf)]).float()  # fmt: skip
        self._correction_stats.append(stats)
        scored = sum(b["completion_ids"].size(0) > 0 for b in self._buffered_inputs)  # empty ones are not scored
        if len(self._correction_stats) < scored:
            return
        # the generation batch's last micro-batch on every process: one gather for the batch
        total = self.accelerator.gather(torch.stack(self._correction_stats)).view(-1, 7)
        self._correction_stats = []
        metrics = self._metrics["train"]
        metrics["sampling/sampling_logp_difference/mean"].append(
            (total[:, 0].sum() / total[:, 1].sum().clamp(min=1)).item()
        )
        metrics["sampling/sampling_logp_difference/max"].append(total[:, 2].max().item())
        metrics["sampling/importance_sampling_ratio/min"].append(total[:, 5].min().item())
        metrics["sampling/importance_sampling_ratio/mean"].append(
            (total[:, 3].sum() / total[:, 4].sum().clamp(min=1)).item()
        )
        metrics["sampling/importance_sampling_ratio/max"].append(total[:, 6].max().item())

    def training_step(self, model, inputs, num_items_in_batch):
        self._generation_seconds = 0.0
        start = time.perf_counter()
        with sdpa_kernel(TRAINING_SDPA_BACKENDS):
            loss = super().training_step(model, inputs, num_items_in_batch)
        seconds = time.perf_counter() - start - self._generation_seconds
        batch = self._buffered_inputs[(self._step - 1) % self.args.steps_per_generation]
        tokens = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
        if tokens:  # an empty micro-batch trained nothing
            self._metrics["train"]["tokens_per_second/training"].append(tokens / max(seconds, 1e-9))
        return loss

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; under FSDP2 only the trainable parameters (the LoRA adapter) are gathered, as
        transformers does for PEFT under DeepSpeed ZeRO-3 (``exclude_frozen_parameters``). Its FSDP path gathers the
        whole model's state dict to save an adapter: the frozen 4-bit base too (~41 GB at Qwen2.5-72B on every save),
        whose FP8 block scales gloo cannot all-gather (``Invalid scalar type``)."""
        model = self.accelerator.unwrap_model(self.model)
        if not (self.uses_fsdp2 and isinstance(model, PeftModel)):
            return super().save_model(output_dir, _internal_call)
        from nvfp4.sharded import is_dtensor

        output_dir = self.args.output_dir if output_dir is None else output_dir
        state_dict = {  # a collective per sharded tensor: every rank gathers, the main one writes
            name: (p.full_tensor() if is_dtensor(p) else p).detach().cpu()
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:  # fmt: skip
        """TRL's model card (``<output_dir>/README.md``, written at each checkpoint save). TRL names only a Hub base
        model: for a local folder (the offline default, a model on disk) its card said "a fine-tuned version of
        [None](https://huggingface.co/None)" and ``pipeline(..., model="None")``; the folder is named instead, and
        the quick start loads the run's adapter (``final/``) unless the card is for a Hub repository."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        base = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", "") or ""
        card = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.isdir(base) or not os.path.isfile(card):
            return
        with open(card) as f:
            text = f.read()
        text = text.replace("[None](https://huggingface.co/None)", f"the local model `{base}`")
        if self.hub_model_id is None:
            text = text.replace('model="None"', f'model="{os.path.join(self.args.output_dir, "final")}"')
        with open(card, "w") as f:
            f.write(text)

    def _get_output_dir(self, trial):
        staging = getattr(self, "_staging_dir", None)
        return staging if staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """``Trainer._save_checkpoint`` into ``<output_dir>/.staging`` (through :meth:`_get_output_dir`), then the AQN
        state and a manifest of the files beside it, fsync, and one rename to ``checkpoint-N``
        (:func:`qerl_trl.checkpoints.publish_checkpoint`); older checkpoints are rotated only after that."""
        run_dir = super()._get_output_dir(trial)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, STAGING_DIR)
        if self.args.should_save and os.path.lexists(staging):
            shutil.rmtree(staging)  # what a save killed midway left behind
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()  # cleared before any rank writes into it
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)  # its rotation sees the staging folder only: a no-op
        finally:
            self._staging_dir = None
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()  # every rank has written its rng_state_<rank>.pth into the staging folder
        if not self.args.should_save:
            return
        staged, final = os.path.join(staging, folder), os.path.join(run_dir, folder)
        if self.aqn is not None:
            with open(os.path.join(staged, AQN_STATE_NAME), "w") as f:
                json.dump(self.aqn.state_dict(), f, indent=2)
        best = self.state.best_model_checkpoint
        if best is not None and os.path.dirname(best) == staging:  # Trainer found the best checkpoint in staging
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        write_manifest(staged, self.state.global_step)
        publish_checkpoint(staged, final)
        shutil.rmtree(staging)
        rotate_checkpoints(run_dir, self.args.save_total_limit, keep=(final, self.state.best_model_checkpoint),
                           step=self.state.global_step)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, AQN_STATE_NAME)
        if os.path.exists(path):
            if self._ensure_aqn() is None:
                raise ValueError(f"{checkpoint} was trained with AQN but args.aqn is False")
            with open(path) as f:
                state = json.load(f)
            described = self.aqn.state_dict()  # what this run would use: args over this run's max_steps
            try:
                self.aqn.load_state_dict(state)
            except ValueError as e:  # the file and the key, in one line (train() checked it; a direct call may not)
                raise CheckpointError(path, str(e)) from e
            if changed := _aqn_changes(self.aqn.state_dict(), described):
                # the saved schedule wins, so that σ goes on from the stage the run was in; say so, it is not what
                # the new arguments describe
                logger.warning("resuming the AQN schedule of %s as saved: %s; to use the new one, start a fresh run",
                               checkpoint, changed)  # fmt: skip
        elif self.args.aqn:
            raise FileNotFoundError(f"{path} is missing: cannot resume the AQN schedule of {checkpoint}")


def _aqn_changes(saved: dict[str, Any], described: dict[str, Any]) -> str:
    """``"total_steps 100 (the arguments give 200), sigma_start 0.01 (the arguments give 0.02)"``: the settings in
    which a checkpoint's AQN controller state (:meth:`aqn.AQNController.state_dict`) differs from the one the run's
    arguments describe; ``""`` if none. The last step and the format versions are not settings."""

    def settings(state: dict[str, Any]) -> dict[str, Any]:
        top = {k: v for k, v in state.items() if k not in ("schedule", "step", "version")}
        return {**{k: v for k, v in state["schedule"].items() if k != "version"}, **top}

    old, new = settings(saved), settings(described)
    return ", ".join(f"{key} {old.get(key)} (the arguments give {new.get(key)})"
                     for key in dict.fromkeys([*new, *old]) if old.get(key) != new.get(key))  # fmt: skip
