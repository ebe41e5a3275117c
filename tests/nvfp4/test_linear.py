"""NVFP4Linear and the nvfp4::linear ops: reference equality, autograd to the input, torch.compile, bad input."""

from __future__ import annotations

import warnings

import nvfp4
import pytest
import torch
from nvfp4 import NVFP4Linear, quantize_model
from nvfp4.formats import FORMATS
from nvfp4.ops import linear_dgrad_reference, linear_reference
from torch import nn


def rel_err(a, b):
    assert not torch.isnan(a).any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_matches_float64_reference(dtype, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias)
    q = NVFP4Linear.from_linear(lin)
    x = torch.randn(3, 7, 96).to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (3, 7, 40)
    ref = x.double() @ q.dequantize(torch.float64).T + (lin.bias.double() if bias else 0)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    assert rel_err(y, ref) < tol


def test_backward_reaches_input_only():
    torch.manual_seed(0)
    q = NVFP4Linear.from_linear(nn.Linear(64, 32))
    x = torch.randn(5, 64, requires_grad=True)
    q(x).square().sum().backward()
    w = q.dequantize(torch.float64)
    expected = (2 * (x.double() @ w.T + q.bias.double())) @ w
    assert rel_err(x.grad, expected) < 1e-6
    assert all(not p.requires_grad for p in q.parameters())
    assert torch.equal(linear_dgrad_reference(torch.ones(2, 32), q.weight_packed, q.weight_scale, q.weight_global_scale),
                       torch.ones(2, 32) @ q.dequantize(torch.float32))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    q = NVFP4Linear.from_linear(nn.Linear(64, 48, bias=True))
    x = torch.randn(4, 64)
    compiled = torch.compile(q, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), q(x))
    args = (x.requires_grad_(), q.weight_packed, q.weight_scale, q.weight_global_scale, None)
    torch.library.opcheck(torch.ops.nvfp4.linear.default, args,
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_weight_is_packed_and_float_use_fails_loudly():
    q = NVFP4Linear.from_linear(nn.Linear(32, 8))
    assert q.weight.dtype == torch.uint8 and q.weight.shape == (8, 16)
    with pytest.raises(RuntimeError):
        q.weight.data += torch.randn(8, 16)  # what a naive LoRA merge would do


def test_bad_inputs():
    q = NVFP4Linear.from_linear(nn.Linear(32, 8))
    with pytest.raises(ValueError, match="input features"):
        q(torch.randn(2, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Linear(24, 8)


@pytest.mark.parametrize("format", FORMATS)
def test_integer_inputs_are_refused_not_computed_in_integers(format):
    """An integer ``x`` (token ids passed to the wrong module) dequantized the weight to that integer dtype, which
    truncates every 4-bit value below 1 to 0: the layer returned zeros (or truncated sums) instead of failing."""
    torch.manual_seed(0)
    q = NVFP4Linear.from_linear(nn.Linear(64, 8), format=format)
    ids = torch.randint(0, 4, (2, 64))
    with pytest.raises(ValueError, match="floating-point"):
        q(ids)
    with pytest.raises(ValueError, match="floating-point"):
        nvfp4.linear(ids, q.weight_packed, q.weight_scale, q.weight_global_scale)
    if format == "mxfp4":  # the plain reference an MXFP4 layer without an NVFP4 transcode computes with
        w = q.quantized_weight
        with pytest.raises(ValueError, match="floating-point"):
            nvfp4.mxfp4.linear_reference(ids, w.packed, w.scale)


def test_from_weight_refuses_tensors_the_format_does_not_hold():
    """``NVFP4Linear.from_weight`` took any tensors: a 0-dim or bf16 global scale computed, then was saved as such
    (compressed-tensors and our loader read float32 ``[1]``), and float32 block scales made the layer say "MXFP4
    tensors without an NVFP4 transcode" at its first forward. Now one line naming the tensor, at construction."""
    torch.manual_seed(0)
    w = nvfp4.quantize(torch.randn(20, 48))
    bad = {
        "weight_global_scale": nvfp4.NVFP4Weight(w.packed, w.scale, w.global_scale.reshape(())),
        "weight_global_scale ": nvfp4.NVFP4Weight(w.packed, w.scale, w.global_scale.bfloat16()),
        "weight_scale": nvfp4.NVFP4Weight(w.packed, w.scale.float(), w.global_scale),
    }
    for tensor, weight in bad.items():
        with pytest.raises(ValueError, match=rf"NVFP4Linear.from_weight\(proj\): {tensor.strip()}: ") as info:
            NVFP4Linear.from_weight(weight, name="proj")
        assert len(str(info.value).splitlines()) == 1
    assert NVFP4Linear.from_weight(w).weight_global_scale.shape == (1,)


def test_load_state_dict_checks_shapes():
    q = NVFP4Linear.from_linear(nn.Linear(32, 8))
    other = NVFP4Linear(64, 8)
    with pytest.raises(ValueError, match="weight_packed: checkpoint has"):
        other.load_state_dict(q.state_dict())


def test_quantize_model_shares_global_scale_in_fused_groups():
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"))  # qwen2: q/k/v with bias
    quantize_model(model, progress=False)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_proj, NVFP4Linear) and attn.q_proj.bias is not None
    assert attn.q_proj.weight_global_scale.item() == attn.k_proj.weight_global_scale.item() == attn.v_proj.weight_global_scale.item()
    assert attn.q_proj.weight_global_scale.data_ptr() != attn.k_proj.weight_global_scale.data_ptr()
    assert mlp.gate_proj.weight_global_scale.item() == mlp.up_proj.weight_global_scale.item()
    assert not isinstance(model.lm_head, NVFP4Linear)
    out = model(input_ids=torch.randint(0, 256, (1, 8))).logits
    assert torch.isfinite(out).all()


def test_public_api_exports():
    for name in ("quantize", "dequantize", "NVFP4Linear", "NVFP4Config", "quantize_model", "linear", "linear_dgrad"):
        assert hasattr(nvfp4, name)
    x = torch.randn(2, 32)
    q = nvfp4.quantize(torch.randn(8, 32))
    assert torch.equal(nvfp4.linear(x, q.packed, q.scale, q.global_scale),
                       linear_reference(x, q.packed, q.scale, q.global_scale))


@pytest.mark.parametrize("format", FORMATS)
def test_module_to_dtype_moves_but_never_casts_4bit_tensors(format):
    """``.to(bf16)`` moves the 4-bit tensors but never casts them (the state dict, in the format's own dtypes, is
    unchanged; the compute scales stay FP8 / FP32); the bias and the output follow the new dtype."""
    q = NVFP4Linear.from_linear(nn.Linear(64, 8, bias=True), format=format)
    before = {k: v.clone() for k, v in q.state_dict().items() if k != "bias"}
    q.to(torch.bfloat16)
    after = q.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k].view(torch.uint8), v.view(torch.uint8))
               for k, v in before.items())  # fmt: skip
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_global_scale.dtype == torch.float32
    assert q.bias.dtype == torch.bfloat16
    assert q(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_mma_layout_round_trip_and_errors():
    from nvfp4.layout import from_mma_layout, is_mma_layout, mma_layout_supported, to_mma_layout, to_scale_mma_layout

    gen = torch.Generator().manual_seed(3)
    for n, k in [(64, 256), (128, 512), (192, 1536)]:
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scale = torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn)
        mma = to_mma_layout(packed)
        assert mma.shape == (n // 4, 2 * k) and is_mma_layout(mma, to_scale_mma_layout(scale))
        assert not is_mma_layout(packed, scale)
        assert torch.equal(from_mma_layout(mma), packed)
        bits = [int(torch.bitwise_and(t.to(torch.int64) >> i, 1).sum()) for t in (mma, packed) for i in range(8)]
        assert sum(bits[:8]) == sum(bits[8:])  # a permutation of the bits
    assert not mma_layout_supported(576, 576) and not mma_layout_supported(96, 256)
    with pytest.raises(ValueError, match="to_mma_layout"):
        to_mma_layout(torch.zeros(96, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_packed must be"):
        is_mma_layout(torch.zeros(10, 10, dtype=torch.uint8), torch.zeros(64, 16, dtype=torch.float8_e4m3fn))


def test_scale_mma_layout_round_trip_and_the_bytes_a_thread_reads():
    """Round 15 step A's scale layout: the inverse round-trips fresh random scales, and the 8 bytes that thread
    ``lane`` of consumer warp ``w`` reads per 64-input stage ``j`` (at ``(8w + lane // 4)·8``, 2 per k16 step ``g``,
    low byte first) are the scales of its wgmma A-fragment rows ``r = 16w + lane // 4`` and ``r + 8`` for inputs
    ``64j + 16g …``: the expected values indexed here row by row, independently of the permutation."""
    from nvfp4.layout import from_scale_mma_layout, to_scale_mma_layout

    gen = torch.Generator().manual_seed(15)
    for n, k in [(64, 64), (128, 512), (192, 3584)]:
        scale = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
        lay = to_scale_mma_layout(scale)
        assert lay.shape == (n // 64, k // 64 * 256) and lay.dtype == torch.float8_e4m3fn
        assert torch.equal(from_scale_mma_layout(lay).view(torch.uint8), scale.view(torch.uint8))
        s, b = scale.view(torch.uint8).tolist(), lay.view(torch.uint8).tolist()
        for _ in range(64):
            t, j, w, lane = (int(torch.randint(0, v, (1,), generator=gen)) for v in (n // 64, k // 64, 4, 32))
            base = 256 * j + (8 * w + lane // 4) * 8
            for g in range(4):
                r = 64 * t + 16 * w + lane // 4
                assert b[t][base + 2 * g] == s[r][(64 * j + 16 * g) // 16], (n, k, t, j, w, lane, g)
                assert b[t][base + 2 * g + 1] == s[r + 8][(64 * j + 16 * g) // 16], (n, k, t, j, w, lane, g)
    with pytest.raises(ValueError, match="to_scale_mma_layout"):
        to_scale_mma_layout(torch.zeros(96, 16, dtype=torch.float8_e4m3fn))


def _rotr(x: torch.Tensor, t: int) -> torch.Tensor:
    return ((x >> t) | (x << (32 - t))) & 0xFFFFFFFF


def test_mma_layout_decodes_with_the_kernels_register_recipe():
    """The MMA-layout GEMM's fast decode, replayed in PyTorch: its four rotate-and-mask recipes applied to each stored
    32-bit word, the tile's register relabelling, and the scale's fp16-shift trick give ``e2m1 · s · 2^-14`` exactly,
    element for element, against the codec (so only the PTX itself is left for the GPU tests)."""
    from nvfp4.codec import e2m1_to_float, unpack_e2m1
    from nvfp4.layout import to_mma_layout

    gen = torch.Generator().manual_seed(5)
    n, k = 128, 512
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    q = to_mma_layout(packed).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [N/4, K/2] words
    p = 0x81C081C0
    regs = [q & p, _rotr(q, 4) & p, _rotr(q, 10) & p, (_rotr(q, 30) & 0x80C080C0) | (_rotr(q, 6) & 0x01000100)]

    def bf16(bits: torch.Tensor) -> torch.Tensor:
        return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).double()

    vals = torch.stack([torch.stack([bf16(r & 0xFFFF), bf16(r >> 16)], -1) for r in regs], -2)  # word, j, nibble
    vals = vals.reshape(n // 64, 16, k // 256, 512, 2).transpose(1, 2)  # tile_n, tile_k, 16 rows, 512 bytes, nibble
    w = vals.reshape(n // 64, k // 256, 4, 4, 8, 4, 8, 2, 2).permute(0, 1, 3, 7, 4, 2, 6, 5, 8)  # as _mma_tile
    w = w.reshape(n // 64, k // 256, 64, 256).transpose(1, 2).reshape(n, k)
    assert torch.equal(w, e2m1_to_float(unpack_e2m1(packed)).double() * 2.0**-126)

    h = scale.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    s_bf16 = bf16(((h >> 3) & 0x0FFF) | 0x7000)  # _scale_words_bf16x2, one half
    assert torch.equal(s_bf16, scale.double() * 2.0**112)
    prod = (w.to(torch.bfloat16) * s_bf16.to(torch.bfloat16).repeat_interleave(16, 1)).double()  # mul.rn.bf16x2
    assert torch.equal(prod, e2m1_to_float(unpack_e2m1(packed)).double() * scale.double().repeat_interleave(16, 1)
                       * 2.0**-14)  # fmt: skip


def test_scale_mma_layout_with_step_a_asm_replayed_per_thread():
    """Round 15 step A (``hopper_ws.E2M1_SCALED_ASM``) replayed per thread in PyTorch: thread ``lane`` of consumer
    warp ``w`` at stage ``kk`` takes its 4 weight words from the MMA layout (row ``16t + 4·(kk % 4) + w``, bytes
    ``512·(kk // 4) + 16·lane …``) and its 4 scale pairs from :func:`to_scale_mma_layout`'s 8 bytes; per word, the
    rotate-and-mask registers ``$0 … $3``, the pair's low byte (``cvt`` → fp16 → ``>> 3``, re-biased) multiplying
    ``$0``/``$2`` and its high byte ``$1``/``$3`` (``mul.rn.bf16x2``) give ``e2m1 · s · 2^-14`` of the A-fragment
    elements those registers hold (register ``j``: row ``r + 8·(j % 2)``, byte ``32·kk + 8·g + 4·(j // 2) + lane % 4``)."""
    import re

    from nvfp4.codec import e2m1_to_float, unpack_e2m1
    from nvfp4.kernels.hopper_ws import E2M1_SCALED_ASM
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    # the asm's own re-bias (its lop3 evaluated bit by bit from the LUT: bit a·4 + b·2 + c), not a restatement of it
    b_imm, c_imm, lut = (int(v, 16) for v in re.search(r"lop3\.b32 f, f, (0x\w+), (0x\w+), (0x\w+);",
                                                        E2M1_SCALED_ASM.value).groups())  # fmt: skip

    def rebias(f: int) -> int:
        return sum(((lut >> (4 * ((f >> i) & 1) + 2 * ((b_imm >> i) & 1) + ((c_imm >> i) & 1))) & 1) << i
                   for i in range(16))  # fmt: skip

    gen = torch.Generator().manual_seed(16)
    n, k = 128, 512
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    ref = e2m1_to_float(unpack_e2m1(packed)).double() * scale.double().repeat_interleave(16, 1) * 2.0**-14
    words = (to_mma_layout(packed).view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()
    pairs = to_scale_mma_layout(scale).view(torch.uint8).tolist()
    f16 = (torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
           .view(torch.int16).to(torch.int64) & 0xFFFF).tolist()  # fmt: skip

    def rotr(x: int, t: int) -> int:
        return ((x >> t) | (x << (32 - t))) & 0xFFFFFFFF

    p, wbits, sbits, where = 0x81C081C0, [], [], []
    for _ in range(48):
        t, kk, w, lane = (int(torch.randint(0, v, (1,), generator=gen)) for v in (n // 64, k // 64, 4, 32))
        row, col = 16 * t + 4 * (kk % 4) + w, (512 * (kk // 4) + 16 * lane) // 4
        sp = pairs[t][256 * kk + (8 * w + lane // 4) * 8:][:8]
        for g in range(4):
            x = words[row][col + g]
            regs = [x & p, rotr(x, 4) & p, rotr(x, 10) & p, (rotr(x, 30) & 0x80C080C0) | (rotr(x, 6) & 0x01000100)]
            pair = [rebias(f16[sp[2 * g + h]] >> 3) for h in range(2)]  # cvt.rn.f16x2.e4m3x2, >> 3, lop3
            for j, reg in enumerate(regs):
                r, b = 64 * t + 16 * w + lane // 4 + 8 * (j % 2), 32 * kk + 8 * g + 4 * (j // 2) + lane % 4
                for half in range(2):
                    wbits.append((reg >> (16 * half)) & 0xFFFF)
                    sbits.append(pair[j % 2])
                    where.append((r, 2 * b + half))

    def bf16(bits: list[int]) -> torch.Tensor:
        return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    got = (bf16(wbits) * bf16(sbits)).double()  # mul.rn.bf16x2
    rows, cols = zip(*where, strict=True)
    assert torch.equal(got, ref[list(rows), list(cols)])


def test_mma_scales_supported_and_the_layout_choice():
    from nvfp4.layout import mma_scales_supported

    every_positive = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # subnormals included
    assert mma_scales_supported(every_positive)
    for bad in (0x00, 0x80, 0xB8, 0x7F, 0xFF):  # 0, -0, -1, NaN, -NaN
        assert not mma_scales_supported(torch.tensor([0x38, bad], dtype=torch.uint8).view(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mma_scales_supported(torch.ones(4))


def test_mma_layout_module_state_dict_and_forward():
    """An NVFP4Linear holding the MMA layout (what CUDA gets) computes the same outputs, saves the checkpoint layout
    and loads a checkpoint-layout state dict; the reference path reads both layouts."""
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout

    torch.manual_seed(0)
    lin = nn.Linear(512, 128, bias=True)
    ref_mod = NVFP4Linear.from_linear(lin)
    mod = NVFP4Linear.from_linear(lin)
    mod.weight_packed, mod.weight_scale = to_mma_layout(mod.weight_packed), to_scale_mma_layout(mod.weight_scale)
    assert mod.mma_layout and not ref_mod.mma_layout
    x = torch.randn(3, 512)
    torch.testing.assert_close(mod(x), ref_mod(x), rtol=0, atol=0)
    torch.testing.assert_close(mod.dequantize(), ref_mod.dequantize(), rtol=0, atol=0)
    assert torch.equal(mod.nvfp4_weight.packed, ref_mod.weight_packed)
    sd = mod.state_dict()
    assert torch.equal(sd["weight_packed"], ref_mod.weight_packed)
    other = NVFP4Linear(512, 128, bias=True)
    other.weight_packed, other.weight_scale = to_mma_layout(other.weight_packed), to_scale_mma_layout(other.weight_scale)
    other.load_state_dict(ref_mod.state_dict())
    assert other.mma_layout and torch.equal(other.weight_packed, mod.weight_packed)
    assert mod.nvfp4_weight.shape == (128, 512)

    # A checkpoint with a zero block scale (the MMA-layout kernels cannot decode it) loads in the checkpoint layout.
    bad = ref_mod.state_dict()
    bad["weight_scale"] = bad["weight_scale"].clone()
    bad["weight_scale"][7, 3] = 0.0
    with pytest.warns(UserWarning, match="compressed-tensors layout"):
        other.load_state_dict(bad)
    assert not other.mma_layout and torch.equal(other.weight_packed, ref_mod.weight_packed)
    plain = NVFP4Linear(512, 128, bias=True)  # same construction, never in the MMA layout
    plain.load_state_dict(bad)
    torch.testing.assert_close(other(x), plain(x), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 64)])
def test_compact_cache_gives_the_dense_cache_numbers(shape):
    """``cache_dequantized(compact=True)`` (int8 codes + half-steps, rebuilt per call) gives the dense cache's outputs
    and input gradients bit for bit, through a LoRA adapter as the trainer runs it, in a fraction of the memory."""
    from nvfp4.peft import get_peft_model
    from peft import LoraConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64, bias=True))
    quantize_model(model, progress=False)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False))
    x = torch.randn(*shape)
    results = {}
    for compact in (False, True):
        xi = x.clone().requires_grad_(True)
        with nvfp4.cache_dequantized(peft, torch.float32, compact=compact) as held:
            layers = [m for m in peft.modules() if isinstance(m, NVFP4Linear)]
            assert all((m._codes_cache is not None) == compact for m in layers)
            y = peft(xi)
            y.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in peft.named_parameters() if p.grad is not None}
        peft.zero_grad(set_to_none=True)
        results[compact] = (y.detach(), xi.grad, grads, held)
    (y0, gx0, g0, held0), (y1, gx1, g1, held1) = results[False], results[True]
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert g0.keys() == g1.keys() and g0 and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert held1 * 3 < held0  # 1.25 bytes a weight instead of 4
    assert all(m._codes_cache is None and m._dense_cache is None for m in layers)


def _weight_sized_allocations(fn, weight_bytes: int) -> list[tuple[int, str]]:
    """(bytes, op) of every op in ``fn()`` (forward + backward) that allocated at least a weight's worth of memory."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.self_cpu_memory_usage, e.name) for e in prof.events() if e.self_cpu_memory_usage >= weight_bytes]


@pytest.mark.parametrize("compact", [False, True])
def test_cached_forward_allocates_no_dequantized_weight(compact):
    """Under ``cache_dequantized`` a forward + backward of an NVFP4 layer neither allocates nor frees a dequantized
    weight (nor a weight-sized temporary): the dense cache holds ``dequant(W)``; the compact one rebuilds it into one
    float32 scratch buffer per weight shape, held for the block (its address is the same on every call and shared by
    the layers of that shape). Each such allocation is a fresh mmap and ``out × in / 1024`` page faults under
    ``qerl train``'s pinned mmap threshold. Without a cache the reference path does allocate (the check sees it)."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(256, 384), nn.Linear(384, 256), nn.Linear(256, 384))
    quantize_model(layers, progress=False)
    x = torch.randn(2, 256, requires_grad=True)
    weight_bytes = 384 * 256 * 4

    def step():
        layers(x).sum().backward()

    assert _weight_sized_allocations(step, weight_bytes)  # the uncached reference dequantizes on every call
    with nvfp4.cache_dequantized(layers, torch.float32, compact=compact):
        step()
        assert _weight_sized_allocations(step, weight_bytes) == []
        if compact:
            first, _, third = (m._codes_cache for m in layers)
            assert first.fill().data_ptr() == first.fill().data_ptr() == third.fill().data_ptr()
            step()
            assert first.fill().data_ptr() == third.fill().data_ptr()


def _two_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))


def test_quantize_model_skips_every_module_a_generator_names():
    """``modules_to_not_convert`` is an ``Iterable``: a generator was used up by the first module's check, so the
    modules it named after that were quantized."""
    model = quantize_model(_two_linears(), modules_to_not_convert=(n for n in ["1", "0"]), progress=False)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]



@pytest.mark.parametrize("keyword, value", [("modules_to_not_convert", "1"), ("fused_groups", ["0", "1"])])
def test_quantize_model_refuses_a_string_where_a_list_of_names_is_meant(keyword, value):
    """``modules_to_not_convert="lm_head"`` was read letter by letter (so lm_head was quantized), and
    ``fused_groups=["q_proj", "k_proj"]`` fused nothing: both silently. Now one line naming the option."""
    with pytest.raises(TypeError, match=rf"quantize_model: {keyword} .*got the string '[01]'") as info:
        quantize_model(_two_linears(), progress=False, **{keyword: value})
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize(
    "keyword, value, bad",
    [("modules_to_not_convert", ["lm_head", None], "None"), ("modules_to_not_convert", [0], "0"),
     ("fused_groups", [["0", 1]], "1"), ("fused_groups", [[None]], "None")],
)  # fmt: skip
def test_a_name_that_is_no_string_is_named_in_one_line(keyword, value, bad):
    """``modules_to_not_convert=["lm_head", None]`` (a name read from a config that lacked it) ended in
    ``AttributeError: 'NoneType' object has no attribute 'removeprefix'``, naming neither the option nor the entry;
    ``fused_groups=[["q_proj", 1]]`` was taken as is and matched nothing. Now one TypeError naming the option and
    the entry, from quantize_model and from NVFP4Config."""
    for call, where in ((lambda: quantize_model(_two_linears(), progress=False, **{keyword: value}), "quantize_model"),
                        (lambda: nvfp4.NVFP4Config(**{keyword: value}), "NVFP4Config")):  # fmt: skip
        with pytest.raises(TypeError, match=rf"{where}: {keyword}: {bad} .*not a string; .*module names") as info:
            call()
        assert len(str(info.value).splitlines()) == 1


def test_a_name_to_keep_dense_that_matches_no_module_is_named_in_a_warning(tiny_model_dir):
    """``modules_to_not_convert=["lm_haed"]`` (a typo; or a name of another architecture) matched nothing, so every
    linear, lm_head too, was quantized without a word: by quantize_model, calibrate_model and NVFP4Config on load.
    Each now warns in one line naming the entries that match no module; names that match say nothing."""
    from nvfp4.calibration import calibrate_model
    from transformers import AutoModelForCausalLM

    with pytest.warns(UserWarning, match=r"quantize_model: modules_to_not_convert: \['2'\] match no module") as info:
        quantize_model(_two_linears(), modules_to_not_convert=["0", "2"], progress=False)
    assert len(str(info[0].message).splitlines()) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_model(_two_linears(), modules_to_not_convert=["re:1"], progress=False)
    with pytest.warns(UserWarning, match=r"NVFP4Config: modules_to_not_convert: \['lm_haed'\] match no module"):
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=nvfp4.NVFP4Config(
            modules_to_not_convert=["lm_haed"]))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with pytest.warns(UserWarning, match=r"calibrate_model: modules_to_not_convert: \['mlp.dwn_proj'\] match no"):
        calibrate_model(model, "awq", [torch.randint(0, 256, (1, 8))], modules_to_not_convert=["mlp.dwn_proj"],
                        progress=False)  # fmt: skip


@pytest.mark.parametrize("entry", ["*.mlp.*", "re:*mlp", "layers[0"])
def test_a_module_name_pattern_that_is_no_regex_is_named_in_one_line(entry):
    """A ``modules_to_not_convert`` entry that is no regular expression (a glob such as ``*.mlp.*``) ended in Python's
    bare ``re.error: nothing to repeat at position 0`` traceback, naming neither the option nor the entry; and
    ``NVFP4Config`` took it, so ``from_pretrained`` failed only once the model was built. Now one ValueError naming
    the option, the entry and what entries are, at the call / the config."""
    with pytest.raises(ValueError, match=r"quantize_model: modules_to_not_convert: .* is not a valid regular") as info:
        quantize_model(_two_linears(), modules_to_not_convert=[entry], progress=False)
    assert entry in str(info.value) and len(str(info.value).splitlines()) == 1
    with pytest.raises(ValueError, match=r"NVFP4Config: modules_to_not_convert: .* is not a valid regular"):
        nvfp4.NVFP4Config(modules_to_not_convert=["lm_head", entry])


def test_a_parent_module_named_in_modules_to_not_convert_keeps_its_linears_dense(tiny_model_dir, tmp_path):
    """``modules_to_not_convert=["model.layers.0"]`` (a block, as transformers' quantizers take the option:
    ``should_convert_module`` keeps everything under a named prefix) matched no linear, so block 0 was quantized
    without a word, by ``quantize_model`` and by ``NVFP4Config`` on load. A named module now keeps every linear
    under it dense; the saved config names them, so the checkpoint reloads the same."""
    from transformers import AutoModelForCausalLM

    def dense(model):
        return sorted(n for n, m in model.named_modules() if type(m) is nn.Linear)

    kept = ["lm_head"] + [f"model.layers.0.{m}" for m in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
                                                           "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
                                                           "self_attn.v_proj")]  # fmt: skip
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert dense(quantize_model(m, modules_to_not_convert=["lm_head", "model.layers.0"], progress=False)) == kept
    cfg = nvfp4.NVFP4Config(modules_to_not_convert=["lm_head", "model.layers.0"])
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=cfg)
    assert dense(loaded) == kept
    loaded.save_pretrained(tmp_path / "q")
    assert dense(nvfp4.load_nvfp4_checkpoint(tmp_path / "q")) == kept


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantize_model_with_a_calibrated_method_and_no_statistics_points_to_calibrate_model(method):
    """``quantize_model(model, method="gptq")`` (a method NVFP4Config takes) said "unknown method 'gptq'" and pointed
    to the per-weight ``gptq_quantize``, and ``method="awq"`` without ``act_sq`` asked the first layer for its
    statistics: at the model level both calibrate on data, which ``calibrate_model`` collects. One line naming it."""
    with pytest.raises(ValueError, match=rf"quantize_model\(method={method!r}\).*calibrate_model\(model, {method!r}") as e:
        quantize_model(_two_linears(), method=method, progress=False)
    assert "unknown method" not in str(e.value) and len(str(e.value).splitlines()) == 1


def test_quantize_model_on_a_model_without_a_linear_to_quantize_says_so():
    """``quantize_model`` on a model none of whose linears it takes (GPT-2's transformers ``Conv1D`` projections, a
    lm_head kept dense) returned it unchanged without a word; now a warning says nothing was quantized and why. A
    model already quantized (a second call) says nothing."""
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=32))
    with pytest.warns(UserWarning, match=r"quantize_model: GPT2LMHeadModel has no nn\.Linear .* to quantize"):
        quantize_model(gpt2, progress=False)
    model = quantize_model(_two_linears(), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_model(model, progress=False)


def test_quantize_model_takes_none_as_the_default_names_and_groups():
    """``modules_to_not_convert=None`` / ``fused_groups=None`` (the default of ``NVFP4Config`` and ``calibrate_model``,
    which say they take these options "as quantize_model") ended in "'NoneType' object is not iterable"."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    quantize_model(model, modules_to_not_convert=None, fused_groups=None, progress=False)
    attn = model.model.layers[0].self_attn
    assert type(model.lm_head) is nn.Linear and isinstance(attn.q_proj, NVFP4Linear)
    assert attn.q_proj.weight_global_scale.item() == attn.v_proj.weight_global_scale.item()


def test_a_nested_cache_gives_the_outer_one_back():
    """``cache_dequantized`` inside another (an evaluation within a CPU training run, which holds the compact cache)
    cleared every layer's cache on leaving, so the rest of the outer block dequantized every weight on every call
    again; the outer block's caches are now restored."""
    from nvfp4 import cache_dequantized

    layer = NVFP4Linear.from_linear(nn.Linear(64, 32))
    x = torch.randn(2, 64)
    with cache_dequantized(layer, torch.float32, compact=True):
        outer = layer._codes_cache
        with cache_dequantized(layer, torch.bfloat16):
            assert layer.has_cached_weight(x.bfloat16())
        assert layer._codes_cache is outer and layer._dense_cache is None and layer.has_cached_weight(x)
    assert not layer.has_cached_weight(x)


def _pickled(m):
    import pickle

    return pickle.loads(pickle.dumps(m))


def _torch_saved(m):
    import io

    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _copies():
    import copy

    return {"pickle": _pickled, "deepcopy": copy.deepcopy, "torch.save": _torch_saved}


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4", "nvfp4-fp8-copy", "nvfp4-shardable"])
def test_layer_pickles_and_deepcopies_exactly(how, kind):
    """``pickle.loads(pickle.dumps(layer))`` failed in torch's unpickler ('UntypedStorage' has no attribute 'dtype':
    plain pickle serialises a float8 storage in torch's legacy format, which cannot read float8 back), so a model
    holding NVFP4Linear did not pickle (multiprocessing, accelerate, copies by pickle). The float8 tensors (block
    scales, an FP8 rollout copy, a shardable layer's parameters) now travel as their bytes and come back bit for bit."""
    from nvfp4.fp8_model import attach_fp8_copies
    from nvfp4.fsdp import make_shardable

    torch.manual_seed(0)
    layer = NVFP4Linear.from_linear(nn.Linear(96, 40, bias=True), format=kind.partition("-")[0])
    if kind.endswith("fp8-copy"):
        attach_fp8_copies(layer, "fp8", 0)
    if kind.endswith("shardable"):
        layer = make_shardable(layer)
    copied = _copies()[how](layer)
    assert type(copied) is type(layer) and copied is not layer
    state, got = layer.state_dict(), copied.state_dict()
    assert list(got) == list(state)
    for k, t in state.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
    for name, t in [*layer.named_buffers(), *layer.named_parameters()]:  # as the layer holds them (not only saved)
        c = dict([*copied.named_buffers(), *copied.named_parameters()])[name]
        assert type(c) is type(t) and c.dtype == t.dtype and c.requires_grad == t.requires_grad, name
    if layer.fp8_copy is not None:
        assert copied.fp8_copy.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(copied.fp8_copy.weight.view(torch.uint8), layer.fp8_copy.weight.view(torch.uint8))
        assert torch.equal(copied.fp8_copy.scale, layer.fp8_copy.scale)
    x = torch.randn(3, 5, 96)
    with torch.no_grad():
        assert torch.equal(copied(x), layer(x))
    if kind.endswith("fp8-copy"):
        from nvfp4.fp8_model import fp8_rollouts

        with torch.no_grad(), fp8_rollouts(layer), fp8_rollouts(copied):
            assert torch.equal(copied(x), layer(x))


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_a_converted_transformers_model_pickles_and_deepcopies(how):
    """The whole model (its config's NVFP4Config holds a weakref to the model: dropped for the copy, which names the
    dense linears as the model holds them) pickles and deep-copies; the copy computes as the model does."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = quantize_model(AutoModelForCausalLM.from_config(tiny_config("llama")), progress=False)
    copied = _copies()[how](model)
    assert isinstance(copied.model.layers[0].self_attn.q_proj, NVFP4Linear)
    for (k, t), (k2, t2) in zip(model.state_dict().items(), copied.state_dict().items(), strict=True):
        assert k == k2 and t.dtype == t2.dtype and torch.equal(t.view(torch.uint8), t2.view(torch.uint8)), k
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, model(ids).logits)
    ignore = model.config.quantization_config.to_dict()["ignore"]
    assert copied.config.quantization_config.to_dict()["ignore"] == ignore
