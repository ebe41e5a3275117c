"""Learning study (issue #8): bf16+LoRA vs NVFP4+LoRA vs NVFP4+LoRA+AQN, GRPO on the offline default model.

Each arm x seed is one real ``qerl train offline-default`` run (same data, same steps, same hyper-parameters; only
``--quantization`` / ``--aqn`` differ), followed by a greedy ``qerl eval`` of its adapter on the arithmetic test
split; the base models (bf16 and NVFP4-RTN) are evaluated once each. Runs go to ``runs/learning_study/<arm>-s<seed>``
(gitignored), two at a time with one torch thread each (``--lanes``), logs under ``/tmp``.

    uv run python benchmarks/learning_study.py                 # train + eval + plot (~50 min on 2 shared CPU cores)
    uv run python benchmarks/learning_study.py --plot-only     # re-read the run folders, write JSON + PNG

Writes ``results/learning_study.json`` and ``docs/learning_study.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "bf16+LoRA": {"tag": "bf16", "quantization": "none", "aqn": "false"},
    "NVFP4+LoRA": {"tag": "nvfp4", "quantization": "rtn", "aqn": "false"},
    "NVFP4+LoRA+AQN": {"tag": "nvfp4-aqn", "quantization": "rtn", "aqn": "true"},
}
COLORS = {"bf16+LoRA": "tab:gray", "NVFP4+LoRA": "tab:blue", "NVFP4+LoRA+AQN": "tab:red"}
TRAIN_OVERRIDES = {
    "per_device_train_batch_size": 16,
    "num_generations": 4,
    "max_completion_length": 12,
    "learning_rate": 5e-4,
    "aqn_num_stages": 5,
    "save_strategy": "no",
    "disable_tqdm": "true",
}
EVAL_ARGS = ["--task", "arithmetic", "--split", "test", "--limit", "64", "--greedy", "--max-new-tokens", "12",
             "--no-progress"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run(cmd: list[str], log: Path) -> tuple[int, float]:
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    return rc, time.perf_counter() - start


def _cached_eval(argv: list[str]) -> None:
    """``qerl_trl.evaluation.main(argv)`` with NVFP4 weights dequantized once (``nvfp4.cache_dequantized``).

    ``qerl eval`` on CPU runs the NVFP4 reference path, which re-dequantizes every weight on every decoded token; the
    cache gives the same numbers (bit-identical by construction) several times faster. Dense models are unaffected.
    """
    import nvfp4
    import qerl_trl.evaluation as ev

    plain = ev.evaluate

    def evaluate(model, *args, **kwargs):
        with nvfp4.cache_dequantized(model, model.get_input_embeddings().weight.dtype):
            return plain(model, *args, **kwargs)

    ev.evaluate = evaluate
    ev.main(argv)


def _eval_cmd(quantize: str, out: Path, adapter: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_eval", "--model", "offline-default", "--quantize",
           quantize, *EVAL_ARGS, "--output", str(out)]
    return cmd + (["--adapter", str(adapter)] if adapter else [])


def _job_train(arm: str, seed: int, steps: int, runs: Path, logs: Path) -> None:
    spec = ARMS[arm]
    out = runs / f"{spec['tag']}-s{seed}"
    if (out / "metrics.jsonl").is_file() and not (out / "final" / "adapter_config.json").is_file():
        # a run a previous driver started is still going (its process outlives that driver): wait for it
        print(f"[{time.strftime('%H:%M:%S')}] waiting for {out} to finish", flush=True)
        while not (out / "final" / "adapter_config.json").is_file():
            time.sleep(10)
    if (out / "final" / "adapter_config.json").is_file():
        print(f"[skip] {out} already trained", flush=True)
    else:
        cmd = [sys.executable, "-m", "qerl_trl.cli", "train", "offline-default", "--output_dir", str(out),
               "--seed", str(seed), "--max_steps", str(steps), "--quantization", spec["quantization"],
               "--aqn", spec["aqn"]]
        for k, v in TRAIN_OVERRIDES.items():
            cmd += [f"--{k}", str(v)]
        print(f"[{time.strftime('%H:%M:%S')}] train {arm} seed {seed}", flush=True)
        rc, sec = _run(cmd, logs / f"train-{spec['tag']}-s{seed}.log")
        (out).mkdir(parents=True, exist_ok=True)
        (out / "wall_time.json").write_text(json.dumps({"train_wall_s": sec, "rc": rc}))
        print(f"[{time.strftime('%H:%M:%S')}] done {arm} seed {seed}: rc {rc}, {sec:.0f} s", flush=True)
    if (out / "final" / "adapter_config.json").is_file() and not (out / "eval" / "eval.json").is_file():
        _run(_eval_cmd(spec["quantization"], out / "eval", out / "final"), logs / f"eval-{spec['tag']}-s{seed}.log")


def _job_base_eval(quantize: str, runs: Path, logs: Path) -> None:
    out = runs / f"base-{quantize}"
    if not (out / "eval.json").is_file():
        print(f"[{time.strftime('%H:%M:%S')}] eval base quantize={quantize}", flush=True)
        _run(_eval_cmd(quantize, out), logs / f"eval-base-{quantize}.log")


def launch(steps: int, seeds: list[int], runs: Path, logs: Path) -> None:
    """Two lanes; arm order so that an interrupted study still has every arm at least once."""
    runs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    arms = list(ARMS)
    lanes: list[list] = [[("base", "none")], [("base", "rtn")]]
    for i, seed in enumerate(seeds):
        order = arms if i % 2 == 0 else arms[::-1]
        lanes[i % 2] += [("train", arm, seed) for arm in order]

    def worker(jobs: list) -> None:
        for job in jobs:
            if job[0] == "base":
                _job_base_eval(job[1], runs, logs)
            else:
                _job_train(job[1], job[2], steps, runs, logs)

    threads = [threading.Thread(target=worker, args=(lane,)) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _read_metrics(path: Path) -> list[dict]:
    rows: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "reward" in row and "step" in row:
                    rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def _accuracy(path: Path) -> float | None:
    if not path.is_file():
        return None
    res = json.loads(path.read_text())
    for key in ("accuracy", "pass@1", "mean_reward", "score"):
        if key in res:
            return float(res[key])
    metrics = res.get("metrics", {})
    for key in ("accuracy", "pass@1", "mean_reward"):
        if key in metrics:
            return float(metrics[key])
    return None


def collect(steps: int, seeds: list[int], runs: Path) -> dict:
    import torch
    import transformers
    import trl

    base = {q: _accuracy(runs / f"base-{q}" / "eval.json") for q in ("none", "rtn")}
    arms: dict = {}
    for arm, spec in ARMS.items():
        per_seed = {}
        for seed in seeds:
            out = runs / f"{spec['tag']}-s{seed}"
            rows = _read_metrics(out / "metrics.jsonl")
            if not rows:
                continue
            wall = json.loads((out / "wall_time.json").read_text()) if (out / "wall_time.json").is_file() else {}
            per_seed[str(seed)] = {
                "run_dir": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
                "finished": (out / "final" / "adapter_config.json").is_file(),
                "steps_logged": len(rows),
                "reward": [r["reward"] for r in rows],
                "accuracy_reward": [r.get("rewards/arithmetic_accuracy_reward/mean") for r in rows],
                "answer_tag_reward": [r.get("rewards/answer_tag_reward/mean") for r in rows],
                "entropy": [r.get("entropy") for r in rows],
                "aqn_sigma": [r.get("aqn/sigma") for r in rows],
                "completion_length": [r.get("completions/mean_length") for r in rows],
                "eval_accuracy_before": base[spec["quantization"]],
                "eval_accuracy_after": _accuracy(out / "eval" / "eval.json"),
                "train_wall_s": wall.get("train_wall_s"),
                "sum_step_time_s": sum(r.get("step_time", 0.0) for r in rows),
            }
        arms[arm] = {"settings": {"quantization": spec["quantization"], "aqn": spec["aqn"] == "true"},
                     "seeds": per_seed}
    return {
        "benchmark": "learning_study",
        "issue": 8,
        "date": datetime.date.today().isoformat(),
        "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores, shared), OMP_NUM_THREADS=1, 2 runs at a time",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "trl": trl.__version__},
        "settings": {
            "recipe": "offline-default (SmolLM2-135M-Instruct, GRPO, arithmetic 1-digit '+', n_examples 2000, "
                      "LoRA r=32 alpha=32, beta 0, T=1.0, AQN exponential 1e-2 -> 5e-4)",
            "max_steps": steps, "seeds": seeds, "overrides": TRAIN_OVERRIDES,
            "eval": "qerl_trl.evaluation " + " ".join(EVAL_ARGS) + " (accuracy on the first 64 test problems)",
        },
        "base_eval_accuracy": {"bf16": base["none"], "nvfp4-rtn": base["rtn"]},
        "arms": arms,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, cx, ex, bx) = plt.subplots(1, 4, figsize=(21, 4.6), gridspec_kw={"width_ratios": [1.5, 1.5, 1.5, 1]})
    labels, before, after_mean, after_lo, after_hi = [], [], [], [], []
    for arm, data in result["arms"].items():
        for axis, key in ((ax, "reward"), (cx, "accuracy_reward"), (ex, "entropy")):
            curves = [s[key] for s in data["seeds"].values()]
            if curves:
                n = min(len(c) for c in curves)
                arr = np.array([c[:n] for c in curves], dtype=float)
                x = np.arange(1, n + 1)
                axis.plot(x, arr.mean(0), color=COLORS[arm], label=f"{arm} ({len(curves)} seeds)", lw=2)
                axis.fill_between(x, arr.min(0), arr.max(0), color=COLORS[arm], alpha=0.18)
        accs = [s["eval_accuracy_after"] for s in data["seeds"].values() if s["eval_accuracy_after"] is not None]
        labels.append(arm)
        b = [s["eval_accuracy_before"] for s in data["seeds"].values() if s["eval_accuracy_before"] is not None]
        before.append(b[0] if b else np.nan)
        after_mean.append(np.mean(accs) if accs else np.nan)
        after_lo.append(np.mean(accs) - min(accs) if accs else 0)
        after_hi.append(max(accs) - np.mean(accs) if accs else 0)
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward of the step's completions")
    ax.set_title("GRPO reward vs step (mean, band = range over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    cx.set_xlabel("training step")
    cx.set_ylabel("fraction of the step's completions correct")
    cx.set_title("accuracy part of the reward (mean, band = range)")
    cx.grid(alpha=0.3)
    ex.set_xlabel("training step")
    ex.set_ylabel("nats / token")
    ex.set_title("policy entropy (TRL 'entropy', training forward)")
    ex.grid(alpha=0.3)
    xs = np.arange(len(labels))
    bx.bar(xs - 0.2, before, 0.4, color="lightgray", edgecolor="k", label="before (base)")
    bx.bar(xs + 0.2, after_mean, 0.4, yerr=[after_lo, after_hi], capsize=4,
           color=[COLORS[a] for a in labels], edgecolor="k", label="after (mean, range)")
    bx.set_xticks(xs, [a.replace("+", "+\n") for a in labels], fontsize=8)
    bx.set_ylabel("greedy accuracy, arithmetic test[:64]")
    bx.set_title("eval before / after")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3, axis="y")
    fig.suptitle(f"SmolLM2-135M-Instruct, arithmetic, {result['settings']['max_steps']} steps × 16 samples, CPU")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def table(result: dict) -> str:
    lines = ["| arm | seed | steps | reward first 3 | reward last 3 | acc before | acc after | train wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, data in result["arms"].items():
        for seed, s in data["seeds"].items():
            r = s["reward"]
            first = sum(r[:3]) / len(r[:3])
            last = sum(r[-3:]) / len(r[-3:])
            fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
            wall = "—" if s["train_wall_s"] is None else f"{s['train_wall_s']:.0f}"
            lines.append(f"| {arm} | {seed} | {s['steps_logged']} | {first:.3f} | {last:.3f} | "
                         f"{fmt(s['eval_accuracy_before'])} | {fmt(s['eval_accuracy_after'])} | {wall} |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["_eval"]:
        _cached_eval(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "learning_study")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/learning_study_logs"))
    ap.add_argument("--plot-only", action="store_true", help="only read existing run folders and write JSON + PNG")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "learning_study.json")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "learning_study.png")
    args = ap.parse_args()
    if not args.plot_only:
        launch(args.steps, args.seeds, args.runs, args.logs)
    result = collect(args.steps, args.seeds, args.runs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    plot(result, args.png)
    print(f"written: {args.json}, {args.png}")


if __name__ == "__main__":
    main()
