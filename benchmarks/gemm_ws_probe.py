"""Probe (round 9, issue #18): can Triton 3.6 warp-specialise the large-M NVFP4 GEMM on Hopper?

Not a shipped kernel: a record of what was tried. ``triton.language.range(..., warp_specialize=True)`` runs Triton's
Hopper warp-specialisation pass (``add_hopper_warpspec``) on sm_90 — a producer warpgroup issuing TMA loads, consumer
warpgroups doing the MMAs, ``setmaxnreg`` — which is the Machete design the large-M kernel lacks
(``docs/kernels.md``, round 7-8: its warps stall on the serial load → decode → ``wgmma`` chain). The pass needs
tensor-descriptor (TMA) loads, so this kernel is the large-M kernel (``nvfp4.kernels.large_m``) with x, the packed
MMA-layout weight (viewed ``[N/64, 16, K/128, 256]``) and the scales (int32 words ``[N, K/64]``) behind
``tl.make_tensor_descriptor``, one 64-row weight tile per program and K steps of 256 (the scale box must be ≥ 16
bytes: 4 words). What it showed on the H100 (``benchmarks/results/gemm_ws_probe.json``, BENCHMARKS.md):

* 4 warps + ``warp_specialize=True`` → a 12-warp kernel (checked in the PTX: ``setmaxnreg``); with two weight tiles per
  program the pass's data partitioning aborts (``WSDataPartition.cpp: Unexpected op``, the decode's reshapes);
  without descriptors it asserts (``WSLowerToken.cpp``).
* Correct only with 2 stages; with 3-4 stages its output holds NaN (a miscompile, shown by the NaN-filled output test
  below), so only 2-stage rows count.
* Warp specialisation helps this kernel (1.1-1.5× over the same kernel without it) but the TMA / K-256 form is
  slower than the shipped kernels at every M ≥ 64 (0.34-0.93× bf16 vs the shipped 0.63-1.63×).

    python3 benchmarks/gemm_ws_probe.py            # on the H100; writes $OUT/gemm_ws_probe.json (~1 min)
    TRITON_INTERPRET=1 python3 benchmarks/gemm_ws_probe.py --check   # the kernel against the codec on CPU (fp16)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "packages" / "nvfp4" / "src")]

from nvfp4.kernels.decode import _mma_tiles, _scale_fold  # noqa: E402

CONFIGS = [  # weight tiles of 64 rows, BLOCK_M, stages, warps, warp-specialised
    (1, 128, 2, 4, True), (1, 128, 3, 4, True), (1, 64, 3, 4, True), (1, 64, 4, 4, True),
    (1, 128, 2, 4, False), (2, 128, 2, 8, False), (1, 128, 2, 8, False),
]  # fmt: skip
SHAPES = [("Qwen2.5-7B", "gate"), ("Qwen2.5-7B", "down"), ("Qwen2.5-7B", "q"), ("Qwen2.5-7B", "k"),
          ("Qwen2.5-32B", "gate"), ("Qwen2.5-32B", "down")]  # fmt: skip
MS = [64, 128, 256, 512, 1024, 2048, 4096]


@triton.jit
def _large_m_tma_kernel(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_ym, TILES: tl.constexpr,
                        BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, FAST: tl.constexpr, WS: tl.constexpr,
                        NUM_STAGES: tl.constexpr):  # fmt: skip
    """``y[M, N] = x · Wᵀ``: x ``[M, K]`` bf16/fp16, W packed uint8 ``[N/4, 2K]`` (MMA layout), scales fp8
    ``[N, K/16]``, global fp32 ``[1]``. ``N % 64 == 0``, ``K % 256 == 0``. Descriptors zero-fill rows past M."""
    pid = tl.program_id(0)
    BLOCK_N: tl.constexpr = 64 * TILES
    BLOCK_K: tl.constexpr = 256
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gsize = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    x_d = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    # a tile's 16 stored rows, each column of 512 bytes cut in two (a TMA box dimension is at most 256 elements)
    w_d = tl.make_tensor_descriptor(w_ptr, shape=[N // 64, 16, K // 128, 256], strides=[32 * K, 2 * K, 256, 1],
                                    block_shape=[TILES, 16, 2, 256])  # fmt: skip
    s_d = tl.make_tensor_descriptor(s_ptr.to(tl.pointer_type(tl.int32)), shape=[N, K // 64], strides=[K // 64, 1],
                                    block_shape=[BLOCK_N, 4])  # fmt: skip
    sfac, _ = _scale_fold(g_ptr, False)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES, warp_specialize=WS):
        p = w_d.load([pid_n * TILES, 0, k0 // 128, 0])  # [T, 16 = (quarter, warp), 2, 256]
        p = tl.reshape(tl.permute(tl.reshape(p, (TILES, 4, 4, 512)), (1, 0, 2, 3)), (16 * TILES, 512))
        w = _mma_tiles(p, s_d.load([pid_n * BLOCK_N, k0 // 64]), sfac, TILES, 4, FAST, dtype)
        acc = tl.dot(w, tl.trans(x_d.load([pid_m * BLOCK_M, k0])), acc)
    acc = tl.trans(acc)
    if FAST:
        acc = acc * sfac
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(dtype),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))  # fmt: skip


def launch(cfg: tuple, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor, y: torch.Tensor,
           fast: bool = True) -> None:  # fmt: skip
    tiles, block_m, stages, warps, ws = cfg
    m, k = x.shape
    n = y.shape[1]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, 64 * tiles),)
    _large_m_tma_kernel[grid](x, packed, scale, gs, y, m, n, k, x.stride(0), y.stride(0), TILES=tiles,
                              BLOCK_M=block_m, GROUP_M=8, FAST=fast, WS=ws, NUM_STAGES=stages, num_warps=warps,
                              num_stages=stages)  # fmt: skip


def _alloc(device: str) -> None:
    """Device-side tensor descriptors need a global scratch buffer."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def check_cpu() -> None:
    """The kernel against the codec's dequantization under ``TRITON_INTERPRET=1`` (fp16; odd M, N = 3 tiles)."""
    from nvfp4.codec import dequantize, quantize
    from nvfp4.layout import to_mma_layout

    _alloc("cpu")
    torch.manual_seed(0)
    for m, n, k in [(70, 128, 512), (5, 192, 256)]:
        q = quantize(torch.randn(n, k) * 0.05)
        x = torch.randn(m, k).half()
        ref = x.float() @ dequantize(q.packed, q.scale, q.global_scale, torch.float32).T
        y = torch.full((m, n), float("nan"), dtype=torch.float16)
        launch((1, 64, 2, 4, False), x, to_mma_layout(q.packed).contiguous(), q.scale, q.global_scale, y, fast=False)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        print(f"M={m} N={n} K={k}: relative error {err:.2e}, NaN {bool(torch.isnan(y).any())}")
        assert err < 2e-3 and not torch.isnan(y).any()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU interpreter check only")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "gemm_ws_probe.json")
    args = ap.parse_args()
    if args.check:
        return check_cpu()
    import gemm as harness
    from nvfp4.kernels import nvfp4_linear

    _alloc("cuda")
    harness.REP_BUDGET_S = 0.05
    rows, t0 = [], time.time()
    for model, lin in SHAPES:
        n, k = harness.MODELS[model][lin]
        wts = harness.Weights(n, k)
        nq, nb = harness._n_calls(len(wts.q)), harness._n_calls(len(wts.bf16))
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            shipped = harness.time_graph([partial(nvfp4_linear, x, *wts.q[i % len(wts.q)], None) for i in range(nq)])
            bf16 = harness.time_graph([partial(F.linear, x, wts.bf16[i % len(wts.bf16)]) for i in range(nb)])
            ref = nvfp4_linear(x, *wts.q[0], None).float()
            row = {"model": model, "linear": lin, "N": n, "K": k, "M": m, "bf16_ms": bf16, "shipped_ms": shipped,
                   "configs": {}}  # fmt: skip
            for cfg in CONFIGS:
                key = "T{}_BM{}_NS{}_NW{}_{}".format(*cfg[:4], "ws" if cfg[4] else "nows")
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                launch(cfg, x, *wts.q[0], y)
                ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                ms = harness.time_graph([partial(launch, cfg, x, *wts.q[i % len(wts.q)], ys[i % 2]) for i in range(nq)])
                err = ((y.float() - ref).norm() / ref.norm()).item()
                row["configs"][key] = {"ms": ms, "rel_err_vs_shipped": err, "nan": bool(torch.isnan(y).any())}
            ok = {kk: v for kk, v in row["configs"].items() if not v["nan"] and v["rel_err_vs_shipped"] < 1e-2}
            best = min(ok, key=lambda kk: ok[kk]["ms"]) if ok else None
            row["best_correct"] = best
            print(f"{model} {lin:5s} M={m:5d} bf16 {bf16 * 1e3:7.1f} µs  shipped {bf16 / shipped:.2f}x  best correct "
                  f"probe {bf16 / ok[best]['ms'] if best else 0:.2f}x ({best})", flush=True)  # fmt: skip
            rows.append(row)
        del wts
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "triton": triton.__version__, "seconds": time.time() - t0, "rows": rows},
                                   indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
