"""What the benchmark scripts share; each script in ``benchmarks/`` composes these and adds its own measurement.

* :mod:`common.env`: the record every result JSON carries (device, commit, versions, date), timing and memory
  helpers, writing and merging result files.
* :mod:`common.shapes`: the model shapes measured (Qwen2.5-7B / 14B / 32B, and a tiny one for CPU smoke runs).
* :mod:`common.models`: random-weight models of those shapes, built layer by layer in an arm's format, + LoRA.
* :mod:`common.workers`: one (model, arm) per subprocess, its result or its failure as a row; torch.compile counters.
* :mod:`common.rollouts`: what ``rollout.py`` and ``rollout_vllm.py`` share: options, prefill / fixed / spread rows.
* :mod:`common.tables`: markdown tables. :mod:`common.plots`: figures.

Importing it puts the workspace packages on ``sys.path``, so the scripts also run with a plain ``python3`` beside the
packages (the GPU image has their dependencies, not the workspace venv).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _pkg in ("nvfp4", "aqn", "qerl-trl"):
    if str(_src := ROOT / "packages" / _pkg / "src") not in sys.path:
        sys.path.insert(0, str(_src))
