"""What the benchmark scripts share (each module says what it holds); each script in ``benchmarks/`` composes these and
adds its own measurement. Importing it puts the workspace packages on ``sys.path``, so the scripts also run with a
plain ``python3`` beside the packages (the GPU image has their dependencies, not the workspace venv)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _pkg in ("nvfp4", "aqn", "qerl-trl"):
    if str(_src := ROOT / "packages" / _pkg / "src") not in sys.path:
        sys.path.insert(0, str(_src))
