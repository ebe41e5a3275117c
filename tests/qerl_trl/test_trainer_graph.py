"""``rollout_engine="graph"``: QeRLGRPOTrainer generating with ``qerl_trl.rollout.graph.generate`` (CPU, eager decode).

Config validation (what graph_generate cannot honour is refused up front); the glue (TRL's left padding, EOS cut,
``(ids, logprobs)``) against ``graph_generate`` called directly with the same seed, and against TRL's own transformers
path when both decode greedily; one seeded training step end to end; TRL's importance-sampling correction on the
engine's sampling logprobs (W4A16 and FP8 rollouts).
"""

from __future__ import annotations

import nvfp4.fp8
import pytest
import torch
from datasets import Dataset
from nvfp4 import NVFP4Linear
from qerl_trl.config import QeRLConfig, QeRLDAPOConfig
from qerl_trl.dapo import QeRLDAPOTrainer
from qerl_trl.policy import load_tokenizer
from qerl_trl.rollout.graph import engine as graph_engine_mod
from qerl_trl.rollout.graph.engine import GraphRollout
from qerl_trl.rollout.graph.generate import graph_generate
from qerl_trl.rollout.transformers import TransformersRollout
from qerl_trl.tasks import load_task
from qerl_trl.trainer import QeRLGRPOTrainer
from tiny_models import tiny_config

MAX_NEW = 8


@pytest.fixture(scope="module")
def tokenizer(offline_model_path):
    return load_tokenizer(offline_model_path)


def tiny_nvfp4_policy(tokenizer, seed: int = 0, eos_boost: float = 0.0):
    """The tiny NVFP4 Llama of test_trainer.py; ``eos_boost`` is added to the EOS logit (a hook on ``lm_head``), so
    that a near-uniform 49k-token policy ends some completions early."""
    import nvfp4
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config("llama", vocab_size=len(tokenizer), max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model = nvfp4.quantize_model(AutoModelForCausalLM.from_config(config), progress=False)
    if eos_boost:
        bias = torch.zeros(config.vocab_size)
        bias[tokenizer.eos_token_id] = eos_boost
        model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias.to(out.dtype))
    return model


def args_for(tmp_path, cls=QeRLConfig, **kw):
    base = dict(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=MAX_NEW, logging_steps=1, save_strategy="no", report_to=[], learning_rate=1e-2,
                gradient_checkpointing=False, aqn_num_stages=2, seed=0, disable_tqdm=True, rollout_engine="graph",
                generation_prompt_cache_len=192)  # fmt: skip
    base.update(kw)
    return cls(**base)


def arithmetic(n: int = 16) -> Dataset:
    return load_task("arithmetic", n_examples=n, demo=False)


def even_token_reward(completions, completion_ids, **kwargs):
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def _prompts(tokenizer) -> list[list[int]]:
    """Three prompts of different lengths (left padding matters), the last one twice."""
    texts = ["What is 2 + 3?", "Compute 17 * 4 and explain each step briefly.", "Hi"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [*ids, ids[-1]]


def _cut_after_eos(rows: torch.Tensor, eos: list[int]) -> list[list[int]]:
    out = []
    for row in rows.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:end])
    return out


# ---------------------------------------------------------------------------------------------------------- config
def test_graph_config_accepts_and_refuses():
    QeRLConfig(output_dir="x", rollout_engine="graph")
    kwargs = {"min_new_tokens": 4, "max_cache_len": 64, "cache_implementation": "static"}
    ok = QeRLConfig(output_dir="x", rollout_engine="graph", rollout_seed_per_prompt=True, top_k=-1, min_p=0.0,
                    generation_kwargs=kwargs)  # fmt: skip
    assert ok.rollout_engine == "graph" and ok.rollout_seed_per_prompt
    QeRLDAPOConfig(output_dir="x", rollout_engine="graph", max_completion_length=16)
    with pytest.raises(ValueError, match="rollout_engine must be"):
        QeRLConfig(output_dir="x", rollout_engine="sglang")
    with pytest.raises(ValueError, match="use_vllm"):
        QeRLConfig(output_dir="x", rollout_engine="graph", use_vllm=True)
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):
        QeRLConfig(output_dir="x", rollout_engine="graph", use_transformers_continuous_batching=True)
    for bad, match in [
        ({"top_p": 0.9}, "top_p=0.9"),
        ({"top_k": 20}, "top_k=20"),
        ({"min_p": 0.05}, "min_p=0.05"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
        ({"generation_kwargs": {"top_p": 0.5}}, "top_p=0.5"),
        ({"generation_kwargs": {"num_beams": 2}}, "num_beams"),
        ({"generation_kwargs": {"suppress_tokens": [3]}}, "suppress_tokens"),
        ({"aqn_mode": "per_forward"}, "per_step"),
    ]:
        with pytest.raises(ValueError, match=match):
            QeRLConfig(output_dir="x", rollout_engine="graph", **bad)
    QeRLConfig(output_dir="x", rollout_engine="graph", aqn=False, aqn_mode="per_forward")  # no AQN: nothing to redraw


# ---------------------------------------------------------------------------------------------------------- glue
def test_graph_path_equals_graph_generate_and_trl_greedy(tmp_path, tokenizer):
    """The trainer's graph path returns exactly what ``graph_generate`` on the same model, same seed, gives after
    TRL's post-processing; and, decoding greedily, exactly what TRL's own transformers path returns."""
    args = args_for(tmp_path, aqn=False, pad_to_multiple_of=8)  # TRL pads prompts to a multiple of 8: both paths do
    model = tiny_nvfp4_policy(tokenizer, eos_boost=9.0)
    trainer = QeRLGRPOTrainer(model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer)
    prompts = _prompts(tokenizer)
    eos, pad = trainer.eos_token_ids, tokenizer.pad_token_id
    assert trainer.generation_config.max_new_tokens == MAX_NEW and trainer.generation_config.do_sample

    torch.manual_seed(1234)
    assert isinstance(trainer.rollout, GraphRollout)
    got, logprobs = trainer.rollout.generate(prompts, None, {}, 1)
    assert len(got) == len(prompts) and [len(lp) for lp in logprobs] == [len(c) for c in got]

    width = -(-max(map(len, prompts)) // 8) * 8
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(1234)
    ref, ref_logp = graph_generate(trainer.accelerator.unwrap_model(trainer.model), ids, mask, max_new_tokens=MAX_NEW,
                                   temperature=1.0, eos_token_id=eos, pad_token_id=pad, max_cache_len=192 + MAX_NEW,
                                   return_logprobs=True)  # fmt: skip
    assert got == _cut_after_eos(ref[:, width:], eos)
    # the logprobs cut exactly like the ids: floats, one per completion token
    assert logprobs == [ref_logp[i, : len(c)].tolist() for i, c in enumerate(got)]
    assert all(isinstance(x, float) and x < 0 for lp in logprobs for x in lp)
    lengths = [len(c) for c in got]
    assert all(1 <= n <= MAX_NEW for n in lengths)
    assert any(n < MAX_NEW for n in lengths), "the EOS boost should end some completion early"
    for c in got:
        assert all(t not in eos for t in c[:-1]) and (len(c) == MAX_NEW or c[-1] in eos)
    assert got[2] != got[3] or got[0] != got[1]  # sampled: not all rows the same

    # greedy: the graph path == TRL's transformers path (generate with a static cache of the same length)
    gen = trainer.generation_config
    gen.do_sample, gen.cache_implementation, gen.max_cache_len = False, "static", 192 + MAX_NEW
    graph_greedy, _ = trainer.rollout.generate(prompts, None, {}, 1)
    trainer.use_vllm = False  # set for TRL's correction (the graph engine's logprobs); TRL's own path reads it
    trl_greedy, _ = TransformersRollout(trainer).generate(prompts, None, {}, 1)
    trainer.use_vllm = True
    assert graph_greedy == trl_greedy
    # generation_wave_rows: the 4 rows in waves of 2 (graph_generate's max_rows), the same greedy completions
    from qerl_trl.rollout.graph.generate import _STATES

    trainer.args.generation_wave_rows = 3
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    _STATES.pop(unwrapped, None)
    assert trainer.rollout.generate(prompts, None, {}, 1)[0] == graph_greedy
    assert _STATES[unwrapped].key[0] == 2
    trainer.args.generation_wave_rows = None
    # temperature -> 0 sampling on the graph path: the greedy tokens
    gen.do_sample, gen.temperature = True, 1e-4
    assert trainer.rollout.generate(prompts, None, {}, 1)[0] == graph_greedy


def test_graph_path_refuses_long_prompts_and_multimodal(tmp_path, tokenizer):
    args = args_for(tmp_path, aqn=False, generation_prompt_cache_len=4)
    trainer = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args, train_dataset=arithmetic(),
                              processing_class=tokenizer)  # fmt: skip
    engine = trainer.rollout
    with pytest.raises(ValueError, match="generation_prompt_cache_len"):
        engine.generate([[5] * 5], None, {}, 1)
    engine.generate([[5] * 4], None, {}, 1)  # 4 + 8 tokens fit the 12-token cache
    with pytest.raises(NotImplementedError, match="text-only"):
        engine.generate([[5]], [object()], {}, 1)
    with pytest.raises(NotImplementedError, match="text-only"):
        engine.generate([[5]], None, {"pixel_values": torch.zeros(1)}, 1)


# ---------------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("cls", [QeRLConfig, QeRLDAPOConfig])
def test_graph_training_step_seeded(tmp_path, tokenizer, monkeypatch, cls):
    """One seeded GRPO (and DAPO) step with rollout_engine="graph": generation goes through graph_generate (never
    ``generate``), once per prompt group, completions are cut after their EOS, the speed is logged and the LoRA
    weights move. AQN noise is on (σ > 0 from step 0 with a constant schedule)."""
    calls: list[tuple[int, int]] = []

    def spy(model, input_ids, attention_mask, **kw):
        calls.append((input_ids.shape[0], kw["max_cache_len"]))
        return graph_generate(model, input_ids, attention_mask, **kw)

    monkeypatch.setattr(graph_engine_mod, "graph_generate", spy)
    seen: list[list[int]] = []

    def reward(completions, completion_ids, **kwargs):
        seen.extend(list(c) for c in completion_ids)
        return even_token_reward(completions, completion_ids)

    model = tiny_nvfp4_policy(tokenizer, eos_boost=9.0)
    model.generate = lambda *a, **k: pytest.fail("transformers generate was called")  # noqa: ARG005
    extra = {"dynamic_sampling": False, "overlong_buffer_length": 0} if cls is QeRLDAPOConfig else {}
    args = args_for(tmp_path, cls=cls, rollout_seed_per_prompt=True, aqn_schedule="constant", aqn_sigma_start=1e-2,
                    aqn_sigma_end=1e-2, **extra)  # fmt: skip
    trainer_cls = QeRLDAPOTrainer if cls is QeRLDAPOConfig else QeRLGRPOTrainer
    trainer = trainer_cls(model, reward, args, train_dataset=arithmetic(), processing_class=tokenizer)
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()

    assert trainer.state.global_step == 1
    assert calls == [(4, 192 + MAX_NEW)] * 2  # one call per prompt group (seeded), the run's fixed cache length
    assert len(seen) == 8
    eos = trainer.eos_token_ids
    for c in seen:
        assert 1 <= len(c) <= MAX_NEW
        assert all(t not in eos for t in c[:-1]) and (len(c) == MAX_NEW or c[-1] in eos)
    assert any(len(c) < MAX_NEW for c in seen)
    (log,) = [h for h in trainer.state.log_history if "reward" in h]
    assert log["tokens_per_second/generation"] > 0 and log["aqn/sigma"] > 0
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert changed, "no LoRA weight moved"


def test_graph_rollouts_are_seeded(tmp_path, tokenizer):
    """rollout_seed_per_prompt with the graph engine: the same seed gives the same rollouts in a fresh trainer."""

    def rollouts(sub: str) -> list[list[int]]:
        seen: list[list[int]] = []

        def reward(completions, completion_ids, **kwargs):
            seen.extend(list(c) for c in completion_ids)
            return even_token_reward(completions, completion_ids)

        args = args_for(tmp_path / sub, rollout_seed_per_prompt=True, aqn=False, learning_rate=0.0)
        QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), reward, args, train_dataset=arithmetic(),
                        processing_class=tokenizer).train()  # fmt: skip
        return seen

    a, b = rollouts("a"), rollouts("b")
    assert a == b and len(a) == 8


# ---------------------------------------------------------------------------------------------- rollout_precision
def _spy_fp8(monkeypatch) -> list[bool]:
    """Each call of the real :func:`nvfp4.fp8.fp8_linear` (whether autograd was recording), then the call itself."""
    calls: list[bool] = []
    real = nvfp4.fp8.fp8_linear

    def spy(x, w8, w_scale, bias=None):
        calls.append(torch.is_grad_enabled())
        return real(x, w8, w_scale, bias)

    monkeypatch.setattr(nvfp4.fp8, "fp8_linear", spy)
    return calls


@pytest.mark.parametrize("precision", ["fp8", "auto"])
def test_graph_engine_generates_with_the_fp8_copy_and_trains_w4a16(tmp_path, tokenizer, monkeypatch, precision):
    """One GRPO step with ``rollout_engine="graph"``: the copies are made once when training starts, generation calls
    the FP8 product (``auto``: only for calls of >= 128 rows — the prefill of 8 rows x ~60 tokens — the decode's
    8-row calls stay W4A16), the trainer's logprobs, forward and backward never do, and the LoRA moves."""
    calls = _spy_fp8(monkeypatch)
    model = tiny_nvfp4_policy(tokenizer, eos_boost=9.0)
    trainer = QeRLGRPOTrainer(model, even_token_reward, args_for(tmp_path, rollout_precision=precision),
                              train_dataset=arithmetic(), processing_class=tokenizer)  # fmt: skip
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    rows_seen: list[int] = []
    real_generate = trainer.rollout.generate

    def generate(*args, **kwargs):
        n = len(calls)
        out = real_generate(*args, **kwargs)
        rows_seen.append(len(calls) - n)
        return out

    trainer.rollout.generate = generate
    trainer.train()
    layers = [m for m in trainer.model.modules() if isinstance(m, NVFP4Linear)]
    assert layers and all(m.fp8_copy is not None and not m.fp8_active for m in layers)
    assert {m.fp8_copy.from_rows for m in layers} == {0 if precision == "fp8" else 128}
    assert rows_seen and all(n > 0 for n in rows_seen)  # FP8 products inside each generation call
    assert not any(calls)  # never under autograd: training's forward/backward is W4A16
    assert sum(rows_seen) == len(calls)  # and none outside generation (the trainer's logprobs are W4A16)
    if precision == "auto":  # prefill only: one FP8 call per layer and generation call
        assert all(n == len(layers) for n in rows_seen), rows_seen
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert changed, "no LoRA weight moved"


# ---------------------------------------------------------------------------------------------- sampling correction
@pytest.mark.parametrize(("precision", "seeded"), [("w4a16", False), ("fp8", True)])
def test_graph_engine_sampling_logprobs_run_trls_importance_sampling_correction(tmp_path, tokenizer, precision,
                                                                                 seeded):  # fmt: skip
    """``rollout_engine="graph"`` returns its sampling logprobs, so with ``vllm_importance_sampling_correction`` TRL's
    correction runs on them (from the loss forward, deferred) and logs its ``sampling/*`` metrics. The trainer scores
    at the same temperature (0.7): W4A16 rollouts (the trainer's own forward, decoded) give a ratio of 1 up to float
    noise; FP8 rollouts (CPU: the float32 reference of the E4M3 product; ``rollout_seed_per_prompt``, one call per
    prompt group) a gap that the ratio corrects."""
    model = tiny_nvfp4_policy(tokenizer, eos_boost=9.0)
    args = args_for(tmp_path, aqn=False, rollout_precision=precision, vllm_importance_sampling_correction=True,
                    temperature=0.7, rollout_seed_per_prompt=seeded, max_steps=2)  # fmt: skip
    trainer = QeRLGRPOTrainer(model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer)
    assert GraphRollout.sampling_logprobs and trainer.use_vllm and trainer.vllm_importance_sampling_correction
    returned: list[list[list[float]]] = []
    real_generate = trainer.rollout.generate

    def generate(*a, **kw):
        ids, logprobs = real_generate(*a, **kw)
        returned.append(logprobs)
        return ids, logprobs

    trainer.rollout.generate = generate
    trainer.train()
    assert returned and all(lp is not None for lp in returned)
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    for h in steps:
        gap, ratio = h["sampling/sampling_logp_difference/mean"], h["sampling/importance_sampling_ratio/mean"]
        assert h["sampling/importance_sampling_ratio/min"] <= ratio <= h["sampling/importance_sampling_ratio/max"]
        if precision == "w4a16":
            assert gap < 1e-4 and abs(ratio - 1) < 1e-4, h
        else:
            # about 1e-3 here: the FP8 forward is not the trainer's, and the ratio re-weights its tokens
            assert 1e-4 < gap < 0.5 and h["sampling/importance_sampling_ratio/min"] < 1 - 1e-3, h
