"""Quantization time of a Qwen2.5-7B-shaped model to NVFP4 (issue #7; goal ≤ 30 s on the H100) and peak memory.

Both modes use random bf16 weights of the real shape (speed does not depend on the values). ``--mode layers``
(default): each decoder layer materialised on the GPU in turn, then ``nvfp4.quantize_model(layer, method=...)``;
quantization time alone and end to end, peak GPU memory and host RSS. ``--mode hf``, the user path: a random bf16
checkpoint in ``--ckpt-dir``, then in fresh processes ``AutoModelForCausalLM.from_pretrained`` in bf16 and with
``quantization_config=NVFP4Config(method=...)`` (page cache warm); the overhead is the difference.

Usage::

    uv run python benchmarks/quantize_time.py --tiny                           # CPU smoke test
    python3 benchmarks/quantize_time.py --mode layers,hf --out $OUT/quantize_time.json   # H100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common  # noqa: F401  (the workspace packages on sys.path)
from common.env import RESULTS, device_name, gb, now, rss_peak_gb, sync, versions, write_result
from common.models import init_
from common.shapes import MODELS, meta_model, qwen2_config
from common.tables import markdown


def _meta_model(model_key: str):
    import torch

    return meta_model(qwen2_config(model_key, dtype="bfloat16"), torch.bfloat16)


def _gpu_peaks(device: str) -> dict[str, float]:
    """Peak and current GPU memory allocated (GB) on CUDA; nothing on CPU."""
    import torch

    if device != "cuda":
        return {}
    return {"peak_gpu_gb": gb(torch.cuda.max_memory_allocated()), "final_gpu_gb": gb(torch.cuda.memory_allocated())}


def run_layers(model_key: str, device: str, method: str) -> dict:
    import torch
    from nvfp4 import NVFP4Linear, quantize_model

    model = _meta_model(model_key)
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
    return {"mode": "layers", "model": model_key, "method": method, "device": device, "linears_quantized": n_lin,
            "params_quantized": n_params, "quantize_s": round(t_quant, 3), "random_init_s": round(t_init, 3),
            "end_to_end_s": round(total, 3), "peak_rss_gb": rss_peak_gb(), **_gpu_peaks(device)}  # fmt: skip


def write_checkpoint(model_key: str, path: Path, device: str) -> dict:
    """Random bf16 checkpoint of the real shape, one safetensors shard per decoder layer (+ one for the rest)."""
    from safetensors.torch import save_file

    model = _meta_model(model_key)
    cfg = model.config
    path.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.perf_counter()
    parts = [(f"model.layers.{i}.", layer) for i, layer in enumerate(model.model.layers)]
    parts += [("model.embed_tokens.", model.model.embed_tokens), ("model.norm.", model.model.norm),
              ("lm_head.", model.lm_head)]  # fmt: skip
    n = len(parts)
    for i, (prefix, mod) in enumerate(parts):
        mod.to_empty(device=device)
        init_(mod)
        sd = {prefix + k: v.detach().to("cpu").contiguous() for k, v in mod.state_dict().items()}
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(sd, str(path / fname), metadata={"format": "pt"})
        for k, v in sd.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
        mod.to_empty(device="meta")
        del sd
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg.save_pretrained(path)
    return {"bytes": total, "write_s": round(time.perf_counter() - t0, 2)}


def load_once(path: str, device: str, method: str | None) -> dict:
    import nvfp4  # noqa: F401  (registers nvfp4_w4a16)
    import torch
    from nvfp4 import NVFP4Config, NVFP4Linear
    from transformers import AutoModelForCausalLM

    kw = {"quantization_config": NVFP4Config(method=method)} if method else {}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, device_map=device, dtype=torch.bfloat16, **kw)
    sync()
    dt = time.perf_counter() - t0
    return {"load_s": round(dt, 3), "nvfp4_linears": sum(isinstance(m, NVFP4Linear) for m in model.modules()),
            "peak_rss_gb": rss_peak_gb(), **_gpu_peaks(device)}  # fmt: skip


def run_hf(model_key: str, device: str, method: str, ckpt_dir: Path) -> dict:
    out: dict = {"mode": "hf", "model": model_key, "method": method, "device": device, "ckpt_dir": str(ckpt_dir)}
    out["checkpoint"] = write_checkpoint(model_key, ckpt_dir, device)
    t0 = time.perf_counter()
    for f in sorted(ckpt_dir.glob("*.safetensors")):  # warm the page cache: time the loader, not the disk
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    out["page_cache_warm_s"] = round(time.perf_counter() - t0, 2)
    for name, meth in (("bf16_load", None), ("nvfp4_load", method)):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_load", str(ckpt_dir), "--device", device]
        if meth:
            cmd += ["--_load-method", meth]
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            out[name] = {"status": f"failed rc={p.returncode}", "stderr_tail": p.stderr[-2000:]}
            print(p.stderr[-2000:], file=sys.stderr)
        else:
            out[name] = json.loads(lines[-1][7:])
    if "load_s" in out.get("bf16_load", {}) and "load_s" in out.get("nvfp4_load", {}):
        out["quantize_overhead_s"] = round(out["nvfp4_load"]["load_s"] - out["bf16_load"]["load_s"], 3)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7b", choices=sorted(MODELS))
    ap.add_argument("--mode", default="layers", help="comma list: layers,hf")
    ap.add_argument("--method", default="rtn", help="comma list of rtn,mse (layers mode); first one for hf mode")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU validation)")
    ap.add_argument("--ckpt-dir", default="/tmp/qerl_qt_ckpt")
    ap.add_argument("--out", default=str(RESULTS / "quantize_time.json"))
    ap.add_argument("--_load", help=argparse.SUPPRESS)
    ap.add_argument("--_load-method", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args._load:
        res = load_once(args._load, device, args._load_method)
        print("RESULT " + json.dumps(res), flush=True)
        os._exit(0)

    model_key = "tiny" if args.tiny else args.model
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
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
    for mode in [m.strip() for m in args.mode.split(",") if m.strip()]:
        if mode == "layers":
            runs = [run_layers(model_key, device, meth) for meth in methods]
        elif mode == "hf":
            runs = [run_hf(model_key, device, methods[0], Path(args.ckpt_dir))]
        else:
            ap.error(f"unknown mode {mode}")
        for r in runs:
            print(json.dumps(r), flush=True)
        results += runs
        write_result(args.out, meta, results)  # after every mode: a later mode's failure keeps it

    rows = []
    for r in results:
        if r["mode"] == "layers":
            rows.append(["layers (quantize_model per layer)", r["model"], r["method"], r["quantize_s"],
                         f"{r['end_to_end_s']} (incl. random init {r['random_init_s']})", r.get("peak_gpu_gb", "—"),
                         r["peak_rss_gb"]])  # fmt: skip
        else:
            b, q = r.get("bf16_load", {}), r.get("nvfp4_load", {})
            rows.append(["from_pretrained bf16 (reference)", r["model"], "—", "—", b.get("load_s", b.get("status")),
                         b.get("peak_gpu_gb", "—"), b.get("peak_rss_gb", "—")])  # fmt: skip
            rows.append(["from_pretrained + NVFP4Config", r["model"], r["method"],
                         f"{r.get('quantize_overhead_s', '—')} (overhead vs bf16 load)", q.get("load_s", q.get("status")),
                         q.get("peak_gpu_gb", "—"), q.get("peak_rss_gb", "—")])  # fmt: skip
    header = ["mode", "model", "method", "quantize s", "end to end s", "peak GPU GB", "peak host RSS GB"]
    print("\n" + markdown(header, rows, "lllrrrr"))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
