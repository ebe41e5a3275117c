"""MXFP4 checkpoints on vLLM's CPU engine through our plugin: the offline default model quantized with
``NVFP4Config(format="mxfp4")`` (compressed-tensors ``MXFP4A16``) is claimed by the plugin, dequantized exactly
(:func:`nvfp4.mxfp4.dequantize`, fused q/k/v and gate/up included), and generates what our transformers path
(``NVFP4Linear(format="mxfp4")``) generates, both in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm_test_helpers import (
    EAGER,
    ENGINE_DTYPE,
    check_forced,
    compare_forced,
    eos_ids,
    hf_forced,
    nvfp4_offline_checkpoint,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
N_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return nvfp4_offline_checkpoint("mxfp4")


@pytest.fixture(scope="module")
def engine(ckpt):
    from qerl_vllm.engine import VLLMEngine

    eng = VLLMEngine(ckpt, max_lora_rank=8, seed=0, max_model_len=256, kv_cache_memory_bytes=128 << 20, enforce_eager=EAGER,
                     dtype=ENGINE_DTYPE)  # fmt: skip
    yield eng
    eng.close()


def test_checkpoint_is_mxfp4a16_and_the_plugin_claims_it(ckpt, engine):
    from qerl_vllm.quant import QeRLNVFP4Config, _compressed_tensors_format

    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and _compressed_tensors_format(qc).name == "mxfp4"
    assert (
        QeRLNVFP4Config.override_quantization_method(qc, None) == "nvfp4_w4a16"
    )  # ours (dequantized once), CPU and CUDA
    assert QeRLNVFP4Config.from_config(qc).weight_format.name == "mxfp4"

    def kinds(model):
        return sorted({type(m.quant_method).__name__ for m in model.modules() if hasattr(m, "quant_method")})

    assert "NVFP4DequantLinearMethod" in engine.llm.apply_model(kinds)[0]


def test_engine_layers_compute_with_the_mxfp4_dequantization(ckpt, engine):
    """The fused q/k/v and the down projection of layer 0 give ``x · dequant(W)ᵀ`` of the checkpoint's tensors (vLLM's
    CPU linear hands its weight to oneDNN after loading, so the product is compared, not the weight). The inputs go
    in the engine's dtype to the layers' device (CUDA: bf16 on the GPU); the reference is their exact product."""
    from nvfp4 import mxfp4
    from safetensors.torch import load_file

    tensors = load_file(ckpt / "model.safetensors")
    prefix = "model.layers.0."

    def deq(name):
        return mxfp4.dequantize(tensors[f"{prefix}{name}.weight_packed"], tensors[f"{prefix}{name}.weight_scale"],
                                torch.float32)  # fmt: skip

    qkv_ref = torch.cat([deq("self_attn.q_proj"), deq("self_attn.k_proj"), deq("self_attn.v_proj")])
    down_ref = deq("mlp.down_proj")
    dtype = getattr(torch, ENGINE_DTYPE)
    x = torch.randn(5, qkv_ref.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    h = torch.randn(5, down_ref.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)

    def run(model):
        layer = model.model.layers[0]
        qkv_proj, down_proj = (getattr(m, "base_layer", m) for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
        with torch.no_grad():  # the base layers (the engine wraps them for LoRA); a float32 copy of each output back
            return tuple(proj(a.to(proj.weight.device))[0].to(device="cpu", dtype=torch.float32, copy=True)
                         for proj, a in ((qkv_proj, x), (down_proj, h)))  # fmt: skip

    qkv, down = engine.llm.apply_model(run)[0]
    # float32: summation order only; bf16: the output's rounding (2^-9 relative) and cuBLAS's bf16 partial sums
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    given_x, given_h = x.float(), h.float()  # the inputs the layers had, exactly
    torch.testing.assert_close(qkv, given_x @ qkv_ref.T, **tol)
    torch.testing.assert_close(down, given_h @ down_ref.T, **tol)
    shuffled = torch.cat([deq("self_attn.k_proj"), deq("self_attn.q_proj"), deq("self_attn.v_proj")])
    wrong = given_x @ shuffled[: qkv.shape[1]].T
    assert not torch.allclose(qkv, wrong, rtol=1e-2, atol=1e-2)  # the comparison can tell shards apart


def test_greedy_matches_hf(ckpt, engine):
    import nvfp4

    prompt_ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    ours = engine.generate(prompt_ids, {"temperature": 0.0, "max_tokens": N_TOKENS, "min_tokens": N_TOKENS}, lora=None)
    model = nvfp4.load_nvfp4_checkpoint(ckpt, dtype=torch.float32).eval()
    assert model.model.layers[0].mlp.up_proj.format == "mxfp4"
    with nvfp4.cache_dequantized(model, torch.float32):
        cmp = compare_forced(ours, hf_forced(model, prompt_ids, ours, eos_ids(model)))
    print(f"\n[mxfp4] {cmp}")
    check_forced(cmp)
