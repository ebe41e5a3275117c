"""Smoke test of ``benchmarks/quantize_time.py`` on the tiny shape on CPU, and the committed run's fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from result_schema import assert_fields_of

REPO = Path(__file__).resolve().parents[2]


def test_quantize_time_tiny(tmp_path):
    out = tmp_path / "quantize_time.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "quantize_time.py"), "--tiny", "--mode", "layers", "--method",
           "rtn,mse", "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    rtn, mse = data["results"]
    assert rtn["linears_quantized"] == mse["linears_quantized"] == 2 * 7 and rtn["quantize_s"] > 0
    assert (rtn["method"], mse["method"]) == ("rtn", "mse")
    assert_fields_of("quantize_time.json", data)
