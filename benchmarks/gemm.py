"""NVFP4 W4A16 GEMM benchmark (H100): our Triton kernels vs torch bf16 matmul, per linear of one decoder layer.

For every linear of one Qwen2.5-7B / 14B / 32B decoder layer (unfused q, k, v, o, gate, up, down) and each M, times
``nvfp4_linear`` (``y = x · Wᵀ``, weights in ``NVFP4Linear``'s MMA layout) and ``F.linear`` on the bf16 weight in the
same run: our time, the achieved weight bandwidth (packed + fp8 scales) and the speed-up; the backward ``dx = dy · W``
against ``dy @ W_bf16`` at M ∈ {256, 1024, 4096}. ``mxfp4_ms`` (issue #22, unless ``--no-mxfp4``): ``NVFP4Linear``
with ``format="mxfp4"`` (E8M0 scales transcoded to NVFP4 at load, the same kernels; goal ≤ ours / 0.95).
``--compare-lora``: ``nvfp4_lora_linear`` with a rank-32 adapter as dispatched (``lora_ms``) and with ``x·Aᵀ``
beside every tile (``lora_pertile_ms``). Finished comparisons (``--compare-ct``, ``--compare-reduce``,
``--fewer-stages``, ``--profile``, ``--fp8``) are at ``benchmarks/gemm.py@dce0c4f``.

Timing: a CUDA graph of launches rotating through >= 200 MB of weight copies (past the 50 MB L2), replayed; the
median per call (CUDA events), as rollouts run the kernels (static cache + CUDA graphs), no Python overhead.

Usage (on the GPU machine)::

    python benchmarks/gemm.py                       # full tables → benchmarks/results/gemm.json
    python benchmarks/gemm.py --out $OUT            # also write gemm.json there
    python benchmarks/gemm.py --sweep --out $OUT    # tile-config sweep (tuning) → gemm_sweep.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common/, also when a test loads this file

import common  # noqa: E402, F401  (the workspace packages on sys.path)
from common.env import git_commit  # noqa: E402
from common.shapes import linear_shapes  # noqa: E402
from common.timing import interleaved, time_graph  # noqa: E402
from nvfp4 import NVFP4Linear, mxfp4  # noqa: E402
from nvfp4.codec import quantize  # noqa: E402
from nvfp4.kernels import DgradConfig, LinearConfig, nvfp4_linear, nvfp4_linear_dgrad, nvfp4_lora_linear  # noqa: E402
from nvfp4.kernels import nvfp4_gemm as kern  # noqa: E402
from nvfp4.kernels.large_m import LARGE_M_TILES  # noqa: E402
from nvfp4.layout import mma_layout_supported, to_mma_layout, to_scale_mma_layout  # noqa: E402

#: name → {linear: (N=out, K=in)} of one decoder layer (q, k, v, o, gate, up, down), from common.shapes
MODELS: dict[str, dict[str, tuple[int, int]]] = {
    f"Qwen2.5-{key.upper()}": {name.removesuffix("_proj"): nk for name, nk in linear_shapes(key).items()}
    for key in ("7b", "14b", "32b")
}
FWD_MS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
BWD_MS = [256, 1024, 4096]
ROTATE_BYTES = 200e6
DEV = "cuda"
REP_BUDGET_S = 0.1  # replay time per measurement (the sweep uses less)


# --------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------
class Weights:
    """Rotated copies of one ``[N, K]`` weight in bf16 and NVFP4 (each set ≥ ``ROTATE_BYTES``); ``q`` in the MMA
    layout where the shape allows it, its scales in the order ``NVFP4Linear`` holds them on a GPU (step A's there)."""

    def __init__(self, n: int, k: int, need_int4: bool = False, need_mxfp4: bool = False):
        self.n, self.k = n, k
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        q = quantize(w)
        self.q_bytes = q.packed.numel() + q.scale.numel() + 4
        nq = max(2, math.ceil(ROTATE_BYTES / self.q_bytes))
        self.mma = mma_layout_supported(n, k)
        packed = to_mma_layout(q.packed) if self.mma else q.packed
        scale = to_scale_mma_layout(q.scale) if self.mma else q.scale
        self.q = [(packed.clone(), scale.clone(), q.global_scale.clone()) for _ in range(nq)]
        # torch's tinygemm int4 (group 128, bf16 scales and zeros; the gpt-fast / torchao weight-only path): a peer
        # on the same GPU, timed on random codes (its speed does not depend on the values)
        self.int4 = []
        if need_int4 and k % 128 == 0:
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV)
            packed4 = torch.ops.aten._convert_weight_to_int4pack(codes, 8)
            sz = torch.randn(k // 128, n, 2, device=DEV, dtype=torch.bfloat16) * 0.01
            n4 = max(2, math.ceil(ROTATE_BYTES / (n * k // 2 + sz.numel() * 2)))
            self.int4 = [(packed4.clone(), sz.clone()) for _ in range(n4)]
        # MXFP4 layers of the same weight, as NVFP4Linear holds them on a GPU (transcoded scales, MMA layout)
        self.mxfp4_layers = []
        if need_mxfp4 and k % mxfp4.GROUP_SIZE == 0:
            qm = mxfp4.quantize(w)
            self.mxfp4_layers = [
                NVFP4Linear.from_weight(mxfp4.MXFP4Weight(qm.packed.clone(), qm.scale.clone()), None, torch.bfloat16)
                for _ in range(nq)
            ]
            layer = self.mxfp4_layers[0]
            if not layer.uses_nvfp4_ops or layer.mma_layout != self.mma:
                raise RuntimeError(f"MXFP4 {n}x{k}: not transcoded / not in the layout NVFP4 takes; timing would lie")
        self.bf16 = [w.clone() for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
        del w


def rotated(copies: list, call) -> float:
    """:func:`~common.timing.time_graph` of ``call(copy)`` for each of ``copies`` (at most 256 calls a graph), with
    ``--rep-budget``'s replay time."""
    return time_graph([call(c) for c in copies[:256]], REP_BUDGET_S)


def bench_fwd(wts: Weights, m: int, config: LinearConfig | None = None) -> float:
    x = torch.randn(m, wts.k, device=DEV, dtype=torch.bfloat16)
    return rotated(wts.q, lambda c: partial(nvfp4_linear, x, *c, None, config=config))


def bench_bf16(wts: Weights, m: int, backward: bool = False) -> float:
    """bf16 cuBLAS on the rotated bf16 copies: ``F.linear(x, W)``, or ``dy @ W`` (``backward``)."""
    x = torch.randn(m, wts.n if backward else wts.k, device=DEV, dtype=torch.bfloat16)
    return rotated(wts.bf16, lambda w: partial(torch.matmul if backward else F.linear, x, w))


def bench_mxfp4(wts: Weights, m: int) -> float:
    """The forward of the rotated MXFP4 ``NVFP4Linear`` layers (what a model runs: ``nvfp4::linear`` on the
    transcoded tensors)."""
    x = torch.randn(m, wts.k, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        return rotated(wts.mxfp4_layers, lambda layer: partial(layer, x))


def bench_int4(wts: Weights, m: int) -> float:
    """torch's tinygemm ``_weight_int4pack_mm`` (group 128) on the rotated int4 copies."""
    x = torch.randn(m, wts.k, device=DEV, dtype=torch.bfloat16)
    return rotated(wts.int4, lambda c: partial(torch.ops.aten._weight_int4pack_mm, x, c[0], 128, c[1]))


def humming_layers(wts: Weights) -> list:
    """Humming (``humming-kernels``) NVFP4 layers of the rotated bf16 copies, as many as our rotated copies: e2m1 values,
    e4m3 scale per 16, fp32 global scale, quantized by Humming's own quantizer, with whichever version is installed.
    0.1.19 spells the scales ``scale_type="group"`` + ``scale_2_type="tensor"`` and quantizes with
    ``load_from_unquantized`` (as ``shared/probes/humming_vs_ours.py``); 0.1.10 (what vLLM 0.26 ships) takes
    ``scale_type="group_tensor"`` and ``quantize_weight``, whose 0-dim global scale its layer wants as shape (1,)."""
    from importlib.metadata import version

    from humming.layer import HummingLayer

    new = tuple(int(p) for p in version("humming-kernels").split(".")[:3]) >= (0, 1, 19)
    cfg = dict(b_dtype="float4e2m1", bs_dtype="float8e4m3", group_size=16, scale_type="group", scale_2_type="tensor")
    old = {"dtype": "float4e2m1", "scale_dtype": "float8e4m3", "group_size": 16, "scale_type": "group_tensor"}
    layers = []
    for i in range(len(wts.q)):
        w = wts.bf16[i % len(wts.bf16)]
        layer = HummingLayer(shape_n=wts.n, shape_k=wts.k, weight_config=dict(cfg if new else old),
                             torch_dtype=torch.bfloat16).cuda()  # fmt: skip
        if new:
            layer.load_from_unquantized(w)
        else:
            from humming.utils.weight import quantize_weight

            sch = layer.weight_schema
            qw, ws, _, gs = quantize_weight(w, dtype=sch.b_dtype, scale_dtype=sch.bs_dtype, group_size=16,
                                            has_global_scale=True, pack=True)  # fmt: skip
            layer.load_from_tensors({"weight": qw, "weight_scale": ws, "global_scale": gs.reshape(1)})
        layer.transform()
        layers.append(layer)
    return layers


def bench_humming(wts: Weights, layers: list, m: int) -> float:
    """ms per call of Humming's forward on the rotated layers."""
    x = torch.randn(m, wts.k, device=DEV, dtype=torch.bfloat16)
    return rotated(layers, lambda layer: partial(layer, x))


def humming_error(wts: Weights, layers: list, m: int) -> float:
    """Humming's relative L2 error against the bf16 product."""
    x = torch.randn(m, wts.k, device=DEV, dtype=torch.bfloat16)
    ref = F.linear(x, wts.bf16[0]).float()
    return ((layers[0](x).float() - ref).norm() / ref.norm()).item()


# The warp-specialised kernel's candidate tiles per M (benchmarks/gemm_ws_spike.py on the 7B gate/down shapes):
# (block_m, weight tiles, stages, stages per stream-K unit). Below M = 64 the decode kernel is measured faster.
# per M: (block_m, tiles, stages, sub[, fixup]) of hopper_ws (gemm_ws_spike.py --mode fixup measures fixup / tiles=4)
WS_CANDIDATES = {64: (64, 2, 12, 2), 128: (128, 2, 8, 2), 256: (256, 2, 3, 1), 4096: (256, 2, 3, 1)}


def ws_candidate(m: int, n: int, k: int) -> LinearConfig | None:
    """The warp-specialised kernel's config for this M (None where it is not a candidate)."""
    if m < 64 or n % 128 or k % 256:
        return None
    tile = WS_CANDIDATES[min(s for s in WS_CANDIDATES if s >= m) if m <= 4096 else 4096]
    return None if n % (64 * tile[1]) else kern.entry_config(("ws", *tile), m, n, k)


def bench_lora(wts: Weights, m: int, config: LinearConfig | None = None, r: int = 32) -> float:
    """``nvfp4_lora_linear`` with a rank-``r`` adapter (one A/B pair shared by the weight copies)."""
    x = torch.randn(m, wts.k, device=DEV, dtype=torch.bfloat16)
    a = torch.randn(r, wts.k, device=DEV, dtype=torch.bfloat16) / wts.k**0.5
    b = torch.randn(wts.n, r, device=DEV, dtype=torch.bfloat16)
    return rotated(wts.q, lambda c: partial(nvfp4_lora_linear, x, *c, None, a, b, 2.0, config=config))


def bench_bwd(wts: Weights, m: int, config: DgradConfig | None = None) -> float:
    dy = torch.randn(m, wts.n, device=DEV, dtype=torch.bfloat16)
    return rotated(wts.q, lambda c: partial(nvfp4_linear_dgrad, dy, *c, config=config))


# --------------------------------------------------------------------------------------------------------------
# Full tables
# --------------------------------------------------------------------------------------------------------------
def run_tables(
    models: list[str],
    fwd_ms: list[int],
    bwd_ms: list[int],
    partial_out: Path | None = None,
    compare_lora: bool = False,
    peer_int4: bool = False,
    with_mxfp4: bool = True,
    peer_humming: bool = False,
    with_ws: bool = False,
    rounds: int = 0,
) -> dict:
    """Forward and backward rows for every linear of ``models``; rows so far are re-written to ``partial_out`` after
    each linear (a run cut short still leaves its numbers). ``with_mxfp4``: ``mxfp4_ms`` (the MXFP4 layer's forward) and ``mxfp4_vs_nvfp4`` (``ours_ms / mxfp4_ms``).
    ``peer_humming``: ``humming_ms`` and ``humming_err`` (Humming on the same bf16 weights, its quantizer).
    ``with_ws``: the warp-specialised kernel (:func:`ws_candidate`) is timed too (``ws_ms``), and ``ours_ms`` is the
    faster of it and the form the dispatch table held before (``prev_ms``): the pick a table frozen from this run
    makes (``ours_form``, ``config``); ``lora_ms`` is then timed for that pick. ``rounds``: the dispatch, bf16 and the asked
    peers timed :func:`~common.timing.interleaved` (0: one balanced design), medians; ``rounds_ms``; LoRA forms once."""
    results: dict = {"forward": [], "backward": []}
    for model in models:
        for name, (n, k) in MODELS[model].items():
            wts = Weights(n, k, need_int4=peer_int4, need_mxfp4=with_mxfp4)
            hum = humming_layers(wts) if peer_humming else []
            for m in fwd_ms:
                cfg = kern.linear_config(m, n, k, mma=wts.mma)
                wcfg = ws_candidate(m, n, k) if with_ws and wts.mma else None
                arms = {"prev": partial(bench_fwd, wts, m), "bf16": partial(bench_bf16, wts, m),
                        "ws": wcfg and partial(bench_fwd, wts, m, wcfg), "humming": hum and partial(bench_humming, wts, hum, m),
                        "int4": wts.int4 and partial(bench_int4, wts, m), "mxfp4": wts.mxfp4_layers and partial(bench_mxfp4, wts, m)}  # fmt: skip
                runs = interleaved({a: f for a, f in arms.items() if f}, rounds)
                t = {a: statistics.median(v) for a, v in runs.items()}
                form, ours, ref, ws_ms = "dispatch", t["prev"], t["bf16"], t.get("ws")
                if ws_ms is not None and ws_ms < ours:
                    form, ours, cfg = "ws", ws_ms, wcfg
                row = dict(model=model, linear=name, N=n, K=k, M=m, ours_ms=ours, bf16_ms=ref,
                           weight_GBps=wts.q_bytes / (ours * 1e-3) / 1e9, speedup=ref / ours, mma_layout=wts.mma,
                           config=cfg.__dict__, ours_form=form, prev_ms=t["prev"], ws_ms=ws_ms,
                           rounds_ms=runs if rounds != 1 else None)  # fmt: skip
                if hum:
                    row["humming_ms"], row["humming_err"] = t["humming"], humming_error(wts, hum, m)
                if compare_lora:  # as dispatched (fused, or unfused on the dequantize + cuBLAS sizes)
                    row["lora_ms"] = bench_lora(wts, m, cfg if form == "ws" else None)
                    small = cfg.mma and not cfg.dequant and not cfg.large_m
                    row["lora_pertile_ms"] = bench_lora(wts, m, replace(cfg, lora_shared_t=False)) if small else None
                if wts.int4:
                    row["int4_ms"] = t["int4"]
                if wts.mxfp4_layers:
                    row["mxfp4_ms"] = t["mxfp4"]
                    row["mxfp4_vs_nvfp4"] = ours / row["mxfp4_ms"]
                results["forward"].append(row)
            for m in bwd_ms:
                runs = interleaved({"ours": partial(bench_bwd, wts, m), "bf16": partial(bench_bf16, wts, m, True)}, rounds)
                ours, ref = statistics.median(runs["ours"]), statistics.median(runs["bf16"])
                results["backward"].append(
                    dict(model=model, linear=name, N=n, K=k, M=m, ours_ms=ours, bf16_ms=ref,
                         weight_GBps=wts.q_bytes / (ours * 1e-3) / 1e9, speedup=ref / ours,
                         config=kern.dgrad_config(m, n, k, mma=wts.mma).__dict__, rounds_ms=runs if rounds != 1 else None)
                )  # fmt: skip
            del wts, hum
            torch.cuda.empty_cache()
            print(f"  done {model} {name}", flush=True)
            if partial_out is not None:
                partial_out.write_text(json.dumps(results))
    return results


# optional per-row timings (``<key>_ms``) and their labels in the layer table
EXTRA_COLUMNS = {"lora": "+ LoRA r=32 as dispatched", "lora_pertile": "+ LoRA, x·Aᵀ per tile", "int4": "torch tinygemm int4 g128",
                 "mxfp4": "MXFP4 layer (transcoded)", "humming": "Humming NVFP4",
                 "prev": "previous dispatch (same run)"}  # fmt: skip


def layer_summary(rows: list[dict]) -> list[dict]:
    out = []
    for (model, m), grp in itertools.groupby(
        sorted(rows, key=lambda r: (r["model"], r["M"])), key=lambda r: (r["model"], r["M"])
    ):
        grp = list(grp)
        ours = sum(r["ours_ms"] for r in grp)
        ref = sum(r["bf16_ms"] for r in grp)
        qbytes = sum(r["weight_GBps"] * r["ours_ms"] * 1e-3 * 1e9 for r in grp)
        row = dict(model=model, M=m, ours_ms=ours, bf16_ms=ref, speedup=ref / ours,
                   weight_GBps=qbytes / (ours * 1e-3) / 1e9)  # fmt: skip
        for col in EXTRA_COLUMNS:
            if all(r.get(f"{col}_ms") is not None for r in grp):
                row[f"{col}_ms"] = sum(r[f"{col}_ms"] for r in grp)
                row[f"{col}_speedup"] = ref / row[f"{col}_ms"]
        if "mxfp4_ms" in row:
            row["mxfp4_vs_nvfp4"] = ours / row["mxfp4_ms"]  # the issue's goal: ≥ 0.95 at every M
        out.append(row)
    return out


def print_tables(results: dict) -> None:
    for kind in ("forward", "backward"):
        rows = results[kind]
        print(f"\n## {kind}: per linear (ours ms | weight GB/s | bf16 ms | speedup)")
        print("| model | linear | N×K | M | ours ms | GB/s | bf16 ms | ×bf16 |")
        print("|---|---|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['model']} | {r['linear']} | {r['N']}×{r['K']} | {r['M']} | {r['ours_ms']:.4f} | "
                  f"{r['weight_GBps']:.0f} | {r['bf16_ms']:.4f} | {r['speedup']:.2f} |")  # fmt: skip
        print(f"\n## {kind}: whole decoder layer (sum of its 7 linears)")
        print("| model | M | ours ms | GB/s | bf16 ms | ×bf16 | "
              + " | ".join(f"{label} ms | ×bf16" for label in EXTRA_COLUMNS.values()) + " |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(EXTRA_COLUMNS))
        for r in layer_summary(rows):
            extra = " | ".join(f"{r[c + '_ms']:.4f} | {r[c + '_speedup']:.2f}" if c + "_ms" in r else "- | -"
                               for c in EXTRA_COLUMNS)  # fmt: skip
            print(f"| {r['model']} | {r['M']} | {r['ours_ms']:.4f} | {r['weight_GBps']:.0f} | {r['bf16_ms']:.4f} | "
                  f"{r['speedup']:.2f} | {extra} |")  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Tuning sweep
# --------------------------------------------------------------------------------------------------------------
def large_m_candidates(m: int, n: int, k: int) -> list[LinearConfig]:
    """``_linear_large_m_kernel`` configs for one (M, N, K): every tile of ``LARGE_M_TILES`` that fits M, with K
    split (≥ 2 K steps per split) until the grid reaches about one and about two programs per SM."""
    out = []
    for tiles, quarters, bm, warps, stages in LARGE_M_TILES:
        if bm > max(64, triton.next_power_of_2(m)) or n % 64:
            continue
        programs = -(-m // bm) * -(-n // (64 * tiles))
        steps = k // (64 * quarters)
        for target in (kern.NUM_SMS, 2 * kern.NUM_SMS):
            split = max(1, min(-(-target // programs), steps // 2))
            out.append(LinearConfig(bm, 64 * tiles, 64 * quarters, split, warps, stages, True, group_m=8, mma=True,
                                    large_m=True))  # fmt: skip
    return list(dict.fromkeys(out))


def fwd_candidates(m: int, n: int, k: int) -> list[LinearConfig]:
    """Candidate forward configs for one (M, N, K) in the MMA layout (every shape of :data:`MODELS` takes it): the
    decode kernel's current config (:func:`~nvfp4.kernels.nvfp4_gemm.mma_config`, M ≤ 128), the large-M kernel's
    tiles from M = 32 (:func:`large_m_candidates`), dequantize + cuBLAS from M = 64."""
    out = [kern.mma_config(m, n, k)] if m <= 128 else []
    if m >= 32:
        out += large_m_candidates(m, n, k)
    return out + [LinearConfig(dequant=True, mma=True)] if m >= 64 else out


def bwd_candidates(m: int) -> list[DgradConfig]:
    """Candidate dgrad configs: ``_dgrad_mma_kernel`` tiles and dequantize + cuBLAS."""
    tiles = [DgradConfig(bm, 64, 256, warps, stages, mma=True) for bm in (64, 128) for warps in (4, 8)
             for stages in (1, 2, 3) if bm <= max(64, triton.next_power_of_2(m))]  # fmt: skip
    return tiles + [DgradConfig(dequant=True, mma=True)]


def run_sweep(models: list[str], fwd_ms: list[int], bwd_ms: list[int], deadline: float,
              partial: Path | None = None) -> dict:  # fmt: skip
    """Every candidate config per shape and M (forward, then backward), the models' shapes in order; rows so far are
    re-written to ``partial`` after each shape."""
    shapes = list(dict.fromkeys(nk for mdl in models for nk in MODELS[mdl].values()))  # the first model's first
    all_w = {nk: Weights(*nk) for nk in shapes}
    res: dict = {"forward": [], "backward": []}
    passes = (("forward", "fwd", fwd_ms, bench_fwd, fwd_candidates),
              ("backward", "bwd", bwd_ms, bench_bwd, lambda m, n, k: bwd_candidates(m)))  # fmt: skip
    for kind, tag, ms, bench, candidates in passes:
        for (n, k), wts in all_w.items():
            for m in ms:
                if time.time() > deadline:
                    break
                ref = bench_bf16(wts, m, backward=kind == "backward")
                for cfg in candidates(m, n, k):
                    try:
                        ours = bench(wts, m, cfg)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is just skipped
                        print("fail", tag, n, k, m, cfg, repr(e)[:200])
                        continue
                    res[kind].append(dict(N=n, K=k, M=m, bf16_ms=ref, ours_ms=ours, config=cfg.__dict__))
                best = min((r for r in res[kind] if (r["N"], r["K"], r["M"]) == (n, k, m)), key=lambda r: r["ours_ms"])
                print(f"{tag} N={n} K={k} M={m} bf16={ref:.4f} best={best['ours_ms']:.4f} "
                      f"({ref / best['ours_ms']:.2f}x) {best['config']}", flush=True)  # fmt: skip
            if partial is not None:
                partial.write_text(json.dumps(res))
    return res


def dispatch_table_source(sweep: dict) -> str:
    """The body of ``dispatch_table.FORWARD`` from a sweep's forward rows: per (N, K) and M, the fastest form."""
    best: dict = {}
    for r in sweep["forward"]:
        if r["M"] <= 16:  # the decode kernel's own configs (not in the table)
            continue
        key = (r["N"], r["K"], r["M"])
        if key not in best or r["ours_ms"] < best[key]["ours_ms"]:
            best[key] = r
    table: dict = {}
    for (n, k, m), r in sorted(best.items()):
        c = r["config"]
        if c["dequant"]:
            entry = "dequant"
        elif c.get("ws"):
            entry = ("ws", c["block_m"], c["block_n"] // 64, c["num_stages"], c["sub"]) + ((1,) if c.get("ws_fixup") else ())
        elif c.get("large_m"):
            entry = (c["block_n"] // 64, c["block_k"] // 64, c["block_m"], c["num_warps"], c["num_stages"], c["split_k"])
        else:
            entry = "decode"
        table.setdefault((n, k), {})[m] = entry
    return "\n".join(f"    ({n}, {k}): {{" + ", ".join(f"{m}: {e!r}" for m, e in row.items()) + "},"
                     for (n, k), row in table.items())  # fmt: skip


def apply_table(runs: list[dict]) -> None:
    """Rewrite the ``FORWARD`` block of ``nvfp4/kernels/dispatch_table.py`` with the fastest forms of ``runs``."""
    path = Path(__file__).resolve().parents[1] / "packages/nvfp4/src/nvfp4/kernels/dispatch_table.py"
    text = path.read_text()
    head, rest = text.split("FORWARD: dict[tuple[int, int], dict[int, Entry]] = {\n", 1)
    _, tail = rest.split("\n}\n# fmt: on", 1)
    body = dispatch_table_source({"forward": [r for run in runs for r in run["forward"]]})
    path.write_text(head + "FORWARD: dict[tuple[int, int], dict[int, Entry]] = {\n" + body + "\n}\n# fmt: on" + tail)
    print(f"rewrote {path} from {len(runs)} run(s)")


def env_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        humming = version("humming-kernels")  # the peer's version (--peer-humming), None where it is not installed
    except PackageNotFoundError:
        humming = None
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                humming=humming, commit=git_commit(), date=datetime.date.today().isoformat(),
                sms=torch.cuda.get_device_properties(0).multi_processor_count)  # fmt: skip


def main() -> None:
    global REP_BUDGET_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the JSON into this folder")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--ms", default=None, help="comma-separated forward Ms (default: the full list)")
    ap.add_argument("--bwd-ms", default=None, help="comma-separated backward Ms")
    ap.add_argument("--sweep", action="store_true", help="tile-config sweep instead of the tables")
    ap.add_argument("--compare-lora", action="store_true", help="also time the fused rank-32 LoRA (as dispatched, and x·Aᵀ per tile)")
    ap.add_argument("--peer-int4", action="store_true", help="also time torch's tinygemm int4 (group 128) as a peer")
    ap.add_argument("--no-mxfp4", action="store_true", help="skip the MXFP4 layer column (mxfp4_ms)")
    ap.add_argument("--peer-humming", action="store_true", help="also time Humming NVFP4 (the installed humming-kernels)")
    ap.add_argument("--ws", action="store_true", help="also time the warp-specialised kernel; ours = the faster pick")
    ap.add_argument("--rep-budget", type=float, default=REP_BUDGET_S, help="replay seconds per measurement")
    ap.add_argument("--rounds", type=int, default=0, help="rounds of the arms, balanced orders (median; 0: one design)")
    ap.add_argument("--write-table", default=None, metavar="SWEEP_JSON",
                    help="print the dispatch table (nvfp4.kernels.dispatch_table.FORWARD) of a sweep's JSON and exit")
    ap.add_argument("--apply-table", default=None, metavar="JSON", nargs="+",
                    help="rewrite dispatch_table.FORWARD from the fastest forms of these runs (sweep or --ws tables)")
    ap.add_argument("--budget", type=float, default=420.0, help="sweep wall-clock budget, seconds")
    args = ap.parse_args()
    if args.write_table:
        print(dispatch_table_source(json.loads(Path(args.write_table).read_text())))
        return
    if args.apply_table:
        apply_table([json.loads(Path(f).read_text()) for f in args.apply_table])
        return
    Path(args.out or ".").mkdir(parents=True, exist_ok=True)  # before the first partial JSON (tables, sweep)
    models = args.models.split(",")
    fwd_ms = [int(v) for v in args.ms.split(",")] if args.ms else FWD_MS
    bwd_ms = [int(v) for v in args.bwd_ms.split(",") if v.strip()] if args.bwd_ms is not None else BWD_MS
    torch.manual_seed(0)
    info = env_info()
    print(json.dumps(info), flush=True)
    t0 = time.time()
    if args.sweep:
        REP_BUDGET_S = 0.06
        res = run_sweep(models, fwd_ms, bwd_ms, t0 + args.budget,
                        Path(args.out) / "gemm_sweep_partial.json" if args.out else None)  # fmt: skip
        res.update(info)
        name = "gemm_sweep.json"
    else:
        partial_out = Path(args.out) / "gemm_partial.json" if args.out else None
        REP_BUDGET_S = args.rep_budget
        res = run_tables(models, fwd_ms, bwd_ms, partial_out, args.compare_lora, args.peer_int4, not args.no_mxfp4, args.peer_humming, args.ws, args.rounds)  # fmt: skip
        res["layer_forward"] = layer_summary(res["forward"])
        res["layer_backward"] = layer_summary(res["backward"])
        res.update(info)
        res["method"] = ("CUDA-graph replays of calls rotating through >=200 MB of weight copies per graph; median "
                         "per call; bf16 = torch.nn.functional.linear / matmul in the same run; unfused linears; "
                         f"arms in {args.rounds or 'the'} rounds of a Williams design (each arm in each place and after each "
                         "other arm equally often); the median")  # fmt: skip
        print_tables(res)
        name = "gemm.json"
    print(f"\ntotal {time.time() - t0:.0f} s", flush=True)
    dst = Path(__file__).resolve().parent / "results" / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(res, indent=1))
    if args.out:
        (Path(args.out) / name).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
