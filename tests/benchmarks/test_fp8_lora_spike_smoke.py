"""Smoke test of ``benchmarks/fp8_lora_spike.py`` (issue #51 item 3's spike) on the tiny shape on CPU: every site,
part and form runs (the references: CPU ``torch._scaled_mm`` has no row-wise scales), errors within the spike's
bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_fp8_lora_spike_tiny(tmp_path):
    out = tmp_path / "fp8_lora_spike.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "fp8_lora_spike.py"), "--tiny", "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "GO (c" in p.stdout and "the faster fused form" in p.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "fp8_lora_spike" and data["verdict"] in ("GO", "NO-GO") and data["versions"]["commit"]
    assert data["lora_impl"] == "torch mm" and set(data["layer"]) == {"3", "8"} and data["best_form"] in ("c1", "c2")
    rows = data["results"]
    assert [(r["site"], r["m"]) for r in rows] == [(s, m) for s in ("qkv", "o", "gate_up", "down") for m in (3, 8)]
    parts = {"aq", "f1", "f2", "mm_k", "mm_kr", "mm_kr128", "a", "b", "c1", "c2"}
    for r in rows:
        assert r["r"] == 32 * {"qkv": 3, "gate_up": 2}.get(r["site"], 1) and r["c"] > 0
        assert set(r["ms"]) == parts and min(r["ms"].values()) > 0, r
        assert set(r["err"]) == {"a", "b", "c1", "c2"} and max(r["err"].values()) < 0.05, r
    assert set(data["layer"]["3"]) == parts
