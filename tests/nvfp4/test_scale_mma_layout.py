"""Landing step A: ``weight_scale`` in :func:`nvfp4.layout.to_scale_mma_layout`'s order (``[N/64, 4K]``) beside an
MMA-layout ``weight_packed``, the only scale order the MMA-layout kernels read since stage 2's end (docs/kernels.md,
"Landing step A"); MMA-layout codes beside ``[N, K/16]`` scales are refused in one line. Every torch reader given the
new order equals the same reader given the compressed-tensors tensors."""

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


def test_the_mixed_pair_is_refused_in_one_line_wherever_it_would_be_read():
    """MMA-layout codes beside ``[N, K/16]`` scales (what ``NVFP4_SCALE_MMA_LAYOUT=0`` held before stage 2's end): the
    layout check, the torch reference, the custom ops, every launcher (the ws kernel's before any GPU work) refuse
    it with one line that names both shapes and the order the scales need."""
    from nvfp4 import ops
    from nvfp4.kernels import dequantize_triton, hopper_ws, nvfp4_linear, nvfp4_linear_dgrad, nvfp4_lora_linear

    q = _weight(128, 512)
    packed = to_mma_layout(q.packed)
    x, dy = torch.randn(3, 512, dtype=torch.bfloat16), torch.randn(3, 128, dtype=torch.bfloat16)
    a, b = torch.randn(4, 512), torch.randn(128, 4)
    calls = {
        "is_mma_layout": lambda: is_mma_layout(packed, q.scale),
        "scale_in_ct_layout": lambda: scale_in_ct_layout(packed, q.scale),
        "codec.dequantize": lambda: dequantize(packed, q.scale, q.global_scale),
        "fp8_weight": lambda: fp8_weight(packed, q.scale, q.global_scale),
        "ops.linear": lambda: ops.linear(x, packed, q.scale, q.global_scale),
        "ops.linear_dgrad": lambda: ops.linear_dgrad(dy, packed, q.scale, q.global_scale),
        "nvfp4_linear": lambda: nvfp4_linear(x, packed, q.scale, q.global_scale),
        "nvfp4_lora_linear": lambda: nvfp4_lora_linear(x, packed, q.scale, q.global_scale, None, a, b, 0.5),
        "nvfp4_linear_dgrad": lambda: nvfp4_linear_dgrad(dy, packed, q.scale, q.global_scale),
        "dequantize_triton": lambda: dequantize_triton(packed, q.scale, q.global_scale),
        "hopper_ws.launch": lambda: hopper_ws.launch(x, packed, q.scale, q.global_scale, None, x, None),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and "(32, 1024) is in the MMA layout" in msg and "(128, 32)" in msg, (name, msg)
        assert "to_scale_mma_layout's order (2, 2048)" in msg, (name, msg)


def test_shapes_of_the_two_accepted_pairs():
    q = _weight(192, 768)
    pm, sm = to_mma_layout(q.packed), to_scale_mma_layout(q.scale)
    assert tuple(sm.shape) == (3, 4 * 768)
    for packed, scale, mma, smma in (
        (q.packed, q.scale, False, False),
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


def test_ws_launch_refuses_compressed_tensors_codes():
    """hopper_ws reads only the MMA layout (step A's scale pairs): a compressed-tensors pair is refused before any
    GPU work, in one line."""
    from nvfp4.kernels import hopper_ws

    q = _weight(128, 512)
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^hopper_ws.launch: needs the MMA layout, got weight_packed \(128, 256\)$"):
        hopper_ws.launch(x, q.packed, q.scale, q.global_scale, None, x, None)


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
    and no local memory; its scale load is ``cp.async``, 8 bytes a thread (``LDGSTS.E.64``; no int32-word
    ``LDGSTS.E`` is left), and the kernel has at most 1 % more instructions than the ``[N, K/16]`` build had before
    stage 2's end deleted it (803 at BLOCK_M = 16, 1,037 at 64: docs/kernels.md, "Stage 1, built")."""
    pytest.importorskip("triton")
    import re

    from nvfp4.kernels import nvfp4_gemm

    fn = nvfp4_gemm.JIT_KERNELS["linear_mma"]
    const = dict(HAS_BIAS=False, USE_WS=False, FAST=True, HAS_LORA=False, BLOCK_R=16, FUSED_REDUCE=False,
                 SHARED_T=False, BLOCK_M=block_m)  # fmt: skip
    line, sass = _sm90_sass(fn, {}, const, 4, stages)
    assert "STACK:0" in line and "LOCAL:0" in line, line
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)
    count, words, pairs = sum(op != "NOP" for op in ops), ops.count("LDGSTS.E"), ops.count("LDGSTS.E.64")
    assert words == 0 and pairs > 0, (words, pairs)
    # (fewer than the [N, K/16] build since its wgmmas stay in flight: no per-wgmma waits, see below)
    assert count <= 1.01 * {16: 803, 64: 1037}[block_m], count


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
                 SHARED_T=False) | extra  # fmt: skip
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
    of 3). No stack, and the registers of the serialised builds (140 / 150 / 192 at 1a9ffb6; the ``[N, K/16]``
    build within 4 of them until stage 2's end deleted it), well below the 255 of the in-flight form."""
    pytest.importorskip("triton")
    import re

    from nvfp4.kernels import nvfp4_gemm

    fn = nvfp4_gemm.JIT_KERNELS["linear_mma"]
    const = dict(HAS_BIAS=False, USE_WS=True, FAST=True, HAS_LORA=True, BLOCK_R=32, FUSED_REDUCE=block_m <= 32,
                 SHARED_T=False, BLOCK_M=block_m)  # fmt: skip
    line, _ = _sm90_sass(fn, {"y_ptr": "*fp32"}, const, 4, stages)
    assert "STACK:0" in line and "LOCAL:0" in line, line
    assert int(re.search(r"REG:(\d+)", line).group(1)) <= {16: 144, 32: 154, 64: 196}[block_m], line


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 33, 64, 200, 512, 2000])
def test_step_a_order_on_the_gpu(m):
    """bf16 on CUDA (the ``prmt`` fast path; on Hopper the ws kernel at M = 64-512): forward and input gradient of
    the MMA layout with step A's scales against the float64 product of the compressed-tensors tensors, and against
    the compressed-tensors kernels on the same weights within bf16 rounding."""
    from nvfp4 import ops

    torch.manual_seed(m)
    n, k = 1024, 2048
    q = quantize(torch.randn(n, k, device="cuda"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    mma = (to_mma_layout(q.packed), to_scale_mma_layout(q.scale), q.global_scale)
    ct = (q.packed, q.scale, q.global_scale)
    wd = dequantize(*ct, torch.float64)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    y, dx = ops.linear(x, *mma, bias), ops.linear_dgrad(dy, *mma)
    assert rel(y, x.double() @ wd.T + bias.double()) < 1e-2 and rel(dx, dy.double() @ wd) < 1e-2
    assert rel(y, ops.linear(x, *ct, bias)) < 1e-2 and rel(dx, ops.linear_dgrad(dy, *ct)) < 1e-2


@pytest.mark.gpu
def test_nvfp4linear_takes_step_a_scales_on_cuda():
    from nvfp4 import NVFP4Linear
    from torch import nn

    torch.manual_seed(5)
    lin = nn.Linear(512, 256, bias=True)
    ref = NVFP4Linear.from_linear(lin)  # the CPU: compressed-tensors layout
    mod = NVFP4Linear.from_linear(lin).cuda()
    assert not ref.mma_layout and tuple(ref.weight_scale.shape) == (256, 32)
    assert mod.mma_layout and tuple(mod.weight_scale.shape) == (4, 2048)
    x = torch.randn(7, 512, dtype=torch.bfloat16)
    y, y_ref = mod.to(torch.bfloat16)(x.cuda()).cpu().double(), ref.to(torch.bfloat16)(x).double()
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 1e-2
    sd, sd_ref = mod.state_dict(), ref.state_dict()
    assert sd.keys() == sd_ref.keys() and all(_same(sd[k].cpu(), sd_ref[k]) for k in sd_ref)


if __name__ == "__main__":  # the FSDP2 test's 2 ranks
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ports import free_port

    mp.spawn(_fsdp_worker, args=(free_port(), sys.argv[1]), nprocs=2)
