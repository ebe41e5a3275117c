"""``qerl eval``: pass@1 / pass@k of a base model, an NVFP4 model or a trained LoRA adapter on a task.

Generation is transformers ``generate`` (chat template, left padding, batched); sampling defaults follow the paper
(temperature 0.6, top-p 0.95, up to 4096 new tokens) and ``--greedy`` decodes greedily. Each completion is scored with
the task's accuracy reward (:data:`qerl_trl.tasks.TASK_EVAL_REWARD`; 1.0 = correct). pass@k uses the unbiased estimator
``1 - C(n-c, k) / C(n, k)`` over ``n`` samples with ``c`` correct, averaged over examples.

Results go to ``<output>/eval.json`` (settings, metrics, one record per example with its completions and rewards) and
``<output>/eval.md`` (a markdown table plus a few samples); an ``<output>`` that holds them from an earlier evaluation is
refused before the model loads unless ``--overwrite`` is given.

Examples::

    qerl eval --model offline-default --task arithmetic --limit 64 --max-new-tokens 32
    qerl eval --model Qwen/Qwen2.5-7B-Instruct --quantization nvfp4-mse --adapter runs/gsm8k/checkpoint-200 --task gsm8k \\
        --n-samples 8 --output runs/eval/qwen7b-gsm8k
    python -m qerl_trl eval --model runs/SmolLM2-135M-Instruct-nvfp4 --task gsm8k --data-path ../shared/data/gsm8k

An adapter is verified after loading: every tensor in its ``adapter_model.safetensors`` must be present, with the same
values, in the model that generates, and the LoRA layers must be active — so a run can never silently score the base
model while the report names the adapter.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from nvfp4 import cache_dequantized

from .policy import OFFLINE_DEFAULT, calibration_prompt_ids, load_policy, resolve_model_path
from .quantization import ALIASES, SCHEMES, QuantScheme, get_scheme
from .rewards import REWARD_FUNCS, get_reward_funcs
from .rollout import ENGINES, RolloutEngine, engine_class, evaluation_engines
from .tasks import TASK_EVAL_REWARD, TASKS, TaskDataError, load_task
from .validation import (
    UsageError,
    UsageErrorParser,
    check_chat_template,
    check_run_record,
    load_task_data,
    validate_eval_args,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["AdapterNotLoadedError", "calibration_data", "evaluate", "load_model", "main", "markdown_report", "pass_at_k",
           "verify_adapter"]


class AdapterNotLoadedError(RuntimeError):
    """The model about to be evaluated does not carry the adapter it is reported with."""


# --------------------------------------------------------------------------------------------------------------------
# metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` are correct (Chen et al., 2021): 1 - C(n-c,k)/C(n,k)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def _default_ks(n: int) -> list[int]:
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= n]
    return ks if n in ks else ks + [n]


# --------------------------------------------------------------------------------------------------------------------
# generation + scoring


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, list | tuple) else [value])
    return ids


def _render(tokenizer, prompt: Any) -> tuple[str, bool]:
    """Prompt text and whether it came from the chat template (then it already holds its special tokens)."""
    if isinstance(prompt, str):
        return prompt, False
    return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True), True


@torch.inference_mode()
def evaluate(
    model,
    tokenizer,
    dataset,
    *,
    reward_fn: Callable[..., list[float | None]] | str,
    n_samples: int = 1,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 4096,
    batch_size: int = 8,
    greedy: bool = False,
    progress: bool = True,
    seed: int | None = None,
    ks: Sequence[int] | None = None,
    engine: Any = None,
) -> dict[str, Any]:
    """Generate ``n_samples`` completions per example of ``dataset`` and score them with ``reward_fn``.

    Args:
        model: a causal LM (bf16/fp32, NVFP4, or a ``PeftModel`` with its adapter); ``None`` with ``engine``.
        tokenizer: its tokenizer; prompts that are message lists go through its chat template.
        dataset: rows with ``prompt`` (messages or text) and the columns ``reward_fn`` reads (e.g. ``answer``).
        reward_fn: a TRL-style reward function (or its :data:`~qerl_trl.rewards.REWARD_FUNCS` name); a sample counts as
            correct when it returns >= 1.0.
        n_samples: completions per example (pass@k is reported for k = 1, 2, 4, ... <= n_samples, and n_samples).
        temperature, top_p: sampling settings (ignored with ``greedy``).
        max_new_tokens: generation budget per completion; completions that hit it are counted as truncated.
        batch_size: prompts per ``generate`` call (each expands to ``n_samples`` sequences).
        greedy: greedy decoding (then ``n_samples`` is forced to 1).
        progress: show a progress bar.
        seed: ``torch.manual_seed`` before generating (reproducible sampling).
        ks: the k values of pass@k (default as above).
        engine: a :class:`qerl_vllm.engine.VLLMEngine` to generate with instead of ``model`` (its synced LoRA adapter,
            if any, is used); same sampling settings, same scoring.

    Returns:
        ``{"metrics": {"pass@1", "pass@k"..., "mean_reward", "mean_completion_tokens", "truncated_fraction",
        "n_examples", "n_samples", "wall_s", "generated_tokens_per_s"}, "settings": {...}, "records": [...]}`` with one
        record per example: ``index``, ``question``, ``answer``, ``completions``, ``rewards``, ``correct``,
        ``n_correct``, ``completion_tokens``, ``truncated``.
    """
    from tqdm.auto import tqdm

    if isinstance(reward_fn, str):
        (reward_fn,) = get_reward_funcs([reward_fn])
    if greedy and n_samples != 1:
        warnings.warn(f"greedy decoding gives identical samples: n_samples={n_samples} -> 1", stacklevel=2)
        n_samples = 1
    if n_samples < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError("n_samples, batch_size and max_new_tokens must be >= 1")
    ks = sorted(set(ks)) if ks else _default_ks(n_samples)
    if any(not 1 <= k <= n_samples for k in ks):
        raise ValueError(f"pass@k values {ks} must lie in 1..n_samples={n_samples}")
    if len(dataset) == 0:
        raise ValueError("empty dataset")
    if "prompt" not in dataset.column_names:
        raise ValueError(f"dataset needs a 'prompt' column (has {dataset.column_names})")
    if seed is not None:
        torch.manual_seed(seed)

    if engine is None:
        model.eval()
        device = next(model.parameters()).device
        eos = _eos_ids(model, tokenizer)
    else:
        eos = {tokenizer.eos_token_id}
        sampling = dict(max_tokens=max_new_tokens, seed=seed, repetition_penalty=1.0, top_k=0)
        sampling.update(temperature=0.0, n=1) if greedy else sampling.update(temperature=temperature, top_p=top_p,
                                                                            n=n_samples)
    old_pad = tokenizer.pad_token  # put back afterwards, as the padding side: the tokenizer is the caller's
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # only the settings named here apply: a checkpoint's generation_config may carry its own top-k or repetition
    # penalty (Qwen2.5-Instruct: top_k=20, repetition_penalty=1.05), which would make evaluations incomparable
    gen_kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                      repetition_penalty=1.0)
    if greedy:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=None,
                          num_return_sequences=n_samples)

    records: list[dict[str, Any]] = []
    generated_tokens = 0
    reward_name = getattr(reward_fn, "__name__", type(reward_fn).__name__)
    t0 = time.perf_counter()
    bar = tqdm(total=len(dataset), desc=f"eval ({reward_name})", disable=not progress, dynamic_ncols=True)
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    held = contextlib.ExitStack()
    try:
        if engine is None and device.type == "cpu":  # the CPU reference path would re-dequantize every weight per token
            held.enter_context(cache_dequantized(model, model.get_input_embeddings().weight.dtype))
        for start in range(0, len(dataset), batch_size):
            rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
            rendered = [_render(tokenizer, row["prompt"]) for row in rows]
            texts = [t for t, _ in rendered]
            add_special = not all(chat for _, chat in rendered)
            if engine is None:
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special).to(device)
                out = model.generate(**enc, **gen_kwargs)
                seqs = out[:, enc["input_ids"].shape[1] :].cpu().tolist()
            else:
                ids = [tokenizer(t, add_special_tokens=add_special)["input_ids"] for t in texts]
                seqs = [g.token_ids for g in engine.generate(ids, sampling)]
            lengths, truncated = [], []
            for seq in seqs:
                stop = next((i for i, t in enumerate(seq) if t in eos), None)
                lengths.append(stop + 1 if stop is not None else len(seq))
                truncated.append(stop is None and len(seq) >= max_new_tokens)
            completions = tokenizer.batch_decode([seq[:n] for seq, n in zip(seqs, lengths)], skip_special_tokens=True)
            generated_tokens += sum(lengths)

            expanded = [row for row in rows for _ in range(n_samples)]
            columns = {k: [r[k] for r in expanded] for k in rows[0] if k not in ("prompt", "completion")}
            rewards = reward_fn(completions=completions, prompts=[r["prompt"] for r in expanded], **columns)
            if len(rewards) != len(completions):
                raise ValueError(f"{reward_name} returned {len(rewards)} rewards for {len(completions)} completions")
            for j, row in enumerate(rows):
                sl = slice(j * n_samples, (j + 1) * n_samples)
                rs = [None if r is None else float(r) for r in rewards[sl]]
                correct = [r is not None and r >= 1.0 for r in rs]
                records.append({
                    "index": start + j,
                    "question": row.get("question", row["prompt"] if isinstance(row["prompt"], str) else
                                        row["prompt"][-1].get("content")),
                    "answer": row.get("answer"),
                    "completions": completions[sl],
                    "rewards": rs,
                    "correct": correct,
                    "n_correct": sum(correct),
                    "completion_tokens": lengths[sl],
                    "truncated": truncated[sl],
                })
            bar.update(len(rows))
            bar.set_postfix(pass1=f"{sum(r['n_correct'] for r in records) / (len(records) * n_samples):.3f}")
    finally:
        held.close()
        tokenizer.padding_side = old_side
        tokenizer.pad_token = old_pad
        bar.close()
    wall = time.perf_counter() - t0

    n = len(records)
    metrics: dict[str, Any] = {f"pass@{k}": sum(pass_at_k(n_samples, r["n_correct"], k) for r in records) / n for k in ks}
    all_rewards = [x for r in records for x in r["rewards"] if x is not None]
    all_lengths = [x for r in records for x in r["completion_tokens"]]
    metrics.update(
        mean_reward=sum(all_rewards) / len(all_rewards) if all_rewards else None,
        mean_completion_tokens=sum(all_lengths) / len(all_lengths),
        truncated_fraction=sum(x for r in records for x in r["truncated"]) / len(all_lengths),
        n_examples=n,
        n_samples=n_samples,
        wall_s=wall,
        generated_tokens_per_s=generated_tokens / wall if wall > 0 else None,
    )
    settings = dict(engine="vllm" if engine is not None else "transformers", reward=reward_name, n_samples=n_samples, greedy=greedy, temperature=None if greedy else temperature,
                    top_p=None if greedy else top_p, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                    ks=list(ks))
    return {"metrics": metrics, "settings": settings, "records": records}


# --------------------------------------------------------------------------------------------------------------------
# model loading


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _adapter_weights_file(path: Path) -> Path:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"{path}: no adapter_model.safetensors (is this a PEFT adapter folder?)")


def verify_adapter(model, adapter_path: str | Path, adapter_name: str = "default") -> dict[str, Any]:
    """Check that ``model`` generates with the adapter saved at ``adapter_path``; return facts for the report.

    Every tensor in the adapter file must map to a parameter of ``model`` holding the same values, the model must have
    LoRA layers with ``adapter_name`` active and not merged-away or disabled. Warns when all LoRA ``B`` matrices are
    zero (an untrained adapter: then the scores equal the base model's, legitimately).

    Raises:
        AdapterNotLoadedError: any of the above fails.
        ValueError: the adapter file holds NaN or inf.
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.utils import get_peft_model_state_dict

    path = Path(adapter_path)
    if not isinstance(model, PeftModel):
        raise AdapterNotLoadedError(f"the model is a {type(model).__name__}, not a PeftModel: adapter {path} is not applied")
    weights_file = _adapter_weights_file(path)
    if weights_file.suffix == ".safetensors":
        from safetensors.torch import load_file

        saved = load_file(str(weights_file))
    else:
        saved = torch.load(weights_file, map_location="cpu", weights_only=True)
    nonfinite = [k for k, v in saved.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nonfinite:  # NaN != NaN: without this, a diverged run's adapter reads as one that "differs from the model's"
        raise ValueError(f"adapter {path}: {len(nonfinite)} of {len(saved)} tensors hold NaN or inf, e.g. "
                         f"{nonfinite[:3]}; the run that saved it diverged (see its grad_norm log)")
    loaded = get_peft_model_state_dict(model, adapter_name=adapter_name)
    missing = [k for k in saved if k not in loaded]
    if missing:
        raise AdapterNotLoadedError(f"{len(missing)} adapter tensors of {path} are not in the model, e.g. {missing[:3]}")
    differ = [k for k, v in saved.items() if not torch.equal(loaded[k].detach().cpu().to(v.dtype), v)]
    if differ:
        raise AdapterNotLoadedError(f"{len(differ)} adapter tensors of {path} differ from the model's, e.g. {differ[:3]}")
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    active = [m for m in layers if adapter_name in m.active_adapters and not m.disable_adapters]
    if not active:
        raise AdapterNotLoadedError(f"adapter {adapter_name!r} from {path} is not active in any LoRA layer")
    b_zero = all(float(m.lora_B[adapter_name].weight.detach().abs().max()) == 0.0 for m in active if adapter_name in m.lora_B)
    if b_zero:
        warnings.warn(f"adapter {path}: every LoRA B matrix is zero, so it does not change the model", stacklevel=2)
    return {"path": str(path), "sha256": _sha256(weights_file), "tensors": len(saved), "lora_layers": len(active),
            "all_b_zero": b_zero}


def _is_prequantized(path: str) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return getattr(config, "quantization_config", None) is not None


def calibration_data(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    evaluated: Any,
    *,
    data_path: str | None = None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    n: int = 32,
) -> list[torch.Tensor]:
    """The token ids ``qerl train`` calibrates ``*-awq`` / ``*-gptq`` on for ``task`` (the first ``n`` prompts of its
    training split, :func:`~qerl_trl.policy.calibration_prompt_ids`; ``n`` = ``calibration_samples``, default 32),
    so that an adapter trained on a calibrated base is evaluated on that base: a list of ``[1, T]`` int64. A task
    without a training split here calibrates on the first ``n`` of ``evaluated`` (the rows being evaluated)."""
    try:
        rows = load_task(task, "train", path=data_path, limit=n, seed=seed, **(options or {}))
    except TaskDataError:  # no train split here: calibrate on the evaluated prompts (activations only)
        rows = evaluated
    return calibration_prompt_ids(rows, tokenizer, n)


def load_model(
    model_path: str,
    *,
    quantization: str | QuantScheme = "none",
    adapter: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | None = None,
    tokenizer_path: str | None = None,
    calibration_data: list[torch.Tensor] | None = None,
):
    """Load ``(model, tokenizer, info)`` for evaluation: bf16 or NVFP4 checkpoint, optional quantize-on-load, adapter.

    ``model_path`` ``offline-default`` is the offline default model. ``quantization`` is a
    :class:`~qerl_trl.quantization.QuantScheme` (``qerl eval`` passes the one its option parsed) or its name, parsed
    here, as ``qerl train``'s: ``none``, ``nvfp4-rtn`` / ``nvfp4-mse`` / ``mxfp4-rtn`` on load, ``nvfp4-awq`` /
    ``nvfp4-gptq`` calibrated on ``calibration_data`` (token ids ``[1, T]`` int64, as :func:`calibration_data` gives
    them: the prompts ``qerl train`` calibrated on), ``nf4`` through bitsandbytes; the bare ``rtn``, ``mse``, ``awq``, ``gptq`` are aliases of ``nvfp4-*``. The model is the
    trainer's policy (:func:`~qerl_trl.policy.load_policy`) on ``device``; ``info["quantize"]`` holds the canonical
    name. The adapter, if any, is loaded with :func:`nvfp4.peft.load_adapter` and checked with :func:`verify_adapter`.
    """
    from transformers import AutoTokenizer

    scheme = get_scheme(quantization)
    model_path = resolve_model_path(model_path)
    on_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    device = device or ("cuda" if on_cuda else "cpu")
    # bf16 matmuls are slow on CPUs: there models run in float32 (NVFP4 tensors are the same either way)
    dtype = dtype or (torch.bfloat16 if on_cuda else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
    prequantized = _is_prequantized(model_path)
    if not scheme.is_dense and prequantized:
        raise ValueError(f"{model_path} is already quantized; drop --quantization {scheme.name}")
    if scheme.calibrated and not calibration_data:  # calibrated on the dense model's activations first
        raise ValueError(f"quantization {scheme.name} calibrates: pass calibration_data, the token ids qerl train "
                         "calibrated on (qerl_trl.evaluation.calibration_data gives them)")
    # calibrated policies on CPU, as before: the dense model is calibrated where it loads, then moved
    device_map = None if scheme.calibrated else device
    model = load_policy(model_path, quantization=scheme, dtype=dtype, device_map=device_map,
                        calibration_data=calibration_data if scheme.calibrated else None)  # fmt: skip
    model.to(device)
    info: dict[str, Any] = {"model": model_path, "quantize": scheme.name, "prequantized": prequantized,
                            "dtype": str(dtype).removeprefix("torch."), "device": device, "adapter": None}
    if adapter is not None:
        from nvfp4.peft import load_adapter

        model = load_adapter(model, adapter)
        model.to(device)
        info["adapter"] = verify_adapter(model, adapter)
    model.eval()
    return model, tokenizer, info


# --------------------------------------------------------------------------------------------------------------------
# report


def markdown_report(result: dict[str, Any], n_show: int = 3) -> str:
    """A markdown table of ``result``'s settings and metrics, followed by up to ``n_show`` sample completions."""
    s, m = result["settings"], result["metrics"]
    adapter = s.get("adapter") or {}
    ks = [k for k in m if k.startswith("pass@")]
    decoding = "greedy" if s["greedy"] else f"T={s['temperature']}, top-p={s['top_p']}"
    head = ["model", "adapter", "quantize", "task", "examples", "samples", "decoding", "max new tokens", *ks,
            "mean reward", "mean tokens", "truncated"]
    task = f"{s.get('task', '?')}/{s.get('split', '?')}"
    row = [Path(str(s.get("model", "?"))).name, Path(adapter["path"]).name if adapter else "—",
           s.get("quantize", "?"), task, m["n_examples"], m["n_samples"], decoding, s["max_new_tokens"],
           *[f"{m[k]:.3f}" for k in ks], "—" if m["mean_reward"] is None else f"{m['mean_reward']:.3f}",
           f"{m['mean_completion_tokens']:.1f}", f"{m['truncated_fraction']:.2f}"]
    lines = [f"# qerl eval: {task}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             "| " + " | ".join(str(x) for x in row) + " |", ""]
    lines.append(f"reward `{s['reward']}`; {m['wall_s']:.1f} s, "
                 f"{(m['generated_tokens_per_s'] or 0):.1f} generated tokens/s"
                 + (f"; adapter sha256 `{adapter['sha256'][:16]}`" if adapter else ""))
    if n_show:
        lines += ["", "## Samples", ""]
        for rec in result["records"][:n_show]:
            question = str(rec["question"]).replace("\n", " ")
            lines.append(f"- **Q** {question[:300]} — gold `{rec['answer']}`")
            comp = rec["completions"][0].replace("\n", " ")
            lines.append(f"  - reward {rec['rewards'][0]}: `{comp[:300]}`")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------------------------
# CLI


def _task_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _scheme_arg(text: str) -> QuantScheme:
    """``--quantization``: the :class:`~qerl_trl.quantization.QuantScheme` it names (aliases accepted)."""
    try:
        return get_scheme(text, "--quantization")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _engine_arg(text: str) -> type[RolloutEngine]:
    """``--engine``: the :class:`~qerl_trl.rollout.RolloutEngine` it names, one of the registry's engines that
    evaluate (:func:`~qerl_trl.rollout.evaluation_engines`; ``graph`` generates for training only)."""
    names = evaluation_engines()
    if text not in names:
        others = [n for n in ENGINES if n not in names]
        why = f" ({', '.join(map(repr, others))} generate{'s' if len(others) == 1 else ''} for qerl train only)"
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(map(repr, names))}, got {text!r}"
                                         + (why if text in others else ""))  # fmt: skip
    return engine_class(text)


class _Parser(UsageErrorParser, argparse.ArgumentParser):
    pass


class _QuantizationOption(argparse.Action):
    """``--quantization``, the name ``qerl train`` uses; ``--quantize``, its name before, still works and says so."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--quantize":
            print("qerl eval: --quantize is deprecated, use --quantization (as qerl train)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    """The ``qerl eval`` argument parser (its errors raise :class:`~qerl_trl.validation.UsageError`)."""
    ap = _Parser(prog="qerl eval", description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--model", default=OFFLINE_DEFAULT,
                    help=f"HF id or folder (bf16, or an NVFP4 checkpoint); '{OFFLINE_DEFAULT}' (the default) = "
                         "SmolLM2-135M-Instruct")
    ap.add_argument("--tokenizer", help="tokenizer id/folder (default: the model's)")
    ap.add_argument("--quantization", "--quantize", dest="quantization", default="none", type=_scheme_arg,
                    action=_QuantizationOption, metavar="{" + ",".join(SCHEMES) + "}",
                    help="quantize a bf16 model on load: 4-bit format and method, as qerl train's --quantization "
                         f"(default: none; aliases {', '.join(f'{a}={c}' for a, c in ALIASES.items())}; "
                         "--quantize is its deprecated name)")
    ap.add_argument("--adapter", help="LoRA adapter folder (verified to be loaded into the evaluated model)")
    ap.add_argument("--task", default="gsm8k", choices=sorted(TASKS), help="(default: %(default)s)")
    ap.add_argument("--data-path", help="local data: folder with <split>.jsonl or a .jsonl file (no Hub access needed)")
    ap.add_argument("--split", default="test", help="(default: %(default)s)")
    ap.add_argument("--limit", type=int, help="evaluate the first N examples")
    ap.add_argument("--task-option", action="append", type=_task_option, default=[], metavar="KEY=VALUE",
                    help="task option, repeatable (arithmetic: n_examples, digits, ops, demo)")
    ap.add_argument("--reward", choices=sorted(REWARD_FUNCS), help="scoring reward (default: the task's accuracy)")
    ap.add_argument("--n-samples", type=int, default=1, help="samples per example, pass@k for k <= n (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default: %(default)s)")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default: %(default)s; no top-k)")
    ap.add_argument("--max-new-tokens", type=int, default=4096, help="(default: %(default)s)")
    ap.add_argument("--greedy", action="store_true", help="greedy decoding (forces --n-samples 1)")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                    help="compute dtype (default auto: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    ap.add_argument("--output", help="folder for eval.json and eval.md (default runs/eval/<model>-<task>-<split>)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the eval.json and eval.md that --output holds from an earlier evaluation (default: "
                         "refuse)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--engine", type=_engine_arg, default="transformers",
                    metavar="{" + ",".join(evaluation_engines()) + "}",
                    help="generation engine, a rollout engine of qerl_trl.rollout that evaluates (default: "
                         "transformers; vllm: needs the qerl-vllm plugin, the adapter is loaded as a LoRA adapter)")
    return ap


def _output_folder(args: argparse.Namespace, scheme: QuantScheme) -> Path:
    """``--output``, or the default ``runs/eval/<model>[-<adapter>][-<quantization>]-<task>-<split>``."""
    if args.output:
        return Path(args.output)
    name = Path(resolve_model_path(args.model).rstrip("/")).name
    name += f"-{Path(args.adapter.rstrip('/')).name}" if args.adapter else ""
    if not scheme.is_dense:
        name += f"-{scheme}"  # nvfp4-rtn, mxfp4-rtn, nf4, ...
    return Path("runs") / "eval" / f"{name}-{args.task}-{args.split}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run ``qerl eval`` with ``argv`` (default ``sys.argv[1:]``); returns the result dict it wrote.

    Raises :class:`~qerl_trl.validation.UsageError` for a bad path or value (checked before the model loads:
    :func:`~qerl_trl.validation.validate_eval_args`, then the task's data); ``qerl eval`` prints it as one line."""
    args = build_parser().parse_args(argv)
    # '~/m' (quoted, --output=~/out, or main() from Python): the checks expand it, so must every later use of a path
    for dest in ("model", "tokenizer", "adapter", "data_path", "output"):
        if getattr(args, dest) is not None:
            setattr(args, dest, os.path.expanduser(getattr(args, dest)))
    # a local model or adapter folder is recorded by its absolute path: '.' named nothing in eval.json / eval.md and
    # gave the default output folder runs/eval/-<task>-<split>
    for dest in ("model", "adapter"):
        value = getattr(args, dest)
        if value is not None and value != OFFLINE_DEFAULT and os.path.isdir(value):
            setattr(args, dest, os.path.abspath(value))
    scheme: QuantScheme = args.quantization
    engine_cls: type[RolloutEngine] = args.engine
    try:
        engine_cls.check_evaluation(scheme)
    except ValueError as e:
        raise UsageError(str(e)) from e
    validate_eval_args(args)
    out = _output_folder(args, scheme)
    if not args.overwrite and any((out / name).exists() for name in ("eval.json", "eval.md")):
        given = "--output" if args.output else "--output (the default)"
        raise UsageError(f"{given} {str(out)!r} holds the eval.json / eval.md of an earlier evaluation: pass "
                         "--overwrite to replace them, or give another --output")  # fmt: skip
    if not scheme.is_dense and _is_prequantized(resolve_model_path(args.model)):  # load_model's ValueError, earlier
        raise UsageError(f"--model {args.model!r} is already quantized (its config.json holds a quantization_config); "
                         f"drop --quantization {scheme.name}, which quantizes a dense model on load")  # fmt: skip
    if args.adapter is not None and (not scheme.is_dense or not _is_prequantized(resolve_model_path(args.model))):
        # the adapter's run record (qerl train's recipe.yaml): another base or quantization measured another policy.
        # An already quantized --model is not compared: its quantization is in its weights, and it may be a
        # quantized copy of the run's model (nvfp4-quantize) under another name
        check_run_record(args.adapter, args.model, scheme.name, given=f"--adapter {args.adapter!r}", command="eval")
    torch.manual_seed(args.seed)
    options = dict(args.task_option)
    dataset = load_task_data(args.task, args.split, args.data_path, args.limit, args.seed, options,
                             ("--data-path", "--task-option"))  # fmt: skip
    check_chat_template(*(("--tokenizer", args.tokenizer) if args.tokenizer else ("--model", args.model)), dataset)

    calib = None
    if scheme.calibrated:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model_path(args.model))
        calib = calibration_data(args.task, tok, dataset, data_path=args.data_path, seed=args.seed, options=options)

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer, info = load_model(args.model, quantization=scheme, adapter=args.adapter, dtype=dtype,
                                        device=args.device, tokenizer_path=args.tokenizer, calibration_data=calib)
    reward_name = args.reward or TASK_EVAL_REWARD[args.task]
    engine = engine_cls.evaluation_generator(args.model, model, scheme, seed=args.seed, dtype=info["dtype"],
                                             adapter=args.adapter)  # fmt: skip
    if engine is not None:
        info["engine_checkpoint"] = engine.model_path
    try:
        result = evaluate(None if engine else model, tokenizer, dataset, reward_fn=reward_name,
                          n_samples=args.n_samples, temperature=args.temperature, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, greedy=args.greedy,
                          progress=not args.no_progress, seed=args.seed, engine=engine)
    finally:
        if engine is not None:
            engine.close()
    result["settings"] = {**info, "task": args.task, "split": args.split, "data_path": args.data_path,
                          "limit": args.limit, "task_options": options, **result["settings"]}

    out.mkdir(parents=True, exist_ok=True)
    report = markdown_report(result)
    _write_atomic(out / "eval.json", json.dumps(result, indent=2, default=str))
    _write_atomic(out / "eval.md", report)
    print("\n" + report.split("\n## Samples")[0].rstrip() + f"\n\nwritten: {out / 'eval.json'}, {out / 'eval.md'}")
    return result
