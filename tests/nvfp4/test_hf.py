"""transformers integration: quantize on load, generate, save/reload identity, llm-compressor checkpoints, bad files."""

from __future__ import annotations

import json
import shutil

import nvfp4
import pytest
import torch
from nvfp4 import NVFP4Config, NVFP4Linear
from nvfp4.hf import QUANT_METHOD, NVFP4CheckpointError
from transformers import AutoModelForCausalLM, AutoTokenizer


def _state_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if set(sa) != set(sb):
        return False
    view = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    return all(torch.equal(view(sa[k]), view(sb[k])) for k in sa)


def _round_trip(path, tmp_path, ids):
    m = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config())
    assert any(isinstance(x, NVFP4Linear) for x in m.modules())
    out = m.generate(ids, max_new_tokens=8, do_sample=False)
    m.save_pretrained(tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == QUANT_METHOD
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert _state_equal(m, m2)
    assert torch.equal(m2.generate(ids, max_new_tokens=8, do_sample=False), out)
    return m, m2


@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen2"], indirect=True)
def test_tiny_round_trip(tiny_model_dir, tmp_path):
    m, _ = _round_trip(tiny_model_dir, tmp_path, torch.randint(0, 256, (2, 6)))
    q = m.model.layers[0].self_attn
    assert q.q_proj.weight_global_scale.item() == q.v_proj.weight_global_scale.item()
    # quantize-on-load gives exactly what quantize_model gives on the dense model
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    nvfp4.quantize_model(dense, progress=False)
    assert _state_equal(m, dense)


def test_offline_default_round_trip(offline_model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(offline_model_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    m, _ = _round_trip(offline_model_path, tmp_path, ids)
    assert sum(isinstance(x, NVFP4Linear) for x in m.modules()) == 30 * 7
    size_q = (tmp_path / "q" / "model.safetensors").stat().st_size
    size_d = (offline_model_path / "model.safetensors").stat().st_size
    assert size_q < 0.5 * size_d


def test_llm_compressor_checkpoint_loads(tiny_model_dir, tmp_path):
    """A folder laid out as llm-compressor's NVFP4A16 writes it (compressed-tensors config + same tensors)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import load_file, save_file

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    dense = load_file(tiny_model_dir / "model.safetensors")
    out = {}
    for k, w in dense.items():
        if k.endswith("_proj.weight"):
            base = k[: -len(".weight")]
            gs = generate_gparam(w.float().amin(), w.float().amax())
            blk = w.reshape(w.shape[0], -1, 16)
            s, _ = calculate_qparams(blk.amin(-1), blk.amax(-1), scheme.weights, global_scale=gs)
            c = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": s, "weight_global_scale": gs}, scheme)
            out.update({f"{base}.{n}": t for n, t in c.items()})
        else:
            out[k] = w
    ct_dir = tmp_path / "ct"
    shutil.copytree(tiny_model_dir, ct_dir)
    save_file(out, ct_dir / "model.safetensors")
    cfg = json.loads((ct_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group"}}},
    }
    (ct_dir / "config.json").write_text(json.dumps(cfg))
    m = nvfp4.from_compressed_tensors(ct_dir)
    q = m.model.layers[1].mlp.down_proj
    assert isinstance(q, NVFP4Linear)
    assert torch.equal(q.weight_packed, out["model.layers.1.mlp.down_proj.weight_packed"])
    assert torch.isfinite(m(input_ids=torch.randint(0, 256, (1, 5))).logits).all()


def test_truncated_safetensors_fails_clearly(tiny_model_dir, tmp_path):
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config())
    m.save_pretrained(tmp_path / "q")
    f = tmp_path / "q" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(NVFP4CheckpointError, match="truncated"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(NVFP4CheckpointError, match="not a readable safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")


def test_config_disagreeing_with_tensors_fails_clearly(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["quantization_config"] = NVFP4Config().to_dict()  # claims NVFP4 but the tensors are dense
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NVFP4CheckpointError, match="disagrees with the tensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "d")


def test_config_validation_and_serialisation():
    with pytest.raises(ValueError, match="awq"):
        NVFP4Config(method="awq")
    with pytest.raises(ValueError, match="only"):
        NVFP4Config(format="mxfp4")
    d = NVFP4Config(method="mse").to_dict()
    assert d["quant_method"] == QUANT_METHOD and d["method"] == "mse" and d["modules_to_not_convert"] == ["lm_head"]
    assert QUANT_METHOD != "nvfp4"  # transformers owns that name
