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


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design for ``n`` arms: orders (rows of a Latin square; ``n`` rows if ``n`` is even, the square and its
    mirror if odd) in which each arm takes each place equally often and follows each other arm equally often."""
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    rows = [[(a + r) % n for a in first] for r in range(n)]
    return rows if n % 2 == 0 or n == 1 else rows + [row[::-1] for row in rows]


def interleaved(arms: dict, rounds: int = 0) -> dict[str, list[float]]:
    """Each arm's figures (``arms``: name → a call returning one figure, e.g. :func:`time_graph`'s) over ``rounds``
    rounds (0: one :func:`balanced_orders` design, ``n`` or ``2n`` rounds for ``n`` arms), each round in the design's
    next order. Why: the same kernel timed after bf16 cuBLAS ran 0-20 % slower than when timed first, in 16 of 16
    pairs on an H100 (``benchmarks/results/gemm_round16_h100_f6fa32f.json``, ``prev_ms`` against ``ws_ms``), and with
    the order only rotated (each arm after the same neighbour every round) two arms of one kernel still differed by
    3-7 % in medians on the 7B gate and up, the one after bf16 the slower (``gemm_round17_h100_f568402.json``, ``prev``
    / ``ws``): a figure must depend neither on its arm's place nor on the arm before it."""
    names, out = list(arms), {name: [] for name in arms}
    orders = balanced_orders(len(names))
    for r in range(rounds or len(orders)):
        for a in orders[r % len(orders)]:
            out[names[a]].append(arms[names[a]]())
    return out
