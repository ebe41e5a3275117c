"""Does a result JSON a benchmark script just wrote (at CPU smoke sizes) hold every field of a committed one?

The committed JSONs are the measurements BENCHMARKS.md quotes; a refactor of the scripts must keep producing the same
fields, so the same measurements can be taken again. Fields only a GPU produces (``*gpu*``: peak / weight memory on the
device, and grpo_step's ``peak_after_*``), and the bookkeeping ``--merge`` adds (``run``, ``run_date``, ``runs``), are not expected from a CPU run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
_NOT_FROM_CPU = ("gpu", "run", "run_date", "runs")


def _cpu_key(key: str) -> bool:
    # grpo_step's running peaks (peak_after_gen_gb, ...) are CUDA's max_memory_allocated too
    return "gpu" not in key and not key.startswith("peak_after_") and key not in _NOT_FROM_CPU


def missing_fields(committed: Any, produced: Any, where: str = "$") -> list[str]:
    """Paths of the committed dict keys (recursively: dicts by key, lists by their first item) the produced JSON lacks."""
    out: list[str] = []
    if isinstance(committed, dict) and isinstance(produced, dict):
        for k, v in committed.items():
            if not _cpu_key(k):
                continue
            if k not in produced:
                out.append(f"{where}.{k}")
            else:
                out += missing_fields(v, produced[k], f"{where}.{k}")
    elif isinstance(committed, list) and isinstance(produced, list) and committed and produced:
        out += missing_fields(committed[0], produced[0], f"{where}[0]")
    return out


def assert_fields_of(committed_name: str, produced: dict, skip: tuple[str, ...] = ()) -> None:
    """Fail naming the fields of ``benchmarks/results/<committed_name>`` that ``produced`` lacks (``skip``: paths
    prefixes whose contents depend on the run, e.g. per-kernel names)."""
    committed = json.loads((RESULTS / committed_name).read_text())
    missing = [m for m in missing_fields(committed, produced) if not m.startswith(skip)]
    assert not missing, f"fields of {committed_name} the script no longer writes: {missing}"
