"""Reward functions in TRL's convention, answer extraction helpers and a registry.

Every reward function has the signature ``f(completions, **kwargs) -> list[float | None]``:

* ``completions`` is a list of either plain strings or conversational completions
  (``[{"role": "assistant", "content": "..."}]``, as TRL passes them for chat prompts); both are accepted.
* TRL passes every dataset column (except ``prompt``) as a keyword argument holding one value per completion, so the
  accuracy rewards read the gold answer from ``answer=[...]``. Other keywords (``prompts``, ``completion_ids``,
  ``trainer_state``, ``log_metric``...) are accepted and ignored.

Functions are named (``__name__``) the way TRL logs them: ``rewards/<name>/mean``.

Registry: :data:`REWARD_FUNCS` maps short names (used in recipes and on the command line) to functions;
:func:`get_reward_funcs` looks names up with an error that lists the valid choices.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

__all__ = [
    "ANSWER_TAG_REWARD",
    "REWARD_FUNCS",
    "RewardFunc",
    "answer_tag_reward",
    "arithmetic_accuracy_reward",
    "completion_text",
    "extract_answer_tag",
    "extract_boxed",
    "extract_hash_answer",
    "extract_last_number",
    "format_reward",
    "get_reward_funcs",
    "gsm8k_accuracy_reward",
    "math_accuracy_reward",
    "numbers_equal",
    "parse_number",
]

RewardFunc = Callable[..., list[float | None]]
Completion = str | list[dict[str, Any]] | dict[str, Any]

# --------------------------------------------------------------------------------------------------------------------
# completions


def completion_text(completion: Completion) -> str:
    """The text of one completion: a string as is; for a conversational completion, the assistant contents joined.

    Content given as a list of parts (``[{"type": "text", "text": ...}]``) is flattened to its text parts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts: list[str] = []
    for message in completion:
        if isinstance(message, str):
            parts.append(message)
            continue
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content", "")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
        parts.append(content or "")
    return "".join(parts)


# --------------------------------------------------------------------------------------------------------------------
# extraction helpers


def extract_hash_answer(text: str) -> str | None:
    """GSM8K's gold answer: the text after the last ``####``, with thousands commas and ``$`` removed.

    >>> extract_hash_answer("She makes 9 * 2 = $18.\\n#### 1,018")
    '1018'

    Returns ``None`` when there is no ``####`` or nothing follows it.
    """
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()
    answer = answer.splitlines()[0].strip() if answer else answer
    return answer.rstrip(".").strip() or None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces nested to any depth.

    >>> extract_boxed(r"so \\boxed{\\frac{1}{\\sqrt{2}}}.")
    '\\\\frac{1}{\\\\sqrt{2}}'

    ``\\boxed 5`` (no braces) gives ``'5'``. Returns ``None`` when there is no box or its braces never close.
    """
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\b\s*", text)]
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            continue  # unbalanced: try an earlier box
        token = re.match(r"[^\s$}]+", text[i:])  # \boxed 5
        if token:
            return token.group(0)
    return None


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer_tag(text: str) -> str | None:
    """Content (stripped) of the last complete ``<answer>…</answer>`` in ``text``; ``None`` if there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


# A number: a fraction of integers (``1/2``, not a date's ``12/25/2023``), thousands-grouped or plain digits with
# optional decimals; the minus sign only when it is not a binary minus (``5-3`` yields 5 and 3, not 5 and -3).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?(?<![\d/])\d+/\d+(?![\d/]|\.\d)"
    r"|(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?:(?<![\w)\]}])-)?\.\d+"
)


_UNICODE_MINUS = "\u2212"  # "−": the typeset minus sign; read as "-" (else "−5" reads as 5)


def extract_last_number(text: str) -> str | None:
    """The last number written in ``text`` (``1,234.5`` style grouping understood), as written; ``None`` if none."""
    found = _NUMBER.findall(text.replace(_UNICODE_MINUS, "-"))
    return found[-1] if found else None


# A number that opens the answer, followed by units or nothing, not by an operator: "3 + 5 = 8" is an expression
# (its leading 3 is no answer).
_LEADING_NUMBER = re.compile(
    r"^(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+)(?![\d,/^])(?!\s*(?:[-+*/×÷=^]|[xX]\s*\d|\\(?:times|cdot|div)\b))"
)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")


def parse_number(text: str | None) -> Fraction | None:
    """Parse a short answer into an exact number, or ``None``.

    Understands ``1,234``, ``$18``, ``18.50``, ``-3``, ``50%`` (→ 50), ``3/4``, ``\\frac{3}{4}``, ``\\boxed{7}``, and a
    number followed by units or a full stop (``18 dollars.``). Anything else (words, expressions) → ``None``.
    """
    if text is None:
        return None
    s = text.strip().replace(_UNICODE_MINUS, "-")
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    # LaTeX spellings: ``1{,}000`` groups thousands (else read as 1), ``\$`` is a dollar sign (else its backslash
    # hides the number and the fallback drops the sign of ``-\$5``)
    s = s.replace("{,}", ",").replace("\\$", "$")
    s = s.replace("$", "").replace("\\%", "").replace("%", "").replace("\\!", "").replace("\\,", "").strip()
    s = s.rstrip(".").strip()
    m = _FRAC.match(s.replace(" ", ""))
    if m:
        num, den = int(m.group(2)), int(m.group(3))
        if den == 0:
            return None
        value = Fraction(num, den)
        return -value if m.group(1) else value
    m = re.fullmatch(r"(-?\d+)\s*/\s*(-?\d+)", s)
    if m:
        den = int(m.group(2))
        return Fraction(int(m.group(1)), den) if den else None
    m = _LEADING_NUMBER.match(s)
    if m:
        try:
            return Fraction(m.group(1).replace(",", ""))
        except (ValueError, ZeroDivisionError):
            return None
    return None


def numbers_equal(a: Fraction | float | None, b: Fraction | float | None, rel_tol: float = 1e-6) -> bool:
    """``a == b`` for parsed numbers (exact for fractions, relative tolerance ``rel_tol`` otherwise); ``None`` → False."""
    if a is None or b is None:
        return False
    if a == b:
        return True
    if isinstance(a, Fraction | int) and isinstance(b, Fraction | int):
        return False  # exact numbers: a relative tolerance would take 1000001 for 1000000
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-9)


def _gold_number(gold: Any) -> Fraction | None:
    if gold is None:
        return None
    if isinstance(gold, float):  # the decimal it prints as (0.1 → 1/10, not its binary value); NaN (missing) → None
        return Fraction(repr(gold)) if math.isfinite(gold) else None
    if isinstance(gold, int | Fraction):
        return Fraction(gold)
    text = str(gold)
    hashed = extract_hash_answer(text)  # a raw GSM8K solution as the gold column also works
    return parse_number(hashed if hashed is not None else text)


def _predicted_number(text: str, *, boxed: bool = True, hashes: bool = True) -> Fraction | None:
    """The model's numeric answer: <answer> tag, else ``\\boxed{}``, else ``####``, else the last number in the text.

    Inside a tag or box that is not a plain number, the last number written there is taken.
    """
    candidates: list[str | None] = [extract_answer_tag(text)]
    if boxed:
        candidates.append(extract_boxed(text))
    if hashes:
        hashed = extract_hash_answer(text)
        # GSM8K's "#### 18" starts with the number; "#### Step 2: ..." is a Markdown heading, not an answer
        candidates.append(hashed if parse_number(hashed) is not None else None)
    for cand in candidates:
        if cand is None:
            continue
        value = parse_number(cand)
        if value is None:
            value = parse_number(extract_last_number(cand))
        return value  # the first explicit answer found decides, right or wrong
    return parse_number(extract_last_number(text))


def _golds(kwargs: dict[str, Any], n: int, fname: str) -> list[Any]:
    golds = kwargs.get("answer")
    if golds is None:
        raise ValueError(f"{fname} needs the gold answers as the `answer` keyword (a dataset column named 'answer')")
    if isinstance(golds, str | int | float):
        golds = [golds] * n
    if len(golds) != n:
        raise ValueError(f"{fname}: {len(golds)} gold answers for {n} completions")
    return list(golds)


# --------------------------------------------------------------------------------------------------------------------
# accuracy rewards


def gsm8k_accuracy_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's numeric answer equals the gold answer, else 0.0 (GSM8K and other numeric tasks).

    The completion's answer is the content of its last ``<answer>…</answer>``, else its last ``\\boxed{}``, else the number
    after its last ``####`` (not a ``#### heading``), else the last number it writes. The gold (``answer`` column) may be a bare number or a full GSM8K
    solution ending in ``#### N``. Numbers compare exactly (``18`` = ``18.00`` = ``$18``). A gold answer that is not a
    number gives ``None`` (TRL then ignores this function for that sample).
    """
    return _numeric_accuracy(completions, kwargs, "gsm8k_accuracy_reward")


def arithmetic_accuracy_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """Lenient accuracy for the synthetic arithmetic task: the ``<answer>`` tag's number, else the last number written.

    Lenient on purpose: a small model that answers ``3 + 5 = 8`` without tags still earns the accuracy reward, so the
    reward signal exists from step 0 (the task's one-shot demo shows the tags).
    """
    return _numeric_accuracy(completions, kwargs, "arithmetic_accuracy_reward", boxed=False, hashes=False)


def _numeric_accuracy(
    completions: Sequence[Completion], kwargs: dict[str, Any], fname: str, *, boxed: bool = True, hashes: bool = True
) -> list[float | None]:
    """1.0 / 0.0 per completion by numeric comparison with the gold ``answer``; ``None`` where the gold is no number."""
    out: list[float | None] = []
    for completion, gold in zip(completions, _golds(kwargs, len(completions), fname)):
        gold_value = _gold_number(gold)
        if gold_value is None:
            out.append(None)
            continue
        pred = _predicted_number(completion_text(completion), boxed=boxed, hashes=hashes)
        out.append(1.0 if numbers_equal(pred, gold_value) else 0.0)
    return out


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _mv_parse(text: str) -> list:
    """``math_verify.parse`` that never raises (signal-based timeouts only work in the main thread)."""
    from math_verify import parse

    try:
        return parse(text, parsing_timeout=5 if _in_main_thread() else None)
    except Exception:  # noqa: BLE001 - any parser failure is "no answer"
        return []


def _parse_gold_math(gold: Any) -> list:
    text = str(gold).strip()
    if not text:
        return []
    if "\\boxed" in text or "$" in text or "\\(" in text or "\\[" in text:
        return _mv_parse(text)
    return _mv_parse(f"\\boxed{{{text}}}") or _mv_parse(f"${text}$") or _mv_parse(text)


def _parse_pred_math(text: str) -> list:
    tag = extract_answer_tag(text)
    if tag is not None:
        if not tag:
            return []
        if "\\boxed" in tag or "$" in tag:
            return _mv_parse(tag)
        return _mv_parse(f"\\boxed{{{tag}}}") or _mv_parse(f"${tag}$") or _mv_parse(tag)
    return _mv_parse(text)  # math-verify finds the last \boxed{} / latex / number itself


def math_accuracy_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """1.0 when ``math_verify.verify`` finds the completion's answer equivalent to the gold (``\\frac{1}{2}`` = ``0.5``).

    The gold (``answer`` column) is parsed as LaTeX (a bare answer is wrapped in ``\\boxed{}``). The completion's
    ``<answer>`` tag content is parsed when present; otherwise math-verify extracts the answer from the whole text
    (last ``\\boxed{}``, then LaTeX/expressions). Any parse or verify failure — including an unparseable gold — scores
    0.0; this function never raises on model output.
    """
    from math_verify import verify

    golds = _golds(kwargs, len(completions), "math_accuracy_reward")
    out: list[float | None] = []
    for completion, gold in zip(completions, golds):
        if gold is None:
            out.append(0.0)
            continue
        gold_parsed = _parse_gold_math(gold)
        pred_parsed = _parse_pred_math(completion_text(completion))
        if not gold_parsed or not pred_parsed:
            out.append(0.0)
            continue
        try:
            ok = verify(gold_parsed, pred_parsed, timeout_seconds=5 if _in_main_thread() else None)
        except Exception:  # noqa: BLE001
            ok = False
        out.append(1.0 if ok else 0.0)
    return out


# --------------------------------------------------------------------------------------------------------------------
# format rewards

_NO_TAG = r"(?:(?!</?think>|</?answer>).)*"  # text holding none of the four tags (linear time, no backtracking blowup)
_STRICT_FORMAT = re.compile(rf"\s*<think>{_NO_TAG}</think>\s*<answer>({_NO_TAG})</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """Reward for the format the system prompt asks for: ``<think> reasoning </think><answer> final answer </answer>``.

    * 1.0 — the whole completion is exactly one ``<think>…</think>`` followed by one non-empty ``<answer>…</answer>``
      (only whitespace around and between them);
    * partial credit otherwise — 0.125 for each of the four tags ``<think>``, ``</think>``, ``<answer>``,
      ``</answer>`` that appears exactly once (at most 0.5), so a model that drifts towards the format is rewarded
      before it gets it fully right;
    * 0.0 — none of the tags.
    """
    out: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        strict = _STRICT_FORMAT.fullmatch(text)
        if strict and strict.group(1).strip():
            out.append(1.0)
        else:
            out.append(0.125 * sum(text.count(tag) == 1 for tag in _TAGS))
    return out


ANSWER_TAG_REWARD = 0.2


def answer_tag_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """A small reward (0.2) for exactly one ``<answer>…</answer>`` holding a number, else 0.0.

    Meant to sit beside a lenient accuracy reward (the arithmetic task): the accuracy signal dominates while the tag
    habit, which a small model lacks untaught, is picked up through its own small bonus.
    """
    out: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        found = _ANSWER_TAG.findall(text)
        ok = len(found) == 1 and text.count("<answer>") == 1 and parse_number(found[0]) is not None
        out.append(ANSWER_TAG_REWARD if ok else 0.0)
    return out


# --------------------------------------------------------------------------------------------------------------------
# registry

REWARD_FUNCS: dict[str, RewardFunc] = {
    "gsm8k_accuracy": gsm8k_accuracy_reward,
    "math_accuracy": math_accuracy_reward,
    "arithmetic_accuracy": arithmetic_accuracy_reward,
    "format": format_reward,
    "answer_tag": answer_tag_reward,
}
"""Reward functions by the names recipes and the CLI use."""


def get_reward_funcs(names: str | Sequence[str]) -> list[RewardFunc]:
    """Look up reward functions by name (a name, a list, or a comma-separated string), in order.

    Raises ``ValueError`` naming the valid choices for an unknown name.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    funcs = []
    for name in names:
        if callable(name):
            funcs.append(name)
            continue
        if name not in REWARD_FUNCS:
            raise ValueError(f"unknown reward function {name!r}; valid choices: {', '.join(sorted(REWARD_FUNCS))}")
        funcs.append(REWARD_FUNCS[name])
    if not funcs:
        raise ValueError(f"no reward functions given; valid choices: {', '.join(sorted(REWARD_FUNCS))}")
    return funcs
