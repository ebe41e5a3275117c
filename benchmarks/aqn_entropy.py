"""AQN on the offline default model: does the noise reach the sampling distribution, and how much survives bf16?

Measures, on SmolLM2-135M-Instruct (CPU):

1. rounding survival: the fraction of N(0, σ²) noise on the model's own RMSNorm weights that survives storage in
   bf16 / fp16 (``aqn.measure_rounding_survival``), σ ∈ {1e-4, 1e-3, 1e-2};
2. fp32 model, sampled completions: 16 chat-template arithmetic prompts, temperature 1.0, no top-k/top-p, 32 new
   tokens, per-step noise (one draw per generate call) at σ ∈ {0, 1e-3, 1e-2}, 3 repeats (noise seed = sampling
   seed = repeat index); mean token entropy of the sampling distribution over generated tokens (through the first
   EOS). Plus per-forward resampling at σ = 1e-2;
3. teacher-forced on the σ = 0 completions (same tokens for every σ, so sampling luck drops out): mean entropy,
   KL(clean ‖ noisy) and top-1 flip rate, for the fp32 model and for a bf16 model with bf16 norm weights vs with
   ``norm_dtype=torch.float32``, σ ∈ {1e-4, 1e-3, 1e-2}, 3 noise seeds.

Writes ``benchmarks/results/aqn_entropy.json`` and (``--plot``, on by default) ``docs/aqn_schedules.png``.

    uv run python benchmarks/aqn_entropy.py            # ~3-4 min on 2 CPU cores
    uv run python benchmarks/aqn_entropy.py --plot-only
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
import warnings
from pathlib import Path

import aqn
import torch
from common.entropy import compare, entropy_of, mean_dicts, sample, teacher_forced_logits
from common.env import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DATE = datetime.date.today().isoformat()  # the day the script runs
SIGMAS = (0.0, 1e-3, 1e-2)
TF_SIGMAS = (1e-4, 1e-3, 1e-2)
PROMPTS = [
    "What is 17 + 25?",
    "What is 9 times 7?",
    "What is 100 minus 37?",
    "What is 144 divided by 12?",
    "If I have 3 apples and buy 5 more, how many apples do I have?",
    "What is 15% of 200?",
    "What is 2 to the power of 10?",
    "What is the square root of 81?",
    "A train travels 60 km in one hour. How far does it go in 3 hours?",
    "What is 1234 + 4321?",
    "What is half of 98?",
    "How many minutes are in 2 hours?",
    "What is 7 + 8 + 9?",
    "What is 56 divided by 8?",
    "If a pencil costs 3 dollars, how much do 4 pencils cost?",
    "What is 11 squared?",
]


# ------------------------------------------------------------------------------------------------ schedules plot
def plot_schedules(path: Path, total_steps: int = 600, num_stages: int = 10, a: float = 1e-2, b: float = 1e-4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "exponential": "tab:red",
        "linear": "tab:blue",
        "cosine": "tab:green",
        "logarithmic": "tab:purple",
        "constant": "tab:gray",
    }
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    steps = list(range(total_steps))
    for ax, reach_end in zip(axes, (False, True)):
        ref = aqn.make_schedule("linear", a, b, num_stages, total_steps, reach_end=reach_end)
        bounds = ref.stage_bounds()
        ax.axvspan(0, bounds[0][1], color="0.92", zorder=0)
        ax.text(
            bounds[0][1] / 2,
            1.2e-3,
            "stage 0: σ = 0 (quantization noise only)",
            ha="center",
            va="center",
            rotation=90,
            fontsize=8,
        )
        for k, (start, _) in enumerate(bounds):
            if k:
                ax.axvline(start, color="0.7", lw=0.8, ls=":", zorder=1)
            ax.text((start + bounds[k][1]) / 2, 2.6e-2, str(k), ha="center", fontsize=8, color="0.4")
        for kind in aqn.SCHEDULE_KINDS:
            s = aqn.make_schedule(kind, a, b, num_stages, total_steps, reach_end=reach_end)
            ys = [s.sigma(t) if s.sigma(t) > 0 else float("nan") for t in steps]
            label = kind if kind != "constant" else "constant (σ_start at every step, stage 0 too)"
            lw, ls = (2.4, "-") if kind == "exponential" else (1.5, "--" if kind == "constant" else "-")
            ax.plot(steps, ys, drawstyle="steps-post", color=colors[kind], lw=lw, ls=ls, label=label, zorder=3)
        ax.axhline(b, color="k", lw=0.6, ls="--")
        ax.text(total_steps * 0.99, b * 1.08, f"σ_end = {b:g}", ha="right", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(2e-5, 4e-2)
        ax.set_xlim(0, total_steps)
        ax.set_xlabel("training step")
        rule = "t_k = (k-1)/(K-1)  (paper, default)" if not reach_end else "t_k = (k-1)/(K-2)  (reach_end=True)"
        ax.set_title(rule, fontsize=10)
        ax.grid(True, which="major", axis="y", alpha=0.3)
    axes[0].set_ylabel("σ of the norm-weight noise (log scale)")
    axes[0].legend(loc="lower left", fontsize=9, bbox_to_anchor=(0.11, 0.0))
    fig.suptitle(
        f"AQN σ schedules: K = {num_stages} equal stages over {total_steps} steps (stage numbers on top), "
        f"σ_start = {a:g}, σ_end = {b:g}",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ measurement
def _compare(clean: torch.Tensor, noisy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return compare(clean, noisy, mask, kl_key="kl_clean_to_noisy", logit_delta=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True, help="write docs/aqn_schedules.png")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this size on 2 cores)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "aqn_entropy.json")
    args = ap.parse_args()

    if args.plot or args.plot_only:
        png = ROOT / "docs" / "aqn_schedules.png"
        plot_schedules(png)
        print(f"wrote {png}")
    if args.plot_only:
        return

    import transformers
    from nvfp4.offline import OFFLINE_DEFAULT_NAME, offline_default_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    t_start = time.time()
    path = offline_default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    # the converted tokenizer reports <|im_start|> as eos; the chat turn ends with <|im_end|> (generation_config: 2)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    tok.pad_token = "<|im_end|>"
    tok.padding_side = "left"
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True, padding=True)
    enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    noise = aqn.NormNoise(model)
    norm_w = torch.cat([p.detach().flatten() for p in noise.params.values()])
    results: dict = {
        "date": DATE,
        "model": OFFLINE_DEFAULT_NAME,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_name(),
        "threads": args.threads,
        "setup": {
            "prompts": len(PROMPTS),
            "new_tokens": args.new_tokens,
            "temperature": 1.0,
            "top_k": None,
            "top_p": 1.0,
            "repeats": args.repeats,
            "noise_mode": "per_step (one draw per generate call) unless stated",
            "noised_norms": len(noise.params),
            "noised_channels": int(norm_w.numel()),
        },
        "norm_weights": {
            "median_abs": float(norm_w.abs().median()),
            "min_abs": float(norm_w.abs().min()),
            "max_abs": float(norm_w.abs().max()),
            "fraction_abs_below_0.1": float((norm_w.abs() < 0.1).double().mean()),
            "fraction_negative": float((norm_w < 0).double().mean()),
        },
    }

    # 1. rounding survival on the model's own norm weights
    surv = {}
    for dt in (torch.bfloat16, torch.float16):
        for s in TF_SIGMAS:
            runs = [aqn.measure_rounding_survival(norm_w, s, dt, seed=r) for r in range(3)]
            surv[f"{str(dt).removeprefix('torch.')}@{s:g}"] = mean_dicts(runs)
    for dt in (torch.bfloat16, torch.float16):  # reference: weights exactly 1 (Qwen / Llama norms sit nearer 1)
        for s in TF_SIGMAS:
            runs = [aqn.measure_rounding_survival(torch.ones_like(norm_w), s, dt, seed=r) for r in range(3)]
            surv[f"{str(dt).removeprefix('torch.')}@{s:g} (w=1)"] = mean_dicts(runs)
    results["rounding_survival"] = surv
    print("\nnoise surviving storage of w + Z (SmolLM2 norm weights, 3 seeds)")
    print(f"{'dtype':>9} {'sigma':>13} {'channels changed':>17} {'retained':>9} {'rel. error':>10}")
    for key, v in surv.items():
        dt, s = key.split("@")
        print(f"{dt:>9} {s:>13} {v['fraction_changed']:>17.1%} {v['retained']:>9.3f} {v['relative_error']:>10.3f}")

    timings = {}
    t0 = time.time()
    # 2. fp32 sampled completions
    sampled = {}
    clean_completions = None
    for s in SIGMAS:
        runs = []
        for r in range(args.repeats):
            with noise.apply(s, seed=r, step=0):
                comp, mask, logits = sample(model, enc, eos_id, args.new_tokens, seed=r)
            runs.append({"entropy": float(entropy_of(logits)[mask].mean()), "tokens": int(mask.sum())})
            if s == 0 and r == 0:
                clean_completions = (comp, mask)
        ents = [x["entropy"] for x in runs]
        sampled[f"{s:g}"] = {
            "mean_entropy": sum(ents) / len(ents),
            "per_repeat": ents,
            "tokens": sum(x["tokens"] for x in runs),
        }
        print(f"sampled fp32 σ={s:g}: mean entropy {sampled[f'{s:g}']['mean_entropy']:.4f} nats  {ents}")
    runs = []
    for r in range(args.repeats):
        with noise.apply_per_forward(1e-2, seed=r, step=0):
            _, mask, logits = sample(model, enc, eos_id, args.new_tokens, seed=r)
        runs.append(float(entropy_of(logits)[mask].mean()))
    sampled["0.01/per_forward"] = {"mean_entropy": sum(runs) / len(runs), "per_repeat": runs}
    print(f"sampled fp32 σ=0.01 per-forward: mean entropy {sum(runs) / len(runs):.4f}  {runs}")
    results["sampled_fp32"] = sampled
    timings["sampled_fp32_s"] = round(time.time() - t0, 1)
    t0 = time.time()

    # 3. teacher-forced on the σ = 0 completions
    assert clean_completions is not None
    comp, mask = clean_completions
    tf: dict = {}
    clean_logits = teacher_forced_logits(model, enc, comp, mask)
    tf["fp32"] = {"0": _compare(clean_logits, clean_logits, mask)}
    for s in TF_SIGMAS:
        runs = []
        for r in range(3):
            with noise.apply(s, seed=r, step=0):
                runs.append(_compare(clean_logits, teacher_forced_logits(model, enc, comp, mask), mask))
        tf["fp32"][f"{s:g}"] = mean_dicts(runs)
    fp32_clean = clean_logits
    timings["teacher_forced_fp32_s"] = round(time.time() - t0, 1)
    t0 = time.time()
    model = model.to(torch.bfloat16)
    for label, norm_dtype in (("bf16, bf16 norms", None), ("bf16, fp32 norms (norm_dtype=float32)", torch.float32)):
        nn_ = aqn.NormNoise(model, norm_dtype=norm_dtype, warn_lossy=False)
        with nn_.apply(0.0):
            base = teacher_forced_logits(model, enc, comp, mask)
        tf[label] = {"0": _compare(base, base, mask)}
        tf[label]["0"]["kl_fp32_to_this"] = _compare(fp32_clean, base, mask)["kl_clean_to_noisy"]
        for s in TF_SIGMAS:
            runs = []
            for r in range(3):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with nn_.apply(s, seed=r, step=0) as h:
                        st = h.survival()
                        row = _compare(base, teacher_forced_logits(model, enc, comp, mask), mask)
                row["weight_noise_retained"] = st["retained"]
                runs.append(row)
            tf[label][f"{s:g}"] = mean_dicts(runs)
    results["teacher_forced"] = tf
    timings["teacher_forced_bf16_s"] = round(time.time() - t0, 1)
    results["timings"] = timings
    print(timings)
    results["teacher_forced_note"] = (
        "same tokens (the σ=0 fp32 completions of repeat 0) scored under noise; KL and flips are against the clean "
        "model of the same configuration; 3 noise seeds averaged"
    )
    print("\nteacher-forced on the σ=0 completions (3 noise seeds)")
    print(
        f"{'model':>38} {'sigma':>7} {'entropy':>8} {'KL(clean||noisy)':>17} {'top-1 flips':>11} {'w noise kept':>12}"
    )
    for label, rows in tf.items():
        for s, v in rows.items():
            kept = v.get("weight_noise_retained", float("nan"))
            print(
                f"{label:>38} {s:>7} {v['entropy']:>8.4f} {v['kl_clean_to_noisy']:>17.2e} "
                f"{v['top1_flip_rate']:>11.2%} {kept:>12.3f}"
            )
    results["wall_seconds"] = round(time.time() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out} ({results['wall_seconds']} s)")


if __name__ == "__main__":
    main()
