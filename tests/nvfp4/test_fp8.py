"""The FP8 rollout path's pieces (:mod:`nvfp4.fp8`, :mod:`nvfp4.kernels.fp8`; issue #51's spike).

* CPU (CI): the fused quantisation kernel under the Triton interpreter (``TRITON_INTERPRET=1``, fp16/fp32: the
  interpreter has no bf16) against :func:`nvfp4.fp8.act_quant_reference` and against float64, on fresh random rows
  (odd M, one-tile and two-pass rows, every mode, a residual in place, zero and tiny rows), outputs allocated full
  of NaN; the whole FP8 linear (the kernel's quantisation, then the **reference matmul**: ``torch._scaled_mm`` on
  CPU takes per-tensor scales only) against the NVFP4 policy's float64 output; the weight copy; the ops' schemas and
  fakes (``torch.library.opcheck``); the kernel compiled for sm_90a without a GPU (SASS: the E4M3 pack instruction,
  128-bit loads, no spills).
* GPU (``-m gpu``, the H100): the kernel in bf16 against the reference, ``torch._scaled_mm`` row-wise (odd M, bias)
  against the reference matmul, the whole FP8 linear against the NVFP4 policy, and a CUDA-graph replay.
"""

from __future__ import annotations

import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from cuda_graphs import capture
from nvfp4 import fp8
from nvfp4.codec import dequantize, quantize
from nvfp4.layout import mma_layout_supported, to_mma_layout, to_scale_mma_layout
from triton_interpreter import run_under_interpreter

SRC = Path(__file__).resolve().parents[2] / "packages" / "nvfp4" / "src"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The checks both the interpreter script and the GPU test apply to one act_quant call (kernel vs reference).
_CHECKS = textwrap.dedent(
    """
    import torch
    from nvfp4 import fp8

    def check(x, mode, w, r, q, s, y, ro):
        '''Kernel outputs (q, s, y, ro) against the reference and float64; returns a dict of measured errors.'''
        rq, rs, ry, rro = fp8.act_quant_reference(x, mode, w, 1e-6, r)
        for t in (q, s, y) + ((ro,) if r is not None else ()):
            assert not torch.isnan(t.float()).any(), "an output element was never written"
        # float64 truth of the row before quantisation (from the rounded new residual, as the kernel reads it)
        h = x.double()
        if mode == "silu_mul":
            g, u = h.chunk(2, dim=-1)
            h = g * torch.sigmoid(g) * u
        if r is not None:
            h = rro.double()
        v = h
        if mode == "rms_norm":
            v = h * w.double() / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        deq = q.double() * s.double()
        bound = (v.abs() * 2.0**-4 + s.double() * 2.0**-10) * (1 + 1e-4) + 1e-30
        qd, rqd = q.double(), rq.double()
        miss = qd != rqd
        return dict(
            s_rel=((s.double() - rs.double()).abs() / rs.double()).max().item(),
            q_miss=miss.double().mean().item(),
            # a mismatch is one E4M3 step at most (float32 ulps in the row's rstd / silu move a rounding boundary)
            q_far=(miss & ((qd - rqd).abs() > rqd.abs() * 2.0**-3 + 2.0**-9 + 1e-12)).sum().item(),
            over_bound=((deq - v).abs() > bound).sum().item(),
            y_rel=((y.double() - ry.double()).norm() / ry.double().norm().clamp_min(1e-30)).item() if y is not None else 0.0,
            ro_equal=bool(r is None or torch.equal(ro, rro)),
        )
    """
)

_INTERP_SCRIPT = _CHECKS + textwrap.dedent(
    """
    import json
    from nvfp4.codec import dequantize, quantize
    from nvfp4.kernels import fp8 as kfp8

    kfp8.POISON_OUTPUTS = True
    torch.manual_seed(51)
    out = []
    # (M, K): one tile (K ≤ 8192), two passes over the row (K > 8192, not a multiple of the tile)
    for m, k in ((5, 300), (3, 96), (3, 8192 + 272)):
        for dt in (torch.float16, torch.float32):
            for mode, with_res in (("plain", False), ("rms_norm", False), ("rms_norm", True), ("silu_mul", False)):
                x = torch.randn(m, 2 * k if mode == "silu_mul" else k) * 3
                x[0] *= 1e-5  # tiny values: E4M3 subnormals after scaling
                if m > 3:
                    x[1] = 0  # an all-zero row (residual-free modes: s = 1e-12 / 448, q = 0)
                x = x.to(dt)
                w = (torch.rand(k) + 0.5) if mode == "rms_norm" else None
                r = torch.randn(m, k).to(dt) if with_res else None
                r_in = r.clone() if with_res else None
                # the new residual written in place over the old one (vLLM's fused_add_rms_norm does so)
                q, s, y, ro = kfp8.act_quant(x, mode, w, 1e-6, r, write_y=True, residual_out=r)
                res = check(x, mode, w, r_in, q, s, y, ro)
                out.append(dict(kind="quant", m=m, k=k, dtype=str(dt), mode=mode, residual=with_res, **res))
    # the whole FP8 linear: kernel quantisation + reference matmul vs the NVFP4 policy's float64 output
    for m, n, k in ((7, 192, 512), (1, 64, 8192 + 256)):
        qw = quantize(torch.randn(n, k))
        w8, ws = fp8.fp8_weight(qw.packed, qw.scale, qw.global_scale)
        bias = torch.randn(n)
        x = torch.randn(m, k, dtype=torch.float16)
        q, s, _, _ = kfp8.act_quant(x)
        y = fp8.scaled_linear_reference(q, s, w8, ws, bias, torch.float32)
        wd = dequantize(qw.packed, qw.scale, qw.global_scale, torch.float64)
        ref = x.double() @ wd.T + bias.double()
        exact = (q.double() * s.double()) @ (w8.double() * ws.double()[:, None]).T + bias.double()
        out.append(dict(kind="linear", m=m, n=n, k=k, rel=((y.double() - ref).norm() / ref.norm()).item(),
                        rel_exact=((y.double() - exact).norm() / exact.norm()).item(), nan=bool(torch.isnan(y).any())))
    print("RESULT" + json.dumps(out))
    """
)


def test_act_quant_kernel_and_fp8_linear_under_triton_interpreter():
    results = run_under_interpreter(_INTERP_SCRIPT, timeout=600, extra_path=[SRC])
    assert len(results) == 3 * 2 * 4 + 2
    for r in results:
        if r["kind"] == "quant":
            assert r["s_rel"] < 1e-5, r
            assert r["q_miss"] < 2e-3 and r["q_far"] == 0, r
            assert r["over_bound"] == 0, r
            assert r["y_rel"] < (1e-3 if r["dtype"] == "torch.float16" else 1e-5), r
            assert r["ro_equal"], r
        else:  # E4M3 on both operands: ≈ 0.04 relative (the 0.040); float32 products: 1e-6
            assert not r["nan"] and r["rel"] < 0.06 and r["rel_exact"] < 1e-5, r


def test_plain_mode_is_bit_exact_against_the_reference_under_the_interpreter():
    """Plain and SiLU-free rows: the kernel's scale and E4M3 rounding equal PyTorch's cast bit for bit (the
    interpreter's own float → fp8 cast is wrong: the kernel rounds in float32 first, ``_round_e4m3``)."""
    script = textwrap.dedent(
        """
        import json, torch
        from nvfp4 import fp8
        from nvfp4.kernels import fp8 as kfp8
        torch.manual_seed(7)
        x = torch.randn(9, 1000) * torch.logspace(-8, 3, 9)[:, None]
        q, s, _, _ = kfp8.act_quant(x)
        rq, rs, _, _ = fp8.act_quant_reference(x)
        print("RESULT" + json.dumps([torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), torch.equal(s, rs)]))
        """
    )
    assert run_under_interpreter(script, timeout=300, extra_path=[SRC]) == [True, True]


def test_fp8_weight_from_nvfp4_layouts_and_bound():
    torch.manual_seed(3)
    w = torch.randn(320, 768) * torch.logspace(-3, 1, 320)[:, None]
    w[5] = 0  # an all-zero row
    q = quantize(w)
    w8, ws = fp8.fp8_weight(q.packed, q.scale, q.global_scale, rows_per_chunk=128)
    w8m, wsm = fp8.fp8_weight(to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale, rows_per_chunk=64)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (320, 768) and ws.shape == (320,)
    assert torch.equal(w8.view(torch.uint8), w8m.view(torch.uint8)) and torch.equal(ws, wsm)
    wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
    deq = w8.double() * ws.double()[:, None]
    bound = (wd.abs() * 2.0**-4 + ws.double()[:, None] * 2.0**-10) * (1 + 1e-6)
    assert ((deq - wd).abs() <= bound).all()
    assert (w8[5].float() == 0).all()
    rel = ((deq - wd).norm() / wd.norm()).item()
    assert 0.01 < rel < 0.04, rel  # E4M3's 3 mantissa bits: ≈ 0.028 on Gaussian rows


def test_ops_schemas_fakes_and_cpu_reference_path():
    torch.manual_seed(0)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w = torch.rand(256) + 0.5
    r = torch.randn(3, 256, dtype=torch.bfloat16)
    # opcheck's test_schema compares outputs with ops that have no float8 CPU kernel ("mul_cpu_reduced_float"): the
    # fakes, the dispatcher registration and AOT dispatch are checked; aliasing is checked by the op itself
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    for args in ((x, "plain", None, 1e-6, None, False), (x, "rms_norm", w, 1e-6, r, True),
                 (torch.cat([x, x], -1), "silu_mul", None, 1e-6, None, True)):  # fmt: skip
        torch.library.opcheck(torch.ops.nvfp4.fp8_act_quant.default, args, test_utils=utils)
    q = quantize(torch.randn(64, 256))
    w8, ws = fp8.fp8_weight(q.packed, q.scale, q.global_scale)
    qx, sx, _, _ = fp8.act_quant(x)
    bias = torch.randn(64, dtype=torch.bfloat16)
    torch.library.opcheck(
        torch.ops.nvfp4.fp8_scaled_linear.default, (qx, sx, w8, ws, bias, torch.bfloat16), test_utils=utils
    )
    # leading dims, the residual out, and torch.compile(fullgraph) through both ops
    x3 = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    q3, s3, y3, ro3 = fp8.act_quant(x3, "rms_norm", w, 1e-6, torch.zeros_like(x3), write_y=True)
    assert q3.shape == (2, 3, 256) and s3.shape == (2, 3, 1) and y3.shape == (2, 3, 256) and torch.equal(ro3, x3)
    fn = torch.compile(lambda t: fp8.fp8_linear(t, w8, ws, bias), fullgraph=True, backend="eager")
    assert torch.equal(fn(x3), fp8.fp8_linear(x3, w8, ws, bias))
    with pytest.raises(ValueError):
        fp8.act_quant(x, "rms_norm")  # no norm weight
    with pytest.raises(ValueError):
        fp8.act_quant(x, "plain", residual=r)


@pytest.mark.parametrize("k,mode,residual,write_y", [(3584, "rms_norm", True, True), (3584, "rms_norm", False, False),
                                                     (3584, "plain", False, False), (18944, "silu_mul", False, False),
                                                     (5120, "rms_norm", True, False)])  # fmt: skip
def test_act_quant_compiles_for_sm90a(k, mode, residual, write_y):
    """CI's build check (Triton's compiler for sm_90a, no GPU): the fp32 → E4M3 pack instruction, 128-bit loads of
    the row, no division in the rounding, no spills."""
    import triton
    from nvfp4.kernels import fp8 as kfp8

    compiled = kfp8.compile_sm90(k, mode, residual, write_y)
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = Path(d) / "k.cubin", Path(d) / "k.ptx"
        cubin.write_bytes(compiled.asm["cubin"])
        ptx.write_text(compiled.asm["ptx"])
        sass = subprocess.run(
            [bin_dir / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
        ptxas = subprocess.run([bin_dir / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", Path(d) / "again.cubin"],
                               capture_output=True, text=True, check=True)  # fmt: skip
    log = ptxas.stdout + ptxas.stderr
    assert "0 bytes spill stores" in log and "LDL" not in sass and "STL" not in sass, log
    assert "F2FP.SATFINITE.E4M3.F32.PACK_AB" in sass
    assert "LDG.E.128" in sass
    if mode != "silu_mul":  # per-row scalars only (1 / sqrt, 448 / amax): the E4M3 rounding multiplies, never divides
        assert sass.count("MUFU.RCP") <= 3, sass.count("MUFU.RCP")


# --------------------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
def test_act_quant_kernel_bf16_against_the_reference_gpu():
    from nvfp4.kernels import fp8 as kfp8

    ns: dict = {}
    exec(_CHECKS, ns)  # noqa: S102 - the same checks as the interpreter script
    kfp8.POISON_OUTPUTS = True
    gen = torch.Generator().manual_seed(11)
    try:
        for k in (3584, 18944, 5120, 8192 + 272, 96):
            m = int(torch.randint(1, 300, (1,), generator=gen)) | 1
            for mode, with_res in (("plain", False), ("rms_norm", False), ("rms_norm", True), ("silu_mul", False)):
                x = (torch.randn(m, 2 * k if mode == "silu_mul" else k, generator=gen) * 3).cuda().bfloat16()
                w = (torch.rand(k, generator=gen) + 0.5).cuda().bfloat16() if mode == "rms_norm" else None
                r = torch.randn(m, k, generator=gen).cuda().bfloat16() if with_res else None
                q, s, y, ro = kfp8.act_quant(x, mode, w, 1e-6, r, write_y=True)
                res = ns["check"](x, mode, w, r, q, s, y, ro)
                assert res["s_rel"] < 1e-5 and res["q_far"] == 0 and res["q_miss"] < 2e-3, (k, mode, res)
                assert res["over_bound"] == 0 and res["ro_equal"] and res["y_rel"] < 1e-2, (k, mode, res)
    finally:
        kfp8.POISON_OUTPUTS = False


@pytest.mark.gpu
@cuda
def test_scaled_mm_rowwise_and_fp8_linear_against_the_nvfp4_policy_gpu():
    """``torch._scaled_mm`` row-wise (odd M, bias) equals the float32 reference matmul; the whole FP8 linear stays
    within 0.06 of the NVFP4 policy's float64 output (the 7B shapes as vLLM fuses them)."""
    gen = torch.Generator().manual_seed(5)
    for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (272, 528)):
        qw = quantize((torch.randn(n, k, generator=gen) * 0.02).cuda())
        mma = mma_layout_supported(n, k)  # as NVFP4Linear holds it
        packed, scale = (to_mma_layout(qw.packed), to_scale_mma_layout(qw.scale)) if mma else (qw.packed, qw.scale)
        w8, ws = fp8.fp8_weight(packed, scale, qw.global_scale)
        wd = dequantize(qw.packed, qw.scale, qw.global_scale, torch.float64)
        bias = torch.randn(n, generator=gen).cuda().bfloat16()
        for m in (1, 7, 64, 129, 1024):
            x = torch.randn(m, k, generator=gen).cuda().bfloat16()
            q, s, _, _ = fp8.act_quant(x)
            y = fp8.scaled_linear(q, s, w8, ws, bias)
            ref = fp8.scaled_linear_reference(q, s, w8, ws, bias, torch.float32).double()
            assert y.dtype == torch.bfloat16 and not torch.isnan(y).any()
            assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3, (n, k, m)  # bf16 output rounding
            pol = x.double() @ wd.T + bias.double()
            rel = ((fp8.fp8_linear(x, w8, ws, bias).double() - pol).norm() / pol.norm()).item()
            assert rel < 0.06, (n, k, m, rel)


@pytest.mark.gpu
@cuda
def test_fused_quant_and_scaled_mm_replay_in_a_cuda_graph_gpu():
    torch.manual_seed(2)
    qw = quantize(torch.randn(4608, 3584, device="cuda") * 0.02)
    w8, ws = fp8.fp8_weight(qw.packed, qw.scale, qw.global_scale)
    x = torch.randn(33, 3584, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(3584, device="cuda", dtype=torch.bfloat16) + 0.5

    def step():
        q, s, _, _ = fp8.act_quant(x, "rms_norm", norm_w, 1e-6)
        return fp8.scaled_linear(q, s, w8, ws)

    eager = step()
    graph, out = capture(step)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step()) and not torch.equal(out, eager)
