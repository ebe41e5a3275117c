"""Inference with the `nvfp4` package alone (no TRL, no vLLM): load an NVFP4 checkpoint and chat with it.

    python examples/inference_nvfp4_only.py [CHECKPOINT]      # default: runs/example-nvfp4 (quantized if missing)
"""

import sys
from pathlib import Path

import nvfp4
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/example-nvfp4")
if not (path / "config.json").is_file():
    from nvfp4.offline import offline_default_model_path

    model = AutoModelForCausalLM.from_pretrained(offline_default_model_path(), quantization_config=nvfp4.NVFP4Config())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(offline_default_model_path()).save_pretrained(path)

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nvfp4.load_nvfp4_checkpoint(path, device_map=device)  # NVFP4Linear on our kernels (either config)
tokenizer = AutoTokenizer.from_pretrained(path)
messages = [{"role": "user", "content": "What is 15 + 27? Answer with the number."}]
enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True).to(device)
out = model.generate(**enc, max_new_tokens=32, do_sample=False)
print(tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
