"""Smoke test of the GPU learning study's harness (issue #21) on CPU: ``learning_study.py --gpu --tiny``.

Two arms (bf16 + LoRA and NVFP4 + LoRA + AQN at a constant σ) of the arithmetic curriculum, 2 real ``qerl train``
steps each on the offline default model, then ``qerl eval`` (greedy pass@1, sampled pass@4) of the base models and
of the step-2 adapters; checks the JSON, the summary table and the figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "learning_study.py"


def test_learning_study_gpu_tiny(tmp_path):
    out = tmp_path / "study.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    arms = "bf16+LoRA,NVFP4+LoRA+AQN const σ"
    cmd = [sys.executable, str(SCRIPT), "--gpu", "--tiny", "--tasks", "arithmetic", "--arms", arms, "--parallel", "2",
           "--runs", str(tmp_path / "runs"), "--logs", str(tmp_path / "logs"), "--json", str(out),
           "--png-dir", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| arithmetic | NVFP4+LoRA+AQN const σ | 1 |" in p.stdout
    data = json.loads(out.read_text())
    assert data["settings"]["tiny"] and data["settings"]["eval_at"] == [0, 2]
    task = data["tasks"]["arithmetic"]
    for quant in ("none", "rtn"):
        assert task["base_eval"][quant]["greedy_pass@1"] is not None
        assert task["base_eval"][quant]["sampled_pass@4"] is not None
    for arm in arms.split(","):
        (run,) = task["arms"][arm]["seeds"].values()
        assert run["finished"] and run["steps_logged"] == 2
        assert all(v is not None for v in run["reward"] + run["entropy"] + run["completion_length"])
        assert set(run["eval"]) == {"0", "2"}
        assert run["eval"]["2"]["greedy_pass@1"] is not None and run["eval"]["2"]["sampled_pass@4"] is not None
    const = task["arms"]["NVFP4+LoRA+AQN const σ"]["seeds"]["0"]["aqn_sigma"]
    assert const == [0.01, 0.01]  # the ablation's σ never decays
    assert {r["arm"] for r in data["summary"]} == set(arms.split(","))
    assert (tmp_path / "learning_study_gpu_arithmetic.png").stat().st_size > 10_000
