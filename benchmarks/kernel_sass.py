"""Compile the NVFP4 GEMM kernels for sm_90 *without a GPU* and count what matters in their SASS.

Triton ships ``ptxas``/``cuobjdump``, so any machine can compile a kernel for the H100 and read its machine code.
This is how the MMA layout was checked before it ever ran on a GPU: per kernel config it prints registers, spills,
shared memory, and counts of the instructions that tell where the bytes go — global loads (``LDG*``, and
``LDGSTS`` = ``cp.async``), shared-memory stores/loads (``STS``/``LDS``/``LDSM``: a decoded weight tile written to
shared memory shows up here), ``HGMMA`` (``wgmma``), and the atomics and fences of the split-K tickets (``ATOMG``,
``MEMBAR``). The pointer arguments and the integer sizes are given 16-byte divisibility, as the launcher's specialisation does for aligned tensors and sizes (without it every load
compiles to bytes).

Usage::

    uv run python benchmarks/kernel_sass.py              # the default decode configs, both layouts
    uv run python benchmarks/kernel_sass.py --ttgir      # also print the layout conversions in the TTGIR
    uv run python benchmarks/kernel_sass.py --ws 128,2,8,2 128,4,6,2 128,4,6,2,1   # the Gluon kernel (hopper_ws)

``--ws BLOCK_M,TILES,STAGES,SUB[,FIXUP]``: the warp-specialised kernel per config (registers, spills, shared memory,
``HGMMA``/``LDS``/``SYNCS``/``WARPGROUP`` counts), then its stream-K schedule on the 7B/32B large linears at
M = 64-512 on 132 SMs: units per program and per tile, and the serial tail of the sum of split tiles (``fixup=False``:
the most parts one program reads after the last is written, and their size per consumer pair).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "nvfp4" / "src"))

from nvfp4.kernels import hopper_ws  # noqa: E402
from nvfp4.kernels import nvfp4_gemm as kern  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
COUNTED = r"\b(LDG\S*|LDGSTS\S*|STS\S*|LDS\S*|LDSM\S*|STSM\S*|HGMMA\S*|ATOMG\S*|MEMBAR\S*)"

_COMMON = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "K_PER_SPLIT": "i32",
           "HAS_BIAS": "constexpr", "USE_WS": "constexpr", "BLOCK_M": "constexpr", "FAST": "constexpr",
           "a_ptr": "*bf16", "lb_ptr": "*bf16", "lora_scale": "fp32", "R": "i32", "HAS_LORA": "constexpr",
           "BLOCK_R": "constexpr", "out_ptr": "*bf16", "cnt_ptr": "*i32", "SPLIT": "i32",
           "FUSED_REDUCE": "constexpr", "t_ptr": "*fp32", "tcnt_ptr": "*i32", "SHARED_T": "constexpr"}  # fmt: skip
_CT_EXTRA = {"EVEN_K": "constexpr", "SWAP": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
             "GROUP_M": "constexpr", "PREFETCH": "constexpr"}  # fmt: skip
_LARGE_M = {k: v for k, v in _COMMON.items() if k not in ("a_ptr", "out_ptr", "cnt_ptr", "SPLIT", "FUSED_REDUCE",
                                                              "t_ptr", "tcnt_ptr", "SHARED_T", "BLOCK_M")}
_LARGE_M |= {"TILES": "constexpr", "QUARTERS": "constexpr", "BLOCK_M": "constexpr", "GROUP_M": "constexpr",
             "t_ptr": "*bf16"}  # fmt: skip
_ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "g_ptr", "b_ptr", "y_ptr", "N", "K", "stride_xm", "stride_ym", "K_PER_SPLIT",
            "a_ptr", "lb_ptr")  # fmt: skip


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    """``triton.compile`` for sm_90 with 16-byte divisibility on the aligned arguments."""
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in _ALIGNED if a in fn.arg_names}
    sig = {a: signature[a] for a in fn.arg_names}
    src = ASTSource(fn, sig, {k: v for k, v in constexprs.items() if k in fn.arg_names}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                             num_stages=num_stages))  # fmt: skip


def sass_summary(compiled, counted: str = COUNTED) -> tuple[str, dict[str, int]]:
    """(resource line from ``cuobjdump``, counts of the instructions matching ``counted``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    line = res.stdout.strip().splitlines()[-1].split("CONSTANT")[0].strip()
    return line, dict(sorted(collections.Counter(re.findall(counted, sass)).items()))


WS_COUNTED = r"\b(LDL\S*|STL\S*|LDS\S*|STS\S*|HGMMA\S*|WARPGROUP\S*|SYNCS\S*|UTMALDG\S*|BAR\.SYNC\S*|ATOMG\S*|LDG\S*)"
WS_SHAPES = {"7B gate/up": (18944, 3584), "7B down": (3584, 18944), "32B gate/up": (27648, 5120),
             "32B down": (5120, 27648)}  # fmt: skip


def streamk_tail(m: int, n: int, k: int, block_m: int, tiles: int, sub: int, programs: int = 132) -> dict:
    """hopper_ws's stream-K schedule (units of ``sub`` 64-input stages, tile-major, ``[p·U/G, (p+1)·U/G)`` each):
    units per program and per tile, and for the serial sum (``fixup=False``) the most parts one tile's first
    program reads after its own work (``serial_parts``), each ``part_kb`` KB (both consumers)."""
    ku = k // (64 * sub)
    units = -(-m // block_m) * (n // (64 * tiles)) * ku
    g = min(programs, units)
    most = 0
    for p in range(g):
        u1 = (p + 1) * units // g
        tile, kb = divmod(u1 - 1, ku)
        if (u1 - 1) // ku * ku >= p * units // g and u1 - tile * ku < ku:  # the head of a split tile: its last segment
            most = max(most, ((tile + 1) * ku * g - 1) // units - p)
    return dict(units_per_program=round(units / g, 1), units_per_tile=ku, serial_parts=most,
                part_kb=64 * tiles * block_m * 4 // 1024)  # fmt: skip


def ws_report(configs: list[str]) -> None:
    """``--ws``: SASS summary and stream-K schedule of each hopper_ws config."""
    for c in configs:
        bm, tiles, stages, sub, *fixup = map(int, c.split(","))
        compiled = hopper_ws.compile_sm90(bm, tiles, stages, sub, bool(fixup and fixup[0]))
        line, counts = sass_summary(compiled, WS_COUNTED)
        print(f"hopper_ws block_m={bm} tiles={tiles} stages={stages} sub={sub} fixup={bool(fixup and fixup[0])}\n"
              f"  {line}  shared {compiled.metadata.shared} B\n  {counts}")  # fmt: skip
        for name, (n, k) in WS_SHAPES.items():
            tails = {m: streamk_tail(m, n, k, bm, tiles, sub) for m in (64, 128, 256, 512) if bm <= max(64, m)}
            print(f"  {name}: " + "; ".join(f"M={m} {t['units_per_program']}/prog {t['units_per_tile']}/tile, "
                                            f"tail {t['serial_parts']}x{t['part_kb']} KB" for m, t in tails.items()))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ttgir", action="store_true", help="print the layout conversions / shared-memory allocations")
    ap.add_argument("--ws", nargs="+", default=None, metavar="BM,T,STAGES,SUB[,FIXUP]",
                    help="the warp-specialised Gluon kernel (hopper_ws) per config, and its stream-K schedule")  # fmt: skip
    args = ap.parse_args()
    if args.ws:
        ws_report(args.ws)
        return
    mma, large, ct = (kern.JIT_KERNELS[k] for k in ("linear_mma", "linear_large_m", "linear"))
    cases = [
        ("MMA layout, M<=16, 3 stages", mma, {}, dict(BLOCK_M=16), 4, 3),
        ("MMA layout, M<=16, 3 stages, fused LoRA r=32", mma, {}, dict(BLOCK_M=16, HAS_LORA=True, BLOCK_R=32), 4, 3),
        ("MMA layout, M<=64, 2 stages", mma, {}, dict(BLOCK_M=64), 4, 2),
        ("MMA layout, M<=16, 3 stages, split-K summed in the kernel", mma, {"y_ptr": "*fp32"},
         dict(BLOCK_M=16, USE_WS=True, FUSED_REDUCE=True), 4, 3),
        ("MMA layout, M<=16, 3 stages, split-K summed, fused LoRA r=32 beside every tile", mma, {"y_ptr": "*fp32"},
         dict(BLOCK_M=16, USE_WS=True, FUSED_REDUCE=True, HAS_LORA=True, BLOCK_R=32), 4, 3),
        ("MMA layout, M<=16, 3 stages, split-K summed, fused LoRA r=32, x·Aᵀ once per split (SHARED_T)", mma,
         {"y_ptr": "*fp32"}, dict(BLOCK_M=16, USE_WS=True, FUSED_REDUCE=True, HAS_LORA=True, BLOCK_R=32, SHARED_T=True),
         4, 3),
        ("large-M kernel, 64 x 128 tiles (1 tile, K step 64), 4 warps, 4 stages", large, _LARGE_M,
         dict(TILES=1, QUARTERS=1, BLOCK_M=128, GROUP_M=8), 4, 4),
        ("large-M kernel, 128 x 256 tiles (2 tiles, K step 64), 8 warps, 3 stages", large, _LARGE_M,
         dict(TILES=2, QUARTERS=1, BLOCK_M=256, GROUP_M=8), 8, 3),
        ("CT layout, M<=16 (tc_config)", ct, _CT_EXTRA,
         dict(BLOCK_M=16, EVEN_K=True, SWAP=True, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, PREFETCH=False), 4, 1),
    ]  # fmt: skip
    for name, fn, extra, const, warps, stages in cases:
        constexprs = dict(HAS_BIAS=False, USE_WS=False, FAST=True, HAS_LORA=False, BLOCK_R=16, FUSED_REDUCE=False,
                          SHARED_T=False)  # fmt: skip
        constexprs |= const
        compiled = compile_sm90(fn, _COMMON | extra, constexprs, warps, stages)
        line, counts = sass_summary(compiled)
        print(f"{name}\n  {line}  shared {compiled.metadata.shared} B\n  {counts}")
        if args.ttgir:
            for ln in compiled.asm["ttgir"].splitlines():
                if "convert_layout" in ln or "local_alloc" in ln:
                    print("   ", re.sub(r"loc\(.*\)", "", ln.strip())[:200])


if __name__ == "__main__":
    main()
