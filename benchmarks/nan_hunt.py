"""Find where a training run's non-finite gradients come from: train until the first such step, then take it apart.

Runs the GPU learning study's GSM8K bf16 + LoRA run (``learning_study.py --gpu``: batch 16, 4 generations, 256 new
tokens) with a callback that, at the first optimizer step whose gradients are not all finite, saves the batch
(``batch.pt``) and recomputes that step's loss + backward under variants: each SDPA backend alone, eager attention,
no gradient checkpointing, one sequence per forward, and each row alone. It records which variants give non-finite
gradients and the first modules with non-finite forward outputs, writes ``nan_hunt.json`` and exits.

Found with it (H100, torch 2.11): seed 0 went NaN at step 31 in every arm because of cuDNN's SDPA backward
(pytorch/pytorch#196678), now off in ``QeRLGRPOTrainer.training_step`` (``TRAINING_SDPA_BACKENDS``), which also stops
at such a step (``StopOnNonFiniteGradients``; the hunter replaces that callback here): ``--keep-cudnn`` lets the
training step pick cuDNN again, to reproduce the finding.

    python3 benchmarks/nan_hunt.py --seed 0 --steps 40 --keep-cudnn --out /tmp/nan_hunt   # on the GPU machine
    python3 benchmarks/nan_hunt.py --force --max-completion-length 8 --steps 1             # CPU smoke: step 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from learning_study import GSM8K_DIR, gpu_train_cmd  # noqa: E402


def _bad_grads(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]


class _Hunter(TrainerCallback):
    def __init__(self, trainer, out: Path, force: bool) -> None:
        self.trainer, self.out, self.force = trainer, out, force
        self.report: dict = {}

    def save(self) -> None:
        (self.out / "nan_hunt.json").write_text(json.dumps(self.report, indent=1) + "\n")

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not _bad_grads(model) and not self.force:
            return
        tr = self.trainer
        batch = tr._buffered_inputs[(tr._step - 1) % tr.args.steps_per_generation]
        cpu = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
        torch.save(cpu, self.out / "batch.pt")
        self.report.update(
            first_bad_step=state.global_step + 1,
            forced=self.force,
            batch_shapes={k: list(v.shape) for k, v in cpu.items() if torch.is_tensor(v)},
            prompt_lens=cpu["prompt_mask"].sum(1).tolist(),
            completion_lens=cpu["completion_mask"].sum(1).tolist(),
            advantages=cpu["advantages"].tolist(),
        )
        self.save()
        self.diagnose(tr.model, batch)
        self.save()
        print(json.dumps(self.report)[:4000], flush=True)
        control.should_training_stop = True
        model.zero_grad(set_to_none=True)  # the optimizer step that follows changes nothing
        self.report["stopped"] = True
        self.save()

    def variant(self, model, batch, name: str, ctx=None, setup=None, teardown=None) -> None:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        try:
            if setup:
                setup()
            with ctx if ctx is not None else contextlib.nullcontext():
                loss = self.trainer.compute_loss(model, batch)
                loss.backward()
            bad = _bad_grads(model)
            result = {"loss": loss.item(), "n_bad": len(bad), "bad": bad[:3],
                      "s": round(time.perf_counter() - start, 2)}  # fmt: skip
        except RuntimeError as e:  # a backend this device does not have
            result = {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            if teardown:
                teardown()
        self.report.setdefault("variants", {})[name] = result
        self.save()

    def diagnose(self, model, batch) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tr = self.trainer
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        attn = base.config._attn_implementation
        self.report.update(attn_implementation=attn, dtype=str(next(base.parameters()).dtype))
        nonfinite: list[dict] = []

        def hook(module, inputs, output, name=""):
            o = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(o) and o.is_floating_point() and len(nonfinite) < 12 and not torch.isfinite(o).all():
                rows = (~torch.isfinite(o)).flatten(1).any(1).nonzero().flatten().tolist()
                nonfinite.append({"module": name, "shape": list(o.shape), "rows": rows[:16]})

        hooks = [m.register_forward_hook(lambda m, i, o, n=n: hook(m, i, o, n)) for n, m in model.named_modules()]
        self.variant(model, batch, "as_is")
        for h in hooks:
            h.remove()
        self.report["nonfinite_forward_outputs"] = nonfinite
        for backend in ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION"):
            self.variant(model, batch, f"sdpa_{backend.lower()}", ctx=sdpa_kernel([getattr(SDPBackend, backend)]))
        self.variant(model, batch, "eager_attention", setup=lambda: base.set_attn_implementation("eager"),
                     teardown=lambda: base.set_attn_implementation(attn))  # fmt: skip
        if tr.args.gradient_checkpointing:
            self.variant(model, batch, "no_gradient_checkpointing", setup=model.gradient_checkpointing_disable,
                         teardown=lambda: model.gradient_checkpointing_enable(
                             gradient_checkpointing_kwargs=tr.args.gradient_checkpointing_kwargs))  # fmt: skip
        chunk = tr.args.logprob_batch_size
        self.variant(model, batch, "one_sequence_per_forward", setup=lambda: setattr(tr.args, "logprob_batch_size", 1),
                     teardown=lambda: setattr(tr.args, "logprob_batch_size", chunk))  # fmt: skip
        n = batch["prompt_ids"].shape[0]
        per_row = {}
        for i in range(n):  # the row keeps the batch's padding
            row = {k: (v[i : i + 1] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v) for k, v in batch.items()}
            model.zero_grad(set_to_none=True)
            tr.compute_loss(model, row).backward()
            per_row[i] = len(_bad_grads(model))
        self.report["per_row_n_bad"] = per_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=40, help="train at most this many steps")
    ap.add_argument("--out", type=Path, default=Path("/tmp/nan_hunt"))
    ap.add_argument("--data-path", type=Path, default=Path(os.environ.get("QERL_GSM8K", GSM8K_DIR)))
    ap.add_argument("--max-completion-length", type=int, default=None, help="default: the study's (256)")
    ap.add_argument("--force", action="store_true", help="diagnose the first step even if its gradients are finite")
    ap.add_argument("--keep-cudnn", action="store_true",
                    help="let the training step pick cuDNN SDPA and go on past NaN (the behaviour before the fix)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import qerl_trl.trainer as qt
    from qerl_trl.cli import build_trainer, parse_train_args

    cuda = torch.cuda.is_available()
    # the study's own command for this run (its CPU-smoke sizes without CUDA), minus checkpoints
    os.environ["QERL_GSM8K"] = str(args.data_path)
    cmd = gpu_train_cmd("gsm8k", "bf16+LoRA", args.seed, args.steps, [args.steps], args.out / "run", tiny=not cuda)
    argv = cmd[cmd.index("offline-default"):] + ["--save_strategy", "no"]
    if args.max_completion_length is not None:
        argv += ["--max_completion_length", str(args.max_completion_length)]
    script_args, config = parse_train_args(argv)
    if args.keep_cudnn:
        qt.TRAINING_SDPA_BACKENDS = [*qt.TRAINING_SDPA_BACKENDS, torch.nn.attention.SDPBackend.CUDNN_ATTENTION]
    trainer = build_trainer(script_args, config)  # `qerl train`'s own, before train()
    trainer.remove_callback(qt.StopOnNonFiniteGradients)  # the hunter takes the step apart instead
    hunter = _Hunter(trainer, args.out, args.force)
    hunter.report.update(seed=args.seed, keep_cudnn=args.keep_cudnn, torch=torch.__version__,
                         device=torch.cuda.get_device_name() if cuda else "cpu")  # fmt: skip
    trainer.add_callback(hunter)
    trainer.train()
    if "first_bad_step" not in hunter.report:
        hunter.report["finite_through_step"] = trainer.state.global_step
    hunter.save()
    print(f"written: {args.out / 'nan_hunt.json'}")


if __name__ == "__main__":
    main()
