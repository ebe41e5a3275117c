"""Where the decode-size NVFP4 GEMM loses bandwidth (H100): the MMA kernel's memory traffic alone, then with compute.

``_linear_mma_kernel`` streams the large weights at ~1.4-1.7 TB/s at M ≤ 16, while a plain copy runs at ~3 TB/s.
This script separates the causes by timing, on the same weights and grids, kernels that do less:

* ``copy``   — ``torch`` copy of the NVFP4 bytes (packed + scales): what the memory system gives a simple stream;
* ``w``      — :func:`_stream_kernel` with the GEMM's grid and loads of the weight tile and its scales (pipelined
  with ``cp.async`` like the GEMM), XOR-folded into registers: the access pattern's own ceiling;
* ``w+x``    — the same plus the activation tile loads;
* ``gemm``   — the real ``nvfp4_linear`` (decode + ``wgmma`` + split-K), same config.

Each is measured over splits (programs) and pipeline depths. Timing as in ``gemm.py`` (CUDA-graph replays over
weight copies that exceed L2).

Usage (GPU)::

    python benchmarks/gemm_ablation.py --out $OUT      # table + gemm_ablation.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "nvfp4" / "src"))

from gemm import MODELS, Weights, _n_calls, env_info, time_graph  # noqa: E402
from nvfp4.kernels import nvfp4_gemm as kern  # noqa: E402
from nvfp4.kernels import nvfp4_linear  # noqa: E402


@triton.jit
def _stream_kernel(w_ptr, s_ptr, x_ptr, out_ptr, M, K, stride_xm, K_PER_SPLIT, LOAD_X: tl.constexpr,
                   BLOCK_M: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """The loads of ``_linear_mma_kernel`` (same tile pointers, same loop), XOR-folded instead of decoded."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    w_tile, s_tile = kern._mma_tile_ptrs(w_ptr, s_ptr, pid_n, K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 256)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    k_lo = pid_k * K_PER_SPLIT
    k_hi = min(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((16, 512), dtype=tl.uint8)
    sacc = tl.zeros((64, 4), dtype=tl.int32)
    xacc = tl.zeros((BLOCK_M, 256), dtype=tl.int16)
    for k0 in tl.range(k_lo, k_hi, 256, num_stages=STAGES):  # explicit: loops without a dot are not pipelined
        acc ^= tl.load(w_tile + 2 * k0)
        sacc ^= tl.load(s_tile + k0 // 64)
        if LOAD_X:
            xt = tl.load(x_rows + (k0 + offs_k)[None, :], mask=(offs_m < M)[:, None], other=0.0)
            xacc ^= xt.to(tl.int16, bitcast=True)
    folded = tl.sum(tl.sum(acc.to(tl.int32), axis=1), axis=0) + tl.sum(tl.sum(sacc, axis=1), axis=0)
    folded += tl.sum(tl.sum(xacc.to(tl.int32), axis=1), axis=0)
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, folded)


def stream(wts: Weights, x: torch.Tensor, split: int, stages: int, load_x: bool):
    n, k = wts.n, wts.k
    kps = triton.cdiv(triton.cdiv(k, split), 256) * 256
    split = triton.cdiv(k, kps)
    out = torch.empty(split * (n // 64), device="cuda", dtype=torch.int32)

    def call(i):
        p, s, _ = wts.q[i % len(wts.q)]
        _stream_kernel[(n // 64, split)](p, s, x, out, x.shape[0], k, x.stride(0), kps, LOAD_X=load_x,
                                         BLOCK_M=max(16, triton.next_power_of_2(x.shape[0])), STAGES=stages,
                                         num_warps=4, num_stages=stages)  # fmt: skip

    return time_graph([partial(call, i) for i in range(_n_calls(len(wts.q)))])


def copy_ms(wts: Weights) -> float:
    dst = [(torch.empty_like(p), torch.empty_like(s)) for p, s, _ in wts.q[:2]]

    def call(i):
        p, s, _ = wts.q[i % len(wts.q)]
        d = dst[i % 2]
        d[0].copy_(p)
        d[1].copy_(s)

    return time_graph([partial(call, i) for i in range(_n_calls(len(wts.q)))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--linears", default="Qwen2.5-7B:gate,Qwen2.5-7B:down,Qwen2.5-7B:q,Qwen2.5-32B:gate")
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args()
    info = env_info()
    print(json.dumps(info), flush=True)
    rows = []
    for spec in args.linears.split(","):
        model, name = spec.split(":")
        n, k = MODELS[model][name]
        wts = Weights(n, k, need_bf16=False)
        gb = wts.q_bytes / 1e9
        cp = copy_ms(wts)
        print(f"\n{model} {name} {n}x{k}: NVFP4 {gb * 1e3:.1f} MB; copy (read + write) {cp * 1e3:.1f} µs = "
              f"{2 * gb / (cp * 1e-3):.0f} GB/s moved", flush=True)  # fmt: skip
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = kern.linear_config(m, n, k, mma=True)
            for split in sorted({1, 2, 3, 4, 6, 8, base.split_k}):
                if k // 256 < split:
                    continue
                for stages in (2, 3, 4):
                    r = dict(model=model, linear=name, N=n, K=k, M=m, split=split, stages=stages, copy_ms=cp,
                             programs=(n // 64) * split)  # fmt: skip
                    r["w_ms"] = stream(wts, x, split, stages, False)
                    r["wx_ms"] = stream(wts, x, split, stages, True)
                    cfg = replace(base, split_k=split, num_stages=stages, fused_reduce=True)
                    r["gemm_ms"] = time_graph([partial(nvfp4_linear, x, *wts.q[i % len(wts.q)], None, config=cfg)
                                               for i in range(_n_calls(len(wts.q)))])  # fmt: skip
                    for key in ("w", "wx", "gemm"):
                        r[f"{key}_GBps"] = gb / (r[f"{key}_ms"] * 1e-3)
                    rows.append(r)
                    print(f"  M={m:3d} split={split:2d} ({r['programs']:4d} programs) stages={stages}: "
                          f"w {r['w_ms'] * 1e3:5.1f} µs {r['w_GBps']:5.0f} GB/s | w+x {r['wx_ms'] * 1e3:5.1f} µs "
                          f"{r['wx_GBps']:5.0f} GB/s | gemm {r['gemm_ms'] * 1e3:5.1f} µs {r['gemm_GBps']:5.0f} GB/s",
                          flush=True)  # fmt: skip
        del wts
        torch.cuda.empty_cache()
    res = dict(info, rows=rows)
    dst = Path(__file__).resolve().parent / "results" / "gemm_ablation.json"
    dst.write_text(json.dumps(res, indent=1))
    if args.out:
        Path(args.out, "gemm_ablation.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
