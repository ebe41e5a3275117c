"""Model card written beside an NVFP4 checkpoint (``README.md``), so a Hub page says what the tensors are."""

from __future__ import annotations

from pathlib import Path

from .hf import FORMAT, QUANT_METHOD

__all__ = ["write_model_card"]


def write_model_card(
    folder: str | Path,
    *,
    base_model: str,
    method: str,
    error_table: str | None = None,
    extra: str = "",
) -> Path:
    """Write ``folder/README.md`` describing the format, the calibration and (optionally) a measured error table."""
    text = f"""---
base_model: {base_model}
library_name: transformers
tags: [nvfp4, {QUANT_METHOD}, compressed-tensors, qerl]
---

# {Path(str(base_model)).name} — NVFP4 (weight-only)

Quantized with [QeRL's `nvfp4`](https://pypi.org/project/nvfp4/) (`quant_method="{QUANT_METHOD}"`).

**Format.** Linear weights are stored in the compressed-tensors `{FORMAT}` layout: E2M1 4-bit values
(two per byte, element 2i in the low nibble) in `weight_packed` (uint8 `[out, in/2]`), one FP8-E4M3 scale per 16
inputs in `weight_scale` (`[out, in/16]`), one FP32 scale per tensor in `weight_global_scale` (a divisor:
`w ≈ e2m1 · scale / global`). Fused q/k/v and gate/up share one global scale. Activations stay in bf16 (W4A16).
Embeddings and `lm_head` are kept in full precision.

**Calibration.** `{method}` ({_METHODS.get(method, method)}).

**Load.**
```python
import nvfp4  # registers the quantization method with transformers
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("<this repo>")
```
"""
    if error_table:
        text += f"\n**Measured quality.**\n\n{error_table}\n"
    text += extra
    path = Path(folder) / "README.md"
    path.write_text(text)
    return path


_METHODS = {
    "rtn": "round to nearest, bit-identical to compressed-tensors",
    "mse": "per-block FP8 scale search minimising squared weight error",
    "awq": "per-block FP8 scale search weighted by calibration activations' mean squares",
}
