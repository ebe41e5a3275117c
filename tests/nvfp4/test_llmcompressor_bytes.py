"""RTN bytes through every entry point == llm-compressor's NVFP4A16 / compressed-tensors on the same weights.

* against a real llm-compressor artifact (``tests/fixtures/llmcompressor_nvfp4a16``, made once by
  ``tests/fixtures/make_llmcompressor_fixture.py``): a tiny bf16 Llama with heavy-tailed weights;
* against compressed-tensors' own functions (``generate_gparam``, ``calculate_qparams``, ``NVFP4PackedCompressor``,
  fused q/k/v and gate/up global scales as llm-compressor's observers fuse them) on fresh random weights in float32,
  bfloat16 and float16, through ``from_pretrained`` → ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import nvfp4
import pytest
import torch
from nvfp4 import NVFP4Config
from nvfp4.cli import quantize_with_method
from nvfp4.hf import from_compressed_tensors
from nvfp4.linear import DEFAULT_FUSED_GROUPS
from safetensors.torch import load_file
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llmcompressor_nvfp4a16"
QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _differing(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    """Quantized tensors of ``ref`` that ``ours`` lacks or holds with other bytes (dtype included)."""
    keys = [k for k in ref if k.endswith(QUANT_SUFFIXES)]
    assert keys, "reference has no NVFP4 tensors"
    return [
        k
        for k in keys
        if k not in ours or ours[k].dtype != ref[k].dtype or not torch.equal(_bytes(ours[k]), _bytes(ref[k]))
    ]


def _saved(model, path: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(path)
    return load_file(path / "model.safetensors")


# ---- the llm-compressor artifact -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llmc() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "nvfp4a16" / "model.safetensors")


def test_fixture_is_what_the_script_says():
    versions = json.loads((FIXTURE / "versions.json").read_text())
    assert versions["llmcompressor"] and versions["compressed_tensors"]
    cfg = json.loads((FIXTURE / "nvfp4a16" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "nvfp4-pack-quantized"
    dense = load_file(FIXTURE / "dense" / "model.safetensors")
    assert {t.dtype for t in dense.values()} == {torch.bfloat16}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_from_pretrained_save_pretrained_matches_llmcompressor(llmc, tmp_path, dtype):
    # dtype=None loads as the checkpoint (bf16); float32 is what nvfp4-quantize and `qerl train` use on CPU: the
    # weights are still quantized in their checkpoint dtype
    kw = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(FIXTURE / "dense", quantization_config=NVFP4Config(), **kw)
    ours = _saved(model, tmp_path / "q")
    assert _differing(ours, llmc) == []
    if dtype in (None, torch.bfloat16):  # same dense parts too: the whole file holds the same tensors
        assert set(ours) == set(llmc)
        assert all(torch.equal(_bytes(ours[k]), _bytes(llmc[k])) for k in llmc)


def test_quantize_model_and_codec_match_llmcompressor(llmc, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(FIXTURE / "dense", dtype=torch.bfloat16)
    dense = {k: v.detach().clone() for k, v in model.state_dict().items()}
    nvfp4.quantize_model(model, progress=False)
    assert _differing(_saved(model, tmp_path / "q"), llmc) == []
    # nvfp4.quantize on a lone tensor: the same bytes where llm-compressor's fused global scale is the tensor's own
    # (o_proj, down_proj are in no fused group); fused members with the group's scale
    for name in [k.removesuffix(".weight_packed") for k in llmc if k.endswith(".weight_packed")]:
        q = nvfp4.quantize(dense[f"{name}.weight"], global_scale=llmc[f"{name}.weight_global_scale"])
        assert _differing(q.state_dict(name + ".weight"), {k: v for k, v in llmc.items() if k.startswith(name + ".")}) == []
        if name.endswith(("o_proj", "down_proj")):
            assert torch.equal(nvfp4.quantize(dense[f"{name}.weight"]).global_scale, llmc[f"{name}.weight_global_scale"])


def test_nvfp4_quantize_cli_path_matches_llmcompressor(llmc, tmp_path):
    # what `nvfp4-quantize --method rtn` runs on CPU (float32 compute) before saving in bf16
    model = quantize_with_method(FIXTURE / "dense", "rtn", dtype=torch.float32)
    assert _differing(_saved(model.to(torch.bfloat16), tmp_path / "q"), llmc) == []


def test_llmcompressor_artifact_loads_as_ours(tmp_path):
    theirs = from_compressed_tensors(FIXTURE / "nvfp4a16")
    ours = AutoModelForCausalLM.from_pretrained(FIXTURE / "dense", quantization_config=NVFP4Config())
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(theirs(ids).logits, ours(ids).logits)


def test_float32_arithmetic_is_an_option_with_other_bytes():
    w = load_file(FIXTURE / "dense" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    native, fp32 = nvfp4.quantize(w), nvfp4.quantize(w, compute_dtype=torch.float32)
    assert fp32.global_scale.item() == pytest.approx(448 * 6 / w.abs().amax().float().item(), rel=1e-6)
    assert native.global_scale.item() == torch.tensor(448 * 6 / w.abs().amax().float().item()).bfloat16().item()


# ---- compressed-tensors' own functions on fresh random weights --------------------------------------------------


def _compressed_tensors_reference(dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What llm-compressor's NVFP4A16 writes for ``dense``, from compressed-tensors' functions in the weights' dtype."""
    ct_nvfp4 = pytest.importorskip("compressed_tensors.compressors.nvfp4.base")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    names = [k.removesuffix(".weight") for k, v in dense.items() if "layers." in k and k.endswith("proj.weight")]
    out = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        group = next((g for g in DEFAULT_FUSED_GROUPS if child in g), (child,))
        members = [dense[f"{parent}.{c}.weight"] for c in group if f"{parent}.{c}.weight" in dense]
        absmax = torch.stack([m.abs().amax() for m in members]).amax()  # as llm-compressor's fused observers
        gs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
        w = dense[f"{name}.weight"]
        blocks = w.reshape(w.shape[0], -1, 16)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
        ct = ct_nvfp4.NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
        out |= {f"{name}.{k}": v for k, v in ct.items()}
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_from_pretrained_matches_compressed_tensors(tmp_path, dtype, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):  # heavy tails, rows of different scales, a zero block, tiny negatives
                t = torch.distributions.StudentT(torch.tensor(2.5)).sample(mod.weight.shape) * 0.05
                mod.weight.copy_(t * (0.25 + 2 * torch.rand(mod.weight.shape[0], 1, generator=g)))
                mod.weight[1, :16] = 0
                mod.weight[2, 16:32] = -1e-4
    model.to(dtype).save_pretrained(tmp_path / "dense")
    dense = load_file(tmp_path / "dense" / "model.safetensors")
    ref = _compressed_tensors_reference(dense)
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=NVFP4Config(), dtype=dtype)
    assert _differing(_saved(q, tmp_path / "q"), ref) == []
    if dtype != torch.float32:  # a float32 load of the same checkpoint quantizes in the checkpoint's dtype
        q32 = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=NVFP4Config(), dtype=torch.float32)
        assert _differing(_saved(q32.to(dtype), tmp_path / "q32"), ref) == []


def test_float16_small_amax_falls_back_like_compressed_tensors():
    from compressed_tensors.quantization.utils import generate_gparam

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(torch.float16) * 0.005
    absmax = w.abs().amax()
    with pytest.warns(UserWarning, match="compute_dtype=torch.float32"):
        q = nvfp4.quantize(w)
    assert torch.equal(q.global_scale, generate_gparam(-absmax.reshape(1), absmax.reshape(1))) and q.global_scale.item() == 1.0
    full = nvfp4.quantize(w, compute_dtype=torch.float32)
    err = lambda x: (x.dequantize(torch.float32) - w.float()).norm().item()  # noqa: E731
    assert err(full) < 0.8 * err(q)
