"""The record a result JSON carries (what was measured where, on which code), timing / memory helpers, result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from . import ROOT

RESULTS = ROOT / "benchmarks" / "results"


def csv_list(s: str) -> list[str]:
    """``"a, b,,c"`` → ``["a", "b", "c"]`` (comma-separated command-line lists)."""
    return [x.strip() for x in s.split(",") if x.strip()]


def git_commit() -> str:
    """The repository's short HEAD, ``+dirty`` when tracked files differ from it; outside a git checkout (a copy of the
    tree on the GPU machine) ``$QERL_COMMIT`` if set, else ``unknown``. Every JSON names the code it measured: a ratio
    is only stated with its commit."""
    fallback = os.environ.get("QERL_COMMIT", "unknown")
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return fallback
    if head.returncode != 0:
        return fallback
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def versions(*more: str) -> dict[str, str]:
    """Commit, Python and the versions of the libraries a measurement depends on (and of the modules ``more``)."""
    import torch

    out = {"commit": git_commit(), "python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "peft", "triton", "bitsandbytes", "accelerate", *more):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out[name] = f"not installed ({type(e).__name__})"
    try:  # the peer kernel vLLM's Humming arm and gemm.py --peer-humming run: 0.1.10 (vLLM 0.26's pin) or 0.1.19
        out["humming-kernels"] = metadata.version("humming-kernels")
    except metadata.PackageNotFoundError:
        out["humming-kernels"] = "not installed"
    return out


def device_name() -> str:
    """The GPU's name, or ``cpu (<processor>, <n> cores)``."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def now() -> str:
    """UTC time of the run, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def sync() -> None:
    """Wait for the GPU (timings end here); nothing on CPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gb(n: int | float) -> float:
    """Bytes → GB (10⁹), 3 decimals."""
    return round(n / 1e9, 3)


def rss_peak_gb() -> float:
    """This process's peak resident memory in GB."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3)


def run_title(meta: dict[str, Any]) -> str:
    """A plot title naming the run: device, commit, date (``?`` where a result file predates the field)."""
    return f"{meta.get('device', '?')}, {meta.get('versions', {}).get('commit', '?')}, {meta.get('date', '?')[:10]}"


def write_json(path: str | Path, data: Any, indent: int = 1) -> Path:
    """``data`` as JSON at ``path``, written whole or not at all (a temporary file renamed into place)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str))
    os.replace(tmp, p)
    return p


def write_result(path: str | Path, meta: dict[str, Any], results: list[dict]) -> Path:
    """A result file: the run's ``meta`` (benchmark, date, device, versions, settings) and its ``results`` rows."""
    return write_json(path, {**meta, "results": results})


def merge_results(paths: list[str]) -> tuple[dict, list[dict]]:
    """Result files of several runs → (meta with every run's metadata under ``runs``, rows tagged with their run)."""
    results, meta = [], {}
    for path in paths:
        d = json.loads(Path(path).read_text())
        for r in d.pop("results"):
            r.setdefault("run", len(meta.get("runs", [])))
            r.setdefault("run_date", d.get("date"))
            results.append(r)
        meta.setdefault("runs", []).append(d)
    return meta, results
