"""RTN in the weight's own dtype (the default, llm-compressor's bytes) against float32 scale arithmetic.

On the offline default model's linears (fused q/k/v and gate/up share a global scale, as in ``quantize_model``), held
in bf16 and in fp16: relative Frobenius error of the dequantized weights and the share of packed bytes that differ
between the two; plus one fp16 tensor with ``amax < 0.041``, where the fp16 quotient ``2688 / amax`` overflows and
compressed-tensors (and our default) fall back to a global scale of 1.0.

    uv run python benchmarks/rtn_arithmetic.py     → benchmarks/results/rtn_arithmetic.json
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from nvfp4.codec import quantize, shared_global_scale
from nvfp4.offline import offline_default_model_path
from safetensors.torch import load_file

GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def rel_err(q, w: torch.Tensor) -> tuple[float, float]:
    d = q.dequantize(torch.float32) - w.float()
    return d.square().sum().item(), w.float().square().sum().item()


def main() -> None:
    warnings.simplefilter("ignore")  # the fp16 fallback warning is what the last row measures
    sd = load_file(str(offline_default_model_path() / "model.safetensors"))
    groups: dict[tuple[str, str], list[torch.Tensor]] = {}
    for k, w in sd.items():
        if w.ndim == 2 and k.endswith("proj.weight"):
            parent, child, _ = k.rsplit(".", 2)
            groups.setdefault((parent, GROUPS.get(child, child)), []).append(w)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        packed = {}
        for compute in (None, torch.float32):
            num = den = 0.0
            packed[compute] = []
            for ws in groups.values():
                ws = [w.to(dtype) for w in ws]
                g = shared_global_scale(ws, compute)
                for w in ws:
                    q = quantize(w, global_scale=g, compute_dtype=compute)
                    n, d = rel_err(q, w)
                    num, den = num + n, den + d
                    packed[compute].append(q.packed)
            rows.append({"weights": str(dtype), "compute_dtype": str(compute or dtype), "rel_error": (num / den) ** 0.5})
        diff = sum((a != b).sum().item() for a, b in zip(packed[None], packed[torch.float32]))
        rows[-1]["packed_bytes_differing_from_default"] = diff / sum(a.numel() for a in packed[None])
    w = (torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * 0.005).to(torch.float16)
    for compute in (None, torch.float32):
        q = quantize(w, compute_dtype=compute)
        n, d = rel_err(q, w)
        rows.append({"weights": f"fp16 randn*0.005 (amax {w.abs().amax().item():.4f})", "compute_dtype":
                     str(compute or w.dtype), "global_scale": q.global_scale.item(), "rel_error": (n / d) ** 0.5})
    print("| weights | scale arithmetic | rel. error ‖W−Ŵ‖/‖W‖ | packed bytes ≠ default |\n|---|---|---|---|")
    for r in rows:
        other = r.get("packed_bytes_differing_from_default")
        print(f"| {r['weights']} | {r['compute_dtype']} | {r['rel_error']:.6f} | {'' if other is None else f'{other:.2%}'} |")
    out = Path(__file__).parent / "results" / "rtn_arithmetic.json"
    out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
