"""Where the training half of a GRPO step spends its time (issue #7): forward + backward per arm, kernel time by
category.

``benchmarks/grpo_step.py`` times the loss forward and the backward of a real GRPO step; this script explains them.
Same models and arms (``common.models.build_model``: random weights with the real Qwen2.5 shapes, LoRA r=32 on all 7
projections), the model in train mode with gradient checkpointing (non-reentrant) as the trainer runs it, a batch of
``--batch`` sequences of ``--seq-len`` tokens (group 8 × (prompt 256 + 1024 completion) by default), and TRL's loss
shape: per-token log-probabilities of the next token (``selective_log_softmax`` over the full vocabulary), their
mean, backward into the LoRA weights. Per arm, in a fresh process: two warm-up iterations, then the median of
``--iters`` timed forwards and backwards (CUDA-synchronised), then ``torch.profiler`` over one more forward +
backward: GPU kernel time per category (as ``decode_profile.py``), the ten costliest kernels, the number of kernels
launched, and ``idle`` = wall − kernel time.

Usage::

    uv run python benchmarks/train_profile.py --tiny                                  # CPU smoke test
    python3 benchmarks/train_profile.py --model 7b --arms nvfp4,bf16 --out $OUT/train_profile_7b.json   # H100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import common  # noqa: F401  (the workspace packages on sys.path)
from common.env import csv_list, gb, sync
from common.models import ARM_LABEL, ARMS, build_model
from common.profiler import CATEGORY_COLUMNS, category, kernel_times, run_arms
from common.shapes import MODELS


def _loss(model, ids):
    """TRL's per-token log-prob loss shape: log p(next token) over the full vocabulary, averaged."""
    import torch

    logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.gather(logits.log_softmax(-1), -1, ids[:, 1:, None]).squeeze(-1)
    return -logp.mean()


def run_worker(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    res: dict = {"model": args.model, "arm": args.arm, "label": ARM_LABEL[args.arm], "batch": args.batch,
                 "seq_len": args.seq_len}  # fmt: skip
    model, info = build_model(
        args.model, args.arm, device, dtype, lora_r=32, lora_dtype=dtype, double_quant=True, nvfp4_method="rtn"
    )
    res.update(info)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    res["trainable_params"] = sum(p.numel() for p in trainable)
    ids = torch.randint(0, MODELS[args.model]["vocab_size"], (args.batch, args.seq_len), device=device)

    def step() -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        loss = _loss(model, ids)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        for p in trainable:
            p.grad = None
        return t1 - t0, t2 - t1

    loss = _loss(model, ids)
    loss.backward()
    res["lora_grads_nonzero"] = sum(int(p.grad is not None and bool(p.grad.abs().sum() > 0)) for p in trainable)
    res["lora_tensors"] = len(trainable)
    for p in trainable:
        p.grad = None
    step()
    times = [step() for _ in range(args.iters)]
    res["forward_s"] = round(statistics.median(t[0] for t in times), 4)
    res["backward_s"] = round(statistics.median(t[1] for t in times), 4)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    kernels = kernel_times(prof)
    total = sum(k["us"] for k in kernels.values())
    by_cat: dict[str, float] = {}
    for name, k in kernels.items():
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + k["us"]
    res["profiled_wall_s"] = round(wall, 4)
    res["kernels_s"] = round(total / 1e6, 4)
    res["kernel_launches"] = sum(k["calls"] for k in kernels.values())
    res["by_category_s"] = {c: round(v / 1e6, 4) for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    res["top_kernels"] = [
        {"kernel": n[:120], "s": round(k["us"] / 1e6, 4), "calls": k["calls"], "category": category(n)}
        for n, k in sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:10]
    ]
    if cuda:
        res["peak_gpu_gb"] = gb(torch.cuda.max_memory_allocated(device))
    res["status"] = "ok"
    return res


def table(results: list[dict]) -> str:
    head = (
        "| model | arm | tokens | fwd s | bwd s | fwd+bwd s | kernels s | idle s | "
        + " | ".join(CATEGORY_COLUMNS)
        + " | launches | peak GPU GB |\n|---|---|---:|"
        + "---:|" * (8 + len(CATEGORY_COLUMNS))
    )
    rows = []
    for r in results:
        if r.get("status") != "ok":
            rows.append(f"| {r.get('model')} | {r.get('arm')} | {r.get('status')} |")
            continue
        cats = r["by_category_s"]
        rows.append(
            f"| {r['model']} | {r['label']} | {r['batch']}×{r['seq_len']} | {r['forward_s']:.3f} | "
            f"{r['backward_s']:.3f} | {r['forward_s'] + r['backward_s']:.3f} | {r['kernels_s']:.3f} | "
            f"{r['profiled_wall_s'] - r['kernels_s']:.3f} | "
            + " | ".join(f"{cats.get(c, 0.0):.3f}" for c in CATEGORY_COLUMNS)
            + f" | {r['kernel_launches']} | {r.get('peak_gpu_gb', '-')} |"
        )
    return "\n".join([head, *rows])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="7b", choices=sorted(MODELS))
    p.add_argument("--arms", type=csv_list, default=["nvfp4", "bf16"])
    p.add_argument("--batch", type=int, default=8, help="sequences (GRPO group)")
    p.add_argument("--seq-len", type=int, default=1280, help="tokens per sequence (prompt + completion)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations (median)")
    p.add_argument("--out", default="benchmarks/results/train_profile.json")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short sequences")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.cpu, args.batch, args.seq_len, args.iters = "tiny", True, 2, 16, 1
        args.arms = [a for a in args.arms if a != "qlora"]
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        p.error(f"unknown arms {bad}; choose from {ARMS}")
    if args.worker:
        args.arm = args.worker
        Path(args.worker_out).write_text(json.dumps(run_worker(args)))
        return
    def worker_cmd(arm: str, part: Path) -> list[str]:
        cmd = [sys.executable, __file__, "--worker", arm, "--worker-out", str(part), "--model", args.model,
               "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--iters", str(args.iters)]  # fmt: skip
        return cmd + ["--cpu"] * args.cpu

    results = run_arms(args, "train_profile", worker_cmd)
    print(table(results))
    for r in results:
        for k in r.get("top_kernels", []):
            print(f"  {r['arm']:6s} {k['s']:8.4f} s {k['calls']:6d}× [{k['category']}] {k['kernel']}")


if __name__ == "__main__":
    main()
