"""Does NVFP4 raise the policy's entropy? Token entropy of the offline default model, dense vs NVFP4 (issue #8).

SmolLM2-135M-Instruct on CPU (fp32 compute), same prompts for every arm: 16 (``--n``) synthetic arithmetic test prompts
(``qerl_trl.tasks.load_task("arithmetic", "test")``, few-shot chat) and 16 GSM8K test questions (system prompt of the
gsm8k task), rendered with the chat template. Arms:

* ``bf16``: the dense checkpoint (bf16 weights, fp32 compute) — the reference;
* ``NVFP4-RTN``, ``NVFP4-MSE`` (``NVFP4Config(method=...)`` on load), ``NVFP4-AWQ`` (``nvfp4.cli.quantize_with_method``,
  activation statistics from 32 GSM8K train texts; only with ``--awq``, not in the committed results);
* ``NVFP4-RTN+AQN``: RTN with AQN at σ_start = 1e-2, applied exactly as the trainer does (``aqn.AQNController`` over
  the offline recipe's exponential schedule, a step in stage 1 where σ = σ_start, per-step draw), several noise seeds.

Two views:

(a) teacher-forced: one set of completions sampled once from the dense model (T = 1, no top-k/top-p); every arm
    scores the same tokens, so sampling luck drops out: mean entropy over completion tokens (through the first EOS),
    KL(dense ‖ arm) and top-1 flip rate against the dense model;
(b) sampled: each arm samples its own completions at T = 1 (``--seeds`` sampling seeds; for AQN noise seed = sampling
    seed), mean entropy of its sampling distribution over the tokens it generated.

    uv run python benchmarks/entropy_quantization.py            # 23 min on 2 heavily shared CPU cores (2026-11-22)
    uv run python benchmarks/entropy_quantization.py --plot-only

Writes ``benchmarks/results/entropy_quantization.json`` and ``docs/entropy_quantization.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import time
from pathlib import Path

import torch
from common.entropy import compare, entropy_of, mean_dicts, sample, teacher_forced_logits
from common.env import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DATE = datetime.date.today().isoformat()  # the day the script runs
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
COLORS = {"bf16": "tab:gray", "NVFP4-RTN": "tab:blue", "NVFP4-MSE": "tab:green", "NVFP4-AWQ": "tab:purple",
          "NVFP4-RTN+AQN": "tab:red"}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    arms = list(results["teacher_forced"]["all"])
    subsets = ["arithmetic", "gsm8k", "all"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    w = 0.8 / len(arms)
    xs = np.arange(len(subsets))
    for i, arm in enumerate(arms):
        tf = [results["teacher_forced"][s][arm]["entropy"] - results["teacher_forced"][s]["bf16"]["entropy"]
              for s in subsets]
        axes[0].bar(xs + i * w, tf, w, color=COLORS[arm], label=arm, edgecolor="k", lw=0.4)
        sm = [results["sampled"][s][arm]["mean_entropy"] for s in subsets]
        lo = [results["sampled"][s][arm]["mean_entropy"] - min(results["sampled"][s][arm]["per_seed"]) for s in subsets]
        hi = [max(results["sampled"][s][arm]["per_seed"]) - results["sampled"][s][arm]["mean_entropy"] for s in subsets]
        axes[1].bar(xs + i * w, sm, w, yerr=[lo, hi], capsize=3, color=COLORS[arm], label=arm, edgecolor="k", lw=0.4)
        kl = [results["teacher_forced"][s][arm]["kl_dense_to_arm"] for s in subsets]
        axes[2].bar(xs + i * w, kl, w, color=COLORS[arm], label=arm, edgecolor="k", lw=0.4)
    titles = ["(a) teacher-forced on dense samples: entropy − bf16's",
              "(b) own samples at T=1: mean entropy (range over seeds)",
              "(a) KL(dense ‖ arm) per token"]
    ylabels = ["nats / token", "nats / token", "nats / token"]
    for ax, t, yl in zip(axes, titles, ylabels):
        ax.set_xticks(xs + w * (len(arms) - 1) / 2, subsets)
        ax.set_title(t, fontsize=10)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3, axis="y")
    axes[0].axhline(0, color="k", lw=0.8)
    axes[1].legend(fontsize=8, loc="lower right", framealpha=0.9)
    s = results["settings"]
    fig.suptitle(f"SmolLM2-135M-Instruct token entropy, {s['n_arithmetic']} arithmetic + {s['n_gsm8k']} GSM8K prompts, "
                 f"{s['new_tokens']} new tokens, CPU fp32 compute", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16, help="prompts per task")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=2, help="sampling seeds per arm in view (b)")
    ap.add_argument("--aqn-seeds", type=int, default=3, help="AQN noise seeds")
    ap.add_argument("--sigma", type=float, default=1e-2, help="AQN σ_start")
    ap.add_argument("--awq", action=argparse.BooleanOptionalAction, default=False, help="add the NVFP4-AWQ arm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", type=Path, default=GSM8K)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "entropy_quantization.json")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "entropy_quantization.png")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.png)
        print(f"wrote {args.png}")
        return

    import aqn
    import nvfp4
    import transformers
    from nvfp4 import NVFP4Config
    from nvfp4.cli import quantize_with_method
    from nvfp4.offline import OFFLINE_DEFAULT_NAME, offline_default_model_path
    from qerl_trl.tasks import load_task
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    t_start = time.time()
    path = offline_default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")  # the chat turn ends with <|im_end|>
    tok.pad_token = "<|im_end|>"
    tok.padding_side = "left"
    rows = {
        "arithmetic": load_task("arithmetic", "test", limit=args.n),
        "gsm8k": load_task("gsm8k", "test", path=str(args.data), limit=args.n),
    }
    encs = {}
    for name, ds in rows.items():
        enc = tok.apply_chat_template([r["prompt"] for r in ds], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True, padding=True)
        encs[name] = {k: enc[k] for k in ("input_ids", "attention_mask")}

    def load(arm: str):
        if arm == "bf16":
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if arm == "NVFP4-AWQ":
            calib_rows = load_task("gsm8k", "train", path=str(args.data), limit=32)
            calib = [f"Question: {r['question']}\nAnswer: {r['solution']}" for r in calib_rows]
            return quantize_with_method(path, "awq", tok, calib, torch.float32).eval()
        method = "mse" if arm == "NVFP4-MSE" else "rtn"
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    quantization_config=NVFP4Config(method=method)).eval()

    # AQN exactly as the trainer builds it: the recipe's exponential schedule; a step of stage 1 has σ = σ_start
    schedule = aqn.make_schedule("exponential", args.sigma, 5e-4, 5, total_steps=30)
    aqn_step = next(t for t in range(30) if schedule.sigma(t) == args.sigma)

    def noise_ctx(model, ctl, seed: int):
        if ctl is None:
            return contextlib.nullcontext()
        ctl.seed = seed
        return ctl.rollout(model, aqn_step)

    arm_names = ["bf16", "NVFP4-RTN", "NVFP4-MSE"] + (["NVFP4-AWQ"] if args.awq else [])
    settings = {
        "model": OFFLINE_DEFAULT_NAME, "compute_dtype": "float32", "n_arithmetic": len(rows["arithmetic"]),
        "n_gsm8k": len(rows["gsm8k"]), "new_tokens": args.new_tokens, "temperature": 1.0, "top_k": None, "top_p": 1.0,
        "sampling_seeds": args.seeds, "aqn": {"sigma": args.sigma, "schedule": "exponential 1e-2 -> 5e-4, 5 stages",
                                              "step": aqn_step, "mode": "per_step", "noise_seeds": args.aqn_seeds},
        "awq_calibration": "32 GSM8K train texts 'Question: ...\\nAnswer: ...'" if args.awq else None,
        "reference_completions": "sampled once from the dense model (seed 0, T=1)",
        "entropy": "mean over completion tokens through the first <|im_end|>, nats",
    }
    results: dict = {"benchmark": "entropy_quantization", "issue": 8, "date": DATE,
                     "device": f"CPU: {cpu_name()} (2 shared cores), torch threads {args.threads}",
                     "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                  "transformers": transformers.__version__,
                                  "nvfp4": getattr(nvfp4, "__version__", None)},
                     "settings": settings}

    ref_comp: dict = {}
    ref_logits: dict = {}
    per_arm_tf: dict = {}   # arm -> subset -> list of dicts (one per noise seed)
    per_arm_smp: dict = {}  # arm -> subset -> list of (entropy sum, tokens) per seed
    timings: dict = {}
    for arm in arm_names + ["NVFP4-RTN+AQN"]:
        t0 = time.time()
        if arm != "NVFP4-RTN+AQN":
            model = load(arm)
        ctl = None
        if arm == "NVFP4-RTN+AQN":
            model = load("NVFP4-RTN")
            ctl = aqn.AQNController(schedule, seed=0, mode="per_step")
        t_load = time.time() - t0
        cache = (nvfp4.cache_dequantized(model, torch.float32) if arm != "bf16" else contextlib.nullcontext())
        seeds_tf = range(args.aqn_seeds) if ctl is not None else [None]
        seeds_smp = range(args.aqn_seeds) if ctl is not None else range(args.seeds)
        per_arm_tf[arm], per_arm_smp[arm] = {}, {}
        with cache:
            for name, enc in encs.items():
                if arm == "bf16":
                    comp, mask, logits = sample(model, enc, eos_id, args.new_tokens, seed=0)
                    ref_comp[name] = (comp, mask)
                comp, mask = ref_comp[name]
                if arm == "bf16":
                    ref_logits[name] = teacher_forced_logits(model, enc, comp, mask)
                tf_rows = []
                for s in seeds_tf:
                    with noise_ctx(model, ctl, s or 0):
                        lg = teacher_forced_logits(model, enc, comp, mask)
                    tf_rows.append(compare(ref_logits[name], lg, mask, kl_key="kl_dense_to_arm"))
                per_arm_tf[arm][name] = tf_rows
                smp = []
                for s in seeds_smp:
                    with noise_ctx(model, ctl, s):
                        c, m, lg = sample(model, enc, eos_id, args.new_tokens, seed=s)
                    ent = entropy_of(lg)[m]
                    smp.append((float(ent.sum()), int(m.sum())))
                per_arm_smp[arm][name] = smp
        del model
        timings[arm] = {"load_s": round(t_load, 1), "total_s": round(time.time() - t0, 1)}
        print(f"{arm}: done in {timings[arm]['total_s']} s (load {timings[arm]['load_s']} s)", flush=True)

    tf_out: dict = {"arithmetic": {}, "gsm8k": {}, "all": {}}
    smp_out: dict = {"arithmetic": {}, "gsm8k": {}, "all": {}}
    ntok = {name: int(ref_comp[name][1].sum()) for name in encs}
    for arm in per_arm_tf:
        for name in encs:
            tf_out[name][arm] = mean_dicts(per_arm_tf[arm][name]) | {
                "per_seed_entropy": [d["entropy"] for d in per_arm_tf[arm][name]], "tokens": ntok[name]}
        # "all": token-weighted over both subsets
        tot = sum(ntok.values())
        tf_out["all"][arm] = {k: sum(tf_out[n][arm][k] * ntok[n] for n in encs) / tot
                              for k in ("entropy", "kl_dense_to_arm", "top1_flip_rate")} | {"tokens": tot}
        for name in encs:
            per = [e / max(n, 1) for e, n in per_arm_smp[arm][name]]
            smp_out[name][arm] = {"mean_entropy": sum(per) / len(per), "per_seed": per,
                                  "tokens": [n for _, n in per_arm_smp[arm][name]]}
        per_all = [sum(per_arm_smp[arm][n][i][0] for n in encs) / sum(per_arm_smp[arm][n][i][1] for n in encs)
                   for i in range(len(per_arm_smp[arm]["arithmetic"]))]
        smp_out["all"][arm] = {"mean_entropy": sum(per_all) / len(per_all), "per_seed": per_all}
    results["teacher_forced"] = tf_out
    results["sampled"] = smp_out
    results["timings_s"] = timings
    results["wall_seconds"] = round(time.time() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{'arm':>15} {'subset':>10} | {'TF entropy':>10} {'KL(dense||arm)':>14} {'top-1 flips':>11} | "
          f"{'sampled entropy (per seed)':>30}")
    for name in ("arithmetic", "gsm8k", "all"):
        for arm in tf_out[name]:
            t, s = tf_out[name][arm], smp_out[name][arm]
            seeds = ", ".join(f"{x:.3f}" for x in s["per_seed"])
            print(f"{arm:>15} {name:>10} | {t['entropy']:>10.4f} {t['kl_dense_to_arm']:>14.4f} "
                  f"{t['top1_flip_rate']:>11.2%} | {s['mean_entropy']:.4f} ({seeds})")
    plot(results, args.png)
    print(f"\nwrote {args.out}, {args.png} ({results['wall_seconds']} s)")


if __name__ == "__main__":
    main()
