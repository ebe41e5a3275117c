"""What each registered :class:`nvfp4.formats.Format` answers for itself (issue #48): bytes per weight, its model
card, its compressed-tensors config and the one check that reads such a config back; and the layer's forward and
backward against the format's reference, one test over the registry instead of one per format."""

from __future__ import annotations

import pytest
import torch
from nvfp4 import NVFP4Linear
from nvfp4.card import write_model_card
from nvfp4.formats import FORMATS, compressed_tensors_format
from nvfp4.hf import NVFP4Config, compressed_tensors_config


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_every_format_answers_for_itself(fmt, tmp_path):
    assert fmt.bytes_per_weight == 0.5 + fmt.scale_dtype.itemsize / fmt.group_size  # nvfp4 0.5625, mxfp4 0.53125
    assert fmt.bytes_per_tensor == (4 if fmt.has_global_scale else 0)
    card = write_model_card(tmp_path, base_model="org/model", method="rtn", format=fmt).read_text()
    assert fmt.ct_scheme in card and "org/model" in card
    qc = compressed_tensors_config(["lm_head"], format=fmt)
    assert compressed_tensors_format(qc) is fmt
    config = NVFP4Config(format=fmt)
    assert config.weight_format is fmt and config.to_dict()["format"] == fmt.ct_format  # the serialized name
    with pytest.raises(ValueError, match="quantizes activations"):
        bad = dict(qc, config_groups={"g": {**qc["config_groups"]["group_0"], "input_activations": {"num_bits": 4}}})
        compressed_tensors_format(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_forward_and_backward_match_the_format_reference(fmt, dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64)
    with torch.no_grad():
        lin.weight.mul_(torch.exp2(torch.randint(-3, 3, (64, 1)).float()))  # rows over several binades
    layer = NVFP4Linear.from_linear(lin, format=fmt)
    q = fmt.quantize(lin.weight.detach())
    x = torch.randn(3, 5, 128, dtype=dtype, requires_grad=True)
    y = layer(x)
    ref = fmt.linear_reference(x, q, lin.bias.detach().to(dtype))
    assert y.dtype == dtype and torch.equal(y, ref)
    y.sum().backward()
    dx = x.grad.clone()
    x.grad = None
    ref.sum().backward()
    assert torch.equal(dx, x.grad)
    assert not any(p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_method_no_format_has_is_an_unknown_value_not_a_missing_feature(fmt):
    """``quantize_model(model, method="gtpq")`` (a typo) raised ``NotImplementedError: method='gtpq' is not implemented
    for NVFP4``, as if the method existed elsewhere or were planned. A name no format knows is now a ValueError saying
    it is unknown and naming the methods there are; a method of another format keeps its NotImplementedError."""
    from nvfp4 import quantize_model

    with pytest.raises(ValueError, match=r"quantize_model: unknown method 'gtpq'; choose one of .*'rtn'") as info:
        quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 64)), method="gtpq", format=fmt, progress=False)
    assert len(str(info.value).splitlines()) == 1 and "not implemented" not in str(info.value)
    with pytest.raises(ValueError, match="unknown method 'gtpq'"):
        FORMATS[fmt].check_options("here", "gtpq")
