"""Triton NVFP4 W4A16 kernels (Hopper-tuned): see :mod:`nvfp4.kernels.nvfp4_gemm` for the layout and the design.

Importing this package needs ``triton``; :mod:`nvfp4.ops` falls back to the PyTorch reference when it is missing.
"""

from .nvfp4_gemm import (
    DgradConfig,
    LinearConfig,
    dequantize_triton,
    dgrad_config,
    linear_config,
    mma_config,
    nvfp4_linear,
    nvfp4_linear_dgrad,
    nvfp4_lora_linear,
)

__all__ = [
    "DgradConfig",
    "LinearConfig",
    "dequantize_triton",
    "dgrad_config",
    "linear_config",
    "mma_config",
    "nvfp4_linear",
    "nvfp4_linear_dgrad",
    "nvfp4_lora_linear",
]
