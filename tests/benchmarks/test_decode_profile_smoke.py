"""Smoke test of ``benchmarks/decode_profile.py --engine graph``: the tiny NVFP4 arm, eager, on CPU (no kernel
times there); the profiled step is the graph engine's and the JSON records it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from result_schema import assert_fields_of

REPO = Path(__file__).resolve().parents[2]


def test_decode_profile_tiny_graph_engine(tmp_path):
    out = tmp_path / "decode_profile.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "decode_profile.py"), "--tiny", "--engine", "graph"]
    cmd += ["--arms", "nvfp4", "--batch", "1", "--out", str(out)]
    p = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| tiny | NVFP4 + LoRA (ours) | graph | 1 |" in p.stdout
    data = json.loads(out.read_text())
    (res,) = data["results"]
    assert res["engine"] == "graph" and [b["batch"] for b in res["batches"]] == [1]
    assert res["batches"][0]["decode_step_wall_us"] > 0
    # the committed run's fields (its kernel names and times, and the lm_head GEMM's, are measured on CUDA only)
    batch = "$.results[0].batches[0]."
    skip = (batch + "by_category_us.", batch + "top_kernels_us.", batch + "lm_head_us")
    assert_fields_of("decode_profile_7b_graph_1280_da.json", data, skip=skip)
