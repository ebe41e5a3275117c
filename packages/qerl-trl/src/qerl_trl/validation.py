"""What ``qerl train`` / ``qerl eval`` check before any heavy work: every path and value a user can type.

A bad one raises :class:`UsageError`, whose message names the argument, the value and what was expected; the CLI
prints it as one line and exits with code 2 (``--debug``: the traceback). Three entry points, each run once:

* :func:`check_config_values`: the trainer config's numbers and names (from ``QeRLConfig.__post_init__``, so a
  recipe, the command line and Python all get it);
* :func:`validate_train_args`: ``qerl train``'s model, data, output folder (an earlier run there is not overwritten
  unless asked) and ``--resume`` (the checkpoint it picks); :func:`check_train_paths`, its part that needs neither
  torch nor the data, also runs before the trainer config's class is imported;
* :func:`validate_eval_args`: ``qerl eval``'s model, tokenizer, adapter, output and sampling values.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .checkpoints import (
    AQN_STATE_NAME,
    WEIGHT_NAMES,
    CheckpointError,
    ResumePoint,
    check_checkpoint,
    check_safetensors,
    find_resume_checkpoint,
    required_checkpoint_files,
)

__all__ = [
    "TrainInputs",
    "UsageError",
    "UsageErrorParser",
    "check_adapter_dir",
    "check_chat_template",
    "check_config_values",
    "check_data_path",
    "check_device",
    "check_model_source",
    "check_no_earlier_run",
    "check_output_dir",
    "check_report_to",
    "check_run_record",
    "check_train_paths",
    "load_task_data",
    "load_train_data",
    "validate_eval_args",
    "validate_train_args",
]

OFFLINE_DEFAULT = "offline-default"  # qerl_trl.policy.OFFLINE_DEFAULT (not imported: that module loads transformers)
_MODEL_WEIGHTS = tuple(n for n in WEIGHT_NAMES if not n.startswith("adapter_"))
_ADAPTER_WEIGHTS = tuple(n for n in WEIGHT_NAMES if n.startswith("adapter_"))
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class UsageError(ValueError):
    """A path or value the user gave cannot be used; the message names the argument, the value and what is expected."""


class UsageErrorParser:
    """Mixin for an ``argparse.ArgumentParser`` (or TRL's ``TrlParser``): a command-line error (unknown option, bad
    type, missing value) raises :class:`UsageError` with argparse's message instead of printing the usage of every
    option and exiting, so the CLI reports it as its one line like every other bad input."""

    def error(self, message: str):  # argparse's documented hook for every parse error
        raise UsageError(message)


# ------------------------------------------------------------------------------------------------------------ values
def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low


_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's
_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")  # GRPOTrainer._compute_loss
_SCALE_REWARDS = ("group", "batch", "none")  # GRPOConfig turns true / false into "group" / "none"
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")

#: (config field, accepted?, what is accepted). ``None`` (the library's default where a field allows it) is not
#: checked; NaN fails every comparison, so it is refused.
CONFIG_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("max_steps", lambda v: v == -1 or v >= 1, "-1 (train for num_train_epochs) or >= 1"),
    ("num_train_epochs", lambda v: v > 0, "> 0"),
    ("per_device_train_batch_size", _at_least(1), ">= 1"),
    ("gradient_accumulation_steps", _at_least(1), ">= 1"),
    ("num_iterations", _at_least(1), ">= 1"),
    # 0 is divisible by num_generations, so TRL's checks passed it; torch's sampler refused it after the model loaded
    ("steps_per_generation", _at_least(1), ">= 1"),
    ("generation_batch_size", _at_least(1), ">= 1"),
    ("max_completion_length", _at_least(1), ">= 1"),
    ("generation_prompt_cache_len", _at_least(1), ">= 1"),
    # finite too: an infinite rate makes the adapter inf/NaN at the first step, an infinite temperature samples
    # uniformly at random
    ("learning_rate", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("temperature", lambda v: 0 < v < math.inf, "a finite number > 0"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    # transformers refuses these only when it builds the first generation's logits processors, after the model loaded
    ("top_k", _at_least(-1), ">= -1 (0 or vLLM's -1: no top-k)"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("repetition_penalty", lambda v: v > 0, "> 0"),
    ("max_grad_norm", _at_least(0), ">= 0 (0: no clipping)"),
    # transformers' own message for a negative value, "must be an integer or a float", named neither
    ("warmup_steps", _at_least(0), ">= 0 (a step count, or a fraction of the run below 1)"),
    ("save_steps", lambda v: v > 0, "> 0 (a step count, or a fraction of the run below 1)"),
    ("logging_steps", lambda v: v > 0, "> 0"),
    ("seed", lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    ("beta", _at_least(0), ">= 0"),
    ("epsilon", _at_least(0), ">= 0"),
    ("epsilon_high", _at_least(0), ">= 0"),
    ("lora_r", _at_least(1), ">= 1"),
    ("lora_alpha", lambda v: v > 0, "> 0"),
    ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    # DAPO writes the penalty at the limit as -1: a factor of -1 would reward overlong completions
    ("overlong_penalty_factor", lambda v: 0 <= v < math.inf, "a finite number >= 0 (the penalty's size)"),
    ("aqn_sigma_start", _at_least(0), ">= 0 (σ is a standard deviation)"),
    ("aqn_sigma_end", _at_least(0), ">= 0 (σ is a standard deviation)"),
    # TRL reads it only inside a training step (the graph and vLLM engines' correction and its metrics): a typo
    # would otherwise stop the run at its first loss, after the model has loaded
    ("vllm_importance_sampling_mode", lambda v: v in _SAMPLING_MODES, f"one of {', '.join(map(repr, _SAMPLING_MODES))}"),
    # likewise read by TRL 1.16 only in the first step (advantages, loss): its names, as its trainer spells them
    ("loss_type", lambda v: v in _LOSS_TYPES, f"one of {', '.join(map(repr, _LOSS_TYPES))}"),
    ("scale_rewards", lambda v: v in _SCALE_REWARDS, f"one of {', '.join(map(repr, _SCALE_REWARDS))} (or true/false)"),
    ("multi_objective_aggregation", lambda v: v in _AGGREGATIONS, f"one of {', '.join(map(repr, _AGGREGATIONS))}"),
]


def check_config_values(config: Any) -> None:
    """Raise :class:`UsageError` for the first field of ``config`` (a ``QeRLConfig``) outside its domain
    (:data:`CONFIG_RULES`, e.g. ``max_steps -3``, which transformers would read as "train for num_train_epochs"), or
    an AQN schedule that :func:`aqn.make_schedule` refuses (unknown kind, fewer than 2 stages, ...)."""
    from aqn import make_schedule

    for name, accepted, expected in CONFIG_RULES:
        value = getattr(config, name, None)
        try:
            ok = value is None or (not isinstance(value, bool) and bool(accepted(value)))
        except TypeError:  # a list or a string where a number is meant (a recipe's `lora_r: [1, 2]`)
            ok = False
        if not ok:
            raise UsageError(f"{name} must be {expected}, got {value!r}")
    data_seed, seed = getattr(config, "data_seed", None), getattr(config, "seed", None)
    if data_seed is not None and data_seed != seed:
        # TrainingArguments' sampler seed: TRL's GRPO sampler (RepeatSampler) and DAPO's refills order the prompts by
        # seed, so another data_seed changed nothing
        raise UsageError(f"data_seed must be unset (or the seed, {seed!r}): GRPO orders the prompts by seed (TRL's "
                         f"RepeatSampler), which data_seed does not reach; set seed instead, got {data_seed!r}")
    # the schedule's own checks (kind, exponential's σ > 0, K >= 2); with AQN off only the kind matters
    aqn = getattr(config, "aqn", False)
    values = (config.aqn_sigma_start, config.aqn_sigma_end, config.aqn_num_stages) if aqn else (1.0, 0.5, 2)
    try:
        make_schedule(config.aqn_schedule, *values, total_steps=max(int(config.max_steps), 1))
    except ValueError as e:
        fields = f"aqn_schedule={config.aqn_schedule!r}"
        if aqn:
            fields += f", aqn_sigma_start={values[0]}, aqn_sigma_end={values[1]}, aqn_num_stages={values[2]}"
        raise UsageError(f"{fields}: {e}") from e


# ------------------------------------------------------------------------------------------------------------- paths
def _is_hub_id(value: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if value.startswith((".", "~", os.sep)):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _check_hub_model(argument: str, repo_id: str) -> None:
    """A Hub id: fine if its ``config.json`` is in the local cache, or if the Hub is online and knows it."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError
    from nvfp4.offline import hub_offline

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    expected = "give a local model folder (with config.json) or 'offline-default'"
    if hub_offline():
        raise UsageError(
            f"{argument} {repo_id!r}: no such local folder, and as a Hugging Face Hub id it is not in the local cache "
            f"while the Hub is offline (HF_HUB_OFFLINE): {expected}"
        )
    try:
        HfApi().model_info(repo_id, timeout=10)
    except RepositoryNotFoundError as e:
        raise UsageError(
            f"{argument} {repo_id!r}: no such local folder, and no such model on the Hugging Face Hub (a private or "
            f"gated one needs `hf auth login`): {expected}"
        ) from e
    except Exception as e:  # noqa: BLE001 - httpx / OSError / HfHubHTTPError: the Hub cannot be reached
        why = str(e).splitlines()[0] if str(e) else ""
        raise UsageError(
            f"{argument} {repo_id!r}: no such local folder, and the Hugging Face Hub cannot be reached to fetch it "
            f"({type(e).__name__}: {why}): {expected}"
        ) from e


def _check_safetensors_in(argument: str, value: str, folder: Path, pattern: str) -> None:
    for file in sorted(folder.glob(pattern)):
        try:
            check_safetensors(file)
        except CheckpointError as e:
            raise UsageError(f"{argument} {value!r}: {e.relative_to(folder)}") from e


def check_model_source(argument: str, value: str, *, tokenizer: bool = True, weights: bool = True) -> None:
    """``value`` is ``'offline-default'``, a model folder (``config.json``, weights whose safetensors headers parse,
    and with ``tokenizer`` a tokenizer), or a Hub id that is cached or reachable; else :class:`UsageError`.
    ``weights=False`` checks a tokenizer-only folder."""
    if value == OFFLINE_DEFAULT:
        return
    path = Path(value).expanduser()
    if not path.exists():
        if not _is_hub_id(value):
            raise UsageError(
                f"{argument} {value!r}: no such file or folder (expected a model folder with config.json, a Hugging "
                "Face Hub id such as Qwen/Qwen2.5-7B-Instruct, or 'offline-default')"
            )
        _check_hub_model(argument, value)
        return
    if not path.is_dir():
        raise UsageError(f"{argument} {value!r}: a file; expected a model folder (with config.json) or a Hub id")
    if weights:
        if not (path / "config.json").is_file():
            raise UsageError(f"{argument} {value!r}: not a model folder (no config.json)")
        try:  # cut short or not JSON: transformers' OSError traceback once the model loads otherwise
            json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{argument} {value!r}: config.json is not readable JSON ({e})") from e
        if not any((path / name).is_file() for name in _MODEL_WEIGHTS):
            raise UsageError(f"{argument} {value!r}: a model folder without weights (no {' / '.join(_MODEL_WEIGHTS)})")
        _check_safetensors_in(argument, value, path, "*.safetensors")
    if tokenizer and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise UsageError(f"{argument} {value!r}: no tokenizer files (none of {', '.join(_TOKENIZER_FILES)})")


def check_adapter_dir(argument: str, value: str) -> None:
    """``value`` is a local PEFT adapter folder (``adapter_config.json`` and a complete ``adapter_model.safetensors``
    or ``.bin``), e.g. a run's ``final/`` or ``checkpoint-N/``; else :class:`UsageError`."""
    path = Path(value).expanduser()
    if not path.is_dir():
        what = "a file" if path.exists() else "no such folder"
        raise UsageError(f"{argument} {value!r}: {what}; expected a LoRA adapter folder (e.g. runs/<run>/final)")
    if not (path / "adapter_config.json").is_file() or not any((path / n).is_file() for n in _ADAPTER_WEIGHTS):
        raise UsageError(
            f"{argument} {value!r}: not a LoRA adapter folder (expected adapter_config.json and "
            "adapter_model.safetensors, as in runs/<run>/final)"
        )
    _check_safetensors_in(argument, value, path, "adapter_model*.safetensors")


def check_output_dir(argument: str, value: str) -> None:
    """``value`` is a folder, or can be made one: not a file, and its nearest existing parent a writable folder."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{argument} {value!r}: a file; expected a folder (created if missing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{argument} {value!r}: {existing} is a file, so the folder cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{argument} {value!r}: {existing} is not writable")


def check_data_path(argument: str, value: str | None, split: str) -> None:
    """``value`` (``None``: the task's own source) exists: a ``.jsonl`` file or a folder with ``<split>.jsonl`` (what is
    inside is the task loader's to check)."""
    if value is None:
        return
    path = Path(value).expanduser()
    if not path.exists():
        raise UsageError(
            f"{argument} {value!r}: no such file or folder (expected a folder with {split}.jsonl or a .jsonl file)"
        )
    if path.is_dir() and not any((path / f"{split}{ext}").is_file() for ext in (".jsonl", ".json")):
        have = ", ".join(sorted(f.name for f in path.glob("*.jsonl"))) or "no .jsonl files"
        raise UsageError(f"{argument} {value!r}: the folder has no {split}.jsonl (found: {have})")


def check_chat_template(argument: str, value: str, dataset: Any) -> None:
    """A dataset of chat-message prompts (every task's) needs a tokenizer with a chat template: one without (a base
    model's) loaded the model and then stopped in transformers' "Cannot use chat template functions" at the first
    prompt. ``value``: the model or tokenizer the prompts are rendered with (``argument`` names it). Nothing is
    checked when the tokenizer cannot be loaded here (loading the model says why). Raises :class:`UsageError`."""
    if dataset is None or "prompt" not in getattr(dataset, "column_names", ()) or len(dataset) == 0:
        return
    if not isinstance(dataset[0]["prompt"], list):  # plain-text prompts are tokenized as they are
        return
    from transformers import AutoTokenizer

    from .policy import resolve_model_path

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(value))
    except (OSError, ValueError):
        return
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            f"{argument} {value!r}: its tokenizer has no chat template, and the task's prompts are chat messages "
            "(system and user turns): use an instruct/chat model, or a tokenizer with a chat template"
        )


def check_device(argument: str, value: str) -> None:
    """``value`` names a device torch can use here: ``cpu``, or ``cuda`` / ``cuda:N`` (another backend torch has,
    e.g. ``mps``, when available); else :class:`UsageError` (the model load failed in a traceback otherwise)."""
    import torch

    expected = "expected cpu, cuda or cuda:N"
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"{argument} {value!r}: not a device name; {expected}") from e
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    if backend is None or not callable(getattr(backend, "is_available", None)) or not backend.is_available():
        raise UsageError(f"{argument} {value!r}: no {device.type} device on this machine; use {argument} cpu")
    count = backend.device_count() if callable(getattr(backend, "device_count", None)) else 1
    if device.index is not None and device.index >= count:
        raise UsageError(f"{argument} {value!r}: this machine has {count} {device.type} device(s) ({device.type}:0 to "
                         f"{device.type}:{count - 1}), or use {argument} cpu")  # fmt: skip


def _check_positive(argument: str, value: Any) -> None:
    if value is not None and not value >= 1:
        raise UsageError(f"{argument} must be >= 1, got {value!r}")


# ------------------------------------------------------------------------------------------------------- entry points
@dataclass
class TrainInputs:
    """What :func:`validate_train_args` checked and loaded: the training set and the checkpoint to resume from."""

    dataset: Any
    resume: ResumePoint | None


def load_task_data(task: str, split: str, path: str | None, limit: int | None, seed: int, options: dict | None,
                   arguments: tuple[str, str]) -> Any:  # fmt: skip
    """:func:`qerl_trl.tasks.load_task` (local files, synthetic, or the Hub), whose errors become a
    :class:`UsageError` naming the argument at fault: ``arguments`` are the CLI's names of the data path and the task
    options (``("--data_path", "--task_options")`` for ``qerl train``)."""
    from .tasks import TaskDataError, check_task_options, load_task

    path_arg, options_arg = arguments
    check_data_path(path_arg, path, split)
    try:
        check_task_options(task, options)  # before the call: a loader argument among them is Python's own TypeError
        return load_task(task, split, path=path, limit=limit, seed=seed, **(options or {}))
    except TaskDataError as e:
        raise UsageError(f"{path_arg} {path!r}: {e}" if path else f"--task {task}: {e}") from e
    except (TypeError, ValueError) as e:  # the task's options (n_examples, digits, ops, ...) when there are some
        raise UsageError(f"{options_arg} {options}: {e}" if options else f"--task {task}: {e}") from e


def load_train_data(script_args: Any, config: Any) -> Any:
    """``qerl train``'s training set (:func:`load_task_data`)."""
    return load_task_data(script_args.task, script_args.split, script_args.data_path, script_args.limit, config.seed,
                          script_args.task_options, ("--data_path", "--task_options"))  # fmt: skip


#: What makes a folder an earlier run's (``qerl train`` writes these); the staging and replaced-run folders are hidden.
PREVIOUS_RUN_PREFIX = ".previous-run-"
#: ``<output_dir>/recipe.yaml``: the recipe and command-line overrides of the last ``qerl train`` into the folder, as a
#: recipe ``qerl train`` reads back (:func:`qerl_trl.cli.run_recipe`)
RUN_RECIPE_NAME = "recipe.yaml"


def continues_run_in(output_dir: str | None, resume: str | None) -> bool:
    """Whether ``--resume`` continues the run of ``output_dir``: ``true``, or a checkpoint path inside it (a path
    elsewhere starts this output_dir from another run's checkpoint)."""
    if resume is None or output_dir is None:
        return False
    return resume == "true" or Path(resume).expanduser().resolve().is_relative_to(Path(output_dir).expanduser().resolve())


def check_no_earlier_run(output_dir: str, resume: str | None, overwrite: bool) -> None:
    """A fresh run (no ``--resume``) into a folder that is not empty would overwrite what is there (an earlier run's
    adapter, metrics, plots; its checkpoints rotated away): refuse, naming ``--resume true`` and
    ``--overwrite_output_dir true``, unless ``overwrite``. ``--resume PATH`` inside ``output_dir`` continues that run."""
    path = Path(output_dir).expanduser()
    if overwrite or not path.is_dir():
        return
    if continues_run_in(output_dir, resume):
        return
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return
    checkpoints = [e for e in entries if e.startswith("checkpoint-")]
    shown = [e for e in entries if not e.startswith("checkpoint-")][:4]
    held = ", ".join([*([f"{len(checkpoints)} checkpoint(s)"] if checkpoints else []), *shown])
    what = "an earlier run" if checkpoints or "final" in entries or "metrics.jsonl" in entries else "files"
    raise UsageError(
        f"--output_dir {output_dir!r} holds {what} ({held}{', ...' if len(entries) > len(shown) + len(checkpoints) else ''}): "
        "continue it with --resume true, or replace it with --overwrite_output_dir true (the old content is removed "
        "once the new run has written its first checkpoint), or give another --output_dir"
    )


def _check_resume_adapter(checkpoint: str, config: Any, model: str) -> None:
    """The checkpoint's adapter is the one this run builds: its LoRA rank (else the optimizer and weights cannot
    load), its alpha (else the weights act rescaled) and the modules it adapts (else the optimizer's parameter groups do not match: torch's traceback after the
    policy loaded). One line naming the adapter's value and base model against the run's."""
    try:
        saved = json.loads((Path(checkpoint) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return  # check_checkpoint accepted it; a full model checkpoint has no adapter config
    if not isinstance(saved, dict):
        return
    lora_r, base = getattr(config, "lora_r", None), saved.get("base_model_name_or_path")
    rank = saved.get("r")
    if isinstance(lora_r, int) and isinstance(rank, int) and rank != lora_r:
        raise UsageError(
            f"--resume {checkpoint!r}: its adapter is LoRA rank {rank} (trained on {base!r}), this run's is lora_r "
            f"{lora_r} on {model!r}: pass --lora_r {rank} (and the model it was trained on) to continue it"
        )
    alpha = getattr(config, "lora_alpha", None)
    alpha = lora_r if alpha is None else alpha  # QeRLConfig's default: alpha = r
    saved_alpha = saved.get("lora_alpha")
    numbers = (int, float)
    if isinstance(alpha, numbers) and isinstance(saved_alpha, numbers) and saved_alpha != alpha:
        # PEFT keeps the run's alpha and loads only the weights: the adapter would act scaled by alpha / r anew
        raise UsageError(
            f"--resume {checkpoint!r}: its adapter was trained with lora_alpha {saved_alpha:g}, this run's is "
            f"{alpha:g}: the same weights would act scaled by {alpha:g}/r instead of {saved_alpha:g}/r; pass "
            f"--lora_alpha {saved_alpha:g} to continue it"
        )
    targets, ours = saved.get("target_modules"), getattr(config, "lora_target_modules", None)
    if isinstance(ours, str):
        ours = [ours]
    # PEFT's all-linear saves every module's full name: compare the projections' names (a name matches its suffix)
    leaves = {str(t).rsplit(".", 1)[-1] for t in targets} if isinstance(targets, list) else None
    if leaves is not None and isinstance(ours, list) and "all-linear" not in ours and leaves != set(ours):
        raise UsageError(
            f"--resume {checkpoint!r}: its adapter is on {sorted(leaves)} (trained on {base!r}), this run's "
            f"lora_target_modules are {sorted(ours)}: pass --lora_target_modules {' '.join(sorted(leaves))} to "
            "continue it"
        )


def _same_model(saved: str, model: str) -> bool:
    """The same model: the same name, or local paths of one folder."""
    if saved == model:
        return True
    a, b = Path(saved).expanduser(), Path(model).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


@dataclass(frozen=True)
class _RecordWords:
    """How a command words a mismatch with a run's record (:func:`check_run_record`)."""

    model_option: str  # the command's option naming the model
    asks: str  # "<who> asks for"
    model_bound: str  # what belongs to the recorded model
    policy_bound: str  # what was trained on the recorded policy
    proceed: str  # what passing the recorded value does


_RECORD_WORDS: dict[str, _RecordWords] = {
    "resume": _RecordWords("--model_name_or_path", "this run asks for", "its adapter and optimizer belong to that model",
                           "its adapter was trained on that policy",
                           "to continue it, or start a new run in another --output_dir"),
    "eval": _RecordWords("--model", "this evaluation asks for", "its adapter belongs to that model",
                         "its adapter was trained on that policy and would be measured on another", "to evaluate it"),
}  # fmt: skip


def check_run_record(adapter: str | os.PathLike[str], model: str, quantization: str | None, *, given: str,
                     command: Literal["resume", "eval"]) -> None:  # fmt: skip
    """The run an adapter folder is of (a ``checkpoint-N`` or ``final`` whose parent holds :data:`RUN_RECIPE_NAME`,
    which ``qerl train`` writes) was trained on ``model`` and ``quantization``: another one took the adapter onto
    another policy without a word (the same shapes: another quantizer, another fine-tune), on ``--resume``
    (``command="resume"``) and in ``qerl eval --adapter`` (``command="eval"``, which then measured another policy).
    ``given``: the option as the user gave it, the head of the message. One line naming the saved value and the
    requested one, and the option that continues with the saved one. ``quantization`` ``None``: not compared. A
    folder without the record (a run of before it, another tool's) is not checked. Raises :class:`UsageError`."""
    import yaml

    record = Path(adapter).expanduser().parent / RUN_RECIPE_NAME
    try:
        saved = yaml.safe_load(record.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return
    if not isinstance(saved, dict):
        return
    words = _RECORD_WORDS[command]
    which = f"{given}: the run in {str(record.parent)!r} ({record.name})"
    model, saved_model = str(model), saved.get("model_name_or_path")
    if saved_model is not None and not _same_model(str(saved_model), model):
        asked = words.asks if command == "resume" else f"{words.asks} {words.model_option}"  # another option name
        raise UsageError(
            f"{which} was trained on --model_name_or_path {str(saved_model)!r}, {asked} {model!r}: "
            f"{words.model_bound}; pass {words.model_option} {saved_model} {words.proceed}"
        )
    saved_quantization = saved.get("quantization")
    if saved_quantization is not None and quantization is not None and (
        str(saved_quantization).strip().lower() != str(quantization).strip().lower()
    ):
        raise UsageError(
            f"{which} was trained with --quantization {saved_quantization!r}, {words.asks} {quantization!r}: "
            f"{words.policy_bound}; pass --quantization {saved_quantization} {words.proceed}"
        )


def _check_resume_step(checkpoint: str, given: str, config: Any) -> None:
    """A checkpoint at or past ``max_steps`` leaves nothing to train: the run loaded the policy, trained 0 steps and
    rewrote ``final/`` (exit 0). One line naming the checkpoint's step and ``max_steps`` instead."""
    max_steps = getattr(config, "max_steps", -1)
    if not isinstance(max_steps, int) or max_steps < 1:  # -1: num_train_epochs decides, known once the data is
        return
    try:
        step = json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if isinstance(step, int) and step >= max_steps:
        done = "the run is complete" if step == max_steps else "past the end of this run"
        which = f"true: {checkpoint} is" if given == "true" else f"{checkpoint!r}: it is"
        raise UsageError(
            f"--resume {which} at step {step}, and max_steps {max_steps}: {done}, nothing to train; "
            f"pass --max_steps > {step} to train on from it (its adapter is in {checkpoint})"
        )


def _is_main_process() -> bool:
    """Rank 0, or a single process (``accelerate launch`` / ``torchrun`` set ``RANK``)."""
    return os.environ.get("RANK", "0") == "0"


def check_train_paths(script_args: Any, config: Any, tasks: Any) -> ResumePoint | None:
    """The checks of :func:`validate_train_args` that need neither the trainer config's class nor the data: algorithm,
    task (one of ``tasks``), rewards, ``--limit``, ``--model_name_or_path``, ``--output_dir`` (an earlier run there
    is refused: :func:`check_no_earlier_run`), ``--data_path`` exists, and ``--resume``: ``true`` picks the newest
    complete, readable checkpoint of ``output_dir`` (:func:`~qerl_trl.checkpoints.find_resume_checkpoint`), a path
    must be one. Returns the checkpoint to resume from; raises :class:`UsageError`."""
    from .rewards import REWARD_FUNCS

    if script_args.algorithm not in ("grpo", "dapo"):
        raise UsageError(f"--algorithm must be 'grpo' or 'dapo', got {script_args.algorithm!r}")
    if script_args.task not in tasks:
        raise UsageError(f"--task must be one of {', '.join(sorted(tasks))}, got {script_args.task!r}")
    unknown = [r for r in script_args.rewards or () if not callable(r) and r not in REWARD_FUNCS]
    if unknown:
        raise UsageError(
            f"--rewards: unknown {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(REWARD_FUNCS))}"
        )
    _check_positive("--limit", script_args.limit)
    if getattr(config, "push_to_hub", False):  # the trainer creates the Hub repo once the policy has loaded
        from nvfp4.offline import hub_offline

        if hub_offline():
            raise UsageError("--push_to_hub: the Hugging Face Hub is offline (HF_HUB_OFFLINE); drop --push_to_hub "
                             "(the run saves to --output_dir) or unset HF_HUB_OFFLINE")  # fmt: skip
    check_model_source("--model_name_or_path", script_args.model_name_or_path)
    if config.output_dir is not None:
        check_output_dir("--output_dir", config.output_dir)
    check_data_path("--data_path", script_args.data_path, script_args.split)
    if getattr(script_args, "overwrite_output_dir", False) and continues_run_in(config.output_dir, script_args.resume):
        raise UsageError(
            f"--resume {script_args.resume} continues the run in {config.output_dir!r} and --overwrite_output_dir true "
            "replaces it: pass either, not both"
        )
    resume = None
    required = required_checkpoint_files(config)
    if script_args.resume_latest:
        resume = find_resume_checkpoint(config.output_dir, required)
        if resume.path is None:
            why = f": {resume.skipped_line()}" if resume.skipped else " (no checkpoint-N folder)"
            raise UsageError(f"--resume true: no usable checkpoint in {config.output_dir}{why}")
    elif script_args.resume is not None:
        try:
            check_checkpoint(script_args.resume, required)
        except CheckpointError as e:
            raise UsageError(f"--resume {script_args.resume!r}: {e.relative_to(script_args.resume)}") from e
        resume = ResumePoint(str(script_args.resume))
    if resume is not None:
        given = "true" if script_args.resume_latest else script_args.resume
        check_run_record(resume.path, str(script_args.model_name_or_path), getattr(config, "quantization", None),
                         given=f"--resume {'true' if given == 'true' else repr(given)}", command="resume")
        _check_resume_adapter(resume.path, config, script_args.model_name_or_path)
        _check_resume_step(resume.path, "true" if script_args.resume_latest else script_args.resume, config)
        if not getattr(config, "aqn", True) and (Path(resume.path) / AQN_STATE_NAME).is_file():
            # the trainer refuses it too, but only once the policy has loaded
            raise UsageError(
                f"--resume {resume.path!r}: it was trained with AQN (its {AQN_STATE_NAME} holds the noise schedule) "
                "and this run has --aqn false: pass --aqn true to continue it"
            )
    # the folder's state is the main process's to judge: it alone writes there, and under a launch it writes the run's
    # recipe.yaml as soon as its own checks pass, which a slower rank would take for an earlier run's files
    if config.output_dir is not None and _is_main_process():
        check_no_earlier_run(config.output_dir, script_args.resume, getattr(script_args, "overwrite_output_dir", False))
    return resume


def validate_train_args(script_args: Any, config: Any) -> TrainInputs:
    """Check ``qerl train``'s arguments (parsed by :func:`qerl_trl.cli.parse_train_args`) before the model loads
    (:func:`check_train_paths`) and load the training set (its errors name ``--data_path`` / ``--task_options``).
    The config's own values were checked when it was built (:func:`check_config_values`). Raises :class:`UsageError`."""
    from .tasks import TASKS

    resume = check_train_paths(script_args, config, TASKS)
    check_report_to(getattr(config, "report_to", None))
    dataset = load_train_data(script_args, config)
    check_enough_prompts(dataset, config)
    check_chat_template("--model_name_or_path", str(script_args.model_name_or_path), dataset)
    return TrainInputs(dataset=dataset, resume=resume)


def check_report_to(report_to: Any) -> None:
    """The reporting integrations of ``report_to`` (a trainer config's) are ones transformers knows and can run here:
    the callbacks its Trainer makes are made once now, so an unknown name or a library that is not installed
    (``--report_to wandb`` without wandb) is one line before the model loads, not a traceback after. Raises
    :class:`UsageError`."""
    # the config resolved 'none' (to []) and 'all' (to the installed integrations) when it was made
    names = [report_to] if isinstance(report_to, str) else list(report_to or ())
    if not names:
        return
    from transformers.integrations import get_reporting_integration_callbacks

    try:
        for callback in get_reporting_integration_callbacks(names):
            _probe(callback)()
    except (ValueError, RuntimeError, ImportError) as e:
        raise UsageError(f"--report_to {','.join(map(str, names))}: {e}") from e


def _probe(callback: type) -> type:
    """``callback``'s class with no ``__del__``: made once to see whether it can run here, it starts nothing to end
    (runs start at the training's first step), and a half-built one (``__init__`` raised: MLflowCallback without
    mlflow) no longer prints "Exception ignored in: MLflowCallback.__del__" and an AttributeError traceback after the
    one-line error, as transformers' ``__del__`` read an attribute that ``__init__`` never set."""
    return type(callback.__name__, (callback,), {"__del__": lambda self: None, "__module__": callback.__module__})


def check_enough_prompts(dataset: Any, config: Any) -> None:
    """The training set holds at least the prompts of one generation round (``generation_batch_size /
    num_generations``): TRL's sampler yields only whole rounds, so with fewer the run trained nothing (transformers'
    "stopping training at step 0") and saved an untrained adapter. Raises :class:`UsageError`."""
    rows, per_round = getattr(config, "generation_batch_size", None), getattr(config, "num_generations", None)
    if dataset is None or not hasattr(dataset, "__len__") or not rows or not per_round:
        return
    prompts = rows // per_round
    if len(dataset) < prompts:
        raise UsageError(
            f"the training set has {len(dataset)} prompt(s), fewer than the {prompts} one generation round takes "
            f"(generation_batch_size {rows} / num_generations {per_round}): nothing would be trained; give more "
            "examples (--limit, task_options n_examples) or a smaller per_device_train_batch_size"
        )


def validate_eval_args(args: Any) -> None:
    """Check ``qerl eval``'s parsed arguments (:func:`qerl_trl.evaluation.build_parser`) before the model loads:
    ``--model``, ``--tokenizer``, ``--adapter``, ``--output``, and the sampling values. Raises :class:`UsageError`."""
    for argument, value in (("--n-samples", args.n_samples), ("--max-new-tokens", args.max_new_tokens),
                            ("--batch-size", args.batch_size), ("--limit", args.limit)):  # fmt: skip
        _check_positive(argument, value)
    if not args.greedy and not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise UsageError(f"--temperature must be > 0 (or use --greedy), got {args.temperature!r}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p!r}")
    _, seed_ok, seed_range = next(rule for rule in CONFIG_RULES if rule[0] == "seed")  # qerl train's range
    if not seed_ok(args.seed):  # torch.manual_seed overflows past 2**64
        raise UsageError(f"--seed must be {seed_range}, got {args.seed!r}")
    if args.device is not None:
        check_device("--device", args.device)
    check_model_source("--model", args.model, tokenizer=args.tokenizer is None)
    if args.tokenizer is not None:
        check_model_source("--tokenizer", args.tokenizer, weights=False)
    if args.adapter is not None:
        check_adapter_dir("--adapter", args.adapter)
    if args.output is not None:
        check_output_dir("--output", args.output)
