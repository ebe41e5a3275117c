"""Spike (issue #36): the Gluon warp-specialised kernel against Humming, our shipped dispatch and bf16 cuBLAS, one
shape, one run. Correctness first (every config against the PyTorch reference on fresh random inputs, output
poisoned with NaN), then CUDA-graph timings with rotated weight copies (``gemm.time_graph``).

    python benchmarks/gemm_ws_spike.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm  # noqa: E402
from gemm import Weights, time_graph  # noqa: E402
from nvfp4.codec import dequantize, quantize  # noqa: E402
from nvfp4.kernels import hopper_ws, nvfp4_linear  # noqa: E402
from nvfp4.layout import to_mma_layout  # noqa: E402

DEV = "cuda"


def humming_layer(w: torch.Tensor):
    """A Humming 0.1.10 layer holding ``w`` [N, K] bf16 as NVFP4 (e2m1, e4m3 per 16, fp32 global), its own quantizer."""
    from humming.layer import HummingLayer
    from humming.utils.weight import quantize_weight

    n, k = w.shape
    layer = HummingLayer(shape_n=n, shape_k=k, torch_dtype=torch.bfloat16,
                         weight_config={"dtype": "float4e2m1", "scale_dtype": "float8e4m3", "group_size": 16,
                                        "scale_type": "group_tensor"}).cuda()  # fmt: skip
    sch = layer.weight_schema
    qw, ws, _, gs = quantize_weight(w, dtype=sch.b_dtype, scale_dtype=sch.bs_dtype, group_size=16,
                                    has_global_scale=True, pack=True)  # fmt: skip
    tensors = {"weight": qw, "weight_scale": ws}
    if gs is not None:
        tensors["global_scale"] = gs.reshape(1)  # 0.1.10's quantizer returns a 0-dim global scale
    layer.load_from_tensors(tensors)
    layer.transform()
    return layer


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("nan")
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def check(cfgs: list[dict], shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Each WS config on each (M, N, K) against ``x · dequantize(W)ᵀ`` (fp32), output poisoned with NaN."""
    rows = []
    for m, n, k in shapes:
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        q = quantize(w)
        packed = to_mma_layout(q.packed)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ref = x.float() @ dequantize(q.packed, q.scale, q.global_scale, torch.float32).T
        for cfg in cfgs:
            try:
                hopper_ws.POISON = True
                bias = torch.randn(n, device=DEV, dtype=torch.bfloat16)
                y = hopper_ws.ws_linear(x, packed, q.scale, q.global_scale, bias, **cfg)
                y2 = hopper_ws.ws_linear(x, packed, q.scale, q.global_scale, bias, **cfg)
                torch.cuda.synchronize()
                if not torch.equal(y, y2):
                    raise RuntimeError("two calls differ: not deterministic")
                torch.cuda.synchronize()
                err = rel_err(y, ref + bias.float())
            except Exception as e:  # noqa: BLE001
                err = repr(e)[:300]
                traceback.print_exc()
            rows.append(dict(M=m, N=n, K=k, cfg=cfg, rel_err=err))
            print(f"check M={m} N={n} K={k} {cfg}: {err}", flush=True)
    hopper_ws.POISON = False
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default="64,128,256,512")
    ap.add_argument("--shapes", default="18944x3584,3584x3584,3584x18944")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--profile", default=None, help="N,K,M,block_m,tiles,stages: one launch each of ws and Humming (ncu)")
    args = ap.parse_args()
    if args.profile:
        n, k, m, bm, t, st, sub = map(int, args.profile.split(","))
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        q = quantize(w)
        packed = to_mma_layout(q.packed)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        hum = humming_layer(w)
        for _ in range(2):
            hopper_ws.ws_linear(x, packed, q.scale, q.global_scale, None, block_m=bm, tiles=t, stages=st, sub=sub)
            hum(x)
            nvfp4_linear(x, packed, q.scale, q.global_scale)
        torch.cuda.synchronize()
        return
    info = gemm.env_info()
    print(json.dumps(info), flush=True)
    res: dict = {"info": info, "check": [], "timing": []}
    cfgs = [dict(block_m=128, tiles=2, stages=6), dict(block_m=128, tiles=2, stages=8, sub=2),
            dict(block_m=128, tiles=2, stages=6, sub=2), dict(block_m=128, tiles=4, stages=4, sub=2),
            dict(block_m=128, tiles=4, stages=6, sub=2), dict(block_m=256, tiles=2, stages=3),
            dict(block_m=256, tiles=2, stages=4, sub=2), dict(block_m=64, tiles=4, stages=8),
            dict(block_m=64, tiles=4, stages=8, sub=2), dict(block_m=64, tiles=2, stages=12, sub=2)]  # fmt: skip
    t0 = time.time()
    res["check"] = check(cfgs, [(128, 18944, 3584), (300, 3584, 18944), (37, 1024, 5120)])
    ok = {json.dumps(r["cfg"]) for r in res["check"] if isinstance(r["rel_err"], float) and r["rel_err"] < 2e-2}
    bad = [r for r in res["check"] if json.dumps(r["cfg"]) not in ok or not isinstance(r["rel_err"], float)
           or not r["rel_err"] < 2e-2]  # fmt: skip
    print(f"checks: {len(res['check']) - len(bad)} ok, {len(bad)} bad ({time.time() - t0:.0f} s)", flush=True)
    if args.check_only:
        return
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        wts = Weights(n, k)
        try:
            hum = [humming_layer(wb) for wb in wts.bf16[: max(2, len(wts.bf16) // 4)]]
            hq = hum[0]
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            hum = []
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            nq = gemm._n_calls(len(wts.q))
            row = dict(N=n, K=k, M=m)
            row["bf16_ms"] = time_graph([partial(F.linear, x, wts.bf16[i % len(wts.bf16)]) for i in range(len(wts.bf16))])
            row["ours_ms"] = time_graph([partial(nvfp4_linear, x, *wts.q[i % len(wts.q)], None) for i in range(nq)])
            if hum:
                try:
                    ref = F.linear(x, wts.bf16[0])
                    row["humming_err_vs_bf16"] = rel_err(hq(x), ref)
                    row["humming_ms"] = time_graph([partial(hum[i % len(hum)], x) for i in range(len(hum) * 2)])
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
            for cfg in cfgs:
                if json.dumps(cfg) not in ok or cfg["block_m"] > max(64, m) or n % (64 * cfg["tiles"]):
                    continue
                for progs in (None,):
                    c = dict(cfg, programs=progs)
                    try:
                        t = time_graph([partial(hopper_ws.ws_linear, x, *wts.q[i % len(wts.q)], None, **c) for i in range(nq)])
                    except Exception as e:  # noqa: BLE001
                        print("fail", c, repr(e)[:200], flush=True)
                        continue
                    row.setdefault("ws", []).append(dict(cfg=c, ms=t))
            best = min(row.get("ws", [{"ms": float("inf"), "cfg": None}]), key=lambda r: r["ms"])
            row["ws_best_ms"], row["ws_best_cfg"] = best["ms"], best["cfg"]
            flops = 2 * m * n * k
            print(f"N={n} K={k} M={m}: bf16 {row['bf16_ms']:.4f} | ours {row['ours_ms']:.4f} "
                  f"({row['bf16_ms'] / row['ours_ms']:.2f}x) | humming {row.get('humming_ms', float('nan')):.4f} "
                  f"({row['bf16_ms'] / row.get('humming_ms', float('nan')):.2f}x) | ws best {best['ms']:.4f} "
                  f"({row['bf16_ms'] / best['ms']:.2f}x, {flops / best['ms'] / 1e9:.0f} TFLOP/s) {best['cfg']}",
                  flush=True)  # fmt: skip
            for r in row.get("ws", []):
                print(f"    {r['cfg']}: {r['ms']:.4f} ({row['bf16_ms'] / r['ms']:.2f}x)", flush=True)
            res["timing"].append(row)
            if args.out:
                Path(args.out, "gemm_ws_spike.json").write_text(json.dumps(res, indent=1))
        del wts, hum
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s")
    if args.out:
        Path(args.out, "gemm_ws_spike.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
