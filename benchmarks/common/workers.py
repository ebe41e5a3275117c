"""One (model, arm) per subprocess: no compile-cache or allocator interference between arms, an OOM only ends its own
arm ("does not fit"), a hung arm is killed at its timeout. Also the torch.compile counters the rows report."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = [
    "LogCatcher",
    "add_worker_arguments",
    "check_names",
    "counter_diff",
    "dynamo_counters",
    "exception_result",
    "failed",
    "run_worker_subprocess",
    "save_partial",
    "worker_exit",
]


class LogCatcher(logging.Handler):
    """Collects torch's recompile / graph-break / perf-hint (cudagraph skip) log records.

    torch's artifact loggers are named ``<module>.__<artifact>`` (``torch._dynamo.guards.__recompiles``) and propagate
    up to ``torch._dynamo`` / ``torch._inductor`` (which do not propagate further), so the handler sits on those parents
    and keeps the records whose logger name matches."""

    NAMES = ("__recompiles", "__graph_breaks", "__perf_hints", "cudagraph_trees")
    PARENTS = ("torch._dynamo", "torch._inductor", "torch")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []
        self._last: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if not any(n in record.name for n in self.NAMES) or id(record) == self._last:
            return
        self._last = id(record)  # the same record reaching two parents
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            msg = str(record.msg)
        self.records.append(f"{record.name}: {msg[:600]}")

    def install(self) -> None:
        import torch

        with contextlib.suppress(Exception):
            torch._logging.set_logs(recompiles=True, graph_breaks=True, perf_hints=True)
        for n in self.PARENTS:
            logging.getLogger(n).addHandler(self)


def dynamo_counters() -> dict[str, Any]:
    """torch.compile's counters so far: graph breaks (and their first reasons), unique graphs, frames, cudagraph skips."""
    from torch._dynamo.utils import counters

    gb = dict(counters.get("graph_break", {}))
    return {
        "graph_breaks": int(sum(gb.values())),
        "graph_break_reasons": {k[:300]: int(v) for k, v in list(gb.items())[:10]},
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "frames_ok": int(counters["frames"].get("ok", 0)),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
    }


def counter_diff(a: dict, b: dict) -> dict[str, int]:
    """What happened between two :func:`dynamo_counters` snapshots."""
    return {k: b[k] - a[k] for k in ("graph_breaks", "unique_graphs", "frames_ok", "cudagraph_skips")}


def failed(model: str, arm: str, status: str, label: str | None = None, **kw: Any) -> dict:
    """A result row for an arm that produced no measurement."""
    return {"model": model, "arm": arm, "label": label or arm, "status": status, **kw}


def exception_result(model: str, arm: str, exc: BaseException, label: str | None = None, **kw: Any) -> dict:
    """A worker's exception as a result row (an OOM means "does not fit"); the traceback is printed and kept."""
    import torch

    oom = isinstance(exc, torch.OutOfMemoryError)
    status = "does not fit: OOM" if oom else f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    res = failed(model, arm, status, label, **kw)
    res["traceback"] = traceback.format_exc()[-3000:]
    print(res["traceback"], file=sys.stderr)
    return res


def add_worker_arguments(ap: Any) -> None:
    """The hidden options of a ``--_worker`` subprocess (:func:`run_worker_subprocess` runs the script with them):
    ``--_worker``, its ``--_result`` file, the one ``--model`` and ``--arm`` it runs."""
    import argparse

    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)


def save_partial(args: Any, res: dict) -> None:
    """Write the worker's results so far to its result file, so they survive a timeout kill of the worker."""
    if getattr(args, "_result", None):
        with open(args._result, "w") as f:
            json.dump({**res, "status": "partial: killed after this batch"}, f)


def worker_exit(args: Any, run_worker: Callable[[Any], dict], label: str | None = None, **kw: Any) -> None:
    """Body of a ``--_worker`` subprocess: run one (model, arm), write the result (or the failure) to
    ``args._result`` and exit at once (skips the slow teardown of compiled graphs and the CUDA context)."""
    try:
        res = run_worker(args)
    except Exception as e:  # noqa: BLE001
        res = exception_result(args.model, args.arm, e, label, **kw)
    with open(args._result, "w") as f:
        json.dump(res, f, default=str)
    sys.stdout.flush()
    os._exit(0)


def run_worker_subprocess(
    cmd: Callable[[str], list[str]], model: str, arm: str, args: Any, label: str | None = None, **kw: Any
) -> dict:
    """Run ``cmd(result_path)`` (within ``args.arm_timeout`` s); its result file, or a failure row with the log's
    tail. ``kw`` (and ``label``) fill the failure row."""
    with tempfile.TemporaryDirectory() as td:
        result_path = os.path.join(td, "r.json")
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd(result_path), timeout=args.arm_timeout, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
            out, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "timeout"
        wall = round(time.perf_counter() - t0, 1)
        if args.verbose:
            print(out)
        if os.path.exists(result_path):
            with open(result_path) as f:
                res = json.load(f)
        else:
            tail = "\n".join(out.strip().splitlines()[-15:])
            oom = "OutOfMemoryError" in out or "CUDA out of memory" in out
            status = "does not fit: OOM (worker died)" if oom else f"failed (rc={rc})"
            res = failed(model, arm, status, label, log_tail=tail, **kw)
            print(f"[{model}/{arm}] worker rc={rc}\n{tail}", file=sys.stderr)
    res["wall_s"] = wall
    return res


def check_names(ap: Any, names: list[str], known: Any, what: str) -> None:
    """``ap.error`` (exit 2) for the first of ``names`` not in ``known``."""
    for n in names:
        if n not in known:
            ap.error(f"unknown {what} {n}")
