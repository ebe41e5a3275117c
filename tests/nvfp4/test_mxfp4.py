"""The MXFP4 codec and the format registry: round trip, the E8M0 scale rule, bytes == compressed-tensors'
``mxfp4-pack-quantized`` (its own functions, on fresh random weights in float32/bfloat16/float16), bad input,
the reference W4A16 linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from nvfp4 import codec, formats, mxfp4, ops
from nvfp4.formats import MXFP4, NVFP4, format_of, get_format
from nvfp4.mxfp4 import GROUP_SIZE, MXFP4Weight, dequantize, e8m0_to_float, linear_reference, quantize

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ct_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """What llm-compressor's ``MXFP4A16`` writes for ``w``: compressed-tensors' min/max → ``calculate_qparams`` →
    ``MXFP4PackedCompressor.compress``, in ``w``'s dtype (as the memoryless min-max observer hands them over)."""
    ct_mxfp4 = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    groups = w.reshape(w.shape[0], -1, GROUP_SIZE)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return ct_mxfp4.MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)


def _ct_decompress(q: MXFP4Weight) -> torch.Tensor:
    ct_mxfp4 = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    return ct_mxfp4.MXFP4PackedCompressor.decompress(q.state_dict(), scheme)["weight"]


def _heavy_tailed(out: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Student-t weights, rows of different scales, and the corner cases of the scale rule in known groups."""
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(torch.tensor(2.5)).sample((out, k)) * 0.05
    w = t * (0.25 + 2 * torch.rand(out, 1, generator=g))
    w[1, :32] = 0  # all-zero group
    w[2, 32:64] = -1e-4  # small negatives: code 8 (-0) where they round to zero
    w[3, 5] = -0.0  # -0.0 itself: code 0 in compressed-tensors
    w[4, :32] = torch.linspace(-3e-6, 3e-6, 32)  # below float16's normal range: scale 1.0 in float16
    w[5, :32] *= 2000  # large group (float16 keeps it below 57344)
    for group in range(k // GROUP_SIZE):  # amax with mantissa 0.75 (rounds up) and just below it, over many exponents
        w[6, group * GROUP_SIZE] = 1.75 * 2.0 ** (group - 3)
        w[6, group * GROUP_SIZE + 1] = -1.74 * 2.0 ** (group - 3)
    w[7, :32] = torch.tensor([1.5, -1.74, 1.0, -6.0]).repeat(8)
    return w.to(dtype)


# ---- bytes == compressed-tensors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bytes_match_compressed_tensors(dtype, seed):
    w = _heavy_tailed(96, 320, dtype, seed)  # K = 10 groups
    ct = _ct_mxfp4(w)
    q = quantize(w)
    assert set(ct) == set(q.state_dict()) == {"weight_packed", "weight_scale"}
    assert ct["weight_packed"].dtype == q.packed.dtype == torch.uint8
    assert ct["weight_scale"].dtype == q.scale.dtype == torch.uint8
    assert torch.equal(ct["weight_packed"], q.packed)
    assert torch.equal(ct["weight_scale"], q.scale)
    # and compressed-tensors decodes our tensors (to bf16) to our dequantization
    dec = _ct_decompress(q)
    assert torch.equal(dec, q.dequantize(dec.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_match_compressed_tensors_on_plain_gaussian_weights(dtype):
    for seed, std in [(3, 0.02), (4, 1.0), (5, 30.0)]:
        w = (torch.randn(64, 512, generator=torch.Generator().manual_seed(seed)) * std).to(dtype)
        ct, q = _ct_mxfp4(w), quantize(w)
        assert torch.equal(ct["weight_packed"], q.packed) and torch.equal(ct["weight_scale"], q.scale)


def test_negative_zero_gets_code_zero_and_small_negatives_keep_their_sign():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 4.0, -0.0, -0.01, 0.01
    codes = codec.unpack_e2m1(quantize(w).packed)[0]
    assert codes[:4].tolist() == [6, 0, 8, 0]
    assert torch.equal(quantize(w).packed, _ct_mxfp4(w)["weight_packed"])


# ---- the scale rule and the round trip ---------------------------------------------------------------------------


def test_e8m0_scale_rule():
    # amax → power of two p (up when the mantissa ≥ 0.75) → E = 127 + log2(p) - 2
    amax = torch.tensor([1.0, 1.5, 1.74, 1.75, 6.0, 7.0, 0.0, 2.0**-130])
    assert mxfp4.e8m0_exponents(amax).tolist() == [125, 125, 125, 126, 127, 128, 0, 0]
    # the group's largest value: 1.0/0.25 = 4, 1.5/0.25 = 6, 1.74/0.25 saturates at 6, 1.75/0.5 = 3.5 → 4 (ties even)
    w = torch.zeros(4, 32)
    w[:, 0] = torch.tensor([1.0, 1.5, 1.74, 1.75])
    q = quantize(w)
    assert q.dequantize(torch.float32)[:, 0].tolist() == [1.0, 1.5, 1.5, 2.0]
    # float16: p = 0 gives scale 1.0 (E = 127), as compressed-tensors' zero-scale guard
    assert mxfp4.e8m0_exponents(torch.tensor([0.0, 1e-6, 4.6e-5], dtype=torch.float16)).tolist() == [127, 127, 111]


@settings(max_examples=40, deadline=None)
@given(
    out=st.integers(1, 24),
    groups=st.integers(1, 6),
    log_scale=st.floats(-12, 10),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_error_is_bounded(out, groups, log_scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, groups * GROUP_SIZE, generator=g) * 2.0**log_scale).to(dtype)
    q = quantize(w)
    assert q.packed.shape == (out, groups * 16) and q.scale.shape == (out, groups)
    d = q.dequantize(torch.float32)
    assert torch.isfinite(d).all()
    wf = w.float().reshape(out, groups, GROUP_SIZE)
    step = e8m0_to_float(q.scale).unsqueeze(-1)
    # E2M1 at a power-of-two step: error ≤ |w|/4 for |w| ≥ step (relative half-gap), ≤ step/4 below it
    err = (d.reshape(out, groups, GROUP_SIZE) - wf).abs()
    assert (err <= torch.maximum(wf.abs(), step) / 4).all()
    # the step puts amax in [3.5, 7) steps (except groups below the dtype's normal range)
    amax = wf.abs().amax(-1, keepdim=True)
    normal = amax >= torch.finfo(dtype).tiny
    assert ((amax / step >= 3.5) & (amax / step < 7) | ~normal).all()


def test_zeros_round_trip_to_zeros():
    for dtype in DTYPES:
        assert torch.equal(quantize(torch.zeros(3, 64, dtype=dtype)).dequantize(torch.float32), torch.zeros(3, 64))


def test_float32_compute_dtype_only_changes_float16_corner_cases():
    w = _heavy_tailed(32, 128, torch.float32, 0)
    for dtype in (torch.float32, torch.bfloat16):
        native, fp32 = quantize(w.to(dtype)), quantize(w.to(dtype), compute_dtype=torch.float32)
        assert torch.equal(native.packed, fp32.packed) and torch.equal(native.scale, fp32.scale)
    # every group below float16's normal range
    w16 = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 5e-6).half()
    native, fp32 = quantize(w16), quantize(w16, compute_dtype=torch.float32)
    assert (native.scale == 127).all() and not native.dequantize(torch.float32).any()
    assert (fp32.dequantize(torch.float32) - w16.float()).norm() < 0.3 * w16.float().norm()


def test_float16_overflow_is_refused_with_a_remedy():
    w = torch.randn(2, 32).half()
    w[0, 3] = 60000.0  # 1.83 · 2^15: the power of two 2^16 overflows float16
    with pytest.raises(ValueError, match="compute_dtype=torch.float32") as e:
        quantize(w, name="layers.0.mlp.down_proj.weight")
    assert "layers.0.mlp.down_proj.weight" in str(e.value)
    assert quantize(w, compute_dtype=torch.float32).scale[0, 0].item() == 127 + 16 - 2


def test_e8m0_decoding_matches_torch_float8_e8m0fnu():
    e = torch.arange(256, dtype=torch.uint8)
    ours, torchs = e8m0_to_float(e), e.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours[:255], torchs[:255]) and ours[:255].tolist() == [2.0 ** (i - 127) for i in range(255)]
    assert ours[255].isnan() and torchs[255].isnan()


# ---- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.randn(4, 48), "multiple of the MXFP4 block size 32"),
        (torch.randn(4, 16), "multiple of the MXFP4 block size 32"),  # fine for NVFP4, not for MXFP4
        (torch.tensor([[float("nan")] * 32]), "NaN/Inf"),
        (torch.randn(4, 32).to(torch.int32), "unsupported dtype"),
        (torch.randn(2, 4, 32), "2-D"),
    ],
)
def test_bad_input_errors_name_the_tensor(w, match):
    with pytest.raises(ValueError, match=match) as e:
        quantize(w, name="model.layers.3.mlp.up_proj.weight")
    assert "model.layers.3.mlp.up_proj.weight" in str(e.value)


def test_only_rtn_and_mismatched_tensors():
    with pytest.raises(ValueError, match="only 'rtn'"):
        quantize(torch.randn(4, 32), method="mse")
    q = quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="disagree"):
        dequantize(q.packed, q.scale[:, :1])
    with pytest.raises(ValueError, match="disagree"):
        dequantize(q.packed, q.scale.view(torch.int8))


def test_weight_container():
    q = quantize(torch.randn(6, 96))
    assert q.shape == (6, 96) and q.nbytes == 6 * 48 + 6 * 3
    assert isinstance(q.to("cpu"), MXFP4Weight)


# ---- reference W4A16 linear --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_reference(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * 0.1
    q = quantize(w.to(dtype))
    x = torch.randn(2, 3, 128, generator=g).to(dtype)
    bias = torch.randn(48, generator=g)
    y = linear_reference(x, q.packed, q.scale, bias)
    assert y.shape == (2, 3, 48) and y.dtype == dtype
    assert torch.equal(y, F.linear(x, q.dequantize(dtype), bias.to(dtype)))
    assert torch.equal(MXFP4.linear_reference(x, q, bias), y)
    # dequant(W) in bf16 is exact (a 3-bit value times a power of two): the same weight compressed-tensors decodes
    assert torch.equal(q.dequantize(torch.bfloat16), _ct_decompress(q))
    ref = x.double() @ q.dequantize(torch.float64).T + bias.to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max()


# ---- the format registry -----------------------------------------------------------------------------------------


def test_get_format_and_format_of():
    assert get_format("nvfp4") is NVFP4 and get_format("MXFP4") is MXFP4 and get_format(MXFP4) is MXFP4
    assert get_format("mxfp4-pack-quantized") is MXFP4 and get_format("nvfp4-pack-quantized") is NVFP4
    with pytest.raises(ValueError, match="choose one of"):
        get_format("int4")
    assert set(formats.FORMATS) == {"nvfp4", "mxfp4"}
    assert format_of(quantize(torch.randn(2, 32))) is MXFP4 and format_of(codec.quantize(torch.randn(2, 32))) is NVFP4
    with pytest.raises(TypeError):
        format_of(torch.zeros(2))


def test_formats_agree_with_compressed_tensors():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import preset_name_to_scheme
    from nvfp4 import hf

    assert NVFP4.ct_format == hf.FORMAT
    for fmt in formats.FORMATS.values():
        assert fmt.ct_format in {f.value for f in CompressionFormat}
        args = preset_name_to_scheme(fmt.ct_scheme, ["Linear"]).weights
        assert args.group_size == fmt.group_size and args.num_bits == 4 and args.type == "float"
        assert args.scale_dtype == fmt.scale_dtype and (args.strategy == "tensor_group") == fmt.has_global_scale


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
def test_format_interface(fmt):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    q = fmt.quantize(w, name="w")
    sd = q.state_dict("layer.weight")
    specs = fmt.tensor_specs(64, 128)
    assert {f"layer.{n}" for n in specs} == set(sd) and fmt.tensor_names == tuple(specs)
    assert all((sd[f"layer.{n}"].dtype, tuple(sd[f"layer.{n}"].shape)) == spec for n, spec in specs.items())
    back = fmt.weight_from_tensors(sd, "layer.weight")
    assert type(back) is fmt.weight_type and torch.equal(fmt.dequantize(back), q.dequantize())
    x = torch.randn(3, 128).bfloat16()
    assert torch.equal(fmt.linear_reference(x, q), F.linear(x, q.dequantize(x.dtype)))
    other = MXFP4 if fmt is NVFP4 else NVFP4
    with pytest.raises(TypeError, match=fmt.weight_type.__name__):
        other.dequantize(q)
    bad = dict(sd, **{"layer.weight_scale": sd["layer.weight_scale"][:, :-1]})
    with pytest.raises(ValueError, match="layer.weight_scale"):
        fmt.weight_from_tensors(bad, "layer.weight")
    with pytest.raises(ValueError, match="missing"):
        fmt.weight_from_tensors({}, "layer.weight")
    with pytest.raises(ValueError, match="multiple of"):
        fmt.tensor_specs(64, fmt.group_size + 8)


def test_nvfp4_format_is_the_existing_codec():
    w = torch.randn(32, 64).bfloat16()
    a, b = NVFP4.quantize(w), codec.quantize(w)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    x = torch.randn(2, 64).bfloat16()
    assert torch.equal(NVFP4.linear_reference(x, a), ops.linear_reference(x, a.packed, a.scale, a.global_scale))
