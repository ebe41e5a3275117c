"""The kernels' in-memory layout of ``weight_packed`` (the "MMA layout"), and its inverse.

Checkpoints always hold the compressed-tensors layout: ``packed`` uint8 ``[N, K/2]``, row ``n`` holding ``W[n, 2j]``
in the low nibble and ``W[n, 2j+1]`` in the high nibble of byte ``j``. On CUDA, :class:`nvfp4.NVFP4Linear` keeps the
same bytes permuted into ``[N/4, 2K]`` so that the Triton GEMM's 16-byte loads land directly in the registers
Hopper's ``wgmma`` reads its A operand from (no shared-memory round trip per tile; see
:mod:`nvfp4.kernels.nvfp4_gemm`). Beside it the scales take :func:`to_scale_mma_layout`'s order (``[N/64, 4K]``):
MMA-layout codes with ``[N, K/16]`` scales are refused (:func:`checked_layout`); the global scale is unchanged.
Serialization converts both back.

Within each 64 × 256 tile of W (64 outputs × 128 bytes), with ``n = n5..n0`` the row and ``b = b6..b0`` the byte
(``b = k // 2``), the tile is stored as 16 rows of 512 bytes at ``[tile_n·16 + r, tile_k·512 + c]``, where

    r = (b6 b5 | n5 n4)   (4 bits)      c = (n2 n1 n0 | b1 b0 | b4 b3 b2 | n3)   (9 bits)

(most significant bit first). Read with 16 bytes per thread, 32 threads per row and one warp per row, thread
``lane`` of warp ``w`` then holds rows ``n = 16w + 8·n3 + lane // 4`` and bytes ``b ≡ lane % 4`` — exactly the
``wgmma`` A-fragment of a bf16 ``m64k16`` MMA, for all 16 K-steps of the tile.

The 4 bytes of each aligned 32-bit word (one per A-fragment register of one K-step: rows ``n``/``n+8``, inputs
``k``/``k+8``) are then stored with their 32 bits permuted (:data:`WORD_BIT_POSITIONS`), so that the kernel turns
a word into the four bf16x2 registers with 9 integer instructions (``e2m1 · 2^-126`` in bf16: sign at bit 15,
exponent-and-mantissa bits ``e1 e0 m`` at bits 8..6 of each half): register ``j`` (byte ``j``, low nibble in the
low half) is ``rotr(q, t_j) & 0x81C081C0`` for ``t_j`` = 0, 4, 10, and the last one
``(rotr(q, 30) & 0x80C080C0) | (rotr(q, 6) & 0x01000100)``. The byte-level placement costed ~20 instructions per
word (two ``prmt``, a shift-and-mask per nibble, and four ``prmt`` to pair the nibbles of a byte).

Both directions are pure permutations (``reshape``/``permute`` and a fixed bit permutation), so they run on any
device and round-trip exactly.

The MMA-layout kernels also decode the FP8 block scales with integer instructions (``cvt`` to fp16, then a shift
into bf16's exponent field), which is exact for every positive finite scale, subnormals included, but not for a
zero, negative or NaN scale: :func:`mma_scales_supported` says whether a weight's scales are all positive and finite
(compressed-tensors never writes a zero scale: it stores 0.125 for an all-zero block).
"""

from __future__ import annotations

import torch

__all__ = [
    "MMA_TILE_K",
    "MMA_TILE_N",
    "checked_layout",
    "from_mma_layout",
    "from_scale_mma_layout",
    "is_mma_layout",
    "mma_layout_supported",
    "mma_scales_supported",
    "packed_in_ct_layout",
    "scale_in_ct_layout",
    "scale_is_mma_layout",
    "scale_rows",
    "to_mma_layout",
    "to_scale_mma_layout",
    "weight_shape",
    "WORD_BIT_POSITIONS",
]

MMA_TILE_N = 64  # outputs per tile
MMA_TILE_K = 256  # inputs per tile


# WORD_BIT_POSITIONS[i] = where bit i of a little-endian word of 4 compressed-tensors bytes goes. Bit i is bit f of
# nibble h of byte j (i = 8j + 4h + f; f = 0..3 is m, e0, e1, sign); it lands where rotr(q, t_j) & 0x81C081C0 puts
# it at bf16 bit 16h + (6, 7, 8, 15)[f] (see the module doc; byte 3's e1 comes through rotr(q, 6), the rest of it
# through rotr(q, 30)).
WORD_BIT_POSITIONS = (6, 7, 8, 15, 22, 23, 24, 31, 10, 11, 12, 19, 26, 27, 28, 3,
                      16, 17, 18, 25, 0, 1, 2, 9, 4, 5, 14, 13, 20, 21, 30, 29)  # fmt: skip


def _permute_word_bits(packed: torch.Tensor, positions: tuple[int, ...]) -> torch.Tensor:
    """uint8 ``[..., 4·w]`` → the same shape with bit ``i`` of every aligned little-endian 32-bit word moved to
    ``positions[i]`` (one shift-and-mask per distinct distance, in int64 so that no sign bit gets in the way)."""
    words = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(words)
    by_shift: dict[int, int] = {}
    for i, p in enumerate(positions):
        by_shift[p - i] = by_shift.get(p - i, 0) | (1 << i)
    for shift, mask in by_shift.items():
        moved = words & mask
        out |= moved << shift if shift >= 0 else moved >> -shift
    return out.to(torch.int32).view(torch.uint8).reshape(packed.shape)


_INVERSE_POSITIONS = tuple(WORD_BIT_POSITIONS.index(i) for i in range(32))


def mma_layout_supported(out_features: int, in_features: int) -> bool:
    """Whether a ``[out, in]`` weight can take the MMA layout (whole tiles only: out % 64 == 0, in % 256 == 0)."""
    return out_features % MMA_TILE_N == 0 and in_features % MMA_TILE_K == 0 and out_features > 0


def scale_is_mma_layout(packed: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether ``scale`` is in :func:`to_scale_mma_layout`'s order (``[N/64, 4K]``) beside an MMA-layout ``packed``
    (``[N/4, 2K]``): from the shapes only (no compressed-tensors pair has them; :func:`is_mma_layout` validates)."""
    return packed.shape[0] == 16 * scale.shape[0] and scale.shape[1] == 2 * packed.shape[1]


def scale_rows(packed: torch.Tensor, scale: torch.Tensor, start: int, stop: int) -> slice:
    """The rows of ``scale`` that hold outputs ``[start, stop)``: those rows for ``[N, K/16]``; in step A's order (a
    row per 64 outputs) ``start // 64`` up to ``ceil(stop / 64)``."""
    per_row = 64 if scale_is_mma_layout(packed, scale) else 1
    return slice(start // per_row, -(-stop // per_row))


def weight_shape(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """``(N, K)`` of the ``[N, K]`` weight, from ``scale`` in either order (``[N, K/16]`` or ``[N/64, 4K]``)."""
    if scale_is_mma_layout(packed, scale):
        return 64 * scale.shape[0], scale.shape[1] // 4
    return scale.shape[0], scale.shape[1] * 16


def is_mma_layout(packed: torch.Tensor, scale: torch.Tensor) -> bool:
    """True if ``packed`` is in the MMA layout (``[N/4, 2K]``) with ``scale`` in :func:`to_scale_mma_layout`'s order
    (``[N/64, 4K]``); False if both are in the compressed-tensors layout (``[N, K/2]``, ``[N, K/16]``); ``ValueError``
    otherwise (:func:`checked_layout`)."""
    return checked_layout(packed, scale)[2]


def checked_layout(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, bool]:
    """``(N, K, mma)``: the weight's shape (:func:`weight_shape`) and :func:`is_mma_layout`, the shape read once;
    ``ValueError`` where ``packed`` fits ``scale`` in neither layout, and for MMA-layout codes beside ``[N, K/16]``
    scales (the pair the kernels read before stage 2's end: no kernel reads it now, docs/kernels.md)."""
    n, k = weight_shape(packed, scale)
    step_a = scale_is_mma_layout(packed, scale)
    if tuple(packed.shape) == (n, k // 2) and not step_a:
        return n, k, False
    if tuple(packed.shape) == (n // 4, 2 * k) and mma_layout_supported(n, k):
        if step_a:
            return n, k, True
        raise ValueError(
            f"NVFP4 tensors: weight_packed {tuple(packed.shape)} is in the MMA layout but weight_scale "
            f"{tuple(scale.shape)} is [N, K/16]; the MMA layout takes its scales in to_scale_mma_layout's order "
            f"{(n // 64, 4 * k)}"
        )
    raise ValueError(
        f"NVFP4 tensors disagree: weight_scale {tuple(scale.shape)} means a [{n}, {k}] weight, so weight_packed must "
        f"be {(n, k // 2)} (compressed-tensors layout; the MMA layout's {(n // 4, 2 * k)} takes {(n // 64, 4 * k)} "
        f"scales), got {tuple(packed.shape)}"
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
    t = t.reshape(n // 64, k // 256, 16, 512).transpose(1, 2).reshape(n // 4, 2 * k)
    return _permute_word_bits(t, WORD_BIT_POSITIONS)


def from_mma_layout(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N/4, 2K]`` (MMA layout) → uint8 ``[N, K/2]`` (compressed-tensors layout), a new contiguous tensor."""
    q, k2 = packed.shape
    n, k = q * 4, k2 // 2
    if packed.dtype != torch.uint8 or not mma_layout_supported(n, k) or k2 % 2:
        raise ValueError(f"from_mma_layout: needs uint8 [N/4, 2K] with N % 64 == 0, K % 256 == 0; got {packed.dtype} "
                         f"{tuple(packed.shape)}")  # fmt: skip
    t = _permute_word_bits(packed, _INVERSE_POSITIONS)
    t = t.reshape(n // 64, 16, k // 256, 512).transpose(1, 2).reshape(n // 64, k // 256, 4, 4, 8, 4, 8, 2)
    t = t.permute(0, 3, 7, 4, 1, 2, 6, 5)  # tn, n54, n3, n210, tk, b65, b432, b10
    return t.reshape(n, k // 2).contiguous()


def packed_in_ct_layout(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``packed`` in the compressed-tensors layout (itself, or converted back from the MMA layout)."""
    return from_mma_layout(packed) if is_mma_layout(packed, scale) else packed


def scale_in_ct_layout(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as ``[N, K/16]`` (itself, or converted back from :func:`to_scale_mma_layout`'s order)."""
    return from_scale_mma_layout(scale) if is_mma_layout(packed, scale) else scale


def mma_scales_supported(scale: torch.Tensor) -> bool:
    """Whether the MMA-layout kernels decode these FP8 block scales exactly: every scale positive and finite (not
    ``0``, ``-0``, negative or NaN). Reads the whole tensor (a host sync): call it once, when the layout is chosen."""
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight_scale must be float8_e4m3fn, got {scale.dtype}")
    b = scale.view(torch.uint8)
    return bool(((b > 0) & (b < 0x7F)).all())


def to_scale_mma_layout(scale: torch.Tensor) -> torch.Tensor:
    """Round 15 step A's scale layout (what the MMA layout holds beside its codes; checkpoints keep ``[N, K/16]``):
    ``[N, K/16]`` → ``[N/64, K/64·256]`` (same dtype, same bytes). Per 64-row tile ``t`` and
    64-input stage ``j``, the 256 bytes at ``[t, 256j:256j+256]`` are ordered (warp w: 4, quad q: 8, k16 step g: 4,
    half h: 2) and hold ``s[64t + 16w + q + 8h, 4j + g]``: thread ``lane`` of consumer warp ``w`` reads the 8 bytes at
    ``(8w + lane // 4)·8``, per k16 step the scales of its A-fragment rows ``r``/``r + 8`` as one 16-bit pair."""
    n, g16 = scale.shape
    if n % 64 or g16 % 4:
        raise ValueError(f"to_scale_mma_layout: needs [N, K/16] with N % 64 == 0, K % 64 == 0; got {tuple(scale.shape)}")
    t = scale.view(torch.uint8).reshape(n // 64, 4, 2, 8, g16 // 4, 4)  # t, w, h, q, j, g
    t = t.permute(0, 4, 1, 3, 5, 2)  # t, j | w, q, g, h
    return t.reshape(n // 64, 64 * g16).contiguous().view(scale.dtype)


def from_scale_mma_layout(scale: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_scale_mma_layout`: ``[N/64, K/64·256]`` → ``[N, K/16]``."""
    tiles, width = scale.shape
    if width % 256:
        raise ValueError(f"from_scale_mma_layout: needs [N/64, K/64·256]; got {tuple(scale.shape)}")
    t = scale.view(torch.uint8).reshape(tiles, width // 256, 4, 8, 4, 2)  # t, j, w, q, g, h
    t = t.permute(0, 2, 5, 3, 1, 4)  # t, w, h, q, j, g
    return t.reshape(64 * tiles, width // 64).contiguous().view(scale.dtype)
