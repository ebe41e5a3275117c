"""NVFP4 weight-only quantization: codec, calibration, ``NVFP4Linear``, kernels, transformers/PEFT integration.

MXFP4 (:mod:`nvfp4.mxfp4`) runs through the same layer, ops and kernels (``NVFP4Linear(format="mxfp4")``,
``quantize_model(..., format="mxfp4")``, ``NVFP4Config(format="mxfp4")`` / ``MXFP4Config()``) after an exact scale
transcode; :func:`get_format` looks up either format (:mod:`nvfp4.formats`).

Importing ``nvfp4`` registers the ``nvfp4::linear`` custom ops and the transformers quantization method
``"nvfp4_w4a16"`` (:class:`NVFP4Config`), so ``from_pretrained`` reloads our checkpoints.
"""

from .codec import NVFP4Weight, dequantize, pack_e2m1, unpack_e2m1
from .extras import MissingExtraError
from .formats import Format, get_format
from .linear import NVFP4Linear, cache_dequantized, quantize_model
from .methods import quantize
from .ops import linear, linear_dgrad

__all__ = [
    "Format",
    "MissingExtraError",
    "NVFP4Linear",
    "NVFP4Weight",
    "cache_dequantized",
    "dequantize",
    "get_format",
    "linear",
    "linear_dgrad",
    "pack_e2m1",
    "quantize",
    "quantize_model",
    "unpack_e2m1",
]
__version__ = "0.1.0"

from .hf import (  # noqa: E402  (registers with transformers)
    MXFP4Config,
    NVFP4CheckpointError,
    NVFP4Config,
    from_compressed_tensors,
    load_nvfp4_checkpoint,
    save_pretrained_by_blocks,
)

__all__ += ["MXFP4Config", "NVFP4CheckpointError", "NVFP4Config", "from_compressed_tensors", "load_nvfp4_checkpoint"]
__all__ += ["save_pretrained_by_blocks"]
