"""The run directory: ``metrics.jsonl`` (one line per logged step) and PNG plots of reward, entropy, σ and length.

Layout of ``output_dir``::

    metrics.jsonl          every TRL log line, with "step"; appended, so a resumed run continues the same file
    plots.png              reward / entropy / σ / completion length per step (rewritten at each save and at the end)
    recipe.yaml            the recipe and command-line overrides of the last ``qerl train`` here, a recipe it reads back
    checkpoint-N/          adapter, optimizer, RNG, trainer state, aqn_state.json (renamed into place whole)
    final/                 the trained LoRA adapter and tokenizer
    calibrated/            nvfp4-awq / nvfp4-gptq: the calibrated policy, reused by a resumed or repeated run
    .previous-run-*/       with --overwrite_output_dir: the earlier run, until this one writes its first checkpoint
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from .memory import trim_malloc
from .validation import PREVIOUS_RUN_PREFIX

__all__ = [
    "ReplacedRunCallback",
    "RunDirectoryCallback",
    "discard_replaced_run",
    "move_earlier_run_aside",
    "plot_metrics",
    "read_metrics",
]

METRICS_NAME = "metrics.jsonl"
#: ``calibration_cache_dir``'s default folder inside ``output_dir`` (the calibrated awq / gptq policies)
CALIBRATED_DIR = "calibrated"
PLOT_NAME = "plots.png"
# (title, metric keys tried in order)
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("reward (mean ± std)", ("reward",)),
    ("mean token entropy", ("entropy",)),
    ("AQN σ", ("aqn/sigma",)),
    ("completion length", ("completions/mean_length",)),
]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl``, one per step, of the run as it went on last: a step logged again (a resumed run)
    replaces that step's line and every later step's (the abandoned run's, past the checkpoint it was resumed from),
    until logged again in turn. A line that is not JSON (cut short by a crash mid-write) is skipped."""
    rows: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and "step" in row and "reward" in row:
                    step = int(row["step"])
                    for later in [k for k in rows if k > step]:  # a step again: a resume, the later steps abandoned
                        del rows[later]
                    rows[step] = row
    return [rows[k] for k in sorted(rows)]


def plot_metrics(metrics_path: str | Path, out_path: str | Path, title: str | None = None) -> Path:
    """Draw the four panels of :data:`PANELS` from ``metrics.jsonl`` into a PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), constrained_layout=True)
    for ax, (name, keys) in zip(axes.flat, PANELS):
        key = next((k for k in keys if any(k in r for r in rows)), None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key is None:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        pts = [(r["step"], r[key]) for r in rows if key in r]
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", ms=3)
        if key == "reward" and all("reward_std" in r for r in rows):
            lo = [r["reward"] - r["reward_std"] for r in rows]
            hi = [r["reward"] + r["reward_std"] for r in rows]
            ax.fill_between([r["step"] for r in rows], lo, hi, alpha=0.2)
    if title:
        fig.suptitle(title)
    out_path = Path(out_path)
    tmp = out_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out_path)
    return out_path


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


class MallocTrimCallback(TrainerCallback):
    """:func:`qerl_trl.memory.trim_malloc` when training starts (the model loaded and quantized) and after every
    optimizer step, so that host memory freed in small blocks leaves the process. ``qerl train`` adds it."""

    def on_train_begin(self, args, state, control, **kwargs):
        trim_malloc()

    def on_step_end(self, args, state, control, **kwargs):
        trim_malloc()


class RunDirectoryCallback(TrainerCallback):
    """Appends every log to ``<output_dir>/metrics.jsonl`` and redraws ``plots.png`` at each save and at the end."""

    def __init__(self, title: str | None = None) -> None:
        self.title = title

    def _dir(self, args) -> Path:
        path = Path(args.output_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float, str))}}
        path = self._dir(args) / METRICS_NAME
        # after a crash mid-write the file may end in a partial line: start on a new one, so this row stays whole
        cut = path.is_file() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
        with open(path, "a") as f:
            f.write(("\n" if cut else "") + json.dumps(row) + "\n")

    def _plot(self, args, state) -> None:
        metrics = self._dir(args) / METRICS_NAME
        if state.is_world_process_zero and metrics.is_file() and read_metrics(metrics):
            plot_metrics(metrics, self._dir(args) / PLOT_NAME, self.title)

    def on_save(self, args, state, control, **kwargs):
        self._plot(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        self._plot(args, state)


def move_earlier_run_aside(output_dir: str | Path) -> Path | None:
    """``--overwrite_output_dir``: move what ``output_dir`` holds into a new ``.previous-run-*`` folder inside it (one
    rename per entry, same filesystem), so the new run starts in an empty folder while the earlier one still exists;
    :func:`discard_replaced_run` removes it once the new run has a checkpoint. None when there was nothing. The
    calibrated policy cache (:data:`CALIBRATED_DIR`) is left in place for the new run."""
    root = Path(output_dir)
    # the calibrated policy cache stays: keyed by model, method and prompts, the new run loads it if it is its own
    entries = [p for p in (root.iterdir() if root.is_dir() else ())
               if not p.name.startswith(PREVIOUS_RUN_PREFIX) and p.name != CALIBRATED_DIR]  # fmt: skip
    if not entries:
        return None
    aside = Path(tempfile.mkdtemp(prefix=PREVIOUS_RUN_PREFIX, dir=root))
    for entry in entries:
        os.rename(entry, aside / entry.name)
    return aside


def discard_replaced_run(output_dir: str | Path) -> None:
    """Remove the ``.previous-run-*`` folders of ``output_dir`` (:func:`move_earlier_run_aside`)."""
    for folder in Path(output_dir).glob(f"{PREVIOUS_RUN_PREFIX}*"):
        shutil.rmtree(folder, ignore_errors=True)


class ReplacedRunCallback(TrainerCallback):
    """With ``--overwrite_output_dir``: the earlier run goes once this one's first checkpoint is in place (never a
    moment with neither)."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            discard_replaced_run(args.output_dir)
