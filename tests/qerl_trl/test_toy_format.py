"""Adding a 4-bit format is one codec file (``toy_format.py``) plus one registry call: ``qerl train
--quantization toy4-rtn`` trains a policy whose linears hold the toy format, and the config, the layer and the
scheme all answer from the registered ``Format``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nvfp4.formats import FORMATS, register_format, unregister_format
from qerl_trl.cli import main
from qerl_trl.quantization import get_scheme
from qerl_trl.run import read_metrics


@pytest.fixture
def toy_format(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # toy_format.py, beside this file
    from toy_format import TOY4

    register_format(TOY4)  # the one registry line
    yield TOY4
    unregister_format(TOY4.name)


def test_qerl_train_runs_through_a_registered_format(tmp_path, tiny_dir, toy_format, monkeypatch, capsys):
    from qerl_trl import trainer as trainer_mod

    seen = []
    real_init = trainer_mod.QeRLGRPOTrainer.__init__

    def spy(self, *args, **kwargs):  # what the trainer holds after loading: layers of the toy format
        real_init(self, *args, **kwargs)
        from nvfp4 import NVFP4Linear

        seen.extend(m.weight_format for m in self.model.modules() if isinstance(m, NVFP4Linear))

    monkeypatch.setattr(trainer_mod.QeRLGRPOTrainer, "__init__", spy)
    assert FORMATS["toy4"] is toy_format and get_scheme("toy4-rtn").format is toy_format
    out = tmp_path / "run"
    main(["train", "offline-default", "--model_name_or_path", str(tiny_dir), "--output_dir", str(out),
          "--quantization", "toy4-rtn", "--max_steps", "1", "--per_device_train_batch_size", "4",
          "--num_generations", "2", "--max_completion_length", "4", "--task_options", json.dumps({"n_examples": 8}),
          "--disable_tqdm", "true", "--save_strategy", "no"])  # fmt: skip
    assert "qerl train: 1 step " in capsys.readouterr().out
    assert seen and all(f is toy_format for f in seen)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1]
