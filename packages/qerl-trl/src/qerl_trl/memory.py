"""Host memory: make glibc give freed tensor memory back to the OS.

glibc ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own ``mmap``,
unmapped on ``free``. But each time such a block is freed, glibc raises the threshold to that block's size (up to
32 MiB), so from then on CPU tensors of a few MiB — every activation of a training step — come from the heap arenas,
where freed memory stays in the process (fragmented over per-thread arenas) instead of going back to the OS. On the
offline default job that kept 7.5 GB resident after one step, for ~1.6 GB live (BENCHMARKS.md, "Host memory of the
main command"). Pinning the threshold with ``mallopt`` turns that adjustment off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["M_MMAP_THRESHOLD", "lean_logprob_backward", "pin_malloc_mmap_threshold", "trim_malloc"]

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def pin_malloc_mmap_threshold(threshold_bytes: int = 64 * 1024) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` for this process; returns whether it was set.

    Allocations of at least ``threshold_bytes`` (tensor storages of CPU activations, gradients, temporaries) are then
    mapped and unmapped on their own, so resident memory follows live memory. The default, 64 KiB (half glibc's
    starting value), also covers the K/V tensors of the offline default recipe's 2-sequence scoring chunks
    (``[2, 3, 74, 64]`` fp32, 111 KiB), which left 0.6 GB of freed heap behind at 128 KiB. Process-wide;
    ``qerl train`` calls it on start. A no-op returning ``False`` off Linux/glibc (macOS, musl).
    """
    if threshold_bytes <= 0:
        raise ValueError(f"threshold_bytes must be positive, got {threshold_bytes}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)) == 1


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def trim_malloc() -> bool:
    """Give the free pages inside glibc's heap arenas back to the OS (``malloc_trim(0)``); returns whether any were.

    Below the pinned mmap threshold (small tensors, Python's and the tokenizer's own allocations) freed memory stays in
    the arenas, fragmented; over a training run that kept ~7 MB per step resident on the offline default job. A no-op
    returning ``False`` off Linux/glibc.
    """
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim(0) == 1


def _lean_backward_tile(tile, tile_stride, targets, log_z, entropy, grad_logprobs, grad_entropy, vocab_start, n_cols,
                        logit_scale, softcap, inv_t, HAS_SOFTCAP, HAS_LOGPROB_GRAD, HAS_ENTROPY_GRAD, BLOCK_SIZE):
    """TRL's ``_backward_tile`` (its torch fallback off Triton devices) computed in the tile itself.

    TRL's version builds ``y``, ``z``, ``log_p``, ``p``, ``grad`` and three temporaries, each a float32 tile
    (``[tokens, 32768]``: 19 MB for the offline default recipe's 146-token scoring chunks), ~8 alive at once at the
    start of every LM-head backward. This one runs the same elementwise operations in the same order, in place:
    the same bits in the tile (``1 - p`` as ``(-p) + 1``, TRL's ``zeros + x`` as ``x + 0``). Cases it does not
    cover (softcapping, an entropy gradient, a non-float32 tile) go to TRL's own.
    """
    import torch

    if HAS_SOFTCAP or HAS_ENTROPY_GRAD or not HAS_LOGPROB_GRAD or tile.dtype != torch.float32:
        return _TRL_BACKWARD_TILE[0](tile, tile_stride, targets, log_z, entropy, grad_logprobs, grad_entropy,
                                     vocab_start, n_cols, logit_scale, softcap, inv_t, HAS_SOFTCAP,
                                     HAS_LOGPROB_GRAD, HAS_ENTROPY_GRAD, BLOCK_SIZE)  # fmt: skip
    tile.mul_(logit_scale).mul_(inv_t)  # z = (tile · logit_scale) · inv_t
    tile.sub_(log_z.unsqueeze(-1)).exp_().neg_()  # -p = -exp(z - log_z)
    local = targets - vocab_start
    rows = ((local >= 0) & (local < n_cols)).nonzero().squeeze(-1)
    cols = local[rows]
    tile[rows, cols] = tile[rows, cols] + 1.0  # 1[j = target] - p
    tile.mul_(grad_logprobs.unsqueeze(-1)).add_(0.0)  # TRL: zeros + grad_logprobs · (1[target] - p)
    tile.mul_(inv_t).mul_(logit_scale)


_TRL_BACKWARD_TILE: list = []


def lean_logprob_backward() -> bool:
    """Make TRL's chunked LM-head backward (``trl.kernels.chunked_logprob``, torch fallback) work in its tile, without
    ~7 tile-sized temporaries; returns whether it is on. Same numbers (``tests/qerl_trl/test_memory.py``).
    Process-wide; ``qerl train`` turns it on for CPU runs. Where TRL runs its Triton kernel (CUDA) nothing changes.
    """
    try:
        from trl.kernels import chunked_logprob
    except ImportError:
        return False
    if not _TRL_BACKWARD_TILE:
        original = getattr(chunked_logprob, "_backward_tile", None)
        if original is None:
            return False
        _TRL_BACKWARD_TILE.append(original)
    chunked_logprob._backward_tile = _lean_backward_tile
    return True
