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


def interleaved(arms: dict, rounds: int = 0) -> dict[str, list[float]]:
    """Each arm's figures (``arms``: name → a call returning one figure, e.g. :func:`time_graph`'s) over ``rounds``
    rounds (0: one per arm, so each arm takes each place once), the order rotated by one place a round. Why: the same
    kernel timed after bf16 cuBLAS ran 0-20 % slower than when timed first, in 16 of 16 pairs on an H100
    (``benchmarks/results/gemm_round16_h100_f6fa32f.json``, ``prev_ms`` against ``ws_ms``): a figure must not depend
    on its arm's place in the order."""
    names, out = list(arms), {name: [] for name in arms}
    for r in range(rounds or len(names)):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(arms[name]())
    return out
