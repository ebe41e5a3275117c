"""Where a step of ``qerl train`` spends its time and page faults, by phase (issue #37).

Builds the trainer exactly as ``qerl train`` does (same recipe parsing, callbacks and glibc settings:
``qerl_trl.cli.parse_train_args`` / ``build_trainer``), runs the first ``--steps`` optimizer steps of the run (the
recipe's ``max_steps`` is kept, so the AQN schedule and learning rate are the real run's; training is stopped after
``--steps``), and charges every moment of each step to exactly one phase:

=================  ==============================================================================================
``generation``     the rollout engine (``_generate_turn``: transformers ``generate`` on CPU), AQN excluded
``aqn``            putting the AQN noise on the norms and restoring them (enter / exit of ``_rollout_noise``)
``rewards``        the reward functions (``_calculate_rewards``)
``old_ref_logps``  log-probs scored outside the loss (old policy / reference model; none with the default recipe)
``rollout_other``  the rest of ``_generate_and_score_completions`` (tokenizing, padding, advantages)
``loss_forward``   ``compute_loss``: the policy's forward over the batch and the GRPO loss
``backward``       ``accelerator.backward`` (with gradient checkpointing: the recomputed forward too)
``grad_clip``      ``_clip_grad_norm``
``optimizer``      from ``on_pre_optimizer_step`` to ``on_optimizer_step`` (the non-finite check and ``step``)
``logging``        ``Trainer.log`` (TRL's metrics, ``metrics.jsonl``)
``checkpoint``     ``_save_checkpoint``
``step_end``       the ``on_step_end`` callbacks (``malloc_trim`` on CPU)
``other``          everything else between ``on_step_begin`` and the next step's
=================  ==============================================================================================

Per phase and step: wall seconds, user and system CPU seconds and minor / major page faults
(``resource.getrusage(RUSAGE_SELF)``, all threads), and the process's ``VmHWM`` (peak RSS) at the end of each step
(``/proc/self/status``). Writes JSON.

Usage::

    uv run python benchmarks/train_phases.py --steps 2 --out benchmarks/results/train_phases.json
    uv run python benchmarks/train_phases.py --steps 1 --out /tmp/p.json -- --logprob_batch_size 4   # recipe overrides
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (the workspace packages on sys.path)
from common.env import git_commit

PHASES = ("generation", "aqn", "rewards", "old_ref_logps", "rollout_other", "loss_forward", "backward", "grad_clip",
          "optimizer", "logging", "checkpoint", "step_end", "other")  # fmt: skip
FIELDS = ("wall_s", "user_s", "sys_s", "minflt", "majflt")


def _counters() -> tuple[float, ...]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), ru.ru_utime, ru.ru_stime, ru.ru_minflt, ru.ru_majflt


def proc_status_kib(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PhaseClock:
    """Charges elapsed wall / CPU time and page faults to the innermost open phase (a stack; the base is ``other``)."""

    def __init__(self) -> None:
        self.stack = ["other"]
        self.last = _counters()
        self.totals: dict[str, list[float]] = {p: [0.0] * len(FIELDS) for p in PHASES}

    def _charge(self) -> None:
        now = _counters()
        acc = self.totals[self.stack[-1]]
        for i, (a, b) in enumerate(zip(now, self.last)):
            acc[i] += a - b
        self.last = now

    def enter(self, phase: str) -> None:
        self._charge()
        self.stack.append(phase)

    def exit(self) -> None:
        self._charge()
        self.stack.pop()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def take(self) -> dict[str, dict[str, float]]:
        """The totals since the last ``take`` (charging the open phase up to now), then reset."""
        self._charge()
        out = {p: dict(zip(FIELDS, (round(v, 4) if isinstance(v, float) else v for v in vals)))
               for p, vals in self.totals.items()}  # fmt: skip
        for p in out:
            for k in ("minflt", "majflt"):
                out[p][k] = int(out[p][k])
        self.totals = {p: [0.0] * len(FIELDS) for p in PHASES}
        return out


def _wrap(obj: Any, attr: str, clock: PhaseClock, phase: str, when=None) -> None:
    """Time ``obj.attr(...)`` as ``phase`` (an instance attribute shadowing the method; ``when()`` False: untimed)."""
    inner = getattr(obj, attr)

    def timed(*args, **kwargs):
        if when is not None and not when():
            return inner(*args, **kwargs)
        with clock.phase(phase):
            return inner(*args, **kwargs)

    setattr(obj, attr, timed)


def instrument(trainer: Any, clock: PhaseClock, steps: int, records: list[dict], on_record=None) -> None:
    """Wrap the trainer's phases (see the module docstring) and stop training after ``steps`` optimizer steps;
    ``on_record()`` is called after each step's record is appended."""
    from transformers import TrainerCallback

    _wrap(trainer, "_generate_and_score_completions", clock, "rollout_other")
    _wrap(trainer, "_generate_turn", clock, "generation")
    _wrap(trainer, "_calculate_rewards", clock, "rewards")
    _wrap(trainer, "_get_per_token_logps_and_entropies", clock, "old_ref_logps",
          when=lambda: clock.stack[-1] == "rollout_other")  # fmt: skip
    _wrap(trainer, "compute_loss", clock, "loss_forward")
    _wrap(trainer.accelerator, "backward", clock, "backward")
    _wrap(trainer, "_clip_grad_norm", clock, "grad_clip")
    _wrap(trainer, "log", clock, "logging")
    _wrap(trainer, "_save_checkpoint", clock, "checkpoint")

    noise = trainer._rollout_noise

    @contextlib.contextmanager
    def timed_noise():
        with clock.phase("aqn"):
            ctx = noise()
            ctx.__enter__()
        try:
            yield
        finally:
            with clock.phase("aqn"):
                ctx.__exit__(None, None, None)

    trainer._rollout_noise = timed_noise

    class Clock(TrainerCallback):
        """A step runs from one ``on_step_begin`` to the next (or ``on_train_end``): the logging and checkpointing
        of step N come after its ``on_step_end``."""

        start: float | None = None

        def _close(self, state) -> None:
            if self.start is None:
                clock.take()  # drop what came before the first step (setup)
                return
            records.append({
                "step": state.global_step,
                "wall_s": round(time.perf_counter() - self.start, 3),
                "vm_hwm_kib": proc_status_kib("VmHWM"),
                "vm_rss_kib": proc_status_kib("VmRSS"),
                "phases": clock.take(),
            })  # fmt: skip
            if on_record is not None:
                on_record()

        def on_step_begin(self, args, state, control, **kwargs):
            self._close(state)
            self.start = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self._close(state)
            self.start = None

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            clock.enter("optimizer")

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= steps:
                control.should_training_stop = True

    class OptimizerEnd(TrainerCallback):  # last: closes "optimizer" after every other on_optimizer_step callback
        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.exit()

    handler = trainer.callback_handler
    handler.callbacks.insert(0, Clock())  # first: "optimizer" opens before the non-finite check; the step closes
    for cb in handler.callbacks:  # before the run directory's on_train_end plot
        if type(cb).__name__ == "MallocTrimCallback":
            _wrap(cb, "on_step_end", clock, "step_end")
    trainer.add_callback(OptimizerEnd())


def summarize(records: list[dict], skip_first: bool) -> dict[str, dict[str, float]]:
    """Mean per step of every phase's fields (over all steps, or all but the first when there are several)."""
    rows = records[1:] if skip_first and len(records) > 1 else records
    out = {}
    for p in PHASES:
        out[p] = {k: round(sum(r["phases"][p][k] for r in rows) / len(rows), 3) for k in FIELDS}
    out["step"] = {k: round(sum(out[p][k] for p in PHASES), 3) for k in FIELDS}
    return out


def print_table(summary: dict[str, dict[str, float]]) -> None:
    print(f"{'phase':15s} {'wall s':>8s} {'user s':>8s} {'sys s':>8s} {'minflt':>10s}")
    for p, v in summary.items():
        if v["wall_s"] >= 0.0005 or p == "step":
            print(f"{p:15s} {v['wall_s']:8.3f} {v['user_s']:8.3f} {v['sys_s']:8.3f} {int(v['minflt']):10d}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps to profile (of the recipe's max_steps)")
    ap.add_argument("--recipe", default="offline-default")
    ap.add_argument("--out", type=Path, default=None, help="JSON file to write")
    ap.add_argument("--mmap-threshold", type=int, default=None,
                    help="glibc mmap threshold in bytes (default: the one `qerl train` pins)")  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="recipe overrides after --, as for qerl train")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")

    from qerl_trl.memory import TRAIN_MMAP_THRESHOLD, pin_malloc_mmap_threshold

    # as `qerl train` does, before the model loads (or the threshold to try)
    pin_malloc_mmap_threshold(TRAIN_MMAP_THRESHOLD if args.mmap_threshold is None else args.mmap_threshold)
    import torch
    from qerl_trl.cli import build_trainer, parse_train_args

    clock = PhaseClock()
    setup = _counters()
    result: dict = {
        "what": "phases of the first optimizer steps of `qerl train` (benchmarks/train_phases.py)",
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "recipe": args.recipe,
        "overrides": args.overrides,
        "mmap_threshold": args.mmap_threshold,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    records: list[dict] = []

    def write() -> None:
        result["load_avg"] = os.getloadavg()
        result["peak_rss_kib"] = proc_status_kib("VmHWM")
        result["mean_per_step"] = summarize(records, False)  # every step so far
        if len(records) > 1:
            result["mean_per_step_excluding_first"] = summarize(records, True)
        result["steps"] = records
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        overrides = list(args.overrides)
        if "--output_dir" not in overrides:
            overrides += ["--output_dir", tmp]
        script_args, config = parse_train_args([args.recipe, "--disable_tqdm", "true", *overrides])
        trainer = build_trainer(script_args, config)
        now = _counters()
        result["setup"] = dict(zip(FIELDS, (round(a - b, 3) for a, b in zip(now, setup))))
        instrument(trainer, clock, args.steps, records, on_record=write)
        trainer.train()
    write()
    print_table(result.get("mean_per_step_excluding_first", result["mean_per_step"]))
    print(f"setup {result['setup']}; peak RSS {result['peak_rss_kib']} KiB; load {result['load_avg']}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
