"""``qerl train``: recipes parse, overrides apply, a run directory appears, ``--resume`` continues."""

from __future__ import annotations

import json

import pytest
from qerl_trl.cli import RECIPES_DIR, main, parse_train_args
from qerl_trl.config import QeRLConfig, QeRLDAPOConfig
from qerl_trl.run import read_metrics


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_shipped_recipe_parses(recipe):
    script, config = parse_train_args([recipe])
    assert isinstance(config, QeRLDAPOConfig if script.algorithm == "dapo" else QeRLConfig)
    assert config.lora_r == 32 and config.lora_alpha == 32 and config.aqn
    if recipe != "offline-default":  # the paper's hyperparameters
        assert config.learning_rate == 1e-5 and config.temperature == 1.0
        assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 128
        assert config.num_generations == (16 if script.task == "bigmath" else 8)
        assert config.max_completion_length == (8192 if script.task == "bigmath" else 4096)
        assert config.rollout_engine == "graph"  # the GPU recipes default to the engine measured fastest
    if script.algorithm == "dapo":
        assert (config.epsilon, config.epsilon_high, config.beta, config.dynamic_sampling) == (0.2, 0.28, 0.0, True)


def test_overrides_and_errors():
    script, config = parse_train_args(["offline-default", "--learning_rate", "3e-4", "--task", "gsm8k"])
    assert config.learning_rate == 3e-4 and script.task == "gsm8k"
    assert parse_train_args([])[0].model_name_or_path == "offline-default"  # no arguments: the offline default
    _, dapo = parse_train_args(["offline-default", "--algorithm", "dapo"])
    assert isinstance(dapo, QeRLDAPOConfig)
    with pytest.raises(SystemExit, match="no recipe named"):
        parse_train_args(["no-such-recipe"])
    with pytest.raises(SystemExit, match="algorithm"):
        parse_train_args(["offline-default", "--algorithm", "ppo"])


def test_vllm_settings_nest_and_the_flat_keys_still_set_them(tmp_path):
    """``vllm`` holds the vLLM engine's settings (YAML mapping, JSON on the command line, dict in Python); the flat
    ``vllm_<name>`` keys of earlier recipes and command lines set the same setting, with a FutureWarning."""
    import dataclasses

    from qerl_trl.config import VLLMRolloutConfig

    default = QeRLConfig(output_dir=str(tmp_path))
    assert default.vllm == VLLMRolloutConfig() and default.vllm.dtype == "auto" and default.vllm.server_timeout == 600
    nested = QeRLConfig(output_dir=str(tmp_path), vllm={"max_model_len": 512, "gpu_memory_utilization": 0.3})
    assert (nested.vllm.max_model_len, nested.vllm.gpu_memory_utilization) == (512, 0.3)
    assert nested.to_dict()["vllm"] == dataclasses.asdict(nested.vllm)  # plain JSON for loggers
    json.dumps(nested.to_dict())
    with pytest.warns(FutureWarning, match="vllm_max_model_len is deprecated: set vllm.max_model_len"):
        flat = QeRLConfig(output_dir=str(tmp_path), vllm_max_model_len=512, vllm_server_url="http://h:1")
    assert (flat.vllm.max_model_len, flat.vllm.server_url, flat.vllm_max_model_len) == (512, "http://h:1", None)
    with pytest.raises(ValueError, match="unknown setting"):
        QeRLConfig(output_dir=str(tmp_path), vllm={"max_len": 512})
    recipe = tmp_path / "r.yaml"
    recipe.write_text((RECIPES_DIR / "offline-default.yaml").read_text() + "vllm:\n  max_model_len: 256\n")
    assert parse_train_args([str(recipe)])[1].vllm.max_model_len == 256
    _, cli = parse_train_args(["offline-default", "--vllm", '{"enforce_eager": true}'])
    assert cli.vllm.enforce_eager is True
    with pytest.warns(FutureWarning, match="vllm_gpu_memory_utilization is deprecated"):
        _, old = parse_train_args(["offline-default", "--vllm_gpu_memory_utilization", "0.3"])
    assert old.vllm.gpu_memory_utilization == 0.3


def test_train_writes_run_directory_and_resumes(tmp_path, tiny_dir, capsys):
    out = tmp_path / "run"
    common = ["--model_name_or_path", str(tiny_dir), "--output_dir", str(out), "--per_device_train_batch_size", "8",
              "--num_generations", "4", "--max_completion_length", "6", "--save_steps", "2",
              "--task_options", json.dumps({"n_examples": 32}), "--disable_tqdm", "true"]
    main(["train", "offline-default", *common, "--max_steps", "2"])
    assert "qerl train: 2 steps" in capsys.readouterr().out
    assert (out / "checkpoint-2" / "aqn_state.json").is_file()
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert (out / "plots.png").is_file()
    main(["train", "offline-default", *common, "--max_steps", "3", "--resume", "true"])
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    with pytest.raises(SystemExit, match="no checkpoint"):
        main(["train", "offline-default", *common[:2], "--output_dir", str(tmp_path / "empty"), "--resume", "true"])


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--quantization", "foo"], ["quantization", "'foo'", "'rtn'", "'none'"]),
     (["--aqn_sigma_start", "-1"], ["aqn_sigma_start", "-1.0"])],
)  # fmt: skip
def test_bad_option_values_print_one_line_and_exit_2(args, words, capsys, monkeypatch):
    """A bad option value ends in one line (option, value, what is accepted) on stderr and exit code 2, no
    traceback; ``--debug`` shows the exception itself."""
    from qerl_trl.cli import DEBUG_ENV, main

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qerl train: error: ") and "Traceback" not in err, err
    assert all(w in err for w in words), err
    with pytest.raises(ValueError):
        main(["train", *args, "--debug"])
