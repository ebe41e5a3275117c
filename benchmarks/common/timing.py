"""Milliseconds per call of kernels replayed in one captured CUDA graph: the kernel benchmarks' timing loop."""

from __future__ import annotations

import statistics

import torch


def time_graph(fns: list, budget_s: float = 0.1, min_reps: int = 5, max_reps: int = 50) -> float:
    """Median milliseconds per call of ``fns`` (each called once per replay of one captured CUDA graph): two eager
    warm-ups, two more on a side stream (PyTorch's capture recipe), the capture, then as many replays as fit
    ``budget_s`` within ``[min_reps, max_reps]``, each timed with CUDA events."""
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) / 1e3
    reps = int(min(max_reps, max(min_reps, budget_s / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    del graph
    return statistics.median(times)
