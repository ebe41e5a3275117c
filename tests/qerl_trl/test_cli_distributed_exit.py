"""``qerl train`` as 2 CPU processes over gloo (``accelerate launch`` with the shipped DDP config), 1 GRPO step of the
tiny policy: a finished run ends cleanly.

A finished multi-process run could abort at interpreter exit ("terminate called without an active exception":
gloo's threads in the C++ teardown, pytorch#190489), now and then (not seen in 5 such runs here; seen in CI). So
``qerl train`` leaves a finished distributed run with ``os._exit(0)`` once everything is written; this checks that
path is the one taken and that it skips nothing the run does at exit: exit code 0 from both ranks, the run's files,
and what Python does at exit before its C++ teardown still happens first: the non-daemon threads are joined (an
upload in flight) and the exit functions run (``atexit``: wandb finishes its run there).

This file is also the worker: ``accelerate launch ... tests/qerl_trl/test_cli_distributed_exit.py MARKS_DIR
[qerl arguments]`` runs ``qerl`` (:func:`qerl_trl.cli.main`) and writes to ``MARKS_DIR/rank<R>.txt`` what happened
as the process ended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DDP_CONFIG = REPO / "recipes" / "accelerate" / "ddp.yaml"


def worker(marks: Path, argv: list[str]) -> None:
    import atexit
    import threading

    def mark(line: str) -> None:
        with open(marks / f"rank{os.environ['RANK']}.txt", "a") as f:
            f.write(line + "\n")

    def at_shutdown() -> None:  # a non-daemon thread that works until the interpreter's shutdown (an upload, say)
        threading.main_thread().join()  # returns once the shutdown has begun
        mark("thread")

    threading.Thread(target=at_shutdown).start()
    atexit.register(mark, "atexit")
    os_exit = os._exit

    def traced_exit(code: int) -> None:
        mark(f"os._exit({code})")
        os_exit(code)

    os._exit = traced_exit
    import qerl_trl.cli
    from qerl_trl.cli import main

    if os.environ.get("FAIL_AFTER_TRAINING"):  # a run that fails once it has trained, on every rank, the group up
        train_and_save = qerl_trl.cli._train_and_save

        def failing(*args, **kwargs):
            train_and_save(*args, **kwargs)
            raise RuntimeError("failed after training")

        qerl_trl.cli._train_and_save = failing

    main(argv)
    mark("main returned")  # the interpreter's own teardown follows, where gloo's threads can abort the process


def _launch(out: Path, marks: Path, tiny_dir: Path, **env_vars: str) -> subprocess.CompletedProcess:
    """``qerl train``, 1 step of the tiny policy, as 2 gloo processes under ``accelerate launch`` (this file the worker)."""
    from ports import free_port

    marks.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO / "tests"),
           **env_vars}  # fmt: skip
    env.pop("QERL_DEBUG", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG), "--num_processes", "2",
           "--mixed_precision", "no", "--main_process_port", str(free_port()), __file__, str(marks),
           "train", "offline-default", "--model_name_or_path", str(tiny_dir), "--output_dir", str(out),
           "--per_device_train_batch_size", "4", "--num_generations", "4", "--gradient_accumulation_steps", "1",
           "--lora_r", "8", "--lora_alpha", "8", "--max_completion_length", "6", "--max_steps", "1",
           "--logging_steps", "1", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
           "--rollout_engine", "transformers",
           "--task_options", json.dumps({"n_examples": 16, "digits": 1, "ops": "+"})]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)


def test_a_finished_two_process_gloo_run_exits_0_through_the_clean_exit(tmp_path, tiny_dir):
    out, marks = tmp_path / "run", tmp_path / "marks"
    proc = _launch(out, marks, tiny_dir)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-6000:]
    # everything the run writes is there: the adapter, its metrics and plots, the recipe
    assert (out / "final" / "adapter_model.safetensors").is_file() and (out / "final" / "adapter_config.json").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {row["step"] for row in rows} == {1} and any("reward" in row for row in rows), rows
    assert (out / "plots.png").is_file() and (out / "recipe.yaml").is_file()
    # each rank left through os._exit(0) (the C++ teardown skipped), after what Python does first at exit, in its
    # order: the non-daemon threads joined, then the exit functions (os._exit alone had skipped both)
    for rank in (0, 1):
        assert (marks / f"rank{rank}.txt").read_text().splitlines() == ["thread", "atexit", "os._exit(0)"], rank


def test_a_two_process_run_that_fails_still_exits_non_zero_with_its_traceback(tmp_path, tiny_dir):
    """The clean exit is a finished run's only: one that raises (after training, the group up) exits non-zero, each
    rank's traceback on stderr, without passing through ``os._exit``."""
    marks = tmp_path / "marks"
    proc = _launch(tmp_path / "run", marks, tiny_dir, FAIL_AFTER_TRAINING="1")
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-6000:]
    assert proc.stderr.count("RuntimeError: failed after training") >= 2 and "Traceback" in proc.stderr, proc.stderr
    for rank in (0, 1):
        assert "os._exit(0)" not in (marks / f"rank{rank}.txt").read_text().splitlines(), rank


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2:])
