"""Learning studies on the GPU (issues #21, #22, #51): bf16 + LoRA against NVFP4 + LoRA (± AQN) and other formats.

Each arm (:data:`GPU_ARMS`) × seed × task (arithmetic as a curriculum; GSM8K from ``../shared/data/gsm8k``) is a
``qerl train`` run saving its adapter at every ``--eval-at`` step, then ``qerl eval`` (greedy pass@1, sampled pass@4)
of every adapter and of the base models on held-out problems; every arm of a seed sees the same prompts in the same
order. Runs execute ``--parallel`` at a time on one GPU (``--mps``: under CUDA MPS), evals ``--eval-parallel`` at a
time. ``--gpu`` (issue #21): the bf16 / NVFP4 / AQN arms → ``results/learning_study_gpu.json``; ``--formats``
(issue #22: NVFP4, MXFP4, NF4) and ``--fp8`` (issue #51: vLLM rollouts in W4A16 and FP8, needs vLLM) are
:data:`PRESETS` → ``results/learning_study_<preset>.json``; figures in ``docs/`` (``--plot-only``: from the run
folders). The CPU study of issue #8 is ``benchmarks/learning_study.py@4f53c7b``; ``--gpu`` stays for recorded commands.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], log: Path) -> tuple[int, float]:
    start = time.perf_counter()
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        print(" ".join(cmd), file=f, flush=True)
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    return rc, time.perf_counter() - start


def _read_metrics(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.is_file() else []
    rows = {int(r["step"]): r for r in map(json.loads, filter(str.strip, lines)) if "reward" in r and "step" in r}
    return [rows[k] for k in sorted(rows)]


# ------------------------------------------------------------------------------------------------ GPU study (#21)
GPU_ARMS = {
    "bf16+LoRA": {"tag": "bf16", "quantization": "none", "aqn": "false"},
    "NVFP4+LoRA": {"tag": "nvfp4", "quantization": "rtn", "aqn": "false"},
    "NVFP4+LoRA+AQN": {"tag": "nvfp4-aqn", "quantization": "rtn", "aqn": "true", "aqn_schedule": "exponential"},
    # the ablation: the schedule's first σ held for the whole run (no decay)
    "NVFP4+LoRA+AQN const σ": {"tag": "nvfp4-aqn-const", "quantization": "rtn", "aqn": "true",
                               "aqn_schedule": "constant"},
    # the formats comparison (issue #22): the same recipe on another 4-bit base
    "MXFP4+LoRA+AQN": {"tag": "mxfp4-aqn", "quantization": "mxfp4-rtn", "aqn": "true", "aqn_schedule": "exponential"},
    "NF4 (QLoRA)": {"tag": "nf4", "quantization": "nf4", "aqn": "false"},
    "NF4+LoRA+AQN": {"tag": "nf4-aqn", "quantization": "nf4", "aqn": "true", "aqn_schedule": "exponential"},
}  # fmt: skip
# the FP8-rollout parity study (issue #51): the NVFP4 + AQN arm with rollouts on vLLM, whose sampling logprobs feed
# TRL's correction (on by default with FP8; off under AQN at W4A16); a small engine each, so that the runs share the card.
# A fixed KV cache (1 GiB: 46,603 positions at SmolLM2-135M's 22.5 KiB) skips vLLM's memory profiling, which charges
# to an engine whatever the runs starting beside it allocate meanwhile, and aborts when one of them frees memory
# (vLLM issues 55827, 56830); gpu_memory_utilization is then only the start check's free-memory floor
_VLLM = GPU_ARMS["NVFP4+LoRA+AQN"] | {
    "rollout_engine": "vllm", "vllm": '{"gpu_memory_utilization": 0.06, "kv_cache_memory_bytes": 1073741824}'}
GPU_ARMS["NVFP4+LoRA+AQN vLLM"] = _VLLM | {"tag": "nvfp4-aqn-vllm"}
GPU_ARMS["NVFP4+LoRA+AQN vLLM FP8"] = _VLLM | {"tag": "nvfp4-aqn-vllm-fp8", "rollout_precision": "fp8"}
# (the NVFP4 arms keep the alias "rtn" = "nvfp4-rtn": their base-model evals live in base-rtn/ folders)
#: the studies beside the GPU study (--formats, --fp8): their issue and arms, everything else as the GPU study
PRESETS = {"formats": (22, ["NVFP4+LoRA+AQN", "MXFP4+LoRA+AQN", "NF4 (QLoRA)"]),
           "fp8": (51, ["NVFP4+LoRA+AQN vLLM", "NVFP4+LoRA+AQN vLLM FP8"])}  # fmt: skip
GPU_COLORS = {"bf16+LoRA": "tab:gray", "NVFP4+LoRA": "tab:blue", "NVFP4+LoRA+AQN": "tab:red",
              "NVFP4+LoRA+AQN const σ": "tab:orange", "MXFP4+LoRA+AQN": "tab:green", "NF4 (QLoRA)": "tab:purple",
              "NF4+LoRA+AQN": "tab:brown", "NVFP4+LoRA+AQN vLLM": "tab:pink",
              "NVFP4+LoRA+AQN vLLM FP8": "tab:cyan"}  # fmt: skip
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"
# per task: trainer overrides, eval task options / limit / completion budget
GPU_TASKS = {
    "arithmetic": {
        # logprob_batch_size 2: the offline default recipe's value when these runs were recorded (re-run identically)
        "train": {"task_options": None, "max_completion_length": 12, "shuffle_dataset": "false",
                  "logprob_batch_size": 2},  # fmt: skip
        "eval": ["--task", "arithmetic", "--task-option", "digits=2", "--limit", "200", "--max-new-tokens", "12"],
    },
    "gsm8k": {
        # logprob_batch_size 16: one scoring forward (the recipe's 2 made 8x the eager ops, ~3.9 s of a 5.1 s step)
        "train": {"task": "gsm8k", "task_options": "{}", "max_completion_length": 256, "logprob_batch_size": 16},
        # one batch of all 200 problems: eager decoding of this model is launch-bound
        "eval": ["--task", "gsm8k", "--limit", "200", "--max-new-tokens", "256", "--batch-size", "200"],
    },
}
# one micro-batch per step with gradient checkpointing: the offline default recipe when these runs were recorded
GPU_TRAIN = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "gradient_checkpointing": "true",
             "num_generations": 4, "learning_rate": 2e-4, "aqn_sigma_start": 1e-2, "aqn_sigma_end": 5e-4,
             "aqn_num_stages": 10, "rollout_engine": "graph", "save_strategy": "steps", "save_total_limit": 100,
             "disable_tqdm": "true"}  # fmt: skip


def _gsm8k_path() -> Path:
    path = Path(os.environ.get("QERL_GSM8K", GSM8K_DIR))
    if not (path / "train.jsonl").is_file() or not (path / "test.jsonl").is_file():
        raise SystemExit(f"GSM8K not found at {path} (train.jsonl / test.jsonl); set QERL_GSM8K")
    return path


def gpu_train_cmd(task: str, arm: str, seed: int, steps: int, eval_at: list[int], out: Path, tiny: bool) -> list[str]:
    """The ``qerl train`` command line of one GPU run of the study (arm, seed, steps; checkpoints at ``eval_at``);
    ``tiny``: CPU-smoke sizes."""
    spec = GPU_ARMS[arm]
    cfg = dict(GPU_TRAIN) | dict(GPU_TASKS[task]["train"])
    prompts_per_step = cfg["per_device_train_batch_size"] // cfg["num_generations"]
    if task == "arithmetic":  # one pass over an ordered curriculum: the first half of the steps 1-digit, then 2-digit
        cfg["task_options"] = json.dumps({"n_examples": steps * prompts_per_step, "digits": [1, 2], "ops": "+"})
    else:
        cfg["data_path"] = str(_gsm8k_path())
    saves = sorted(s for s in eval_at if s > 0)
    cfg["save_steps"] = math.gcd(*saves) if saves else steps
    cfg |= {k: v for k, v in spec.items() if k not in ("tag",)}
    if tiny:  # CPU smoke: eager transformers rollouts, short everything
        cfg |= {"per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4,
                "rollout_engine": "transformers", "rollout_precision": None, "vllm": None}
        if task == "arithmetic":
            cfg["task_options"] = json.dumps({"n_examples": 2 * steps, "digits": [1, 2], "ops": "+"})
    cmd = [sys.executable, "-m", "qerl_trl.cli", "train", "offline-default", "--output_dir", str(out), "--seed",
           str(seed), "--max_steps", str(steps)]  # fmt: skip
    for k, v in cfg.items():
        if v is not None:
            cmd += [f"--{k}", str(v)]
    return cmd


def _gpu_eval_argvs(task: str, quantize: str, out: Path, adapter: Path | None, tiny: bool) -> list[list[str]]:
    """``qerl eval`` argument lists: greedy pass@1 and sampled pass@4 of one model (+ adapter) on held-out problems."""
    base = ["--model", "offline-default", "--quantization", quantize, "--split", "test", "--no-progress",
            "--batch-size", "64", *GPU_TASKS[task]["eval"]]  # fmt: skip
    if task == "gsm8k":
        base += ["--data-path", str(_gsm8k_path())]
    if tiny:
        base += ["--limit", "2", "--max-new-tokens", "4", "--batch-size", "4"]
    if adapter is not None:
        base += ["--adapter", str(adapter)]
    return [base + ["--greedy", "--output", str(out / "greedy")],
            base + ["--n-samples", "4", "--temperature", "1.0", "--top-p", "1.0", "--output", str(out / "sampled")]]


def _eval_many(argvs_json: str) -> None:
    """In-process: run several ``qerl eval`` argument lists (one interpreter start for a greedy + sampled pair)."""
    import qerl_trl.evaluation as ev

    for argv in json.loads(argvs_json):
        if not (Path(argv[argv.index("--output") + 1]) / "eval.json").is_file():
            ev.main(argv)


#: eval jobs that failed (argument lists, log): ``launch_gpu`` runs each once more, alone, after the others
_FAILED_EVALS: list[tuple[list[list[str]], Path]] = []
#: evals running at once (``--eval-parallel``): a sampled GSM8K eval holds ~10 GB of KV cache
EVAL_PARALLEL = 6
_EVAL_SLOTS = threading.BoundedSemaphore(EVAL_PARALLEL)


def _say_failure(what: str, log: Path, lines: int = 25) -> None:
    """Print the end of a failed job's log into the study's own output (the logs may not outlive the machine)."""
    tail = log.read_text(errors="replace").splitlines()[-lines:] if log.is_file() else ["(no log)"]
    print(f"[fail] {what} (log {log}):\n    " + "\n    ".join(tail), flush=True)


def _run_eval_job(argvs: list[list[str]], log: Path) -> int:
    if all((Path(a[a.index("--output") + 1]) / "eval.json").is_file() for a in argvs):
        return 0
    with _EVAL_SLOTS:
        rc, _ = _run([sys.executable, str(Path(__file__).resolve()), "_eval_many", json.dumps(argvs)], log)
    if rc != 0:
        _say_failure(f"eval rc {rc}", log)
        _FAILED_EVALS.append((argvs, log))
    return rc


@contextlib.contextmanager
def _mps_daemon(folder: Path):
    """Run the study's processes under CUDA MPS: a control daemon with its pipe and log folders under ``folder``,
    stopped on exit. Without MPS, a dozen processes time-slice the GPU; with it, their small kernels share the SMs."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=os.environ | env, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--mps: could not start nvidia-cuda-mps-control ({e}); run without --mps") from e
    with mock.patch.dict(os.environ, env):  # the caller's own settings, if it had any, come back after
        try:
            yield
        finally:
            subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=os.environ, check=False)


def _gpu_run_dir(runs: Path, task: str, arm: str, seed: int) -> Path:
    return runs / task / f"{GPU_ARMS[arm]['tag']}-s{seed}"


def _gpu_job(task: str, arm: str, seed: int, steps: int, eval_at: list[int], runs: Path, logs: Path,
             tiny: bool) -> None:  # fmt: skip
    """Train one (task, arm, seed) run unless its final adapter exists, then evaluate its saved adapters."""
    out = _gpu_run_dir(runs, task, arm, seed)
    tag = f"{task}-{GPU_ARMS[arm]['tag']}-s{seed}"
    if not (out / "final" / "adapter_config.json").is_file():
        print(f"[{time.strftime('%H:%M:%S')}] train {tag}", flush=True)
        rc, sec = _run(gpu_train_cmd(task, arm, seed, steps, eval_at, out, tiny), logs / f"train-{tag}.log")
        if rc != 0:
            _say_failure(f"train {tag} rc {rc}", logs / f"train-{tag}.log")
        out.mkdir(parents=True, exist_ok=True)
        (out / "wall_time.json").write_text(json.dumps({"train_wall_s": sec, "rc": rc}))
        print(f"[{time.strftime('%H:%M:%S')}] trained {tag}: rc {rc}, {sec:.0f} s", flush=True)
    quant = GPU_ARMS[arm]["quantization"]
    for step in sorted(s for s in eval_at if s > 0):
        ckpt = out / "final" if step == steps else out / f"checkpoint-{step}"
        if not (ckpt / "adapter_config.json").is_file():
            print(f"[warn] {tag}: no adapter at step {step} ({ckpt})", flush=True)
            continue
        rc = _run_eval_job(_gpu_eval_argvs(task, quant, out / f"eval-{step}", ckpt, tiny), logs / f"eval-{tag}-{step}.log")
        print(f"[{time.strftime('%H:%M:%S')}] evaluated {tag} at step {step}: rc {rc}", flush=True)


def launch_gpu(tasks: list[str], arms: list[str], seeds: list[int], steps: int, eval_at: list[int], runs: Path,
               logs: Path, parallel: int, tiny: bool, mps: bool = False, eval_parallel: int = EVAL_PARALLEL) -> None:  # fmt: skip
    """Train and evaluate every (task, arm, seed), ``parallel`` processes at a time (under MPS with ``mps``), at most
    ``eval_parallel`` of them evals; an eval that failed runs once more at the end, alone and without MPS, and its
    log's end is printed either way."""
    global _EVAL_SLOTS
    _EVAL_SLOTS = threading.BoundedSemaphore(eval_parallel)
    runs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    # seeds outermost: a study cut short still has every arm of the first seeds
    jobs = [(_gpu_job, (task, arm, seed, steps, eval_at, runs, logs, tiny))
            for seed in seeds for task in tasks for arm in arms]  # fmt: skip
    if 0 in eval_at:  # the base models, once per (task, quantization); last, so that no training run waits for them
        for task in tasks:
            for quant in sorted({GPU_ARMS[a]["quantization"] for a in arms}):
                argvs = _gpu_eval_argvs(task, quant, runs / task / f"base-{quant}", None, tiny)
                jobs.append((_run_eval_job, (argvs, logs / f"eval-{task}-base-{quant}.log")))
    with _mps_daemon(logs / "mps") if mps else contextlib.nullcontext(), ThreadPoolExecutor(parallel) as pool:
        for f in [pool.submit(fn, *a) for fn, a in jobs]:
            f.result()
    for argvs, log in list(_FAILED_EVALS):
        rc = _run_eval_job(argvs, log.with_suffix(".retry.log"))
        print(f"[{time.strftime('%H:%M:%S')}] eval retried alone ({log.name}): rc {rc}", flush=True)
    _FAILED_EVALS.clear()  # a retry that failed again was printed; it is not retried twice


def _pass_rates(folder: Path) -> dict:
    """Greedy pass@1 and sampled pass@4 of one evaluation folder (None where its eval did not finish)."""
    g, smp = ((folder / k / "eval.json") for k in ("greedy", "sampled"))
    g, smp = (json.loads(f.read_text()).get("metrics") if f.is_file() else None for f in (g, smp))
    return {"greedy_pass@1": g and g.get("pass@1"), "sampled_pass@4": smp and smp.get("pass@4")}


def _seed_ci(arm: dict, step: int | None, key: str) -> tuple[float, float | None] | None:
    """``key`` of ``arm``'s evaluations at ``step`` over its seeds: the mean and the half-width of the 95 % t interval
    (one seed: its value and None; none: None)."""
    import statistics

    values = [s["eval"].get(str(step), {}).get(key) for s in arm["seeds"].values()]
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return (values[0], None) if values else None
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}.get(len(values), 2.0)
    return statistics.mean(values), t * statistics.stdev(values) / math.sqrt(len(values))


def collect_gpu(tasks: list[str], arms: list[str], seeds: list[int], steps: int, eval_at: list[int], runs: Path,
                tiny: bool) -> dict:  # fmt: skip
    import torch
    import transformers
    import trl

    result: dict = {"tasks": {}}
    for task in tasks:
        base = {}
        for quant in sorted({GPU_ARMS[a]["quantization"] for a in arms} | {"none", "rtn"}):
            base[quant] = _pass_rates(runs / task / f"base-{quant}")
        per_arm: dict = {}
        for arm in arms:
            spec = GPU_ARMS[arm]
            per_seed = {}
            for seed in seeds:
                out = _gpu_run_dir(runs, task, arm, seed)
                rows = _read_metrics(out / "metrics.jsonl")
                if not rows:
                    continue
                evals = {"0": base[spec["quantization"]]}
                for step in sorted(s for s in eval_at if s > 0):
                    evals[str(step)] = _pass_rates(out / f"eval-{step}")
                wall = json.loads((out / "wall_time.json").read_text()) if (out / "wall_time.json").is_file() else {}
                acc_key = next((k for k in rows[0] if k.startswith("rewards/") and "accuracy" in k and
                                k.endswith("/mean")), None)  # fmt: skip
                per_seed[str(seed)] = {
                    "steps_logged": len(rows),
                    "finished": (out / "final" / "adapter_config.json").is_file() or len(rows) >= steps,
                    "reward": [r.get("reward") for r in rows],
                    "accuracy_reward": [r.get(acc_key) for r in rows] if acc_key else None,
                    "entropy": [r.get("entropy") for r in rows],
                    "aqn_sigma": [r.get("aqn/sigma") for r in rows],
                    "completion_length": [r.get("completions/mean_length") for r in rows],
                    "eval": evals,
                    "train_wall_s": wall.get("train_wall_s"),
                }
            per_arm[arm] = {"settings": {k: v for k, v in spec.items() if k != "tag"}, "seeds": per_seed}
        result["tasks"][task] = {"base_eval": base, "arms": per_arm}
    return {
        "benchmark": "learning_study_gpu",
        "issue": 21,
        "date": datetime.date.today().isoformat(),
        # --plot-only elsewhere than the runs' machine: QERL_STUDY_DEVICE names the device they ran on
        "device": os.environ.get("QERL_STUDY_DEVICE")
        or (torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "trl": trl.__version__},  # fmt: skip
        "settings": {"model": "offline-default (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized to bf16)",
                     "steps": steps, "seeds": seeds, "eval_at": eval_at, "train": GPU_TRAIN,
                     "tasks": {t: GPU_TASKS[t] for t in tasks}, "tiny": tiny,
                     "entropy": "TRL's 'entropy': mean token entropy of the policy (noise off) over the completions it "
                                "sampled, computed in the loss forward",
                     "eval": "qerl eval: greedy pass@1 and pass@4 of 4 samples at T=1.0 on held-out test problems"},
        **result,
    }


def take_arms_from(res: dict, specs: list[str]) -> None:
    """``--arm-from [TASK/]ARM=JSON``: an earlier study's data for ``ARM`` (in ``TASK``, or every task) in place of
    this run's, whose logged steps must equal that run's (reward and entropy); ``notes`` say which came from where."""
    for spec in specs:
        name, sep, path = spec.partition("=")
        only, _, arm = name.rpartition("/")
        if not sep or arm not in GPU_ARMS or (only and only not in GPU_TASKS):
            raise SystemExit(f"--arm-from {spec!r}: expected [TASK/]ARM=JSON with TASK one of {', '.join(GPU_TASKS)} "
                             f"and ARM one of {', '.join(GPU_ARMS)}")
        earlier = json.loads(Path(path).read_text())
        for task, data in res["tasks"].items():
            if only and task != only:
                continue
            theirs = earlier.get("tasks", {}).get(task, {}).get("arms", {}).get(arm)
            if theirs is None or arm not in data["arms"]:
                continue
            checked = 0
            for seed, ours in data["arms"][arm]["seeds"].items():
                old = theirs["seeds"].get(seed, {})
                for key in ("reward", "entropy"):
                    n = len(ours[key])
                    if old.get(key, [])[:n] != ours[key]:
                        raise SystemExit(f"--arm-from: {task}/{arm} seed {seed}: this run's {key} differs from "
                                         f"{path}'s within its {n} steps; not the same runs")
                checked = max(checked, len(ours["reward"]))
            data["arms"][arm] = theirs | {"source": f"{path} (same settings and seeds; this run's {checked} steps "
                                                    "of it identical)"}
            res.setdefault("notes", []).append(f"{task}/{arm}: data from {path} ({earlier.get('date')}); this run "
                                               f"stopped it after {checked} steps, all identical to that run's.")


def _curves(arm: dict, key: str):
    """``arm``'s per-seed curves of ``key`` cut to the shortest, as a ``[seeds, steps]`` array (None as NaN); None
    when no seed has the curve."""
    import numpy as np

    if not (curves := [s[key] for s in arm.get("seeds", {}).values() if s.get(key)]):
        return None
    n = min(len(c) for c in curves)
    return np.array([[np.nan if v is None else v for v in c[:n]] for c in curves], dtype=float)


def _summary_rows(res: dict) -> list[dict]:
    """Per (task, arm): held-out accuracy at the first and last eval (mean, 95 % CI over seeds), final reward, and
    steps to reach 50 % of bf16 + LoRA's final reward (mean curve over seeds, smoothed over 10 steps)."""
    import numpy as np

    rows = []
    for task, data in res["tasks"].items():
        def mean_curve(arm: str, key: str, data: dict = data):
            if (arr := _curves(data["arms"].get(arm, {}), key)) is None:
                return None
            k = min(10, arr.shape[1])
            return np.convolve(np.nanmean(arr, 0), np.ones(k) / k, mode="valid")

        ref = mean_curve("bf16+LoRA", "reward")
        target = 0.5 * ref[-1] if ref is not None and len(ref) and ref[-1] > 0 else None
        for arm, a in data["arms"].items():
            row = {"task": task, "arm": arm, "seeds": len(a["seeds"])}
            steps = sorted({int(k) for s in a["seeds"].values() for k in s["eval"]})
            for key in ("greedy_pass@1", "sampled_pass@4"):
                for label, step in (("start", steps[0] if steps else None), ("end", steps[-1] if steps else None)):
                    row[f"{key} {label}"] = _seed_ci(a, step, key)
            cur = mean_curve(arm, "reward")
            row["final_reward"] = None if cur is None else float(cur[-1])
            window = None if cur is None else _curves(a, "reward").shape[1] - len(cur) + 1
            hit = None if cur is None or target is None else next((i + window for i, v in enumerate(cur) if v >= target),
                                                                   None)  # fmt: skip
            row["steps_to_half_bf16_final"] = hit
            ent = mean_curve(arm, "entropy")
            row["entropy_first_20"] = None if ent is None else float(ent[: max(1, 20 - 9)].mean())
            rows.append(row)
    return rows


def table_gpu(res: dict) -> str:
    def f(v) -> str:  # a (mean, CI half-width) cell
        return "—" if v is None else f"{v[0]:.3f}" + ("" if v[1] is None else f" ± {v[1]:.3f}")

    lines = ["| task | arm | seeds | greedy pass@1 start → end | sampled pass@4 start → end | final reward "
             "| steps to ½ bf16 final reward | entropy, first 20 steps |",
             "|---|---|---:|---|---|---:|---:|---:|"]  # fmt: skip
    for r in _summary_rows(res):
        fr, ent = (f((r[k], None)) if r[k] is not None else "—" for k in ("final_reward", "entropy_first_20"))
        lines.append(f"| {r['task']} | {r['arm']} | {r['seeds']} | {f(r['greedy_pass@1 start'])} → "
                     f"{f(r['greedy_pass@1 end'])} | {f(r['sampled_pass@4 start'])} → {f(r['sampled_pass@4 end'])} "
                     f"| {fr} | {r['steps_to_half_bf16_final'] or '—'} | {ent} |")  # fmt: skip
    return "\n".join(lines)


def plot_gpu(res: dict, folder: Path, prefix: str = "learning_study_gpu") -> list[Path]:
    """One figure per task, ``<folder>/<prefix>_<task>.png``: reward, entropy, σ, completion length per step (mean over
    seeds, 95 % CI band) and held-out greedy pass@1 at each evaluated step, one colour per arm."""
    import warnings

    import numpy as np
    from common.plots import pyplot, save_figure

    plt = pyplot()
    warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (σ of the arms without AQN)
    paths = []
    for task, data in res["tasks"].items():
        fig, axes = plt.subplots(1, 5, figsize=(26, 4.6))
        panels = (("reward", "mean reward of the step's completions"), ("entropy", "nats / token"),
                  ("aqn_sigma", "AQN σ"), ("completion_length", "tokens"))  # fmt: skip
        for axis, (key, ylabel) in zip(axes[:4], panels):
            for arm, a in data["arms"].items():
                if (arr := _curves(a, key)) is None:
                    continue
                x = np.arange(1, arr.shape[1] + 1)
                mean = np.nanmean(arr, 0)
                axis.plot(x, mean, color=GPU_COLORS[arm], lw=1.8, label=f"{arm} ({len(arr)} seeds)")
                if len(arr) > 1:
                    half = 1.96 * np.nanstd(arr, 0, ddof=1) / np.sqrt(len(arr))
                    axis.fill_between(x, mean - half, mean + half, color=GPU_COLORS[arm], alpha=0.15)
            axis.set_xlabel("training step")
            axis.set_ylabel(ylabel)
            axis.set_title(key.replace("_", " ") + " (mean, band = 95 % CI over seeds)")
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        ax = axes[4]
        width = 0.8 / max(1, len(data["arms"]))
        for i, (arm, a) in enumerate(data["arms"].items()):
            steps = sorted({int(k) for s in a["seeds"].values() for k in s["eval"]})
            cis = [_seed_ci(a, st, "greedy_pass@1") or (np.nan, None) for st in steps]
            means, errs = [m for m, _ in cis], [h or 0.0 for _, h in cis]
            xs = np.arange(len(steps)) + (i - (len(data["arms"]) - 1) / 2) * width
            ax.bar(xs, means, width, yerr=errs, capsize=3, color=GPU_COLORS[arm], edgecolor="k", label=arm)
            ax.set_xticks(np.arange(len(steps)), [f"step {st}" for st in steps])
        ax.set_ylabel("greedy pass@1, held-out")
        ax.set_title("held-out accuracy (mean, 95 % CI)")
        ax.grid(alpha=0.3, axis="y")
        steps_total = res["settings"]["steps"]
        logged = [s["steps_logged"] for a in data["arms"].values() for s in a["seeds"].values()]
        stopped = logged and min(logged) < steps_total  # a study cut short says so on its figure
        span = f"stopped at steps {min(logged)}-{max(logged)} of {steps_total}" if stopped else f"{steps_total} steps"
        fig.suptitle(f"SmolLM2-135M-Instruct, GRPO on {task}, {span}, {res['device']}")
        fig.tight_layout()
        paths.append(save_figure(fig, folder / f"{prefix}_{task}.png"))
    return paths


def main_gpu(args) -> None:
    tasks, arms = args.tasks.split(","), args.arms.split(",") if args.arms else list(GPU_ARMS)[:4]
    for names, known, what in ((arms, GPU_ARMS, "arm"), (tasks, GPU_TASKS, "task")):
        if unknown := [n for n in names if n not in known]:
            raise SystemExit(f"unknown {what} {unknown[0]!r}; {what}s: {', '.join(known)}")
    GPU_TRAIN["rollout_engine"] = args.rollout_engine
    steps, seeds, eval_at = args.steps, args.seeds, sorted(set(args.eval_at))
    if args.tiny:
        steps, seeds, eval_at = 2, seeds[:1], [0, 2]
    if any(s > steps or s < 0 for s in eval_at) or steps not in eval_at:
        raise SystemExit(f"--eval-at {eval_at}: steps in 0..{steps}, the last one included")
    name = f"learning_study_{args.preset}" if args.preset else "learning_study_gpu"
    runs = args.runs or ROOT / "runs" / (f"{name}_tiny" if args.tiny else name)
    if not args.plot_only:
        launch_gpu(tasks, arms, seeds, steps, eval_at, runs, args.logs, args.parallel, args.tiny, args.mps,
                   args.eval_parallel)
    res = collect_gpu(tasks, arms, seeds, steps, eval_at, runs, args.tiny)
    take_arms_from(res, args.arm_from)
    out = args.json or ROOT / "benchmarks" / "results" / (f"{name}_tiny.json" if args.tiny else f"{name}.json")
    res["summary"] = _summary_rows(res)
    if args.preset:
        res["issue"], res["benchmark"] = PRESETS[args.preset][0], name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(table_gpu(res))
    pngs = plot_gpu(res, args.png_dir or (runs if args.tiny else ROOT / "docs"), prefix=name)
    print(f"written: {out}, " + ", ".join(str(p) for p in pngs))


def main() -> None:
    if sys.argv[1:2] == ["_eval_many"]:
        _eval_many(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the GPU study (the only one here; kept for recorded commands)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", type=Path, default=None, help="run folders (default runs/<study>[_tiny])")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/learning_study_logs"))
    ap.add_argument("--plot-only", action="store_true", help="only read existing run folders and write JSON + PNG")
    ap.add_argument("--json", type=Path, default=None, help="default benchmarks/results/<study>[_tiny].json")
    ap.add_argument("--tasks", default="arithmetic,gsm8k", help="comma list of " + ",".join(GPU_TASKS))
    ap.add_argument("--arms", default=None, help="comma list (default: the first four) of " + ", ".join(GPU_ARMS))
    ap.add_argument("--formats", action="store_const", dest="preset", const="formats", help="formats (issue #22)")
    ap.add_argument("--fp8", action="store_const", dest="preset", const="fp8", help="FP8 rollouts' parity (#51)")
    ap.add_argument("--eval-at", type=int, nargs="+", default=[0, 75, 150], help="steps evaluated (0 = base model)")
    ap.add_argument("--parallel", type=int, default=12, help="runs at a time")
    ap.add_argument("--eval-parallel", type=int, default=EVAL_PARALLEL, help="of those, evals at a time")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: 1 seed, 2 steps, tiny batches and evals")
    ap.add_argument("--png-dir", type=Path, default=None, help="figure folder (default docs/)")
    ap.add_argument("--mps", action="store_true", help="run the processes under CUDA MPS")
    ap.add_argument("--rollout-engine", default="graph", choices=["graph", "transformers"], help="on CUDA")
    ap.add_argument("--arm-from", action="append", default=[], metavar="[TASK/]ARM=JSON", help="see take_arms_from")
    args = ap.parse_args()
    if args.preset:
        args.arms = args.arms or ",".join(PRESETS[args.preset][1])
        if "--tasks" not in sys.argv:
            args.tasks = "arithmetic"
    main_gpu(args)


if __name__ == "__main__":
    main()
