"""PEFT LoRA on NVFP4Linear in every 4-bit format (``nvfp4.formats.FORMATS``): attach by names and all-linear, only
LoRA trains, save/load, merge to a dense model; an MXFP4 layer without an NVFP4 transcode (the plain reference path)
trains and merges the same way."""

from __future__ import annotations

import warnings

import pytest
import torch
from nvfp4 import NVFP4Linear, mxfp4, quantize_model
from nvfp4.formats import FORMATS
from nvfp4.peft import LoraNVFP4Linear, get_peft_model, load_adapter, merge_and_unload
from peft import LoraConfig
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM


def _model(format: str = "nvfp4"):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(tiny_config("llama"))
    return quantize_model(m, format=format, progress=False)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_lora_attaches_and_only_lora_trains(targets, format):
    model = _model(format)
    assert {m.format for m in model.modules() if isinstance(m, NVFP4Linear)} == {format}
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    wrapped = [m for m in pm.modules() if isinstance(m, LoraNVFP4Linear)]
    assert len(wrapped) == (14 if targets == "all-linear" else 6)
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    bufs = {n: b.clone().view(torch.uint8) for n, b in pm.named_buffers()}
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, 10))
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    changed = {n for n, p in pm.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    assert all(torch.equal(bufs[n], b.view(torch.uint8)) for n, b in pm.named_buffers())


def test_plain_peft_trains_but_refuses_to_merge_into_4bit():
    from peft import get_peft_model as plain

    pm = plain(_model(), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(0, 256, (1, 6))
    pm(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError):
        pm.merge_and_unload()


@pytest.mark.parametrize("format", FORMATS)
def test_adapter_save_load_and_merge(tmp_path, format):
    base = _model(format)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    pm = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        ref = pm(input_ids=ids).logits
    pm.save_pretrained(tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_config(tiny_config("llama"))
    quantize_model(fresh, format=format, progress=False)
    fresh.load_state_dict(base_state)
    reloaded = load_adapter(fresh, str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, ref)
    merged = merge_and_unload(pm)
    assert not any(isinstance(m, NVFP4Linear) for m in merged.modules())
    assert getattr(merged.config, "quantization_config", None) is None
    with torch.no_grad():
        out = merged(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_load_adapter_takes_peft_subfolder(tmp_path):
    """``load_adapter(model, path, subfolder=...)`` (PEFT's own keyword, passed on) read ``path/adapter_config.json``
    for its fit check and config, so an adapter saved in a subfolder (or named by a Hub id, which PEFT downloads)
    ended in FileNotFoundError; the check reads the folder PEFT loads, and is left to PEFT for a Hub id."""
    pm = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    ids = torch.randint(0, 256, (1, 6))
    pm.save_pretrained(tmp_path / "run" / "step-10")
    reloaded = load_adapter(_model(), str(tmp_path / "run"), subfolder="step-10")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, pm(input_ids=ids).logits)


def test_dora_is_refused_in_one_line():
    """``LoraConfig(use_dora=True)``: PEFT's DoRA reads ``base_layer.weight`` as the dense matrix, which is the packed
    uint8 codes here, so attaching the adapter ended in "The size of tensor a (32) must match the size of tensor b
    (64)"; now one line naming DoRA and the layer."""
    with pytest.raises(ValueError, match=r"use_dora=True.*q_proj") as info:
        get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("how", ["quantize_model", "calibrate_model"])
def test_quantizing_a_model_that_carries_adapters_is_refused(how):
    """``quantize_model`` / ``calibrate_model`` after ``get_peft_model`` (QLoRA's order reversed) quantized the
    adapters' own ``lora_A`` / ``lora_B`` linears too: frozen 4-bit buffers, no trainable parameter left, silently.
    Now one line saying to quantize first."""
    from nvfp4.calibration import calibrate_model
    from peft import get_peft_model as plain

    torch.manual_seed(0)
    pm = plain(AutoModelForCausalLM.from_config(tiny_config("llama")), LoraConfig(r=16, target_modules=["q_proj"]))
    convert = {"quantize_model": lambda m: quantize_model(m, progress=False),
               "calibrate_model": lambda m: calibrate_model(m, "awq", [torch.randint(0, 256, (1, 6))])}[how]  # fmt: skip
    with pytest.raises(ValueError, match=r"PEFT adapters.*quantize the base model first") as info:
        convert(pm)
    assert len(str(info.value).splitlines()) == 1
    assert not any(isinstance(m, NVFP4Linear) for m in pm.modules())


def _adapted_model(device: str = "cpu", dtype: torch.dtype = torch.float32):
    pm = get_peft_model(_model(), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    return pm.to(device=device, dtype=dtype).eval()


def test_lora_linear_op_reference_equals_peft_forward_and_refuses_gradients():
    """``ops.lora_linear`` (what generation uses on CUDA) computes PEFT's forward; it has no backward."""
    from nvfp4 import ops

    pm = _adapted_model()
    layer = next(m for m in pm.modules() if isinstance(m, LoraNVFP4Linear))
    base = layer.get_base_layer()
    x = torch.randn(3, 5, base.in_features)
    with torch.no_grad():
        assert layer._plain_adapter(x, (), {}) is None  # CPU, uncached: PEFT's path
        peft_y = layer(x)
        fused_y = ops.lora_linear(x, base.weight_packed, base.weight_scale, base.weight_global_scale, base.bias,
                                  layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                                  layer.scaling["default"])  # fmt: skip
    torch.testing.assert_close(fused_y, peft_y, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="no backward"):
        ops.lora_linear(x, base.weight_packed, base.weight_scale, base.weight_global_scale, base.bias,
                        layer.lora_A["default"].weight, layer.lora_B["default"].weight, 2.0)  # fmt: skip


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("lora_alpha", [8, 16])
def test_cached_lora_path_gives_peft_outputs_and_gradients(compact, lora_alpha, monkeypatch):
    """With the base's dequant(W) cached (the CPU trainer), every LoraNVFP4Linear adds its adapter in place
    (``_CachedLoraLinear``): the logits (bit for bit at scaling 1, α = r), the input gradients and every LoRA gradient
    of PEFT's own path (to rounding: autograd adds the base's and the adapter's input gradients in another order)."""
    import nvfp4
    import nvfp4.peft as nvpeft

    pm = get_peft_model(_model(), LoraConfig(r=8, lora_alpha=lora_alpha, target_modules="all-linear",
                                             init_lora_weights=False)).train()  # fmt: skip
    layers = [m for m in pm.modules() if isinstance(m, LoraNVFP4Linear)]
    ids = torch.randint(0, 256, (3, 9))
    results = []
    with nvfp4.cache_dequantized(pm, torch.float32, compact=compact):
        x = torch.randn(2, layers[0].in_features)
        assert all(m._plain_adapter(x, (), {}) == "default" for m in layers)
        for fused in (False, True):
            monkeypatch.setattr(nvpeft, "FUSED_LORA", fused)
            embeds = pm.get_input_embeddings()(ids).detach().requires_grad_(True)
            logits = pm(inputs_embeds=embeds).logits
            logits.square().mean().backward()
            grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
            pm.zero_grad(set_to_none=True)
            results.append((logits.detach(), embeds.grad, grads))
    (y0, gx0, g0), (y1, gx1, g1) = results
    assert len(g0) == 2 * len(layers) and g0.keys() == g1.keys()
    if lora_alpha == 8:
        assert torch.equal(y1, y0)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-7)
    for got, ref in [(gx1, gx0), *((g1[n], g0[n]) for n in g0)]:  # the same sums, added in another order
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_lora_generation_matches_peft_path_gpu(compiled, monkeypatch):
    """On CUDA without gradients every LoraNVFP4Linear takes the fused kernel; logits match PEFT's unfused path,
    also compiled with CUDA graphs; with gradients (training) PEFT's path runs."""
    import nvfp4.peft as nvpeft

    pm = _adapted_model("cuda", torch.bfloat16)
    layers = [m for m in pm.modules() if isinstance(m, LoraNVFP4Linear)]
    ids = torch.randint(0, 256, (4, 11), device="cuda")
    x = torch.randn(2, layers[0].in_features, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert all(m._plain_adapter(x, (), {}) == "default" for m in layers)
        monkeypatch.setattr(nvpeft, "FUSED_LORA", False)
        unfused = pm(input_ids=ids).logits.float()
        monkeypatch.setattr(nvpeft, "FUSED_LORA", True)
        fwd = torch.compile(pm, mode="reduce-overhead", fullgraph=True) if compiled else pm
        for _ in range(3 if compiled else 1):
            fused = fwd(input_ids=ids).logits.float()
    assert not torch.isnan(fused).any()
    rel = ((fused - unfused).norm() / unfused.norm()).item()
    assert rel < 2e-2, rel
    assert layers[0]._plain_adapter(x.requires_grad_(), (), {}) is None  # grad enabled: PEFT's path


def test_lora_on_an_mxfp4_layer_without_transcode_trains_and_merges():
    """An MXFP4 layer whose scales have no NVFP4 transcode computes with the plain reference: its LoRA trains, its
    output is ``mxfp4.linear_reference`` plus PEFT's term, and the merge exports ``dequant(W) + ΔW``."""
    m = _model("mxfp4")
    layer = m.model.layers[1].mlp.down_proj
    q = layer.quantized_weight
    q.scale[0, 0] += 20  # 20 more binades than FP8-E4M3 holds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.model.layers[1].mlp.down_proj = NVFP4Linear.from_weight(q, None, layer.orig_dtype, name="down_proj")
    assert sum(not x.uses_nvfp4_ops for x in m.modules() if isinstance(x, NVFP4Linear)) == 1
    pm = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, 10))
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    changed = {n for n, p in pm.named_parameters() if not torch.equal(before[n], p)}
    assert any("layers.1.mlp.down_proj.lora_A" in n for n in changed)  # the reference-path layer trains its LoRA
    wrapped = pm.base_model.model.model.layers[1].mlp.down_proj
    x = torch.randn(3, 128)
    with torch.no_grad():
        lora = wrapped.lora_B["default"](wrapped.lora_A["default"](x)) * wrapped.scaling["default"]
        assert torch.allclose(wrapped(x), mxfp4.linear_reference(x, q.packed, q.scale) + lora, atol=1e-6)
        merged = merge_and_unload(pm)
    dense = merged.model.layers[1].mlp.down_proj
    delta = wrapped.lora_B["default"].weight @ wrapped.lora_A["default"].weight * wrapped.scaling["default"]
    assert type(dense) is torch.nn.Linear
    assert torch.allclose(dense.weight, q.dequantize(torch.float32) + delta, atol=1e-6)


def test_merge_after_a_dtype_cast_gives_one_dtype():
    """A bf16 NVFP4 model cast with ``.float()`` (as for CPU training) merged to bf16 weights beside float32 norms,
    embeddings and inputs, so the merged model failed at its first forward; the layer's export dtype follows casts."""
    torch.manual_seed(0)
    m = quantize_model(AutoModelForCausalLM.from_config(tiny_config("llama")).to(torch.bfloat16), progress=False)
    m.float()
    assert m.model.layers[0].mlp.down_proj.dequantize().dtype == torch.float32
    pm = get_peft_model(m, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        ref = pm(input_ids=ids).logits
    merged = merge_and_unload(pm)
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    with torch.no_grad():
        out = merged(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_a_refused_merge_leaves_the_4bit_base_in_place():
    """``merge(safe_merge=True)`` refusing a NaN adapter (or a merge naming no adapter) left the layer's base swapped
    for its dense copy: 4x the memory and no longer 4-bit, silently, with nothing merged. The 4-bit base is back."""
    pm = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaNs detected"):
        layer.merge(safe_merge=True)
    assert not layer.merged and isinstance(layer.get_base_layer(), NVFP4Linear)
    layer.merge(adapter_names=[])
    assert not layer.merged and isinstance(layer.get_base_layer(), NVFP4Linear)


def test_the_lora_layer_prints_its_name_once():
    """``print(model)`` showed ``lora.NVFP4LoraNVFP4Linear(`` (the prefix added to a name that already held it); PEFT
    prints ``lora.Linear4bit(`` for its 4-bit layers, ours ``lora.NVFP4Linear(``."""
    pm = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"]))
    text = repr(pm.base_model.model.model.layers[0].self_attn.q_proj)
    assert text.startswith("lora.NVFP4Linear(\n  (base_layer): NVFP4Linear("), text[:80]


def test_peft_merge_and_unload_of_a_loaded_model_saves_a_checkpoint_that_reloads(tmp_path):
    """PEFT's own ``model.merge_and_unload()`` on a model quantized on load swaps each adapted NVFP4 layer for a dense
    ``nn.Linear`` (:meth:`LoraNVFP4Linear.merge`), but the model kept its quantization config: ``save_pretrained``
    wrote the merged dense weights under a config saying they are 4-bit, and every reader (ours, compressed-tensors)
    initialised those linears at random (NaN logits) beside 'UNEXPECTED' dense weights. The saved config now names
    the linears left dense, so the checkpoint reloads as the merged model computes."""
    import nvfp4
    from nvfp4 import NVFP4Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=NVFP4Config())
    pm = get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    merged = pm.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert isinstance(merged.model.layers[0].self_attn.k_proj, NVFP4Linear)
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        ref = merged(ids).logits
    merged.save_pretrained(tmp_path / "merged")
    reloaded = nvfp4.load_nvfp4_checkpoint(tmp_path / "merged")
    assert type(reloaded.model.layers[1].mlp.down_proj) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ref)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "mica", "orthogonal"])
def test_an_initialisation_that_reads_the_dense_base_weight_is_refused_in_one_line(init):
    """``LoraConfig(init_lora_weights=...)`` of the kinds that read (PiSSA, OLoRA, MiCA, rewriting it too) or take the
    dtype of (orthogonal) ``base_layer.weight`` met the packed uint8 codes: 'Unsupported data type for the base layer.
    Got torch.uint8' (OLoRA), 'Only Tensors of floating point and complex dtype can require gradients' (orthogonal),
    or PEFT's float-dtype advice; now one line naming the initialisation, the 4-bit layer and what works."""
    with pytest.raises(ValueError, match=rf"init_lora_weights={init!r}.*4-bit.*q_proj") as info:
        get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init))
    assert len(str(info.value).splitlines()) == 1


def test_peft_merge_and_unload_of_a_model_converted_in_memory_saves_a_checkpoint_that_reloads(tmp_path):
    """The same as above for a model converted in memory (``quantize_model``, README's torchao-style call), whose
    config records the dense linears at conversion: after PEFT's own ``merge_and_unload()`` the merged linears were
    dense but the saved config still called them 4-bit ('their tensors are absent' on reload). The recorded config
    now names the linears the model holds dense when it is written; it still pickles and copies."""
    import copy
    import pickle

    import nvfp4

    model = _model()
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    merged = pm.merge_and_unload()
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        ref = merged(ids).logits
    merged.save_pretrained(tmp_path / "merged")
    reloaded = nvfp4.load_nvfp4_checkpoint(tmp_path / "merged", dtype=torch.float32)
    assert type(reloaded.model.layers[1].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ref)
    for config in (pickle.loads(pickle.dumps(merged.config)), copy.deepcopy(merged.config)):
        assert config.quantization_config.to_dict()["ignore"] == merged.config.quantization_config.to_dict()["ignore"]


def test_write_adapter_of_a_raw_state_dict_writes_the_adapter_alone(tmp_path):
    """``write_adapter(folder, model.state_dict(), config)`` (a raw state dict, which its docstring takes) wrote every
    tensor of the PeftModel into adapter_model.safetensors: the embeddings, lm_head, norms and the 4-bit base tensors
    beside the LoRA weights (an adapter file the size of the model, which vLLM's LoRA loader refuses). It now writes
    the tensors PEFT's get_peft_model_state_dict gives, under the same names."""
    from nvfp4.peft import write_adapter
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    pm = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    write_adapter(tmp_path / "raw", pm.state_dict(), pm.peft_config["default"])
    written = load_file(tmp_path / "raw" / "adapter_model.safetensors")
    expected = get_peft_model_state_dict(pm)
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[k], expected[k]) for k in expected)


def test_a_loaded_model_config_names_linears_merged_since_the_load_before_any_save(tmp_path):
    """A model quantized on load named its dense linears in its config in a second way (a copy made at load and again
    inside ``save_pretrained``), so between the two the config (``to_dict``, a pickle or deep copy of it, which
    multiprocessing and trainers' config logging make) still called linears merged by PEFT 4-bit. The loaded config
    is now bound to its model as a converted one is: it names them as the model holds them, as the save writes."""
    import copy
    import json
    import pickle

    from nvfp4 import NVFP4Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    cfg = NVFP4Config(modules_to_not_convert=["lm_head", "o_proj"])
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=cfg)
    merged = get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).merge_and_unload()
    qc = merged.config.quantization_config
    now = [qc.to_dict()["ignore"], pickle.loads(pickle.dumps(qc)).to_dict()["ignore"],
           copy.deepcopy(qc).to_dict()["ignore"]]  # fmt: skip
    assert cfg.modules_to_not_convert == ["lm_head", "o_proj"]  # the caller's config is left as it was
    merged.save_pretrained(tmp_path / "merged")
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.1.self_attn.q_proj" in saved
    assert now == [saved] * 3
