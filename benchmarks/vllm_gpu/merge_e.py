"""Machine E's job folder (``machine_e.sh``; issue #52) as one JSON: per run the command, the plan, the exit code, per
step ``step_time`` split into generation and training, tokens/s, the TP engine's logprob difference, and the peak
``memory.used`` of each GPU.

    python3 benchmarks/vllm_gpu/merge_e.py e --commit SHA [--out benchmarks/results/grpo_fsdp2_vllm_tp.json]

Phases (from each run's ``metrics.jsonl``, rank 0's): ``step_time`` is TRL's, the sum of the step's ``training_step``
calls (generation included: it runs inside the first; the optimizer step is not). ``generation_s`` = the process's
completion tokens / ``tokens_per_second/generation``, its tokens taken as ``completions/mean_length`` (the mean over
every process) × its rows (``per_device_train_batch_size`` × ``gradient_accumulation_steps``): exact where every
completion reaches the cap, as a random model's do. ``training_s`` = the rest (scoring, loss forward, backward, FSDP2
gathers and reduce-scatters). Peak per GPU: the largest ``memory.used`` (MiB) of each index in ``NAME.smi.csv``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

KEYS = {"reward": "reward", "mean_length": "completions/mean_length", "tok_s_generation": "tokens_per_second/generation",
        "tok_s_training": "tokens_per_second/training", "logp_diff_mean": "sampling/sampling_logp_difference/mean",
        "logp_diff_max": "sampling/sampling_logp_difference/max", "num_tokens": "num_tokens"}  # fmt: skip


def peak_mib(csv: Path) -> dict[str, int]:
    """``{gpu index: largest memory.used}`` of ``nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,
    noheader,nounits`` lines; ``[N/A]`` and cut lines skipped."""
    peak: dict[str, int] = {}
    for line in csv.read_text().splitlines() if csv.is_file() else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            peak[parts[1]] = max(peak.get(parts[1], 0), int(parts[2]))
    return peak


def merge_run(job: Path, name: str) -> dict:
    """One run of the job folder: ``NAME.cmd``, ``.plan.txt``, ``.rc``, ``.log``, ``.smi.csv``, ``NAME/metrics.jsonl``."""
    read = lambda suffix: (job / f"{name}{suffix}").read_text().strip() if (job / f"{name}{suffix}").is_file() else None  # noqa: E731
    argv = shlex.split(read(".cmd") or "")
    rc = read(".rc")
    procs = int(re.search(r"_(\d+)gpu$", name)[1]) if re.search(r"_(\d+)gpu$", name) else 1  # NAME = MODEL_Ngpu
    flag = lambda name, default: int(argv[argv.index(name) + 1]) if name in argv else default  # noqa: E731
    rows = flag("--per_device_train_batch_size", 8) * flag("--gradient_accumulation_steps", 1)  # a process's rows
    plan = (read(".plan.txt") or "").splitlines()
    log = read(".log") or ""
    train_plan = re.findall(r"qerl train: memory plan: (.*)", log)
    out = {"model": name.split("_")[0], "processes": procs, "rc": int(rc) if rc and rc.lstrip("-").isdigit() else rc,
           "command": argv, "plan": plan[-1] if plan else None, "train_plan": train_plan[-1] if train_plan else None,
           "rows_per_step": rows * procs, "steps": []}  # fmt: skip
    planned = re.search(r"planned peak ([\d.]+) of ([\d.]+) GB", out["train_plan"] or out["plan"] or "")
    if planned:
        out["planned_peak_gb"], out["usable_gb"] = float(planned[1]), float(planned[2])
    metrics = job / name / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        row = json.loads(line)
        if "step_time" in row:
            step = {"step": row["step"], "step_time_s": round(row["step_time"], 3)}
            step |= {k: row[m] for k, m in KEYS.items() if m in row}
            if row.get(KEYS["tok_s_generation"]) and "mean_length" in step:
                gen = step["mean_length"] * rows / row[KEYS["tok_s_generation"]]
                step |= {"generation_s": round(gen, 3), "training_s": round(row["step_time"] - gen, 3)}
            step["rows_per_s"] = round(rows * procs / row["step_time"], 4)
            out["steps"].append(step)
        elif "train_runtime" in row:
            out["train_runtime_s"] = row["train_runtime"]
    if out["rc"] != 0:  # a failed, cut or skipped run: what its log ended with
        out["log_tail"] = log.splitlines()[-8:]
    peak = peak_mib(job / f"{name}.smi.csv")
    if peak:
        out["peak_mib_per_gpu"] = peak
        out["peak_gb_per_gpu"] = {i: round(m * 2**20 / 1e9, 2) for i, m in peak.items()}
    return out


def merge(job: Path, commit: str | None) -> dict:
    names = sorted({p.name.rsplit(".", 1)[0] for p in [*job.glob("*.cmd"), *job.glob("*.rc")]})  # ran, running, skipped
    built = {m[0]: float(m[1]) for f in job.glob("build_*.log") for m in re.findall(r"\[(\S+)\] checkpoints ready in ([\d.]+) s", f.read_text())}  # fmt: skip
    gpus, runs = job / "gpus.txt", {n: merge_run(job, n) for n in names}
    compare = {}  # a model run on 1 and on 2 GPUs: the last step's ratios (2 GPUs make twice the rows)
    for m in sorted({r["model"] for r in runs.values()}):
        one, two = (runs.get(f"{m}_{g}gpu", {}).get("steps") for g in (1, 2))
        if one and two:
            compare[m] = {"step_time_2gpu_over_1gpu": round(two[-1]["step_time_s"] / one[-1]["step_time_s"], 3),
                          "rows_per_s_2gpu_over_1gpu": round(two[-1]["rows_per_s"] / one[-1]["rows_per_s"], 3)}  # fmt: skip
    return {"benchmark": "GRPO step, qerl train under FSDP2 + vLLM tensor-parallel rollouts (issue #52, machine E)",
            "commit": commit, "device": gpus.read_text().splitlines()[:4] if gpus.is_file() else None,
            "checkpoint_build_s": built, "runs": runs, "compare": compare}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", type=Path, help="the job's folder ($JOB_OUT; `e/` in bg.tgz)")
    ap.add_argument("--commit", default=None, help="the commit the machine ran")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results/grpo_fsdp2_vllm_tp.json")
    args = ap.parse_args(argv)
    res = merge(args.job, args.commit)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    for n, r in res["runs"].items():
        steps = "; ".join(f"step {s['step']}: {s['step_time_s']} s (gen {s.get('generation_s')}, train "
                          f"{s.get('training_s')})" for s in r["steps"])  # fmt: skip
        print(f"{n}: rc {r['rc']}, {steps}, peak GB per GPU {r.get('peak_gb_per_gpu')}, plan {r.get('planned_peak_gb')}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
