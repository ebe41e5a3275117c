"""Tasks: prompts + gold answers as ``datasets.Dataset`` objects ready for TRL's GRPO trainer and ``qerl eval``.

Every task gives the columns

* ``prompt`` — conversational: ``[{"role": "system", ...}, {"role": "user", ...}]``;
* ``answer`` — the gold final answer as a string (what the accuracy rewards compare against);
* ``question`` — the original question text (plus, for GSM8K/MATH, ``solution``: the reference solution).

Tasks (:data:`TASKS`):

* ``gsm8k`` — Hub ``openai/gsm8k`` (config ``main``), or ``path=`` a folder holding ``train.jsonl``/``test.jsonl`` or one
  jsonl file with ``question``/``answer`` fields; gold = the text after ``####``.
* ``math`` — Hub ``HuggingFaceH4/MATH-500`` (test) and ``DigitalLearningGmbH/MATH-lighteval`` (train), or local jsonl with
  ``problem`` and ``answer`` or ``solution``; gold = ``answer``, else the last ``\\boxed{}`` of the solution.
* ``bigmath`` — Hub ``SynthLabsAI/Big-Math-RL-Verified`` (train only), or local jsonl with ``problem``/``answer``.
* ``arithmetic`` — synthetic and offline: ``What is 3 + 5?``, answered in ``<answer></answer>`` tags (short system prompt
  plus one demonstration exchange); small enough for the offline default model (SmolLM2-135M-Instruct) to learn within
  a few dozen GRPO steps.

Nothing is downloaded implicitly in an offline environment: a failed Hub load raises :class:`TaskDataError` telling the
user to pass ``path=``. :data:`TASK_DEFAULT_REWARDS` names each task's default reward functions (see
:mod:`qerl_trl.rewards`).
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset, concatenate_datasets

from .rewards import extract_boxed, extract_hash_answer, parse_number

__all__ = [
    "ARITHMETIC_DEMO",
    "ARITHMETIC_SYSTEM_PROMPT",
    "SYSTEM_PROMPT",
    "TASKS",
    "TASK_DEFAULT_REWARDS",
    "TASK_EVAL_REWARD",
    "TASK_OPTIONS",
    "TaskDataError",
    "arithmetic_dataset",
    "check_task_options",
    "load_task",
    "make_prompt",
]

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves problems step by step. "
    "First think through the reasoning inside <think> </think> tags, then give only the final answer inside "
    "<answer> </answer> tags. Your response must have exactly this format:\n"
    "<think> reasoning </think><answer> final answer </answer>"
)
"""System prompt for the reasoning tasks: it states the exact format that :func:`~qerl_trl.rewards.format_reward` checks."""

ARITHMETIC_SYSTEM_PROMPT = "Answer with the number only, inside <answer></answer> tags."
"""Short system prompt of the arithmetic task (a 135M model follows short instructions better than long ones)."""

ARITHMETIC_DEMO: list[dict[str, str]] = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<answer>5</answer>"},
]
"""One worked exchange placed between the system prompt and the question of every arithmetic prompt.

Measured on SmolLM2-135M-Instruct (48 prompts, temperature 1, 24 new tokens): with the system prompt alone it never
wrote ``<answer>`` tags (0/48, whatever the wording); with this demonstration 40% of its answers are tagged, so the tag
reward has signal from the first GRPO step. Accuracy stayed at ~19% (lenient) either way.
"""

TASK_DEFAULT_REWARDS: dict[str, list[str]] = {
    "gsm8k": ["gsm8k_accuracy", "format"],
    "math": ["math_accuracy", "format"],
    "bigmath": ["math_accuracy", "format"],
    "arithmetic": ["arithmetic_accuracy"],
}
# arithmetic: accuracy alone. With a 0.2 tag bonus beside it, NVFP4 policies learned fixed well-tagged wrong answers
# (reward up, accuracy down: BENCHMARKS.md, learning study); the prompt's one-shot demo already teaches the tags.
"""Default reward functions per task, by :data:`qerl_trl.rewards.REWARD_FUNCS` name (use ``get_reward_funcs``)."""

TASK_EVAL_REWARD: dict[str, str] = {
    "gsm8k": "gsm8k_accuracy",
    "math": "math_accuracy",
    "bigmath": "math_accuracy",
    "arithmetic": "arithmetic_accuracy",
}
"""The accuracy reward ``qerl eval`` scores each task with (1.0 = correct)."""


class TaskDataError(RuntimeError):
    """A task's data could not be found or loaded (the message says what to pass instead)."""


def make_prompt(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """A conversational prompt: the system message (if any) and the user's question."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": question}]


# --------------------------------------------------------------------------------------------------------------------
# loading helpers


_JSONL = "the file must be JSON Lines: one JSON object (one row) per line"
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file; a line that is no JSON object (a JSON array file, say) or a file that is not
    text (Parquet, say) is named as such."""
    rows = []
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is read past
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    hint = f"; {_JSONL}" if line.startswith("[") else ""
                    raise TaskDataError(f"{path}:{lineno}: not valid JSON ({e.msg}){hint}") from e
                if not isinstance(row, dict):
                    kind = _JSON_KINDS.get(type(row), type(row).__name__)
                    raise TaskDataError(f"{path}:{lineno}: a JSON {kind}, not an object: {_JSONL}")
                rows.append(row)
    except UnicodeDecodeError as e:  # a ValueError, which the CLI would have pinned on --task_options
        raise TaskDataError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start}): {_JSONL}") from e
    if not rows:
        raise TaskDataError(f"{path}: no rows")
    return rows


def _local_rows(task: str, path: str | Path, split: str) -> list[dict[str, Any]]:
    """Rows from ``path``: a jsonl file (used whatever the split), or a folder holding ``<split>.jsonl``."""
    p = Path(path).expanduser()
    if p.is_file():
        return _read_jsonl(p)
    if p.is_dir():
        for name in (f"{split}.jsonl", f"{split}.json"):
            if (p / name).is_file():
                return _read_jsonl(p / name)
        have = sorted(f.name for f in p.glob("*.jsonl")) or ["no .jsonl files"]
        raise TaskDataError(f"task {task!r}: {p} has no {split}.jsonl (found: {', '.join(have)})")
    raise TaskDataError(f"task {task!r}: data path {p} does not exist (give a folder with {split}.jsonl or a .jsonl file)")


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached, when that is known at once, else None: no proxy is set and the Hub's
    host does not resolve (a client without a proxy must resolve it itself). ``datasets`` would find out after 5
    retries with backoff (~40 s of "Retrying in 8s" lines). Under ``HF_HUB_OFFLINE`` nothing is asked (its cache
    answers), nor behind a proxy (which resolves for the client)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in proxies):
        return None
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"{host} does not resolve ({e.strerror or e}) and no proxy is set"
    return None


def _hub_rows(task: str, repo: str, split: str, config: str | None = None, local_hint: str = "") -> Dataset:
    from datasets import load_dataset

    what = f"task {task!r}: could not load {repo}{f' ({config})' if config else ''} split {split!r} from the Hugging Face Hub"
    local = f"Without network access pass path= (CLI: --data-path) {local_hint}"
    if (why := hub_unreachable()) is not None:
        raise TaskDataError(f"{what} ({why}; HF_HUB_OFFLINE=1 reads a cached copy). {local}")
    try:
        return load_dataset(repo, config, split=split)
    except Exception as e:  # offline, missing, gated...: the user needs to know the local alternative
        raise TaskDataError(f"{what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). {local}") from e


def _require(row: dict[str, Any], keys: tuple[str, ...], task: str, where: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise TaskDataError(f"task {task!r}: {where} rows lack field(s) {missing} (have {sorted(row)})")


def _text(row: dict[str, Any], key: str) -> str:
    """``row[key]``, which must be a non-empty text: a question, problem or solution that is null, empty or a number
    would make an empty prompt or fail in pyarrow. Else a TypeError / ValueError naming the field (:func:`_build`
    puts it on the row)."""
    value = row[key]
    if not isinstance(value, str):
        raise TypeError(f"field {key!r} must be a text, got {type(value).__name__} {value!r:.80}")
    if not value.strip():
        raise ValueError(f"field {key!r} is empty ({value!r:.80})")
    return value


def _gold(row: dict[str, Any], key: str) -> str | None:
    """``row[key]``, a gold answer, as a string; None when it is missing, null, empty or NaN (``str()`` of those, the
    gold "None" or "", would be scored against every completion)."""
    value = row.get(key)
    if value is None or (isinstance(value, float) and value != value) or not str(value).strip():
        return None
    return str(value)


def _build(rows, convert: Callable[[dict[str, Any]], dict[str, Any]], limit: int | None, what: str) -> Dataset:
    """``convert`` of each row (the first ``limit``); ``what`` (``"task 'gsm8k': <source>"``) names the source when a
    row's field has a type ``convert`` cannot read: a :class:`TaskDataError` naming the row, not a bare TypeError."""
    if isinstance(rows, Dataset) and limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    out = []
    for row in rows:
        if limit is not None and len(out) >= limit:
            break
        try:
            out.append(convert(row))
        except (TypeError, ValueError, AttributeError) as e:  # e.g. a number where a text is meant
            raise TaskDataError(f"{what}: row {len(out) + 1}: {type(e).__name__}: {e}") from e
    return Dataset.from_list(out)


def _check_split(task: str, split: str, valid: tuple[str, ...]) -> None:
    if split not in valid:
        raise TaskDataError(f"task {task!r} has no split {split!r}; valid splits: {', '.join(valid)}")


# --------------------------------------------------------------------------------------------------------------------
# tasks


def _gsm8k(split: str, path, limit, seed, system_prompt: str | None = SYSTEM_PROMPT) -> Dataset:
    _check_split("gsm8k", split, ("train", "test"))
    if path is not None:
        rows = _local_rows("gsm8k", path, split)
        where = str(path)
    else:
        rows = _hub_rows("gsm8k", "openai/gsm8k", split, "main", "a folder with train.jsonl/test.jsonl (GSM8K's fields "
                         "question/answer), e.g. ../shared/data/gsm8k.")
        where = "openai/gsm8k"

    def convert(row):
        _require(row, ("question", "answer"), "gsm8k", where)
        question, solution = _text(row, "question"), _text(row, "answer")
        gold = extract_hash_answer(solution)
        if gold is None:
            raise TaskDataError(f"task 'gsm8k': {where}: an answer without '####': {row['answer'][:80]!r}")
        return {"prompt": make_prompt(question, system_prompt), "answer": gold, "question": question,
                "solution": solution}

    data = _build(rows, convert, limit, f"task 'gsm8k': {where}")
    _check_numeric_golds(data["answer"], f"task 'gsm8k': {where}")
    return data


def _check_numeric_golds(golds: Sequence[str], what: str) -> None:
    """gsm8k_accuracy_reward compares numbers and scores a row whose gold is none as ``None`` (TRL leaves it out): with
    no numeric gold at all the run would train on the format reward alone, said nowhere. Refuse that; warn on some."""
    bad = [(i, g) for i, g in enumerate(golds, 1) if parse_number(g) is None]
    if not bad:
        return
    first = f"row {bad[0][0]}: {bad[0][1][:60]!r}"
    if len(bad) == len(golds):
        raise TaskDataError(f"{what}: no gold answer (the text after '####') is a number ({first}), so "
                            "gsm8k_accuracy_reward can score none: use task 'math' (math-verify) for such answers")  # fmt: skip
    warnings.warn(f"{what}: {len(bad)} of {len(golds)} gold answers are no number ({first}); gsm8k_accuracy_reward "
                  "leaves those rows out", stacklevel=3)  # fmt: skip


def _math(split: str, path, limit, seed, system_prompt: str | None = SYSTEM_PROMPT) -> Dataset:
    _check_split("math", split, ("train", "test"))
    if path is not None:
        rows = _local_rows("math", path, split)
        where = str(path)
    else:
        hint = "a folder with train.jsonl/test.jsonl (fields problem and answer or solution) or one such .jsonl file."
        if split == "test":
            rows, where = _hub_rows("math", "HuggingFaceH4/MATH-500", "test", None, hint), "HuggingFaceH4/MATH-500"
        else:
            rows = _hub_rows("math", "DigitalLearningGmbH/MATH-lighteval", "train", "default", hint)
            where = "DigitalLearningGmbH/MATH-lighteval"

    def convert(row):
        _require(row, ("problem",), "math", where)
        problem = _text(row, "problem")
        solution = _text(row, "solution") if row.get("solution") not in (None, "") else ""
        gold = _gold(row, "answer")
        if gold is None:
            gold = extract_boxed(solution)
        if gold in (None, ""):
            raise TaskDataError(f"task 'math': {where}: a row with neither 'answer' nor a \\boxed{{}} solution: "
                                f"{problem[:80]!r}")
        return {"prompt": make_prompt(problem, system_prompt), "answer": gold, "question": problem,
                "solution": solution}

    return _build(rows, convert, limit, f"task 'math': {where}")


def _bigmath(split: str, path, limit, seed, system_prompt: str | None = SYSTEM_PROMPT) -> Dataset:
    if path is not None:
        rows = _local_rows("bigmath", path, split)
        where = str(path)
    else:
        _check_split("bigmath", split, ("train",))
        rows = _hub_rows("bigmath", "SynthLabsAI/Big-Math-RL-Verified", "train", None,
                         "a .jsonl file with fields problem/answer.")
        where = "SynthLabsAI/Big-Math-RL-Verified"

    def convert(row):
        _require(row, ("problem", "answer"), "bigmath", where)
        problem, gold = _text(row, "problem"), _gold(row, "answer")
        if gold is None:
            raise ValueError(f"field 'answer' (the gold answer) is empty: {row['answer']!r}")
        return {"prompt": make_prompt(problem, system_prompt), "answer": gold, "question": problem}

    return _build(rows, convert, limit, f"task 'bigmath': {where}")


_OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_dataset(
    n_examples: int = 1000,
    *,
    digits: int | Sequence[int] = 1,
    ops: str = "+",
    seed: int = 0,
    split: str = "train",
    system_prompt: str | None = ARITHMETIC_SYSTEM_PROMPT,
    demo: bool = True,
) -> Dataset:
    """Synthetic problems ``What is a <op> b?`` with ``a, b`` of up to ``digits`` digits and ``<op>`` drawn from ``ops``.

    Deterministic in ``(n_examples, digits, ops, seed, split)``; ``train`` and ``test`` draw from different streams
    (with one digit and ``+`` only 100 problems exist, so the splits overlap). Subtraction is written larger-first, so
    every answer is a non-negative integer. Columns: ``prompt``, ``answer``, ``question``, ``a``, ``b``, ``op``.

    The prompt is ``system_prompt``, then (with ``demo``) the one-shot exchange :data:`ARITHMETIC_DEMO`, then
    ``What is a + b?``.

    ``digits`` as a list (e.g. ``[1, 2]``) makes a curriculum: ``len(digits)`` consecutive blocks of rows (sizes
    differing by at most one), block ``i`` drawn as ``arithmetic_dataset`` with ``digits[i]`` draws it (its rows are
    that dataset's first rows). The order only reaches the model if the trainer does not shuffle
    (``shuffle_dataset: false``).
    """
    _check_split("arithmetic", split, ("train", "test"))
    if isinstance(n_examples, bool) or not isinstance(n_examples, int) or n_examples < 1:
        raise ValueError(f"n_examples must be an int >= 1, got {n_examples!r}")
    if isinstance(digits, bool | str) or not isinstance(digits, int | Sequence):
        raise ValueError(f"digits must be an int or a non-empty list of ints, got {digits!r}")
    if not isinstance(digits, int):
        stages = list(digits)
        if not stages or not all(isinstance(d, int) and not isinstance(d, bool) for d in stages):
            raise ValueError(f"digits must be an int or a non-empty list of ints, got {digits!r}")
        if n_examples < len(stages):
            raise ValueError(f"n_examples ({n_examples}) must be >= the number of curriculum stages ({len(stages)})")
        sizes = [n_examples // len(stages) + (i < n_examples % len(stages)) for i in range(len(stages))]
        parts = [arithmetic_dataset(n, digits=d, ops=ops, seed=seed, split=split, system_prompt=system_prompt,
                                    demo=demo) for n, d in zip(sizes, stages)]  # fmt: skip
        return concatenate_datasets(parts)
    if not 1 <= digits <= 9:
        raise ValueError(f"digits must be in 1..9, got {digits}")
    bad = [op for op in ops if op not in _OPS] if isinstance(ops, str) else [ops]
    if bad or not ops:
        raise ValueError(f"ops must be a string of {''.join(_OPS)} characters, got {ops!r}")
    rng = random.Random(f"qerl-arithmetic/{seed}/{split}/{digits}/{ops}")  # str seeds are stable across processes
    hi = 10**digits - 1
    rows = []
    for _ in range(n_examples):
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
        if op == "-" and b > a:
            a, b = b, a
        question = f"What is {a} {op} {b}?"
        prompt = make_prompt(question, system_prompt)
        if demo:
            prompt[-1:-1] = [dict(m) for m in ARITHMETIC_DEMO]
        rows.append({"prompt": prompt, "answer": str(_OPS[op](a, b)),
                     "question": question, "a": a, "b": b, "op": op})
    return Dataset.from_list(rows)


def _arithmetic(split: str, path, limit, seed, **options: Any) -> Dataset:
    if path is not None:
        raise TaskDataError("task 'arithmetic' is synthetic: it takes no path (options: n_examples, digits, ops)")
    n = options.pop("n_examples", 1000 if split == "train" else 200)
    if limit is not None and isinstance(n, int) and not isinstance(n, bool):  # else arithmetic_dataset names it
        n = min(n, limit)
    return arithmetic_dataset(n, seed=seed, split=split, **options)


TASKS: dict[str, Callable[..., Dataset]] = {"gsm8k": _gsm8k, "math": _math, "bigmath": _bigmath, "arithmetic": _arithmetic}
"""Task loaders by name."""

TASK_OPTIONS: dict[str, tuple[str, ...]] = {
    **{name: ("system_prompt",) for name in TASKS},
    "arithmetic": ("demo", "digits", "n_examples", "ops", "system_prompt"),
}
"""The options (``--task_options`` keys) each task takes."""


def check_task_options(name: str, options: Any) -> None:
    """Raise ``TypeError`` naming the options of ``options`` that task ``name`` does not take, and those it takes
    (a loader argument, ``seed``, ``split``, ``limit`` or ``path``, said to be set by its own option)."""
    if name not in TASK_OPTIONS:  # load_task names the tasks
        return
    takes = TASK_OPTIONS[name]
    unknown = sorted(set(options or ()) - set(takes))
    if not unknown:
        return
    said = f"its options: {', '.join(takes)}" if len(takes) > 1 else f"only {', '.join(takes)}"
    hint = ""
    if set(unknown) & {"seed", "split", "limit", "path"}:
        hint = ("; seed, split, limit and path are set by their own options (qerl train: --seed, --split, --limit, "
                "--data_path)")  # fmt: skip
    raise TypeError(f"task {name!r} takes no option(s) {unknown} ({said}){hint}")


def load_task(
    name: str,
    split: str = "train",
    *,
    path: str | Path | None = None,
    limit: int | None = None,
    seed: int = 0,
    **options: Any,
) -> Dataset:
    """Load task ``name``'s ``split`` as a ``Dataset`` with columns ``prompt``, ``answer``, ``question`` (+ extras).

    Args:
        name: one of :data:`TASKS` (``gsm8k``, ``math``, ``bigmath``, ``arithmetic``).
        split: ``train`` or ``test``.
        path: local data instead of the Hub — a folder with ``<split>.jsonl`` or a single ``.jsonl`` file.
        limit: keep the first ``limit`` examples (file/Hub order; the same examples every time).
        seed: seed of the synthetic ``arithmetic`` task (other tasks are not shuffled here; the trainer shuffles).
        **options: task options — ``system_prompt`` (any task; ``None`` for no system message); for ``arithmetic``
            ``n_examples`` (default 1000 train / 200 test), ``digits`` (default 1; a list: a curriculum), ``ops`` (default ``"+"``, e.g.
            ``"+-*"``), ``demo`` (default ``True``: the one-shot exchange :data:`ARITHMETIC_DEMO`).

    Raises:
        TaskDataError: unknown task or split, missing files or fields, or a Hub load that failed (e.g. offline).
    """
    if name not in TASKS:
        raise TaskDataError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    check_task_options(name, options)
    return TASKS[name](split, path, limit, seed, **options)
