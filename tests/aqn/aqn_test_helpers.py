"""Shared helpers for tests/aqn (tiny random models, an engine-style model, column-scaling reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def tiny_model(arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, random_norms: bool = True):
    """A 2-layer random HF causal LM; norm weights drawn in [0.5, 1.5] so ``Z/w`` is not trivially ``Z``."""
    import transformers

    cfg_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "gemma3_text": transformers.Gemma3TextConfig,  # (1 + w) ⊙ n(x) norms
        "cohere": transformers.CohereConfig,  # bias-free LayerNorms: w ⊙ (x - mean)/std
    }[arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**TINY), dtype=torch.float32)
    if random_norms:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model.to(dtype).eval()


def tokens(batch: int = 2, length: int = 7, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(model: nn.Module, snap: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == snap.keys()
    for k, v in snap.items():
        assert state[k].dtype == v.dtype, k
        assert torch.equal(state[k], v), k


def scale_input_columns(model: nn.Module, groups, noise: dict[str, torch.Tensor]) -> None:
    """Reference for the equivalence: ``W[:, j] *= 1 + Z_j / w_j`` on every linear fed by a noised norm."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for g in groups:
            w = g.weight.detach().double()
            factor = 1.0 + noise[g.weight_name].double() / w
            for lin in g.linear_names:
                W = modules[lin].weight
                W.copy_((W.double() * factor[None, :]).to(W.dtype))


# --------------------------------------------------------------------------- an engine-style (vLLM-like) model
class RMSNorm(nn.Module):
    """vLLM-style: ``forward(x, residual)`` fuses the residual add in place and returns ``(out, residual)``."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual.add_(x)  # in place, like fused_add_rms_norm
        x.copy_(self._norm(residual))
        return x, residual


class QKVParallelLinear(nn.Module):
    """Not an nn.Linear: returns ``(out, bias)`` like vLLM's linears."""

    def __init__(self, d: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, d) / d**0.5)

    def forward(self, input_: torch.Tensor):
        return F.linear(input_, self.weight), None


class MergedColumnParallelLinear(QKVParallelLinear):
    pass


class RowParallelLinear(QKVParallelLinear):
    pass


class EngineAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(d, 3 * d)
        self.o_proj = RowParallelLinear(d, d)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.chunk(3, dim=-1)
        att = torch.softmax(q @ k.T / q.shape[-1] ** 0.5 + torch.triu(torch.full_like(q @ k.T, -1e9), 1), -1)
        out, _ = self.o_proj(att @ v)
        return out


class EngineMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(d, 4 * d)
        self.down_proj = RowParallelLinear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu, _ = self.gate_up_proj(x)
        g, u = gu.chunk(2, dim=-1)
        out, _ = self.down_proj(F.silu(g) * u)
        return out


class EngineLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = EngineAttention(d)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = EngineMLP(d)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class EngineModel(nn.Module):
    """Flattened tokens ``[T]`` + ``positions``; returns final hidden states ``[T, d]`` (logits are separate)."""

    def __init__(self, d: int = 32, layers: int = 2, vocab: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(EngineLayer(d) for _ in range(layers))
        self.norm = RMSNorm(d)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden
