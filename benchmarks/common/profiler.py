"""The GPU kernels of a profiled region, by category; the decode step's share of each (``rollout.py`` /
``rollout_vllm.py --profile``)."""

from __future__ import annotations

import re
from collections.abc import Callable

# First match wins: LoRA before the GEMMs (punica's names hold "lora"), attention before FP8 (vLLM's KV-cache write
# names Fp8KVCacheDataType), the FP8 product before cuBLAS (both cutlass).
CATEGORIES: list[tuple[str, re.Pattern]] = [
    ("LoRA", re.compile(r"lora|punica|sgmv|bgmv", re.I)),
    ("nvfp4 gemm", re.compile(r"_linear_(mma_|large_m_)?kernel|_gemv_kernel|_splitk_reduce|_dequant_(mma_)?kernel"
                              r"|_dgrad_(mma_)?kernel")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient_attention|paged_attn|reshape_and_cache", re.I)),
    # torch._scaled_mm row-wise (cutlass, float_e4m3_t; or cuBLAS's nvjet with FP8 operands, "qq…_ovscale", as on the
    # H100 at 35bcdd6), vLLM's cutlass_scaled_mm, our activation quantisation
    ("fp8 gemm", re.compile(r"e4m3|e5m2|fp8|scaled_mm|_act_quant_kernel|nvjet_\w*qq", re.I)),
    ("bnb nf4", re.compile(r"4bit|kDequantize|kQuantize|nf4", re.I)),
    ("cuBLAS gemm", re.compile(r"gemm|xmma|cutlass|nvjet|cublas|splitKreduce|sm90_", re.I)),
    ("sampling", re.compile(r"argmax|topk|top_k|sort|multinomial|exponential|gumbel|sampl|log_softmax", re.I)),
    # vLLM's CUDA ops and inductor's fused names (rms norm = mean·pow·rsqrt)
    ("norm/rotary/act", re.compile(r"norm|rsqrt|rotary|rope|cos_sin|silu|act_and_mul|gelu", re.I)),
    ("inductor (fused)", re.compile(r"^triton_")),
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
]
GEMMS = ("nvfp4 gemm", "fp8 gemm", "cuBLAS gemm", "bnb nf4")

# Table columns: every category above, lm_head (by position, :func:`label_kernels`), then "other".
CATEGORY_COLUMNS = ("nvfp4 gemm", "fp8 gemm", "bnb nf4", "cuBLAS gemm", "LoRA", "attention", "lm_head", "sampling",
                    "norm/rotary/act", "inductor (fused)", "memcpy/memset", "other")  # fmt: skip


def category(kernel: str) -> str:
    return next((name for name, pat in CATEGORIES if pat.search(kernel)), "other")


def label_kernels(names: list[str]) -> list[str]:
    """The category of each kernel of a run in launch order; the GEMMs right before a sampling kernel (the last
    GEMM run of the step, after the final norm) are ``lm_head``: its name is cuBLAS's, as the bf16 linears' are."""
    cats = [category(n) for n in names]
    last_gemm = None
    for i, c in enumerate(cats):
        if c in GEMMS:
            last_gemm = i
        elif c == "sampling" and last_gemm is not None:
            while last_gemm >= 0 and cats[last_gemm] in GEMMS:
                cats[last_gemm], last_gemm = "lm_head", last_gemm - 1
            last_gemm = None
    return cats


def _summary(prof) -> dict:
    """Device µs per category and per kernel, busy µs (the union of the kernels' intervals) and the kernel count of
    one profile; without CUDA the leaf CPU ops stand in for kernels (plumbing only: other names)."""
    from torch.autograd import DeviceType

    evts = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not evts:
        evts = [e for e in prof.events() if e.device_type == DeviceType.CPU and not e.cpu_children]
    evts.sort(key=lambda e: e.time_range.start)
    cats: dict[str, float] = {}
    kern: dict[str, float] = {}
    busy, end = 0.0, float("-inf")
    for e, c in zip(evts, label_kernels([e.name for e in evts])):
        t0, t1 = e.time_range.start, e.time_range.end
        cats[c] = cats.get(c, 0.0) + t1 - t0
        key = f"[{c}] {e.name[:160]}"
        kern[key] = kern.get(key, 0.0) + t1 - t0
        busy += max(0.0, t1 - max(t0, end))
        end = max(end, t1)
    return {"cats": cats, "kernels": kern, "busy": busy, "n": len(evts)}


def profile_decode(run: Callable[[int], float], cuda: bool, steps: int = 16, top: int = 12) -> dict:
    """ms per decode step by category: ``run(n)`` (a rollout of ``n`` new tokens; returns its wall seconds) profiled
    with 1 and ``1 + steps`` tokens, the two subtracted (prefill and once-a-call work cancel) and divided by
    ``steps``. ``cpu_gap_ms``: wall minus GPU busy (the profiler's own per-op cost included)."""
    from torch.profiler import ProfilerActivity, profile

    runs = []
    for n in (1, 1 + steps):
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            wall = run(n)
        runs.append((_summary(prof), wall))
    (a, wa), (b, wb) = runs

    def per_step(x: float, y: float) -> float:  # µs → ms per step
        return round((y - x) / steps / 1000, 4)

    wall, busy = round((wb - wa) * 1000 / steps, 4), per_step(a["busy"], b["busy"])
    kern = {k: per_step(a["kernels"].get(k, 0.0), v) for k, v in b["kernels"].items()}
    return {
        "steps": steps, "wall_ms": wall, "gpu_busy_ms": busy, "cpu_gap_ms": round(wall - busy, 4),
        "kernels_per_step": round((b["n"] - a["n"]) / steps, 1),
        "by_category_ms": {c: per_step(a["cats"].get(c, 0.0), b["cats"].get(c, 0.0)) for c in CATEGORY_COLUMNS},
        "top_kernels_ms": dict(sorted(kern.items(), key=lambda kv: -kv[1])[:top]),
    }  # fmt: skip


def profile_table(results: list[dict]) -> str:
    """One row per (arm, batch) holding a ``profile``: ms per step unprofiled (the timed runs), under the profiler
    (wall), GPU busy, the gap and each category."""
    cols = [c for c in CATEGORY_COLUMNS if any(r.get("profile", {}).get("by_category_ms", {}).get(c)
                                               for x in results for r in x.get("batches", []))]  # fmt: skip
    lines = ["| model | engine | arm | B | unprofiled | wall | GPU busy | CPU gap | " + " | ".join(cols) + " |",
             "|---|---|---|---:|" + "---:|" * (4 + len(cols))]  # fmt: skip
    for x in results:
        for r in x.get("batches", []):
            if p := r.get("profile"):
                cells = [r.get("ms_per_step", float("nan")), p["wall_ms"], p["gpu_busy_ms"], p["cpu_gap_ms"],
                         *(p["by_category_ms"][c] for c in cols)]  # fmt: skip
                lines.append(f"| {x['model']} | {x.get('engine')} | {x['arm']} | {r['batch']} | "
                             + " | ".join(f"{v:.2f}" for v in cells) + " |")  # fmt: skip
    return "\n".join(lines) if len(lines) > 2 else ""


def with_profile(text: str, results: list[dict]) -> str:
    """``text``, then :func:`profile_table` of ``results`` under its title where a row holds a profile."""
    pt = profile_table(results)
    return f"{text}\n\nms per decode step (under torch.profiler)\n{pt}" if pt else text
