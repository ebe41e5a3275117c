"""FP8 + LoRA spike (issue #51 item 3, docs/fp8_rollouts.md): the adapter as r more K columns of the FP8 GEMM.

Qwen2.5-7B's four sites as vLLM fuses them (qkv 3 members, o, gate_up 2 members, down; r = 32 a member), M = 128 /
256 / 512, one process, CUDA-graph replays over weight copies rotated past L2 (median per call): (a) ``act_quant`` +
``_scaled_mm`` (K); (b) (a) + the adapter as vLLM computes it (its punica ``lora_shrink`` / ``lora_expand`` where
importable, else torch ``y·Aᵀ`` then ``addmm_``: ``lora_impl`` in the JSON); (c) the fused form (``act_quant_lora`` +
the K + r ``_scaled_mm``; BLOCK_M 4 / 8 / 16, the fastest kept). Errors: each form against float64 ``v·Wᵀ +
scaling·(v·Aᵀ)·Bᵀ`` on the NVFP4-dequantised W ((a): against ``v·Wᵀ``; rollout_vllm.py's adapter: A ~ N(0, 1/K), B ~ N(0, 0.02²), scaling
2). Go: (c) ≤ 1.05× (a) on the layer at M = 128 and 256, every error ≤ 0.05. ``--tiny``: CPU smoke (references).
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (the workspace packages on sys.path)
import torch
from common.env import device_name, now, versions, write_result
from common.shapes import linear_shapes
from common.tables import markdown
from common.timing import time_graph
from nvfp4 import fp8
from nvfp4.codec import dequantize, quantize

ROTATE_BYTES, RANK, GO_RATIO, GO_ERR = 200e6, 32, 1.05, 0.05


def sites(model: str) -> list[tuple[str, list[int], int, str]]:
    s = linear_shapes(model)
    h, i = s["o_proj"][1], s["down_proj"][1]
    return [("qkv", [s["q_proj"][0], s["k_proj"][0], s["v_proj"][0]], h, "rms_norm"), ("o", [h], h, "plain"),
            ("gate_up", [i, i], h, "rms_norm"), ("down", [h], i, "silu_mul")]  # fmt: skip


def time_ms(calls: list, cuda: bool) -> float:
    """Median ms per call: one CUDA graph of ``calls`` replayed (CUDA events); on CPU a plain loop (smoke only)."""
    if not cuda:
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / len(calls)
    return time_graph(calls, min_reps=20, max_reps=20)


def vllm_lora(m: int, dev: str, ads: list):
    """vLLM's punica shrink + expand on every token with adapter 0 (lora_tune.py's call), or None if not importable."""
    try:
        from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
    except Exception:  # noqa: BLE001 - any import failure means the torch fallback
        return None
    meta = LoRAKernelMeta.make(max_loras=1, max_num_tokens=m, device=dev)
    meta.prepare_tensors(torch.zeros(m, dtype=torch.int32, device=dev))
    args = meta.meta_args(m, False)
    a = [ad[0][None] for ad in ads]
    b = [(ad[1] * ad[2]).bfloat16()[None] for ad in ads]
    buf = torch.empty(len(ads), m, RANK, dtype=torch.float32, device=dev)

    def run(y: torch.Tensor, out: torch.Tensor) -> None:
        lora_shrink(y, a, buf, *args, 1.0)
        lora_expand(buf, b, out, *args, offset_start=0, add_inputs=True)

    return run, meta


def run_site(name: str, widths: list[int], k: int, mode: str, ms: list[int], dev: str) -> list[dict]:
    gen, n, cuda = torch.Generator().manual_seed(k + sum(widths)), sum(widths), dev == "cuda"
    qw = quantize((torch.randn(n, k, generator=gen) * 0.02).to(dev))
    w8, ws = fp8.fp8_weight(qw.packed, qw.scale, qw.global_scale)
    wd = dequantize(qw.packed, qw.scale, qw.global_scale, torch.float64)
    ads = [((torch.randn(RANK, k, generator=gen) / k**0.5).bfloat16().to(dev), (torch.randn(w, RANK, generator=gen) * 0.02).to(dev), 2.0)
           for w in widths]  # fmt: skip
    w8x, a, c = fp8.fp8_lora_weight(w8, ws, ads, widths)
    copies = max(2, int(ROTATE_BYTES // w8.numel())) if cuda else 2
    base, fused = [w8.clone() for _ in range(copies)], [w8x.clone() for _ in range(copies)]
    nw = (torch.rand(k, generator=gen) + 0.5).bfloat16().to(dev) if mode == "rms_norm" else None
    bt = [(ad[1] * ad[2]).bfloat16().T.contiguous() for ad in ads]
    punica = {}

    def form_a(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q, s, _, _ = fp8.act_quant(x, mode, nw)
        return fp8.scaled_linear(q, s, w, ws, None, x.dtype)

    def form_b(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q, s, y, _ = fp8.act_quant(x, mode, nw, write_y=mode != "plain")
        out, y = fp8.scaled_linear(q, s, w, ws, None, x.dtype), x if mode == "plain" else y
        if punica.get(x.shape[0]) is not None:
            punica[x.shape[0]][0](y, out)
            return out
        sh, row = y @ a.T, 0
        for i, (width, b) in enumerate(zip(widths, bt, strict=True)):
            out[:, row : row + width].addmm_(sh[:, i * RANK : (i + 1) * RANK], b)
            row += width
        return out

    def form_c(x: torch.Tensor, w: torch.Tensor, bm: int = 8) -> torch.Tensor:
        return fp8.fp8_lora_linear(x, w, ws, a, c, mode, nw, block_m=bm)

    rows = []
    for m in ms:
        x = torch.randn(m, 2 * k if mode == "silu_mul" else k, generator=gen).bfloat16().to(dev)
        punica[m] = vllm_lora(m, dev, ads) if cuda else None
        v = x.double()
        if mode == "silu_mul":
            g, u = v.chunk(2, dim=-1)
            v = g * torch.sigmoid(g) * u
        if mode == "rms_norm":
            v = v * nw.double() / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        ref0 = v @ wd.T  # the base alone: (a)'s reference
        ref, row = ref0.clone(), 0
        for width, (aa, bb, sc) in zip(widths, ads, strict=True):
            ref[:, row : row + width] += sc * (v @ aa.double().T) @ bb.double().T
            row += width
        err = {f: ((fn(x, wt[0]).double() - r).norm() / r.norm()).item() for f, fn, wt, r in
               (("base", form_a, base, ref0), ("vllm", form_b, base, ref), ("fused", form_c, fused, ref))}  # fmt: skip
        t_a = time_ms([lambda w=w, x=x: form_a(x, w) for w in base], cuda)
        t_b = time_ms([lambda w=w, x=x: form_b(x, w) for w in base], cuda)
        t_c = {bm: time_ms([lambda w=w, x=x, bm=bm: form_c(x, w, bm) for w in fused], cuda) for bm in (4, 8, 16)}
        best = min(t_c, key=t_c.get)
        rows.append(dict(site=name, m=m, n=n, k=k, r=RANK * len(widths), c=c, base_ms=t_a, vllm_ms=t_b,
                         fused_ms=t_c[best], fused_block_m=best, fused_ms_by_block_m=t_c, base_err=err["base"],
                         vllm_err=err["vllm"], fused_err=err["fused"], fused_x_base=t_c[best] / t_a,
                         lora_impl="vllm punica" if punica[m] else "torch mm + addmm_"))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny shape")
    ap.add_argument("--out", default="fp8_lora_spike.json")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    model, ms = ("tiny", [3, 8]) if args.tiny else ("7b", [128, 256, 512])
    rows = [r for s in sites(model) for r in run_site(*s, ms, dev)]
    layer = {m: {f: sum(r[f] for r in rows if r["m"] == m) for f in ("base_ms", "vllm_ms", "fused_ms")} for m in ms}
    go = all(layer[m]["fused_ms"] <= GO_RATIO * layer[m]["base_ms"] for m in ms[:2])
    go = go and all(r["fused_err"] <= GO_ERR for r in rows)
    table = [(r["site"], r["m"], f"{r['base_ms']:.4f}", f"{r['vllm_ms']:.4f}", f"{r['fused_ms']:.4f}", r["fused_block_m"],
              f"{r['fused_x_base']:.3f}", f"{r['base_err']:.4f}", f"{r['vllm_err']:.4f}", f"{r['fused_err']:.4f}")
             for r in rows]  # fmt: skip
    table += [("layer", m, f"{v['base_ms']:.4f}", f"{v['vllm_ms']:.4f}", f"{v['fused_ms']:.4f}", "", f"{v['fused_ms'] / v['base_ms']:.3f}",
               "", "", "") for m, v in layer.items()]  # fmt: skip
    print(markdown(["site", "M", "(a) ms", "(b) ms", "(c) ms", "BLOCK_M", "(c)/(a)", "err a", "err b", "err c"], table,
                   "lrrrrrrrrr"))  # fmt: skip
    verdict = "GO" if go else "NO-GO"
    print(f"{verdict}: (c) <= {GO_RATIO}x (a) on the layer at M = {ms[0]} and {ms[1]}, every (c) error <= {GO_ERR}")
    meta = dict(benchmark="fp8_lora_spike", date=now(), device=device_name(), versions=versions("vllm"), model=model,
                rank=RANK, layer={str(m): v for m, v in layer.items()}, verdict=verdict,
                lora_impl=rows[0]["lora_impl"], timing="CUDA-graph replays, median ms a call" if dev == "cuda" else "cpu")  # fmt: skip
    write_result(args.out, meta, rows)


if __name__ == "__main__":
    main()
