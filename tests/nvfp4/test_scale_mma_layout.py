"""Landing step A, stage 1: ``weight_scale`` in :func:`nvfp4.layout.to_scale_mma_layout`'s order (``[N/64, 4K]``)
beside an MMA-layout ``weight_packed`` (on by default since stage 2; ``NVFP4_SCALE_MMA_LAYOUT=0`` keeps ``[N, K/16]``;
docs/kernels.md, "Landing step A"). Every reader given the new order equals the same reader given ``[N, K/16]`` scales on the same weights."""

from __future__ import annotations

import pytest
import torch
from nvfp4.codec import dequantize, quantize
from nvfp4.fp8 import fp8_weight
from nvfp4.layout import (
    from_scale_mma_layout,
    is_mma_layout,
    scale_in_ct_layout,
    scale_is_mma_layout,
    scale_mma_layout_enabled,
    to_mma_layout,
    to_scale_mma_layout,
    weight_shape,
)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-equal (fp8 has no ``torch.equal`` on the CPU)."""
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _weight(n: int = 128, k: int = 512, seed: int = 0):
    torch.manual_seed(seed)
    return quantize(torch.randn(n, k))


def test_switch_is_on_by_default(monkeypatch):
    monkeypatch.delenv("NVFP4_SCALE_MMA_LAYOUT", raising=False)
    assert scale_mma_layout_enabled()
    monkeypatch.setenv("NVFP4_SCALE_MMA_LAYOUT", "0")
    assert not scale_mma_layout_enabled()
    monkeypatch.setenv("NVFP4_SCALE_MMA_LAYOUT", "1")
    assert scale_mma_layout_enabled()


def test_shapes_of_the_three_accepted_pairs():
    q = _weight(192, 768)
    pm, sm = to_mma_layout(q.packed), to_scale_mma_layout(q.scale)
    assert tuple(sm.shape) == (3, 4 * 768)
    for packed, scale, mma, smma in (
        (q.packed, q.scale, False, False),
        (pm, q.scale, True, False),
        (pm, sm, True, True),
    ):
        assert weight_shape(packed, scale) == (192, 768)
        assert is_mma_layout(packed, scale) is mma
        assert scale_is_mma_layout(packed, scale) is smma
        assert _same(scale_in_ct_layout(packed, scale), q.scale)
    # the shape rule works on meta tensors too (the torch.compile fakes)
    assert weight_shape(pm.to("meta"), sm.to("meta")) == (192, 768)


def test_wrong_pairs_refused():
    q = _weight(128, 512)
    sm = to_scale_mma_layout(q.scale)
    with pytest.raises(ValueError, match="NVFP4 tensors disagree"):
        is_mma_layout(q.packed, sm)  # compressed-tensors packed with step A's scales
    with pytest.raises(ValueError, match="NVFP4 tensors disagree"):
        is_mma_layout(to_mma_layout(q.packed), sm[:1])  # one tile of scales for two tiles of codes
    with pytest.raises(ValueError, match="NVFP4 tensors disagree"):
        dequantize(q.packed, sm, q.global_scale)


def test_prmt_selectors_replay_the_byte_formula():
    """The 8 bytes at (t, j, w, q) of the new order, read as one int64 (lo, hi), give today's int32 scale words of
    rows r = 64t + 16w + q and r + 8 through ``prmt(lo, hi, 0x6420)`` / ``prmt(lo, hi, 0x7531)``."""
    torch.manual_seed(1)
    n, k = 128, 512
    scale = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8)
    new = to_scale_mma_layout(scale.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1)
    g16 = k // 16
    ct_words = scale.view(torch.int32)  # [N, K/64]: word j of row n = scales 4j..4j+3

    def prmt(lo: int, hi: int, sel: int) -> int:
        b = [(lo >> 8 * i) & 0xFF for i in range(4)] + [(hi >> 8 * i) & 0xFF for i in range(4)]
        return sum(b[(sel >> 4 * i) & 7] << 8 * i for i in range(4))

    for t in range(n // 64):
        for j in range(g16 // 4):
            for w in range(4):
                for q in range(8):
                    base = t * 64 * g16 + j * 256 + w * 64 + q * 8
                    assert all(
                        new[base + gg * 2 + h] == scale[64 * t + 16 * w + q + 8 * h, 4 * j + gg]
                        for gg in range(4)
                        for h in range(2)
                    )
                    lo = int.from_bytes(bytes(new[base : base + 4].tolist()), "little")
                    hi = int.from_bytes(bytes(new[base + 4 : base + 8].tolist()), "little")
                    r = 64 * t + 16 * w + q
                    assert prmt(lo, hi, 0x6420) == int(ct_words[r, j]) & 0xFFFFFFFF
                    assert prmt(lo, hi, 0x7531) == int(ct_words[r + 8, j]) & 0xFFFFFFFF


def test_codec_dequantize_and_fp8_copy_equal_in_both_orders():
    q = _weight(320, 768, seed=2)
    pm, sm = to_mma_layout(q.packed), to_scale_mma_layout(q.scale)
    ref = dequantize(q.packed, q.scale, q.global_scale, torch.float32)
    assert torch.equal(dequantize(pm, sm, q.global_scale, torch.float32), ref)
    w8, s8 = fp8_weight(q.packed, q.scale, q.global_scale, rows_per_chunk=128)
    w8m, s8m = fp8_weight(pm, sm, q.global_scale, rows_per_chunk=128)  # chunks of 2 tiles, the last one of 1
    assert _same(w8m, w8) and torch.equal(s8m, s8)
    assert _same(from_scale_mma_layout(sm), q.scale)


def test_torch_compile_fakes_take_the_shape_from_the_helper():
    from nvfp4 import ops

    q = _weight(128, 256)
    pm, sm = to_mma_layout(q.packed).to("meta"), to_scale_mma_layout(q.scale).to("meta")
    x = torch.empty(3, 256, device="meta")
    assert tuple(ops._linear_fake(x, pm, sm).shape) == (3, 128)
    dy = torch.empty(3, 128, device="meta")
    assert tuple(torch.ops.nvfp4.linear_dgrad.default(dy, pm, sm, q.global_scale.to("meta")).shape) == (3, 256)


def _mma_both(layer):
    """``layer`` as CUDA holds it with the switch on: MMA packed and step A's scale order (set by hand on the CPU)."""
    layer.weight_scale = to_scale_mma_layout(layer.weight_scale)  # before packed: the old pair gives the CT scale
    layer.weight_packed = to_mma_layout(layer.weight_packed)
    assert layer.mma_layout and scale_is_mma_layout(layer.weight_packed, layer.weight_scale)
    return layer


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_module_forward_state_dict_load_and_caches(fmt):
    """An NVFP4Linear holding both MMA orders computes the CT layer's outputs (bias, odd M), saves and loads the
    checkpoint layout (``[N, K/16]`` scales on disk), and its dequantized caches are the CT layer's."""
    import nvfp4
    from nvfp4 import NVFP4Linear
    from torch import nn

    torch.manual_seed(3)
    lin = nn.Linear(512, 128, bias=True)
    ref = NVFP4Linear.from_linear(lin, format=fmt)
    mod = _mma_both(NVFP4Linear.from_linear(lin, format=fmt))
    x = torch.randn(5, 512)
    assert torch.equal(mod(x), ref(x)) and torch.equal(mod.dequantize(), ref.dequantize())
    assert _same(mod.nvfp4_weight.scale, ref.weight_scale) and mod.nvfp4_weight.shape == (128, 512)
    sd, sd_ref = mod.state_dict(), ref.state_dict()
    assert sd.keys() == sd_ref.keys() and all(_same(sd[k], sd_ref[k]) for k in sd)
    for compact in (False, True):
        with nvfp4.cache_dequantized(mod, torch.float32, compact=compact):
            assert torch.equal(mod(x), ref(x))
    if fmt == "nvfp4":  # a checkpoint loads into a layer holding both MMA orders
        other = _mma_both(NVFP4Linear(512, 128, bias=True))
        other.load_state_dict(sd_ref)
        assert _same(other.weight_scale, mod.weight_scale) and torch.equal(other.weight_packed, mod.weight_packed)
        bad = {k: v.clone() for k, v in sd_ref.items()}  # a zero scale: back to the CT layout, both tensors
        bad["weight_scale"].view(torch.uint8)[7, 3] = 0
        with pytest.warns(UserWarning, match="compressed-tensors layout"):
            other.load_state_dict(bad)
        assert not other.mma_layout and _same(other.weight_scale, bad["weight_scale"])


def _fsdp_worker(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: a 192-output layer holding both MMA orders (3 scale rows: uneven 64-row-tile shards),
    sharded by FSDP2; its gathered weight, output and input gradient against the unsharded CT layer."""
    import json
    import os

    import torch.distributed as dist
    from nvfp4 import NVFP4Linear
    from nvfp4.fsdp import fully_shard_quantized, gathered_quantized_weight
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(6)
        lin = nn.Linear(256, 192, bias=True)
        ref = NVFP4Linear.from_linear(lin)
        model = nn.Sequential(_mma_both(NVFP4Linear.from_linear(lin)))
        mesh = init_device_mesh("cpu", (2,))
        fully_shard_quantized(model, mesh=mesh)
        fully_shard(model, mesh=mesh)
        w = gathered_quantized_weight(model[0])
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2), requires_grad=True)
        (g,) = torch.autograd.grad(model(x).square().sum(), x)
        xr = x.detach().clone().requires_grad_(True)
        (gr,) = torch.autograd.grad(ref(xr).square().sum(), xr)
        result = {"weight": torch.equal(w.packed, ref.weight_packed) and _same(w.scale, ref.weight_scale),
                  "grad": torch.equal(g, gr), "scale_rows": model[0].stored("weight_scale").to_local().shape[0]}  # fmt: skip
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        from ports import end_process_group

        end_process_group()


def test_fsdp2_shards_of_step_a_scales_gather_and_compute_as_the_ct_layer(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(out.read_text()) == {"weight": True, "grad": True, "scale_rows": 2}


def test_fsdp_gather_of_an_unsharded_shardable_layer():
    from nvfp4 import NVFP4Linear
    from nvfp4.fsdp import gathered_quantized_weight, make_shardable
    from torch import nn

    torch.manual_seed(4)
    lin = nn.Linear(256, 192, bias=False)
    ref = NVFP4Linear.from_linear(lin)
    conv = make_shardable(_mma_both(NVFP4Linear.from_linear(lin)))
    w = gathered_quantized_weight(conv)
    assert torch.equal(w.packed, ref.weight_packed) and _same(w.scale, ref.weight_scale)
    x = torch.randn(3, 256)
    assert torch.equal(conv(x), ref(x))


_INTERP_SCRIPT = """
import json
import torch
from nvfp4.codec import quantize
from nvfp4.kernels import LinearConfig, dequantize_triton, nvfp4_gemm, nvfp4_linear, nvfp4_linear_dgrad, nvfp4_lora_linear
from nvfp4.layout import to_mma_layout, to_scale_mma_layout

nvfp4_gemm.POISON_OUTPUTS = True
torch.manual_seed(97)
out = []

def same(a, b):
    return bool(a.shape == b.shape and not torch.isnan(a).any() and torch.equal(a, b))

def weights(n, k):
    q = quantize(torch.randn(n, k))
    packed = to_mma_layout(q.packed)
    return (packed, q.scale, q.global_scale), (packed, to_scale_mma_layout(q.scale), q.global_scale)

def mma(m, split):
    return LinearConfig(block_m=m, block_n=64, block_k=256, split_k=split, num_stages=1, mma=True)

def large(bm, tiles, quarters, split=1):
    return LinearConfig(block_m=bm, block_n=64 * tiles, block_k=64 * quarters, split_k=split, num_warps=4,
                        num_stages=1, group_m=2, mma=True, large_m=True)

# decode kernel (split-K, row blocks), large-M (several tiles, tiles past N, K quarters, split-K): bias, odd M
for m, n, k, cfg in [(3, 128, 512, mma(16, 2)), (20, 64, 512, mma(16, 1)), (37, 192, 512, large(32, 2, 2)),
                     (5, 64, 768, large(16, 1, 4, 2))]:
    ct, pairs = weights(n, k)
    x = torch.randn(m, k, dtype=torch.float16)
    b = torch.randn(n, dtype=torch.float16)
    out.append(dict(kind="linear", m=m, cfg=str(cfg), same=same(nvfp4_linear(x, *pairs, b, config=cfg),
                                                               nvfp4_linear(x, *ct, b, config=cfg))))
# fused LoRA in the decode kernel (x·Aᵀ shared by the tiles of a split) and in the large-M epilogue
for m, n, k, cfg in [(3, 128, 512, mma(16, 2)), (9, 128, 512, large(16, 2, 1))]:
    ct, pairs = weights(n, k)
    x = torch.randn(m, k, dtype=torch.float16)
    a, bb = torch.randn(8, k) / k**0.5, torch.randn(n, 8)
    y = [nvfp4_lora_linear(x, *w, None, a, bb, 0.5, config=cfg) for w in (ct, pairs)]
    out.append(dict(kind="lora", m=m, cfg=str(cfg), same=same(y[1], y[0])))
# dgrad (several 64-row tiles of W), dequantize (fp16, fp32)
ct, pairs = weights(192, 512)
dy = torch.randn(19, 192, dtype=torch.float16)
out.append(dict(kind="dgrad", same=same(nvfp4_linear_dgrad(dy, *pairs), nvfp4_linear_dgrad(dy, *ct))))
for dt in (torch.float16, torch.float32):
    out.append(dict(kind="dequant", dtype=str(dt), same=same(dequantize_triton(*pairs, dt), dequantize_triton(*ct, dt))))
print("RESULT" + json.dumps(out))
"""


def test_mma_kernels_read_either_order_bit_identically_under_triton_interpreter():
    """The decode kernel (split-K, row blocks, fused LoRA), large-M (tiles past N, K quarters, split-K, LoRA), dgrad
    and dequantize: with the scales in step A's order, the same outputs bit for bit as with ``[N, K/16]`` scales."""
    from pathlib import Path

    from triton_interpreter import run_under_interpreter

    src = Path(__file__).resolve().parents[2] / "packages" / "nvfp4" / "src"
    results = run_under_interpreter(_INTERP_SCRIPT, timeout=900, extra_path=[src])
    assert len(results) == 4 + 2 + 1 + 2
    assert all(r["same"] for r in results), [r for r in results if not r["same"]]


def test_ws_dispatch_passes_scale_pairs_from_the_scale_shape(monkeypatch):
    """The dispatch gives hopper_ws ``scale_pairs=True`` exactly when the scales are in step A's order (the kernel
    itself needs a Hopper GPU: its launch is recorded here); ``launch`` refuses a flag that contradicts the shape."""
    pytest.importorskip("triton")
    from nvfp4.kernels import LinearConfig, hopper_ws, nvfp4_gemm

    calls = []
    monkeypatch.setattr(hopper_ws, "launch", lambda *a, **kw: calls.append(kw["scale_pairs"]))
    q = _weight(128, 512)
    packed = to_mma_layout(q.packed)
    cfg = LinearConfig(block_m=64, block_n=128, num_stages=4, mma=True, ws=True)
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    for scale in (q.scale, to_scale_mma_layout(q.scale)):
        nvfp4_gemm._linear_ws(x, packed, scale, q.global_scale, None, None, cfg, None)
    assert calls == [False, True]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="scale_pairs=True but weight_scale is"):
        hopper_ws.launch(x, packed, q.scale, q.global_scale, None, x, None, scale_pairs=True)


def _sm90_sass(fn, signature: dict, constexprs: dict, warps: int, stages: int) -> tuple[str, str]:
    """(cuobjdump resource line, SASS) of ``fn`` compiled for sm_90a on the CPU (benchmarks/kernel_sass.py's helper)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_sass.py"
    spec = importlib.util.spec_from_file_location("kernel_sass", path)
    ks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ks)
    compiled = ks.compile_sm90(fn, ks._COMMON | signature, constexprs, warps, stages)
    line, _ = ks.sass_summary(compiled)
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([ks.BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    return line, sass


@pytest.mark.parametrize("block_m, stages", [(16, 3), (64, 2)])
def test_mma_decode_kernel_in_step_a_order_compiles_for_sm90_without_spills(block_m, stages):
    """The decode kernel (FAST: the ``prmt`` PTX) with the scales in step A's order builds for sm_90a with no stack
    and no local memory; its scale load stays ``cp.async``, 8 bytes a thread (``LDGSTS.E.64``, half as many as the
    int32 words' ``LDGSTS.E``), and the kernel has at most 1 % more instructions than the ``[N, K/16]`` build."""
    pytest.importorskip("triton")
    import re

    from nvfp4.kernels import nvfp4_gemm

    fn = nvfp4_gemm.JIT_KERNELS["linear_mma"]
    const = dict(HAS_BIAS=False, USE_WS=False, FAST=True, HAS_LORA=False, BLOCK_R=16, FUSED_REDUCE=False,
                 SHARED_T=False, BLOCK_M=block_m)  # fmt: skip
    counts = {}
    for pairs in (False, True):
        line, sass = _sm90_sass(fn, {}, const | dict(SCALE_PAIRS=pairs), 4, stages)
        assert "STACK:0" in line and "LOCAL:0" in line, line
        ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)
        counts[pairs] = (sum(op != "NOP" for op in ops), ops.count("LDGSTS.E"), ops.count("LDGSTS.E.64"))
    (ct, ct_words, _), (new, new_words, new_pairs) = counts[False], counts[True]
    assert new_words == 0 and 2 * new_pairs == ct_words, counts
    assert new <= 1.01 * ct, counts  # (fewer since its wgmmas stay in flight: no per-wgmma waits, see below)


@pytest.mark.parametrize(
    "label, extra",
    [("M<=16", dict(BLOCK_M=16)), ("M<=64", dict(BLOCK_M=64)),
     ("M<=16, fused LoRA, x.A^T once per split", dict(BLOCK_M=16, HAS_LORA=True, BLOCK_R=32, SHARED_T=True)),
     ("M<=16, split-K summed in the kernel, fused LoRA", dict(BLOCK_M=16, USE_WS=True, FUSED_REDUCE=True,
                                                              HAS_LORA=True, BLOCK_R=32, SHARED_T=True))],
)  # fmt: skip
def test_mma_decode_kernel_in_step_a_order_keeps_its_wgmmas_in_flight(label, extra):
    """ptxas serialises every wgmma (C7515) when a non-wgmma instruction defines an accumulator register inside the
    pipeline: the loop's zero-trip path (``acc = 0``) laid out after the loop did that in step A's order until the
    kernel told LLVM that every split has work (``tl.assume``). Checked with ``ptxas -v`` on the sm_90a PTX."""
    pytest.importorskip("triton")
    import importlib.util
    import subprocess
    import tempfile
    from pathlib import Path

    from nvfp4.kernels import nvfp4_gemm

    spec = importlib.util.spec_from_file_location("kernel_sass", Path(__file__).resolve().parents[2] / "benchmarks"
                                                  / "kernel_sass.py")  # fmt: skip
    ks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ks)
    const = dict(HAS_BIAS=False, USE_WS=False, FAST=True, HAS_LORA=False, BLOCK_R=16, FUSED_REDUCE=False,
                 SHARED_T=False, SCALE_PAIRS=True) | extra  # fmt: skip
    sig = ks._COMMON | ({"y_ptr": "*fp32"} if extra.get("USE_WS") else {})
    compiled = ks.compile_sm90(nvfp4_gemm.JIT_KERNELS["linear_mma"], sig, const, 4, 3 if const["BLOCK_M"] == 16 else 2)
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        out = subprocess.run([ks.BIN / "ptxas", "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                             text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "C7515" not in out.stdout + out.stderr, (label, out.stdout + out.stderr)


@pytest.mark.parametrize("block_m, stages", [(16, 3), (32, 3), (64, 2)])
def test_step_a_order_with_lora_beside_every_tile_keeps_the_registers_of_the_shipped_build(block_m, stages):
    """x·Aᵀ accumulated beside every tile (``HAS_LORA`` without ``SHARED_T``: the 7B q/o/k/v at M <= 16) keeps
    ptxas's serialised wgmmas in step A's order too: in flight they held both register-A operands live, 255
    registers and spills from BLOCK_M = 32 (H100 at 4e1d05a: q/o 20-25 % slower at M <= 16, 2 CTAs per SM instead
    of 3). No stack, and the registers of the ``[N, K/16]`` build within 4."""
    pytest.importorskip("triton")
    import re

    from nvfp4.kernels import nvfp4_gemm

    fn = nvfp4_gemm.JIT_KERNELS["linear_mma"]
    const = dict(HAS_BIAS=False, USE_WS=True, FAST=True, HAS_LORA=True, BLOCK_R=32, FUSED_REDUCE=block_m <= 32,
                 SHARED_T=False, BLOCK_M=block_m)  # fmt: skip
    regs = {}
    for pairs in (False, True):
        line, _ = _sm90_sass(fn, {"y_ptr": "*fp32"}, const | dict(SCALE_PAIRS=pairs), 4, stages)
        assert "STACK:0" in line and "LOCAL:0" in line, (pairs, line)
        regs[pairs] = int(re.search(r"REG:(\d+)", line).group(1))
    assert regs[True] <= regs[False] + 4, regs


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 33, 64, 200, 512, 2000])
def test_both_orders_on_the_gpu(m):
    """bf16 on CUDA (the ``prmt`` fast path; on Hopper the ws kernel with ``scale_pairs`` at M = 64-512): forward and
    input gradient with step A's scales equal the ``[N, K/16]`` ones on the same weights (bit for bit where the same
    kernel reads both orders; the ws kernel's step A path within 1e-3 relative)."""
    from nvfp4 import ops

    torch.manual_seed(m)
    n, k = 1024, 2048
    q = quantize(torch.randn(n, k, device="cuda"))
    packed = to_mma_layout(q.packed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ct = (packed, q.scale, q.global_scale)
    pairs = (packed, to_scale_mma_layout(q.scale), q.global_scale)
    y_ct, y = ops.linear(x, *ct, bias), ops.linear(x, *pairs, bias)
    ws = torch.cuda.get_device_capability() == (9, 0) and 64 <= m <= 512
    if ws:
        assert ((y.float() - y_ct.float()).norm() / y_ct.float().norm()).item() < 1e-3
    else:
        assert torch.equal(y, y_ct)
    assert torch.equal(ops.linear_dgrad(dy, *pairs), ops.linear_dgrad(dy, *ct))


@pytest.mark.gpu
def test_nvfp4linear_takes_step_a_scales_on_cuda_with_the_switch(monkeypatch):
    from nvfp4 import NVFP4Linear
    from torch import nn

    torch.manual_seed(5)
    lin = nn.Linear(512, 256, bias=True)
    monkeypatch.setenv("NVFP4_SCALE_MMA_LAYOUT", "0")
    ref = NVFP4Linear.from_linear(lin).cuda()
    monkeypatch.delenv("NVFP4_SCALE_MMA_LAYOUT", raising=False)  # the default: step A's order
    mod = NVFP4Linear.from_linear(lin).cuda()
    assert ref.mma_layout and tuple(ref.weight_scale.shape) == (256, 32)
    assert mod.mma_layout and tuple(mod.weight_scale.shape) == (4, 2048)
    x = torch.randn(7, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(mod.to(torch.bfloat16)(x), ref.to(torch.bfloat16)(x))
    sd, sd_ref = mod.state_dict(), ref.state_dict()
    assert all(_same(sd[k], sd_ref[k]) for k in sd_ref)


if __name__ == "__main__":  # the FSDP2 test's 2 ranks
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ports import free_port

    mp.spawn(_fsdp_worker, args=(free_port(), sys.argv[1]), nprocs=2)
