"""The formats comparison of the learning study (issue #22): each new arm becomes a ``qerl train`` command and
``qerl eval`` argument lists that the real parsers accept with the intended format, and ``--formats`` wires the
preset arms, the output names and the figure (an empty run folder, ``--plot-only``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "learning_study.py"
sys.path.insert(0, str(REPO / "benchmarks"))  # plot_gpu imports benchmarks/common, as the script run from there does


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("learning_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("arm", "quantization", "aqn"),
    [("NVFP4+LoRA+AQN", "nvfp4-rtn", True), ("MXFP4+LoRA+AQN", "mxfp4-rtn", True), ("NF4 (QLoRA)", "nf4", False),
     ("NF4+LoRA+AQN", "nf4", True)],
)  # fmt: skip
def test_arm_to_train_and_eval_arguments(study, tmp_path, arm, quantization, aqn):
    from qerl_trl.cli import parse_train_args
    from qerl_trl.evaluation import build_parser

    assert arm in study.GPU_ARMS and arm in study.GPU_COLORS
    cmd = study.gpu_train_cmd("arithmetic", arm, 1, 150, [0, 75, 150], tmp_path / "run", tiny=False)
    assert cmd[1:4] == ["-m", "qerl_trl.cli", "train"]
    script, config = parse_train_args(cmd[4:])
    assert (config.quantization, config.aqn, config.seed, config.max_steps) == (quantization, aqn, 1, 150)
    assert script.model_name_or_path == "offline-default" and config.rollout_engine == "graph"
    if aqn:
        assert (config.aqn_schedule, config.aqn_sigma_start, config.aqn_sigma_end) == ("exponential", 1e-2, 5e-4)
    # everything but the format (and AQN) as the NVFP4 + AQN arm of the same seed
    ref = study.gpu_train_cmd("arithmetic", "NVFP4+LoRA+AQN", 1, 150, [0, 75, 150], tmp_path / "run", tiny=False)
    _, ref_config = parse_train_args(ref[4:])
    same = ("learning_rate", "per_device_train_batch_size", "num_generations", "lora_r", "max_completion_length",
            "save_steps", "temperature")  # fmt: skip
    assert all(getattr(config, k) == getattr(ref_config, k) for k in same)
    for argv in study._gpu_eval_argvs("arithmetic", study.GPU_ARMS[arm]["quantization"], tmp_path / "e",
                                      tmp_path / "run" / "final", tiny=False):  # fmt: skip
        assert build_parser().parse_args(argv).quantization.name == quantization


@pytest.mark.parametrize(("arm", "precision", "correction"),
                         [("NVFP4+LoRA+AQN vLLM", "w4a16", False), ("NVFP4+LoRA+AQN vLLM FP8", "fp8", True)])
def test_fp8_parity_arms_roll_out_on_vllm_with_their_default_correction(study, tmp_path, arm, precision, correction):
    """``--fp8`` (issue #51): the NVFP4 + AQN recipe of the GPU study with vLLM rollouts, W4A16 or FP8, each with
    QeRL's default importance-sampling correction (vLLM returns the sampling logprobs it needs), a small engine each."""
    from qerl_trl.cli import parse_train_args

    assert study.PRESETS["fp8"][1] == ["NVFP4+LoRA+AQN vLLM", "NVFP4+LoRA+AQN vLLM FP8"] and arm in study.GPU_COLORS
    cmd = study.gpu_train_cmd("arithmetic", arm, 2, 150, [0, 75, 150], tmp_path / "run", tiny=False)
    _, config = parse_train_args(cmd[4:])
    assert (config.rollout_engine, config.rollout_precision, config.quantization, config.aqn) == (
        "vllm", precision, "nvfp4-rtn", True)
    assert config.vllm_importance_sampling_correction is correction and config.vllm.gpu_memory_utilization == 0.06
    _, tiny = parse_train_args(study.gpu_train_cmd("arithmetic", arm, 2, 2, [0, 2], tmp_path / "t", tiny=True)[4:])
    assert (tiny.rollout_engine, tiny.rollout_precision) == ("transformers", "w4a16")  # the CPU smoke's engine


def test_formats_preset_plot_only_writes_json_table_and_figure(tmp_path):
    out = tmp_path / "formats.json"
    cmd = [sys.executable, str(SCRIPT), "--formats", "--plot-only", "--runs", str(tmp_path / "runs"), "--json",
           str(out), "--png-dir", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["issue"] == 22 and data["benchmark"] == "learning_study_formats"
    assert list(data["tasks"]) == ["arithmetic"]
    assert list(data["tasks"]["arithmetic"]["arms"]) == ["NVFP4+LoRA+AQN", "MXFP4+LoRA+AQN", "NF4 (QLoRA)"]
    assert {"nf4", "mxfp4-rtn", "rtn"} <= set(data["tasks"]["arithmetic"]["base_eval"])
    assert "| arithmetic | MXFP4+LoRA+AQN | 0 |" in p.stdout
    assert (tmp_path / "learning_study_formats_arithmetic.png").is_file()


def test_arm_from_an_earlier_study(study, tmp_path):
    """``--arm-from ARM=JSON`` takes an arm stopped early from an earlier run, only when every step this run logged
    equals that run's (reward and entropy), and says so in the notes."""

    def arm(rewards):
        return {"seeds": {"0": {"reward": rewards, "entropy": [r / 2 for r in rewards], "eval": {}}}}

    earlier = {"date": "2026-11-24", "tasks": {"arithmetic": {"arms": {"NVFP4+LoRA": arm([0.1, 0.2, 0.3, 0.4])}}}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    res = {"tasks": {"arithmetic": {"arms": {"NVFP4+LoRA": arm([0.1, 0.2]), "bf16+LoRA": arm([0.5])}}}}
    study.take_arms_from(res, [f"NVFP4+LoRA={path}"])
    assert res["tasks"]["arithmetic"]["arms"]["NVFP4+LoRA"]["seeds"]["0"]["reward"] == [0.1, 0.2, 0.3, 0.4]
    assert res["tasks"]["arithmetic"]["arms"]["bf16+LoRA"]["seeds"]["0"]["reward"] == [0.5]
    assert "stopped it after 2 steps" in res["notes"][0]
    differs = {"tasks": {"arithmetic": {"arms": {"NVFP4+LoRA": arm([0.1, 0.25])}}}}
    with pytest.raises(SystemExit, match="not the same runs"):
        study.take_arms_from(differs, [f"NVFP4+LoRA={path}"])
    with pytest.raises(SystemExit, match="expected \\[TASK/\\]ARM=JSON"):
        study.take_arms_from(res, ["no-such-arm=x.json"])
    with pytest.raises(SystemExit, match="expected \\[TASK/\\]ARM=JSON"):
        study.take_arms_from(res, [f"no-such-task/NVFP4+LoRA={path}"])
    # TASK/ARM: only that task's arm is taken; another task's (a full run here, unlike the earlier one's) stays
    both = {"tasks": {"arithmetic": {"arms": {"NVFP4+LoRA": arm([0.1, 0.2])}},
                      "gsm8k": {"arms": {"NVFP4+LoRA": arm([0.0, 0.1, 0.2, 0.3, 0.4])}}}}
    earlier["tasks"]["gsm8k"] = {"arms": {"NVFP4+LoRA": arm([0.0])}}
    path.write_text(json.dumps(earlier))
    study.take_arms_from(both, [f"arithmetic/NVFP4+LoRA={path}"])
    assert both["tasks"]["arithmetic"]["arms"]["NVFP4+LoRA"]["seeds"]["0"]["reward"] == [0.1, 0.2, 0.3, 0.4]
    assert both["tasks"]["gsm8k"]["arms"]["NVFP4+LoRA"]["seeds"]["0"]["reward"] == [0.0, 0.1, 0.2, 0.3, 0.4]


def test_failed_eval_is_shown_and_retried_alone(study, tmp_path, capsys):
    """A ``qerl eval`` job that fails prints its log's end into the study's output (the logs may not outlive the
    device machine) and runs once more after all other jobs; here it fails for real both times (no adapter there)."""
    argvs = study._gpu_eval_argvs("arithmetic", "none", tmp_path / "eval-75", tmp_path / "no-adapter", tiny=True)
    log = tmp_path / "eval.log"
    assert study._run_eval_job(argvs[:1], log) != 0
    out = capsys.readouterr().out
    assert "[fail] eval rc" in out and "no-adapter" in out  # the error names the missing adapter
    assert study._FAILED_EVALS == [(argvs[:1], log)]
    study.launch_gpu([], [], [0], 2, [0, 2], tmp_path / "runs", tmp_path, parallel=1, tiny=True)
    out = capsys.readouterr().out
    assert "eval retried alone (eval.log): rc" in out and "rc 0" not in out
    assert (tmp_path / "eval.retry.log").is_file() and study._FAILED_EVALS == []


def test_gsm8k_runs_score_the_whole_batch_and_eval_in_one_batch(study, tmp_path, monkeypatch):
    """GSM8K runs score their 16 sequences in one forward (the recipe's ``logprob_batch_size: 2`` is for CPU host
    memory and costs 8x the ops per step: ``benchmarks/loss_op_count.py``); the arithmetic runs keep the recipe's value
    so that the recorded ones re-run identically. GSM8K evals are one batch of the 200 problems."""
    from qerl_trl.cli import parse_train_args
    from qerl_trl.evaluation import build_parser

    data = study.GSM8K_DIR
    if not (data / "train.jsonl").is_file():  # a checkout without ../shared: one-line splits will do
        data = tmp_path / "gsm8k"
        data.mkdir()
        for split in ("train", "test"):
            (data / f"{split}.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    monkeypatch.setenv("QERL_GSM8K", str(data))
    for task, size in (("gsm8k", 16), ("arithmetic", 2)):
        cmd = study.gpu_train_cmd(task, "NVFP4+LoRA+AQN", 0, 150, [0, 75, 150], tmp_path / "run", tiny=False)
        _, config = parse_train_args(cmd[4:])
        assert config.logprob_batch_size == size and config.gradient_checkpointing
    argv = study._gpu_eval_argvs("gsm8k", "rtn", tmp_path / "e", None, tiny=False)[1]
    args = build_parser().parse_args(argv)
    assert (args.batch_size, args.limit, args.n_samples) == (200, 200, 4)


def test_stopped_study_says_so_on_its_figure(study, tmp_path, monkeypatch):
    """A study cut short (here 3 of 150 steps logged) is titled with the steps it reached, not the steps it meant to."""
    import matplotlib.figure

    titles = []
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda self, t, **k: titles.append(t))
    seed = {"steps_logged": 3, "reward": [0.0, 0.1, 0.2], "entropy": [2.0, 2.1, 2.2], "aqn_sigma": [0.0] * 3,
            "completion_length": [9.0] * 3, "eval": {}}  # fmt: skip
    res = {"device": "H100", "settings": {"steps": 150, "eval_at": [0, 75, 150]},
           "tasks": {"gsm8k": {"base_eval": {}, "arms": {"bf16+LoRA": {"seeds": {"0": seed}}}}}}  # fmt: skip
    study.plot_gpu(res, tmp_path)
    assert titles and "stopped at steps 3-3 of 150" in titles[0]
