"""FP8 + LoRA spike (issue #51 item 3, docs/fp8_rollouts.md): the adapter as r more K columns of the FP8 GEMM.

Qwen2.5-7B's four sites as vLLM fuses them (r = 32 a member), M = 128 / 256 / 512, CUDA-graph replays (weights rotated
past L2; median ms a call). Parts: ``act_quant`` (aq), ``act_quant_lora`` form 1 (f1; BLOCK_M 4, 8 at down: the
H100's best at f0b1812) and form 2 (f2), ``_scaled_mm`` at K, K + r and K + r zero-padded to a multiple of 128.
Totals: (a) aq + ``_scaled_mm`` (K); (b) (a) + vLLM's punica shrink / expand (else torch ``mm``s: ``lora_impl``);
(c1) / (c2) form 1 / 2 + the K + r ``_scaled_mm``. Errors against float64 ``v·Wᵀ + scaling·(v·Aᵀ)·Bᵀ`` ((a):
``v·Wᵀ``; A ~ N(0, 1/K), B ~ N(0, 0.02²), scaling 2). Go: the faster fused form ≤ 1.05× (a) on the layer at M = 128
and 256, its every error ≤ 0.05. ``--tiny``: CPU smoke (references)."""

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
from nvfp4.kernels.fp8 import lora_a_norm

ROTATE_BYTES, RANK, GO_RATIO, GO_ERR = 200e6, 32, 1.05, 0.05
PARTS = ("aq", "f1", "f2", "mm_k", "mm_kr", "mm_kr128", "a", "b", "c1", "c2")


def sites(model: str) -> list[tuple[str, list[int], int, str]]:
    s = linear_shapes(model)
    h, i = s["o_proj"][1], s["down_proj"][1]
    return [("qkv", [s["q_proj"][0], s["k_proj"][0], s["v_proj"][0]], h, "rms_norm"), ("o", [h], h, "plain"),
            ("gate_up", [i, i], h, "rms_norm"), ("down", [h], i, "silu_mul")]  # fmt: skip


def time_ms(calls: list, cuda: bool) -> float:
    """Median ms per call: one CUDA graph of ``calls`` replayed (CUDA events); on CPU a plain loop (smoke only)."""
    if cuda:
        return time_graph(calls, min_reps=20, max_reps=20)
    t = time.perf_counter()
    _ = [c() for c in calls]
    return (time.perf_counter() - t) * 1e3 / len(calls)


def vllm_lora(m: int, dev: str, ads: list):
    """vLLM's punica shrink + expand on every token with adapter 0 (lora_tune.py's call), or None if not importable."""
    try:
        from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
    except Exception:  # noqa: BLE001 - any import failure means the torch fallback
        return None
    meta = LoRAKernelMeta.make(max_loras=1, max_num_tokens=m, device=dev)
    meta.prepare_tensors(torch.zeros(m, dtype=torch.int32, device=dev))
    args = meta.meta_args(m, False)
    a, b, buf = [ad[0][None] for ad in ads], [(ad[1] * ad[2]).bfloat16()[None] for ad in ads], torch.empty(
        len(ads), m, RANK, dtype=torch.float32, device=dev)

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
    an, kr, bm1 = lora_a_norm(a), w8x.shape[1], 8 if k > 8192 else 4
    kp = -(-kr // 128) * 128
    w8p = torch.zeros(n, kp, dtype=w8x.dtype, device=dev)
    w8p[:, :kr] = w8x
    copies = max(2, int(ROTATE_BYTES // w8.numel())) if cuda else 2
    base, fused, padded = ([t.clone() for _ in range(copies)] for t in (w8, w8x, w8p))
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
        sh = y @ a.T
        return out.add_(torch.cat([sh[:, i * RANK : (i + 1) * RANK] @ b for i, b in enumerate(bt)], dim=1))

    def quant(x: torch.Tensor, form: int | None):  # act_quant (None) or act_quant_lora form 1 / 2
        return fp8.act_quant(x, mode, nw) if form is None else fp8.act_quant_lora(
            x, a, c, mode, nw, block_m=bm1 if form == 1 else None, form=form, a_norm=an)

    def form_c(x: torch.Tensor, w: torch.Tensor, form: int) -> torch.Tensor:
        q, s, _, _ = quant(x, form)
        return fp8.scaled_linear(q, s, w, ws, None, x.dtype)

    rows = []
    for m in ms:
        x = torch.randn(m, 2 * k if mode == "silu_mul" else k, generator=gen).bfloat16().to(dev)
        punica[m] = vllm_lora(m, dev, ads) if cuda else None
        v = torch.nn.functional.silu(x.double().chunk(2, -1)[0]) * x.double().chunk(2, -1)[1] if mode == "silu_mul" else x.double()
        v = v * nw.double() / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) if mode == "rms_norm" else v
        ref0 = v @ wd.T  # the base alone: (a)'s reference; then each member's term at its rows
        ref = ref0 + torch.cat([sc * (v @ aa.double().T) @ bb.double().T for aa, bb, sc in ads], dim=1)
        q, s, _, _ = quant(x, 2)
        qk, qp = q[:, :k].contiguous(), torch.zeros(m, kp, dtype=q.dtype, device=dev)
        qp[:, :kr] = q
        totals = {"a": (form_a, base), "b": (form_b, base), "c1": (lambda x, w: form_c(x, w, 1), fused),
                  "c2": (lambda x, w: form_c(x, w, 2), fused)}  # fmt: skip
        err = {f: ((fn(x, wt[0]).double() - rf).norm() / rf.norm()).item() for f, (fn, wt) in totals.items()
               for rf in (ref0 if f == "a" else ref,)}  # fmt: skip
        parts = {p: (lambda x, w, q=qq, s=s: fp8.scaled_linear(q, s, w, ws), ww)
                 for p, qq, ww in (("mm_k", qk, base), ("mm_kr", q, fused), ("mm_kr128", qp, padded))} | totals
        t = {p: time_ms([lambda x=x, f=f: quant(x, f)] * 8, cuda) for p, f in (("aq", None), ("f1", 1), ("f2", 2))}
        t |= {p: time_ms([lambda w=w, x=x, fn=fn: fn(x, w) for w in ww], cuda) for p, (fn, ww) in parts.items()}
        rows.append(dict(site=name, m=m, n=n, k=k, r=RANK * len(widths), c=c, ms=t, err=err, form1_block_m=bm1,
                         lora_impl="vllm punica" if punica[m] else "torch mm"))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny shape")
    ap.add_argument("--out", default="fp8_lora_spike.json")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    model, ms = ("tiny", [3, 8]) if args.tiny else ("7b", [128, 256, 512])
    rows = [r for s in sites(model) for r in run_site(*s, ms, dev)]
    layer = {m: {p: sum(r["ms"][p] for r in rows if r["m"] == m) for p in PARTS} for m in ms}
    best = min(("c1", "c2"), key=lambda f: sum(layer[m][f] for m in ms[:2]))
    go = all(layer[m][best] <= GO_RATIO * layer[m]["a"] for m in ms[:2]) and all(r["err"][best] <= GO_ERR for r in rows)
    table = [(r["site"], r["m"], *(f"{r['ms'][p]:.4f}" for p in PARTS), *(f"{r['err'][f]:.4f}" for f in ("a", "b", "c1", "c2")))
             for r in rows] + [("layer", m, *(f"{v[p]:.4f}" for p in PARTS), "", "", "", "") for m, v in layer.items()]  # fmt: skip
    print(markdown(["site", "M", *(f"{p} ms" for p in PARTS), "err a", "err b", "err c1", "err c2"], table, "lr" + "r" * 14))
    for m, v in layer.items():
        print(f"layer M = {m}: (c1)/(a) {v['c1'] / v['a']:.3f}, (c2)/(a) {v['c2'] / v['a']:.3f}, (b)/(a) {v['b'] / v['a']:.3f}")
    print(f"{(verdict := 'GO' if go else 'NO-GO')} ({best}, the faster fused form): ({best}) <= {GO_RATIO}x (a) on the layer at M = {ms[0]} and {ms[1]}, "
          f"every ({best}) error <= {GO_ERR}")  # fmt: skip
    meta = dict(benchmark="fp8_lora_spike", date=now(), device=device_name(), versions=versions("vllm"), model=model,
                rank=RANK, layer={str(m): v for m, v in layer.items()}, verdict=verdict, best_form=best,
                lora_impl=rows[0]["lora_impl"], timing="CUDA-graph replays, median ms a call" if dev == "cuda" else "cpu")  # fmt: skip
    write_result(args.out, meta, rows)


if __name__ == "__main__":
    main()
