"""``qerl train``'s options checked before torch, transformers or TRL is imported (a typo costs a second, not 20).

TRL's ``TrlParser`` needs the trainer config's dataclass, and importing it (``GRPOConfig``) imports torch and
transformers. :data:`OPTIONS_FILE` holds what checking an option needs from those dataclasses, written by
:func:`option_table` from the real classes (``python -m qerl_trl.arguments`` rewrites it; a test keeps it equal):
per field its kind (``int``, ``float``, ``bool``, ``str``, ``list``, ``choice`` or ``other``), its choices and its
default when JSON can hold it; and the names of the ``quantization`` values and of the tasks. :func:`precheck_train`
parses the command line and the recipe against it and raises :class:`~qerl_trl.validation.UsageError` for an unknown
option, a value of the wrong type, a value outside its domain (:data:`~qerl_trl.validation.CONFIG_RULES`) or a bad
path, before the real parse, which still runs afterwards and stays the authority.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

from .validation import CONFIG_RULES, UsageError

__all__ = [
    "OPTIONS_FILE",
    "PrecheckedArgs",
    "TrainArguments",
    "check_quantization",
    "option_table",
    "precheck_train",
    "task_names",
    "train_options",
]

OPTIONS_FILE = Path(__file__).with_name("train_options.json")
_TRUE = ("yes", "true", "t", "y", "1")
_FALSE = ("no", "false", "f", "n", "0")


# ---------------------------------------------------------------------------------------------------- the snapshot
def _field_spec(field: Any, hint: Any) -> dict[str, Any]:
    """The kind of one dataclass field as transformers' ``HfArgumentParser`` parses it (Optional unwrapped)."""
    import dataclasses
    import enum
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None  # Union[X, str]: a string passes too; not checked here
        origin = typing.get_origin(hint)
    spec: dict[str, Any]
    if hint is None:
        spec = {"kind": "other"}
    elif origin is typing.Literal:
        spec = {"kind": "choice", "choices": list(typing.get_args(hint))}
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        spec = {"kind": "choice", "choices": [m.value for m in hint]}
    elif hint is bool:
        spec = {"kind": "bool"}
    elif hint is int:
        spec = {"kind": "int"}
    elif hint is float:
        spec = {"kind": "float"}
    elif hint is str:
        spec = {"kind": "str"}
    elif origin is list or hint is list:
        spec = {"kind": "list"}
    else:
        spec = {"kind": "other"}
    default = field.default
    if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    if isinstance(default, enum.Enum):
        default = default.value
    try:
        json.dumps(default, allow_nan=False)
        spec["default"] = default
    except (TypeError, ValueError):
        pass
    return spec


def _dataclass_specs(cls: type) -> dict[str, dict[str, Any]]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    return {f.name: _field_spec(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def option_table() -> dict[str, Any]:
    """The snapshot :data:`OPTIONS_FILE` holds, computed from the real dataclasses and registries (imports TRL)."""
    from aqn import SCHEDULE_KINDS

    from .config import QeRLConfig, QeRLDAPOConfig
    from .quantization import ALIASES, SCHEMES
    from .tasks import TASKS

    grpo = _dataclass_specs(QeRLConfig)
    dapo = _dataclass_specs(QeRLDAPOConfig)
    return {
        "grpo": grpo,
        "dapo": {k: v for k, v in dapo.items() if grpo.get(k) != v},  # what DAPO's config adds or changes
        "quantization": {"schemes": list(SCHEMES), "aliases": dict(ALIASES)},
        "tasks": sorted(TASKS),
        "aqn_schedules": list(SCHEDULE_KINDS),
    }


@cache
def _load_table() -> dict[str, Any]:
    return json.loads(OPTIONS_FILE.read_text())


def task_names() -> list[str]:
    """The names of ``qerl_trl.tasks.TASKS`` (that module imports ``datasets``)."""
    return list(_load_table()["tasks"])


# ---------------------------------------------------------------------------------------------------- the precheck
def _to_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _convert(kind: str, text: str) -> Any:
    """A command-line string as the real parser converts it; ValueError if it cannot."""
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        return _to_bool(text)
    return text


_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _recipe_value(recipe: str, name: str, kind: str, value: Any) -> Any:
    """A recipe's value for a field of ``kind``; strings are converted as argparse converts string defaults, and a
    single value of a list field is a list of one (as on the command line: ``--rewards format``)."""
    if kind == "list" and value is not None and not isinstance(value, list):
        return [value]
    if value is None or kind not in _KIND_WORDS:
        return value
    if isinstance(value, str):
        try:
            return _convert(kind, value)
        except ValueError:
            pass
    elif kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    elif kind == "bool" and isinstance(value, bool):
        return value
    elif kind == "str" and isinstance(value, (int, float)):  # YAML read `output_dir: 2024` as a number
        return str(value)
    raise UsageError(f"recipe {recipe}: {name} must be {_KIND_WORDS[kind]}, got {value!r}")


def _suggest(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean --{close[0]}?)" if close else ""


class _Options:
    """The option names ``qerl train`` accepts: the script arguments', the trainer config's, their ``-`` spellings and
    ``--no_<flag>`` for boolean fields that default to true; as argparse, a unique prefix of a name is that name."""

    def __init__(self, specs: dict[str, dict[str, Any]]) -> None:
        self.specs = specs
        self.names: dict[str, tuple[str, bool]] = {}  # spelling → (field, negated)
        for name, spec in specs.items():
            self.names[name] = self.names[name.replace("_", "-")] = (name, False)
            if spec["kind"] == "bool" and spec.get("default") is True:
                self.names[f"no_{name}"] = self.names[f"no-{name.replace('_', '-')}"] = (name, True)

    def resolve(self, spelling: str) -> tuple[str, bool]:
        if spelling in self.names:
            return self.names[spelling]
        prefixed = {self.names[s] for s in self.names if s.startswith(spelling)}
        if len(prefixed) == 1:
            return prefixed.pop()
        if prefixed:
            choices = ", ".join(sorted(f"--{n}" for n, _ in prefixed))
            raise UsageError(f"ambiguous option: --{spelling} could match {choices}")
        raise UsageError(f"unknown option --{spelling}{_suggest(spelling, sorted(self.specs))}; "
                         "qerl train takes the recipe's fields and TRL's GRPOConfig fields")  # fmt: skip


def _parse_command_line(argv: list[str], options: _Options) -> dict[str, Any]:
    """``--name VALUE`` / ``--name=VALUE`` / a bare ``--flag`` → {field: converted value}, as argparse would."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise UsageError(f"unrecognized argument {arg!r} (options are --name value; the recipe comes first)")
        spelling, has_inline, inline = arg[2:].partition("=")
        name, negated = options.resolve(spelling)
        kind = options.specs[name]["kind"]
        i += 1
        following = []
        while i < len(argv) and not argv[i].startswith("--") and not has_inline:
            following.append(argv[i])
            i += 1
            if kind != "list":
                break
        given = [inline] if has_inline else following
        if negated:
            values[name] = False
            continue
        if not given:
            if kind == "bool" and options.specs[name].get("default") is not None:  # as HfArgumentParser: nargs="?"
                values[name] = True
                continue
            raise UsageError(f"argument --{spelling}: expected {'at least ' if kind == 'list' else ''}one argument")
        if kind == "list":
            values[name] = given
            continue
        spec = options.specs[name]
        if kind == "choice":
            if given[0] not in [str(c) for c in spec["choices"]]:
                raise UsageError(f"argument --{spelling}: invalid choice: {given[0]!r} (choose from "
                                 f"{', '.join(map(repr, spec['choices']))})")  # fmt: skip
            values[name] = given[0]
            continue
        try:
            values[name] = _convert(kind, given[0])
        except ValueError:
            what = {"int": "int", "float": "float", "bool": "boolean"}.get(kind, kind)
            raise UsageError(f"argument --{spelling}: invalid {what} value: {given[0]!r}") from None
    return values


def check_quantization(value: Any) -> None:
    """Check a ``quantization`` name before torch is imported: ``get_scheme``'s rule and message against the snapshot
    (``qerl_trl.quantization`` imports torch). Nothing is parsed into a scheme here: the value stays a string, which
    the config parses once (``QeRLConfig.quant_scheme``). Where the registry or ``nvfp4.formats`` is loaded already (a
    format may have been registered at run time, which the snapshot would refuse), it checks nothing: the config's
    parse does. Raises :class:`~qerl_trl.validation.UsageError` (a ``ValueError``)."""
    if f"{__package__}.quantization" in sys.modules or "nvfp4.formats" in sys.modules:
        return
    table = _load_table()
    schemes, aliases = table["quantization"]["schemes"], table["quantization"]["aliases"]
    key = str(value).strip().lower()
    if aliases.get(key, key) not in schemes:
        ordered = sorted(aliases.items(), key=lambda ac: schemes.index(ac[1]))  # the registry's order (JSON sorts keys)
        named = ", ".join(f"{a!r} (= {c!r})" for a, c in ordered)
        raise UsageError(
            f"quantization must be one of {', '.join(map(repr, schemes))}; aliases: {named}, got {value!r}"
        )


class PrecheckedArgs(SimpleNamespace):
    """Attribute access to the merged values of one config (defaults, then recipe, then command line)."""


def _config_specs(algorithm: str) -> dict[str, dict]:
    """The specs of ``algorithm``'s trainer config fields (DAPO's adds its fields to GRPO's; any other name: GRPO's,
    the algorithm is refused elsewhere), from the snapshot."""
    table = _load_table()
    return {**table["grpo"], **(table["dapo"] if algorithm == "dapo" else {})}


@cache
def train_options(algorithm: str, script_arguments: type) -> _Options:
    """The options ``qerl train`` takes with ``algorithm``'s config (:func:`_config_specs`) and the script arguments
    ``script_arguments``."""
    return _Options({**_config_specs(algorithm), **_dataclass_specs(script_arguments)})


class TrainArguments(Protocol):
    """One ``qerl train``'s recipe and command line, each read once (``qerl_trl.cli.TrainInvocation``, which this
    module must not import: the CLI imports it)."""

    @property
    def recipe(self) -> dict[str, Any]:
        """The recipe's YAML mapping."""

    @property
    def recipe_file(self) -> str:
        """The recipe's path, as errors name it."""

    @property
    def algorithm(self) -> str:
        """The algorithm the recipe and the command line give."""

    @property
    def overrides(self) -> dict[str, Any]:
        """The command line parsed (:func:`_parse_command_line` against :func:`train_options`), on first use."""

    @property
    def drops_task_options(self) -> bool:
        """Whether ``--task`` changes the recipe's task without ``--task_options`` (the recipe's are dropped)."""


def precheck_train(args: TrainArguments, script_arguments: type) -> tuple[Any, PrecheckedArgs]:
    """Check ``qerl train``'s recipe and command line ``args`` (its overrides are asked for after the recipe is
    checked: a bad recipe is reported first) for the algorithm the two give, with ``script_arguments``
    (``qerl_trl.cli.ScriptArguments``, passed in: this module must not import the CLI that imports it) as
    far as can be done without the trainer config's class: option names, value types, the values'
    domains, the quantization and the task. Returns (script arguments, the config's merged values); raises
    :class:`~qerl_trl.validation.UsageError`. Paths are :func:`qerl_trl.validation.check_train_paths`' to check."""
    import dataclasses

    table = _load_table()
    algorithm, recipe_name = args.algorithm, args.recipe_file
    recipe = copy.deepcopy(args.recipe)  # its values go into the objects returned: the caller's mapping stays as read
    if algorithm not in ("grpo", "dapo"):
        raise UsageError(f"--algorithm must be 'grpo' or 'dapo', got {algorithm!r}")
    config_specs = _config_specs(algorithm)
    options = train_options(algorithm, script_arguments)
    for key in recipe:
        if key != "env" and key not in options.specs:
            raise UsageError(f"recipe {recipe_name}: unknown option {key!r}{_suggest(key, sorted(options.specs))}")
    values = {k: _recipe_value(recipe_name, k, options.specs[k]["kind"], v) for k, v in recipe.items() if k != "env"}
    if args.drops_task_options:  # the recipe's options belong to the recipe's task (n_examples, digits, ...)
        values.pop("task_options", None)
    values.update(args.overrides)
    for name, accepted, expected in CONFIG_RULES:
        value = values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not accepted(value):
            raise UsageError(f"{name} must be {expected}, got {value!r}")
    if values.get("resume_from_checkpoint") is not None:  # transformers' field, which the trainer never reads
        raise UsageError(f"--resume_from_checkpoint {values['resume_from_checkpoint']!r}: qerl train does not read "
                         "this transformers option (the run would start afresh); continue a run with --resume PATH "
                         "(a checkpoint-N folder) or --resume true (the newest one in --output_dir)")  # fmt: skip
    strategy = values.get("eval_strategy")  # else transformers' "no eval_dataset" traceback once the policy loaded
    if strategy is not None and str(getattr(strategy, "value", strategy)).lower() != "no":
        raise UsageError(f"--eval_strategy {strategy!r}: qerl train has no evaluation set, so it takes 'no' only; "
                         "evaluate the run's adapters with qerl eval --adapter <output_dir>/checkpoint-N")  # fmt: skip
    if "quantization" in values:
        check_quantization(values["quantization"])
        key = str(values["quantization"]).strip().lower()  # the canonical name, as the config keeps it ("rtn" → …)
        values["quantization"] = table["quantization"]["aliases"].get(key, key)
    kind = str(values.get("aqn_schedule", "exponential")).lower()
    if not any(k.startswith(kind) for k in table["aqn_schedules"]):  # make_schedule also takes exp, log, cos, const
        raise UsageError(f"aqn_schedule={values['aqn_schedule']!r}: unknown AQN schedule kind; expected one of "
                         f"{tuple(table['aqn_schedules'])}")  # fmt: skip
    script_fields = {f.name for f in dataclasses.fields(script_arguments)}
    script_args = script_arguments(**{k: v for k, v in values.items() if k in script_fields})
    if script_args.task not in table["tasks"]:
        raise UsageError(f"--task must be one of {', '.join(table['tasks'])}, got {script_args.task!r}")
    defaults = {k: s["default"] for k, s in config_specs.items() if "default" in s}
    config = PrecheckedArgs(**{**defaults, **{k: v for k, v in values.items() if k not in script_fields}})
    for name in ("max_steps", "seed"):  # NaN or inf where a count is meant
        if isinstance(getattr(config, name, None), float) and not math.isfinite(getattr(config, name)):
            raise UsageError(f"{name} must be a finite number, got {getattr(config, name)!r}")
    return script_args, config


if __name__ == "__main__":  # rewrite the snapshot after a change to the config classes or TRL
    OPTIONS_FILE.write_text(json.dumps(option_table(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OPTIONS_FILE}")
