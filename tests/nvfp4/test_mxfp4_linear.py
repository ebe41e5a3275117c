"""``NVFP4Linear(format="mxfp4")``: compressed-tensors MXFP4 state dict, the load-time transcode to NVFP4 scales (the
layer then computes through the NVFP4 ops), the reference fallback for tensors without a transcode, loading checks,
``quantize_model(format="mxfp4")``, autograd, dtype moves."""

from __future__ import annotations

import pytest
import torch
from nvfp4 import NVFP4Linear, mxfp4, quantize_model
from nvfp4.codec import NVFP4Weight
from nvfp4.formats import MXFP4
from nvfp4.mxfp4 import MXFP4Weight
from torch import nn


def _linear(out: int = 64, k: int = 128, bias: bool = True, seed: int = 0, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, out, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.exp2(torch.randint(-3, 3, (out, 1)).float()))  # rows over several binades
    return lin.to(dtype)


def _no_transcode_weight(out: int = 64, k: int = 128) -> MXFP4Weight:
    """Non-zero groups 20 binades apart: E4M3's powers of two cannot hold both."""
    q = mxfp4.quantize(torch.randn(out, k))
    q.scale[0, 0] = q.scale[0, 0] + 20
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_from_linear_state_dict_is_compressed_tensors_mxfp4(dtype):
    lin = _linear(dtype=dtype)
    layer = NVFP4Linear.from_linear(lin, format="mxfp4", name="layers.0.q_proj.weight")
    ref = mxfp4.quantize(lin.weight.detach())
    sd = layer.state_dict()
    assert set(sd) == {"weight_packed", "weight_scale", "bias"}
    assert sd["weight_scale"].dtype == torch.uint8 and sd["weight_scale"].shape == (64, 4)
    assert torch.equal(sd["weight_packed"], ref.packed) and torch.equal(sd["weight_scale"], ref.scale)
    assert layer.format == "mxfp4" and layer.uses_nvfp4_ops  # transcoded: the NVFP4 ops compute it
    assert layer.weight_scale.dtype == torch.float8_e4m3fn and layer.weight_global_scale.shape == (1,)
    assert torch.equal(layer.dequantize(torch.float32), ref.dequantize(torch.float32))
    assert isinstance(layer.quantized_weight, MXFP4Weight) and isinstance(layer.nvfp4_weight, NVFP4Weight)
    assert "mxfp4" in repr(layer) and layer.orig_dtype == dtype


def test_no_transcode_keeps_e8m0_and_computes_with_the_reference():
    q = _no_transcode_weight()
    with pytest.warns(UserWarning, match=r"layers\.3\.up_proj.*plain PyTorch reference"):
        layer = NVFP4Linear.from_weight(q, None, torch.float32, name="layers.3.up_proj")
    assert not layer.uses_nvfp4_ops and not layer.mma_layout and layer.weight_global_scale is None
    x = torch.randn(4, 128, requires_grad=True)
    assert torch.equal(layer(x), mxfp4.linear_reference(x, q.packed, q.scale))
    layer(x).sum().backward()
    assert x.grad is not None
    sd = layer.state_dict()
    assert torch.equal(sd["weight_scale"], q.scale) and "weight_global_scale" not in sd
    with pytest.raises(ValueError, match="without an NVFP4 transcode"):
        _ = layer.nvfp4_weight
    layer.to(torch.bfloat16)  # no second warning, tensors untouched
    assert torch.equal(layer.weight_scale, q.scale)


def test_all_zero_groups_outside_the_window_keep_their_bytes():
    w = torch.randn(64, 128)
    w[3, 32:64] = 0  # compressed-tensors' E = 0, far below the transcode's window
    layer = NVFP4Linear.from_linear(nn.Linear(128, 64, bias=False).requires_grad_(False), format="mxfp4")
    q = mxfp4.quantize(w)
    assert q.scale[3, 1].item() == 0
    layer = NVFP4Linear.from_weight(q, None, torch.float32)
    assert layer.uses_nvfp4_ops and layer.weight_scale_e8m0 is not None
    assert torch.equal(layer.state_dict()["weight_scale"], q.scale)
    assert torch.equal(layer.dequantize(torch.float32), q.dequantize(torch.float32))


def test_load_state_dict_round_trip_and_checks():
    src = NVFP4Linear.from_linear(_linear(seed=1), format="mxfp4")
    sd = src.state_dict()
    dst = NVFP4Linear(128, 64, bias=True, dtype=torch.float32, format="mxfp4")
    assert not dst.uses_nvfp4_ops  # zeros, not yet transcoded
    dst.load_state_dict(sd)
    assert dst.uses_nvfp4_ops and torch.equal(dst.weight_scale, src.weight_scale)
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), sd.values()))
    # a layer already transcoded loads tensors that have none: back to E8M0, reference compute
    bad = _no_transcode_weight()
    with pytest.warns(UserWarning, match="plain PyTorch reference"):
        dst.load_state_dict({**bad.state_dict(), "bias": sd["bias"]})
    assert not dst.uses_nvfp4_ops and torch.equal(dst.state_dict()["weight_scale"], bad.scale)
    # and back again
    dst.load_state_dict(sd)
    assert dst.uses_nvfp4_ops
    with pytest.raises(ValueError, match=r"weight_scale: checkpoint has torch.float8_e4m3fn"):
        nvfp4_sd = NVFP4Linear.from_linear(_linear()).state_dict()
        dst.load_state_dict({k: v for k, v in nvfp4_sd.items() if k != "weight_global_scale"})
    with pytest.raises(ValueError, match="holds NVFP4 tensors"):
        dst.load_state_dict(nvfp4_sd)
    with pytest.raises(ValueError, match=r"weight_scale: checkpoint has torch.uint8 \(64, 2\)"):
        dst.load_state_dict({**sd, "weight_scale": sd["weight_scale"][:, :2]})
    with pytest.raises(ValueError, match="together"):
        dst.load_state_dict({"weight_packed": sd["weight_packed"], "bias": sd["bias"]}, strict=False)
    with pytest.raises(ValueError, match="multiple of 32"):
        NVFP4Linear(48, 64, format="mxfp4")
    with pytest.raises(ValueError, match="unknown 4-bit format"):
        NVFP4Linear(64, 64, format="int4")


def test_quantize_model_mxfp4():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("q_proj", nn.Linear(64, 64))
    model.add_module("k_proj", nn.Linear(64, 32))
    model.add_module("odd", nn.Linear(48, 32))  # in_features % 32 != 0: stays dense
    model.add_module("lm_head", nn.Linear(64, 64))
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_model(model, format="mxfp4", progress=False)
    assert isinstance(model.q_proj, NVFP4Linear) and model.q_proj.format == "mxfp4"
    assert model.q_proj.layer_name == "q_proj"
    assert type(model.odd) is nn.Linear and type(model.lm_head) is nn.Linear
    for n in ("q_proj", "k_proj"):  # each its own scales: no shared global scale
        q = mxfp4.quantize(dense[f"{n}.weight"])
        sd = getattr(model, n).state_dict()
        assert torch.equal(sd["weight_packed"], q.packed) and torch.equal(sd["weight_scale"], q.scale)
    with pytest.raises(NotImplementedError, match="MXFP4 supports method='rtn' only"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), format="mxfp4", method="mse", progress=False)
    with pytest.raises(ValueError, match="unknown 4-bit format"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), format="fp8", progress=False)
    with pytest.raises(ValueError, match="global_scale"):
        NVFP4Linear.from_linear(nn.Linear(64, 64), format="mxfp4", global_scale=torch.ones(1))
    assert MXFP4.group_size == 32
