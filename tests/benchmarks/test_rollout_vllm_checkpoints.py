"""``rollout_vllm.checkpoints(..., nvfp4_only=True)`` (issue #47 item 5): the NVFP4 checkpoint written layer by layer
(``nvfp4.save_pretrained_by_blocks``), never dense on disk, holds the tensors and config the bf16 → NVFP4 path writes
for the same seed, and loads as our NVFP4 model; and the writer's refusals, on CPU at the tiny shapes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rollout_vllm():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import rollout_vllm

        yield rollout_vllm
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_nvfp4_only_checkpoint_equals_the_bf16_path(tmp_path, rollout_vllm):
    both = rollout_vllm.checkpoints("tiny", tmp_path / "a", 8)
    only = rollout_vllm.checkpoints("tiny", tmp_path / "b", 8, nvfp4_only=True)
    assert set(only) == {"nvfp4", "adapter"} and not (only["nvfp4"].parent / "bf16").exists()
    assert len(list(only["nvfp4"].glob("model-*.safetensors"))) == 2 + 3  # one shard per layer, embed, norm, lm_head
    for kind in ("nvfp4", "adapter"):
        a, b = _tensors(both[kind]), _tensors(only[kind])
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
        for k in a:  # bit for bit: packed nibbles, fp8 scales, fp32 global scales, bf16 norms / embeddings / biases
            assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k
    for name in ("config.json", "generation_config.json"):
        assert json.loads((both["nvfp4"] / name).read_text()) == json.loads((only["nvfp4"] / name).read_text())
    ca, cb = (json.loads((p["adapter"] / "adapter_config.json").read_text()) for p in (both, only))
    ca["target_modules"], cb["target_modules"] = sorted(ca["target_modules"]), sorted(cb["target_modules"])
    assert ca == cb  # the same adapter config (PEFT writes its target set in any order)

    import nvfp4

    ids = torch.tensor([[5, 17, 300, 2]])
    ref = nvfp4.load_nvfp4_checkpoint(both["nvfp4"], dtype=torch.bfloat16)
    got = nvfp4.load_nvfp4_checkpoint(only["nvfp4"], dtype=torch.bfloat16)
    assert isinstance(got.model.layers[1].mlp.down_proj, nvfp4.NVFP4Linear)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)


def test_save_pretrained_by_blocks_refuses_what_it_cannot_write(tmp_path):
    import nvfp4
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)  # fmt: skip
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)

    def fill(m):
        m.to_empty(device="cpu")
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)

    with pytest.raises(ValueError, match="calibrates the dense model"):
        nvfp4.save_pretrained_by_blocks(model, tmp_path / "x", ["model.layers.0"], fill, nvfp4.NVFP4Config("gptq"))
    with pytest.raises(ValueError, match=r"\d+ tensors in no block, e.g. \['model.embed_tokens.weight'"):
        nvfp4.save_pretrained_by_blocks(model, tmp_path / "y", ["model.layers.0"], fill)
