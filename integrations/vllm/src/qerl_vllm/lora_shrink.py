"""Bitwise reproducible LoRA rollouts on CUDA: vLLM's LoRA shrink kernel held to one K split.

vLLM's Triton LoRA "shrink" kernel (``x @ lora_A`` for every token) splits K 64 ways below 128 rows (8 ways from
there) and sums the float32 partial products with ``tl.atomic_add`` in the order the blocks finish, so the same
adapter on the same prompts gives different logprobs from one run to the next (0.066-0.086 apart, bf16, on an H200
with vLLM 0.26: ``benchmarks/results/repro_probe_h200_b78624b.log``, the probe at b78624b; the base model without
LoRA, and our kernels, bit-identical). With one split the kernel stores its sums instead: every arm of that probe was
then bit-identical run to run. vLLM takes the split from a JSON file in the folder ``VLLM_TUNED_CONFIG_FOLDER`` names
(its own tuning hook, ``vllm/lora/ops/triton_ops/utils.py``); :func:`write_one_split_shrink_config` writes that file.
vLLM reads the variable once per process and keeps what it found (an engine freezes vLLM's environment when it
starts), so set it before the first engine or server of the process starts. vLLM's CPU engine runs LoRA without these
kernels and never reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["TUNED_CONFIG_FOLDER_ENV", "write_one_split_shrink_config"]

TUNED_CONFIG_FOLDER_ENV = "VLLM_TUNED_CONFIG_FOLDER"
# vLLM's default shrink tile below 128 rows, with split_k 1 (no atomics)
_ONE_SPLIT = {"block_m": 32, "block_n": 16, "block_k": 256, "split_k": 1, "num_warps": 4, "num_ctas": 1,
              "group_size_m": 8, "num_stages": 2, "max_nreg": None}  # fmt: skip
# vLLM looks the slice count up exactly (a KeyError for one not listed): 1 for a plain linear, one per member of a
# fused one (2 gate/up, 3 q/k/v); beyond that, room for other models' fusions
_SLICE_COUNTS = range(1, 17)


def write_one_split_shrink_config(folder: str | os.PathLike, device_name: str | None = None) -> Path:
    """Write vLLM's tuned config for its LoRA shrink kernel with one K split into ``folder``; returns the file.

    Point ``VLLM_TUNED_CONFIG_FOLDER`` at ``folder`` before vLLM starts (the engine's process, or the server's
    environment in server mode) to make LoRA rollouts bitwise reproducible run to run on CUDA (module docstring).
    vLLM names the file after the GPU (``{device name}_SHRINK.json``, spaces and dashes as ``_``; ``device_name``:
    default the current CUDA device's) and keys it ``[max_loras][num_slices][rows][K][rank]``, each level but the
    slice count matched to the nearest key: one entry per level covers every row count, hidden size and rank.
    """
    if device_name is None:
        import torch

        device_name = torch.cuda.get_device_name()
    name = device_name.replace(" ", "_").replace("-", "_")
    table = {"1": {str(s): {"1": {"1": {"1": _ONE_SPLIT}}} for s in _SLICE_COUNTS}}
    path = Path(folder) / f"{name}_SHRINK.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table))
    return path
