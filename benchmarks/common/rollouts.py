"""What ``rollout.py`` (graph / transformers engines) and ``rollout_vllm.py`` (vLLM arms) share: their length and
batch options, the (model, arm) grid they take from them, and the rows they measure (prefill, fixed-length timings,
the spread-length rounds' summary), so the two engines' numbers are defined once."""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Callable
from typing import Any

from .env import csv_list
from .shapes import MODELS
from .workers import check_names

PREFILL_SAMPLES = 3  # 1-token generates per batch; the fastest is prefill_s (one sample varied 2-3x between runs)


def add_rollout_arguments(ap: Any, models: str, batch: str, new_tokens: int, repeats: int, spread_warmups: int) -> None:
    """The options both scripts take: models, batch sizes, lengths (fixed, or spread with ``--eos-mean-tokens``),
    warm-ups and repeats, the tiny CPU model and ``--profile``; the defaults that differ are arguments."""
    ap.add_argument("--models", default=models, help="comma list of " + ",".join(MODELS))
    ap.add_argument("--batch", default=batch, type=lambda s: [int(x) for x in csv_list(s)])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=new_tokens)
    ap.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of each warm-up generate (compile)")
    ap.add_argument("--eos-mean-tokens", type=float, default=0.0,
                    help="completions of varying length (a mean of this many tokens past --min-new-tokens; "
                    "sampled); 0: fixed lengths, greedy")  # fmt: skip
    ap.add_argument("--min-new-tokens", type=int, default=0, help="with --eos-mean-tokens: EOS suppressed before this")
    ap.add_argument("--spread-warmups", type=int, default=spread_warmups,
                    help="with --eos-mean-tokens: warm-up rollouts per batch (the first compiles and records)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=repeats, help="timed generates per batch (min is reported)")
    ap.add_argument("--tiny", action="store_true", help="tiny config only (CPU validation)")
    ap.add_argument("--profile", action="store_true", help="ms per decode step by kernel category (module doc)")


def models_and_arms(ap: Any, args: Any, arms: Any) -> tuple[list[str], list[str]]:
    """``--models`` (``tiny`` with ``--tiny``) and ``--arms``, each checked (``ap.error`` for an unknown name), after
    the lengths are (``ap.error`` for a negative mean or a minimum outside ``[0, --new-tokens)``)."""
    if args.eos_mean_tokens < 0 or not 0 <= args.min_new_tokens < args.new_tokens:
        ap.error("--eos-mean-tokens must be >= 0 and --min-new-tokens in [0, --new-tokens)")
    models, arm_names = ["tiny"] if args.tiny else csv_list(args.models), csv_list(args.arms)
    check_names(ap, models, MODELS, "model")
    check_names(ap, arm_names, arms, "arm")
    return models, arm_names


def prefill_row(one_token_s: Callable[[], float]) -> dict:
    """``prefill_s``: the fastest of :data:`PREFILL_SAMPLES` 1-token generates (``one_token_s()``: seconds), and each."""
    times = [one_token_s() for _ in range(PREFILL_SAMPLES)]
    return {"prefill_s": round(min(times), 4), "prefill_s_all": [round(t, 4) for t in times]}


def fixed_length_row(times: list[float], batch: int, new_tokens: int, prefill_s: float, tokens=None) -> dict:
    """A fixed-length batch's timings from the timed generates' seconds: the fastest (``gen_s``), tokens/s end to end
    (prefill included), tokens/s and ms per step of the decode (the prefill's 1-token generate taken off). ``tokens``
    (the greedy completions' ids): ``tokens_crc32``, equal between two runs that computed the same tokens."""
    gen_s = min(times)
    decode_s = gen_s - prefill_s
    return {"gen_s": round(gen_s, 4), "gen_s_all": [round(t, 4) for t in times],
            "tok_s": round(batch * new_tokens / gen_s, 2),
            "decode_tok_s": round(batch * (new_tokens - 1) / decode_s, 2) if decode_s > 0 else None,
            "ms_per_step": round(1000 * decode_s / max(new_tokens - 1, 1), 3),
            **({"tokens_crc32": zlib.crc32(repr(tokens).encode())} if tokens is not None else {})}  # fmt: skip


def spread_summary(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant, its ``--eos-mean-tokens`` rounds (each ``{"s", "tokens", "lengths"}``, and ``"steps"`` / ``"ok"``
    where the engine reports them): the median tokens/s of real tokens, every round's seconds and tokens, the mean and
    longest completion."""
    out = {}
    for variant, rs in rounds.items():
        tok_s = [x["tokens"] / x["s"] for x in rs]
        lengths = [n for x in rs for n in x["lengths"]]
        out[variant] = {"tok_s": round(statistics.median(tok_s), 2), "tok_s_all": [round(t, 2) for t in tok_s],
                        "gen_s_all": [round(x["s"], 4) for x in rs], "tokens_all": [x["tokens"] for x in rs],
                        "mean_len": round(sum(lengths) / len(lengths), 1), "max_len": max(lengths)}  # fmt: skip
        if "steps" in rs[0]:
            out[variant] |= {"steps_all": [x["steps"] for x in rs], "well_formed": all(x["ok"] for x in rs)}
    return out
