"""The GPU kernels of a profiled region, by category, and one profiled arm per process (``decode_profile.py``,
``train_profile.py``)."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from .env import device_name, versions

__all__ = ["CATEGORIES", "CATEGORY_COLUMNS", "by_category", "category", "kernel_times", "run_arms"]

CATEGORIES: list[tuple[str, re.Pattern]] = [
    (
        "nvfp4 gemm",
        re.compile(
            r"_linear_(mma_|large_m_)?kernel|_gemv_kernel|_splitk_reduce|_dequant_(mma_)?kernel|_dgrad_(mma_)?kernel"
        ),
    ),
    ("bnb nf4", re.compile(r"4bit|kDequantize|kQuantize|nf4", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient_attention", re.I)),
    ("cuBLAS gemm", re.compile(r"gemm|xmma|cutlass|nvjet|cublas|splitKreduce|sm90_", re.I)),
    ("inductor (fused)", re.compile(r"^triton_")),
]


# Table columns: every category above, then "other".
CATEGORY_COLUMNS = ("nvfp4 gemm", "bnb nf4", "cuBLAS gemm", "attention", "inductor (fused)", "other")


def category(kernel: str) -> str:
    for name, pat in CATEGORIES:
        if pat.search(kernel):
            return name
    return "other"


def by_category(kernel_us: dict[str, float], top: int) -> dict:
    """``{kernel: µs}`` → total (``kernels_us``), per category (``by_category_us``) and the ``top`` largest kernels
    (``top_kernels_us``), rounded for the JSON."""
    cats: dict[str, float] = {}
    for name, us in kernel_us.items():
        cats[category(name)] = cats.get(category(name), 0.0) + us
    return {
        "kernels_us": round(sum(cats.values()), 1),
        "by_category_us": {k: round(v, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels_us": {k: round(v, 2) for k, v in sorted(kernel_us.items(), key=lambda kv: -kv[1])[:top]},
    }


def kernel_times(prof) -> dict[str, dict]:
    """``{kernel name: {"us": total device µs, "calls": n}}``: the GPU-side events (kernels, memcpy/memset)."""
    from torch.autograd import DeviceType

    out: dict[str, dict] = {}
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:
            continue  # CPU ops (their device time would count their kernels twice)
        out[evt.key] = {"us": float(evt.self_device_time_total), "calls": int(evt.count)}
    return out


def run_arms(args, tag: str, worker_cmd: Callable[[str, Path], list[str]], worker_env=None) -> list[dict]:
    """Run each of ``args.arms`` in a fresh process (``worker_cmd(arm, part_json)``, environment ``worker_env(arm)``)
    and collect the JSON each writes; ``args.out`` is rewritten after every arm (device, versions, date, arguments and
    the results so far), so a killed run keeps what it measured."""
    results = []
    for arm in args.arms:
        part = Path(args.out).with_suffix(f".{arm.replace(':', '-')}.part.json")
        print(f"[{tag}] {args.model} {arm} ...", flush=True)
        proc = subprocess.run(worker_cmd(arm, part), env=worker_env(arm) if worker_env else None)
        if proc.returncode == 0 and part.exists():
            results.append(json.loads(part.read_text()))
            part.unlink()
        else:
            results.append({"model": args.model, "arm": arm, "status": f"failed (rc {proc.returncode})"})
        meta = {
            "device": device_name(),
            "versions": versions(),
            "date": datetime.date.today().isoformat(),
            "args": vars(args),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return results
