import warnings

import aqn
import pytest
import torch
from aqn_test_helpers import ARCHS, EngineModel, tiny_model
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread")


def expected_groups(layers: int = 2) -> list[tuple[str, tuple[str, ...]]]:
    out = []
    for i in range(layers):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm", tuple(f"{p}.self_attn.{x}_proj" for x in "qkv")))
        out.append((f"{p}.post_attention_layernorm", (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_architectures_norm_to_linear_pairs(arch):
    model = tiny_model(arch)
    groups, skipped = aqn.find_norm_linear_pairs(model, return_skipped=True)
    assert [(g.norm_name, g.linear_names) for g in groups] == expected_groups()
    assert all(g.found_by == "trace" and g.num_channels == 64 and not g.feeds_output_embeddings for g in groups)
    assert all(g.weight is dict(model.named_parameters())[g.weight_name] for g in groups)
    # o_proj / down_proj are fed by no norm
    fed = {lin for g in groups for lin in g.linear_names}
    assert not any(n.endswith(("o_proj", "down_proj")) for n in fed)
    assert "model.norm" in skipped  # final norm → lm_head excluded by default, as in the paper
    if arch == "qwen3":  # per-head q_norm / k_norm feed rotary, not a linear: never noised
        assert {f"model.layers.{i}.self_attn.{q}_norm" for i in range(2) for q in "qk"} <= set(skipped)


def test_final_norm_is_an_option():
    groups = aqn.find_norm_linear_pairs(tiny_model("llama"), include_final_norm=True)
    last = groups[-1]
    assert last.norm_name == "model.norm" and last.linear_names == ("lm_head",) and last.feeds_output_embeddings


def test_tracing_restores_training_flags():
    model = tiny_model("llama").train()
    aqn.find_norm_linear_pairs(model)
    assert all(m.training for m in model.modules())


def test_engine_style_model_with_fused_linears_and_fused_add_norm():
    """vLLM-like classes: not nn.Linear, fused qkv / gate_up, in-place fused residual-add norms returning tuples."""
    model = EngineModel()
    ids = torch.arange(5) % 64
    groups = aqn.find_norm_linear_pairs(model, (ids, torch.arange(5)))
    assert [(g.norm_name, g.linear_names) for g in groups] == [
        ("layers.0.input_layernorm", ("layers.0.self_attn.qkv_proj",)),
        ("layers.0.post_attention_layernorm", ("layers.0.mlp.gate_up_proj",)),
        ("layers.1.input_layernorm", ("layers.1.self_attn.qkv_proj",)),
        ("layers.1.post_attention_layernorm", ("layers.1.mlp.gate_up_proj",)),
    ]
    assert all(g.found_by == "trace" for g in groups)


def test_convention_fallback_when_the_forward_cannot_be_traced():
    model = EngineModel()  # default example input (input_ids only) misses `positions`
    with pytest.warns(UserWarning, match="falling back"):
        groups = aqn.find_norm_linear_pairs(model)
    assert [g.found_by for g in groups] == ["convention"] * 4
    assert groups[0].linear_names == ("layers.0.self_attn.qkv_proj",)
    with pytest.raises(TypeError):
        aqn.find_norm_linear_pairs(model, method="trace")


def test_peft_wrapped_model_reports_the_outermost_linears():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, cfg)
    groups = aqn.find_norm_linear_pairs(wrapped)
    assert len(groups) == 4
    first = groups[0]
    assert first.norm_name.endswith("model.layers.0.input_layernorm")
    assert [n.rsplit(".", 1)[-1] for n in first.linear_names] == ["q_proj", "k_proj", "v_proj"]
    assert not any("lora_" in n or "base_layer" in n for g in groups for n in g.linear_names)


class _LayerNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.ln = nn.LayerNorm(8)  # has a bias: not RMSNorm-style
        self.fc = nn.Linear(8, 16)

    def forward(self, input_ids):
        return self.fc(self.ln(self.emb(input_ids)))


class _NormNotFeedingLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)

    def forward(self, input_ids):
        return self.norm(self.fc(torch.ones(*input_ids.shape, 8)))


@pytest.mark.parametrize("net", [_LayerNormNet, _NormNotFeedingLinear, lambda: nn.Sequential(nn.Linear(4, 4))])
def test_no_rmsnorm_is_a_clear_error(net):
    model = net()
    name = type(model).__name__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=f"found no RMSNorm-style module feeding a linear layer in {name}; AQN"):
            aqn.find_norm_linear_pairs(model)


def test_torch_rmsnorm_is_found():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.norm = nn.RMSNorm(8)
            self.up = nn.Linear(8, 32)

        def forward(self, input_ids):
            return self.up(self.norm(self.emb(input_ids)))

    (g,) = aqn.find_norm_linear_pairs(Net())
    assert (g.norm_name, g.linear_names) == ("norm", ("up",))


@pytest.mark.parametrize(
    ("config", "router"), [("MixtralConfig", "gate"), ("Qwen3MoeConfig", "gate"), ("GptOssConfig", "router")]
)
def test_moe_layers_post_attention_norm_feeds_router_and_experts(config, router):
    # a mixture-of-experts MLP has no nn.Linear: its router and fused experts call F.linear on their own parameters;
    # the norm before it was reported as feeding nothing and never noised (AQN on the attention norms only)
    import transformers

    cfg = getattr(transformers, config)(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    groups, skipped = aqn.find_norm_linear_pairs(model, return_skipped=True)
    by_norm = {g.norm_name: g.linear_names for g in groups}
    for i in range(2):
        p = f"model.layers.{i}"
        assert by_norm[f"{p}.post_attention_layernorm"] == (f"{p}.mlp.{router}", f"{p}.mlp.experts")
        assert f"{p}.post_attention_layernorm" not in skipped
    convention = aqn.find_norm_linear_pairs(model, method="convention")
    assert {g.norm_name: set(g.linear_names) for g in convention} == {k: set(v) for k, v in by_norm.items()}
    # and the norm is noised
    w = model.model.layers[0].post_attention_layernorm.weight
    before = w.detach().clone()
    with aqn.NormNoise(model, groups=groups).apply(1e-2, seed=0):
        assert not torch.equal(w, before)
    assert torch.equal(w, before)


@pytest.mark.parametrize("config", ["Gemma2Config", "Gemma3TextConfig"])
def test_convention_fallback_on_gemma_sandwich_norms_names_the_pre_feedforward_norm(config):
    # Gemma 2/3: post_attention_layernorm scales the attention output, pre_feedforward_layernorm feeds the MLP; the
    # fallback noised the former, claiming it fed mlp.gate_proj / up_proj, and left the MLP's input norm clean
    import transformers

    cfg = getattr(transformers, config)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    traced = aqn.find_norm_linear_pairs(model)

    def broken_forward(_model):
        raise RuntimeError("this forward needs inputs the tracer cannot make")

    with pytest.warns(UserWarning, match="falling back"):
        fallback = aqn.find_norm_linear_pairs(model, broken_forward)
    assert all(g.found_by == "convention" for g in fallback)
    assert [(g.norm_name, g.linear_names) for g in fallback] == [(g.norm_name, g.linear_names) for g in traced]
    assert "model.layers.0.pre_feedforward_layernorm" in {g.norm_name for g in fallback}
