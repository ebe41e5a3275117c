"""MXFP4 layers through the NVFP4 Triton kernels, after the exact scale transcode (:func:`nvfp4.mxfp4.to_nvfp4`):
no kernel of their own, so these check that the transcoded tensors drive every kernel family to MXFP4's reference
(:func:`nvfp4.mxfp4.dequantize` + ``F.linear``, in float64).

* CPU (CI): under the Triton interpreter (``TRITON_INTERPRET=1``, fp16/fp32 activations) in a subprocess, outputs
  poisoned with NaN first (every element must be written): compressed-tensors layout (tensor-core, split-K, GEMV,
  dequantize + matmul), MMA layout (decode, large-M), dgrad, fused LoRA; weights whose groups span 16 binades (FP8
  subnormal scales) and an all-zero group.
* GPU (``-m gpu``, skipped without CUDA): ``NVFP4Linear(format="mxfp4")`` on CUDA takes the MMA layout and, at every
  dispatch M from 1 to 4096, matches the reference in bf16 and fp16, forward, dgrad (autograd) and fused LoRA.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from triton_interpreter import run_under_interpreter

SRC = Path(__file__).resolve().parents[2] / "packages" / "nvfp4" / "src"

_INTERP_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from nvfp4 import NVFP4Linear, mxfp4
    from nvfp4.kernels import LinearConfig, nvfp4_gemm, nvfp4_linear, nvfp4_linear_dgrad, nvfp4_lora_linear
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    nvfp4_gemm.POISON_OUTPUTS = True
    torch.manual_seed(2222)
    out = []

    def rel(a, b):
        a, b = a.double(), b.double()
        return float("nan") if torch.isnan(a).any() else ((a - b).norm() / b.norm()).item()

    def mx_weight(n, k):
        # rows over 16 binades (FP8 subnormal scales after the transcode) and an all-zero group
        w = torch.randn(n, k) * torch.exp2(torch.randint(-8, 8, (n, 1)).float())
        w[1, 32:64] = 0
        q = mxfp4.quantize(w)
        layer = NVFP4Linear.from_weight(q, None, torch.float32)
        assert layer.uses_nvfp4_ops, "no transcode"
        return q, layer.weight_packed, layer.weight_scale, layer.weight_global_scale

    def mma(m, split, large=False):
        if large:
            return LinearConfig(block_m=m, block_n=128, block_k=128, split_k=split, num_warps=4, num_stages=1,
                                group_m=2, mma=True, large_m=True)
        return LinearConfig(block_m=m, block_n=64, block_k=256, split_k=split, num_stages=1, mma=True)

    ct = lambda p, s: (p, s)
    mma_pair = lambda p, s: (to_mma_layout(p), to_scale_mma_layout(s))  # as NVFP4Linear holds them on CUDA
    cases = [  # (M, N, K, config, layout, x dtype)
        (3, 40, 96, LinearConfig(block_m=16, block_n=32, block_k=64, split_k=1), ct, torch.float16),
        (5, 72, 288, LinearConfig(block_m=16, block_n=32, block_k=64, split_k=3), ct, torch.float16),
        (3, 72, 288, LinearConfig(block_n=32, block_k=64, split_k=3, gemv=True), ct, torch.float16),
        (1, 64, 512, LinearConfig(block_n=16, block_k=128, split_k=2, gemv=True, prefetch=True), ct, torch.float16),
        (2, 24, 64, LinearConfig(dequant=True), ct, torch.float16),
        (4, 40, 96, None, ct, torch.float32),  # float32 x: the Triton dequantizer + matmul
        (1, 64, 256, None, mma_pair, torch.float16),
        (3, 128, 512, mma(16, 2), mma_pair, torch.float16),
        (37, 256, 512, mma(32, 1, large=True), mma_pair, torch.float16),
        (4, 64, 256, None, mma_pair, torch.float32),
    ]
    for m, n, k, cfg, layout, dt in cases:
        q, packed, scale, g = mx_weight(n, k)
        x = torch.randn(m, k, dtype=dt)
        b = torch.randn(n, dtype=dt)
        ref = mxfp4.linear_reference(x.double(), q.packed, q.scale, b.double())  # float64: exact weights
        y = nvfp4_linear(x, *layout(packed, scale), g, b, config=cfg)
        out.append(dict(kind="linear", m=m, n=n, k=k, rel=rel(y, ref), shape=list(y.shape), dtype=str(y.dtype),
                        ref_rel=rel(mxfp4.linear_reference(x, q.packed, q.scale, b), ref)))
    for m, n, k, layout in [(3, 40, 96, ct), (19, 64, 256, mma_pair)]:
        q, packed, scale, g = mx_weight(n, k)
        dy = torch.randn(m, n, dtype=torch.float16)
        dx = nvfp4_linear_dgrad(dy, *layout(packed, scale), g)
        ref = dy.double() @ mxfp4.dequantize(q.packed, q.scale, torch.float64)
        out.append(dict(kind="dgrad", m=m, n=n, k=k, rel=rel(dx, ref), shape=list(dx.shape), dtype=str(dx.dtype)))
    for m, n, k, r, cfg, layout in [(3, 40, 96, 8, LinearConfig(16, 32, 64, 1), ct), (3, 128, 512, 16, mma(16, 2), mma_pair)]:
        q, packed, scale, g = mx_weight(n, k)
        x = torch.randn(m, k, dtype=torch.float16)
        a, lb = torch.randn(r, k) / k**0.5, torch.randn(n, r)
        ref = (mxfp4.linear_reference(x.double(), q.packed, q.scale)
               + 0.5 * (x.double() @ a.double().T) @ lb.double().T)
        y = nvfp4_lora_linear(x, *layout(packed, scale), g, None, a, lb, 0.5, config=cfg)
        out.append(dict(kind="lora", m=m, n=n, k=k, rel=rel(y, ref), shape=list(y.shape), dtype=str(y.dtype)))
    print("RESULT" + json.dumps(out))
    """
)


def test_mxfp4_through_the_kernels_under_triton_interpreter():
    results = run_under_interpreter(_INTERP_SCRIPT, timeout=600, extra_path=[SRC])
    assert len(results) == 10 + 2 + 2
    for r in results:
        assert r["rel"] == r["rel"], f"NaN in output (unwritten element?): {r}"  # NaN != NaN
        # fp16 outputs round at ~3e-4; the plain fp16 reference itself is that far from float64
        assert r["rel"] < (1e-5 if r["dtype"] == "torch.float32" else 2e-3), r
        if "ref_rel" in r:
            assert r["ref_rel"] < (1e-5 if r["dtype"] == "torch.float32" else 2e-3), r
        assert r["shape"] == [r["m"], r["k"] if r["kind"] == "dgrad" else r["n"]], r


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


def _mxfp4_layer(n: int, k: int, gen: torch.Generator, dtype: torch.dtype):
    from nvfp4 import NVFP4Linear, mxfp4

    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (n, 1), generator=gen).float())
    w[1, :32] = 0  # an all-zero group (E = 0, outside the transcode's window)
    q = mxfp4.quantize(w.to(dtype))
    bias = torch.randn(n, generator=gen).to(dtype)
    return q, NVFP4Linear.from_weight(q, bias, dtype).cuda(), bias.cuda()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp4_layers_through_every_kernel_family_gpu(dtype, poisoned):
    """MXFP4 layers on CUDA (MMA layout where the shape allows, compressed-tensors layout otherwise) at every dispatch
    M (GEMV/decode, tensor-core split-K, large-M, dequantize + cuBLAS), forward + dgrad through autograd, and the
    fused LoRA kernel: all against MXFP4's float64 reference."""
    from nvfp4 import mxfp4
    from nvfp4.kernels import nvfp4_lora_linear

    gen = torch.Generator().manual_seed(31)
    shapes = [(64 * int(torch.randint(1, 40, (1,), generator=gen)), 256 * int(torch.randint(1, 30, (1,), generator=gen)))
              for _ in range(3)] + [(200, 96)]  # the last: no MMA layout (N % 64, K % 256)
    for n, k in shapes:
        q, layer, bias = _mxfp4_layer(n, k, gen, dtype)
        assert layer.format == "mxfp4" and layer.uses_nvfp4_ops
        assert layer.mma_layout == (n % 64 == 0 and k % 256 == 0)
        wd = mxfp4.dequantize(q.packed, q.scale, torch.float64).cuda()
        for m in (1, 2, 3, 7, 16, 17, 33, 64, 100, 129, 300, 1000, 4096):
            x = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
            y = layer(x)
            ref = x.detach().double() @ wd.T + bias.double()
            assert y.dtype == dtype and y.shape == (m, n)
            assert _rel(y, ref) < 1e-2, (m, n, k)
            if m in (3, 129, 1000):
                dy = torch.randn_like(y)
                y.backward(dy)
                assert _rel(x.grad, dy.double() @ wd) < 1e-2, (m, n, k)
            if m <= 300:
                r = 16
                a = torch.randn(r, k, device="cuda") / k**0.5
                lb = torch.randn(n, r, device="cuda")
                with torch.no_grad():
                    yl = nvfp4_lora_linear(x.detach(), layer.weight_packed, layer.weight_scale,
                                           layer.weight_global_scale, bias, a, lb, 0.5)  # fmt: skip
                delta = 0.5 * (x.detach().double() @ a.double().T) @ lb.double().T
                assert _rel(yl, ref + delta) < 1e-2, (m, n, k)
        sd = layer.state_dict()  # the checkpoint's bytes, whatever the layout on the GPU
        assert torch.equal(sd["weight_packed"].cpu(), q.packed) and torch.equal(sd["weight_scale"].cpu(), q.scale)


@pytest.mark.gpu
@cuda
def test_mxfp4_layer_without_transcode_runs_the_reference_on_cuda_gpu():
    from nvfp4 import NVFP4Linear, mxfp4

    q = mxfp4.quantize(torch.randn(128, 512))
    q.scale[0, 0] += 20
    with pytest.warns(UserWarning, match="plain PyTorch reference"):
        layer = NVFP4Linear.from_weight(q, None, torch.bfloat16).cuda()
    assert not layer.uses_nvfp4_ops and not layer.mma_layout
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mxfp4.linear_reference(x, q.packed.cuda(), q.scale.cuda())
        assert torch.equal(layer(x), ref)
