"""Tests of the Triton NVFP4 kernels (:mod:`nvfp4.kernels`).

* CPU (CI): the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, fp16/fp32 since the interpreter
  has no bf16) in a subprocess, so the variable is set before triton is imported and the rest of the suite is
  unaffected. They must match the float64 reference of :func:`nvfp4.codec.dequantize`, with every output element
  written (outputs are allocated filled with NaN).
* GPU (``-m gpu``, skipped without CUDA): random shapes (odd M, K a multiple of 16 but not of the tile, N not a
  multiple of the tile) for every M range's config, both products, autograd through ``nvfp4.ops``, and
  ``torch.compile`` (full graph, CUDA graphs) of an ``NVFP4Linear`` against eager.
"""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from nvfp4.codec import dequantize, quantize
from triton_interpreter import run_under_interpreter

SRC = Path(__file__).resolve().parents[2] / "packages" / "nvfp4" / "src"

# What both interpreter scripts start with: imports, outputs allocated full of NaN, and the relative error.
_INTERP_PRELUDE = textwrap.dedent(
    """
    import json
    import torch
    from nvfp4.codec import dequantize, quantize
    from nvfp4.kernels import DgradConfig, LinearConfig, dequantize_triton, linear_config, nvfp4_linear
    from nvfp4.kernels import nvfp4_gemm, nvfp4_linear_dgrad, nvfp4_lora_linear
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    nvfp4_gemm.POISON_OUTPUTS = True
    out = []

    def rel(a, b):
        a, b = a.double(), b.double()
        return float("nan") if torch.isnan(a).any() else ((a - b).norm() / b.norm()).item()

    def mma_pair(packed, scale):  # as NVFP4Linear holds them on CUDA: MMA-layout codes, step A's scale order
        return to_mma_layout(packed), to_scale_mma_layout(scale)

    # fused NVFP4 + LoRA (bias, scaling 0.5) against the float64 reference; layout converts (packed, scale)
    def lora_case(m, n, k, r, cfg, layout=lambda packed, scale: (packed, scale)):
        q = quantize(torch.randn(n, k))
        x = torch.randn(m, k, dtype=torch.float16)
        a, b = torch.randn(r, k) / k**0.5, torch.randn(n, r)
        bias = torch.randn(n, dtype=torch.float16)
        wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        ref = x.double() @ wd.T + bias.double() + 0.5 * (x.double() @ a.double().T) @ b.double().T
        y = nvfp4_lora_linear(x, *layout(q.packed, q.scale), q.global_scale, bias, a, b, 0.5, config=cfg)
        return dict(kind="lora", m=m, n=n, k=k, r=r, rel=rel(y, ref), shape=list(y.shape), dtype=str(y.dtype))
    """
)

_INTERP_SCRIPT = _INTERP_PRELUDE + textwrap.dedent(
    """
    assert linear_config(1, 48, 1024).gemv and linear_config(1, 48, 1024).split_k == 2
    torch.manual_seed(1234)

    # (M, N, K, config): odd M, N not a multiple of the tile, K a multiple of 16 but not of BLOCK_K
    cases = [
        (3, 40, 96, LinearConfig(block_m=16, block_n=32, block_k=64, split_k=1)),
        (5, 72, 272, LinearConfig(block_m=16, block_n=32, block_k=64, split_k=3)),
        (17, 33, 128, LinearConfig(block_m=16, block_n=32, block_k=64, split_k=2, swap=False)),
        (1, 64, 512, LinearConfig(block_m=16, block_n=64, block_k=128, split_k=2)),
        (2, 24, 48, LinearConfig(dequant=True)),
        (1, 64, 512, LinearConfig(block_m=16, block_n=64, block_k=128, split_k=2, prefetch=True)),
        # CUDA-core GEMV path (small M): split-K, K not a multiple of BLOCK_K, register prefetch
        (1, 40, 96, LinearConfig(block_n=16, block_k=64, split_k=1, gemv=True)),
        (3, 72, 272, LinearConfig(block_n=32, block_k=64, split_k=3, gemv=True)),
        (4, 50, 512, LinearConfig(block_n=16, block_k=128, split_k=2, gemv=True, prefetch=True)),
        (7, 33, 128, LinearConfig(block_n=16, block_k=64, split_k=1, gemv=True, prefetch=True)),
        (1, 48, 1024, None),  # the default dispatch: GEMV for M ≤ 2 on a small weight (split-K 2)
    ]
    for m, n, k, cfg in cases:
        for with_bias in (False, True):
            w = torch.randn(n, k)
            q = quantize(w)
            x = torch.randn(m, k, dtype=torch.float16)
            b = torch.randn(n, dtype=torch.float16) if with_bias else None
            wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
            ref = x.double() @ wd.T + (b.double() if with_bias else 0)
            y = nvfp4_linear(x, q.packed, q.scale, q.global_scale, b, config=cfg)
            out.append(dict(kind="linear", m=m, n=n, k=k, bias=with_bias, rel=rel(y, ref),
                            shape=list(y.shape), dtype=str(y.dtype)))
    for m, n, k, cfg in [(3, 40, 96, DgradConfig(16, 32, 64, 4, 2)), (19, 70, 144, DgradConfig(32, 16, 128, 4, 2))]:
        q = quantize(torch.randn(n, k))
        dy = torch.randn(m, n, dtype=torch.float16)
        wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        dx = nvfp4_linear_dgrad(dy, q.packed, q.scale, q.global_scale, config=cfg)
        out.append(dict(kind="dgrad", m=m, n=n, k=k, rel=rel(dx, dy.double() @ wd), shape=list(dx.shape),
                        dtype=str(dx.dtype)))
    # the fallback dequantizer equals the codec up to one rounding of the folded scale (fp16 and fp32)
    q = quantize(torch.randn(37, 80) * 3)
    for dt in (torch.float16, torch.float32):
        d = dequantize_triton(q.packed, q.scale, q.global_scale, dt).double()
        r = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        out.append(dict(kind="dequant", maxrel=((d - r).abs() / r.abs().clamp_min(1e-30)).max().item(),
                        dtype=str(dt)))
    # leading dims are flattened and restored
    q = quantize(torch.randn(48, 64))
    x = torch.randn(2, 3, 64, dtype=torch.float16)
    y = nvfp4_linear(x, q.packed, q.scale, q.global_scale, None, config=LinearConfig(16, 32, 64, 1))
    ref = x.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.float64).T
    out.append(dict(kind="linear3d", rel=rel(y, ref), shape=list(y.shape), dtype=str(y.dtype)))
    # LoRA fused into the tensor-core kernel: split-K, uneven K, prefetch, the GEMV dispatch rerouted, the fallback
    for m, n, k, r, cfg in [(3, 40, 96, 8, LinearConfig(16, 32, 64, 1)), (5, 72, 272, 32, LinearConfig(16, 32, 64, 3)),
                            (1, 64, 512, 16, LinearConfig(16, 64, 128, 2, prefetch=True)), (1, 48, 1024, 4, None),
                            (2, 24, 48, 8, LinearConfig(dequant=True))]:
        out.append(lora_case(m, n, k, r, cfg))
    print("RESULT" + json.dumps(out))
    """
)


def test_kernels_under_triton_interpreter():
    results = run_under_interpreter(_INTERP_SCRIPT, timeout=300, extra_path=[SRC])
    assert len(results) == 32
    for r in results:
        if r["kind"] == "dequant":
            tol = 1e-3 if r["dtype"] == "torch.float16" else 1e-6  # fp16: half an ulp of 2^-11; fp32: ~1e-7
            assert r["maxrel"] < tol, r
            continue
        assert r["rel"] == r["rel"], f"NaN in output (unwritten element?): {r}"  # NaN != NaN
        assert r["rel"] < 2e-3, r  # fp16 output rounding is ~3e-4
        assert r["dtype"] == "torch.float16", r
    shapes = {r["kind"]: r["shape"] for r in results if "shape" in r}
    assert shapes["linear3d"] == [2, 3, 48]
    assert [r["shape"] for r in results if r["kind"] == "lora"] == [[3, 40], [5, 72], [1, 64], [1, 48], [2, 24]]


_INTERP_MMA_SCRIPT = _INTERP_PRELUDE + textwrap.dedent(
    """
    torch.manual_seed(4321)

    def mma(m, split, stages=1, fused_reduce=True, shared_t=True):
        return LinearConfig(block_m=m, block_n=64, block_k=256, split_k=split, num_stages=stages, mma=True,
                            fused_reduce=fused_reduce, lora_shared_t=shared_t)

    # (M, N, K, config): odd M, several K splits (uneven; split-K summed in the kernel and by the separate reduce
    # kernel), several row blocks (M > BLOCK_M), the default dispatch
    cases = [(1, 64, 256, None), (3, 128, 512, mma(16, 2)), (5, 192, 768, mma(16, 2)), (20, 64, 512, mma(16, 1)),
             (33, 128, 256, mma(64, 1)), (7, 64, 1536, None), (130, 64, 256, None), (20, 128, 768, mma(16, 3)),
             (5, 192, 768, mma(16, 2, fused_reduce=False))]
    for m, n, k, cfg in cases:
        for with_bias in (False, True):
            q = quantize(torch.randn(n, k))
            x = torch.randn(m, k, dtype=torch.float16)
            b = torch.randn(n, dtype=torch.float16) if with_bias else None
            wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
            ref = x.double() @ wd.T + (b.double() if with_bias else 0)
            y = nvfp4_linear(x, to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale, b, config=cfg)
            out.append(dict(kind="linear", m=m, n=n, k=k, bias=with_bias, rel=rel(y, ref), shape=list(y.shape)))
    # x·Aᵀ once per split, shared by the tiles (split-K summed in the kernel; two row blocks), x·Aᵀ beside every
    # tile (no split, the separate reduce kernel, or asked for)
    for m, n, k, r, cfg in [(3, 128, 512, 8, mma(16, 2)), (1, 64, 256, 32, None), (18, 64, 512, 16, mma(16, 1)),
                            (18, 192, 768, 8, mma(16, 3)), (5, 320, 1024, 32, mma(16, 4)),
                            (5, 320, 1024, 32, mma(16, 4, shared_t=False)), (5, 192, 768, 16, mma(16, 2, 1, False))]:
        out.append(lora_case(m, n, k, r, cfg, mma_pair))
    for m, n, k in [(3, 128, 512), (19, 64, 256), (70, 64, 256)]:
        q = quantize(torch.randn(n, k))
        dy = torch.randn(m, n, dtype=torch.float16)
        wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        dx = nvfp4_linear_dgrad(dy, to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale)
        out.append(dict(kind="dgrad", m=m, n=n, k=k, rel=rel(dx, dy.double() @ wd), shape=list(dx.shape)))
    q = quantize(torch.randn(128, 512) * 3)
    for dt in (torch.float16, torch.float32):
        d = dequantize_triton(to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale, dt).double()
        r = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        out.append(dict(kind="dequant", maxrel=((d - r).abs() / r.abs().clamp_min(1e-30)).max().item(), dtype=str(dt)))
    # the fused split-K reduction leaves its ticket counters at zero for the next launch
    from nvfp4.kernels import nvfp4_gemm
    out.append(dict(kind="counters", zero=all(int(c.abs().sum()) == 0 for c in nvfp4_gemm._SPLITK_COUNTERS.values()),
                    used=len(nvfp4_gemm._SPLITK_COUNTERS)))
    # a config for the other layout is refused instead of reading the bytes wrongly
    try:
        nvfp4_linear(torch.randn(1, 256, dtype=torch.float16), *mma_pair(q.packed[:, :128].contiguous(),
                     q.scale[:, :16].contiguous()), q.global_scale, None, config=LinearConfig(16, 32, 64, 1))
        out.append(dict(kind="refused", ok=False))
    except ValueError:
        out.append(dict(kind="refused", ok=True))
    print("RESULT" + json.dumps(out))
    """
)


def test_mma_layout_kernels_under_triton_interpreter():
    """The MMA-layout kernels (forward with bias / split-K / row blocks, fused LoRA, dgrad, dequantize) match the
    float64 reference of the compressed-tensors tensors they were converted from."""
    results = run_under_interpreter(_INTERP_MMA_SCRIPT, timeout=600, extra_path=[SRC])
    assert len(results) == 18 + 7 + 3 + 2 + 1 + 1
    for r in results:
        if r["kind"] == "counters":
            assert r["zero"] and r["used"] == 1, r
            continue
        if r["kind"] == "dequant":
            tol = 1e-3 if r["dtype"] == "torch.float16" else 1e-6
            assert r["maxrel"] < tol, r
        elif r["kind"] == "refused":
            assert r["ok"], "a compressed-tensors config was accepted for an MMA-layout weight"
        else:
            assert r["rel"] == r["rel"], f"NaN in output (unwritten element?): {r}"
            assert r["rel"] < 2e-3, r
            assert r["shape"] == [r["m"], r["k"] if r["kind"] == "dgrad" else r["n"]], r


_INTERP_LARGE_M_SCRIPT = _INTERP_PRELUDE + textwrap.dedent(
    """
    torch.manual_seed(2468)

    def large(bm, tiles, quarters, split=1, warps=4):
        return LinearConfig(block_m=bm, block_n=64 * tiles, block_k=64 * quarters, split_k=split, num_warps=warps,
                            num_stages=1, group_m=2, mma=True, large_m=True)

    # (M, N, K, config): odd M, several row blocks, N not a multiple of the program's 64·TILES rows, K at the
    # smallest (256) and larger, every K step (64, 128, 256), uneven split-K, fused LoRA
    cases = [(5, 64, 256, large(16, 1, 1)), (37, 192, 512, large(32, 2, 2)), (70, 128, 768, large(64, 2, 4, 2)),
             (33, 320, 1024, large(16, 4, 1, 3)), (100, 192, 256, large(32, 1, 4)), (9, 64, 1280, large(16, 1, 2, 3))]
    for m, n, k, cfg in cases:
        q = quantize(torch.randn(n, k))
        x = torch.randn(m, k, dtype=torch.float16)
        b = torch.randn(n, dtype=torch.float16)
        wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        y = nvfp4_linear(x, to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale, b, config=cfg)
        out.append(dict(kind="linear", m=m, n=n, rel=rel(y, x.double() @ wd.T + b.double()), shape=list(y.shape)))
        out.append(lora_case(m, n, k, 16, cfg, mma_pair))
    out.append(lora_case(48, 192, 512, 16, None, mma_pair))  # the dispatch moves a LoRA at 32 < M ≤ 64 here
    print("RESULT" + json.dumps(out))
    """
)


def test_large_m_kernel_under_triton_interpreter():
    """The large-M kernel (several weight tiles per program, K steps of 64-256, row blocks, split-K, fused LoRA)
    matches the float64 reference, every output element written."""
    results = run_under_interpreter(_INTERP_LARGE_M_SCRIPT, timeout=600, extra_path=[SRC])
    assert len(results) == 13
    for r in results:
        assert r["rel"] == r["rel"], f"NaN in output (unwritten element?): {r}"
        assert r["rel"] < 2e-3, r
        assert r["shape"] == [r["m"], r["n"]], r


_INTERP_ROWS_SCRIPT = _INTERP_PRELUDE + textwrap.dedent(
    """
    from nvfp4.kernels.nvfp4_gemm import linear_config
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    torch.manual_seed(1357)
    # the dispatch's own configs (no override), each form at a K of the offline model vLLM runs (576: not a multiple
    # of the tile; 1536: split 3), M real rows then M_PAD as a CUDA-graph size pads them with garbage rows
    cases = [(3, 8, 192, 576, False), (20, 32, 192, 576, False), (42, 48, 192, 576, False),  # tc: bm 16, 32, 64
             (3, 8, 128, 1536, True), (20, 24, 128, 1536, True),  # MMA decode kernel, split 3, summed in the kernel
             (42, 48, 128, 1536, True), (100, 128, 128, 1536, True)]  # split 3 + reduce kernel; large-M, split 12
    for m, pad, n, k, mma in cases:
        q = quantize(torch.randn(n, k))
        packed = to_mma_layout(q.packed) if mma else q.packed
        scale = to_scale_mma_layout(q.scale) if mma else q.scale
        cfg, cfg_pad = linear_config(m, n, k, mma=mma), linear_config(pad, n, k, mma=mma)
        x = torch.randn(m, k, dtype=torch.float16)
        junk = torch.randn(pad - m, k, dtype=torch.float16) * 1e4
        junk[::2, ::7] = float("nan")
        junk[1::2, ::5] = float("inf")
        y = nvfp4_linear(x, packed, scale, q.global_scale)
        again = nvfp4_linear(x, packed, scale, q.global_scale)
        padded = nvfp4_linear(torch.cat([x, junk]), packed, scale, q.global_scale)[:m]
        wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        out.append(dict(m=m, pad=pad, mma=mma, same_config=cfg == cfg_pad, split=cfg.split_k, rel=rel(y, x.double() @ wd.T),
                        again=bool(torch.equal(again, y)), padded=bool(torch.equal(padded, y))))
    print("RESULT" + json.dumps(out))
    """
)


def test_rows_independent_of_padding_and_repeats_bit_identical_under_triton_interpreter():
    """What vLLM needs of the op to give the same tokens and logprobs run to run: at the dispatch's own configs
    (tensor-core kernel, MMA decode kernel with split-K summed in the kernel or by the reduce kernel, large-M split-K)
    the same input twice gives the same bits, and a row's output does not depend on the rows beside it: the first M
    rows of a batch padded with NaN / inf / huge rows (a CUDA-graph size's padding) equal the unpadded call's bit for
    bit, where the padded M takes the same config."""
    results = run_under_interpreter(_INTERP_ROWS_SCRIPT, timeout=600, extra_path=[SRC])
    assert len(results) == 7
    assert {r["split"] for r in results if r["mma"]} >= {3, 12}, results  # the split-K forms were exercised
    for r in results:
        assert r["same_config"], r  # the cases are chosen so that padding keeps the config
        assert r["rel"] == r["rel"] and r["rel"] < 2e-3, r
        assert r["again"] and r["padded"], r


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in output"
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def poisoned():
    from nvfp4.kernels import nvfp4_gemm

    nvfp4_gemm.POISON_OUTPUTS = True
    yield
    nvfp4_gemm.POISON_OUTPUTS = False


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_random_shapes_gpu(dtype, poisoned):
    from nvfp4.kernels import LinearConfig, linear_config, nvfp4_linear

    gen = torch.Generator().manual_seed(7)
    for m in (1, 3, 7, 16, 17, 33, 64, 100, 129, 300, 1100):
        n = int(torch.randint(17, 700, (1,), generator=gen)) | 1  # odd: never a multiple of a tile
        k = 16 * int(torch.randint(1, 90, (1,), generator=gen))
        w = torch.randn(n, k, device="cuda") * (100.0 if m == 17 else 1.0)  # amax > 24: the scale-fold fallback
        q = quantize(w)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype)
        ref = x.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.float64).T + b.double()
        cfgs = [None, LinearConfig(16, 64, 256, 3), LinearConfig(64, 128, 128, 2, 4, 3, True),
                LinearConfig(128, 128, 64, 1, 8, 3, False), LinearConfig(dequant=True),
                LinearConfig(16, 64, 128, 2, 4, 1, True, prefetch=True),
                LinearConfig(1, 32, 256, 3, 4, 1, gemv=True), LinearConfig(1, 16, 512, 1, 4, 1, gemv=True, prefetch=True),
                LinearConfig(1, 64, 128, 4, 4, 1, gemv=True, prefetch=True)]  # fmt: skip
        if m > 17:  # the GEMV path is for small M
            cfgs = cfgs[:6]
        for cfg in cfgs:
            y = nvfp4_linear(x, q.packed, q.scale, q.global_scale, b, config=cfg)
            assert y.dtype == dtype and y.shape == (m, n)
            err = _rel(y, ref)
            assert err < 1e-2, (m, n, k, cfg or linear_config(m, n, k), err)


@pytest.mark.gpu
@cuda
def test_dgrad_random_shapes_gpu(poisoned):
    from nvfp4.kernels import DgradConfig, nvfp4_linear_dgrad

    gen = torch.Generator().manual_seed(8)
    for m in (1, 5, 64, 257, 1030):
        n = int(torch.randint(17, 700, (1,), generator=gen)) | 1
        k = 16 * int(torch.randint(1, 90, (1,), generator=gen))
        q = quantize(torch.randn(n, k, device="cuda"))
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ref = dy.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        for cfg in (None, DgradConfig(), DgradConfig(64, 64, 128, 4, 3), DgradConfig(dequant=True)):
            dx = nvfp4_linear_dgrad(dy, q.packed, q.scale, q.global_scale, config=cfg)
            assert dx.dtype == torch.bfloat16 and dx.shape == (m, k)
            assert _rel(dx, ref) < 1e-2, (m, n, k, cfg)


@pytest.mark.gpu
@cuda
def test_ops_dispatch_and_autograd_gpu():
    from nvfp4 import ops

    q = quantize(torch.randn(300, 272, device="cuda"))
    x = torch.randn(5, 9, 272, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ops.linear(x, q.packed, q.scale, q.global_scale)
    wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
    assert _rel(y, x.detach().double() @ wd.T) < 1e-2
    g = torch.randn_like(y)
    y.backward(g)
    assert _rel(x.grad, g.double() @ wd) < 1e-2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_cudagraphs_gpu(mode):
    from nvfp4 import NVFP4Linear

    torch._dynamo.reset()
    lin = torch.nn.Linear(512, 384, bias=True, device="cuda", dtype=torch.bfloat16)
    mod = NVFP4Linear.from_linear(lin)
    net = torch.nn.Sequential(mod, torch.nn.GELU())
    compiled = torch.compile(net, mode=mode, fullgraph=True)
    for m in (4, 4, 4, 64):  # repeated calls replay the captured graph
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            eager = net(x)
            out = compiled(x).clone()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_linear_random_shapes_gpu(dtype, poisoned):
    """Base + adapter in one kernel vs the float64 product, every M range, ranks 8-64, split-K and uneven shapes."""
    from nvfp4.kernels import nvfp4_lora_linear

    gen = torch.Generator().manual_seed(7)
    for m in (1, 2, 3, 9, 16, 33, 64, 100, 128, 300):
        n = int(torch.randint(17, 700, (1,), generator=gen)) | 1
        k = 16 * int(torch.randint(4, 80, (1,), generator=gen))
        r = (8, 16, 32, 64)[m % 4]
        q = quantize(torch.randn(n, k, device="cuda") * (30 if m == 9 else 1))  # amax > 24: folded-scale path
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        a = torch.randn(r, k, device="cuda") / k**0.5
        b = torch.randn(n, r, device="cuda")
        bias = torch.randn(n, device="cuda", dtype=dtype)
        wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        base = x.double() @ wd.T + bias.double()
        # the adapter's share as large as the base's, so that the check of the share alone is not swamped by the
        # output's own rounding (bf16: 2^-9 of |y|)
        b *= (base.norm() / (0.7 * (x.double() @ a.double().T) @ b.double().T).norm()).float()
        delta = 0.7 * (x.double() @ a.double().T) @ b.double().T
        y = nvfp4_lora_linear(x, q.packed, q.scale, q.global_scale, bias, a, b, 0.7)
        assert y.dtype == dtype and y.shape == (m, n)
        assert _rel(y, base + delta) < 1e-2, (m, n, k, r)
        assert _rel(y.double() - base, delta) < 2e-2, (m, n, k, r)  # the adapter's share itself is right


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma_layout_random_shapes_gpu(dtype, poisoned):
    """MMA-layout kernels on random whole-tile shapes, every M range (incl. the dequantize paths), odd M, bias,
    split-K, amax > 24, fused LoRA and dgrad: all against the float64 product of the original tensors."""
    from nvfp4.kernels import LinearConfig, linear_config, nvfp4_linear, nvfp4_linear_dgrad, nvfp4_lora_linear
    from nvfp4.kernels import nvfp4_gemm as kern
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    gen = torch.Generator().manual_seed(11)
    for m in (1, 3, 7, 16, 17, 33, 64, 100, 129, 300):
        n = 64 * int(torch.randint(1, 40, (1,), generator=gen))
        k = 256 * int(torch.randint(1, 30, (1,), generator=gen))
        q = quantize(torch.randn(n, k, device="cuda") * (100.0 if m == 17 else 1.0))
        packed = to_mma_layout(q.packed)
        scale = to_scale_mma_layout(q.scale)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype)
        wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        ref = x.double() @ wd.T + b.double()
        for cfg in (None, LinearConfig(16, 64, 256, 3, 4, 3, mma=True), LinearConfig(64, 64, 256, 1, 4, 2, mma=True)):
            y = nvfp4_linear(x, packed, scale, q.global_scale, b, config=cfg)
            assert y.dtype == dtype and y.shape == (m, n)
            assert _rel(y, ref) < 1e-2, (m, n, k, cfg or linear_config(m, n, k, mma=True))
        if m <= 128 and k >= 512:  # split-K summed in the kernel: the separate reduce kernel's sum, bit for bit
            cfg = kern._decode_config(m, n, k)
            cfg = LinearConfig(cfg.block_m, 64, 256, max(2, cfg.split_k), 4, cfg.num_stages, mma=True)
            fused = nvfp4_linear(x, packed, scale, q.global_scale, b, config=cfg)
            separate = nvfp4_linear(x, packed, scale, q.global_scale, b, config=replace(cfg, fused_reduce=False))
            assert torch.equal(fused, separate), (m, n, k, cfg)
        r = (8, 16, 32, 64)[m % 4]
        a = torch.randn(r, k, device="cuda") / k**0.5
        lb = torch.randn(n, r, device="cuda")
        lb *= (ref.norm() / (0.7 * (x.double() @ a.double().T) @ lb.double().T).norm()).float()
        delta = 0.7 * (x.double() @ a.double().T) @ lb.double().T
        y = nvfp4_lora_linear(x, packed, scale, q.global_scale, b, a, lb, 0.7)
        assert _rel(y, ref + delta) < 1e-2, (m, n, k, r)
        assert _rel(y.double() - ref, delta) < 2e-2, (m, n, k, r)
        if m <= 128:  # the other LoRA form: x·Aᵀ beside every tile / once per split (SHARED_T, with split-K at M ≤ 32)
            cfg = kern._decode_config(m, n, k)
            cfg = replace(cfg, lora_shared_t=not cfg.lora_shared_t)
            y = nvfp4_lora_linear(x, packed, scale, q.global_scale, b, a, lb, 0.7, config=cfg)
            assert _rel(y.double() - ref, delta) < 2e-2, (m, n, k, r, cfg)
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        dx = nvfp4_linear_dgrad(dy, packed, scale, q.global_scale)
        assert dx.shape == (m, k) and _rel(dx, dy.double() @ wd) < 1e-2, (m, n, k)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_m_random_shapes_gpu(dtype, poisoned):
    """Every swept tile of the large-M kernel on random whole-tile shapes: odd M, N not a multiple of the program's
    rows, K at 256 and large, split-K, bias, amax > 24, fused LoRA; and the dispatch from M = 32 to 4096."""
    from nvfp4.kernels import LinearConfig, linear_config, nvfp4_linear, nvfp4_lora_linear
    from nvfp4.kernels.large_m import LARGE_M_TILES
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    gen = torch.Generator().manual_seed(23)
    for i, (tiles, quarters, bm, warps, stages) in enumerate(LARGE_M_TILES):
        for m, split in ((int(torch.randint(bm // 2, 3 * bm, (1,), generator=gen)) | 1, 1), (bm + 3, 3)):
            n = 64 * int(torch.randint(1, 60, (1,), generator=gen))
            k = 256 * (1 if i % 3 == 0 else int(torch.randint(2, 40, (1,), generator=gen)))
            q = quantize(torch.randn(n, k, device="cuda") * (100.0 if i % 4 == 1 else 1.0))
            packed = to_mma_layout(q.packed)
            scale = to_scale_mma_layout(q.scale)
            # amax > 24 weights with K in the thousands give outputs near fp16's 65504 once the adapter's equal-norm
            # delta is added (an H100 run overflowed to inf, correctly): x is scaled down there in fp16
            x_scale = 1 / 16 if dtype == torch.float16 and i % 4 == 1 else 1.0
            x = torch.randn(m, k, device="cuda", dtype=dtype) * x_scale
            b = torch.randn(n, device="cuda", dtype=dtype)
            ref = x.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.float64).T + b.double()
            cfg = LinearConfig(bm, 64 * tiles, 64 * quarters, split, warps, stages, mma=True, large_m=True)
            y = nvfp4_linear(x, packed, scale, q.global_scale, b, config=cfg)
            assert y.dtype == dtype and y.shape == (m, n)
            assert _rel(y, ref) < 1e-2, (m, n, k, cfg)
            a = torch.randn(32, k, device="cuda") / k**0.5
            lb = torch.randn(n, 32, device="cuda")
            lb *= (ref.norm() / (0.7 * (x.double() @ a.double().T) @ lb.double().T).norm()).float()
            delta = 0.7 * (x.double() @ a.double().T) @ lb.double().T
            assert (ref + delta).abs().max() < torch.finfo(dtype).max / 4  # the test's own data stays in range
            y = nvfp4_lora_linear(x, packed, scale, q.global_scale, b, a, lb, 0.7, config=cfg)
            assert _rel(y.double() - ref, delta) < 2e-2, (m, n, k, cfg)
    for m in (32, 65, 128, 255, 512, 1000, 2048, 4096):  # whatever the dispatch table picks
        n, k = 64 * int(torch.randint(8, 100, (1,), generator=gen)), 256 * int(torch.randint(4, 30, (1,), generator=gen))
        q = quantize(torch.randn(n, k, device="cuda"))
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = x.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.float64).T
        y = nvfp4_linear(x, to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale)
        assert _rel(y, ref) < 1e-2, (m, n, k, linear_config(m, n, k, mma=True))


def _assert_replays_bit_equal(fn, cases) -> None:
    """``cases``: ``(args, config, expected)``. Capture 10 rounds of ``fn(*args, config=config)`` for every case in
    one CUDA graph, replay it 5 times with the outputs reset to NaN first, and require each output to equal
    ``expected`` bit for bit and the split-K counters to end at zero."""
    from nvfp4.kernels import nvfp4_gemm as kern

    outs = [torch.empty_like(expected) for _, _, expected in cases]
    for (args, cfg, _), o in zip(cases, outs):
        o.copy_(fn(*args, config=cfg))  # allocates the counters outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            for (args, cfg, _), o in zip(cases, outs):
                o.copy_(fn(*args, config=cfg))
    for _ in range(5):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for (_, cfg, expected), o in zip(cases, outs):
            assert torch.equal(o, expected), cfg
    assert int(kern._SPLITK_COUNTERS[torch.device("cuda", torch.cuda.current_device())].abs().sum()) == 0


@pytest.mark.gpu
@cuda
def test_fused_splitk_reduction_back_to_back_in_a_cuda_graph_gpu(poisoned):
    """The split-K tickets under stress: 40 launches of 4 weights (different tile counts and splits) captured in one
    CUDA graph and replayed 5 times; every output equals the separate reduce kernel's bit for bit (a program that
    summed before all partials had landed, or a counter left non-zero, would differ) and the counters end at zero."""
    from nvfp4.kernels import LinearConfig, nvfp4_linear
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    torch.manual_seed(5)
    cases = []
    for n, k, split, m in [(512, 3584, 7, 1), (4096, 2048, 4, 16), (64, 4096, 16, 5), (18944, 3584, 2, 8)]:
        q = quantize(torch.randn(n, k, device="cuda"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = LinearConfig(16, 64, 256, split, 4, 3, mma=True)
        args = (x, to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale, None)
        cases.append((args, cfg, nvfp4_linear(*args, config=replace(cfg, fused_reduce=False))))
    _assert_replays_bit_equal(nvfp4_linear, cases)


@pytest.mark.gpu
@cuda
def test_fused_lora_shared_t_back_to_back_in_a_cuda_graph_gpu(poisoned):
    """The fused LoRA with ``x·Aᵀ`` shared through the workspace (tile 0's programs publish it, every tile's last
    program waits for it): 40 launches of 4 adapters × weights (ranks 8-64, 1-2 row blocks, 2-16 splits) in one
    CUDA graph replayed 5 times; every output equals the eager call's bit for bit and the float64 product within
    bf16 error, and all counters end at zero (a reader that did not wait, or a counter not reset, would differ)."""
    from nvfp4.kernels import LinearConfig, nvfp4_lora_linear
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    torch.manual_seed(6)
    cases = []
    for n, k, split, m, r in [(512, 3584, 7, 1, 32), (4096, 2048, 4, 16, 8), (64, 4096, 16, 5, 64), (18944, 3584, 2, 24, 16)]:  # fmt: skip
        q = quantize(torch.randn(n, k, device="cuda"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(r, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, r, device="cuda", dtype=torch.bfloat16)
        wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
        ref = x.double() @ wd.T + 0.5 * (x.double() @ a.double().T) @ b.double().T
        args = (x, to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale, None, a, b, 0.5)
        cfg = LinearConfig(16, 64, 256, split, 4, 3, mma=True)
        eager = nvfp4_lora_linear(*args, config=cfg)
        assert _rel(eager, ref) < 1e-2, (n, k, split, m, r)
        cases.append((args, cfg, eager))
    _assert_replays_bit_equal(nvfp4_lora_linear, cases)


@pytest.mark.gpu
@cuda
def test_fused_splitk_first_call_inside_compiled_cuda_graphs_gpu():
    """The first split-K call of a process can happen inside torch.compile's CUDA-graph trees (a decode step whose
    prefill took the dequantize path): the ticket counters allocated then must not land in the graphs' private pool
    (cudagraph trees reject a live tensor they do not track), and the compiled result is the eager one."""
    from nvfp4 import ops
    from nvfp4.kernels import nvfp4_gemm as kern
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    torch._dynamo.reset()
    kern._SPLITK_COUNTERS.clear()
    q = quantize(torch.randn(512, 3584, device="cuda"))
    packed = to_mma_layout(q.packed)
    scale = to_scale_mma_layout(q.scale)
    x = torch.randn(1, 3584, device="cuda", dtype=torch.bfloat16)
    assert kern.linear_config(1, 512, 3584, mma=True).split_k > 1

    def step(x):
        return ops.linear(x * 1.0, packed, scale, q.global_scale)  # the custom op, as NVFP4Linear calls it

    compiled = torch.compile(step, mode="reduce-overhead")
    outs = [compiled(x).clone() for _ in range(4)]
    eager = step(x)
    assert kern._SPLITK_COUNTERS, "the fused reduction was not used"
    for out in outs:
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.gpu
@cuda
def test_nvfp4linear_uses_mma_layout_on_cuda_gpu():
    """A layer moved to CUDA converts to the MMA layout; its state dict stays in the checkpoint layout; it compiles
    (full graph, CUDA graphs) and gives the compressed-tensors layer's result bit for bit in eager mode."""
    from nvfp4 import NVFP4Linear

    torch._dynamo.reset()
    lin = torch.nn.Linear(1024, 512, bias=True, dtype=torch.bfloat16)
    cpu = NVFP4Linear.from_linear(lin)
    gpu = NVFP4Linear.from_linear(lin).cuda()
    assert not cpu.mma_layout and gpu.mma_layout and gpu.weight_packed.shape == (128, 2048)
    sd = gpu.state_dict()
    assert torch.equal(sd["weight_packed"].cpu(), cpu.weight_packed)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = gpu(x)
        ref = x.double() @ cpu.dequantize(torch.float64).cuda().T + lin.bias.cuda().double()
        assert _rel(eager, ref) < 1e-2
        compiled = torch.compile(gpu, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            out = compiled(x).clone()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.gpu
@cuda
def test_nvfp4linear_keeps_ct_layout_for_unsupported_scales_gpu():
    """A zero block scale (compressed-tensors never writes one, a hand-made checkpoint might) is outside what the
    MMA-layout kernels decode exactly: the layer stays in the compressed-tensors layout, warns, and stays exact."""
    from nvfp4 import NVFP4Linear

    lin = torch.nn.Linear(512, 256, bias=False, dtype=torch.bfloat16)
    layer = NVFP4Linear.from_linear(lin)
    layer.weight_scale[3, 5] = 0.0
    with pytest.warns(UserWarning, match="compressed-tensors layout"):
        gpu = layer.cuda()
    assert not gpu.mma_layout
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = x.double() @ layer.dequantize(torch.float64).cuda().T
        assert _rel(gpu(x), ref) < 1e-2
