"""MXFP4 through transformers: ``NVFP4Config(format="mxfp4")`` (and ``MXFP4Config``) quantizes on load, saves the
compressed-tensors ``MXFP4A16`` config and tensors, reloads the same bytes; bytes == llm-compressor's ``MXFP4A16``
artifact (``tests/fixtures/llmcompressor_mxfp4a16``, made by ``tests/fixtures/make_llmcompressor_fixture.py
MXFP4A16`` from the NVFP4 fixture's bf16 checkpoint) and == compressed-tensors' own functions on fresh random weights
in float32/bfloat16/float16, through ``from_pretrained`` → ``save_pretrained``; the llm-compressor artifact loads."""

from __future__ import annotations

import json
from pathlib import Path

import nvfp4
import pytest
import torch
from nvfp4 import MXFP4Config, NVFP4Config, NVFP4Linear
from nvfp4.hf import QUANT_METHOD, NVFP4CheckpointError, from_compressed_tensors
from nvfp4.mxfp4 import GROUP_SIZE
from safetensors.torch import load_file
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DENSE = FIXTURES / "llmcompressor_nvfp4a16" / "dense"
LLMC = FIXTURES / "llmcompressor_mxfp4a16"
QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale")


def _differing(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    """Quantized tensors of ``ref`` that ``ours`` lacks or holds with other bytes (dtype included), and quantized
    tensors ``ours`` has beyond ``ref`` (a global scale)."""
    keys = [k for k in ref if k.endswith(QUANT_SUFFIXES)]
    assert keys, "reference has no quantized tensors"
    bad = [k for k in keys if k not in ours or ours[k].dtype != ref[k].dtype or not torch.equal(ours[k], ref[k])]
    return bad + [k for k in ours if k.endswith(QUANT_SUFFIXES) and k not in ref]


def _saved(model, path: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(path)
    return load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def llmc() -> dict[str, torch.Tensor]:
    return load_file(LLMC / "mxfp4a16" / "model.safetensors")


# ---- the config --------------------------------------------------------------------------------------------------


def test_config_accepts_format_names_and_writes_llmcompressors_mxfp4a16_config():
    theirs = json.loads((LLMC / "mxfp4a16" / "config.json").read_text())["quantization_config"]
    for fmt in ("mxfp4", "MXFP4", "mxfp4-pack-quantized"):
        cfg = NVFP4Config(format=fmt)
        assert cfg.format == "mxfp4-pack-quantized" and cfg.weight_block_size == GROUP_SIZE
        d = cfg.to_dict()
        ours = d.pop("qerl")
        assert d == {k: v for k, v in theirs.items() if k != "version"}  # what llm-compressor writes, key for key
        assert ours["weight_block_size"] == 32 and ours["method"] == "rtn"
    assert MXFP4Config().to_dict() == NVFP4Config(format="mxfp4").to_dict()
    old = NVFP4Config(format="mxfp4", serialization=QUANT_METHOD).to_dict()
    assert old["format"] == "mxfp4-pack-quantized" and old["weight_block_size"] == 32
    back = NVFP4Config.from_compressed_tensors_dict(theirs)
    assert back.format == "mxfp4-pack-quantized" and back.modules_to_not_convert == ["lm_head"]


def test_nvfp4_config_unchanged():
    theirs = json.loads((FIXTURES / "llmcompressor_nvfp4a16" / "nvfp4a16" / "config.json").read_text())
    theirs = {k: v for k, v in theirs["quantization_config"].items() if k != "version"}
    dicts = [NVFP4Config(format=f).to_dict() for f in (None, "nvfp4", "nvfp4-pack-quantized")[1:]]
    dicts.append(NVFP4Config().to_dict())
    for d in dicts:
        assert json.dumps(d) == json.dumps(dicts[-1])
        assert {k: v for k, v in d.items() if k != "qerl"} == theirs
        assert d["qerl"]["weight_block_size"] == 16 and "format" not in d["qerl"]
    old = NVFP4Config(serialization=QUANT_METHOD).to_dict()
    assert old["format"] == "nvfp4-pack-quantized" and old["weight_block_size"] == 16


def test_config_errors_name_what_is_supported():
    with pytest.raises(ValueError, match="MXFP4 supports method='rtn' only"):
        NVFP4Config(format="mxfp4", method="mse")
    with pytest.raises(ValueError, match="MXFP4 supports method='rtn' only"):
        MXFP4Config(method="gptq", calibration_data=[torch.tensor([1, 2])])
    with pytest.raises(ValueError, match=r"choose one of \['mxfp4', 'mxfp4-pack-quantized', 'nvfp4'"):
        NVFP4Config(format="fp8")
    with pytest.raises(ValueError, match="use NVFP4Config"):
        MXFP4Config(format="nvfp4")
    theirs = json.loads((LLMC / "mxfp4a16" / "config.json").read_text())["quantization_config"]
    bad = json.loads(json.dumps(theirs))
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(NVFP4CheckpointError, match="not MXFP4 weight-only"):
        NVFP4Config.from_compressed_tensors_dict(bad)


# ---- the llm-compressor artifact ---------------------------------------------------------------------------------


def test_fixture_is_what_the_script_says():
    versions = json.loads((LLMC / "versions.json").read_text())
    assert versions["scheme"] == "MXFP4A16" and versions["llmcompressor"] and versions["compressed_tensors"]
    cfg = json.loads((LLMC / "mxfp4a16" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mxfp4-pack-quantized"


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_from_pretrained_save_pretrained_matches_llmcompressor(llmc, tmp_path, dtype):
    kw = {} if dtype is None else {"dtype": dtype}  # float32 loads still quantize in the checkpoint's bf16
    model = AutoModelForCausalLM.from_pretrained(DENSE, quantization_config=NVFP4Config(format="mxfp4"), **kw)
    assert model.model.layers[0].mlp.up_proj.format == "mxfp4"
    ours = _saved(model, tmp_path / "q")
    assert _differing(ours, llmc) == []
    if dtype is None:  # the whole file: same tensors, same bytes
        assert set(ours) == set(llmc) and all(torch.equal(ours[k], llmc[k]) for k in llmc)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mxfp4-pack-quantized" and cfg["config_groups"]["group_0"]["weights"]["group_size"] == 32


def test_quantize_model_and_cli_path_match_llmcompressor(llmc, tmp_path):
    from nvfp4.cli import quantize_with_method

    model = AutoModelForCausalLM.from_pretrained(DENSE, dtype=torch.bfloat16)
    nvfp4.quantize_model(model, format="mxfp4", progress=False)
    model.config.quantization_config = NVFP4Config(format="mxfp4")  # what from_pretrained would have set
    assert _differing(load_file_of(model, tmp_path / "a"), llmc) == []
    cli = quantize_with_method(DENSE, "rtn", dtype=torch.float32, format="mxfp4")  # nvfp4-quantize --format mxfp4
    assert _differing(_saved(cli.to(torch.bfloat16), tmp_path / "b"), llmc) == []


def load_file_of(model, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    path.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "m.safetensors"))
    return load_file(path / "m.safetensors")


def test_llmcompressor_artifact_loads_and_saves_its_own_bytes(llmc, tmp_path):
    theirs = from_compressed_tensors(LLMC / "mxfp4a16")
    assert nvfp4.hf.nvfp4_checkpoint_kind(LLMC / "mxfp4a16") == "compressed-tensors"
    layer = theirs.model.layers[1].self_attn.o_proj
    assert isinstance(layer, NVFP4Linear) and layer.format == "mxfp4" and layer.uses_nvfp4_ops
    ours = AutoModelForCausalLM.from_pretrained(DENSE, quantization_config=NVFP4Config(format="mxfp4"))
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(theirs(ids).logits, ours(ids).logits)
    # save → reload: identical bytes, through both loaders
    saved = _saved(theirs, tmp_path / "q")
    assert _differing(saved, llmc) == []
    again = nvfp4.load_nvfp4_checkpoint(tmp_path / "q")
    assert _differing(_saved(again, tmp_path / "q2"), llmc) == []
    theirs.config.quantization_config.serialization = QUANT_METHOD  # the QeRL-only config: plain from_pretrained
    theirs.save_pretrained(tmp_path / "old")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "old")
    assert plain.model.layers[0].self_attn.q_proj.format == "mxfp4"
    assert _differing(_saved(plain, tmp_path / "q3"), llmc) == []
    assert torch.equal(plain(ids).logits, ours(ids).logits)


def test_nvfp4_tensors_under_an_mxfp4_config_fail_clearly(tmp_path):
    m = AutoModelForCausalLM.from_pretrained(DENSE, quantization_config=NVFP4Config())
    m.save_pretrained(tmp_path / "q")
    cfg_path = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = NVFP4Config(format="mxfp4").to_dict()
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises((ValueError, RuntimeError), match="weight_scale|weight_global_scale|mismatch|size"):
        nvfp4.load_nvfp4_checkpoint(tmp_path / "q")


# ---- compressed-tensors' own functions on fresh random weights ---------------------------------------------------


def _compressed_tensors_reference(dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What llm-compressor's MXFP4A16 writes for ``dense``, from compressed-tensors' functions in the weights' dtype."""
    ct_mxfp4 = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    out = {}
    for key, w in dense.items():
        if "layers." not in key or not key.endswith("proj.weight"):
            continue
        groups = w.reshape(w.shape[0], -1, GROUP_SIZE)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        ct = ct_mxfp4.MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        out |= {f"{key.removesuffix('.weight')}.{k}": v for k, v in ct.items()}
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_from_pretrained_matches_compressed_tensors(tmp_path, dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):  # heavy tails, rows of different scales, a zero group, tiny negatives
                t = torch.distributions.StudentT(torch.tensor(2.5)).sample(mod.weight.shape) * 0.05
                mod.weight.copy_(t * (0.25 + 2 * torch.rand(mod.weight.shape[0], 1, generator=g)))
                mod.weight[1, :32] = 0  # E = 0 in fp32/bf16: outside the transcode's window, its byte kept
                mod.weight[2, 32:64] = -1e-4
    model.to(dtype).save_pretrained(tmp_path / "dense")
    dense = load_file(tmp_path / "dense" / "model.safetensors")
    ref = _compressed_tensors_reference(dense)
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=MXFP4Config(), dtype=dtype)
    assert _differing(_saved(q, tmp_path / "q"), ref) == []
    again = nvfp4.load_nvfp4_checkpoint(tmp_path / "q", dtype=dtype)  # reload: the same bytes
    assert _differing(_saved(again, tmp_path / "q2"), ref) == []
    x = torch.randint(0, 256, (1, 6))
    assert torch.equal(q(x).logits, again(x).logits)


_STOCK_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)  # compressed-tensors decompresses
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[2]))).logits
assert "nvfp4" not in sys.modules
torch.save(logits, sys.argv[3])
"""


def test_saved_checkpoint_loads_in_stock_transformers(tmp_path):
    """Our MXFP4 checkpoint in a process without ``import nvfp4`` (transformers + compressed-tensors decompress it):
    the same logits as our ``NVFP4Linear(format="mxfp4")`` model (bf16)."""
    import subprocess
    import sys

    m = AutoModelForCausalLM.from_pretrained(DENSE, quantization_config=MXFP4Config(), dtype=torch.bfloat16)
    m.save_pretrained(tmp_path / "q")
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = m(ids).logits
    out = tmp_path / "stock.pt"
    args = [sys.executable, "-c", _STOCK_LOAD, str(tmp_path / "q"), json.dumps(ids.tolist()), str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = torch.load(out)
    rel = ((stock.float() - ours.float()).norm() / ours.float().norm()).item()
    assert rel < 1e-2, f"stock transformers decoded other weights than ours (relative logit error {rel:.2e})"
