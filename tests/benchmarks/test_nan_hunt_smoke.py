"""Smoke test of ``benchmarks/nan_hunt.py`` on CPU: one forced diagnosis of the first GSM8K step (~90 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_nan_hunt_diagnoses_a_forced_step(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "nan_hunt.py"), "--force", "--steps", "1",
           "--max-completion-length", "8", "--keep-cudnn", "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "nan_hunt.json").read_text())
    assert report["first_bad_step"] == 1 and report["forced"] and report["stopped"] and report["keep_cudnn"]
    assert (tmp_path / "batch.pt").is_file()
    # CPU has math and flash SDPA: both run, finite; the GPU-only backends say why they could not
    assert report["variants"]["as_is"]["n_bad"] == 0 and report["variants"]["sdpa_math"]["n_bad"] == 0
    assert "error" in report["variants"]["sdpa_cudnn_attention"]
    assert set(report["per_row_n_bad"]) == {"0", "1", "2", "3"}
