"""``rollout_precision`` in the trainer (issue #51): the setting parsed once by the config, refused by the engines
that cannot honour it, and ``qerl train`` with FP8 rollouts through the graph engine (CPU: the FP8 product is the
float32 reference of ``nvfp4::fp8_scaled_linear``). The graph engine's own test is in test_trainer_graph.py."""

from __future__ import annotations

import json

import nvfp4.fp8
import pytest
import torch
from nvfp4.rollout_precision import RolloutPrecision
from qerl_trl.cli import main, parse_train_args
from qerl_trl.config import QeRLConfig


def test_the_config_parses_it_once_and_engines_refuse_what_they_cannot_honour(tmp_path):
    default = QeRLConfig(output_dir="x")
    assert default.rollout_precision == "w4a16" and default.rollout_precision_spec == RolloutPrecision("w4a16")
    graph = QeRLConfig(output_dir="x", rollout_engine="graph", rollout_precision="FP8")
    assert graph.rollout_precision == "fp8" and graph.rollout_precision_spec.fp8_copy
    assert QeRLConfig(output_dir="x", rollout_engine="vllm", rollout_precision="auto").rollout_precision == "auto"
    refusals = [
        ({"rollout_precision": "fp16"}, r"^rollout_precision must be one of 'w4a16', 'fp8', 'auto', got 'fp16'$"),
        ({"rollout_precision": "fp8"}, r"^rollout_engine='transformers' generates in w4a16 only, not "
                                       r"rollout_precision='fp8': use rollout_engine='graph' or 'vllm'"),
        ({"rollout_precision": "auto", "rollout_engine": "graph", "quantization": "nf4"},
         r"makes its FP8 copy from NVFP4 weights; quantization='nf4' has none"),
        ({"rollout_precision": "fp8", "rollout_engine": "vllm", "vllm": {"server_url": "http://127.0.0.1:1"}},
         r"a vLLM server's own setting: start it with --additional-config"),
    ]  # fmt: skip
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message) as info:
            QeRLConfig(output_dir="x", **kwargs)
        assert "\n" not in str(info.value)
    # the recipe's YAML and `qerl train --rollout_precision` reach the config
    recipe = tmp_path / "fp8.yaml"
    recipe.write_text("model_name_or_path: offline-default\nrollout_engine: graph\nrollout_precision: auto\n")
    assert parse_train_args([str(recipe)])[1].rollout_precision_spec.name == "auto"
    _, config = parse_train_args(["offline-default", "--rollout_engine", "graph", "--rollout_precision", "fp8"])
    assert config.rollout_precision == "fp8"


def test_fp8_rollouts_without_sampling_logprobs_say_the_correction_does_not_run(caplog, monkeypatch):
    """TRL's importance-sampling correction reads the engine's logprobs: FP8 rollouts on an engine that returns none
    (here the graph engine without them, as it was before it recorded them) are told once, in one line, that their gap
    to the trainer stays uncorrected (correction on by default). The graph and vLLM engines return them: no line."""
    from qerl_trl.rollout.graph.engine import GraphRollout

    class NoLogprobs(GraphRollout):
        name = "graph-no-logprobs"
        sampling_logprobs = False

    said = "TRL's importance-sampling correction does not run"
    with monkeypatch.context() as patch, caplog.at_level("WARNING", logger="qerl_trl.rollout.base"):
        patch.setattr("qerl_trl.config.engine_class", lambda name: NoLogprobs)
        QeRLConfig(output_dir="x", rollout_engine="graph-no-logprobs", rollout_precision="auto")
        lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0] and "rollout_engine='graph-no-logprobs'" in lines[0], lines
        caplog.clear()
        QeRLConfig(output_dir="x", rollout_engine="graph-no-logprobs", rollout_precision="fp8",
                   vllm_importance_sampling_correction=False)  # chosen off: nothing to say
        QeRLConfig(output_dir="x", rollout_engine="graph-no-logprobs")  # w4a16
    with caplog.at_level("WARNING", logger="qerl_trl.rollout.base"):
        QeRLConfig(output_dir="x", rollout_engine="vllm", rollout_precision="fp8")  # vLLM returns them
        QeRLConfig(output_dir="x", rollout_engine="graph", rollout_precision="auto")  # so does the graph engine
    assert not [r for r in caplog.records if said in r.getMessage()]


def test_bad_values_are_one_line_before_and_after_torch(tmp_path, capsys, monkeypatch):
    from qerl_trl.cli import DEBUG_ENV

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    for argv, words in [
        (["train", "--rollout_precision", "fp16"], ["--rollout_precision", "'fp16'", "'w4a16', 'fp8', 'auto'"]),
        (["train", "--rollout_precision", "fp8"], ["rollout_engine='transformers'", "rollout_precision='fp8'"]),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
        assert all(w in err for w in words), err


def test_qerl_train_one_step_with_fp8_rollouts_on_the_offline_default(tmp_path, monkeypatch):
    """``qerl train --max_steps 1 --rollout_engine graph --rollout_precision fp8`` on the offline default (CPU)."""
    monkeypatch.chdir(tmp_path)
    calls: list[bool] = []
    real = nvfp4.fp8.fp8_linear
    monkeypatch.setattr(nvfp4.fp8, "fp8_linear", lambda *a: calls.append(torch.is_grad_enabled()) or real(*a))
    main(["train", "--max_steps", "1", "--rollout_engine", "graph", "--rollout_precision", "fp8", "--output_dir",
          str(tmp_path / "run"), "--save_strategy", "no", "--disable_tqdm", "true"])  # fmt: skip
    assert calls and not any(calls)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward" in m for m in metrics), metrics
