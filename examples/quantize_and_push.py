"""Quantize a bf16 causal LM to NVFP4 on load, save it with a model card, and (optionally) push it to the Hub.

    python examples/quantize_and_push.py                      # offline default model, saves to runs/example-nvfp4
    python examples/quantize_and_push.py Qwen/Qwen2.5-7B-Instruct --push-to-hub you/Qwen2.5-7B-Instruct-NVFP4
"""

import argparse

import nvfp4
from nvfp4.card import write_model_card
from transformers import AutoModelForCausalLM, AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("model", nargs="?")
ap.add_argument("--out", default="runs/example-nvfp4")
ap.add_argument("--push-to-hub")
args = ap.parse_args()
if args.model is None:
    from nvfp4.offline import offline_default_model_path

    args.model = str(offline_default_model_path())

model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=nvfp4.NVFP4Config(method="mse"))
tokenizer = AutoTokenizer.from_pretrained(args.model)
model.save_pretrained(args.out)
tokenizer.save_pretrained(args.out)
write_model_card(args.out, base_model=args.model, method="mse")
print(f"saved {args.out}")
if args.push_to_hub:
    model.push_to_hub(args.push_to_hub)
    tokenizer.push_to_hub(args.push_to_hub)
