"""Row-sharded ``DTensor`` views of a quantized layer's 1-byte tensors, for :mod:`nvfp4.fsdp` and the layer's state dict.

Apart from :mod:`nvfp4.fsdp` so that :mod:`nvfp4.linear` can use them without an import cycle. ``view_stored`` and ``map_rows``
take a plain tensor too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def view_stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored floating view of 1-byte tensors (plain, or a row-sharded ``DTensor``) read as ``dtype``: the same
    bytes, the last dimension rescaled. A ``DTensor`` stays one (each rank views its own rows)."""
    if not is_dtensor(t):
        return t.view(dtype)
    from torch.distributed.tensor import DTensor

    shape = (*t.shape[:-1], t.shape[-1] * t.element_size() // dtype.itemsize)
    stride = torch.empty(shape, device="meta").stride()
    local = t.to_local().contiguous().view(dtype)
    return DTensor.from_local(local, t.device_mesh, t.placements, shape=shape, stride=stride)


def map_rows(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` (a map of each row on its own, e.g. FP8 → E8M0 block scales) applied to ``t``; to each rank's rows of a
    row-sharded ``DTensor``, which stays one (no collective)."""
    if not is_dtensor(t):
        return fn(t)
    from torch.distributed.tensor import DTensor

    local = fn(t.to_local())
    shape = (t.shape[0], *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, t.device_mesh, t.placements, shape=shape, stride=stride)


def gather_bytes(t) -> torch.Tensor:
    """The whole tensor of a row-sharded ``DTensor``, all-gathered as bytes (uint8 ``[..., last · itemsize]``): gloo
    has no float8 collectives, and bytes are what the layer's tensors are."""
    from torch.distributed.tensor import DTensor

    local = t.to_local().contiguous().view(torch.uint8)
    shape = (*t.shape[:-1], t.shape[-1] * t.element_size())
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, t.device_mesh, t.placements, shape=shape, stride=stride).full_tensor()
