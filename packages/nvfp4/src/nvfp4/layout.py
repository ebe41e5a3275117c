"""The kernels' in-memory layout of ``weight_packed`` (the "MMA layout"), and its inverse.

Checkpoints always hold the compressed-tensors layout: ``packed`` uint8 ``[N, K/2]``, row ``n`` holding ``W[n, 2j]``
in the low nibble and ``W[n, 2j+1]`` in the high nibble of byte ``j``. On CUDA, :class:`nvfp4.NVFP4Linear` keeps the
same bytes permuted into ``[N/4, 2K]`` so that the Triton GEMM's 16-byte loads land directly in the registers
Hopper's ``wgmma`` reads its A operand from (no shared-memory round trip per tile; see
:mod:`nvfp4.kernels.nvfp4_gemm`). The scales and the global scale are unchanged. Serialization converts back.

Within each 64 × 256 tile of W (64 outputs × 128 bytes), with ``n = n5..n0`` the row and ``b = b6..b0`` the byte
(``b = k // 2``), the tile is stored as 16 rows of 512 bytes at ``[tile_n·16 + r, tile_k·512 + c]``, where

    r = (b6 b5 | n5 n4)   (4 bits)      c = (n2 n1 n0 | b1 b0 | b4 b3 b2 | n3)   (9 bits)

(most significant bit first). Read with 16 bytes per thread, 32 threads per row and one warp per row, thread
``lane`` of warp ``w`` then holds rows ``n = 16w + 8·n3 + lane // 4`` and bytes ``b ≡ lane % 4`` — exactly the
``wgmma`` A-fragment of a bf16 ``m64k16`` MMA, for all 16 K-steps of the tile. Both directions are pure
permutations (``reshape``/``permute``), so they run on any device and round-trip exactly.
"""

from __future__ import annotations

import torch

__all__ = [
    "MMA_TILE_K",
    "MMA_TILE_N",
    "from_mma_layout",
    "is_mma_layout",
    "mma_layout_supported",
    "packed_in_ct_layout",
    "to_mma_layout",
]

MMA_TILE_N = 64  # outputs per tile
MMA_TILE_K = 256  # inputs per tile


def mma_layout_supported(out_features: int, in_features: int) -> bool:
    """Whether a ``[out, in]`` weight can take the MMA layout (whole tiles only: out % 64 == 0, in % 256 == 0)."""
    return out_features % MMA_TILE_N == 0 and in_features % MMA_TILE_K == 0 and out_features > 0


def is_mma_layout(packed: torch.Tensor, scale: torch.Tensor) -> bool:
    """True if ``packed`` is in the MMA layout (``[N/4, 2K]``) for the ``[N, K/16]`` ``scale``; False if it is in
    the compressed-tensors layout (``[N, K/2]``); ``ValueError`` if it is neither."""
    n, k = scale.shape[0], scale.shape[1] * 16
    if tuple(packed.shape) == (n, k // 2):
        return False
    if tuple(packed.shape) == (n // 4, 2 * k) and mma_layout_supported(n, k):
        return True
    raise ValueError(
        f"NVFP4 tensors disagree: weight_scale {tuple(scale.shape)} means a [{n}, {k}] weight, so weight_packed must "
        f"be {(n, k // 2)} (compressed-tensors layout) or {(n // 4, 2 * k)} (MMA layout), got {tuple(packed.shape)}"
    )


def to_mma_layout(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` (compressed-tensors layout) → uint8 ``[N/4, 2K]`` (MMA layout), a new contiguous tensor."""
    n, half = packed.shape
    k = half * 2
    if packed.dtype != torch.uint8 or not mma_layout_supported(n, k):
        raise ValueError(f"to_mma_layout: needs uint8 [N, K/2] with N % 64 == 0, K % 256 == 0; got {packed.dtype} "
                         f"{tuple(packed.shape)}")  # fmt: skip
    t = packed.reshape(n // 64, 4, 2, 8, k // 256, 4, 8, 4)  # tn, n54, n3, n210, tk, b65, b432, b10
    t = t.permute(0, 4, 5, 1, 3, 7, 6, 2)  # tn, tk, b65, n54 | n210, b10, b432, n3
    return t.reshape(n // 64, k // 256, 16, 512).transpose(1, 2).reshape(n // 4, 2 * k).contiguous()


def from_mma_layout(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N/4, 2K]`` (MMA layout) → uint8 ``[N, K/2]`` (compressed-tensors layout), a new contiguous tensor."""
    q, k2 = packed.shape
    n, k = q * 4, k2 // 2
    if packed.dtype != torch.uint8 or not mma_layout_supported(n, k) or k2 % 2:
        raise ValueError(f"from_mma_layout: needs uint8 [N/4, 2K] with N % 64 == 0, K % 256 == 0; got {packed.dtype} "
                         f"{tuple(packed.shape)}")  # fmt: skip
    t = packed.reshape(n // 64, 16, k // 256, 512).transpose(1, 2).reshape(n // 64, k // 256, 4, 4, 8, 4, 8, 2)
    t = t.permute(0, 3, 7, 4, 1, 2, 6, 5)  # tn, n54, n3, n210, tk, b65, b432, b10
    return t.reshape(n, k // 2).contiguous()


def packed_in_ct_layout(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``packed`` in the compressed-tensors layout (itself, or converted back from the MMA layout)."""
    return from_mma_layout(packed) if is_mma_layout(packed, scale) else packed
