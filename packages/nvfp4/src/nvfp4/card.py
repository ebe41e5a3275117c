"""Model card written beside an NVFP4 checkpoint (``README.md``), so a Hub page says what the tensors are."""

from __future__ import annotations

from pathlib import Path

from .formats import Format, get_format
from .hf import FORMAT

__all__ = ["write_model_card"]


def write_model_card(
    folder: str | Path,
    *,
    base_model: str,
    method: str,
    error_table: str | None = None,
    extra: str = "",
    format: str | Format = "nvfp4",
) -> Path:
    """Write ``folder/README.md`` describing the format, the calibration and (optionally) a measured error table.

    ``format``: ``"nvfp4"`` (default) or ``"mxfp4"`` (the MXFP4A16 card: E8M0 scales per 32 inputs), or the
    :class:`~nvfp4.formats.Format`; the format says which card it has (:meth:`~nvfp4.formats.Format.write_card`).
    """
    fmt = get_format(format)  # a Format as it is; the public API's name looked up once, here
    return fmt.write_card(folder, base_model=base_model, method=method, error_table=error_table, extra=extra)


_STOCK_DTYPE_NOTE = (
    "  compressed-tensors (0.20) decompresses the 4-bit weights to bf16, so this path needs a bf16 checkpoint: one\n"
    "  saved in float16/float32 fails at the first forward there (the loaders below take any dtype).\n"
)


def _write_nvfp4_card(folder: str | Path, *, base_model: str, method: str, error_table: str | None, extra: str) -> Path:
    text = f"""---
base_model: {base_model}
library_name: transformers
tags: [nvfp4, nvfp4a16, compressed-tensors, qerl]
---

# {Path(str(base_model)).name} — NVFP4 (weight-only)

## Load it

The `quantization_config` is the compressed-tensors one that llm-compressor writes for `NVFP4A16`, so the usual
loaders read it as they are:

- **transformers** (with `pip install compressed-tensors`):
  ```python
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained("<this repo>")
  ```
  Without compressed-tensors installed the load stops with an error that says so.
{_STOCK_DTYPE_NOTE}- **vLLM**: `vllm serve <this repo>` or `LLM("<this repo>")` (its compressed-tensors NVFP4A16 scheme; Marlin FP4
  kernels on NVIDIA GPUs). On vLLM's CPU engine, `pip install qerl-vllm` (QeRL's plugin) adds the path it lacks.
- **`nvfp4`** (QeRL's Triton W4A16 kernels on Hopper, PEFT LoRA on top):
  ```python
  import nvfp4
  model = nvfp4.from_compressed_tensors("<this repo>")   # NVFP4Linear layers
  ```
  A plain `from_pretrained` goes through compressed-tensors (transformers picks the loader from `quant_method`).

## Format

Quantized with [QeRL's `nvfp4`](https://pypi.org/project/nvfp4/). Linear weights are stored in the compressed-tensors
`{FORMAT}` layout: E2M1 4-bit values
(two per byte, element 2i in the low nibble) in `weight_packed` (uint8 `[out, in/2]`), one FP8-E4M3 scale per 16
inputs in `weight_scale` (`[out, in/16]`), one FP32 scale per tensor in `weight_global_scale` (a divisor:
`w ≈ e2m1 · scale / global`). Fused q/k/v and gate/up share one global scale. Activations stay in bf16 (W4A16).
Embeddings and `lm_head` are kept in full precision. QeRL's own fields (calibration method, fused groups) sit
under `quantization_config["qerl"]`, which compressed-tensors ignores.

**Calibration.** `{method}` ({_METHODS.get(method, method)}).
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
    "gptq": "GPTQ: column-by-column rounding with the error spread through the inverse input Hessian of calibration data",
}


def _write_mxfp4_card(folder: str | Path, *, base_model: str, method: str, error_table: str | None, extra: str) -> Path:
    text = f"""---
base_model: {base_model}
library_name: transformers
tags: [mxfp4, mxfp4a16, compressed-tensors, qerl]
---

# {Path(str(base_model)).name} — MXFP4 (weight-only)

## Load it

The `quantization_config` is the compressed-tensors one that llm-compressor writes for `MXFP4A16`:

- **transformers** (with `pip install compressed-tensors`): `AutoModelForCausalLM.from_pretrained("<this repo>")`.
{_STOCK_DTYPE_NOTE}- **vLLM**: `LLM("<this repo>")` where its compressed-tensors MXFP4 scheme runs; on vLLM's CPU engine,
  `pip install qerl-vllm` (QeRL's plugin) adds the path.
- **`nvfp4`** (QeRL's Triton W4A16 kernels, after an exact transcode of the scales; PEFT LoRA on top):
  `nvfp4.from_compressed_tensors("<this repo>")`.

## Format

Quantized with [QeRL's `nvfp4`](https://pypi.org/project/nvfp4/), round to nearest, bit-identical to
compressed-tensors. Linear weights are stored in the compressed-tensors `mxfp4-pack-quantized` layout: E2M1 4-bit
values (two per byte, element 2i in the low nibble) in `weight_packed` (uint8 `[out, in/2]`), one E8M0 scale per 32
inputs in `weight_scale` (uint8 `[out, in/32]`, `w ≈ e2m1 · 2^(scale - 127)`), no per-tensor scale. Activations stay
in bf16 (W4A16). Embeddings and `lm_head` are kept in full precision.
"""
    if error_table:
        text += f"\n**Measured quality.**\n\n{error_table}\n"
    text += extra
    path = Path(folder) / "README.md"
    path.write_text(text)
    return path
