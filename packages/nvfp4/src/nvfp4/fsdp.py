"""NVFP4 / MXFP4 layers sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``).

What is sharded and how. ``fully_shard`` shards a module's *parameters* on dim 0 and leaves its buffers whole (it only
moves them to the mesh's device). An :class:`~nvfp4.NVFP4Linear` keeps its 4-bit weight in buffers (so that a
single-GPU model pays nothing for FSDP and DDP has nothing to broadcast), so :func:`make_shardable` turns the two
per-weight tensors into frozen parameters (``requires_grad=False``): ``weight_packed`` (the E2M1 codes,
``[out, in/2]``) and ``weight_scale`` (the block scales, ``[out, in/16]`` FP8 E4M3 or ``[out, in/32]`` E8M0) are split
by output rows, each rank holding ``ceil(out / world)`` rows; ``weight_global_scale`` (FP32 ``[1]``, one per tensor)
stays a buffer, replicated on every rank. The forward all-gathers the rows back: a byte copy, so the regathered
weight is bit-identical to the unsharded one (``tests/nvfp4/test_fsdp.py`` checks it, and the model's losses and LoRA
gradients, with 2 gloo processes).

Why frozen parameters and not a tensor subclass (torchao's ``NF4Tensor`` implements ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on a subclass whose outer dtype is bf16): the subclass would have to implement every aten op
FSDP2 and the layer apply to it (chunk, narrow, copy, view, ``new_zeros``, the state-dict ops) and would change the
layer's storage on every path, sharded or not. Row sharding needs none of that: the rows of the packed codes and of the
block scales are independent, so FSDP2's own dim-0 chunking already is the split axolotl uses for NVFP4 (packed rows and
their E4M3 scales together, the FP32 tensor scale replicated), and the all-gather extension hooks would only reproduce
it. Two details of FSDP2 decide the rest:

* ``fully_shard`` wraps every parameter as ``nn.Parameter(DTensor)``, which must be a floating dtype (an integer tensor
  "cannot require gradients", even frozen), and gloo has no float8 collectives. The 1-byte tensors are therefore
  stored as a *view* of the same bytes in bfloat16 (``[out, in/4]`` for the codes, ``[out, in/32]`` for FP8 block
  scales): no value is converted, and the layer views them back (``weight_packed`` reads as uint8 again, ``weight_scale``
  as FP8); all-gathers and copies move bytes, nothing is ever computed on them.
* a ``MixedPrecisionPolicy(param_dtype=bf16)`` casts every floating parameter it manages before the all-gather, which
  would turn the FP8 scales (and the bf16-viewed codes) into other numbers. :func:`fully_shard_quantized` therefore
  gives each block's quantized layers their own FSDP group with no casting (``MixedPrecisionPolicy()``), one all-gather
  per block for all its 4-bit weights; the enclosing ``fully_shard`` (accelerate's, per decoder layer, with the run's
  mixed precision) then manages only what is left — LoRA adapters, norms, embeddings — as it would for any model.

A layer that is not sharded keeps its buffers and its class: :func:`make_shardable` changes the class of the layers it
converts to :class:`ShardableNVFP4Linear` (which views the stored bytes back), so the single-GPU path has no extra
check. The CUDA MMA layout (:mod:`nvfp4.layout`, rows of 4 output channels interleaved) is kept as the layer holds it
when it is converted: move the model to its GPU before sharding.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .codec import NVFP4Weight
from .formats import QuantizedWeight
from .linear import NVFP4Linear
from .sharded import gather_bytes, is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import OffloadPolicy

__all__ = [
    "ShardableNVFP4Linear",
    "fully_shard_quantized",
    "gathered_quantized_weight",
    "is_sharded",
    "make_shardable",
    "quantized_blocks",
]

#: the layer's tensors that FSDP2 shards by rows (``weight_global_scale`` stays a replicated buffer)
SHARDED_TENSORS = ("weight_packed", "weight_scale")


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a 1-byte tensor (uint8 codes, E8M0 or FP8 scales) as a floating view FSDP2 can hold and any
    backend can all-gather: bfloat16 (half as many elements) when the last dimension is even, else float8 (an integer
    tensor cannot be a parameter; gloo has no float8 collectives, which only an odd last dimension leaves)."""
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte tensor, got {t.dtype}")
    if t.dim() and t.shape[-1] % 2 == 0:
        return t.view(torch.bfloat16)
    return t if t.is_floating_point() else t.view(torch.float8_e4m3fn)


class ShardableNVFP4Linear(NVFP4Linear):
    """An :class:`~nvfp4.NVFP4Linear` whose ``weight_packed`` and ``weight_scale`` are frozen parameters (FSDP2 shards
    those by rows); made by :func:`make_shardable`, not constructed. Integer tensors are stored as floating views of
    their bytes and read back in their own dtype (``layer.weight_packed`` is uint8 again on a plain tensor; while FSDP2
    holds the layer sharded it is the stored ``DTensor``). See the module docstring."""

    fsdp_shardable = True
    _storage_dtypes: dict[str, torch.dtype]
    _stored_mma_layout: bool

    def __getattr__(self, name: str):
        t = super().__getattr__(name)
        dtype = self.__dict__["_storage_dtypes"].get(name)
        if dtype is not None and t is not None and t.dtype != dtype and not is_dtensor(t):
            return t.view(dtype)
        return t

    @property
    def mma_layout(self) -> bool:
        return self._stored_mma_layout

    @property
    def uses_nvfp4_ops(self) -> bool:
        return self._storage_dtypes["weight_scale"] == torch.float8_e4m3fn

    @torch.no_grad()
    def use_kernel_layout(self) -> bool:
        """The layout is fixed while the layer is shardable (see :func:`make_shardable`)."""
        return self._stored_mma_layout

    def stored(self, name: str) -> torch.Tensor:
        """The tensor FSDP2 manages for ``name`` (a floating view of integer bytes, a DTensor while sharded)."""
        return self._parameters[name]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is a quantized layer prepared for FSDP2 (:func:`make_shardable`)."""
    return getattr(module, "fsdp_shardable", False)


def make_shardable(layer: NVFP4Linear) -> ShardableNVFP4Linear:
    """Turn ``layer``'s ``weight_packed`` and ``weight_scale`` buffers into frozen parameters holding the same bytes
    (integer tensors as floating views), in place, so that ``fully_shard`` shards them by rows; the global scale stays a
    replicated buffer. Idempotent; returns the layer (its class is now :class:`ShardableNVFP4Linear`). The state dict
    keeps its names and dtypes."""
    if isinstance(layer, ShardableNVFP4Linear):
        return layer
    if not isinstance(layer, NVFP4Linear):
        raise TypeError(f"expected an NVFP4Linear, got {type(layer).__name__}")
    if layer.weight_packed.is_meta:
        raise ValueError(f"{layer._label()}: its tensors are on the meta device; load or quantize it first")
    mma = layer.mma_layout
    dtypes: dict[str, torch.dtype] = {}
    for name in SHARDED_TENSORS:
        t = layer._buffers.pop(name)
        dtypes[name] = t.dtype
        stored = _storage_view(t)
        layer.register_parameter(name, nn.Parameter(stored, requires_grad=False))
    layer.__class__ = ShardableNVFP4Linear
    layer._storage_dtypes = dtypes
    layer._stored_mma_layout = mma
    return layer  # type: ignore[return-value]


_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def _block_of(name: str) -> str:
    """The block a layer belongs to: its name up to the first ``ModuleList`` index (``model.layers.3.mlp.up_proj`` →
    ``model.layers.3``); a layer outside any list is its own block."""
    m = _BLOCK.match(name)
    return m.group(1) if m else name


def quantized_blocks(
    model: nn.Module, block_of: Callable[[str], str] = _block_of
) -> dict[str, list[tuple[str, NVFP4Linear]]]:
    """The quantized layers of ``model`` grouped by block (``block_of`` of each layer's name), in module order."""
    groups: dict[str, list[tuple[str, NVFP4Linear]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, NVFP4Linear):
            groups.setdefault(block_of(name), []).append((name, module))
    return groups


def fully_shard_quantized(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    block_of: Callable[[str], str] = _block_of,
    offload_policy: OffloadPolicy | None = None,
) -> int:
    """Prepare every quantized layer of ``model`` (:func:`make_shardable`) and ``fully_shard`` them, one FSDP group
    per block (all of a decoder layer's 4-bit weights in one all-gather) with no mixed-precision casting. Call it before
    the ``fully_shard`` of the decoder layers and of the root (accelerate's ``fsdp2_prepare_model``, or your own), which
    then skip these layers' tensors. ``mesh``: the 1-D data-parallel mesh (default: all ranks, on the current
    accelerator, else CPU). Returns the number of groups."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    groups = quantized_blocks(model, block_of)
    for layers in groups.values():
        modules = [make_shardable(m) for _, m in layers]
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(),
            offload_policy=offload_policy or OffloadPolicy(),
        )
    return len(groups)


def gathered_quantized_weight(layer: NVFP4Linear) -> QuantizedWeight:
    """The full weight of a (possibly sharded) quantized layer, as stored: ``[out, in/2]`` codes and their scales in
    the layer's own dtypes, all-gathered from every rank when FSDP2 holds it sharded (a collective: call it on every
    rank). For an unsharded layer, :attr:`~nvfp4.NVFP4Linear.quantized_weight` (which this equals: MXFP4 as E8M0)."""
    if not isinstance(layer, ShardableNVFP4Linear):
        return layer.quantized_weight
    tensors = {}
    for name in SHARDED_TENSORS:
        t = layer.stored(name)
        full = gather_bytes(t) if is_dtensor(t) else t.detach()
        tensors[name] = full.view(layer._storage_dtypes[name])
    packed, scale = tensors["weight_packed"], tensors["weight_scale"]
    if layer._stored_mma_layout:
        from .layout import from_mma_layout, scale_in_ct_layout

        packed, scale = from_mma_layout(packed), scale_in_ct_layout(packed, scale)
    fmt = layer.weight_format
    if fmt.to_nvfp4_scales is None:
        return NVFP4Weight(packed, scale, layer.weight_global_scale)
    # MXFP4, as quantized_weight gives it: the E8M0 scales the state dict holds
    if scale.dtype == torch.float8_e4m3fn:
        scale = layer.weight_scale_e8m0 if layer.weight_scale_e8m0 is not None else fmt.from_nvfp4_scales(
            scale, layer.weight_global_scale)  # fmt: skip
    return fmt.weight_type(packed, scale)


def shardable_layers(model: nn.Module) -> Iterable[ShardableNVFP4Linear]:
    """The layers of ``model`` prepared for FSDP2."""
    return (m for m in model.modules() if isinstance(m, ShardableNVFP4Linear))
