"""DAPO on top of :class:`~qerl_trl.QeRLGRPOTrainer`.

TRL already has clip-higher (``epsilon_high``), the token-level loss (``loss_type="dapo"``) and masking of truncated
completions; this module adds the two parts TRL lacks:

* **dynamic sampling**: groups whose rewards all agree carry no advantage; they are dropped and the batch is refilled
  with groups generated from fresh prompts (up to ``max_resample_rounds`` extra rounds per step). With several
  processes each refills its own slice, and all run the same number of rounds (the largest shortfall, gathered);
* **overlong reward shaping**: :class:`OverlongPenalty`, a reward term that goes linearly from 0 to
  ``-overlong_penalty_factor`` over the last ``overlong_buffer_length`` tokens before ``max_completion_length``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .config import QeRLDAPOConfig
from .trainer import QeRLGRPOTrainer

__all__ = ["OverlongPenalty", "QeRLDAPOTrainer", "concat_generation_batches", "informative_groups"]

_LEFT_PADDED = {"prompt_ids", "prompt_mask"}
_RIGHT_PADDED = {
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "importance_sampling_ratio",
    "tool_mask",
}
_PER_ROW = {"advantages"}


class OverlongPenalty:
    """DAPO's soft overlong punishment as a TRL reward function.

    For a completion of ``L`` tokens, limit ``L_max`` and buffer ``L_buf``: 0 while ``L ≤ L_max − L_buf``, then
    ``(L_max − L_buf − L) / L_buf · factor`` (reaching ``−factor`` at ``L_max``), and ``−factor`` beyond.
    """

    def __init__(self, max_completion_length: int, buffer_length: int, penalty_factor: float = 1.0) -> None:
        if not 0 < buffer_length < max_completion_length:
            raise ValueError(
                f"need 0 < buffer_length ({buffer_length}) < max_completion_length ({max_completion_length})"
            )
        if not 0 <= penalty_factor < math.inf:  # -1 would reward overlong completions
            raise ValueError(f"penalty_factor must be a finite number >= 0 (the penalty's size), got {penalty_factor}")
        self.max_completion_length = max_completion_length
        self.buffer_length = buffer_length
        self.penalty_factor = penalty_factor
        self.__name__ = "overlong_penalty"

    def __call__(self, completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        start = self.max_completion_length - self.buffer_length
        return [
            -self.penalty_factor * min(max(len(ids) - start, 0) / self.buffer_length, 1.0) for ids in completion_ids
        ]


def informative_groups(advantages: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[num_groups]`` bool: True where a group's advantages are not all equal (its rewards did not all agree).

    GRPO's advantage is ``(r − mean_group) / (std_group + ε)``: equal rewards give every row of the group the same
    advantage, which is 0 in exact arithmetic but not in float32 (the mean of eight 0.2 rounds, and ``ε = 1e-4``
    magnifies the residue to ~1e-4), nor under ``normalize_then_sum`` (a batch-level baseline); so the spread of the
    advantages decides, not their size.
    """
    if advantages.numel() % num_generations:
        raise ValueError(f"{advantages.numel()} advantages do not split into groups of {num_generations}")
    grouped = advantages.view(-1, num_generations)
    return grouped.amax(dim=1) > grouped.amin(dim=1)


def _pad_to(t: torch.Tensor, length: int, value: float | int, left: bool) -> torch.Tensor:
    extra = length - t.size(1)
    if extra == 0:
        return t
    pad = t.new_full((t.size(0), extra, *t.shape[2:]), value)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def concat_generation_batches(batches: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Row-concatenate outputs of ``_generate_and_score_completions``, re-padding prompts left and completions right.

    ``num_items_in_batch`` is recomputed from the completion (and tool) masks by the caller.
    """
    keys = set(batches[0])
    for b in batches[1:]:
        if set(b) != keys:
            raise ValueError(f"generation batches disagree on keys: {sorted(keys ^ set(b))}")
    unknown = keys - _LEFT_PADDED - _RIGHT_PADDED - _PER_ROW - {"num_items_in_batch"}
    if unknown:
        raise NotImplementedError(f"dynamic sampling does not support batches with {sorted(unknown)} (multimodal?)")
    out: dict[str, Any] = {}
    for key in keys - {"num_items_in_batch"}:
        tensors = [b[key] for b in batches]
        # a sequence-level ratio is [b, 1] in every batch; a token-level one is [b, C] (C = 1 in a batch of one-token
        # completions only): judged on all batches, not the first
        per_sequence = key == "importance_sampling_ratio" and all(t.size(1) == 1 for t in tensors)
        if key in _PER_ROW or tensors[0].dim() == 1 or per_sequence:
            out[key] = torch.cat(tensors, dim=0)
            continue
        length = max(t.size(1) for t in tensors)
        value = pad_token_id if key in ("prompt_ids", "completion_ids") else (1 if key == "tool_mask" else 0)
        out[key] = torch.cat([_pad_to(t, length, value, left=key in _LEFT_PADDED) for t in tensors], dim=0)
    return out


def _take_rows(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    return {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in batch.items()}


class QeRLDAPOTrainer(QeRLGRPOTrainer):
    """DAPO (clip-higher, token-level loss, dynamic sampling, overlong shaping, β = 0) on an NVFP4 + LoRA policy.

    Takes the arguments of :class:`~qerl_trl.QeRLGRPOTrainer` with ``args`` a :class:`~qerl_trl.QeRLDAPOConfig`.
    ``overlong_penalty`` is appended to ``reward_funcs`` when ``args.overlong_buffer_length > 0``.

    Logs ``dapo/informative_group_fraction`` (of the first round), ``dapo/resample_rounds`` and
    ``dapo/unfilled_groups`` (slots left with uninformative groups after the last allowed round).
    """

    _tag_names = [*QeRLGRPOTrainer._tag_names, "dapo"]

    def __init__(
        self,
        model: Any,
        reward_funcs: Callable | list[Callable] | None = None,
        args: QeRLDAPOConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if args is None:
            args = QeRLDAPOConfig(output_dir="runs/qerl-dapo")
        if not isinstance(args, QeRLDAPOConfig):
            raise TypeError(f"QeRLDAPOTrainer needs a QeRLDAPOConfig, got {type(args).__name__}")
        dataset = kwargs.get("train_dataset")
        if args.dynamic_sampling and args.max_resample_rounds > 0 and dataset is not None and not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        ):  # _refill_inputs draws random rows: it would fail at the first step that refills
            raise ValueError(
                f"dynamic_sampling refills from random rows of train_dataset, and a {type(dataset).__name__} has no "
                "rows by index: pass a map-style Dataset, or set dynamic_sampling=False or max_resample_rounds=0"
            )
        funcs = (
            list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else ([reward_funcs] if reward_funcs else [])
        )
        if args.overlong_buffer_length > 0:
            funcs.append(
                OverlongPenalty(args.max_completion_length, args.overlong_buffer_length, args.overlong_penalty_factor)
            )
            if args.reward_weights is not None and len(args.reward_weights) == len(funcs) - 1:
                args.reward_weights = [*args.reward_weights, 1.0]
        super().__init__(model, funcs, args, **kwargs)

    def _refill_inputs(self, num_groups: int, round_index: int) -> list[dict[str, Any]]:
        """Fresh prompts for a refill round, each repeated ``num_generations`` times (a pure function of seed/step).

        One permutation per (seed, step, round), shared by all processes; process ``p`` takes the ``p``-th slice of
        ``num_groups`` prompts, so ranks never refill with the same prompts.
        """
        dataset = self.train_dataset
        gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.state.global_step * 101 + round_index)
        perm = torch.randperm(len(dataset), generator=gen)
        start = self.accelerator.process_index * num_groups
        rows = perm[torch.arange(start, start + num_groups) % len(dataset)].tolist()
        return [dict(dataset[i]) for i in rows for _ in range(self.num_generations)]

    def _global(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` gathered over processes (concatenated along dim 0)."""
        return self.accelerator.gather(value.to(self.accelerator.device))

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        if not (self.args.dynamic_sampling and self.model.training):
            return batch
        g = self.num_generations
        num_groups = len(inputs) // g
        keep = informative_groups(batch["advantages"], g)
        self._metrics["train"]["dapo/informative_group_fraction"].append(self._global(keep.float()).mean().item())
        kept = [_take_rows(batch, _group_rows(keep, g))] if keep.any() else []
        have, rounds = int(keep.sum()), 0
        # Each process fills its own slice; the number of rounds is decided globally (while any process is short),
        # because every round's generation and scoring gather across processes. A full process still generates (and
        # discards) its refill so that the collectives line up.
        while rounds < self.args.max_resample_rounds and self._global(torch.tensor([num_groups - have])).max() > 0:
            rounds += 1
            extra = super()._generate_and_score_completions(self._refill_inputs(num_groups, rounds))
            extra_keep = informative_groups(extra["advantages"], g)
            take = extra_keep & (torch.cumsum(extra_keep.long(), 0) <= num_groups - have)
            if take.any():
                kept.append(_take_rows(extra, _group_rows(take, g)))
                have += int(take.sum())
        unfilled = num_groups - have
        if unfilled:  # out of rounds: keep uninformative groups from the first round (zero advantage, zero gradient)
            fill = (~keep) & (torch.cumsum((~keep).long(), 0) <= unfilled)
            kept.append(_take_rows(batch, _group_rows(fill, g)))
        self._metrics["train"]["dapo/resample_rounds"].append(float(rounds))
        self._metrics["train"]["dapo/unfilled_groups"].append(float(self._global(torch.tensor([unfilled])).sum()))
        if rounds == 0:
            return batch
        out = concat_generation_batches(kept, self._tokenizer.pad_token_id)
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        out["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        return out


def _group_rows(groups: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Row indices of the selected groups (``groups`` is ``[num_groups]`` bool)."""
    return torch.nonzero(groups.repeat_interleave(num_generations), as_tuple=False).squeeze(1)
