"""Reward functions and answer extraction (qerl_trl.rewards) on real GSM8K lines and synthetic completions."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from qerl_trl.rewards import (
    REWARD_FUNCS,
    answer_tag_reward,
    arithmetic_accuracy_reward,
    completion_text,
    extract_answer_tag,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    format_reward,
    get_reward_funcs,
    gsm8k_accuracy_reward,
    math_accuracy_reward,
    numbers_equal,
    parse_number,
)


@pytest.fixture(scope="module")
def gsm8k_rows(gsm8k_dir):
    with open(gsm8k_dir / "test.jsonl") as f:
        return [json.loads(line) for line in f]


def _conv(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------------------------------------------- extraction


def test_extract_hash_answer_on_real_gsm8k(gsm8k_rows):
    golds = [extract_hash_answer(r["answer"]) for r in gsm8k_rows]
    assert golds[:3] == ["18", "3", "70000"]
    assert all(g is not None and "," not in g and "$" not in g for g in golds)
    assert all(parse_number(g) is not None for g in golds)  # every gold is a number
    assert any(g.startswith("-") for g in golds)  # the test set holds a negative answer (-10)
    assert extract_hash_answer("so $1,450,000.\n#### $1,450,000") == "1450000"
    assert extract_hash_answer("no answer marker") is None
    assert extract_hash_answer("trailing ####   ") is None


def test_extract_boxed_nesting_and_edge_cases():
    assert extract_boxed(r"first \boxed{1}, then \boxed{\frac{1}{\sqrt{2}}}.") == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed(r"$\boxed{\left\{1,2\right\}}$") == r"\left\{1,2\right\}"
    assert extract_boxed(r"\boxed{{a}{b{c}}}") == "{a}{b{c}}"
    assert extract_boxed(r"\boxed 5 apples") == "5"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"ok \boxed{3} then broken \boxed{4") == "3"  # unbalanced last box: the earlier one
    assert extract_boxed("no box") is None
    assert extract_boxed(r"\boxed{") is None


def test_extract_answer_tag_and_last_number():
    assert extract_answer_tag("<answer> 42 </answer>") == "42"
    assert extract_answer_tag("<answer>1</answer> and <answer>\n2\n</answer>") == "2"
    assert extract_answer_tag("<answer>open") is None
    assert extract_last_number("5-3=2, then 1,234.5 then -7.") == "-7"
    assert extract_last_number("x-3") == "3"  # a binary minus is not a sign
    assert extract_last_number("no digits") is None


@pytest.mark.parametrize(
    "text, value",
    [("18", 18), ("$18.00", 18), ("1,018", 1018), ("-10", -10), ("50%", 50), ("3/4", Fraction(3, 4)),
     (r"\frac{3}{4}", Fraction(3, 4)), (r"\boxed{7}", 7), ("18 dollars.", 18), ("0.25", Fraction(1, 4)),
     ("x + 1", None), ("2^3", None), ("", None), (None, None)],
)
def test_parse_number(text, value):
    assert parse_number(text) == (None if value is None else Fraction(value))


@pytest.mark.parametrize(
    "text, value",
    [(r"\boxed{1{,}000}", 1000), ("18{,}500", 18500), (r"\boxed{-\$5}", -5), (r"-\$5", -5), (r"\$1{,}200.50", 1200.5),
     (r"\boxed{\$18}", 18)],
)
def test_parse_number_latex_spellings(text, value):
    # LaTeX thousands separator {,} and escaped dollar \$: not 1 for 1{,}000, not +5 for -\$5
    assert parse_number(text) == Fraction(str(value))


def test_completion_text_accepts_both_shapes():
    assert completion_text("plain") == "plain"
    assert completion_text(_conv("chat")) == "chat"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "parts"}]}]) == "parts"


# ---------------------------------------------------------------------------------------------------- GSM8K


def test_gsm8k_reward_right_wrong_malformed_on_real_lines(gsm8k_rows):
    rows = gsm8k_rows[:20]
    golds = [r["answer"] for r in rows]  # raw GSM8K solutions work as gold too
    numbers = [extract_hash_answer(g) for g in golds]
    right = [f"<think>{r['answer'].split('####')[0]}</think><answer>{n}</answer>" for r, n in zip(rows, numbers)]
    wrong = [f"<think>guess</think><answer>{int(n) + 1}</answer>" for n in numbers]
    malformed = ["<answer></answer>", "", "I don't know", "<answer>seventy</answer>", "<think>unfinished"] * 4
    assert gsm8k_accuracy_reward(right, answer=golds) == [1.0] * 20
    assert gsm8k_accuracy_reward(wrong, answer=numbers) == [0.0] * 20
    assert gsm8k_accuracy_reward(malformed, answer=numbers) == [0.0] * 20
    assert gsm8k_accuracy_reward([_conv(c) for c in right], answer=numbers) == [1.0] * 20


def test_gsm8k_reward_answer_sources_in_priority_order():
    gold = ["70000"] * 7
    completions = [
        "<answer>$70,000</answer>",
        r"So the profit is \boxed{70,000}.",
        "Profit: 70000 dollars\n#### 70,000",
        "200,000 - 130,000 = 70,000",  # no explicit answer: the last number
        "<answer>70000</answer> (not 5)",  # the tag beats a later number
        r"<answer>5</answer> \boxed{70000}",  # the tag decides even when wrong
        "70000 is wrong, it is 69999",
    ]
    assert gsm8k_accuracy_reward(completions, answer=gold) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_gsm8k_reward_markdown_headings_are_not_the_hash_answer():
    # "#### Step 2: ..." is a level-4 Markdown heading (common in instruct models' reasoning), not GSM8K's "#### N"
    text = "#### Step 1: apples\n3 * 2 = 6 dollars.\n#### Step 2: add the pears\n6 + 12 = 18 dollars.\n\nThe answer is 18."
    assert gsm8k_accuracy_reward([text, text + "\n#### 18", "#### 18 dollars"], answer=["18"] * 3) == [1.0] * 3


def test_gsm8k_reward_edge_cases():
    assert gsm8k_accuracy_reward(["<answer>-10</answer>", "<answer>18.0</answer>"], answer=["-10", "18"]) == [1.0, 1.0]
    assert gsm8k_accuracy_reward(["<answer>1</answer>"], answer=["not a number"]) == [None]
    with pytest.raises(ValueError, match="answer"):
        gsm8k_accuracy_reward(["1"])
    with pytest.raises(ValueError, match="2 gold answers for 1"):
        gsm8k_accuracy_reward(["1"], answer=["1", "2"])


def test_large_answers_compare_exactly():
    # parsed answers are exact Fractions: 1000001 is not 1000000, nor 9999 * 9999 off by 50 the product
    assert gsm8k_accuracy_reward(["<answer>1000001</answer>"], answer=["1000000"]) == [0.0]
    assert arithmetic_accuracy_reward(["<answer>99980051</answer>"], answer=[str(9999 * 9999)]) == [0.0]
    assert arithmetic_accuracy_reward(["<answer>99980001</answer>"], answer=[str(9999 * 9999)]) == [1.0]
    assert numbers_equal(0.1 + 0.2, Fraction(3, 10))  # a float still compares with the tolerance


def test_float_gold_answers_mean_their_decimal_and_nan_is_no_gold():
    # a numeric `answer` column: 0.1 is the decimal 1/10 (not the binary double), a missing value (NaN) is no gold
    comps = ["<answer>0.1</answer>", "<answer>2.5</answer>", "<answer>3</answer>", "<answer>1</answer>"]
    assert gsm8k_accuracy_reward(comps, answer=[0.1, 2.5, 3.0, float("nan")]) == [1.0, 1.0, 1.0, None]


def test_an_expression_in_the_answer_tag_is_scored_by_its_result():
    # "<answer>3 + 5 = 8</answer>" answers 8: the leading operand of an expression is no answer
    assert parse_number("3 + 5 = 8") is None
    assert parse_number(r"3 \times 4 = 12") is None
    assert parse_number("3 x 4 = 12") is None and parse_number("5 x-rays") == 5
    comps = ["<answer>3 + 5 = 8</answer>", "<answer>$10 + $8 = $18</answer>", "<answer>24 / 3 = 8</answer>",
             "<answer>10 - 2 = 8</answer>", "<answer>8 dollars</answer>"]
    assert gsm8k_accuracy_reward(comps, answer=["8", "18", "8", "8", "8"]) == [1.0] * 5
    assert arithmetic_accuracy_reward(["<answer>3 + 5 = 8</answer>"], answer=["3"]) == [0.0]


def test_a_fraction_written_last_is_read_whole():
    # without an explicit answer the last number decides: "1/2" is one half, not 2 (a gold of 2 scored it right)
    assert extract_last_number("so she eats 1/2 of it.") == "1/2"
    assert extract_last_number("on 12/25/2023 she paid 40") == "40"
    comps = ["So the answer is 3/4.", "The probability is 1/2.", "Each gets -5/2 points", "60/3 = 20 apples"]
    assert gsm8k_accuracy_reward(comps, answer=["0.75", "2", "-2.5", "20"]) == [1.0, 0.0, 1.0, 1.0]


def test_unicode_minus_sign_is_a_minus():
    # U+2212 (what LaTeX-trained models and typeset gold answers write) is a sign: "−5" is -5, never +5
    assert parse_number("\u22125") == -5
    assert extract_last_number("so x = \u22127") == "-7"
    comps = ["<answer>\u22125</answer>", "<answer>\u22125</answer>", "the change is \u221212 degrees"]
    assert gsm8k_accuracy_reward(comps, answer=["-5", "5", "-12"]) == [1.0, 0.0, 1.0]


def test_arithmetic_reward_is_lenient():
    comps = ["<answer>8</answer>", "3 + 5 = 8", "8", "<answer>9</answer> 8", "eight", _conv("<answer> 8 </answer>")]
    assert arithmetic_accuracy_reward(comps, answer=["8"] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------------------------------- MATH


def test_math_reward_equivalents():
    comps = [
        "<think>half</think><answer>0.5</answer>",
        r"Thus the answer is $\boxed{\dfrac{1}{2}}$.",
        r"<answer>\frac{2}{4}</answer>",
        r"<answer>\frac{1}{3}</answer>",
        _conv(r"so \boxed{1/2}"),
    ]
    assert math_accuracy_reward(comps, answer=[r"\frac{1}{2}"] * 5) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert math_accuracy_reward([r"\boxed{3\sqrt{2}}", r"\boxed{\sqrt{18}}", r"\boxed{x^2+1}"],
                                answer=[r"3\sqrt{2}", r"3\sqrt{2}", "1+x^2"]) == [1.0, 1.0, 1.0]
    assert math_accuracy_reward([r"\boxed{72}"], answer=[r"The total is $\boxed{72}$."]) == [1.0]


def test_math_reward_never_crashes():
    junk = ["", "<answer></answer>", r"\boxed{", r"\frac{1}{0}", "}}}{{{", "<answer>\\left(</answer>", "a" * 2000]
    out = math_accuracy_reward(junk, answer=[r"\frac{1}{2}"] * len(junk))
    assert out == [0.0] * len(junk)
    assert math_accuracy_reward([r"\boxed{1}", r"\boxed{1}"], answer=[None, r"\left("]) == [0.0, 0.0]


def test_math_reward_in_a_worker_thread():
    """math-verify's signal timeouts only work in the main thread; the reward must still score elsewhere."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        out = pool.submit(math_accuracy_reward, [r"\boxed{0.5}"], answer=[r"\frac{1}{2}"]).result()
    assert out == [1.0]


# ---------------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "text, reward",
    [
        ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
        ("  <think>\nreason\n</think>\n<answer> 4 </answer>\n", 1.0),
        ("<think>r</think><answer>4</answer> trailing text", 0.5),
        ("<think>r</think><answer></answer>", 0.5),  # empty answer is not the format
        ("<answer>4</answer><think>r</think>", 0.5),  # wrong order
        ("<think>r</think><think>s</think><answer>4</answer>", 0.25),  # think twice: those tags earn nothing
        ("<think>only reasoning</think>", 0.25),
        ("<answer>4</answer>", 0.25),
        ("4", 0.0),
    ],
)
def test_format_reward(text, reward):
    assert format_reward([text]) == [reward]
    assert format_reward([_conv(text)]) == [reward]


def test_format_reward_is_fast_on_long_completions():
    import time

    long = ["<think>" + "step " * 5000 + "</think><answer>" + "x " * 5000 + "</answer> tail", "<answer>" + " " * 20000]
    t0 = time.perf_counter()
    assert format_reward(long) == [0.5, 0.125]
    assert time.perf_counter() - t0 < 1.0


def test_answer_tag_reward():
    comps = ["<answer>8</answer>", "x <answer> 8 </answer> y", "<answer>8</answer><answer>8</answer>",
             "<answer>eight</answer>", "8"]
    assert answer_tag_reward(comps) == [0.2, 0.2, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------- registry


def test_registry_and_names():
    assert get_reward_funcs(["gsm8k_accuracy", "format"]) == [gsm8k_accuracy_reward, format_reward]
    assert get_reward_funcs("math_accuracy, format") == [math_accuracy_reward, format_reward]
    with pytest.raises(ValueError, match="valid choices: .*gsm8k_accuracy"):
        get_reward_funcs(["gsm8k"])
    with pytest.raises(ValueError, match="no reward functions"):
        get_reward_funcs([])
    for name, fn in REWARD_FUNCS.items():
        assert fn.__name__.startswith(name) and fn.__name__.endswith("_reward")  # TRL logs rewards/<__name__>
        assert fn.__doc__
        assert fn(["<answer>1</answer>"], answer=["1"], trainer_state=None, prompts=["p"]) is not None


def test_tasks_default_rewards_exist():
    from qerl_trl.tasks import TASK_DEFAULT_REWARDS, TASK_EVAL_REWARD, TASKS

    assert set(TASK_DEFAULT_REWARDS) == set(TASKS) == set(TASK_EVAL_REWARD)
    for names in TASK_DEFAULT_REWARDS.values():
        get_reward_funcs(names)
