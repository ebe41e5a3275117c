"""Which MMA-layout kernel runs each ``y[M, N] = x[M, K] · Wᵀ``, frozen from a measured sweep (no autotuning at import
or during a CUDA-graph capture).

``FORWARD[(N, K)][M]`` is the fastest form the sweep measured at that M on an H100 SXM (``benchmarks/gemm.py --sweep
--ms 32,64,128,256,512,1024,2048,4096``, raw numbers in ``benchmarks/results/gemm_sweep_large_m.json``; the shapes are
the linears of Qwen2.5-7B/14B/32B): ``"decode"`` (``_linear_mma_kernel`` with :func:`~nvfp4.kernels.nvfp4_gemm._decode_config`'s
decode-size config), ``"dequant"`` (dequantize once, then cuBLAS) or a tile of the large-M kernel, ``(tiles, quarters,
block_m, warps, stages, split_k)`` (:mod:`nvfp4.kernels.large_m`), or the warp-specialised kernel,
``("ws", block_m, tiles, stages, sub[, fixup])`` (:mod:`nvfp4.kernels.hopper_ws`; bf16 on sm_90, else the rule below;
``fixup`` 1: a split tile's programs each sum a share of it; set by hand on the 7B and 32B down projections from
``benchmarks/gemm_ws_spike.py@1486a77 --mode fixup``, ``benchmarks/results/gemm_ws_fixup.json``, where it beat the serial sum
by 9-21 % in the same run). The M = 1024 entries of (18944, 3584) (7B gate / up) and (5120, 27648) (32B down) are
set by hand to the ws tile ``(256, 2, 3, 1)`` from ``gemm.py --ws`` at f6fa32f
(``benchmarks/results/gemm_round16_h100_f6fa32f.json``, docs/kernels.md round 16): 6-9 % below dequantize + cuBLAS, a
shape's linears summed, against the mean of its measurements in the round's three processes (the 9130aab sweep,
which tied them, timed the ws kernel on the ``[N, K/16]`` scales, before step A's order shipped); a LoRA adapter
is added by cuBLAS after either form. The one M = 2048 entry, (3584, 18944) (7B down), is that tile too: 3-8 % below
dequantize + cuBLAS in each of three processes on two H100s (``gemm_round16_h100_f6fa32f.json``,
``gemm_ws_repeat_7b_h100_92cc613_{a,b}.json``; mean 5.3 %), though timed after bf16 cuBLAS each time, the place that
ran the same kernel slower (docs/kernels.md round 16). A call at M between two measured sizes takes the
entry of the next larger one; shapes that were not measured take :func:`generic`, the rule those entries follow.
Regenerate with ``python benchmarks/gemm.py --write-table <sweep.json>`` after a new sweep.
"""

from __future__ import annotations

# "decode" | "dequant" | (tiles, quarters, block_m, warps, stages, split_k) of the large-M kernel
# | ("ws", block_m, tiles, stages, sub[, fixup]) of the warp-specialised kernel (nvfp4.kernels.hopper_ws)
Entry = str | tuple[int, int, int, int, int, int] | tuple[str, int, int, int, int] | tuple[str, int, int, int, int, int]

# fmt: off
FORWARD: dict[tuple[int, int], dict[int, Entry]] = {
    (512, 3584): {32: 'decode', 64: 'decode', 128: (1, 1, 64, 4, 4, 9), 256: (1, 1, 64, 4, 4, 9), 512: 'dequant', 1024: 'dequant', 4096: 'dequant'},
    (1024, 5120): {32: 'decode', 64: (1, 1, 64, 4, 4, 9), 128: (1, 2, 128, 4, 3, 9), 256: (2, 2, 128, 8, 3, 9), 512: 'dequant', 1024: 'dequant', 4096: 'dequant'},
    (3584, 3584): {32: 'decode', 64: 'decode', 128: (1, 1, 64, 4, 4, 2), 256: (1, 1, 128, 4, 4, 3), 512: 'dequant', 1024: 'dequant', 4096: 'dequant'},
    (3584, 18944): {32: 'decode', 64: ('ws', 64, 2, 12, 2, 1), 128: ('ws', 128, 2, 8, 2, 1), 256: ('ws', 256, 2, 3, 1, 1), 512: ('ws', 256, 2, 3, 1), 1024: ('ws', 256, 2, 3, 1), 2048: ('ws', 256, 2, 3, 1), 4096: 'dequant'},
    (5120, 5120): {32: (1, 1, 64, 4, 4, 4), 64: 'decode', 128: (1, 1, 128, 4, 4, 4), 256: (1, 1, 128, 4, 4, 2), 512: ('ws', 256, 2, 3, 1), 1024: 'dequant', 4096: 'dequant'},
    (5120, 13824): {32: 'decode', 64: ('ws', 64, 2, 12, 2), 128: ('ws', 128, 2, 8, 2), 256: ('ws', 256, 2, 3, 1), 512: ('ws', 256, 2, 3, 1), 1024: 'dequant', 4096: 'dequant'},
    (5120, 27648): {32: 'decode', 64: ('ws', 64, 4, 8, 2, 1), 128: ('ws', 128, 2, 8, 2), 256: ('ws', 256, 2, 3, 1), 512: ('ws', 256, 2, 3, 1), 1024: ('ws', 256, 2, 3, 1), 4096: 'dequant'},
    (13824, 5120): {32: 'decode', 64: ('ws', 64, 2, 12, 2), 128: (1, 2, 128, 4, 3, 1), 256: ('ws', 256, 2, 3, 1), 512: ('ws', 256, 2, 3, 1), 1024: ('ws', 256, 2, 3, 1), 4096: 'dequant'},
    (18944, 3584): {32: 'decode', 64: ('ws', 64, 2, 12, 2), 128: ('ws', 128, 2, 8, 2), 256: ('ws', 256, 2, 3, 1), 512: ('ws', 256, 2, 3, 1), 1024: ('ws', 256, 2, 3, 1), 4096: 'dequant'},
    (27648, 5120): {32: 'decode', 64: ('ws', 64, 2, 12, 2), 128: ('ws', 128, 2, 8, 2), 256: ('ws', 256, 2, 3, 1), 512: ('ws', 256, 2, 3, 1), 1024: (2, 1, 256, 8, 3, 1), 4096: 'dequant'},
}
# fmt: on

NUM_SMS = 132


def split_for(programs: int, k_steps: int, target: int = NUM_SMS) -> int:
    """K splits so that ``programs · split`` reaches ``target``, each split keeping ≥ 2 K steps."""
    return max(1, min(-(-target // max(programs, 1)), k_steps // 2))


def generic(m: int, n: int, k: int) -> Entry:
    """The rule of the measured table, for shapes it lacks: the decode kernel to M = 64; the large-M kernel with
    64 × 128 tiles (one warpgroup, K step 64) to M = 256, and 128 × 256 tiles (two warpgroups) for large weights
    (N ≥ 8192) to M = 512; dequantize + cuBLAS above. K is split until the grid has about one program per SM."""
    if m <= 64:
        return "decode"
    if m <= 256 or (m <= 512 and n >= 8192):
        tiles, quarters, bm, warps, stages = (2, 1, 256, 8, 3) if m > 128 and n >= 8192 else (1, 1, 128, 4, 4)
        programs = -(-m // bm) * -(-n // (64 * tiles))
        return tiles, quarters, bm, warps, stages, split_for(programs, k // (64 * quarters))
    return "dequant"


def lookup(m: int, n: int, k: int) -> Entry:
    """The frozen entry for ``(m, n, k)`` (the next larger measured M, or the largest), else :func:`generic`."""
    row = FORWARD.get((n, k))
    if row is None:
        return generic(m, n, k)
    sizes = sorted(row)
    return row[next((s for s in sizes if s >= m), sizes[-1])]
