"""One (model, arm) per subprocess: no compile-cache or allocator interference between arms, an OOM only ends its own
arm ("does not fit"), a hung arm is killed at its timeout. Also the options and the loop over (model, arm) the
scripts share, and the torch.compile counters the rows report."""

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
from collections.abc import Callable, Sequence
from typing import Any

from .env import device_name, now, write_result
from .shapes import MODELS


class LogCatcher(logging.Handler):
    """Collects torch's recompile / graph-break / perf-hint (cudagraph skip) log records: the handler sits on the
    parents of torch's artifact loggers (``torch._dynamo.guards.__recompiles`` ...) and keeps those that match."""

    NAMES = ("__recompiles", "__graph_breaks", "__perf_hints", "cudagraph_trees")
    PARENTS = ("torch._dynamo", "torch._inductor", "torch")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records, self._last = [], None

    def emit(self, record: logging.LogRecord) -> None:
        if not any(n in record.name for n in self.NAMES) or id(record) == self._last:
            return
        self._last = id(record)  # the same record reaching two parents
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            msg = str(record.msg)
        self.records.append(f"{record.name}: {msg[:600]}")

    def install(self) -> LogCatcher:
        import torch

        with contextlib.suppress(Exception):
            torch._logging.set_logs(recompiles=True, graph_breaks=True, perf_hints=True)
        for n in self.PARENTS:
            logging.getLogger(n).addHandler(self)
        return self


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


DYN_KEYS = ("graph_breaks", "unique_graphs", "frames_ok", "cudagraph_skips")  # the counters that count


def counter_diff(a: dict, b: dict) -> dict[str, int]:
    """What happened between two :func:`dynamo_counters` snapshots."""
    return {k: b[k] - a[k] for k in DYN_KEYS}


def failed(model: str, arm: str, status: str, label: str | None = None, **kw: Any) -> dict:  # no measurement
    return {"model": model, "arm": arm, "label": label or arm, "status": status, **kw}


def exception_result(model: str, arm: str, exc: BaseException, label: str | None = None, **kw: Any) -> dict:
    """A worker's exception as a result row (an OOM means "does not fit"); the traceback is printed and kept."""
    import torch

    oom = isinstance(exc, torch.OutOfMemoryError)
    res = failed(model, arm, "does not fit: OOM" if oom else f"failed: {type(exc).__name__}: {str(exc)[:300]}", label,
                 **kw)  # fmt: skip
    res["traceback"] = traceback.format_exc()[-3000:]
    print(res["traceback"], file=sys.stderr)
    return res


#: the arms' adapter, quantization, compile mode and device in every committed run: options no run set left (#48);
#: the settings of the result JSONs keep them
FIXED_ARM_SETTINGS = {"lora_r": 32, "lora_dtype": "bfloat16", "nvfp4_method": "rtn", "no_double_quant": False,
                      "compile_mode": "reduce-overhead", "fullgraph": False, "cpu": False}  # fmt: skip


def add_arm_arguments(ap: Any, out: str, arm_timeout: float) -> None:
    """The options of the scripts that build :mod:`common.models`' arms and run each in a subprocess: the compile
    backend, :func:`add_run_arguments` and merging runs (:data:`FIXED_ARM_SETTINGS` as settings)."""
    ap.set_defaults(**FIXED_ARM_SETTINGS)
    ap.add_argument("--compile-backend", default="inductor", choices=["inductor", "cudagraphs", "eager", "aot_eager"],
                    help="cudagraphs = dynamo + CUDA graphs without inductor (much faster to compile)")  # fmt: skip
    add_run_arguments(ap, out, arm_timeout)
    ap.add_argument("--merge", nargs="+", help="merge these result JSONs into --out and print the table")


def add_run_arguments(ap: Any, out: str, arm_timeout: float) -> None:
    """A run of (model, arm) subprocesses: each one's timeout, the run's deadline, the result file; and the hidden
    options of a ``--_worker`` subprocess (:func:`worker_cmd`): its ``--_result`` file, its one ``--model`` and
    ``--arm``."""
    import argparse

    ap.add_argument("--arm-timeout", type=float, default=arm_timeout, help="seconds per (model, arm) subprocess")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no new (model, arm) after this many seconds (keeps a device call inside its limit)")  # fmt: skip
    ap.add_argument("--out", default=out)
    for hidden in ("--_result", "--model", "--arm"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)


def worker_cmd(script: str, args: Any, model: str, arm: str, result_path: str, options: Sequence[str],
               flags: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The ``--_worker`` command line of one (model, arm): ``script`` with its result file, the run's ``options``
    (those set; a list as a comma list) and ``flags`` (those on)."""
    cmd = [sys.executable, script, "--_worker", "--_result", result_path, "--model", model, "--arm", arm]
    for k in options:
        if (v := getattr(args, k)) is not None:
            cmd += ["--" + k.replace("_", "-"), ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return cmd + ["--" + f.replace("_", "-") for f in flags if getattr(args, f)]


def run_in_process(run_worker: Callable[[Any], dict], args: Any, model: str, arm: str, label: str | None = None,
                   **kw: Any) -> dict:  # fmt: skip
    """One (model, arm) in this process (debugging): its result or its failure row; then the compiled graphs and
    the allocator's cached blocks are dropped, so the next arm starts clean."""
    import argparse
    import gc

    import torch

    try:
        res = run_worker(argparse.Namespace(**{**vars(args), "model": model, "arm": arm}))
    except Exception as e:  # noqa: BLE001
        res = exception_result(model, arm, e, label, **kw)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return res


def run_meta(benchmark: str, args: Any, models: list[str], versions: dict, skip: Sequence[str] = (), **extra) -> dict:
    """A run's ``meta``: what it measures, when, on which device, the versions, its settings (the options but the
    hidden ones and ``skip``), the models' configs, then ``extra``."""
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip}
    return {"benchmark": benchmark, "date": now(), "device": device_name(), "versions": versions, "settings": settings,
            "configs": {m: MODELS[m] for m in models}, **extra}  # fmt: skip


def run_arm_grid(name: str, args: Any, models: list[str], arms: list[str], meta: dict, labels: dict[str, str],
                 brief: Callable[[dict], str], table: Callable[[list[dict]], str], script: str,
                 run_worker: Callable[[Any], dict], options: Sequence[str], flags: Sequence[str] = (),
                 in_process: bool = False, defaults: Callable[[str], dict] = dict,
                 t_start: float | None = None) -> list[dict]:  # fmt: skip
    """Every (model, arm) in a ``script`` worker subprocess (:func:`run_worker_subprocess`: ``options``, ``flags``)
    or, ``in_process``, through ``run_worker`` here (:func:`run_in_process`), none started after ``args.deadline_s``
    from ``t_start`` (a "not run" row); each row gets its wall time, ``defaults(arm)`` and a line (``brief(row)``),
    ``args.out`` is rewritten after every arm; then ``table(rows)`` is printed."""
    print(f"# {name}: {meta['device']} | {meta['versions']}", flush=True)
    results: list[dict] = []
    t_start = time.perf_counter() if t_start is None else t_start
    for m in models:
        for a in arms:
            t0 = time.perf_counter()
            if args.deadline_s and t0 - t_start > args.deadline_s:
                res = failed(m, a, f"not run: --deadline-s {args.deadline_s:g} passed", labels[a], wall_s=0.0)
            else:
                print(f"[{m}/{a}] running ...", flush=True)
                if in_process:
                    res = run_in_process(run_worker, args, m, a, labels[a])
                else:
                    res = run_worker_subprocess(script, args, m, a, options, flags, labels[a])
                res.setdefault("wall_s", round(time.perf_counter() - t0, 1))
            for k, v in defaults(a).items():
                res.setdefault(k, v)
            results.append(res)
            print(f"[{m}/{a}] {res.get('status')} in {res['wall_s']} s; {brief(res)}", flush=True)
            write_result(args.out, meta, results)
    print(f"\n{table(results)}\n\nwrote {args.out}")
    return results


def save_partial(args: Any, res: dict) -> None:  # the worker's results so far: they survive a timeout kill
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


def run_worker_subprocess(script: str, args: Any, model: str, arm: str, options: Sequence[str],
                          flags: Sequence[str] = (), label: str | None = None) -> dict:  # fmt: skip
    """Run ``script``'s ``--_worker`` of one (model, arm) (:func:`worker_cmd`: ``options`` and ``flags`` passed on)
    within ``args.arm_timeout`` s; its result file, or a failure row (``label``) with the log's tail."""
    with tempfile.TemporaryDirectory() as td:
        result_path = os.path.join(td, "r.json")
        t0 = time.perf_counter()
        try:
            cmd = worker_cmd(os.path.abspath(script), args, model, arm, result_path, options, flags)
            p = subprocess.run(cmd, timeout=args.arm_timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            out, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "timeout"
        wall = round(time.perf_counter() - t0, 1)
        if os.path.exists(result_path):
            with open(result_path) as f:
                res = json.load(f)
        else:
            tail = "\n".join(out.strip().splitlines()[-15:])
            oom = "OutOfMemoryError" in out or "CUDA out of memory" in out
            status = "does not fit: OOM (worker died)" if oom else f"failed (rc={rc})"
            res = failed(model, arm, status, label, log_tail=tail)
            print(f"[{model}/{arm}] worker rc={rc}\n{tail}", file=sys.stderr)
    res["wall_s"] = wall
    return res


def check_names(ap: Any, names: list[str], known: Any, what: str) -> None:
    """``ap.error`` (exit 2) for the first of ``names`` not in ``known``."""
    for n in names:
        if n not in known:
            ap.error(f"unknown {what} {n}")
