"""Smoke test of ``benchmarks/grpo_step.py`` (issue #7): one tiny NVFP4 + LoRA arm through the real trainer on CPU.

Runs the script as a user would (a subprocess, which itself runs the arm in a fresh worker process), with the decode
compiled by dynamo without inductor (``--compile-backend eager``: the same guards and graph breaks as the H100 run,
seconds to compile), and checks the JSON: every phase timed, fixed completion lengths, non-zero advantages, and the
compiled decode not recompiling on the measured steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from result_schema import assert_fields_of

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "grpo_step.py"


def _run(tmp_path: Path, *extra: str) -> tuple[str, dict]:
    """Run the script on the tiny NVFP4 + LoRA arm (2 measured steps, 6-token completions); (stdout, its JSON)."""
    out = tmp_path / "grpo.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--arms", "nvfp4", "--compile-backend", "eager", *extra]
    cmd += ["--prompt-len", "12", "--steps", "2", "--out", str(out)]
    if "--completion-len" not in extra:
        cmd += ["--completion-len", "6"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, json.loads(out.read_text())


def test_grpo_step_tiny_nvfp4(tmp_path):
    stdout, data = _run(tmp_path)
    assert "| tiny | NVFP4 + LoRA (ours) |" in stdout
    assert data["world_size"] == 1 and "versions" in data and "date" in data
    (res,) = data["results"]
    assert res["status"] == "ok", res
    assert res["generation_config"]["min_new_tokens"] == 6
    assert res["generation_config"]["cache_implementation"] == "static"
    assert len(res["warmup_steps"]) == 1 and len(res["steps"]) == 2
    for step in res["warmup_steps"] + res["steps"]:
        for key in ("step_s", "gen_s", "prefill_s", "aqn_s", "decode_s", "score_s", "loss_fwd_s", "backward_s"):
            assert step[key] > 0, (key, step)
        assert step["optimizer_s"] >= 0 and step["clip_s"] >= 0
        assert step["completions"] == 8
        assert step["completion_len_min"] == step["completion_len_max"] == 6
        assert step["adv_abs_mean"] > 0 and step["adv_std"] > 0
        assert step["trl_log"]["reward_std"] > 0
        parts = step["gen_s"] + step["score_s"] + step["loss_fwd_s"] + step["backward_s"] + step["optimizer_s"]
        assert parts <= step["step_s"] * 1.05
    s = res["summary"]
    assert s["completion_lengths_ok"] and s["advantages_nonzero"]
    assert s["gen_tok_s"] > 0 and s["warmup_step_s"] > 0
    assert s["dynamo_warmup"]["unique_graphs"] >= 1  # the decode was compiled on the warm-up step ...
    assert s["compiled_path_ok"], s["dynamo_measured"]  # ... and replayed without recompiling afterwards


def test_grpo_step_tiny_nvfp4_graph_engine(tmp_path):
    """``--rollout-engine graph``: ``QeRLConfig.rollout_engine="graph"`` (``qerl_trl.rollout.graph.generate``, its decode step
    compiled by dynamo without inductor) reaches the worker and is recorded; fixed-length completions and the compiled
    decode (no recompile on the measured steps) hold as on the transformers path."""
    stdout, data = _run(tmp_path, "--rollout-engine", "graph")
    assert "| tiny | NVFP4 + LoRA (ours) | graph |" in stdout
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
    # every field of the latest committed H100 run (BENCHMARKS.md's 7B step at the recipe's batch), GPU memory aside
    assert_fields_of("grpo_step_7b_b128_no_cudnn.json", data, skip=("$.configs.",))  # configs: by model name


def test_grpo_step_tiny_spread_lengths_in_waves(tmp_path):
    """``--eos-mean-tokens`` / ``--min-new-tokens``: completions of spread lengths (a quarter of the tiny vocabulary are
    EOS ids: the rows end after 2 tokens, at the 16-token cap at the latest, not all at once), with their mean, spread
    and quantiles per step; 8 completions per step (2 groups of 4, 2 micro-batches) generated in waves of at most 3
    rows (``--wave-rows``: ``generation_wave_rows``, graph_generate's ``max_rows``)."""
    stdout, data = _run(tmp_path, "--rollout-engine", "graph", "--no-compile", "--eos-mean-tokens", "4",
                        "--min-new-tokens", "2", "--completion-len", "16", "--group", "4", "--per-device-batch", "4",
                        "--grad-accum", "2", "--wave-rows", "3")  # fmt: skip
    (res,) = data["results"]
    assert res["status"] == "ok", res
    assert res["generation_wave_rows"] == 3 and res["spread_eos_ids"] == 256
    assert data["settings"]["eos_mean_tokens"] == 4 and data["settings"]["min_new_tokens"] == 2
    lens = []
    for step in res["warmup_steps"] + res["steps"]:
        assert step["completions"] == 8
        assert 2 < step["completion_len_min"] and step["completion_len_max"] <= step["expected_len"]
        assert step["completion_len_mean"] > 0 and step["completion_len_sd"] >= 0
        assert len(step["completion_len_p50_p90_p99"]) == 3
        lens.append((step["completion_len_min"], step["completion_len_max"]))
    assert any(lo < hi for lo, hi in lens), lens  # spread, not fixed
    assert res["summary"]["completion_lengths_ok"] and res["summary"]["advantages_nonzero"]
