"""Smoke test of ``benchmarks/train_profile.py``: the NVFP4 arm of the tiny model, forward + backward with gradient
checkpointing on CPU, as a user would run it; the LoRA weights get gradients and the table and JSON are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from result_schema import assert_fields_of

REPO = Path(__file__).resolve().parents[2]


def test_train_profile_tiny_nvfp4(tmp_path):
    out = tmp_path / "train_profile.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "train_profile.py"),
        "--tiny",
        "--arms",
        "nvfp4",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| tiny | NVFP4 + LoRA (ours) | 2×16 |" in p.stdout
    data = json.loads(out.read_text())
    (res,) = data["results"]
    assert res["status"] == "ok" and res["trainable_params"] > 0
    assert res["lora_grads_nonzero"] > 0 and res["lora_grads_nonzero"] >= res["lora_tensors"] // 2  # B starts at 0
    assert res["forward_s"] > 0 and res["backward_s"] > 0 and res["profiled_wall_s"] > 0
    assert_fields_of("train_profile_7b.json", data, skip=("$.results[0].by_category_s.", "$.results[0].top_kernels."))
