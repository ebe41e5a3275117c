"""The NVFP4 codec: round trip, packing, rounding rules, bit-exactness with compressed-tensors, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nvfp4.codec import (
    E2M1_VALUES,
    FP8_MAX,
    NVFP4Weight,
    dequantize,
    e2m1_to_float,
    pack_e2m1,
    quantize,
    round_to_e2m1,
    unpack_e2m1,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@settings(max_examples=40, deadline=None)
@given(
    out=st.integers(1, 40),
    blocks=st.integers(1, 8),
    log_scale=st.floats(-12, 6),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_error_is_bounded(out, blocks, log_scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, blocks * 16, generator=g) * 2.0**log_scale).to(dtype)
    with warnings.catch_warnings(record=True) as fell_back:
        warnings.simplefilter("always")
        q = quantize(w)
    if fell_back:  # fp16 amax < 0.041: compressed-tensors' global scale 1.0 (test_llmcompressor_bytes checks those bytes)
        q = quantize(w, compute_dtype=torch.float32)
    assert q.packed.shape == (out, blocks * 8) and q.packed.dtype == torch.uint8
    assert q.scale.shape == (out, blocks) and q.scale.dtype == torch.float8_e4m3fn
    assert q.global_scale.shape == (1,) and q.global_scale.dtype == torch.float32
    d = q.dequantize(torch.float32)
    assert torch.isfinite(d).all()
    # E2M1 with a per-16 scale: each element is within half a step of the top code's grid (≤ amax/6 per block),
    # plus FP8 rounding of the scale: bound the per-block max error by amax_block * (1/6 + 1/16) generously.
    wf = w.float()
    amax = wf.abs().reshape(out, blocks, 16).amax(-1, keepdim=True)
    err = (d - wf).abs().reshape(out, blocks, 16)
    tiny = 2.0**-120  # below this the FP8 scale range is exhausted (sub-normal blocks quantize to zero)
    ok = (err <= amax * (1 / 6 + 1 / 16) + 1e-6 * amax.amax()) | (amax < tiny)
    assert ok.all()


@settings(max_examples=30, deadline=None)
@given(shape=st.tuples(st.integers(1, 6), st.integers(1, 12)), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_inverse(shape, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (shape[0], shape[1] * 2), generator=g, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (shape[0], shape[1])
    assert torch.equal(unpack_e2m1(packed), codes)
    # element 2i sits in the LOW nibble
    assert torch.equal(packed & 0xF, codes[:, 0::2])


def test_e2m1_codebook_and_ties():
    vals = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6])
    assert torch.equal(e2m1_to_float(round_to_e2m1(vals)), vals)
    # ties go to the even code: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4; saturation at 6
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0])
    assert e2m1_to_float(round_to_e2m1(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 6]
    assert E2M1_VALUES.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_all_zero_blocks_round_trip_to_zero():
    w = torch.randn(4, 64)
    w[1] = 0
    w[2, 16:32] = 0
    d = quantize(w).dequantize(torch.float32)
    assert torch.equal(d[1], torch.zeros(64)) and torch.equal(d[2, 16:32], torch.zeros(16))
    assert torch.equal(quantize(torch.zeros(3, 32)).dequantize(torch.float32), torch.zeros(3, 32))


def test_global_scale_is_the_divisor_convention():
    w = torch.randn(8, 32)
    q = quantize(w)
    assert q.global_scale.item() == pytest.approx(FP8_MAX * 6 / w.abs().max().item(), rel=1e-6)
    # the largest block scale maps amax onto code 6
    assert (q.scale.float() / q.global_scale).max().item() * 6 == pytest.approx(w.abs().max().item(), rel=0.07)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_exact_with_compressed_tensors(dtype, seed):
    ct_nvfp4 = pytest.importorskip("compressed_tensors.compressors.nvfp4.base")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g) * 3).to(dtype)
    w[5, :16] = 0  # an all-zero block
    w[7, 32:48] = -1e-3  # a block of small negatives (sign kept on zero codes)
    w[9, 64:72] = -0.0  # exact negative zeros: code 0, not 8, in compressed-tensors
    absmax = w.abs().amax()  # in w's own dtype, as llm-compressor's observer hands it to generate_gparam
    gs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    blk = w.reshape(96, -1, 16)
    scale, _ = calculate_qparams(blk.amin(-1), blk.amax(-1), scheme.weights, global_scale=gs)
    ct = ct_nvfp4.NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme
    )
    ours = quantize(w)
    assert torch.equal(ct["weight_packed"], ours.packed)
    assert torch.equal(ct["weight_scale"].view(torch.uint8), ours.scale.view(torch.uint8))
    assert torch.equal(ct["weight_global_scale"], ours.global_scale)
    # and compressed-tensors decodes our tensors to our dequantization
    dec = ct_nvfp4.NVFP4PackedCompressor.decompress(ours.state_dict(), scheme)["weight"]
    assert torch.equal(dec, ours.dequantize(dec.dtype))


def test_calibrated_methods_reduce_error():
    from nvfp4 import quantize  # the codec is RTN; the methods sit one level up (nvfp4.methods)

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.02
    act = torch.rand(512, generator=g) ** 4 * 10
    rtn = quantize(w, method="rtn").dequantize(torch.float32)
    mse = quantize(w, method="mse").dequantize(torch.float32)
    awq = quantize(w, method="awq", act_sq=act).dequantize(torch.float32)
    assert rel_err(mse, w) < 0.95 * rel_err(rtn, w)
    weighted = lambda d: ((d - w).square() * act).sum().item()  # noqa: E731
    assert weighted(awq) < 0.9 * weighted(rtn)
    assert weighted(awq) <= weighted(mse)


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.tensor([[float("nan")] * 16]), "NaN/Inf"),
        (torch.tensor([[float("inf")] + [0.0] * 15]), "NaN/Inf"),
        (torch.randn(4, 24), "multiple of the NVFP4 block size"),
        (torch.randn(4, 32).to(torch.int32), "unsupported dtype"),
        (torch.randn(2, 4, 32), "2-D"),
        (torch.randn(0, 32), "empty weight"),
    ],
)
def test_bad_input_errors_name_the_tensor(w, match):
    with pytest.raises(ValueError, match=match) as e:
        quantize(w, name="model.layers.3.mlp.up_proj.weight")
    assert "model.layers.3.mlp.up_proj.weight" in str(e.value)


def test_unknown_method_and_missing_stats():
    from nvfp4 import quantize

    with pytest.raises(ValueError, match="unknown method"):
        quantize(torch.randn(4, 32), method="gptq")
    with pytest.raises(ValueError, match="act_sq"):
        quantize(torch.randn(4, 32), method="awq")


def test_dequantize_rejects_mismatched_tensors():
    q = quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="disagree"):
        dequantize(q.packed, q.scale[:, :2], q.global_scale)


def test_weight_container():
    q = quantize(torch.randn(6, 48))
    assert q.shape == (6, 48)
    assert q.nbytes == 6 * 24 + 6 * 3 + 4
    assert isinstance(q.to("cpu"), NVFP4Weight)
    assert set(q.state_dict()) == {"weight_packed", "weight_scale", "weight_global_scale"}


@pytest.mark.parametrize("method", ["rtn", "mse"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_given_global_scale_that_is_not_positive_and_finite_is_refused(method, bad):
    """A fused group's ``global_scale`` of 0, a negative number, NaN or inf quantized "successfully" to tensors that
    dequantize to NaN (or all zeros): the weight was lost, silently. Now one line naming the weight and the value."""
    import nvfp4

    with pytest.raises(ValueError, match=r"layer\.weight: global_scale must be a finite number > 0, got"):
        nvfp4.quantize(torch.randn(8, 32), method=method, global_scale=torch.tensor([bad]), name="layer.weight")


@pytest.mark.parametrize("method", ["rtn", "mse"])
def test_a_global_scale_given_as_a_number_is_that_scale(method):
    """``global_scale=100.0`` (a Python number, as one writes ``448 * 6 / amax``) ended in "'float' object has no
    attribute 'to'"; it is now the float32 ``[1]`` tensor of that value (the same bytes as ``torch.tensor([100.0])``)."""
    import nvfp4

    w = torch.randn(8, 32)
    given = nvfp4.quantize(w, method=method, global_scale=torch.tensor([100.0]))
    for number in (100.0, 100):
        q = nvfp4.quantize(w, method=method, global_scale=number)
        assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == (1,)
        assert torch.equal(q.packed, given.packed) and torch.equal(q.scale.view(torch.uint8), given.scale.view(torch.uint8))
    layer = nvfp4.NVFP4Linear.from_linear(torch.nn.Linear(32, 8), global_scale=50.0)
    assert layer.weight_global_scale.item() == 50.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_awq_statistics_that_are_no_mean_square_are_refused(bad):
    """``method="awq"`` with ``act_sq`` holding NaN or inf (calibration activations that overflowed, e.g. in float16)
    or a negative value (no mean of x**2 is) quantized without a word: one such channel made every block's weighted
    error NaN (or zero), so the search kept the first candidate and the layer got RTN's bytes under the name awq.
    Now one line naming the weight, how many values and what act_sq must be."""
    import nvfp4

    act_sq = torch.rand(32)
    act_sq[3] = bad
    with pytest.raises(ValueError, match=r"layer\.weight: act_sq holds 1 NaN, inf or negative value") as e:
        nvfp4.quantize(torch.randn(8, 32), method="awq", act_sq=act_sq, name="layer.weight")
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 2.0]), torch.tensor([]), torch.ones(2, 2)])
def test_a_given_global_scale_of_several_values_is_refused_in_one_line(bad):
    """A ``global_scale`` of several values (per-row scales where the format has one per tensor) or of none ended in
    torch's "shape '[1]' is invalid for input of size 2", naming neither the weight nor the option; now one line."""
    import nvfp4

    with pytest.raises(ValueError, match=r"layer\.weight: global_scale must be one number .*got a tensor of shape"):
        nvfp4.quantize(torch.randn(8, 32), global_scale=bad, name="layer.weight")


def test_the_float16_global_scale_warning_says_what_is_lost_and_a_way_out_that_works():
    """A float16 weight with amax < 2688/65504 quantizes with a global scale of 1.0 (as compressed-tensors does): every
    block with amax below ~0.006 gets a zero FP8 scale and decodes to zeros. The warning said only that 'the block
    scales lose precision' (here 95 % of the blocks were zeros, 96 % error) and advised loading the model in fp32,
    which changes nothing on load (quantize on load computes in the checkpoint's float16). It now counts the blocks
    that decode to zeros and names the ways out that work: compute_dtype=torch.float32 or a bfloat16 load."""
    import warnings

    import nvfp4

    torch.manual_seed(0)
    w = (torch.randn(64, 256) * 0.002).half()
    with pytest.warns(UserWarning, match=r"global scale falls back to 1\.0") as record:
        q = nvfp4.quantize(w)
    zeros = int((q.dequantize(torch.float32).reshape(-1, 16) == 0).all(-1).sum())
    message = str(record[0].message)
    assert zeros > 900 and f"{zeros} of its 1024 blocks decode to zeros" in message
    assert "compute_dtype=torch.float32" in message and "dtype=torch.bfloat16" in message and "fp32" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ways out it names: no warning, the usual error
        for fixed in (nvfp4.quantize(w, compute_dtype=torch.float32), nvfp4.quantize(w.bfloat16())):
            assert (fixed.dequantize(torch.float32) - w.float()).norm() / w.float().norm() < 0.1
