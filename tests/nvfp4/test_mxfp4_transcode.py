"""The exact MXFP4 → NVFP4 scale transcode (:func:`nvfp4.mxfp4.to_nvfp4` / :func:`nvfp4.mxfp4.from_nvfp4`): the
NVFP4 dequantization of the transcoded scales equals MXFP4's bit for bit, the bytes round-trip, all-zero groups,
tensors that have no transcode, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nvfp4 import codec, layout, mxfp4
from nvfp4.mxfp4 import E8M0_BIAS, GROUP_SIZE, from_nvfp4, to_nvfp4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random_weight(out: int, k: int, dtype: torch.dtype, seed: int, spread: float = 2.0) -> torch.Tensor:
    """Student-t weights with rows of scales spread over ``2^±spread`` binades."""
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(torch.tensor(2.5)).sample((out, k)) * 0.05
    rows = torch.exp2((torch.rand(out, 1, generator=g) * 2 - 1) * spread)
    return (t * rows).to(dtype)


def _check_exact(q: mxfp4.MXFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    t = to_nvfp4(q.packed, q.scale)
    assert t is not None
    fp8, g = t
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == (q.scale.shape[0], q.scale.shape[1] * 2)
    assert g.dtype == torch.float32 and g.shape == (1,)
    assert layout.mma_scales_supported(fp8)
    ref = mxfp4.dequantize(q.packed, q.scale, torch.float32)
    assert torch.equal(codec.dequantize(q.packed, fp8, g, torch.float32), ref)  # bit for bit, zeros' signs included
    for dtype in DTYPES:
        assert torch.equal(codec.dequantize(q.packed, fp8, g, dtype), mxfp4.dequantize(q.packed, q.scale, dtype))
    return fp8, g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_transcode_is_exact_and_round_trips_on_random_weights(dtype, seed):
    q = mxfp4.quantize(_random_weight(48, 256, dtype, seed))
    fp8, g = _check_exact(q)
    assert torch.equal(from_nvfp4(fp8, g), q.scale)  # the bytes come back
    assert fp8.view(torch.uint8).max().item() == (8 + 7) << 3  # the largest scale is 2^8


@settings(max_examples=60, deadline=None)
@given(
    e_max=st.integers(9, 235),
    span=st.integers(0, 17),
    rows=st.integers(1, 5),
    groups=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_transcode_exact_for_any_exponents_in_the_window(e_max, span, rows, groups, seed):
    g = torch.Generator().manual_seed(seed)
    scale = (e_max - torch.randint(0, min(span, e_max) + 1, (rows, groups), generator=g)).to(torch.uint8)
    scale.view(-1)[0] = e_max
    packed = torch.randint(0, 256, (rows, groups * GROUP_SIZE // 2), generator=g, dtype=torch.uint8)
    packed[:, 0] |= 0x07  # every group non-zero
    q = mxfp4.MXFP4Weight(packed, scale)
    fp8, gs = _check_exact(q)
    assert torch.equal(from_nvfp4(fp8, gs), scale)


def test_a_group_below_the_window_has_no_transcode():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)  # two groups per row, all codes 1.0
    scale = torch.tensor([[140, 140], [140, 140 - 18]], dtype=torch.uint8)  # 18 binades: one too many
    assert to_nvfp4(packed, scale) is None
    scale[1, 1] = 140 - 17  # 2^-9 · 2^c: still exact
    _check_exact(mxfp4.MXFP4Weight(packed, scale))


def test_all_zero_groups_take_any_scale():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)
    packed[1, 16:] = torch.tensor([0x80, 0x08, 0x88, 0x00]).repeat(4).to(torch.uint8)  # ±0 codes only
    scale = torch.tensor([[140, 140], [140, 0]], dtype=torch.uint8)  # CT writes E = 0 for an all-zero group
    fp8, g = _check_exact(mxfp4.MXFP4Weight(packed, scale))
    assert fp8[1, 2:].view(torch.uint8).tolist() == [1, 1]  # the smallest scale, 2^-9
    back = from_nvfp4(fp8, g)
    assert torch.equal(back[:, 0], scale[:, 0]) and back[1, 1].item() == 140 - 17  # the zero group's byte is lost
    # an all-zero group above the window (float16's E = 127 in a tensor of small weights) gets the largest scale
    scale = torch.tensor([[100, 100], [100, 127]], dtype=torch.uint8)
    fp8, g = _check_exact(mxfp4.MXFP4Weight(packed, scale))
    assert fp8[1, 2].view(torch.uint8).item() == (8 + 7) << 3


def test_all_zero_tensor_and_tiny_tensors_keep_a_normal_global_scale():
    packed = torch.zeros(4, 64, dtype=torch.uint8)
    fp8, g = _check_exact(mxfp4.MXFP4Weight(packed, torch.zeros(4, 4, dtype=torch.uint8)))
    assert g.item() == 2.0**126
    q = mxfp4.quantize(torch.randn(4, 64) * 1e-37)  # E ≤ 8: the global scale stops at 2^126
    _check_exact(q)


def test_no_transcode_for_nan_scales_or_scales_beyond_the_kernels_range():
    packed = torch.full((1, 16), 0x22, dtype=torch.uint8)
    assert to_nvfp4(packed, torch.tensor([[255]], dtype=torch.uint8)) is None
    assert to_nvfp4(packed, torch.tensor([[E8M0_BIAS + 109]], dtype=torch.uint8)) is None  # c = -101
    assert to_nvfp4(packed, torch.tensor([[E8M0_BIAS + 108]], dtype=torch.uint8)) is not None


def test_bad_input_raises():
    packed, scale = torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        to_nvfp4(packed, scale.view(torch.int8))
    with pytest.raises(ValueError, match="needs weight_scale"):
        to_nvfp4(packed, torch.zeros(2, 3, dtype=torch.uint8))
    q = codec.quantize(torch.randn(4, 64))  # real NVFP4 scales: not powers of two, halves differ
    with pytest.raises(ValueError, match="differ|power of two"):
        from_nvfp4(q.scale, q.global_scale)
    fp8, g = to_nvfp4(packed, scale)
    with pytest.raises(ValueError, match="global scale"):
        from_nvfp4(fp8, g * 3)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        from_nvfp4(fp8.float(), g)
