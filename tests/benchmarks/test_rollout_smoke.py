"""Smoke test of ``benchmarks/rollout.py --engine graph`` (``qerl_trl.graph_generate``): one tiny arm, eager, on CPU.

Runs the script as a user would (in-process arms to keep it short) and checks that the engine is recorded in the
settings and every row, that the fixed lengths hold, and that the table shows the engine column.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from result_schema import assert_fields_of

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "rollout.py"


def test_rollout_tiny_graph_engine(tmp_path):
    out = tmp_path / "rollout.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--tiny",
        "--no-compile",
        "--engine",
        "graph",
        "--arms",
        "bf16",
        "--batch",
        "1,2",
    ]
    cmd += ["--prompt-len", "8", "--new-tokens", "6", "--warmup-tokens", "3", "--in-process", "--out", str(out)]
    cmd += ["--profile"]  # issue #51 item 1: the decode step by kernel category (CPU: the plumbing only)
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| tiny | bf16 + LoRA | graph | 2 |" in p.stdout
    assert "ms per decode step" in p.stdout and "| tiny | graph | bf16 | 2 |" in p.stdout

    data = json.loads(out.read_text())
    assert data["settings"]["engine"] == "graph" and "graph_generate" in data["benchmark"]
    (res,) = data["results"]
    assert res["status"] == "ok" and res["engine"] == "graph", res
    assert [row["batch"] for row in res["batches"]] == [1, 2]
    for row in res["batches"]:
        assert row["length_ok"] and row["new_tokens_generated"] == 6
        assert row["tok_s"] > 0 and row["prefill_s"] > 0 and isinstance(row["tokens_crc32"], int)
        assert len(row["prefill_s_all"]) == 3 and row["prefill_s"] == pytest.approx(min(row["prefill_s_all"]), abs=1e-3)
        prof = row["profile"]
        assert prof["steps"] == 5 and prof["kernels_per_step"] > 0 and prof["top_kernels_ms"]
    # the latest committed run (H100, graph engine): its fields, GPU memory and its model's config key aside
    assert_fields_of("rollout_batches.json", data, skip=("$.configs.",))


def test_rollout_tiny_length_spread(tmp_path):
    """``--eos-mean-tokens``: the three variants per batch, real-token counts, and the compaction table."""
    out = tmp_path / "spread.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--no-compile", "--engine", "graph", "--arms", "bf16", "--batch", "4",
           "--prompt-len", "8", "--new-tokens", "24", "--min-new-tokens", "2", "--eos-mean-tokens", "6",
           "--compact-min-batch", "1", "--repeats", "2", "--in-process", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| EOS + compaction tok/s |" in p.stdout and "| tiny | bf16 + LoRA | 4 |" in p.stdout
    data = json.loads(out.read_text())
    assert data["settings"]["eos_mean_tokens"] == 6
    ((row,),) = [r["batches"] for r in data["results"]]
    assert row["n_eos_ids"] == round(1024 / 6) and len(row["warmup_s"]) == 2  # the default
    sp = row["spread"]
    assert set(sp) == {"fixed", "eos", "eos+compact"}
    assert sp["fixed"]["tokens_all"] == [4 * 24] * 2 and sp["fixed"]["steps_all"] == [24] * 2
    for v in ("eos", "eos+compact"):
        assert sp[v]["well_formed"] and len(sp[v]["tok_s_all"]) == 2 and sp[v]["tok_s"] > 0
        assert 2 < sp[v]["mean_len"] < 24 and all(s <= 24 for s in sp[v]["steps_all"])
    assert_fields_of("rollout_spread_7b_b128.json", data, skip=("$.configs.",))


def test_rollout_refuses_the_engine_that_left_and_bad_lengths():
    """The transformers ``generate`` engine left in issue #48 (``rollout.py@e48270c``; spread lengths needed the graph
    engine's compaction anyway): ``--engine generate`` is a usage error, as a negative ``--eos-mean-tokens`` is."""
    for extra, message in ((["--engine", "generate"], "invalid choice: 'generate'"),
                           (["--eos-mean-tokens", "-1"], "--eos-mean-tokens must be >= 0")):  # fmt: skip
        p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", *extra], cwd=REPO, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        assert p.returncode == 2 and message in p.stderr, p.stderr


def test_rollout_plot_only(tmp_path):
    """``--plot PNG --plot-only JSON`` draws a committed H100 result (three arms, five batch sizes) without running."""
    png = tmp_path / "batches.png"
    src = REPO / "benchmarks" / "results" / "rollout_batches.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--plot", str(png), "--plot-only", str(src)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    p = subprocess.run([sys.executable, str(SCRIPT), "--plot-only", str(src)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "--plot-only needs --plot" in p.stderr
    # two runs merged: their curves stay apart (a ratio is drawn only within one run)
    old_run = REPO / "benchmarks" / "results" / "rollout_batches_7b_d4205f1.json"
    merged, png2 = tmp_path / "merged.json", tmp_path / "merged.png"
    p = subprocess.run([sys.executable, str(SCRIPT), "--merge", str(src), str(old_run), "--out", str(merged), "--plot",
                        str(png2)], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert png2.stat().st_size > 10_000 and len(json.loads(merged.read_text())["results"]) == 5
