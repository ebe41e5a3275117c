"""Tasks (qerl_trl.tasks): local jsonl loading, the synthetic arithmetic task, Hub errors offline."""

from __future__ import annotations

import json
import re

import pytest
from qerl_trl.rewards import arithmetic_accuracy_reward, format_reward, get_reward_funcs, gsm8k_accuracy_reward
from qerl_trl.tasks import (
    ARITHMETIC_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    TASK_DEFAULT_REWARDS,
    TaskDataError,
    arithmetic_dataset,
    load_task,
)


def test_system_prompt_states_the_rewarded_format():
    """The reference implementation rewarded a format it never asked for: the prompt must spell it out."""
    assert "<think> reasoning </think><answer> final answer </answer>" in SYSTEM_PROMPT
    example = "<think> reasoning </think><answer> final answer </answer>"
    assert format_reward([example]) == [1.0]  # the format the prompt shows earns the full format reward
    assert "<answer></answer>" in ARITHMETIC_SYSTEM_PROMPT


def test_gsm8k_local_folder(gsm8k_dir):
    ds = load_task("gsm8k", "test", path=gsm8k_dir, limit=5)
    assert len(ds) == 5
    assert {"prompt", "answer", "question"} <= set(ds.column_names)
    row = ds[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][0]["content"] == SYSTEM_PROMPT
    assert row["prompt"][1]["content"] == row["question"]
    assert row["question"].startswith("Janet")
    assert list(ds["answer"]) == ["18", "3", "70000", "540", "20"]
    # the gold answer and a right completion score 1.0 with the task's default accuracy reward
    (acc, fmt) = get_reward_funcs(TASK_DEFAULT_REWARDS["gsm8k"])
    assert acc([f"<think>..</think><answer>{a}</answer>" for a in ds["answer"]], answer=list(ds["answer"])) == [1.0] * 5
    train = load_task("gsm8k", "train", path=gsm8k_dir, limit=2)
    assert train[0]["answer"] == "72"


def test_gsm8k_single_file_and_options(gsm8k_dir, tmp_path):
    ds = load_task("gsm8k", "train", path=gsm8k_dir / "test.jsonl", limit=3, system_prompt=None)
    assert [m["role"] for m in ds[0]["prompt"]] == ["user"]
    assert list(ds["answer"]) == ["18", "3", "70000"]
    with pytest.raises(TypeError, match="digits"):
        load_task("gsm8k", "test", path=gsm8k_dir, digits=2)


def test_math_local_jsonl(tmp_path):
    rows = [
        {"problem": "What is 1/2 of 1?", "answer": "\\frac{1}{2}"},
        {"problem": "Compute 3*4.", "solution": "We get $3\\cdot4=\\boxed{12}$."},
        {"problem": "Nested?", "solution": "So $\\boxed{\\frac{\\sqrt{2}}{2}}$."},
    ]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = load_task("math", "test", path=tmp_path)
    assert list(ds["answer"]) == ["\\frac{1}{2}", "12", "\\frac{\\sqrt{2}}{2}"]
    assert ds[1]["question"] == "Compute 3*4."
    (acc, _) = get_reward_funcs(TASK_DEFAULT_REWARDS["math"])
    assert acc(["<answer>0.5</answer>", "\\boxed{12}", "\\boxed{\\frac{1}{\\sqrt{2}}}"], answer=list(ds["answer"])) == [1.0] * 3
    (tmp_path / "bad.jsonl").write_text(json.dumps({"problem": "no answer", "solution": "none"}) + "\n")
    with pytest.raises(TaskDataError, match="neither 'answer' nor"):
        load_task("math", path=tmp_path / "bad.jsonl")


def test_bigmath_local_jsonl(tmp_path):
    f = tmp_path / "bigmath.jsonl"
    f.write_text(json.dumps({"problem": "2+2?", "answer": 4, "source": "x"}) + "\n")
    ds = load_task("bigmath", path=f)
    assert ds[0]["answer"] == "4" and ds[0]["question"] == "2+2?"


def test_errors_unknown_task_split_missing_files(tmp_path, gsm8k_dir):
    with pytest.raises(TaskDataError, match="valid tasks: arithmetic, bigmath, gsm8k, math"):
        load_task("gsm9k")
    with pytest.raises(TaskDataError, match="no split 'validation'; valid splits: train, test"):
        load_task("gsm8k", "validation", path=gsm8k_dir)
    with pytest.raises(TaskDataError, match="has no test.jsonl"):
        load_task("gsm8k", "test", path=tmp_path)
    with pytest.raises(TaskDataError, match="does not exist"):
        load_task("gsm8k", "test", path=tmp_path / "nope")
    (tmp_path / "test.jsonl").write_text('{"q": 1}\n')
    with pytest.raises(TaskDataError, match=r"lack field\(s\) \['question', 'answer'\]"):
        load_task("gsm8k", "test", path=tmp_path)
    (tmp_path / "test.jsonl").write_text("{not json\n")
    with pytest.raises(TaskDataError, match="test.jsonl:1: not valid JSON"):
        load_task("gsm8k", "test", path=tmp_path)
    with pytest.raises(TaskDataError, match="synthetic"):
        load_task("arithmetic", path=tmp_path)


def test_a_row_of_the_wrong_type_is_named_with_its_file_and_row(tmp_path):
    """A data file whose row has a field of another type (a number where GSM8K's solution text is meant): the error
    names the data path and the row, not ``--task_options`` (which the user did not even give)."""
    from qerl_trl.validation import UsageError, load_task_data

    (tmp_path / "train.jsonl").write_text('{"question": "1+4?", "answer": "#### 5"}\n{"question": "1+1?", "answer": 2}\n')
    with pytest.raises(TaskDataError, match=r"task 'gsm8k': .*: row 2: TypeError"):
        load_task("gsm8k", path=tmp_path)
    with pytest.raises(UsageError, match=r"^--data_path '.*': task 'gsm8k': .*row 2") as info:
        load_task_data("gsm8k", "train", str(tmp_path), None, 0, None, ("--data_path", "--task_options"))
    assert "--task_options" not in str(info.value)


def test_a_json_array_file_is_named_as_such(tmp_path):
    """A ``train.json`` holding a JSON array (the folder lookup takes ``<split>.json``) or a line that is not an object:
    one error saying the file must be JSON Lines, not "rows lack field(s) ... (have [{...whole row...}])" or a bare
    "Expecting value"."""
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    (tmp_path / "train.json").write_text(json.dumps(rows) + "\n")
    with pytest.raises(TaskDataError, match=r"train.json:1: a JSON array, not an object.*JSON Lines") as info:
        load_task("gsm8k", path=tmp_path)
    assert "lack field" not in str(info.value)
    (tmp_path / "train.json").write_text(json.dumps(rows, indent=2) + "\n")  # pretty-printed: line 1 is "["
    with pytest.raises(TaskDataError, match=r"train.json:1: not valid JSON .*JSON Lines"):
        load_task("gsm8k", path=tmp_path)
    (tmp_path / "train.json").write_text(json.dumps(rows[0]) + '\n"2+2?"\n')
    with pytest.raises(TaskDataError, match=r"train.json:2: a JSON string, not an object"):
        load_task("gsm8k", path=tmp_path)


def test_a_json_lines_file_with_a_byte_order_mark_reads(tmp_path):
    """Windows editors (Notepad, Excel's "CSV UTF-8" kin) write UTF-8 with a byte-order mark: its rows read as without
    one (it was refused: "line 1: not valid JSON (Unexpected UTF-8 BOM ...)")."""
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "train.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "train.jsonl").write_text(text)
    assert load_task("gsm8k", path=tmp_path)[0] == load_task("gsm8k", path=tmp_path / "plain")[0]


def test_a_binary_data_file_is_named_as_not_json_lines(tmp_path):
    """A Parquet file as the data path (the Hub's own format) failed in a bare UnicodeDecodeError, which qerl train
    reported as "--task_options None: 'utf-8' codec can't decode byte ..." (options the user never gave); now one
    error naming the file and that it must be JSON Lines, attributed to --data_path."""
    from datasets import Dataset
    from qerl_trl.validation import UsageError, load_task_data

    data = tmp_path / "train.parquet"
    Dataset.from_list([{"question": "1+1?", "answer": "#### 2"}] * 4).to_parquet(data)
    with pytest.raises(TaskDataError, match=r"train.parquet: not a UTF-8 text file .*JSON Lines"):
        load_task("gsm8k", path=data)
    with pytest.raises(UsageError, match=r"^--data_path .*train.parquet.*not a UTF-8 text file") as info:
        load_task_data("gsm8k", "train", str(data), None, 0, None, ("--data_path", "--task_options"))
    assert "--task_options" not in str(info.value)


@pytest.mark.parametrize(
    "task, row, field",
    [
        ("gsm8k", {"question": "", "answer": "#### 5"}, "question"),
        ("gsm8k", {"question": None, "answer": "#### 5"}, "question"),
        ("gsm8k", {"question": 7, "answer": "#### 5"}, "question"),
        ("gsm8k", {"question": "1+4?", "answer": None}, "answer"),
        ("math", {"problem": "  ", "answer": "3"}, "problem"),
        ("math", {"problem": "1+2?", "answer": "3", "solution": 3}, "solution"),
        ("bigmath", {"problem": "2+2?", "answer": None}, "answer"),
        ("bigmath", {"problem": "2+2?", "answer": ""}, "answer"),
        ("bigmath", {"problem": None, "answer": "4"}, "problem"),
    ],
)
def test_a_row_with_an_empty_or_non_text_field_is_refused(tmp_path, task, row, field):
    """A question that is empty or not a text, or a gold answer that is null or empty: one error naming the file, the
    row and the field. Before, bigmath took a null answer as the gold "None" (every completion scored against it), an
    empty question made an empty prompt, and a numeric question failed in pyarrow, reported by qerl train as a bad
    ``--task_options`` the user never gave."""
    from qerl_trl.validation import UsageError, load_task_data

    good = {"gsm8k": {"question": "1+1?", "answer": "#### 2"}}.get(task, {"problem": "1+1?", "answer": "2"})
    (tmp_path / "train.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskDataError, match=rf"task '{task}': .*: row 2: \w+Error: field '{field}'"):
        load_task(task, path=tmp_path)
    with pytest.raises(UsageError, match=r"^--data_path .*row 2") as info:
        load_task_data(task, "train", str(tmp_path), None, 0, None, ("--data_path", "--task_options"))
    assert "--task_options" not in str(info.value)


@pytest.mark.parametrize("task, split", [("gsm8k", "test"), ("math", "test"), ("math", "train"), ("bigmath", "train")])
def test_hub_load_offline_tells_user_to_pass_path(task, split, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # both libraries read the variable at import time: set their flags as well
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TaskDataError, match=r"pass path= \(CLI: --data-path\)"):
        load_task(task, split)


def test_an_unresolvable_hub_fails_at_once_with_the_local_alternative(monkeypatch):
    """No proxy and a Hub host that cannot resolve (``.invalid`` never does, RFC 2606): one error naming why and the
    local alternative, before ``datasets`` is asked (it would retry 5 times, ~40 s). Under ``HF_HUB_OFFLINE`` or
    behind a proxy nothing is probed: the cache or the proxy answers."""
    import huggingface_hub.constants
    from qerl_trl.tasks import hub_unreachable

    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.qerl-test.invalid")
    assert hub_unreachable().startswith("hub.qerl-test.invalid does not resolve")
    with pytest.raises(TaskDataError) as info:
        load_task("gsm8k", "test")
    msg = str(info.value)
    assert "\n" not in msg and "could not load openai/gsm8k (main) split 'test'" in msg, msg
    assert "does not resolve" in msg and "HF_HUB_OFFLINE=1" in msg and "pass path= (CLI: --data-path)" in msg
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert hub_unreachable() is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert hub_unreachable() is None


def test_arithmetic_is_deterministic_and_correct():
    a = load_task("arithmetic", "train", n_examples=300, seed=3)
    b = load_task("arithmetic", "train", n_examples=300, seed=3)
    assert a.to_list() == b.to_list()
    assert a.to_list() != load_task("arithmetic", "train", n_examples=300, seed=4).to_list()
    assert a["question"] != load_task("arithmetic", "test", n_examples=300, seed=3)["question"]
    for row in a:
        assert 0 <= row["a"] <= 9 and 0 <= row["b"] <= 9 and row["op"] == "+"
        assert row["question"] == f"What is {row['a']} + {row['b']}?"
        assert int(row["answer"]) == row["a"] + row["b"]
    assert len(set(a["question"])) > 50  # covers most of the 100 one-digit sums


def test_arithmetic_options_and_prompt():
    ds = arithmetic_dataset(400, digits=2, ops="+-*", seed=0)
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
    assert set(ds["op"]) == {"+", "-", "*"}
    for row in ds:
        assert int(row["answer"]) == ops[row["op"]](row["a"], row["b"]) >= 0
        assert row["a"] <= 99 and row["b"] <= 99
    prompt = ds[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user"]  # system, one-shot demo, question
    assert prompt[0]["content"] == ARITHMETIC_SYSTEM_PROMPT
    assert prompt[2]["content"] == "<answer>5</answer>"
    assert prompt[-1]["content"] == ds[0]["question"]
    assert sum(len(m["content"]) for m in prompt) < 200  # short: a 135M model loses long instructions
    bare = load_task("arithmetic", n_examples=2, demo=False, system_prompt=None)
    assert [m["role"] for m in bare[0]["prompt"]] == ["user"]
    assert len(load_task("arithmetic", "test")) == 200 and len(load_task("arithmetic", limit=7)) == 7
    for bad in (dict(digits=0), dict(ops="/"), dict(n_examples=0)):
        with pytest.raises(ValueError):
            load_task("arithmetic", **bad)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"n_examples": "500"}, "n_examples must be an int >= 1, got '500'"),
        ({"n_examples": True}, "n_examples must be an int >= 1, got True"),
        ({"digits": 1.5}, "digits must be an int or a non-empty list of ints, got 1.5"),
        ({"digits": True}, "digits must be an int or a non-empty list of ints, got True"),
        ({"ops": 5}, "ops must be a string of"),
    ],
)
def test_arithmetic_options_of_the_wrong_type_say_which(options, message):
    """``task_options`` of the wrong type (a quoted number in YAML, a float) failed in Python's own words ("'<' not
    supported between instances of 'str' and 'int'", "'float' object is not iterable") or were taken silently
    (``digits: true`` as 1, ``n_examples: true`` as one problem); now the option, the value and what it takes."""
    with pytest.raises(ValueError, match=re.escape(message)):
        load_task("arithmetic", **options)


@pytest.mark.parametrize("value", ["500", "5x", [5]])
def test_an_n_examples_of_the_wrong_type_says_which_with_a_limit_too(value):
    """With a limit (qerl eval --limit 2 --task-option n_examples=5x, qerl train --limit) the option was compared with
    it first: "'<' not supported between instances of 'int' and 'str'", naming neither; now as without a limit."""
    with pytest.raises(ValueError, match=re.escape(f"n_examples must be an int >= 1, got {value!r}")):
        load_task("arithmetic", "test", limit=2, n_examples=value)


@pytest.mark.parametrize(
    "options", [{"digitz": 2}, {"seed": 3}, {"split": "test"}, {"limit": 3}, {"path": "data.jsonl"}]
)
def test_an_unknown_arithmetic_option_names_the_options_it_takes(options):
    """``--task_options '{"digitz": 2}'`` said only "arithmetic_dataset() got an unexpected keyword argument 'digitz'",
    and an option that is a loader argument ("seed", "split", "limit") "load_task() got multiple values for keyword
    argument 'seed'": neither said what the task takes. Now one line naming the option and the task's options (the
    other tasks already said "only system_prompt"), and where a loader argument is set instead."""
    from qerl_trl.validation import UsageError, load_task_data

    with pytest.raises(UsageError) as info:
        load_task_data("arithmetic", "train", None, None, 0, options, ("--data_path", "--task_options"))
    message = str(info.value)
    name = next(iter(options))
    assert f"task 'arithmetic' takes no option(s) ['{name}']" in message, message
    assert "demo, digits, n_examples, ops, system_prompt" in message and "\n" not in message, message
    if name != "digitz":
        assert "--seed, --split, --limit, --data_path" in message, message


def test_arithmetic_curriculum_is_ordered_blocks():
    ds = load_task("arithmetic", n_examples=301, digits=[1, 2], seed=5)
    assert len(ds) == 301
    first, second = ds.select(range(151)), ds.select(range(151, 301))
    # each block is the plain dataset of its digits (its first rows), easiest first
    assert first.to_list() == arithmetic_dataset(151, digits=1, seed=5).to_list()
    assert second.to_list() == arithmetic_dataset(150, digits=2, seed=5).to_list()
    assert max(max(r["a"], r["b"]) for r in first) <= 9 and max(max(r["a"], r["b"]) for r in second) > 9
    for bad in (dict(digits=[]), dict(digits=[1, "2"]), dict(digits=[1, 2], n_examples=1), dict(digits=[1, 12])):
        with pytest.raises(ValueError):
            load_task("arithmetic", **bad)


def test_arithmetic_default_rewards():
    ds = load_task("arithmetic", n_examples=4)
    funcs = get_reward_funcs(TASK_DEFAULT_REWARDS["arithmetic"])
    assert funcs[0] is arithmetic_accuracy_reward
    gold = list(ds["answer"])
    tagged = [f"<answer>{g}</answer>" for g in gold]
    untagged = [f"It is {g}." for g in gold]
    wrong = [f"<answer>{int(g) + 1}</answer>" for g in gold]
    total = lambda comps: [sum(vals) for vals in zip(*(f(comps, answer=gold) for f in funcs))]
    assert total(tagged) == [1.0] * 4
    assert total(untagged) == [1.0] * 4  # the lenient accuracy pays without tags
    assert total(wrong) == [0.0] * 4  # a wrong answer earns nothing, tagged or not (no format bonus to farm)
    assert gsm8k_accuracy_reward(tagged, answer=gold) == [1.0] * 4


def test_an_error_without_task_options_is_not_pinned_on_them():
    """``load_task_data`` named ``--task_options None`` for any ValueError, options given or not."""
    from qerl_trl.validation import UsageError, load_task_data

    with pytest.raises(UsageError, match=r"^--task arithmetic: limit must be >= 1") as info:
        load_task_data("arithmetic", "train", None, 0, 0, None, ("--data_path", "--task_options"))
    assert "task_options" not in str(info.value)
    with pytest.raises(UsageError, match=r"^--task_options \{'digits': 1\}: limit must be >= 1"):
        load_task_data("arithmetic", "train", None, 0, 0, {"digits": 1}, ("--data_path", "--task_options"))


def test_gsm8k_gold_answers_that_are_no_number(tmp_path):
    """gsm8k_accuracy_reward scores a row whose gold is no number as None: with none numeric the run trained on the
    format reward alone without a word; now refused (all) or warned (some)."""
    rows = [{"question": "Capital of France?", "answer": "It is Paris.\n#### Paris"},
            {"question": "2+2?", "answer": "#### 4"}]  # fmt: skip
    (tmp_path / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(TaskDataError, match=r"no gold answer .* is a number \(row 1: 'Paris'\).*task 'math'"):
        load_task("gsm8k", path=tmp_path)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match=r"1 of 2 gold answers are no number \(row 1: 'Paris'\)"):
        assert len(load_task("gsm8k", path=tmp_path)) == 2
