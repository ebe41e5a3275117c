"""Tiny random model configs for tests (importable from any test file: tests/ is on pytest's pythonpath)."""

from __future__ import annotations


def tiny_config(arch: str = "llama", **kw):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    common.update(kw)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**common)
