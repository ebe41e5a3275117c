"""``qerl train``: recipes parse, overrides apply, a run directory appears, ``--resume`` continues."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from qerl_trl.cli import RECIPES_DIR, main, parse_train_args
from qerl_trl.config import QeRLConfig, QeRLDAPOConfig
from qerl_trl.run import read_metrics
from qerl_trl.validation import UsageError


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
        # the GPU recipes default to the engine measured fastest at their batch and lengths (issue #47 item 7): vLLM
        # for the 7B GSM8K recipe (3ed8a10, one H100, both engines in one run) and the 32B DAPO recipe (e0a0a82, one
        # two-GPU H200, one engine a GPU at once); each fixes its paged KV cache
        assert config.rollout_engine == "vllm" and config.vllm.kv_cache_memory_bytes in (12 * 2**30, 14 * 2**30)
    if script.algorithm == "dapo":
        assert (config.epsilon, config.epsilon_high, config.beta, config.dynamic_sampling) == (0.2, 0.28, 0.0, True)


def test_overrides_and_errors():
    script, config = parse_train_args(["offline-default", "--learning_rate", "3e-4", "--task", "gsm8k"])
    assert config.learning_rate == 3e-4 and script.task == "gsm8k"
    assert parse_train_args([])[0].model_name_or_path == "offline-default"  # no arguments: the offline default
    _, dapo = parse_train_args(["offline-default", "--algorithm", "dapo"])
    assert isinstance(dapo, QeRLDAPOConfig)
    with pytest.raises(UsageError, match="recipe 'no-such-recipe': no recipe of that name"):
        parse_train_args(["no-such-recipe"])
    with pytest.raises(UsageError, match="algorithm"):
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


def test_train_writes_run_directory_and_resumes(tmp_path, tiny_dir, capsys, monkeypatch):
    out = tmp_path / "run"
    common = ["--model_name_or_path", str(tiny_dir), "--output_dir", str(out), "--per_device_train_batch_size", "8",
              "--num_generations", "4", "--max_completion_length", "6", "--save_steps", "2",
              "--task_options", json.dumps({"n_examples": 32}), "--disable_tqdm", "true"]
    main(["train", "offline-default", *common, "--max_steps", "2"])
    assert "qerl train: 2 steps" in capsys.readouterr().out
    assert (out / "checkpoint-2" / "aqn_state.json").is_file()
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert (out / "plots.png").is_file()
    leftover = out / ".staging" / "checkpoint-3"  # a save cut short: the resume says it is not used
    leftover.mkdir(parents=True)
    (leftover / "trainer_state.json").write_text("{")
    main(["train", "offline-default", *common, "--max_steps", "3", "--resume", "true"])
    captured = capsys.readouterr()
    assert f"qerl train: resuming from {out / 'checkpoint-2'} (step 2)" in captured.err
    assert f"{out / '.staging'} holds checkpoint-3 from a save cut short" in captured.err
    assert "qerl train: 1 step in " in captured.out and "(step 3)" in captured.out  # this process ran 1 of the 3
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # another rank on the same checkpoint: one line naming both ranks and the base, before the model loads
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "offline-default", *common, "--max_steps", "4", "--resume", str(out / "checkpoint-2"),
              "--lora_r", "8"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "its adapter is LoRA rank 32" in err and "lora_r 8" in err and "--lora_r 32" in err, err
    # another quantization of the same model: the same shapes, so it loaded onto the other policy without a word
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "offline-default", *common, "--max_steps", "4", "--resume", "true", "--quantization", "mse"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "quantization 'nvfp4-rtn', this run asks for 'nvfp4-mse'" in err, err

    # --overwrite_output_dir: the earlier run is kept until the new one's first checkpoint exists, then removed
    import qerl_trl.run as run_module

    earlier = _hashes(out)
    seen = []
    discard = run_module.discard_replaced_run

    def discard_after_checking(output_dir):  # the real removal, after noting what the folder held at that moment
        aside = list(Path(output_dir).glob(".previous-run-*"))
        seen.append((sorted(p.name for p in Path(output_dir).glob("checkpoint-*")), aside and _hashes(aside[0])))
        discard(output_dir)

    monkeypatch.setattr(run_module, "discard_replaced_run", discard_after_checking)
    main(["train", "offline-default", *common, "--max_steps", "2", "--overwrite_output_dir", "true"])
    assert "is kept in" in capsys.readouterr().err
    assert seen and seen[0] == (["checkpoint-2"], earlier), seen[0]  # first call: new checkpoint in place, old intact
    assert not list(out.glob(".previous-run-*")) and [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "offline-default", *common[:2], "--output_dir", str(tmp_path / "empty"), "--resume", "true"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"--resume true: no usable checkpoint in {tmp_path / 'empty'} "
                                                    "(no checkpoint-N folder)")  # fmt: skip


def _cut_safetensors(path: Path) -> None:
    """A small real safetensors file cut to half its size, as a kill mid-write leaves it."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"lora_A": torch.ones(4, 8)}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> Path:
    """Things a user can point at by mistake: a file, a folder that is no model, checkpoints and an adapter whose
    safetensors file was cut short."""
    root = tmp_path_factory.mktemp("bad")
    (root / "a-file").write_text("not a folder")
    (root / "not-a-model").mkdir()
    (root / "not-a-model" / "notes.txt").write_text("hello")
    ckpt = root / "run" / "checkpoint-2"
    _cut_safetensors(ckpt / "adapter_model.safetensors")
    for name, text in {"trainer_state.json": "{}", "aqn_state.json": "{}", "optimizer.pt": "", "scheduler.pt": ""}.items():
        (ckpt / name).write_text(text)
    _cut_safetensors(root / "adapter" / "adapter_model.safetensors")
    (root / "adapter" / "adapter_config.json").write_text("{}")
    # complete checkpoints of an AQN run: one whose aqn_state.json lost its schedule (valid JSON), one that is whole
    from aqn import AQNController, make_schedule
    from safetensors.torch import save_file
    from transformers import TrainerState

    aqn_state = AQNController(make_schedule("exponential", 1e-2, 5e-4, 2, total_steps=4)).state_dict()
    for run, state in [("half-aqn", {k: v for k, v in aqn_state.items() if k != "schedule"}), ("aqn-run", aqn_state)]:
        ckpt = root / run / "checkpoint-2"
        ckpt.mkdir(parents=True)
        save_file({"lora_A": torch.ones(4, 8)}, ckpt / "adapter_model.safetensors")
        TrainerState(global_step=2, train_batch_size=8).save_to_json(str(ckpt / "trainer_state.json"))
        torch.save({}, ckpt / "optimizer.pt")
        torch.save({}, ckpt / "scheduler.pt")
        (ckpt / "aqn_state.json").write_text(json.dumps(state))
    return root


#: (argv, words the one line must hold); ``{bad}`` is the bad_inputs folder. Each: exit 2, one line on stderr.
BAD_INPUTS = [
    (["train", "no-such-recipe"], ["recipe", "'no-such-recipe'", "offline-default"]),
    (["train", "{bad}/missing.yaml"], ["recipe", "missing.yaml", "no such file"]),
    (["train", "--model_name_or_path", "/nonexistent/model", "--max_steps", "1"],
     ["--model_name_or_path", "'/nonexistent/model'", "no such file or folder", "config.json"]),
    (["train", "--model_name_or_path", "{bad}/not-a-model"], ["--model_name_or_path", "not-a-model", "no config.json"]),
    (["train", "--model_name_or_path", "qerl-tests/no-such-model"],
     ["--model_name_or_path", "'qerl-tests/no-such-model'", "Hub", "offline"]),
    (["train", "--max_steps", "-3"], ["max_steps", "-3", "-1", ">= 1"]),
    (["train", "--max_steps", "abc"], ["--max_steps", "'abc'"]),
    (["train", "--max_completion_length", "-1"], ["max_completion_length", "-1", ">= 1"]),
    (["train", "--per_device_train_batch_size", "0"], ["per_device_train_batch_size", "0"]),
    (["train", "--aqn_sigma_start", "-1"], ["aqn_sigma_start", "-1.0"]),
    (["train", "--aqn", "false", "--aqn_sigma_end", "-0.5"], ["aqn_sigma_end", "-0.5", ">= 0"]),
    (["train", "--aqn_schedule", "zigzag"], ["aqn_schedule", "'zigzag'", "exponential"]),
    (["train", "--aqn_num_stages", "1"], ["aqn_num_stages=1", ">= 2"]),
    (["train", "--temperature", "0"], ["temperature", "> 0"]),
    (["train", "--quantization", "foo"], ["quantization", "'foo'", "'rtn'", "'none'"]),
    (["train", "--limit", "0"], ["--limit", ">= 1", "0"]),
    (["train", "--task", "nope"], ["--task", "'nope'", "gsm8k"]),
    (["train", "--rewards", "nope"], ["--rewards", "'nope'", "format"]),
    (["train", "--algorithm", "ppo"], ["--algorithm", "'ppo'"]),
    (["train", "--no_such_option", "1"], ["--no_such_option"]),
    (["train", "--task", "gsm8k", "--data_path", "{bad}/no-data"], ["--data_path", "no-data", "train.jsonl"]),
    (["train", "--task_options", '{"digits": 12}'], ["--task_options", "digits", "1..9"]),
    (["train", "--output_dir", "{bad}/a-file"], ["--output_dir", "a-file", "a file; expected a folder"]),
    (["train", "--output_dir", "{bad}/a-file/run"], ["--output_dir", "a-file/run", "is a file"]),
    (["train", "--output_dir", "{bad}/empty", "--resume", "true"], ["--resume true", "no usable checkpoint", "empty"]),
    (["train", "--output_dir", "{bad}/run", "--resume", "true"],
     ["--resume true", "no usable checkpoint", "checkpoint-2 (adapter_model.safetensors: not a complete safetensors"]),
    (["train", "--resume", "{bad}/run/checkpoint-2"],
     ["--resume", "checkpoint-2", "adapter_model.safetensors: not a complete safetensors file", "not fully covered"]),
    (["train", "--resume", "{bad}/run/checkpoint-9"], ["--resume", "checkpoint-9", "no such checkpoint folder"]),
    (["train", "--resume", "{bad}/half-aqn/checkpoint-2"],
     ["--resume", "checkpoint-2", "aqn_state.json: AQN controller state has no 'schedule'"]),
    (["train", "--aqn", "false", "--resume", "{bad}/aqn-run/checkpoint-2"],
     ["--resume", "checkpoint-2", "trained with AQN", "aqn_state.json", "--aqn false", "--aqn true"]),
    (["eval", "--model", "offline-default", "--adapter", "/nonexistent", "--task", "arithmetic"],
     ["--adapter", "'/nonexistent'", "no such folder", "LoRA adapter"]),
    (["eval", "--adapter", "{bad}/not-a-model", "--task", "arithmetic"], ["--adapter", "not a LoRA adapter folder"]),
    (["eval", "--adapter", "{bad}/adapter", "--task", "arithmetic"],
     ["--adapter", "adapter_model.safetensors: not a complete safetensors file"]),
    (["eval", "--model", "/nonexistent", "--task", "arithmetic"], ["--model", "'/nonexistent'", "no such file"]),
    (["eval", "--task", "gsm8k", "--data-path", "{bad}/no-data"], ["--data-path", "no-data", "test.jsonl"]),
    (["eval", "--n-samples", "0"], ["--n-samples", ">= 1", "0"]),
    (["eval", "--temperature", "0"], ["--temperature", "> 0", "--greedy"]),
    (["eval", "--task", "nope"], ["--task", "'nope'"]),
    (["frobnicate"], ["unknown command", "'frobnicate'"]),
]  # fmt: skip


def test_bad_inputs_print_one_line_and_exit_2(bad_inputs, capsys, monkeypatch):
    """Every bad path or value of the issue's table and more, through ``main`` in this process: exit code 2, one line
    on stderr that names the argument and the value, no traceback; with ``--debug`` the exception itself (its
    traceback) instead."""
    from qerl_trl.cli import DEBUG_ENV

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub id is refused as offline here, whatever the network
    monkeypatch.chdir(bad_inputs)  # the recipe's runs/offline-default of a developer's own run is not in the way
    for argv, words in BAD_INPUTS:
        argv = [a.replace("{bad}", str(bad_inputs)) for a in argv]
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2, (argv, err)
        assert len(err.splitlines()) == 1 and ": error: " in err and "Traceback" not in err, (argv, err)
        assert all(w.replace("{bad}", str(bad_inputs)) in err for w in words), (argv, err)
        with pytest.raises(Exception) as debug_info:  # noqa: B017 - whichever exception the message came from
            main([*argv, "--debug"])
        assert not isinstance(debug_info.value, SystemExit) and debug_info.value.__traceback__ is not None, argv
        capsys.readouterr()


def test_bad_input_from_the_shell_exits_2_in_one_line_and_debug_shows_the_traceback(tmp_path):
    """The same through the installed ``qerl`` entry point, in two real processes (both fail before torch loads)."""
    import shutil
    import subprocess

    qerl = shutil.which("qerl") or str(Path(sys.executable).with_name("qerl"))
    env = {k: v for k, v in os.environ.items() if k != "QERL_DEBUG"}
    plain = subprocess.run([qerl, "train", "no-such-recipe"], capture_output=True, text=True, env=env, timeout=120)
    assert plain.returncode == 2 and plain.stdout == "", plain
    assert plain.stderr.splitlines() == [
        "qerl train: error: recipe 'no-such-recipe': no recipe of that name, nor a .yaml file; shipped recipes: "
        "bigmath-qwen2.5-32b-dapo, gsm8k-qwen2.5-7b-grpo, offline-default"
    ]
    debug = subprocess.run([qerl, "train", "no-such-recipe", "--debug"], capture_output=True, text=True, env=env,
                           timeout=120)  # fmt: skip
    assert debug.returncode == 1 and debug.stderr.startswith("Traceback (most recent call last):"), debug
    assert debug.stderr.splitlines()[-1].startswith("qerl_trl.validation.UsageError: recipe 'no-such-recipe'")


# ------------------------------------------------------------------------------------------ issue #49: before torch
def _qerl() -> str:
    import shutil

    return shutil.which("qerl") or str(Path(sys.executable).with_name("qerl"))


def _hashes(root: Path) -> dict[str, str]:
    """Every file under ``root`` → its SHA-256 (hidden folders included)."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}  # fmt: skip


def _earlier_run(root: Path) -> Path:
    """A folder as a finished ``qerl train`` leaves it (the files' contents do not matter to the refusal)."""
    run = root / "earlier-run"
    for name, text in {"final/adapter_model.safetensors": "weights", "final/adapter_config.json": "{}",
                       "checkpoint-10/trainer_state.json": "{}", "checkpoint-20/trainer_state.json": "{}",
                       "metrics.jsonl": '{"step": 1, "reward": 0.5}\n', "plots.png": "png", "README.md": "run"}.items():  # fmt: skip
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    return run


def test_only_the_main_process_refuses_an_output_dir_that_holds_files(tmp_path, monkeypatch):
    """Under ``accelerate launch`` every rank runs the argument checks, and rank 0 writes the run's ``recipe.yaml`` as
    soon as its own checks pass: a slower rank then found the folder holding files and refused the run it belongs to
    (seen in ``test_a_two_process_run_that_fails_still_exits_non_zero_with_its_traceback`` on a loaded host). The
    folder's state is the main process's to judge (it alone writes there); the other ranks leave it, and a refusal
    stops the launch through rank 0's exit."""
    from qerl_trl.cli import precheck_train_args

    run = _earlier_run(tmp_path)
    argv = ["--output_dir", str(run)]
    monkeypatch.setenv("RANK", "1")
    precheck_train_args(argv)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="an earlier run"):
        precheck_train_args(argv)
    monkeypatch.delenv("RANK")
    with pytest.raises(UsageError, match="an earlier run"):
        precheck_train_args(argv)


#: (argv after ``qerl train``, words the one line must hold). Each fails before torch is imported.
FAST_ERRORS = [
    (["--max_steps", "-3"], ["max_steps", "-3", ">= 1"]),
    (["--learning_rate", "nan"], ["learning_rate", "nan", ">= 0"]),
    (["--no_such_option", "1"], ["unknown option --no_such_option"]),
    (["--learning_rat", "1e-5", "--lerning_rate", "1"], ["unknown option --lerning_rate", "did you mean --learning_rate"]),
    (["--per_device_train_batch_size", "two"], ["--per_device_train_batch_size", "'two'", "int"]),
    (["--quantization", "foo"], ["quantization", "'foo'", "'nvfp4-rtn'"]),
    (["--rollout_precision", "fp16"], ["--rollout_precision", "'fp16'", "'w4a16', 'fp8', 'auto'"]),
    (["--task", "gsm8k", "--data_path", "/nonexistent/gsm8k"], ["--data_path", "'/nonexistent/gsm8k'", "no such file"]),
    (["--task", "gsm8k", "--data_path", "{data}"], ["--data_path", "has no train.jsonl", "(found: test.jsonl)"]),
    (["{recipe}"], ["recipe", "lora_r must be an integer", "[1, 2]"]),
    (["--output_dir", "{run}"], ["--output_dir", "earlier-run", "an earlier run", "--resume true",
                                 "--overwrite_output_dir true"]),
]  # fmt: skip


@pytest.mark.parametrize("argv, words", FAST_ERRORS, ids=[" ".join(a) for a, _ in FAST_ERRORS])
def test_argument_errors_come_in_one_line_within_2_s_and_touch_nothing(tmp_path, argv, words):
    """From the shell, as a user types it: exit 2, exactly one stderr line naming the argument, no traceback, under
    2 s (the options are checked before torch, transformers and TRL are imported; they took ~20 s), and no file of an
    earlier run changed."""
    import subprocess
    import time

    run = _earlier_run(tmp_path)
    recipe = tmp_path / "bad-rank.yaml"
    recipe.write_text((RECIPES_DIR / "offline-default.yaml").read_text().replace("lora_r: 32", "lora_r: [1, 2]"))
    before = _hashes(run)
    data = tmp_path / "gsm8k-test-only"  # a folder with another split's file only
    data.mkdir()
    (data / "test.jsonl").write_text("{}\n")
    argv = [a.replace("{run}", str(run)).replace("{recipe}", str(recipe)).replace("{data}", str(data)) for a in argv]
    env = {k: v for k, v in os.environ.items() if k != "QERL_DEBUG"}
    start = time.perf_counter()
    done = subprocess.run([_qerl(), "train", *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    seconds = time.perf_counter() - start
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and done.stdout == "", done
    assert len(lines) == 1 and lines[0].startswith("qerl train: error: ") and "Traceback" not in done.stderr, lines
    assert all(w in lines[0] for w in words), lines
    assert seconds < 2.0, f"{seconds:.2f} s to {lines[0]}"
    assert _hashes(run) == before


def test_option_snapshot_matches_the_config_classes():
    """``train_options.json`` (what the check before TRL knows of the config's fields) is what the real dataclasses,
    quantization schemes and tasks give; after a change to them: ``python -m qerl_trl.arguments``."""
    from qerl_trl.arguments import OPTIONS_FILE, option_table

    assert json.loads(OPTIONS_FILE.read_text()) == json.loads(json.dumps(option_table())), (
        "train_options.json is stale: run `uv run python -m qerl_trl.arguments`"
    )


def test_precheck_accepts_what_the_parser_accepts(tmp_path):
    """Every shipped recipe, the README's overrides, flags without a value, ``--no_<flag>``, dashes and ``=``."""
    from qerl_trl.cli import precheck_train_args

    for recipe in sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")):
        precheck_train_args([recipe, "--output_dir", str(tmp_path / recipe), "--model_name_or_path", "offline-default"])
    argv = ["--output_dir", str(tmp_path / "o"), "--learning_rate", "5e-6", "--disable_tqdm", "true", "--log_completions", "--no_aqn",
            "--max-steps=3", "--lora_target_modules", "q_proj", "v_proj", "--task_options", '{"n_examples": 8}',
            "--vllm", '{"enforce_eager": true}', "--bf16", "false"]  # fmt: skip
    script, config = precheck_train_args(argv)
    assert (config.learning_rate, config.disable_tqdm, config.aqn, config.max_steps) == (5e-6, True, False, 3)
    assert config.log_completions is True
    assert config.lora_target_modules == ["q_proj", "v_proj"] and script.task_options == {"n_examples": 8}
    parsed_script, parsed = parse_train_args(argv)
    assert (parsed.learning_rate, parsed.disable_tqdm, parsed.aqn, parsed.max_steps) == (5e-6, True, False, 3)
    assert parsed.log_completions is True and parsed.lora_target_modules == ["q_proj", "v_proj"]


def test_gsm8k_with_a_data_path_needs_no_task_options(tmp_path):
    """``--task gsm8k --data_path X`` drops the offline recipe's arithmetic options (n_examples, digits, ops)."""
    from qerl_trl.cli import precheck_train_args
    from qerl_trl.validation import load_train_data

    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}) + "\n")
    argv = ["--task", "gsm8k", "--data_path", str(tmp_path), "--output_dir", str(tmp_path / "run")]
    assert precheck_train_args(argv)[0].task_options is None
    script, config = parse_train_args(argv)
    assert script.task_options is None
    assert len(load_train_data(script, config)) == 1


def test_the_memory_plan_lets_the_demo_run_in_8_gb(tmp_path, offline_model_path):
    """The 135M demo peaks at 1.9 GB; its plan pads the training micro-batch to the longest prompt (~60 tokens), not
    the engine's 1024-token cap, so ``--memory-budget-gb 8`` no longer refuses it (it said 13.4 GB)."""
    from qerl_trl.cli import check_memory
    from qerl_trl.validation import load_train_data

    script, config = parse_train_args(["--output_dir", str(tmp_path / "run")])
    plan = check_memory(script, config, int(8e9), load_train_data(script, config))
    assert plan is not None and plan.training < 2e9 and plan.wave_rows == plan.run.generation_rows
    assert 30 < plan.run.train_prompt_len < 200


def _adapter_of(model_dir: Path, out: Path, rank: int, base: str) -> Path:
    """A rank-``rank`` LoRA adapter of the model in ``model_dir``, saved as trained on ``base``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=rank, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    return out


def _progress_bar(line: str) -> bool:
    """A tqdm bar (``NN%|...|``), each of its carriage-return updates."""
    import re

    return all(re.search(r"\d+%\|.*\|", seg) or not seg.strip() for seg in line.split("\r"))


def test_an_adapter_of_another_model_or_rank_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """``qerl eval --adapter`` of another base model (another hidden size) or whose config's rank is not its weights':
    exit 2, one line naming the adapter's base model and rank against the model (PEFT printed ~470 lines); the same
    check guards :func:`nvfp4.peft.load_adapter`."""
    from nvfp4.peft import AdapterMismatchError, load_adapter
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    monkeypatch.delenv("QERL_DEBUG", raising=False)
    other = tmp_path / "other-model"
    AutoModelForCausalLM.from_config(tiny_config("llama", hidden_size=32, intermediate_size=64)).save_pretrained(other)
    foreign = _adapter_of(other, tmp_path / "foreign", 4, "someone/other-32")
    relabelled = _adapter_of(tiny_dir, tmp_path / "relabelled", 4, str(tiny_dir))
    config = json.loads((relabelled / "adapter_config.json").read_text())
    (relabelled / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    cases = [(foreign, ["rank 4", "'someone/other-32'", "self_attn.q_proj has 32 inputs, the model's 64"]),
             (relabelled, ["rank 16", "has rank 4, not the config's 16"])]  # fmt: skip
    for adapter, words in cases:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", "--model", str(tiny_dir), "--adapter", str(adapter), "--task", "arithmetic", "--limit", "1",
                  "--output", str(tmp_path / "eval"), "--no-progress"])  # fmt: skip
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not _progress_bar(line)]
        err = "\n".join(lines)  # the model's "Loading weights" bars came before it
        assert exit_info.value.code == 2 and len(lines) == 1, err
        assert err.startswith("qerl eval: error: adapter ") and "Traceback" not in err, err
        assert all(w in err for w in words), err
    with pytest.raises(AdapterMismatchError, match="someone/other-32"):
        load_adapter(AutoModelForCausalLM.from_pretrained(tiny_dir), str(foreign))


def test_first_screen_holds_only_our_lines(tiny_dir, tmp_path):
    """The first 15 lines of ``qerl train --max_steps 1`` (stdout and stderr together, as a terminal shows them) are
    ours. Ours: a line of the ``qerl`` CLI (``qerl train: ...``), a progress bar (tqdm's ``NN%|...|``), a step's
    metrics as the trainer logs them (a Python dict of numbers and strings), or blank. Not ours, as before #49:
    bitsandbytes' "Failed to load CPU gemm_4bit_forward", torch's pin_memory UserWarning and its stray
    ``super().__init__(loader)``, transformers' clean_up_tokenization_spaces warning."""
    import ast
    import re
    import subprocess

    def ours(segment: str) -> bool:
        text = segment.strip()
        if not text or text.startswith("qerl train: ") or re.search(r"\d+%\|.*\|", text):
            return True
        try:
            return isinstance(ast.literal_eval(text), dict)
        except (ValueError, SyntaxError):
            return False

    env = {k: v for k, v in os.environ.items() if k != "QERL_DEBUG"} | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = ["--model_name_or_path", str(tiny_dir), "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--num_generations", "4",
            "--max_completion_length", "4", "--task_options", '{"n_examples": 8}']  # fmt: skip
    done = subprocess.run([_qerl(), "train", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    lines = done.stdout.splitlines()[:15]
    foreign = [seg for line in lines for seg in line.split("\r") if not ours(seg)]
    assert not foreign, "\n".join(lines)
    assert any(line.startswith("qerl train: 1 step") for line in done.stdout.splitlines()), done.stdout[-2000:]


def test_vllm_on_the_command_line_updates_the_recipes_mapping(tmp_path):
    """``--vllm '{JSON}'`` over a recipe's ``vllm:`` block changes the keys it names and keeps the others (``null``
    unsets one), in the full parse and in the check before TRL is imported; a recipe without the block takes it whole."""
    from qerl_trl.cli import precheck_train_args

    out = ["--output_dir", str(tmp_path / "run")]
    _, config = parse_train_args(["gsm8k-qwen2.5-7b-grpo", *out, "--vllm", '{"gpu_memory_utilization": 0.3}'])
    assert (config.vllm.kv_cache_memory_bytes, config.vllm.max_model_len) == (12 << 30, 4608)
    assert config.vllm.gpu_memory_utilization == 0.3
    _, config = parse_train_args(["gsm8k-qwen2.5-7b-grpo", *out, '--vllm={"kv_cache_memory_bytes": null}'])
    assert config.vllm.kv_cache_memory_bytes is None and config.vllm.max_model_len == 4608
    offline = ["--model_name_or_path", "offline-default"]  # the check looks for the model: no Hub here
    _, pre = precheck_train_args(["gsm8k-qwen2.5-7b-grpo", *out, *offline, "--vllm", '{"max_model_len": 5120}'])
    vllm = json.loads(pre.vllm) if isinstance(pre.vllm, str) else pre.vllm  # the check keeps the option's text
    assert vllm["kv_cache_memory_bytes"] == 12 << 30 and vllm["max_model_len"] == 5120
    _, config = parse_train_args(["offline-default", *out, "--vllm", '{"gpu_memory_utilization": 0.3}'])
    assert config.vllm.gpu_memory_utilization == 0.3 and config.vllm.kv_cache_memory_bytes is None


def test_a_failed_training_run_closes_the_rollout_engine(tmp_path, monkeypatch):
    """``qerl_trl.cli.train``: when training raises (non-finite gradients, out of memory, Ctrl-C), the trainer's rollout
    engine (vLLM: its engine, GPU memory and adapter folder) is closed before the error goes on, as on success."""
    import qerl_trl.cli as cli
    from qerl_trl.validation import TrainInputs

    closed = []

    class FailingTrainer:
        def train(self, resume_from_checkpoint=None):
            raise FloatingPointError("step 3: the gradient norm is nan")

        def close(self):
            closed.append(True)

    monkeypatch.setattr(cli, "build_trainer", lambda *args, **kwargs: FailingTrainer())
    script_args, config = parse_train_args(["--output_dir", str(tmp_path / "run"), "--report_to", "none"])
    with pytest.raises(FloatingPointError, match="gradient norm"):
        cli.train(script_args, config, TrainInputs(dataset=None, resume=None))
    assert closed == [True]


def test_a_metrics_line_cut_short_by_a_crash_does_not_stop_the_resumed_run(tmp_path):
    """A crash (power cut, full disk) can leave metrics.jsonl ending in a partial line; the resumed run appends to it.
    Its rows stay readable and the plot at each save works (it raised JSONDecodeError out of on_save, stopping the
    resumed run at every checkpoint)."""
    from types import SimpleNamespace

    from qerl_trl.run import RunDirectoryCallback

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    callback = RunDirectoryCallback()
    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(is_world_process_zero=True, global_step=2)
    callback.on_log(args, state, None, logs={"reward": 0.7})
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 0.5), (2, 0.7)]
    callback.on_save(args, state, None)
    assert (tmp_path / "plots.png").is_file()


def test_resuming_from_an_earlier_checkpoint_names_the_later_ones_resume_true_would_pick(tmp_path):
    """--resume run/checkpoint-2 where the run went on to checkpoint-4 and -6: the resume line says those are of the
    run past this step, replaced as this one saves those steps, and that --resume true picks them until then (after a
    crash of this run it would silently continue the abandoned one). Resuming from the newest names none."""
    from qerl_trl.checkpoints import ResumePoint
    from qerl_trl.cli import _resume_line

    run = tmp_path / "run"
    for step in (2, 4, 6):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    line = _resume_line(str(run), ResumePoint(str(run / "checkpoint-2")), 2)
    assert line.startswith(f"qerl train: resuming from {run / 'checkpoint-2'} (step 2); ")
    assert "checkpoint-4, checkpoint-6" in line and "--resume true" in line and "\n" not in line, line
    assert _resume_line(str(run), ResumePoint(str(run / "checkpoint-6")), 6) == (
        f"qerl train: resuming from {run / 'checkpoint-6'} (step 6)")  # fmt: skip
    elsewhere = tmp_path / "new-run"  # resumed into another output_dir: the old run's folders are not in its way
    assert _resume_line(str(elsewhere), ResumePoint(str(run / "checkpoint-2")), 2).endswith("(step 2)")


def test_metrics_of_a_run_resumed_from_an_earlier_checkpoint_replace_the_abandoned_later_steps(tmp_path):
    """A run that reached step 6 (checkpoints at 2, 4, 6) resumed from checkpoint-2 and stopped at step 4 (max_steps 4,
    or a second crash): metrics.jsonl holds both runs' lines; the rows, and the plot, are the resumed run's steps
    1-4, not its steps 1-4 followed by the abandoned run's steps 5-6."""
    from types import SimpleNamespace

    from qerl_trl.run import RunDirectoryCallback

    callback = RunDirectoryCallback()
    args = SimpleNamespace(output_dir=str(tmp_path))
    for step, reward in [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5), (6, 0.6), (3, 0.9), (4, 0.8)]:
        callback.on_log(args, SimpleNamespace(is_world_process_zero=True, global_step=step), None,
                        logs={"reward": reward})  # fmt: skip
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 0.1), (2, 0.2), (3, 0.9), (4, 0.8)]  # fmt: skip


@pytest.mark.parametrize("setting, value", [("gpu_memory_utilization", 30), ("gpu_memory_utilization", 0),
                                            ("kv_cache_memory_bytes", -1), ("max_model_len", 0),
                                            ("server_timeout", 0)])  # fmt: skip
def test_vllm_numbers_out_of_range_are_refused_with_the_config(tmp_path, setting, value):
    """A vLLM number out of range (30 for 0.3) is refused in one line when the config is built, not by the engine
    after the policy has loaded."""
    with pytest.raises(ValueError, match=rf"vllm\.{setting} must be .*got {value}"):
        QeRLConfig(output_dir=str(tmp_path), vllm={setting: value})


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_qerl_help_names_the_commands(flag, capsys):
    """``qerl --help`` / ``qerl -h`` (what a new user types first) print the commands, as ``qerl help`` does, not
    ``qerl train``'s hundred options under a usage line that names no command."""
    main([flag])
    out = capsys.readouterr().out
    assert "usage: qerl {train,eval,plan}" in out and "qerl train --list-recipes" in out, out[:300]


@pytest.mark.parametrize("flag", ["--version", "-V", "version"])
def test_qerl_version_names_the_packages_a_bug_report_needs(flag, capsys):
    """``qerl --version`` printed "qerl train: error: unknown option --version (did you mean --epsilon?)"; it now names
    QeRL's packages and the libraries a bug report needs, one per line, nothing trained or loaded."""
    import importlib.metadata as md

    main([flag])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"qerl-trl {md.version('qerl-trl')}"
    names = {line.split()[0] for line in out}
    assert {"nvfp4", "aqn", "trl", "transformers", "peft", "torch", "python"} <= names, out


@pytest.mark.parametrize(
    ("command", "usage", "option"),
    [("train", "usage: qerl train [RECIPE]", "--list-recipes"), ("plan", "usage: qerl plan [RECIPE]", "--gpus N")],
)
def test_qerl_command_help_names_the_command_and_the_recipe(capsys, command, usage, option):
    """``qerl train --help``'s usage says ``qerl train`` and that a recipe may come first (as ``qerl eval --help``
    says ``qerl eval``); ``qerl plan --help`` said ``qerl train [RECIPE]`` (the train parser's usage): it names
    ``qerl plan`` and its own options."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert out.startswith(usage), out[:200]
    assert option in out, out[:400]


def test_lora_target_modules_that_match_nothing_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """``--lora_target_modules qproj`` (a typo) was PEFT's traceback once the model had loaded; now one line naming
    the option, and nothing trained."""
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model_name_or_path", str(tiny_dir), "--lora_target_modules", "qproj", "--max_steps", "1",
              "--output_dir", str(tmp_path / "run"), "--disable_tqdm", "true"])  # fmt: skip
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not _progress_bar(line)]
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("qerl train: error: --lora_target_modules ['qproj']: ") and "qproj" in lines[0], lines
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("option", ["--steps_per_generation", "--generation_batch_size"])
def test_a_generation_batch_of_no_rows_is_one_line_before_the_model_loads(option, tmp_path, capsys, monkeypatch):
    """``--steps_per_generation 0`` (or ``--generation_batch_size 0``) passed every check (0 is divisible by
    num_generations) and ended in torch's sampler traceback ("batch_size should be a positive integer value") once
    the model had loaded; now one line naming the option."""
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", option, "0", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{option.removeprefix('--')} must be >= 1, got 0" in err, err


def test_negative_warmup_steps_says_what_is_wrong(tmp_path, capsys, monkeypatch):
    """``--warmup_steps -1`` said "warmup_steps must be an integer or a float" (transformers' message) of an
    integer; now the rule it broke, with the value."""
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--warmup_steps", "-1", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "warmup_steps must be >= 0" in err and "got -1" in err, err


@pytest.mark.parametrize("option", ["--learning_rate", "--temperature"])
def test_an_infinite_learning_rate_or_temperature_is_refused(option, tmp_path, capsys, monkeypatch):
    """``nan`` was refused but ``inf`` passed: an infinite learning rate makes the adapter inf/NaN at the first step,
    an infinite temperature samples uniformly at random. Now one line before anything loads."""
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", option, "inf", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{option.removeprefix('--')} must be a finite number" in err and "got inf" in err, err


@pytest.mark.parametrize("option, value, rule", [("top_k", "-5", ">= -1 (0 or vLLM's -1: no top-k)"), ("min_p", "1.5", "in [0, 1]"),
                                                 ("repetition_penalty", "0", "> 0")])  # fmt: skip
def test_sampling_values_generation_refuses_are_one_line_before_the_model_loads(option, value, rule, tmp_path, capsys,
                                                                                 monkeypatch):  # fmt: skip
    """``--top_k -5``, ``--min_p 1.5``, ``--repetition_penalty 0`` passed every check and ended in transformers'
    traceback at the first generation, after the model had loaded; now one line naming the rule."""
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", f"--{option}", value, "--max_steps", "1", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{option} must be {rule}, got {float(value) if option != 'top_k' else int(value)}" in err, err


@pytest.mark.parametrize("spelling", ["--algo", "--algor=dapo"])
def test_an_abbreviated_algorithm_option_picks_the_dapo_config(spelling, tmp_path):
    """``--algo dapo`` (argparse takes a unique prefix of an option) set ``algorithm: dapo`` but parsed the GRPO
    config: a DAPO trainer without DAPO's settings (epsilon_high 0.28, dynamic sampling, no KL term), silently."""
    argv = [spelling] if "=" in spelling else [spelling, "dapo"]
    script, config = parse_train_args([*argv, "--output_dir", str(tmp_path / "run")])
    assert script.algorithm == "dapo" and isinstance(config, QeRLDAPOConfig), type(config).__name__
    assert (config.epsilon_high, config.beta, config.dynamic_sampling) == (0.28, 0.0, True)


def test_plan_and_memory_budget_take_the_equals_spelling(capsys):
    """``--gpus=2`` and ``--memory-budget-gb=80`` (the spelling every other option takes) were refused as unknown
    options (TRL's "not used by the HfArgumentParser", "unknown option --memory-budget-gb"); they now mean what
    ``--gpus 2 --memory-budget-gb 80`` means."""
    main(["plan", "offline-default", "--gpus", "2", "--memory-budget-gb", "80"])
    spaced = capsys.readouterr().out
    main(["plan", "offline-default", "--gpus=2", "--memory-budget-gb=80"])
    assert capsys.readouterr().out == spaced and "2 GPUs" in spaced, spaced


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_bad_memory_budget_of_qerl_plan_is_named_as_qerl_plans(value, capsys, monkeypatch):
    """``qerl plan --memory-budget-gb abc`` said "qerl train: error: ...", the command the user did not run."""
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "offline-default", "--memory-budget-gb", value])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith("qerl plan: error: --memory-budget-gb must be"), err


def test_a_shipped_recipe_named_by_its_file_name_says_to_drop_the_suffix(tmp_path, monkeypatch):
    """``qerl train offline-default.yaml`` outside the recipes folder said only "no such file"; the shipped recipe of
    that name is run as ``qerl train offline-default``, which the line now says."""
    from qerl_trl.cli import recipe_path

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"recipe 'offline-default.yaml': no such file; the shipped recipe of that "
                                         r"name is 'qerl train offline-default'"):  # fmt: skip
        recipe_path("offline-default.yaml")
    with pytest.raises(UsageError, match=r"recipe 'mine.yaml': no such file$"):
        recipe_path("mine.yaml")


def test_a_recipes_single_name_for_a_list_option_is_a_list_of_one(tmp_path):
    """``rewards: format`` in a recipe was read letter by letter ("--rewards: unknown 'f', 'o', ..."), and
    ``lora_target_modules: q_proj`` reached PEFT as a string, which PEFT takes as a regex of whole module names (so
    it matched nothing); a YAML scalar for a list option now means a list of one, as ``--rewards format`` does."""
    from qerl_trl.cli import precheck_train_args

    recipe = tmp_path / "single.yaml"
    recipe.write_text((RECIPES_DIR / "offline-default.yaml").read_text()
                      + "rewards: format\nlora_target_modules: q_proj\n")  # fmt: skip
    argv = [str(recipe), "--output_dir", str(tmp_path / "run")]
    for script, config in (precheck_train_args(argv), parse_train_args(argv)):
        assert (script.rewards, config.lora_target_modules) == (["format"], ["q_proj"])


@pytest.mark.parametrize("argv", [["--limit", "3"], ["--task_options", '{"n_examples": 2}']])
def test_a_training_set_smaller_than_one_generation_round_is_one_line(argv, tmp_path, capsys, monkeypatch):
    """Fewer prompts than one generation round takes (generation_batch_size / num_generations: 32 / 8 = 4 in the
    offline recipe) gave the sampler no batch: transformers logged "stopping training at step 0" and the run saved an
    untrained adapter, exit 0. Now one line before the model loads."""
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv, "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "fewer than the 4 one generation round takes" in err and "nothing would be trained" in err, err
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_model_folder_whose_config_json_is_not_json_is_one_line(command, tiny_dir, tmp_path, capsys, monkeypatch):
    """A model folder whose config.json is cut short passed the checks: ``qerl eval`` then ended in transformers'
    OSError traceback, ``qerl train`` the same once the run had started; now one line before anything loads."""
    import shutil

    monkeypatch.delenv("QERL_DEBUG", raising=False)
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "config.json").write_text('{"model_type": "llama", ')
    option = "--model_name_or_path" if command == "train" else "--model"
    with pytest.raises(SystemExit) as exit_info:
        main([command, option, str(model), "--output_dir" if command == "train" else "--output", str(tmp_path / "o"),
              "--task", "arithmetic"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{option} {str(model)!r}: config.json is not readable JSON" in err, err


def test_graph_engine_prompts_longer_than_its_cache_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """``rollout_engine: graph`` decodes into a KV cache of fixed length (generation_prompt_cache_len +
    max_completion_length): a training prompt longer than generation_prompt_cache_len stopped the run with a traceback
    at the step whose batch drew it, after the model had loaded (a minute on this CPU; on a GPU run perhaps hours of
    training in). Now one line before the model loads, naming the longest prompt and the setting to raise."""
    import time

    import qerl_trl.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.delenv("QERL_DEBUG", raising=False)
    monkeypatch.setattr(qerl_trl.trainer.QeRLGRPOTrainer, "__init__", no_model)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--rollout_engine", "graph", "--generation_prompt_cache_len", "16", "--output_dir",
              str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "generation_prompt_cache_len 16" in err and "longest training prompt is 62 tokens" in err, err
    assert time.perf_counter() - start < 10
    assert not (tmp_path / "run").exists()
    # a generation_kwargs max_cache_len fixes the cache instead: 62 + 12 new tokens do not fit 70 either
    with pytest.raises(SystemExit):
        main(["train", "--rollout_engine", "graph", "--generation_kwargs", '{"max_cache_len": 70}', "--output_dir",
              str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "max_cache_len" in err and "62 tokens" in err, err
    # the boundary: a cache that holds the longest prompt exactly passes
    from qerl_trl.cli import check_prompt_lengths
    from qerl_trl.validation import load_train_data

    script, config = parse_train_args(["--rollout_engine", "graph", "--generation_prompt_cache_len", "62",
                                       "--output_dir", str(tmp_path / "run")])  # fmt: skip
    check_prompt_lengths(script, config, load_train_data(script, config))
    config.generation_prompt_cache_len = 61
    with pytest.raises(UsageError, match="raise it to >= 62"):
        check_prompt_lengths(script, config, load_train_data(script, config))


def test_a_model_without_a_chat_template_is_one_line_before_it_loads(base_dir, tmp_path, capsys, monkeypatch):
    """Every task's prompts are chat messages: a model whose tokenizer has no chat template (a base model) loaded,
    started training and stopped at the first generation in transformers' "Cannot use chat template functions"
    traceback. Now one line naming the model, before it loads."""
    import qerl_trl.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    base = base_dir
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    monkeypatch.setattr(qerl_trl.trainer.QeRLGRPOTrainer, "__init__", no_model)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model_name_or_path", str(base), "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"qerl train: error: --model_name_or_path '{base}': ") and "no chat template" in err, err


@pytest.mark.parametrize("option", ["--eval_strategy", "--eval-strategy"])
def test_an_evaluation_strategy_is_one_line_before_anything_loads(option, tmp_path, capsys, monkeypatch):
    """``qerl train --eval_strategy steps`` (an option its --help lists) loaded and quantized the policy, then
    stopped in transformers' 'you didn't pass an eval_dataset' traceback: qerl train has no evaluation set. Now one
    line before anything loads, pointing to qerl eval; 'no' (the default) still passes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", option, "steps", "--max_steps", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("qerl train: error: --eval_strategy 'steps': ") and "qerl eval" in err, err
    script_args, config = parse_train_args(["--eval_strategy", "no", "--max_steps", "1"])
    assert config.eval_strategy == "no"


def test_transformers_resume_from_checkpoint_is_not_ignored(tmp_path, capsys, monkeypatch):
    """``qerl train --resume_from_checkpoint runs/a/checkpoint-2 --output_dir runs/b`` (transformers' option, in
    qerl train --help, which its example scripts read) was parsed and never read: the run started afresh without a
    word. qerl train resumes with --resume; the transformers option is now one line naming it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--resume_from_checkpoint", "runs/a/checkpoint-2", "--output_dir", "runs/b", "--max_steps", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("qerl train: error: --resume_from_checkpoint 'runs/a/checkpoint-2': ") and "--resume" in err


@pytest.mark.parametrize("report_to, words", [
    ("nonsense", ["nonsense is not supported", "wandb"]),
    pytest.param("wandb", ["requires wandb to be installed", "pip install wandb"],
                 marks=pytest.mark.skipif(__import__("importlib").util.find_spec("wandb") is not None,
                                          reason="wandb is installed here")),
])  # fmt: skip
def test_a_reporting_integration_that_cannot_run_is_one_line_before_the_model_loads(report_to, words, tmp_path,
                                                                                    capsys, monkeypatch):  # fmt: skip
    """``qerl train --report_to wandb`` without wandb installed (or a name transformers does not know) loaded and
    quantized the policy, then stopped in transformers' RuntimeError / ValueError traceback as the trainer made its
    callbacks; now one line naming --report_to before the model loads."""
    import qerl_trl.cli

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(qerl_trl.cli, "train", no_model)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--report_to", report_to, "--max_steps", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"qerl train: error: --report_to {report_to}: ") and all(w in err for w in words), err


@pytest.mark.skipif(__import__("importlib").util.find_spec("mlflow") is not None, reason="mlflow is installed here")
def test_report_to_mlflow_without_mlflow_is_the_one_line_and_nothing_after_it(tmp_path):
    """From the shell: ``qerl train --report_to mlflow`` without mlflow printed the one-line error, then, as the process
    ended, "Exception ignored in: <function MLflowCallback.__del__ ...>" and its AttributeError traceback: the check
    made the callback to see whether it could run, and the half-built one's ``__del__`` read an attribute its
    ``__init__`` never set. Now stderr is the one line, nothing after it."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "QERL_DEBUG"}
    done = subprocess.run([_qerl(), "train", "--report_to", "mlflow", "--max_steps", "1"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines() == [
        "qerl train: error: --report_to mlflow: MLflowCallback requires mlflow to be installed. Run `pip install mlflow`."
    ], done.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_push_to_hub_while_the_hub_is_offline_is_one_line_before_anything_loads(tmp_path, capsys, monkeypatch):
    """``qerl train --push_to_hub true`` with HF_HUB_OFFLINE set loaded and quantized the policy, then stopped in
    huggingface_hub's OfflineModeIsEnabled traceback as the trainer created the Hub repo (nvfp4-quantize
    --push-to-hub says so in one line); now one line naming the option and HF_HUB_OFFLINE before anything loads."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--push_to_hub", "true", "--max_steps", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("qerl train: error: --push_to_hub: ") and "HF_HUB_OFFLINE" in err, err


def _complete_checkpoint(folder: Path, step: int, **adapter: object) -> Path:
    """A checkpoint folder that passes check_checkpoint (AQN on): adapter (its config's fields as given), trainer
    state at ``step``, optimizer, scheduler, AQN state."""
    from aqn import AQNController, make_schedule
    from safetensors.torch import save_file
    from transformers import TrainerState

    folder.mkdir(parents=True)
    save_file({"lora_A": torch.ones(4, 8)}, folder / "adapter_model.safetensors")
    config = {"r": 32, "lora_alpha": 32, "base_model_name_or_path": "offline-default", "peft_type": "LORA",
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps({**config, **adapter}))
    TrainerState(global_step=step, max_steps=step, train_batch_size=8).save_to_json(str(folder / "trainer_state.json"))
    torch.save({}, folder / "optimizer.pt")
    torch.save({}, folder / "scheduler.pt")
    aqn = AQNController(make_schedule("exponential", 1e-2, 5e-4, 5, total_steps=20))
    (folder / "aqn_state.json").write_text(json.dumps(aqn.state_dict()))
    return folder


def _refused_before_the_model_loads(argv: list[str], capsys, monkeypatch) -> str:
    """``qerl train ARGV``'s one line (exit 2), checking that no model was loaded."""
    import qerl_trl.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.delenv("QERL_DEBUG", raising=False)
    monkeypatch.setattr(qerl_trl.trainer.QeRLGRPOTrainer, "__init__", no_model)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_resume_with_other_lora_target_modules_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """--resume of a checkpoint whose adapter covers all seven projections with --lora_target_modules q_proj v_proj
    loaded the policy, then failed in torch's optimizer.load_state_dict ("loaded state dict contains a parameter group
    that doesn't match the size of optimizer's group", a traceback). Now one line naming both sets, before the load."""
    from qerl_trl.cli import precheck_train_args

    ckpt = _complete_checkpoint(tmp_path / "run" / "checkpoint-4", 4)
    err = _refused_before_the_model_loads(["--output_dir", str(tmp_path / "run"), "--resume", str(ckpt),
                                           "--lora_target_modules", "q_proj", "v_proj"], capsys, monkeypatch)  # fmt: skip
    assert f"--resume '{ckpt}'" in err and "'q_proj', 'v_proj'" in err and "down_proj" in err, err
    assert "--lora_target_modules down_proj gate_proj k_proj o_proj q_proj up_proj v_proj" in err, err
    # the same modules in another order are the same adapter
    script, _ = precheck_train_args(["--output_dir", str(tmp_path / "run"), "--resume", str(ckpt),
                                     "--lora_target_modules", *reversed(json.loads(
                                         (ckpt / "adapter_config.json").read_text())["target_modules"])])  # fmt: skip
    assert script.resume == str(ckpt)
    # PEFT's all-linear saves every module's full name: the run's projection names are the same adapter
    full = [f"model.layers.{i}.{m}" for i in range(2) for m in ["self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]]  # fmt: skip
    named = _complete_checkpoint(tmp_path / "full" / "checkpoint-4", 4, target_modules=full)
    assert precheck_train_args(["--output_dir", str(tmp_path / "full"), "--resume", str(named)])[0].resume == str(named)


def test_a_resume_with_another_lora_alpha_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """--resume with another --lora_alpha than the checkpoint's adapter (or the default, = lora_r, against an adapter
    trained with another alpha) trained on with the adapter's weights rescaled by the new alpha / r: the resumed
    policy was not the checkpoint's, without a word. Now one line naming both alphas, before the model loads."""
    from qerl_trl.cli import precheck_train_args

    ckpt = _complete_checkpoint(tmp_path / "run" / "checkpoint-4", 4)
    err = _refused_before_the_model_loads(["--output_dir", str(tmp_path / "run"), "--resume", str(ckpt),
                                           "--lora_alpha", "64"], capsys, monkeypatch)  # fmt: skip
    assert f"--resume '{ckpt}'" in err and "lora_alpha 32" in err and "64" in err and "--lora_alpha 32" in err, err
    halved = _complete_checkpoint(tmp_path / "other" / "checkpoint-4", 4, lora_alpha=16)
    err = _refused_before_the_model_loads(["--output_dir", str(tmp_path / "other"), "--resume", str(halved)], capsys,
                                          monkeypatch)  # fmt: skip
    assert "lora_alpha 16" in err and "--lora_alpha 16" in err, err
    script, _ = precheck_train_args(["--output_dir", str(tmp_path / "other"), "--resume", str(halved),
                                     "--lora_alpha", "16"])  # fmt: skip
    assert script.resume == str(halved)


@pytest.mark.parametrize("max_steps", [2, 4])
def test_a_resume_from_a_checkpoint_at_or_past_max_steps_is_one_line_before_the_model_loads(max_steps, tmp_path,
                                                                                            capsys, monkeypatch):  # fmt: skip
    """--resume of checkpoint-4 with --max_steps 2 (or 4) loaded the policy, trained 0 steps, rewrote final/ and
    printed "qerl train: 0 steps in ... s" with exit 0 (minutes of loading for a 7B model, nothing done). Now one line
    naming the checkpoint's step and max_steps, before the model loads; a larger max_steps resumes."""
    from qerl_trl.cli import precheck_train_args

    ckpt = _complete_checkpoint(tmp_path / "run" / "checkpoint-4", 4)
    err = _refused_before_the_model_loads(["--output_dir", str(tmp_path / "run"), "--resume", "true",
                                           "--max_steps", str(max_steps)], capsys, monkeypatch)  # fmt: skip
    assert f"--resume true: {ckpt} is at step 4" in err and f"max_steps {max_steps}" in err, err
    assert "nothing to train" in err and "--max_steps" in err, err
    script, _ = precheck_train_args(["--output_dir", str(tmp_path / "run"), "--resume", "true", "--max_steps", "5"])
    assert script.resume == "true"


@pytest.mark.parametrize("resume", ["true", "checkpoint-4"])
def test_overwrite_output_dir_with_resume_is_one_line_before_the_model_loads(resume, tmp_path, capsys, monkeypatch):
    """--overwrite_output_dir true (start afresh, replacing the earlier run) with --resume (continue it) contradict
    each other; the resume won and the overwrite was dropped without a word. Now one line naming both."""
    ckpt = _complete_checkpoint(tmp_path / "run" / "checkpoint-4", 4)
    resume = str(ckpt) if resume != "true" else resume
    err = _refused_before_the_model_loads(["--output_dir", str(tmp_path / "run"), "--resume", resume, "--max_steps",
                                           "8", "--overwrite_output_dir", "true"], capsys, monkeypatch)  # fmt: skip
    assert "--overwrite_output_dir" in err and "--resume" in err and "either" in err, err


def test_overwrite_output_dir_with_a_checkpoint_of_another_folder_replaces_the_earlier_run(tmp_path, monkeypatch):
    """--resume of another folder's checkpoint into an output_dir holding an earlier run, with --overwrite_output_dir
    true: the resume is no contradiction, and the earlier run is moved aside as for a fresh start (the overwrite was
    dropped: its checkpoint-9 stayed beside the new run's, for --resume true to pick)."""
    import qerl_trl.cli as cli
    from qerl_trl.checkpoints import ResumePoint
    from qerl_trl.validation import TrainInputs

    class FailingTrainer:  # stops where training would start: what was moved aside is what counts
        def add_callback(self, callback):
            pass

        def train(self, resume_from_checkpoint=None):
            raise KeyboardInterrupt

        def close(self):
            pass

    ckpt = _complete_checkpoint(tmp_path / "a" / "checkpoint-4", 4)
    earlier = _complete_checkpoint(tmp_path / "b" / "checkpoint-9", 9)
    argv = ["--output_dir", str(tmp_path / "b"), "--resume", str(ckpt), "--max_steps", "8",
            "--overwrite_output_dir", "true"]  # fmt: skip
    script, config = parse_train_args(argv)
    monkeypatch.setattr(cli, "build_trainer", lambda *args, **kwargs: FailingTrainer())
    with pytest.raises(KeyboardInterrupt):
        cli.train(script, config, TrainInputs(dataset=None, resume=ResumePoint(str(ckpt))))
    assert not earlier.exists() and [p.name for p in (tmp_path / "b").glob(".previous-run-*/*")] == ["checkpoint-9"]


def test_data_seed_which_grpo_ignores_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """TrainingArguments' --data_seed ("random seed to be used with data samplers") was taken and ignored: TRL's GRPO
    sampler (RepeatSampler) and DAPO's refills order the prompts by seed, so --data_seed 7 trained on the same prompts
    in the same order as without it. Now one line naming it and --seed, before anything loads."""
    monkeypatch.delenv("QERL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--data_seed", "7", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "data_seed" in err and "got 7" in err and "seed" in err.split("data_seed", 2)[-1], err
    with pytest.raises(ValueError, match="data_seed"):
        QeRLConfig(output_dir=str(tmp_path / "run"), data_seed=7)
    assert QeRLConfig(output_dir=str(tmp_path / "run")).data_seed is None
    assert QeRLConfig(output_dir=str(tmp_path / "run"), seed=3, data_seed=3).data_seed == 3  # the order seed gives


def test_overwrite_output_dir_keeps_the_calibrated_policy_cache(tmp_path):
    """--overwrite_output_dir moved everything in output_dir aside, the calibrated policy cache (calibrated/, the
    default calibration_cache_dir, keyed by model, method and prompts) too, and removed it at the first checkpoint:
    the repeated run calibrated again (minutes for a 7B awq / gptq policy), where the config says a repeated run loads
    it. The cache now stays; the earlier run's own files are moved aside as before."""
    from qerl_trl.run import move_earlier_run_aside

    run = tmp_path / "run"
    cached = run / "calibrated" / "tiny-awq-0123456789ab" / "model.safetensors"
    cached.parent.mkdir(parents=True)
    cached.write_text("weights")
    (run / "checkpoint-2").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    aside = move_earlier_run_aside(run)
    assert cached.is_file() and sorted(p.name for p in aside.iterdir()) == ["checkpoint-2", "metrics.jsonl"]
    assert move_earlier_run_aside(run) is None  # nothing but the cache (and the aside folder) left to move


def test_the_closing_lines_name_the_adapter_when_no_step_logged_a_reward(tmp_path, capsys):
    """With --logging_steps above the steps run (--logging_steps 50 --max_steps 20) no step logs a reward, and qerl
    train ended with no closing line at all: not the steps run, nor where the adapter went (and no plots.png was
    drawn, which nothing said). The closing lines now come whatever was logged, saying why there is no reward."""
    from types import SimpleNamespace

    from qerl_trl.cli import _print_summary

    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path), logging_steps=50),
                              state=SimpleNamespace(global_step=20, log_history=[{"train_runtime": 3.0, "step": 20}]))  # fmt: skip
    _print_summary(trainer, 3.0, tmp_path / "final", 20)
    out = capsys.readouterr().out
    assert "qerl train: 20 steps in 3 s" in out and f"adapter: {tmp_path / 'final'}" in out, out
    assert "no step logged a reward" in out and "logging_steps 50" in out and "plots:" not in out, out


def test_a_run_folder_records_its_recipe_and_overrides_as_a_recipe_qerl_train_reads_back(tmp_path, tiny_dir):
    """A run folder held the adapter, checkpoints and metrics but not what made them: which recipe, which command-line
    overrides (transformers' training_args.bin is a pickle of the trainer config alone). ``qerl train`` now writes
    ``<output_dir>/recipe.yaml``: the recipe with the overrides applied, headed by the recipe's name and the command,
    which ``qerl train`` reads back into the same script arguments and trainer config; a resumed run rewrites it."""
    import dataclasses
    import shlex

    import yaml
    from qerl_trl.cli import precheck_train_args

    out = tmp_path / "run"
    argv = ["offline-default", "--model_name_or_path", str(tiny_dir), "--output_dir", str(out),
            "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "6",
            "--task_options", json.dumps({"n_examples": 32}), "--disable_tqdm", "true", "--max_steps", "1",
            "--save_steps", "1", "--learning_rate", "3e-4", "--lora_target_modules", "q_proj", "v_proj", "--vllm",
            '{"max_model_len": 256}']  # fmt: skip
    main(["train", *argv])
    record = out / "recipe.yaml"
    lines = record.read_text().splitlines()
    assert lines[1] == "# recipe: offline-default (shipped)", lines[:4]
    assert shlex.split(lines[2].removeprefix("# command: ")) == ["qerl", "train", *argv], lines[2]
    saved = yaml.safe_load(record.read_text())
    assert (saved["model_name_or_path"], saved["quantization"], saved["learning_rate"]) == (str(tiny_dir), "nvfp4-rtn",
                                                                                            3e-4)  # fmt: skip
    assert saved["lora_target_modules"] == ["q_proj", "v_proj"] and saved["vllm"] == {"max_model_len": 256}
    assert saved["task_options"] == {"n_examples": 32} and saved["aqn_sigma_start"] == 0.01  # override, recipe
    script, config = parse_train_args(argv)
    again_script, again = parse_train_args([str(record)])  # fed back: the same run
    assert dataclasses.asdict(again_script) == dataclasses.asdict(script) and again.to_dict() == config.to_dict()
    precheck_train_args([str(record), "--output_dir", str(tmp_path / "again")])  # a fresh run of it is accepted
    resumed = [*argv[:-11], "--max_steps", "2", "--save_steps", "1", "--resume", "true", *argv[-7:]]
    main(["train", *resumed])  # continued: the record is its command now
    saved = yaml.safe_load(record.read_text())
    assert saved["max_steps"] == 2 and "resume" not in saved
    assert "--resume true" in record.read_text().splitlines()[2]


def test_qerl_train_reads_its_recipe_and_parses_its_overrides_once(tmp_path, monkeypatch):
    """``qerl train`` read the recipe file three times (the check before TRL, the parse, the run's record) and parsed
    its command-line overrides twice (the check, the record); issue #48: once each per invocation, the one result
    handed on. Counted through spies that delegate to the real functions, up to the run's start (``train``)."""
    import qerl_trl.arguments
    import qerl_trl.cli

    calls = {"read": 0, "parse": 0}

    def counted(name: str, real):
        def spy(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return spy

    class Started(Exception):
        """Where the run would load the model: the parsing is over."""

    def started(script_args, config, inputs=None, *, recipe=None):
        raise Started(recipe)

    monkeypatch.setattr(qerl_trl.cli, "_read_recipe", counted("read", qerl_trl.cli._read_recipe))
    monkeypatch.setattr(qerl_trl.arguments, "_parse_command_line",
                        counted("parse", qerl_trl.arguments._parse_command_line))  # fmt: skip
    monkeypatch.setattr(qerl_trl.cli, "train", started)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Started) as run:
        main(["train", "offline-default", "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--task_options",
              json.dumps({"n_examples": 16}), "--vllm", '{"max_model_len": 256}'])  # fmt: skip
    assert calls == {"read": 1, "parse": 1}, calls
    recorded = run.value.args[0]
    assert "# recipe: offline-default (shipped)" in recorded and "max_model_len: 256" in recorded, recorded


@pytest.mark.parametrize("change", ["quantization", "model"])
def test_a_resume_with_another_quantization_or_model_is_one_line_before_the_model_loads(change, tmp_path, tiny_dir,
                                                                                         capsys, monkeypatch):  # fmt: skip
    """--resume of a run made with --quantization nvfp4-rtn, asked with nvfp4-mse (or none), or of a run on one model
    asked with another of the same shapes: the checkpoint's adapter and optimizer were loaded onto the other policy
    and trained on without a word. The run folder's recipe.yaml records both; one line names the saved value and the
    requested one, before the model loads. The same values in another spelling (an alias, another path to the same
    folder) continue it."""
    from qerl_trl.cli import TrainInvocation, precheck_train_args, run_recipe

    run = tmp_path / "run"
    made = ["--model_name_or_path", str(tiny_dir), "--output_dir", str(run), "--max_steps", "8"]
    ckpt = _complete_checkpoint(run / "checkpoint-4", 4)  # the run's checkpoint and record, as qerl train writes
    invocation = TrainInvocation.from_argv(made)
    (run / "recipe.yaml").write_text(run_recipe(invocation, *parse_train_args(invocation)))
    if change == "quantization":
        for asked in ("nvfp4-mse", "none"):
            err = _refused_before_the_model_loads([*made, "--resume", "true", "--quantization", asked], capsys,
                                                  monkeypatch)  # fmt: skip
            assert err.startswith(f"qerl train: error: --resume true: the run in '{run}' (recipe.yaml) was trained "
                                  f"with --quantization 'nvfp4-rtn', this run asks for '{asked}'"), err  # fmt: skip
            assert "pass --quantization nvfp4-rtn to continue it" in err, err
    else:
        other = tmp_path / "other-model"
        other.symlink_to(tiny_dir)  # another folder name, but...
        assert precheck_train_args([*made[2:], "--model_name_or_path", str(other), "--resume", "true"])[0].resume
        import shutil

        other.unlink()
        shutil.copytree(tiny_dir, other)  # ...another model (the same shapes)
        err = _refused_before_the_model_loads([*made[2:], "--model_name_or_path", str(other), "--resume", str(ckpt)],
                                              capsys, monkeypatch)  # fmt: skip
        assert f"--resume '{ckpt}': the run in '{run}' (recipe.yaml) was trained on --model_name_or_path " in err, err
        assert f"'{tiny_dir}', this run asks for '{other}'" in err and f"--model_name_or_path {tiny_dir} " in err, err
    script, config = precheck_train_args([*made, "--resume", "true", "--quantization", "rtn"])  # an alias: the same
    assert script.resume == "true" and config.quantization == "nvfp4-rtn"
