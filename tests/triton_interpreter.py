"""Run a script under the Triton interpreter in a subprocess (importable from any test file: tests/ is on pytest's
pythonpath). ``TRITON_INTERPRET=1`` must be set before triton is imported, hence the fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest


def run_under_interpreter(script: str, timeout: int, extra_path: Sequence[Path] = ()) -> list[dict]:
    """Run ``script`` with ``TRITON_INTERPRET=1`` and ``extra_path`` prepended to ``PYTHONPATH``; return the JSON list
    it printed on its line starting with ``RESULT``."""
    pytest.importorskip("triton")
    path = os.pathsep.join([*map(str, extra_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])
