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
    assert data["settings"]["rollout_engine"] == "graph" and "rollout_engine='graph'" in data["benchmark"]
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


def test_grpo_step_recipe_on_the_graph_engine(tmp_path):
    """``--recipe`` with ``--rollout-engine graph`` (issue #47 item 7, S3g): ``qerl train`` with the shipped 32B DAPO recipe
    on its own engine settings (no ``--vllm``), the graph engine's spread EOS ids (``round(V / M)``, as the other
    arms) on TRL's generation config, one whole step of 128 completions, and the probe's micro-batch at the cap (the
    graph engine's generation probe skipped with its reason)."""
    out = tmp_path / "dapo_graph.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--recipe", "bigmath-qwen2.5-32b-dapo", "--arms", "nvfp4",
           "--rollout-engine", "graph", "--prompt-len", "64", "--min-new-tokens", "4", "--eos-mean-tokens", "16",
           "--recipe-overrides", "--max_completion_length 48 --overlong_buffer_length 16", "--probe-tokens", "8",
           "--warmup-steps", "0", "--steps", "1", "--ckpt-root", str(tmp_path / "ckpt"), "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["status"] == "ok" and res["rollout_engine"] == "graph", res.get("status")
    assert res["train_argv"][4:6] == ["--rollout_engine", "graph"] and "--vllm" not in res["train_argv"]
    assert json.loads(res["train_argv"][res["train_argv"].index("--generation_kwargs") + 1]) == {"min_new_tokens": 4}
    assert res["spread_eos_ids"] == 64 and "vllm_engine" not in res  # 1024 / 16 EOS ids
    (step,) = res["steps"]
    assert step["completions"] == 128 and 4 < step["completion_len_min"] < step["completion_len_max"] <= 48
    assert step["gen_s"] > 0 and step["loss_fwd_s"] > 0 and step["backward_s"] > 0 and step["sync_s"] == 0
    assert step["trl_log"]["dapo/informative_group_fraction"] == 1.0
    assert res["summary"]["completion_lengths_ok"] and res["summary"]["advantages_nonzero"]
    w = res["worst_case"]
    assert w["generation"].startswith("skipped: ") and "gen_s" not in w and "step_s" not in w, w
    assert w["train_row_tokens"] == 64 + 48 and w["train_s"] > 0


def test_grpo_step_recipe_refuses_the_transformers_engine(tmp_path):
    """``--recipe`` runs on vllm (its default: ``--rollout-engine`` unset) or graph, the engines a recipe's generation
    batch fits (their own memory, or waves); transformers is refused before anything is built: the row's status."""
    out = tmp_path / "recipe.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--arms", "nvfp4", "--recipe", "bigmath-qwen2.5-32b-dapo",
           "--rollout-engine", "transformers", "--no-subprocess", "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ((res,),) = [json.loads(out.read_text())["results"]]
    assert "--recipe runs on --rollout-engine vllm (the default) or graph" in res["status"], res["status"]
