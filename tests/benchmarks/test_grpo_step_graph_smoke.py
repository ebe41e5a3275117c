"""Smoke test of ``benchmarks/grpo_step.py --rollout-engine graph``: the tiny NVFP4 + LoRA arm through the real trainer
on CPU with ``QeRLConfig.rollout_engine="graph"`` (``qerl_trl.graph_generate``, its decode step compiled by dynamo
without inductor), checking that the engine reaches the worker, is recorded, and that the fixed-length completions and
the compiled decode (no recompile on the measured steps) hold as on the transformers path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "grpo_step.py"


def test_grpo_step_tiny_nvfp4_graph_engine(tmp_path):
    out = tmp_path / "grpo_graph.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--arms", "nvfp4", "--compile-backend", "eager"]
    cmd += ["--rollout-engine", "graph", "--prompt-len", "12", "--completion-len", "6", "--steps", "2"]
    cmd += ["--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| tiny | NVFP4 + LoRA (ours) | graph |" in p.stdout

    data = json.loads(out.read_text())
    assert data["settings"]["rollout_engine"] == "graph" and "graph_generate" in data["benchmark"]
    (res,) = data["results"]
    assert res["status"] == "ok", res
    assert res["rollout_engine"] == "graph"
    assert res["generation_config"]["compile_config"]["backend"] == "eager"
    for step in res["warmup_steps"] + res["steps"]:
        assert step["gen_s"] > 0 and step["loss_fwd_s"] > 0 and step["backward_s"] > 0
        assert step["completions"] == 8
        assert step["completion_len_min"] == step["completion_len_max"] == 6
        assert step["prefill_s"] == 0  # the timer on transformers' ``_prefill`` never ran: generate was not used
    s = res["summary"]
    assert s["completion_lengths_ok"] and s["advantages_nonzero"] and s["gen_tok_s"] > 0
    assert s["dynamo_warmup"]["unique_graphs"] >= 1  # graph_generate's decode step compiled on the warm-up step ...
    assert s["compiled_path_ok"], s["dynamo_measured"]  # ... and replayed without recompiling afterwards
