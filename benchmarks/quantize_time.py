"""Quantization time of a Qwen2.5-7B-shaped model to NVFP4 (issue #7; goal ≤ 30 s on the H100) and peak memory.

Random bf16 weights of the real shape (speed does not depend on the values): each decoder layer materialised on the
GPU in turn, then ``nvfp4.quantize_model(layer, method=...)``; quantization time alone and end to end, peak GPU memory
and host RSS. (``--mode hf``, ``from_pretrained`` with ``NVFP4Config`` against a bf16 load, never run, is at
``benchmarks/quantize_time.py@6a06c59``.)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import common  # noqa: F401  (the workspace packages on sys.path)
from common.env import RESULTS, device_name, gb, now, rss_peak_gb, sync, versions, write_result
from common.models import init_
from common.shapes import MODELS, meta_model, qwen2_config
from common.tables import markdown


def run_layers(model_key: str, device: str, method: str) -> dict:
    import torch
    from nvfp4 import NVFP4Linear, quantize_model

    model = meta_model(qwen2_config(model_key, dtype="bfloat16"), torch.bfloat16)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_init = t_quant = 0.0
    n_lin = n_params = 0
    t_all = time.perf_counter()
    for layer in model.model.layers:
        t0 = time.perf_counter()
        layer.to_empty(device=device)
        init_(layer)
        n_params += sum(m.weight.numel() for m in layer.modules() if type(m) is torch.nn.Linear)
        sync()
        t1 = time.perf_counter()
        quantize_model(layer, method=method, progress=False)
        sync()
        t2 = time.perf_counter()
        t_init += t1 - t0
        t_quant += t2 - t1
        n_lin += sum(isinstance(m, NVFP4Linear) for m in layer.modules())
    for mod in (model.model.embed_tokens, model.model.norm, model.lm_head):
        mod.to_empty(device=device)
        init_(mod)
    sync()
    total = time.perf_counter() - t_all
    gpu = {"peak_gpu_gb": gb(torch.cuda.max_memory_allocated()),
           "final_gpu_gb": gb(torch.cuda.memory_allocated())} if device == "cuda" else {}  # fmt: skip
    return {"mode": "layers", "model": model_key, "method": method, "device": device, "linears_quantized": n_lin,
            "params_quantized": n_params, "quantize_s": round(t_quant, 3), "random_init_s": round(t_init, 3),
            "end_to_end_s": round(total, 3), "peak_rss_gb": rss_peak_gb(), **gpu}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7b", choices=sorted(MODELS))
    ap.add_argument("--mode", default="layers", choices=["layers"], help="(the hf mode: quantize_time.py@6a06c59)")
    ap.add_argument("--method", default="rtn", help="comma list of rtn,mse")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU validation)")
    ap.add_argument("--out", default=str(RESULTS / "quantize_time.json"))
    args = ap.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_key = "tiny" if args.tiny else args.model
    meta = {
        "benchmark": "NVFP4 quantization time, random weights of the real shape",
        "date": now(),
        "device": device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "versions": versions(),
        "config": MODELS[model_key],
        "goal": "<= 30 s for the 7B shape on the H100",
    }
    print(f"# quantize_time: {meta['device']} | {meta['versions']}", flush=True)
    results = []
    for method in [m.strip() for m in args.method.split(",") if m.strip()]:
        results.append(run_layers(model_key, device, method))
        print(json.dumps(results[-1]), flush=True)
        write_result(args.out, meta, results)  # after every method: a later one's failure keeps it
    rows = [["layers (quantize_model per layer)", r["model"], r["method"], r["quantize_s"],
             f"{r['end_to_end_s']} (incl. random init {r['random_init_s']})", r.get("peak_gpu_gb", "—"),
             r["peak_rss_gb"]] for r in results]  # fmt: skip
    header = ["mode", "model", "method", "quantize s", "end to end s", "peak GPU GB", "peak host RSS GB"]
    print("\n" + markdown(header, rows, "lllrrrr"))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
