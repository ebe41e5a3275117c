"""PEFT LoRA on MXFP4 layers (``NVFP4Linear(format="mxfp4")``), transcoded and reference-path alike: only LoRA
trains, the 4-bit tensors never change, the adapter's output is the dense reference's, merge exports a dense model."""

from __future__ import annotations

import warnings

import torch
from nvfp4 import NVFP4Linear, mxfp4, quantize_model
from nvfp4.peft import LoraNVFP4Linear, get_peft_model, merge_and_unload
from peft import LoraConfig
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM


def _model():
    torch.manual_seed(0)
    m = quantize_model(AutoModelForCausalLM.from_config(tiny_config("llama")), format="mxfp4", progress=False)
    # one layer whose scales have no NVFP4 transcode: it computes with the plain reference
    layer = m.model.layers[1].mlp.down_proj
    q = layer.quantized_weight
    q.scale[0, 0] += 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.model.layers[1].mlp.down_proj = NVFP4Linear.from_weight(q, None, layer.orig_dtype, name="down_proj")
    return m


def test_lora_on_mxfp4_trains_only_lora_and_matches_the_dense_reference():
    m = _model()
    layers = [x for x in m.modules() if isinstance(x, NVFP4Linear)]
    assert len(layers) == 14 and all(x.format == "mxfp4" for x in layers)
    assert sum(not x.uses_nvfp4_ops for x in layers) == 1
    pm = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    assert len([x for x in pm.modules() if isinstance(x, LoraNVFP4Linear)]) == 14
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    bufs = {n: b.clone().view(torch.uint8) for n, b in pm.named_buffers()}
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, 10))
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    changed = {n for n, p in pm.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    assert any("layers.1.mlp.down_proj.lora_A" in n for n in changed)  # the reference-path layer trains its LoRA
    assert all(torch.equal(bufs[n], b.view(torch.uint8)) for n, b in pm.named_buffers())
    # each wrapped layer's output == F.linear with mxfp4's dequantized weight, plus PEFT's adapter term
    wrapped = pm.base_model.model.model.layers[1].mlp.down_proj
    x = torch.randn(3, 128)
    base = wrapped.get_base_layer()
    q = base.quantized_weight
    with torch.no_grad():
        lora = wrapped.lora_B["default"](wrapped.lora_A["default"](x)) * wrapped.scaling["default"]
        assert torch.allclose(wrapped(x), mxfp4.linear_reference(x, q.packed, q.scale) + lora, atol=1e-6)
        merged = merge_and_unload(pm)
    dense = merged.model.layers[1].mlp.down_proj
    assert type(dense) is torch.nn.Linear
    delta = wrapped.lora_B["default"].weight @ wrapped.lora_A["default"].weight * wrapped.scaling["default"]
    assert torch.allclose(dense.weight, q.dequantize(torch.float32) + delta, atol=1e-6)
