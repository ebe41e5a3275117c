"""Host memory: make glibc give freed tensor memory back to the OS.

glibc ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own ``mmap``,
unmapped on ``free``. But each time such a block is freed, glibc raises the threshold to that block's size (up to
32 MiB), so from then on CPU tensors of a few MiB — every activation of a training step — come from the heap arenas,
where freed memory stays in the process (fragmented over per-thread arenas) instead of going back to the OS. On the
offline default job that kept 7.5 GB resident after one step, for ~1.6 GB live (BENCHMARKS.md, "Host memory of the
main command"). Pinning the threshold with ``mallopt`` turns that adjustment off.

``qerl train`` pins it at :data:`TRAIN_MMAP_THRESHOLD` (glibc's ceiling, 32 MiB): a training step's activations then
come from the heap and are reused within the step instead of being mapped and faulted in on every allocation, and
:class:`qerl_trl.run.MallocTrimCallback` gives the freed pages back at each step's end (:func:`trim_malloc`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["M_MMAP_THRESHOLD", "TRAIN_MMAP_THRESHOLD", "pin_malloc_mmap_threshold", "trim_malloc"]

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
#: ``qerl train``'s pinned threshold. At 64 KiB every activation of the offline default's 2-sequence micro-batches was
#: mapped, unmapped and faulted in again: 4.1 M minor faults and 16 s of system time in a 43 s step; at 32 MiB, 0.33 M
#: and 1.4 s in a 33 s step, the same losses, peak RSS 1.72 GB against 1.58 (BENCHMARKS.md, "The main command").
TRAIN_MMAP_THRESHOLD = 32 << 20


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
