"""qerl_trl.memory: glibc's mmap threshold is pinned, so freed CPU tensors leave the process."""

from __future__ import annotations

import subprocess
import sys

import pytest
from qerl_trl.memory import pin_malloc_mmap_threshold

# Run in a fresh interpreter: in the test session's process, memory freed by earlier tests is already resident and
# the 1 MiB blocks below would reuse it without moving RSS at all.
_FRESH_PROCESS = """
import os, torch
from qerl_trl.memory import pin_malloc_mmap_threshold


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


assert pin_malloc_mmap_threshold() is True
# without the pin, freeing one 8 MiB tensor raises glibc's threshold to 8 MiB, and the 1 MiB tensors after it come
# from the heap arenas, where they stay resident after being freed
big = torch.empty(8 << 20, dtype=torch.uint8).fill_(1)
del big
before = rss()
blocks = [torch.empty(1 << 20, dtype=torch.uint8).fill_(1) for _ in range(256)]  # 256 MiB, touched
held = rss()
keep = blocks[::64]  # a few stay alive between freed ones (fragmentation)
del blocks
after = rss()
print((held - before) >> 20, (after - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_tensors_are_returned_to_the_os():
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    held_mib, after_mib = map(int, proc.stdout.split())
    assert held_mib > 200, f"the 256 MiB of blocks raised RSS by {held_mib} MiB only"
    assert after_mib < 32, f"{after_mib} MiB still resident after freeing 252 MiB"


def test_bad_threshold():
    with pytest.raises(ValueError, match="positive"):
        pin_malloc_mmap_threshold(0)


def test_trim_malloc_returns_free_arena_pages():
    """Small blocks (under the pinned mmap threshold) freed out of order stay in the heap arenas; ``trim_malloc``
    gives their pages back (fresh interpreter, as above)."""
    code = """
import ctypes, os
from qerl_trl.memory import pin_malloc_mmap_threshold, trim_malloc


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


assert pin_malloc_mmap_threshold() is True
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(32 << 10) for _ in range(8192)]  # 256 MiB of 32 KiB blocks: heap, not mmap
for b in blocks:
    ctypes.memset(b, 1, 32 << 10)
keep = blocks[-1]  # the top block stays live, so freeing the rest cannot shrink the heap from the top
for b in blocks[:-1]:
    libc.free(b)
before = rss()
assert trim_malloc() is True
after = rss()
assert before - after > (128 << 20), (before, after)
print("ok")
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
