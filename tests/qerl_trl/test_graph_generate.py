"""``qerl_trl.graph_generate``: the graph-replayed decode loop against transformers' ``generate`` on tiny random models.

Greedy tokens must equal ``generate``'s (static cache, left-padded batch: checks the mask and position handling, EOS
and pad semantics, early stop); sampling is reproducible from a seeded generator; EOS handling (pad after EOS,
``min_new_tokens``); the compiled step is one graph (dynamo + AOT autograd, no inductor: seconds on CPU) that later
calls with other prompt lengths, token counts and temperatures replay without recompiling; input validation.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import pytest
import torch
from qerl_trl.graph_generate import graph_generate, release_graph_state
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

PAD = 1
EOS = 5


_no_op = contextlib.nullcontext


def _model(arch: str = "llama"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch)).eval()


def _prompts(batch: int = 3, length: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts: row i has ``length - 2*i`` real tokens (ids >= 6, so never PAD or EOS)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):
        mask[i, : 2 * i] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def _hf_greedy(model, ids, mask, n: int, **kw) -> torch.Tensor:
    kw = {"min_new_tokens": n, "eos_token_id": None, **kw}
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=PAD,
                          cache_implementation="static", **kw)  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_generate_left_padded(arch):
    model = _model(arch)
    ids, mask = _prompts()
    ref = _hf_greedy(model, ids, mask, 12)
    out = graph_generate(model, ids, mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out.shape == (3, 7 + 12) and out.dtype == torch.long
    assert torch.equal(out, ref)
    # a longer cache (as a training run keeps it fixed) and a second call on the kept state: same tokens
    out2 = graph_generate(model, ids, mask, max_new_tokens=12, do_sample=False, max_cache_len=40)
    assert torch.equal(out2, ref)


@pytest.mark.parametrize("min_new", [0, 6])
def test_greedy_eos_pad_and_early_stop_match_generate(min_new):
    model = _model()
    ids, mask = _prompts()
    free = _hf_greedy(model, ids, mask, 16)
    eos = [int(free[0, 7 + 3]), int(free[1, 7 + 5]), int(free[2, 7 + 8])]  # each row emits one when nothing stops it
    ref = _hf_greedy(model, ids, mask, 16, eos_token_id=eos, min_new_tokens=min_new)
    out = graph_generate(model, ids, mask, max_new_tokens=16, min_new_tokens=min_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=PAD, check_every=3)  # fmt: skip
    assert out.shape == ref.shape and torch.equal(out, ref)
    if min_new == 0:  # every row finished by its 9th token: generate stopped there, so did we
        assert out.shape[1] <= 7 + 9
        assert out[0, 7 + 3] == eos[0] and (out[0, 7 + 4 :] == PAD).all()


def _eos_likely(model, boost: float = 4.0):
    """Add ``boost`` to the EOS logit (a hook on lm_head): most rows finish within a few dozen sampled tokens."""
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = boost
    return model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)


def test_sampling_eos_then_pad():
    model = _model()
    _eos_likely(model)
    ids, mask = _prompts(batch=6, length=8)
    out = graph_generate(model, ids, mask, max_new_tokens=40, eos_token_id=[EOS, 3], pad_token_id=PAD,
                         generator=torch.Generator().manual_seed(0), check_every=4)  # fmt: skip
    gen = out[:, 8:]
    finished = [(row == EOS) | (row == 3) for row in gen]
    ends = [int(f.nonzero()[0]) + 1 if f.any() else gen.shape[1] for f in finished]
    assert sum(f.any() for f in finished) >= 4, gen
    for row, end in zip(gen, ends):
        assert (row[end:] == PAD).all()
    assert gen.shape[1] == max(ends) <= 40  # stops once every row has finished, as generate does
    assert torch.equal(out[:, :8], ids)


def test_min_new_tokens_suppresses_eos():
    model = _model()
    _eos_likely(model)
    ids, mask = _prompts(batch=6, length=8)
    g = torch.Generator().manual_seed(0)
    fixed = graph_generate(model, ids, mask, max_new_tokens=20, min_new_tokens=20, eos_token_id=EOS, generator=g)
    assert fixed.shape == (6, 28) and not (fixed[:, 8:] == EOS).any()
    some = graph_generate(model, ids, mask, max_new_tokens=30, min_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD,
                          generator=g)  # fmt: skip
    assert not (some[:, 8:18] == EOS).any() and (some[:, 18:] == EOS).any()


def test_sampling_reproducible_with_generator():
    model = _model("qwen2")
    ids, mask = _prompts()

    def run(seed: int, temperature: float = 1.0) -> torch.Tensor:
        return graph_generate(model, ids, mask, max_new_tokens=10, min_new_tokens=10, temperature=temperature,
                              generator=torch.Generator().manual_seed(seed))  # fmt: skip

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    cold = run(0, temperature=1e-4)  # temperature -> 0: the greedy tokens
    assert torch.equal(cold, graph_generate(model, ids, mask, max_new_tokens=10, do_sample=False))


def test_compiled_step_is_one_graph_replayed():
    """dynamo + AOT autograd (functionalized in-place updates, as inductor sees them): same tokens as eager, one
    graph, no graph break, no recompile for other prompt lengths / token counts / temperatures / EOS ids."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    ids, mask = _prompts(batch=2, length=7)
    opts = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    calls = [  # (prompt length, max_new, min_new, temperature, eos)
        (7, 9, 9, 1.0, None),
        (5, 12, 0, 0.7, EOS),
        (7, 4, 2, 1.3, [EOS, 3]),
    ]
    for plen, n, mn, temp, eos in calls:
        kw = dict(max_new_tokens=n, min_new_tokens=mn, temperature=temp, eos_token_id=eos, pad_token_id=PAD,
                  max_cache_len=24)  # fmt: skip
        p_ids, p_mask = ids[:, -plen:], mask[:, -plen:]
        got = graph_generate(model, p_ids, p_mask, compile=True, compile_options=opts,
                             generator=torch.Generator().manual_seed(2), **kw)  # fmt: skip
        ref = graph_generate(model, p_ids, p_mask, compile=False, generator=torch.Generator().manual_seed(2), **kw)
        assert torch.equal(got, ref)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    release_graph_state(model)


def test_peft_model():
    from peft import LoraConfig, get_peft_model

    torch._dynamo.reset()
    peft_model = get_peft_model(_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                            init_lora_weights=False)).eval()  # fmt: skip
    ids, mask = _prompts(batch=2)
    ref = _hf_greedy(peft_model, ids, mask, 6)
    opts = {"backend": "eager", "fullgraph": True, "dynamic": False}
    out = graph_generate(peft_model, ids, mask, max_new_tokens=6, do_sample=False, compile=True, compile_options=opts)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, ValueError, "min_new_tokens"),
        ({"max_new_tokens": 4, "min_new_tokens": -1}, ValueError, "min_new_tokens"),
        ({"max_new_tokens": 4, "attention_mask": torch.ones(2, 6, dtype=torch.long)}, ValueError, "attention_mask"),
        ({"max_new_tokens": 4, "input_ids": torch.ones(5, dtype=torch.long)}, ValueError, "input_ids"),
        ({"max_new_tokens": 4, "input_ids": torch.ones(2, 5)}, TypeError, "integer"),
        ({"max_new_tokens": 4, "temperature": 0.0}, ValueError, "temperature"),
        ({"max_new_tokens": 4, "check_every": 0}, ValueError, "check_every"),
        ({"max_new_tokens": 4, "max_cache_len": 8}, ValueError, "max_cache_len"),
        ({"max_new_tokens": 4, "eos_token_id": -2}, ValueError, "eos_token_id"),
        ({"max_new_tokens": 4, "eos_token_id": 10_000}, ValueError, "vocabulary"),
        ({"max_new_tokens": 4, "pad_token_id": -1}, ValueError, "pad_token_id"),
    ],
)
def test_validation(kwargs, error, match):
    model = _model()
    kwargs = {"input_ids": torch.full((2, 5), 7), **kwargs}
    with pytest.raises(error, match=match):
        graph_generate(model, **kwargs)


def test_import_is_light(monkeypatch):
    """The benchmarks import this module alone: no trl (qerl_trl's package imports are lazy). In-process: qerl_trl and
    trl are taken out of ``sys.modules`` (put back afterwards) and any import of trl raises."""

    class BlockTrl:
        def find_spec(self, name, path=None, target=None):
            if name == "trl" or name.startswith("trl."):
                raise ImportError(f"{name} imported")
            return None

    for name in [n for n in sys.modules if n.split(".")[0] in ("qerl_trl", "trl")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [BlockTrl(), *sys.meta_path])
    mod = importlib.import_module("qerl_trl.graph_generate")
    assert callable(mod.graph_generate) and "trl" not in sys.modules


@pytest.mark.gpu
def test_cuda_graphs_default_compile_is_greedy_gpu():
    """The default on CUDA (inductor, ``mode="reduce-overhead"``: CUDA graphs), for a bf16 model with PEFT LoRA and an
    NVFP4 model (MMA-layout Triton kernels with the fused LoRA; every linear a whole number of kernel tiles): each
    generated token is the argmax of an uncompiled full-sequence forward (within bf16 noise: inductor and eager round
    differently, so exact token equality with the eager loop would fail on near-ties), and a second call, replaying
    the recorded graphs, returns the same tokens."""
    from nvfp4 import quantize_model
    from nvfp4.peft import get_peft_model as nvfp4_peft
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=16, target_modules=targets, init_lora_weights=False)
    cfg = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen2", **cfg)).to("cuda", torch.bfloat16).eval()
    quantized = quantize_model(AutoModelForCausalLM.from_config(tiny_config("qwen2", **cfg)), progress=False)
    arms = {"bf16": get_peft_model(base, lora), "nvfp4": nvfp4_peft(quantized.to("cuda", torch.bfloat16), lora)}
    ids, mask = _prompts(batch=3, length=9)
    ids, mask = ids.cuda(), mask.cuda()
    n = 16
    for name, model in arms.items():
        model.eval()
        torch._dynamo.reset()
        out = graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True)
        assert torch.equal(graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True), out)
        full = torch.cat([mask, torch.ones_like(out[:, 9:])], 1)
        pos = (full.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=out, attention_mask=full, position_ids=pos).logits[:, 8:-1].float()
        chosen = logits.gather(-1, out[:, 9:, None]).squeeze(-1)
        gap = logits.amax(-1) - chosen
        tol = 0.05 * logits.std(-1)
        assert torch.isfinite(logits).all() and (gap <= tol).all(), (name, gap.max().item())
        release_graph_state(model)


@pytest.mark.gpu
def test_cuda_graphs_follow_aqn_fp32_norms_gpu():
    """The H100 form of the test below, with the default CUDA compile (inductor, CUDA graphs): a bf16 NVFP4 + LoRA
    model, AQN's fp32 norm storage switched on and off between rollouts. Every generated token of every rollout is
    the argmax of an uncompiled forward of the model as it is at that moment (noise on or off; within bf16 noise), so
    no rollout replays a step recorded for the other configuration (before the fix the noisy rollouts replayed the
    bf16-norm graph: garbage tokens from AQN's first noisy stage)."""
    from aqn import NormNoise
    from nvfp4 import quantize_model
    from nvfp4.peft import get_peft_model as nvfp4_peft
    from peft import LoraConfig

    lora = LoraConfig(r=16, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)
    cfg = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    quantized = quantize_model(AutoModelForCausalLM.from_config(tiny_config("qwen2", **cfg)), progress=False)
    model = nvfp4_peft(quantized.to("cuda", torch.bfloat16), lora).eval()
    ids, mask = _prompts(batch=3, length=9)
    ids, mask = ids.cuda(), mask.cuda()
    n = 12

    def check(out: torch.Tensor) -> None:
        full = torch.cat([mask, torch.ones_like(out[:, 9:])], 1)
        pos = (full.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=out, attention_mask=full, position_ids=pos).logits[:, 8:-1].float()
        gap = logits.amax(-1) - logits.gather(-1, out[:, 9:, None]).squeeze(-1)
        assert torch.isfinite(logits).all() and (gap <= 0.05 * logits.std(-1)).all(), gap.max().item()

    torch._dynamo.reset()
    clean = graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True)
    check(clean)
    noise = NormNoise(model, norm_dtype=torch.float32)
    for step in (1, 2, 3):
        with noise.apply(0.3, seed=0, step=step):
            noisy = graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True)
            check(noisy)
            assert not torch.equal(noisy, clean)
        assert torch.equal(graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True), clean)
    release_graph_state(model)


def test_compiled_step_follows_aqn_fp32_norms():
    """AQN on a bf16 model holds the norm weights in fp32 and hooks the norms for a rollout, which dynamo does not
    guard: the step compiled before the noise must not be replayed on the fp32 storage (it was: garbage rollouts on
    the H100 from AQN's first noisy stage on, a dtype error here). The noisy rollouts decode eagerly (with a warning:
    a step compiled with AQN's hooks still gave garbage on the H100 in the trainer); the clean step compiles once and
    replays."""
    import qerl_trl.graph_generate as gg
    from aqn import NormNoise
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model().to(torch.bfloat16)
    ids, mask = _prompts(batch=2, length=7)
    opts = {"backend": "aot_eager", "fullgraph": False, "dynamic": False}
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, max_cache_len=24)
    clean = graph_generate(model, ids, mask, compile=False, **kw)
    assert torch.equal(graph_generate(model, ids, mask, compile=True, compile_options=opts, **kw), clean)
    noise = NormNoise(model, norm_dtype=torch.float32)
    gg._WARNED_EAGER = False
    for step in (1, 2):
        with noise.apply(0.3, seed=0, step=step):
            with pytest.warns(UserWarning, match="decoding these rollouts eagerly") if step == 1 else _no_op():
                got = graph_generate(model, ids, mask, compile=True, compile_options=opts, **kw)
            assert torch.equal(got, graph_generate(model, ids, mask, compile=False, **kw))
            assert not torch.equal(got, clean)  # σ = 0.3 changes the greedy tokens of this tiny model
    assert torch.equal(graph_generate(model, ids, mask, compile=True, compile_options=opts, **kw), clean)
    assert counters["stats"]["unique_graphs"] == 1  # the clean step, replayed after the noisy rollouts
    release_graph_state(model)
