"""qerl_trl.memory: glibc's mmap threshold is pinned, so freed CPU tensors leave the process."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from qerl_trl.memory import pin_malloc_mmap_threshold


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_tensors_are_returned_to_the_os():
    assert pin_malloc_mmap_threshold() is True
    # without the pin, freeing one 8 MiB tensor raises glibc's threshold to 8 MiB, and the 1 MiB tensors after it
    # come from the heap arenas, where they stay resident after being freed
    big = torch.empty(8 << 20, dtype=torch.uint8).fill_(1)
    del big
    before = _rss()
    blocks = [torch.empty(1 << 20, dtype=torch.uint8).fill_(1) for _ in range(256)]  # 256 MiB, touched
    held = _rss()
    keep = blocks[::64]  # a few stay alive between freed ones (fragmentation)
    del blocks
    after = _rss()
    assert held - before > 200 << 20
    assert after - before < 32 << 20, f"{(after - before) >> 20} MiB still resident after freeing 252 MiB"
    del keep


def test_bad_threshold():
    with pytest.raises(ValueError, match="positive"):
        pin_malloc_mmap_threshold(0)
