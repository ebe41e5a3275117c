"""The warp-specialised Gluon kernel (:mod:`nvfp4.kernels.hopper_ws`).

* CPU (CI): the kernel compiles for sm_90a without a GPU (Triton's compiler with a ``GPUTarget``), its SASS has the
  Hopper instructions it is built on (``HGMMA`` with a register A operand, ``UTMALDG`` bulk tensor copies,
  ``SYNCS`` mbarriers) and no local-memory spills; the dispatch falls back to the Triton kernels where it cannot run.
* GPU (``-m gpu``, the H100): every config the dispatch table uses against the float64 PyTorch reference on fresh
  random inputs (odd M, bias, NaN-poisoned outputs), bit-equal repeated calls (stream-K sums its split tiles in a
  fixed order), a LoRA adapter through ``nvfp4_lora_linear``, and CUDA-graph replays.
* Round 15 step A (the scales in :func:`nvfp4.layout.to_scale_mma_layout`'s order, the kernel's only scale path since
  stage 2's end; ``-k round15``): it compiles for sm_90a without spills at the design's mainloop count (CPU), and it
  matches the float64 reference on random shapes and the 7B gate/down at M = 64 and 128 (GPU).
* Round 15 step B (``inflight=True`` on top of step A; ``-k round15``, names ``step_b``): it compiles for sm_90a
  without spills or C7515 at the spike's mainloop count, its asm is step A's split at the wgmma wait (CPU), and it
  passes step A's GPU checks.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from nvfp4.codec import dequantize, quantize

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _table_configs() -> list[tuple[int, ...]]:
    """The (block_m, tiles, stages, sub[, fixup]) tuples of the dispatch table's warp-specialised entries (or the default)."""
    from nvfp4.kernels import dispatch_table

    found = {
        e[1:] for row in dispatch_table.FORWARD.values() for e in row.values() if isinstance(e, tuple) and e[0] == "ws"
    }
    return sorted(found) or [(128, 2, 8, 2)]


def _compile_sm90(block_m: int, tiles: int, stages: int, sub: int, fixup: bool = False):
    from nvfp4.kernels import hopper_ws

    return hopper_ws.compile_sm90(block_m, tiles, stages, sub, fixup)


_BIN = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin"  # ptxas, cuobjdump
ROOT = Path(__file__).resolve().parents[2]

def _usage_and_sass(compiled) -> tuple[str, str]:
    """``cuobjdump``'s resource line(s) and the SASS of a kernel compiled for sm_90a."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_BIN / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([_BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    return usage, sass


def _mainloop_instructions(compiled) -> int:
    """Instructions per iteration of the consumer's mainloop (the innermost loop holding ``HGMMA``), counted as
    docs/kernels.md round 15 does (``nvdisasm -c``, ``docs/scripts/sass_loop_counts.py``: label .. backward branch,
    the out-of-line mbarrier retry blocks not included)."""
    spec = importlib.util.spec_from_file_location("sass_loop_counts", ROOT / "docs" / "scripts" / "sass_loop_counts.py")
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cubin").write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([_BIN / "nvdisasm", "-c", Path(d) / "k.cubin"], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        (Path(d) / "k.sass").write_text(sass)
        insts, labels = counts.parse(Path(d) / "k.sass")
    (_, _, body), *_ = counts.loops(insts, labels)
    return len(body)


# round 15 (docs/kernels.md): step A's mainloop at the dispatched M = 64 / 128 configs, per unit of SUB = 2 stages (64
# decoded weights per thread; the int32 scale path it replaced had 306 / 310), and the shared memory of step A's scale
# boxes (256 B per 64 rows and stage)
ROUND15 = {(64, 2, 12, 2): (218, 154008), (128, 2, 8, 2): (218, 168280)}


@pytest.mark.parametrize("config", list(ROUND15))
def test_round15_step_a_compiles_without_spills_at_the_designs_count(config):
    """Step A builds for sm_90a with no stack and no local memory, its mainloop within 5 % of the design's 218
    instructions (its SASS byte-identical before and after stage 2's end deleted the int32 scale path,
    docs/kernels.md)."""
    step_a, shared = ROUND15[config]
    compiled = hopper_ws_compile(*config)
    usage, sass = _usage_and_sass(compiled)
    assert re.search(r"STACK:0\b", usage), usage
    assert "LDL" not in sass and "STL" not in sass
    assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16 R\d+, R\d+,", sass) and "UTMALDG" in sass
    assert "F2FP.F16.E4M3.UNPACK_B" in sass and compiled.metadata.shared == shared
    assert abs(_mainloop_instructions(compiled) - step_a) <= 0.05 * step_a


def _dispatched_ws_configs() -> list[tuple]:
    from nvfp4.kernels import dispatch_table

    return sorted({tuple(e[1:]) for shapes in dispatch_table.FORWARD.values() for e in shapes.values()
                   if isinstance(e, tuple) and e[0] == "ws"})  # fmt: skip


@pytest.mark.parametrize("config", _dispatched_ws_configs())
def test_every_dispatched_config_builds_in_step_a_order_without_spills(config):
    """Every ws config the dispatch table names runs in step A's order (the 32B down's ``(64, 4, 8, 2, 1)`` too,
    which the GPU first ran at ae88aa3): each builds for sm_90a with no stack and no local memory. (The int32 scale
    path's ``(256, 2, 3, 1, 1)`` had 8 bytes of stack.)"""
    usage, sass = _usage_and_sass(hopper_ws_compile(*config))
    assert re.search(r"STACK:0\b", usage) and re.search(r"LOCAL:0\b", usage), usage
    assert "LDL" not in sass and "STL" not in sass


def hopper_ws_compile(*config, inflight: bool = False):
    from nvfp4.kernels import hopper_ws

    return hopper_ws.compile_sm90(*config, inflight=inflight)


# round 15 step B's mainloop per unit (docs/kernels.md: step A's decode, 8 wgmma groups of one k16 step each)
ROUND15_STEP_B = {(64, 2, 12, 2): 246, (128, 2, 8, 2): 247}


@pytest.mark.parametrize("config", list(ROUND15_STEP_B))
def test_round15_step_b_compiles_without_spills_or_c7515_at_the_spikes_count(config):
    """Step B (``inflight=True``) builds for sm_90a with no stack and no local memory, 8 register-A ``HGMMA``s of
    one k16 step per unit, ``ptxas`` on its PTX warns nothing (no C7515: no in-flight operand written), its mainloop
    within 5 % of the spike's count."""
    compiled = hopper_ws_compile(*config, inflight=True)
    usage, sass = _usage_and_sass(compiled)
    assert re.search(r"STACK:0\b", usage), usage
    assert "LDL" not in sass and "STL" not in sass
    assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16 R\d+, R\d+,", sass) and "UTMALDG" in sass
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(compiled.asm["ptx"])
        r = subprocess.run([_BIN / "ptxas", "-arch=sm_90a", "--maxrregcount=168", Path(d) / "k.ptx", "-o",
                            Path(d) / "k.cubin"], capture_output=True, text=True, check=True)  # fmt: skip
    assert "C7515" not in r.stdout + r.stderr, r.stderr
    step_b = ROUND15_STEP_B[config]
    assert abs(_mainloop_instructions(compiled) - step_b) <= 0.05 * step_b


def test_round15_step_b_asm_is_step_a_split_at_the_wait():
    """Step B's ``PAIR_ASM`` (before the wait) and ``MUL_ASM`` (after it) are step A's ``E2M1_SCALED_ASM`` cut in two:
    the same scale-pair PTX (LUT 0xea) and the same multiplies, ``$0``/``$2`` by row r's scale and ``$1``/``$3`` by
    row r + 8's (so the CPU replay of step A's asm covers step B's numerics but for the k16 split)."""
    from nvfp4.kernels.hopper_ws import E2M1_SCALED_ASM, MUL_ASM, PAIR_ASM, SCALE_PAIR_PTX

    assert "0xea;" in SCALE_PAIR_PTX and SCALE_PAIR_PTX in E2M1_SCALED_ASM.value and SCALE_PAIR_PTX in PAIR_ASM.value
    step_b = MUL_ASM.value
    for j in range(4):  # step B reads the decoded words from $4..$7, step A multiplies them in place
        step_b = step_b.replace(f", ${j + 4},", f", ${j},")

    def muls(asm: str) -> list[str]:
        return [ln.strip() for ln in asm.splitlines() if ln.strip().startswith("mul.")]

    assert muls(step_b) == muls(E2M1_SCALED_ASM.value) and len(muls(step_b)) == 4


@pytest.mark.parametrize("config", _table_configs()[:1])
def test_compiles_for_sm90a_without_a_gpu(config):
    """CI's build check: a kernel that no longer compiles for sm_90a, or that spills, fails here."""
    compiled = _compile_sm90(*config)
    usage, sass = _usage_and_sass(compiled)
    assert "sm_90a" in compiled.asm["ptx"] or ".target sm_90a" in compiled.asm["ptx"]
    assert re.search(r"STACK:0\b", usage), usage  # no local-memory spills
    assert "LDL" not in sass and "STL" not in sass
    assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16 R\d+, R\d+,", sass), "wgmma with a register A operand"
    assert "UTMALDG" in sass and "SYNCS" in sass  # TMA loads completing on mbarriers


def test_parallel_fixup_compiles_for_sm90a_without_spills_in_the_main_loop():
    """The ``fixup=True`` form (256-row tiles, the spike's candidate) builds for sm_90a; whatever ptxas spills sits
    outside the wgmma loop (between a ``WARPGROUP.ARRIVE`` and its ``DEPBAR`` there is no local memory)."""
    _, sass = _usage_and_sass(_compile_sm90(128, 4, 6, 2, fixup=True))
    assert re.search(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+,", sass)
    assert "LDG.E.STRONG.GPU" in sass  # the per-thread acquire poll of the parts' flags
    in_loop = False
    for line in sass.splitlines():
        in_loop = (in_loop or "WARPGROUP.ARRIVE" in line) and "WARPGROUP.DEPBAR" not in line
        assert not (in_loop and re.search(r"\b(LDL|STL)\b", line)), line


@pytest.mark.parametrize("shape", [(128, 3584, 18944, 128, 4, 2), (128, 18944, 3584, 128, 4, 2), (300, 1024, 5120, 64, 2, 2),
                                   (64, 5120, 27648, 64, 4, 1), (700, 27648, 5120, 256, 2, 1)])  # fmt: skip
@pytest.mark.parametrize("programs", [132, 100, 7])
def test_parallel_fixup_schedule_sums_every_split_tile_once(shape, programs):
    """The index arithmetic of ``fixup=True`` replayed in Python (:func:`hopper_ws._participants`'s formula, the slot
    and flag indices of ``_consumer`` and ``_parallel_fixup``): every part a reader adds is a part of its tile, the
    parts cover the tile's K once, every token group of a split tile is summed by exactly one program, and the flags
    come back to zero; the workspace slots and flags of (program, segment, consumer) are distinct and within the
    ``4·programs`` that :func:`hopper_ws.launch` allocates."""
    m, n, k, block_m, tiles, sub = shape
    num_m, ku = -(-m // block_m), k // (64 * sub)
    u = num_m * (n // (64 * tiles)) * ku
    g = min(programs, u)
    first_last = lambda t: (((t * ku + 1) * g - 1) // u, ((t + 1) * ku * g - 1) // u)  # noqa: E731
    parts, flags, summed, slots = {}, {}, {}, []
    for me in range(g):  # the main loop: a split tile's part goes to slot (me, j), its flag to the readers' count
        u0, u1 = me * u // g, (me + 1) * u // g
        unit = u0
        while unit < u1:
            tile, kb = divmod(unit, ku)
            ke = min(ku, kb + u1 - unit)
            if not (kb == 0 and ke == ku):
                pf, pl = first_last(tile)
                assert pf <= me <= pl
                parts[(me, int(unit != u0))] = (tile, ke - kb)
                for wg in range(2):  # _consumer's slot and flag indices of this part
                    j = int(unit != u0)
                    slots.append((j * 2 * g + 2 * me + wg, 4 * me + 2 * j + wg))
                flags[(me, int(unit != u0))] = pl - pf + 1
            unit += ke - kb
    for me in range(g):  # the fixups: the first segment's tile and the last segment's, where split
        u0, u1 = me * u // g, (me + 1) * u // g
        t0, kb0 = divmod(u0, ku)
        t1 = (u1 - 1) // ku
        tiles_of_me = ([t0] if kb0 > 0 or kb0 + u1 - u0 < ku else []) + ([t1] if t1 != t0 and u1 - t1 * ku < ku else [])
        for tile in tiles_of_me:
            pf, pl = first_last(tile)
            j_first = int(pf * u // g < tile * ku)
            keys = [(q, j_first if q == pf else 0) for q in range(pf, pl + 1)]
            assert all(parts[key][0] == tile for key in keys) and sum(parts[key][1] for key in keys) == ku
            for c in range(me - pf, block_m // 4, pl - pf + 1):
                summed[(tile, c)] = summed.get((tile, c), 0) + 1
            for key in keys:
                flags[key] -= 1
    assert set(flags.values()) <= {0}
    for index in zip(*slots, strict=True):
        assert len(set(index)) == len(index) and max(index) < 4 * g
    assert set(summed.values()) <= {1}
    assert len(summed) == len({t for t, _ in parts.values()}) * (block_m // 4)


def test_dispatch_falls_back_where_the_kernel_cannot_run():
    """On the CPU (or fp16, or another GPU) a table entry of the warp-specialised kernel takes the Triton kernels'
    form of the table's rule instead."""
    from nvfp4.kernels import hopper_ws, nvfp4_gemm

    x = torch.zeros(128, 3584, dtype=torch.bfloat16)
    assert not hopper_ws.supported(x, 18944, 3584, 2)
    cfg = nvfp4_gemm._without_ws(128, 18944, 3584, torch.bfloat16)
    assert not cfg.ws and cfg.mma
    ws = nvfp4_gemm.entry_config(("ws", 128, 2, 8, 2), 128, 18944, 3584)
    assert ws == nvfp4_gemm.LinearConfig(128, 128, 64, 1, 4, 8, True, mma=True, ws=True, sub=2)
    fix = nvfp4_gemm.entry_config(("ws", 128, 4, 6, 2, 1), 128, 3584, 18944)
    assert fix == nvfp4_gemm.LinearConfig(128, 256, 64, 1, 4, 6, True, mma=True, ws=True, sub=2, ws_fixup=True)
    assert not nvfp4_gemm._without_ws(128, 18944, 3584, torch.float16).large_m  # fp16: dequantize + cuBLAS


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in output (an element never written)"
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", _table_configs())
def test_random_shapes_against_the_reference_gpu(config):
    from nvfp4.kernels import hopper_ws, nvfp4_gemm, nvfp4_linear, nvfp4_lora_linear
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    cfg = nvfp4_gemm.entry_config(("ws", *config), 128, 64 * config[1], 256)
    block_m, tiles = config[:2]
    gen = torch.Generator().manual_seed(sum(config))
    nvfp4_gemm.POISON_OUTPUTS = hopper_ws.POISON = True
    try:
        for m in (1, block_m - 1, block_m + 3, 3 * block_m + 1, 700):
            n = 64 * tiles * int(torch.randint(1, 40, (1,), generator=gen))
            k = 256 * int(torch.randint(1, 30, (1,), generator=gen))
            q = quantize(torch.randn(n, k, device="cuda"))
            packed = to_mma_layout(q.packed)
            scale = to_scale_mma_layout(q.scale)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.float64).T + b.double()
            y = nvfp4_linear(x, packed, scale, q.global_scale, b, config=cfg)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            assert _rel(y, ref) < 1e-2, (m, n, k, config)
            assert torch.equal(y, nvfp4_linear(x, packed, scale, q.global_scale, b, config=cfg)), "not deterministic"
            a = torch.randn(32, k, device="cuda") / k**0.5
            lb = torch.randn(n, 32, device="cuda")
            # the adapter's delta about as large as the base output, so that bf16 rounding of y stays small beside it
            lb *= (ref.norm() / (0.5 * (x.double() @ a.double().T) @ lb.double().T).norm()).float()
            delta = 0.5 * (x.double() @ a.double().T) @ lb.double().T
            y = nvfp4_lora_linear(x, packed, scale, q.global_scale, b, a, lb, 0.5, config=cfg)
            assert _rel(y.double() - ref, delta) < 3e-2, (m, n, k, config)
        flags = nvfp4_gemm._SPLITK_COUNTERS[torch.device("cuda", torch.cuda.current_device())]
        assert int(flags.abs().sum()) == 0  # every launch leaves its flags at zero
    finally:
        nvfp4_gemm.POISON_OUTPUTS = hopper_ws.POISON = False


@pytest.mark.gpu
@cuda
def test_cuda_graph_replays_are_bit_equal_gpu():
    from nvfp4.kernels import nvfp4_gemm, nvfp4_linear
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    config = _table_configs()[0]
    cfg = nvfp4_gemm.entry_config(("ws", *config), 128, 64 * config[1], 256)
    block_m, tiles = config[:2]
    q = quantize(torch.randn(64 * tiles * 37, 3584, device="cuda"))
    packed = to_mma_layout(q.packed)
    scale = to_scale_mma_layout(q.scale)
    x = torch.randn(block_m + 5, 3584, device="cuda", dtype=torch.bfloat16)
    expected = nvfp4_linear(x, packed, scale, q.global_scale, config=cfg)
    out = torch.empty_like(expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(5):
            out.copy_(nvfp4_linear(x, packed, scale, q.global_scale, config=cfg))
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", [(128, 4, 6, 2), (64, 4, 8, 2), (128, 2, 8, 2), (256, 2, 3, 1)])
def test_parallel_fixup_against_the_reference_and_the_serial_sum_gpu(config):
    """``fixup=True`` against the float64 reference (odd M, bias, NaN-poisoned output), bit-equal repeats, flags
    left at zero; long K (many programs per tile) and short K."""
    block_m, tiles, stages, sub = config
    cfg = dict(block_m=block_m, tiles=tiles, stages=stages, sub=sub, fixup=True)
    _check_shapes([(block_m + 3, 64 * tiles * 14, 18944), (2 * block_m - 1, 64 * tiles * 37, 3584), (37, 1024, 5120)],
                  cfg, config)  # fmt: skip


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", [(64, 2, 12, 2), (128, 2, 8, 2), (64, 2, 12, 2, 1), (128, 2, 8, 2, 1)])
def test_round15_step_a_random_shapes_and_7b_gate_down_against_the_reference_gpu(config):
    """Round 15 step A (scales in :func:`nvfp4.layout.to_scale_mma_layout`'s order) on fresh
    random shapes (odd M, bias, NaN-poisoned output, bit-equal repeats, flags left at zero) and on Qwen2.5-7B's
    gate (18944 × 3584) and down (3584 × 18944) at M = 64 and 128, against the float64 reference."""
    block_m, tiles, stages, sub, *fixup = config
    cfg = dict(block_m=block_m, tiles=tiles, stages=stages, sub=sub, fixup=bool(fixup))
    gen = torch.Generator().manual_seed(sum(config))
    shapes = [(m, 64 * tiles * int(torch.randint(1, 40, (1,), generator=gen)), 256 * int(torch.randint(1, 30, (1,), generator=gen)))
              for m in (1, block_m - 1, block_m + 3, 3 * block_m + 1, 700)]  # fmt: skip
    _check_shapes(shapes + [(m, n, k) for m in (64, 128) for n, k in ((18944, 3584), (3584, 18944))], cfg, config)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", [(64, 2, 12, 2), (128, 2, 8, 2), (64, 2, 12, 2, 1), (128, 2, 8, 2, 1)])
def test_round15_step_b_random_shapes_and_7b_gate_down_against_the_reference_gpu(config):
    """Round 15 step B (``inflight=True`` on step A): step A's checks (random shapes, odd M,
    bias, NaN-poisoned output, bit-equal repeats, flags left at zero, the 7B gate and down at M = 64 and 128)."""
    block_m, tiles, stages, sub, *fixup = config
    cfg = dict(block_m=block_m, tiles=tiles, stages=stages, sub=sub, fixup=bool(fixup), inflight=True)
    gen = torch.Generator().manual_seed(sum(config))
    shapes = [(m, 64 * tiles * int(torch.randint(1, 40, (1,), generator=gen)), 256 * int(torch.randint(1, 30, (1,), generator=gen)))
              for m in (1, block_m - 1, block_m + 3, 3 * block_m + 1, 700)]  # fmt: skip
    _check_shapes(shapes + [(m, n, k) for m in (64, 128) for n, k in ((18944, 3584), (3584, 18944))], cfg, config)


def _check_shapes(shapes: list[tuple[int, int, int]], cfg: dict, config: tuple) -> None:
    """``ws_linear(**cfg)`` on fresh random (M, N, K) ``shapes`` against the float64 reference (bias, NaN-poisoned
    output), bit-equal on a repeat, every launch leaving its flags at zero (the scales in round 15 step A's
    order)."""
    from nvfp4.kernels import hopper_ws
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    hopper_ws.POISON = True
    try:
        for m, n, k in shapes:
            q = quantize(torch.randn(n, k, device="cuda"))
            packed = to_mma_layout(q.packed)
            scale = to_scale_mma_layout(q.scale)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.float64).T + b.double()
            y = hopper_ws.ws_linear(x, packed, scale, q.global_scale, b, **cfg)
            assert _rel(y, ref) < 1e-2, (m, n, k, config)
            assert torch.equal(y, hopper_ws.ws_linear(x, packed, scale, q.global_scale, b, **cfg)), "not deterministic"
            assert int(hopper_ws._FLAGS[x.device].abs().sum()) == 0  # every launch leaves its flags at zero
    finally:
        hopper_ws.POISON = False
