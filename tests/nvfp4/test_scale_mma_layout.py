"""Landing step A, stage 1: ``weight_scale`` in :func:`nvfp4.layout.to_scale_mma_layout`'s order (``[N/64, 4K]``)
beside an MMA-layout ``weight_packed``, behind ``NVFP4_SCALE_MMA_LAYOUT=1`` (default off; docs/kernels.md, "Landing
step A"). Every reader given the new order equals the same reader given ``[N, K/16]`` scales on the same weights."""

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


def test_switch_is_off_by_default(monkeypatch):
    monkeypatch.delenv("NVFP4_SCALE_MMA_LAYOUT", raising=False)
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
