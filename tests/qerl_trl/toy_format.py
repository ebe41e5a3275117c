"""A 4-bit format written the way a new one is (one codec module plus one ``nvfp4.formats.register_format`` call), for
``test_toy_format.py``: ``toy4``, NVFP4's codes and scales (group 16, FP8 block scales, fp32 global scale) under its
own name, compressed-tensors format string and weight container, round to nearest only."""

from __future__ import annotations

import dataclasses

import torch
from nvfp4 import codec, methods
from nvfp4.formats import NVFP4


class Toy4Weight(codec.NVFP4Weight):
    """The toy format's container (NVFP4's fields; its own type is what tells the formats apart)."""


def quantize(w: torch.Tensor, **kwargs) -> Toy4Weight:
    q = methods.quantize(w, **kwargs)
    return Toy4Weight(q.packed, q.scale, q.global_scale)


TOY4 = dataclasses.replace(
    NVFP4,
    name="toy4",
    methods=("rtn",),
    ct_format="toy4-pack-quantized",
    ct_scheme="TOY4A16",
    weight_type=Toy4Weight,
    _quantize=quantize,
    vllm_rollouts=False,
    card="",
)
