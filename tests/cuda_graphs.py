"""Capture a step in a CUDA graph the way the GPU tests replay it (importable from any test file: tests/ is on
pytest's pythonpath)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``step`` once on a side stream (PyTorch's recipe: warm-up off the capturing stream, so lazy allocations and
    compiles happen before capture), then capture one call of it; return ``(graph, the captured call's output)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
