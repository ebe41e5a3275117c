"""Aten ops in one GRPO loss forward + backward, by ``logprob_batch_size`` (issue #21's GSM8K runs).

Eager on a GPU every aten op costs a launch plus Python time whatever its size, so for a small model the op count
of the training half of a step sets its time. This counts them for a real ``qerl train offline-default`` step on
GSM8K (16 sequences = 4 prompts × 4 samples, bf16 + LoRA, gradient checkpointing as the recipe has it) with a
``TorchDispatchMode`` around ``compute_loss`` and around the ``backward`` (which holds the recomputed forwards).
Each setting runs in its own process; CPU is enough (the count does not depend on the device)::

    uv run python benchmarks/loss_op_count.py                       # logprob_batch_size 2 (recipe) and 16, ~3 min
    uv run python benchmarks/loss_op_count.py --sizes 2 4 16 --out benchmarks/results/loss_op_count.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

from learning_study import GSM8K_DIR  # this folder is the script's sys.path[0]


def count(size: int, data: Path, out_dir: Path) -> dict[str, int]:
    """In this process: one training step with ``logprob_batch_size=size``; aten ops of the loss forward, backward."""
    import qerl_trl.trainer as trainer_mod
    import torch
    from qerl_trl import cli
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    counts: dict[str, int] = {}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            with Count() as mode:
                result = fn(*args, **kwargs)
            counts[key] = mode.n
            return result

        return wrapper

    # counting wrappers for this process only (it exits after the one step)
    trainer_mod.QeRLGRPOTrainer.compute_loss = counted(trainer_mod.QeRLGRPOTrainer.compute_loss, "loss_forward")
    torch.Tensor.backward = counted(torch.Tensor.backward, "backward")
    cli.main(["train", "offline-default", "--output_dir", str(out_dir / f"lb{size}"), "--max_steps", "1",
              "--quantization", "none", "--aqn", "false", "--task", "gsm8k", "--task_options", "{}",
              "--data_path", str(data), "--per_device_train_batch_size", "16", "--num_generations", "4",
              "--max_completion_length", "8", "--save_strategy", "no", "--disable_tqdm", "true",
              "--logprob_batch_size", str(size)])  # fmt: skip
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 16])
    ap.add_argument("--data", type=Path, default=GSM8K_DIR, help="GSM8K folder (train.jsonl)")
    ap.add_argument("--runs", type=Path, default=Path("/tmp/loss_op_count"))
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: print only)")
    ap.add_argument("--_one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._one is not None:
        print("COUNTS " + json.dumps(count(args._one, args.data, args.runs)))
        return
    rows = []
    for size in args.sizes:
        proc = subprocess.run([sys.executable, __file__, "--_one", str(size), "--data", str(args.data), "--runs",
                               str(args.runs)], capture_output=True, text=True)  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("COUNTS ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"logprob_batch_size {size}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
        c = json.loads(line.removeprefix("COUNTS "))
        rows.append({"logprob_batch_size": size, **c, "total": c["loss_forward"] + c["backward"]})
    print("| logprob_batch_size | loss forward ops | backward ops | total |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['logprob_batch_size']} | {r['loss_forward']} | {r['backward']} | {r['total']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        import torch
        import transformers
        import trl

        settings = ("qerl train offline-default, 1 step, GSM8K, bf16 + LoRA r=32, 16 sequences (4 prompts x 4), "
                    "8-token completions, gradient checkpointing on; ops counted with a TorchDispatchMode")
        meta = {"benchmark": "loss_op_count", "issue": 21, "device": f"CPU ({platform.machine()})",
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                             "trl": trl.__version__}, "settings": settings}  # fmt: skip
        args.out.write_text(json.dumps(meta | {"rows": rows}, indent=1) + "\n")
        print(f"written: {args.out}")


if __name__ == "__main__":
    main()
