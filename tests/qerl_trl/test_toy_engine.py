"""Adding a rollout engine is one file (``toy_engine.py``) plus one registry line: ``qerl train`` runs through it, its
rules (``check_config``) apply, and ``qerl eval --engine`` offers it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qerl_trl.cli import main
from qerl_trl.config import QeRLConfig
from qerl_trl.rollout import ENGINES
from qerl_trl.run import read_metrics


@pytest.fixture
def toy_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # toy_engine.py, beside this file
    monkeypatch.setitem(ENGINES, "toy", "toy_engine:ToyRollout")  # the one registry line
    from toy_engine import ToyRollout

    ToyRollout.generations.clear()
    ToyRollout.trainings = 0
    return ToyRollout


def test_qerl_train_runs_through_a_registered_engine(tmp_path, tiny_dir, toy_engine, capsys):
    out = tmp_path / "run"
    main(["train", "offline-default", "--model_name_or_path", str(tiny_dir), "--output_dir", str(out),
          "--rollout_engine", "toy", "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "2",
          "--max_completion_length", "4", "--task_options", json.dumps({"n_examples": 8}), "--disable_tqdm", "true",
          "--save_strategy", "no"])  # fmt: skip
    assert "qerl train: 1 step " in capsys.readouterr().out
    assert toy_engine.trainings == 1 and len(toy_engine.generations) == 1  # one generation call: the step's batch
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1]


def test_the_engine_owns_its_rules(tmp_path, toy_engine):
    cfg = QeRLConfig(output_dir=str(tmp_path), rollout_engine="toy")
    assert cfg.rollout_engine_class is toy_engine
    with pytest.raises(ValueError, match="'toy' decodes greedily and cannot honour top_k"):
        QeRLConfig(output_dir=str(tmp_path), rollout_engine="toy", top_k=5)
    from qerl_trl.evaluation import build_parser

    assert build_parser().parse_args(["--engine", "toy"]).engine is toy_engine


def test_an_engine_that_does_not_say_how_it_holds_generation_memory_is_refused(tmp_path, monkeypatch):
    """The memory plan reads ``holds_generation_memory``: an engine without it fails at config time, not silently."""
    from qerl_trl.rollout.base import RolloutEngine

    class Unsaid(RolloutEngine):
        name = "unsaid"

    monkeypatch.setattr("qerl_trl.config.engine_class", lambda name: Unsaid)
    with pytest.raises(TypeError, match="Unsaid must set holds_generation_memory"):
        QeRLConfig(output_dir=str(tmp_path), rollout_engine="unsaid")
