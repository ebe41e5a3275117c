"""QeRLGRPOTrainer / QeRLDAPOTrainer on CPU: tiny NVFP4 policies, real tokenizer, real TRL loop."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import nvfp4
import pytest
import torch
from datasets import Dataset
from nvfp4.linear import NVFP4Linear
from qerl_trl.checkpoints import CheckpointError
from qerl_trl.config import QeRLConfig, QeRLDAPOConfig
from qerl_trl.dapo import OverlongPenalty, QeRLDAPOTrainer, concat_generation_batches, informative_groups
from qerl_trl.policy import load_tokenizer
from qerl_trl.run import RunDirectoryCallback, read_metrics
from qerl_trl.tasks import load_task
from qerl_trl.trainer import AQN_STATE_NAME, QeRLGRPOTrainer
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def tokenizer(offline_model_path):
    return load_tokenizer(offline_model_path)


def tiny_nvfp4_policy(tokenizer, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    return nvfp4.quantize_model(model, progress=False)


def args_for(tmp_path: Path, cls=QeRLConfig, **kw):
    base = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        logging_steps=1,
        save_steps=1000,
        report_to=[],
        learning_rate=1e-3,
        gradient_checkpointing=False,
        aqn_num_stages=2,
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return cls(**base)


def even_token_reward(completions, completion_ids, **kwargs):
    """Fraction of completion tokens with an even id: 0.5 for a random policy, learnable up to 1."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def arithmetic(n: int = 16) -> Dataset:
    return load_task("arithmetic", n_examples=n, demo=False)


def test_grpo_steps_train_only_lora_and_log_qerl_metrics(tmp_path, tokenizer):
    model = tiny_nvfp4_policy(tokenizer)
    packed_before = {n: b.clone() for n, b in model.named_buffers() if n.endswith("weight_packed")}
    args = args_for(tmp_path, save_steps=2)
    trainer = QeRLGRPOTrainer(
        model,
        even_token_reward,
        args,
        train_dataset=arithmetic(),
        processing_class=tokenizer,
        callbacks=[RunDirectoryCallback()],
    )
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert lora_before and all("lora_" in n for n in lora_before)
    assert any(type(m).__name__ == "LoraNVFP4Linear" for m in trainer.model.modules())
    trainer.train()

    assert trainer.state.global_step == 2
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert changed, "no LoRA weight moved"
    for name, buf in trainer.model.named_buffers():
        if name.endswith("weight_packed"):
            key = name.split("base_model.model.", 1)[-1].replace(".base_layer", "")
            assert torch.equal(buf, packed_before[key]), f"{name} (4-bit base) changed"
    nvfp4_layers = [m for m in trainer.model.modules() if isinstance(m, NVFP4Linear)]
    assert all(m._dense_cache is None and m._codes_cache is None for m in nvfp4_layers)  # released after train()

    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2
    for key in (
        "reward",
        "reward_std",
        "entropy",
        "aqn/sigma",
        "aqn/stage",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "tokens_per_second/generation",
        "tokens_per_second/training",
    ):
        assert key in logs[0], key
        assert all(h[key] == h[key] for h in logs), f"{key} is NaN"
    assert [h["aqn/stage"] for h in logs] == [0.0, 1.0]  # stage 0 noise-free, then noise
    assert logs[0]["aqn/sigma"] == 0.0 and logs[1]["aqn/sigma"] > 0

    run = Path(args.output_dir)
    ckpt = run / "checkpoint-2"
    assert (ckpt / AQN_STATE_NAME).is_file() and (ckpt / "adapter_model.safetensors").is_file()
    assert not (run / ".staging").exists()
    assert len(read_metrics(run / "metrics.jsonl")) == 2
    assert (run / "plots.png").stat().st_size > 10_000


def test_rollout_noise_is_on_during_generation_only(tmp_path, tokenizer):
    """AQN noise is on the norms while the model generates (σ>0) and off again for scoring and the loss."""
    model = tiny_nvfp4_policy(tokenizer)
    norm = model.model.layers[0].input_layernorm
    clean = norm.weight.detach().clone()
    seen = []
    handle = norm.register_forward_hook(lambda m, a, o: seen.append(torch.equal(m.weight.float(), clean.float())))
    args = args_for(tmp_path, max_steps=2, aqn_num_stages=2)
    trainer = QeRLGRPOTrainer(model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer)
    trainer.train()
    handle.remove()
    assert not all(seen), "noise never reached the norm during step 2's generation"
    assert any(seen), "norms were never clean"
    assert torch.equal(norm.weight, clean)  # bit-identical after training


def test_learning_reward_rises_on_a_learnable_task(tmp_path, tokenizer):
    """A tiny NVFP4 policy + LoRA learns to emit even token ids within a bounded number of GRPO steps.

    A random tiny model is near-uniform over 49k tokens. Its (dense, frozen) lm_head gets one direction ``u`` that
    separates even from odd ids, so moving the last hidden state along ``u`` — which only the LoRA adapters on the
    NVFP4 projections can do, with gradients through the 4-bit base — raises the reward.
    """
    model = tiny_nvfp4_policy(tokenizer, seed=1)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        u = torch.nn.functional.normalize(torch.randn(head.shape[1], generator=torch.Generator().manual_seed(1)), dim=0)
        sign = torch.where(torch.arange(head.shape[0]) % 2 == 0, 1.0, -1.0)
        head += 0.2 * sign[:, None] * u[None, :]
    args = args_for(
        tmp_path,
        max_steps=12,
        learning_rate=2e-2,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=6,
        aqn=False,
        lr_scheduler_type="constant",
    )
    trainer = QeRLGRPOTrainer(model, even_token_reward, args, train_dataset=arithmetic(32), processing_class=tokenizer)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards


def test_resume_lands_in_the_same_sigma_stage_with_the_same_data(tmp_path, tokenizer, caplog):
    seen: dict[str, list] = {"full": [], "resumed": []}

    def recorder(tag):
        def reward(completions, completion_ids, question, trainer_state, **kwargs):
            seen[tag].append((trainer_state.global_step, tuple(question)))
            return even_token_reward(completions, completion_ids)

        reward.__name__ = "even_tokens"
        return reward

    kw = dict(max_steps=4, save_steps=2, aqn_num_stages=4)
    full = QeRLGRPOTrainer(
        tiny_nvfp4_policy(tokenizer),
        recorder("full"),
        args_for(tmp_path / "a", **kw),
        train_dataset=arithmetic(),
        processing_class=tokenizer,
    )
    full.train()
    resumed = QeRLGRPOTrainer(
        tiny_nvfp4_policy(tokenizer),
        recorder("resumed"),
        args_for(tmp_path / "a", **kw),
        train_dataset=arithmetic(),
        processing_class=tokenizer,
    )
    with caplog.at_level(logging.WARNING, logger="qerl_trl.trainer"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-2"))
    # a rollback: checkpoint-4 of the first run is named before this run replaces it
    assert any("checkpoint-4 are of the run it rolls back" in r.getMessage() for r in caplog.records), caplog.text

    def sigmas(trainer):
        return {h["step"]: (h["aqn/stage"], h["aqn/sigma"]) for h in trainer.state.log_history if "aqn/sigma" in h}

    assert sigmas(resumed) == sigmas(full)  # steps 1-2 come back from the checkpoint's log, 3-4 are new
    assert {s for s, _ in sigmas(full).values()} == {0.0, 1.0, 2.0, 3.0}
    assert seen["resumed"] == [x for x in seen["full"] if x[0] >= 2]  # same prompts in the same order
    state = json.loads((tmp_path / "a" / "run" / "checkpoint-4" / AQN_STATE_NAME).read_text())
    assert state["schedule"]["num_stages"] == 4


def test_resume_without_aqn_state_fails_clearly(tmp_path, tokenizer):
    args = args_for(tmp_path, max_steps=1, save_steps=1)
    QeRLGRPOTrainer(
        tiny_nvfp4_policy(tokenizer), even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer
    ).train()
    ckpt = Path(args.output_dir) / "checkpoint-1"
    (ckpt / AQN_STATE_NAME).unlink()
    trainer = QeRLGRPOTrainer(
        tiny_nvfp4_policy(tokenizer),
        even_token_reward,
        args_for(tmp_path, max_steps=2),
        train_dataset=arithmetic(),
        processing_class=tokenizer,
    )
    with pytest.raises(CheckpointError, match=r"checkpoint-1/aqn_state.json: missing"):
        trainer.train(resume_from_checkpoint=str(ckpt))
    with pytest.raises(CheckpointError, match=r"run: no complete checkpoint-N folder: checkpoint-1 \(aqn_state.json"):
        trainer.train(resume_from_checkpoint=True)


def test_resume_with_other_aqn_settings_keeps_the_checkpoints_schedule_and_says_so(tmp_path, tokenizer, caplog):
    """A run resumed with a longer max_steps or other aqn_* values continues the checkpoint's σ schedule (σ goes on
    where it was, no jump back to an earlier stage), and one warning says so, naming each setting that differs and
    both values; an unchanged resume says nothing."""

    kw = dict(max_steps=2, save_steps=2, aqn_num_stages=2)
    QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args_for(tmp_path, **kw),
                    train_dataset=arithmetic(), processing_class=tokenizer).train()  # fmt: skip
    ckpt = tmp_path / "run" / "checkpoint-2"

    def resume(**changes) -> tuple[QeRLGRPOTrainer, list[str]]:
        trainer = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward,
                                  args_for(tmp_path, **{**kw, **changes}), train_dataset=arithmetic(),
                                  processing_class=tokenizer)  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qerl_trl.trainer"):
            trainer.train(resume_from_checkpoint=str(ckpt))
        return trainer, [r.getMessage() for r in caplog.records if "AQN" in r.getMessage()]

    _, said = resume()  # already at max_steps: nothing trains, and nothing differs
    assert said == []
    trainer, said = resume(max_steps=3, aqn_sigma_start=2e-2)
    assert len(said) == 1 and "\n" not in said[0], said
    assert f"{ckpt}" in said[0]
    assert "total_steps 2 (the arguments give 3)" in said[0] and "sigma_start 0.01 (the arguments give 0.02)" in said[0]
    assert trainer.aqn.schedule.total_steps == 2 and trainer.aqn.schedule.sigma_start == 1e-2
    step3 = [h for h in trainer.state.log_history if h.get("step") == 3 and "aqn/sigma" in h]
    assert step3 and step3[0]["aqn/stage"] == 1.0 and step3[0]["aqn/sigma"] == pytest.approx(1e-2)


def step_numbers(trainer, after: int = 0) -> dict[int, dict]:
    """Every logged number of each step after ``after``, except timings (tokens/s), which no two runs share."""
    return {h["step"]: {k: v for k, v in h.items() if "per_second" not in k and "time" not in k}
            for h in trainer.state.log_history if "reward" in h and h["step"] > after}  # fmt: skip


def test_resume_skips_damaged_checkpoints_and_continues_to_the_same_numbers(tmp_path, tokenizer, caplog):
    """``train(resume_from_checkpoint=True)`` after checkpoint-4's adapter was cut short resumes from checkpoint-3;
    with checkpoint-3's optimizer missing too, from checkpoint-2. Each time the steps after it log the numbers of an
    uninterrupted run (reward, loss, grad norm, entropy, σ, ...), the damaged folders are replaced by complete ones,
    and what was skipped is said in one warning."""
    import shutil

    from qerl_trl.checkpoints import check_checkpoint

    kw = dict(max_steps=4, save_steps=1, aqn_num_stages=4)
    full = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args_for(tmp_path / "full", **kw),
                           train_dataset=arithmetic(), processing_class=tokenizer)  # fmt: skip
    full.train()
    full_run = Path(full.args.output_dir)

    def damage_and_resume(tag: str, damage) -> tuple[QeRLGRPOTrainer, str]:
        run = tmp_path / tag / "run"
        shutil.copytree(full_run, run)
        damage(run)
        resumed = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args_for(tmp_path / tag, **kw),
                                  train_dataset=arithmetic(), processing_class=tokenizer)  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qerl_trl.trainer"):
            resumed.train(resume_from_checkpoint=True)
        for step in (1, 2, 3, 4):
            check_checkpoint(run / f"checkpoint-{step}", ["optimizer.pt", "scheduler.pt", AQN_STATE_NAME])
        return resumed, caplog.text

    def cut_adapter(run: Path) -> None:
        path = run / "checkpoint-4" / "adapter_model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    resumed, said = damage_and_resume("cut", cut_adapter)
    assert f"resuming from {tmp_path / 'cut' / 'run' / 'checkpoint-3'}; skipped checkpoint-4 (adapter_model" in said
    assert step_numbers(resumed, after=3) == step_numbers(full, after=3) != {}

    def cut_adapter_and_drop_optimizer(run: Path) -> None:
        cut_adapter(run)
        (run / "checkpoint-3" / "optimizer.pt").unlink()

    resumed, said = damage_and_resume("cut-and-missing", cut_adapter_and_drop_optimizer)
    assert (
        "checkpoint-2; skipped checkpoint-4 (adapter_model" in said and "; checkpoint-3 (optimizer.pt: missing)" in said
    )
    assert step_numbers(resumed, after=2) == step_numbers(full, after=2) and len(step_numbers(full, after=2)) == 2


def test_dapo_steps_with_dynamic_sampling_refill(tmp_path, tokenizer):
    """Half the prompts get a constant reward (no signal): their groups are dropped and refilled with fresh ones."""

    def half_constant(completions, completion_ids, b, **kwargs):
        return [1.0 if bi % 2 == 0 else even_token_reward(None, [ids])[0] for bi, ids in zip(b, completion_ids)]

    args = args_for(
        tmp_path,
        cls=QeRLDAPOConfig,
        max_steps=3,
        max_completion_length=8,
        overlong_buffer_length=0,
        max_resample_rounds=6,
    )
    assert (args.epsilon, args.epsilon_high, args.loss_type, args.beta) == (0.2, 0.28, "dapo", 0.0)
    trainer = QeRLDAPOTrainer(
        tiny_nvfp4_policy(tokenizer), half_constant, args, train_dataset=arithmetic(32), processing_class=tokenizer
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 3
    assert all(h["dapo/informative_group_fraction"] < 1.0 for h in logs) or any(
        h["dapo/resample_rounds"] > 0 for h in logs
    )
    assert any(h["dapo/resample_rounds"] >= 1 for h in logs)
    assert all(h["dapo/unfilled_groups"] == 0 for h in logs)
    assert "clip_ratio/high_mean" in logs[0]


def test_dapo_adds_overlong_penalty_reward(tmp_path, tokenizer):
    args = args_for(tmp_path, cls=QeRLDAPOConfig, max_steps=1, max_completion_length=8, dynamic_sampling=False)
    assert args.overlong_buffer_length == 2  # default: a quarter of the limit
    trainer = QeRLDAPOTrainer(
        tiny_nvfp4_policy(tokenizer), even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer
    )
    assert trainer.reward_func_names == ["even_token_reward", "overlong_penalty"]
    trainer.train()
    assert "rewards/overlong_penalty/mean" in trainer.state.log_history[0]


def test_rollout_seeds_of_a_training_step_do_not_depend_on_an_evaluation_before_it(tmp_path, tokenizer):
    """``rollout_seed_per_prompt``: the seed of a training generation is (seed, step, call, group); an evaluation at
    the same ``global_step`` (eval_strategy="steps" runs after step N, the next step generates at N too) must not
    shift the training calls, or a run resumed from checkpoint-N (no evaluation replayed) samples other rollouts."""
    from qerl_trl.trainer import rollout_seed

    trainer = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward,
                              args_for(tmp_path, rollout_seed_per_prompt=True, aqn=False), train_dataset=arithmetic(),
                              processing_class=tokenizer)  # fmt: skip
    seeds = []

    def turn(prompt_ids, *args):
        seeds.append(torch.initial_seed())
        return [[1] for _ in prompt_ids], None

    trainer._generate_turn = turn
    prompts = [[5, 6]] * 4 + [[7, 8]] * 4
    trainer.model.eval()
    trainer._generate_seeded(prompts, None, None, 4, False)  # the evaluation after step 0
    seeds.clear()
    trainer.model.train()
    trainer._generate_seeded(prompts, None, None, 4, False)  # the next training generation, still at global_step 0
    assert seeds == [rollout_seed(0, 0, 0, 0), rollout_seed(0, 0, 0, 1)]


def test_a_failed_lora_sync_is_retried_by_the_next_generation(tmp_path, tokenizer):
    """If pushing the adapter to the engine fails (a vLLM server briefly down), the step is not marked as synced: the
    next generation at that step (train() called again, resumed from the checkpoint of that step) pushes it again
    instead of generating from the engine's stale adapter."""
    trainer = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args_for(tmp_path, aqn=False),
                              train_dataset=arithmetic(), processing_class=tokenizer)  # fmt: skip
    calls = []

    def sync_lora():
        calls.append(trainer.state.global_step)
        if len(calls) == 1:
            raise ConnectionError("vLLM server down")

    trainer.rollout.sync_lora = sync_lora
    trainer._generate_turn = lambda prompt_ids, *args: ([[1] for _ in prompt_ids], None)
    with pytest.raises(ConnectionError):
        trainer._generate_single_turn([[5, 6]], None, None, 1)
    trainer._generate_single_turn([[5, 6]], None, None, 1)
    assert calls == [0, 0]


def test_train_again_starts_the_per_run_rollout_bookkeeping_afresh(tmp_path, tokenizer, monkeypatch):
    """train() called again on the same trainer (resumed after an exception at step N): the generation calls of step
    N count from 0 again (rollout_seed_per_prompt: the rollouts of a fresh process resumed from checkpoint-N), and the
    adapter is pushed to the engine again (a restarted vLLM server holds none)."""
    from trl import GRPOTrainer

    trainer = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward,
                              args_for(tmp_path, rollout_seed_per_prompt=True, aqn=False), train_dataset=arithmetic(),
                              processing_class=tokenizer)  # fmt: skip
    trainer._rollout_calls, trainer._lora_synced_step = (("train", 3), 1), 3  # left by a run that failed in step 3
    trainer._correction_stats = [torch.zeros(7)]  # a generation batch's sampling statistics, half gathered
    seen = []
    monkeypatch.setattr(GRPOTrainer, "train", lambda self, *a, **k: seen.append((self._rollout_calls,
                                                                                  self._lora_synced_step,
                                                                                  len(self._correction_stats))))
    trainer.train()
    assert seen == [((("", -1), 0), -1, 0)]


def test_dapo_dynamic_sampling_on_an_iterable_data_set_is_refused_before_the_model_loads(tmp_path, tokenizer):
    """Dynamic sampling refills from random rows (QeRLDAPOTrainer._refill_inputs: len(dataset), dataset[i]): with an
    IterableDataset it failed in the first step that had an uninformative group, TypeError "object of type
    'IterableDataset' has no len()". Refused up front (the path does not exist: nothing loaded); without refills the
    stream trains."""
    streamed = arithmetic().to_iterable_dataset()
    with pytest.raises(ValueError, match=r"^dynamic_sampling refills from random rows of train_dataset, and a "
                                         r"IterableDataset has no rows by index"):  # fmt: skip
        QeRLDAPOTrainer(str(tmp_path / "no-such-model"), even_token_reward, args_for(tmp_path, cls=QeRLDAPOConfig),
                        train_dataset=streamed)  # fmt: skip
    args = args_for(tmp_path, cls=QeRLDAPOConfig, max_resample_rounds=0, max_steps=1)
    trainer = QeRLDAPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args, train_dataset=streamed,
                              processing_class=tokenizer)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 1


def test_overlong_penalty_values():
    pen = OverlongPenalty(max_completion_length=10, buffer_length=4, penalty_factor=1.0)
    got = pen(None, completion_ids=[[0] * n for n in (0, 6, 7, 8, 10, 12)])
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer_length"):
        OverlongPenalty(10, 10)


@pytest.mark.parametrize("factor", [-1.0, float("nan"), float("inf")])
def test_a_negative_or_non_finite_overlong_penalty_factor_is_refused(factor):
    # DAPO writes the penalty at the limit as -1: a factor of -1 would reward overlong completions, silently
    with pytest.raises(ValueError, match="overlong_penalty_factor"):
        QeRLDAPOConfig(output_dir="x", max_completion_length=16, overlong_penalty_factor=factor)
    with pytest.raises(ValueError, match="penalty_factor"):
        OverlongPenalty(10, 4, penalty_factor=factor)
    assert OverlongPenalty(10, 4, penalty_factor=0.5)(None, completion_ids=[[0] * 10]) == [-0.5]


def test_default_overlong_buffer_with_a_one_token_limit_names_what_the_user_set():
    """max_completion_length 1 with the default buffer: the error is about the limit the user set and the default
    buffer, not about a "buffer_length 1" the user never gave; turning the shaping off still works."""
    with pytest.raises(ValueError) as info:
        QeRLDAPOConfig(output_dir="x", max_completion_length=1)
    said = str(info.value)
    assert "max_completion_length >= 2, got 1" in said and "overlong_buffer_length 0" in said and ", got 1)" not in said
    assert QeRLDAPOConfig(output_dir="x", max_completion_length=1, overlong_buffer_length=0).overlong_buffer_length == 0
    # TRL's max_completion_length None (no limit): a TypeError about None and int before; now what to set
    no_limit = r"needs a max_completion_length \(got None, no limit\).*overlong_buffer_length 0"
    with pytest.raises(ValueError, match=no_limit):
        QeRLDAPOConfig(output_dir="x", max_completion_length=None)
    unlimited = QeRLDAPOConfig(output_dir="x", max_completion_length=None, overlong_buffer_length=0)
    assert unlimited.max_completion_length is None


def test_informative_groups_ignore_rounding_of_equal_rewards():
    # TRL's advantage of 8 equal rewards 0.2 (e.g. arithmetic_accuracy + answer_tag, all wrong but tagged) is not 0 in
    # float32 (the mean rounds) but the same for every row: no learning signal, so DAPO must drop the group
    rewards = torch.tensor([0.2] * 8 + [1.2] * 4 + [0.2] * 4)
    grouped = rewards.view(-1, 8)
    mean = grouped.mean(1, keepdim=True)
    adv = ((grouped - mean) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    assert adv[:8].abs().max() > 0  # the rounding this test is about
    assert informative_groups(adv, 8).tolist() == [False, True]


def test_informative_groups_and_batch_concatenation():
    adv = torch.tensor([0.0, 0.0, 0.0, 1.0, -1.0, 0.0])
    assert informative_groups(adv, 3).tolist() == [False, True]
    with pytest.raises(ValueError, match="groups of 4"):
        informative_groups(adv, 4)
    a = {
        "prompt_ids": torch.tensor([[5, 6]]),
        "prompt_mask": torch.tensor([[1, 1]]),
        "completion_ids": torch.tensor([[7]]),
        "completion_mask": torch.tensor([[1]]),
        "advantages": torch.tensor([0.5]),
        "num_items_in_batch": torch.tensor(1),
    }
    b = {
        "prompt_ids": torch.tensor([[8]]),
        "prompt_mask": torch.tensor([[1]]),
        "completion_ids": torch.tensor([[9, 10, 11]]),
        "completion_mask": torch.tensor([[1, 1, 1]]),
        "advantages": torch.tensor([-0.5]),
        "num_items_in_batch": torch.tensor(3),
    }
    out = concat_generation_batches([a, b], pad_token_id=0)
    assert out["prompt_ids"].tolist() == [[5, 6], [0, 8]]  # prompts stay left-padded
    assert out["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert out["completion_ids"].tolist() == [[7, 0, 0], [9, 10, 11]]  # completions right-padded
    assert out["completion_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert out["advantages"].tolist() == [0.5, -0.5]
    with pytest.raises(NotImplementedError, match="pixel_values"):
        concat_generation_batches([{**a, "pixel_values": torch.zeros(1)}] * 2, 0)
    # a token-level importance ratio whose first batch's completions are one token long: padded like its tokens
    # (torch.cat of [1, 1] and [1, 3] failed), while a sequence-level [b, 1] ratio is stacked as it is
    token = concat_generation_batches([{**a, "importance_sampling_ratio": torch.tensor([[0.9]])},
                                       {**b, "importance_sampling_ratio": torch.tensor([[1.0, 1.1, 1.2]])}], 0)  # fmt: skip
    assert torch.allclose(token["importance_sampling_ratio"], torch.tensor([[0.9, 0, 0], [1.0, 1.1, 1.2]]))
    seq = concat_generation_batches([{**a, "importance_sampling_ratio": torch.tensor([[0.9]])},
                                     {**b, "importance_sampling_ratio": torch.tensor([[1.1]])}], 0)  # fmt: skip
    assert torch.allclose(seq["importance_sampling_ratio"], torch.tensor([[0.9], [1.1]]))


def assert_same_step(logs0: dict, lora0: dict, logs1: dict, lora1: dict) -> None:
    """Two runs of one step from the same rollouts made the same update: loss, gradient norm, LoRA weights."""
    assert logs1["reward"] == logs0["reward"]  # the same rollouts
    assert logs1["loss"] == pytest.approx(logs0["loss"], rel=1e-5, abs=1e-7)
    assert logs1["grad_norm"] == pytest.approx(logs0["grad_norm"], rel=1e-4)
    assert all(torch.allclose(lora1[n], lora0[n], rtol=1e-5, atol=1e-7) for n in lora0)


def test_chunked_scoring_with_checkpointing_gives_the_same_step(tmp_path, tokenizer):
    # memory settings: scoring in 3-sequence forwards under gradient checkpointing, or the offline default recipe's
    # micro-batches of 2 sequences (gradient accumulation over one generation batch): the same loss, gradient and
    # LoRA update as one whole-batch forward
    results = []
    for kw in ({}, {"gradient_checkpointing": True, "logprob_batch_size": 3},
               {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}):  # fmt: skip
        model = tiny_nvfp4_policy(tokenizer)
        # plain SGD: Adam's first step turns the rounding noise of LoRA A's ~zero gradient (B starts at 0) into ±lr
        args = args_for(tmp_path / str(len(results)), max_steps=1, aqn=False, optim="sgd", **kw)
        trainer = QeRLGRPOTrainer(
            model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer
        )
        rows: list[int] = []

        def count_rows(module, args, kwargs, rows=rows):  # sequences per forward that builds a graph (the loss)
            if torch.is_grad_enabled():
                rows.append(kwargs["input_ids"].shape[0])

        hook = trainer.model.get_base_model().model.register_forward_pre_hook(count_rows, with_kwargs=True)
        trainer.train()
        hook.remove()
        lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        results.append((trainer.state.log_history[0], lora, rows))
    (logs0, lora0, rows0), *others = results
    # rows per forward: the batch's 2 prompts and 8 completions packed into one row; under checkpointing whole
    # sequences, 3 at a time; the micro-batches of 2 are re-split by prompt (micro_batches_by_prompt), one row each
    assert rows0 == [1] and [rows for _, _, rows in others] == [[3, 3, 2], [1] * 4]
    for logs1, lora1, _ in others:
        assert_same_step(logs0, lora0, logs1, lora1)


def test_micro_batches_by_prompt_keeps_every_row_and_puts_each_group_together():
    """TRL's buffered micro-batches (rows shuffled, then split) re-split with each prompt's rows together: the same
    rows and values, the same number and size of micro-batches, groups in the order the shuffle left them; batches
    with a value that is not one row per sequence come back as they were."""
    from qerl_trl.trainer import micro_batches_by_prompt

    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    order = torch.tensor([1, 0, 0, 1, 1, 0, 0, 1])  # shuffled rows of 2 groups of 4
    rows = {"prompt_ids": prompts[order], "prompt_mask": (prompts[order] != 0).long(),
            "completion_ids": torch.arange(16).view(8, 2), "advantages": torch.arange(8.0),
            "num_items_in_batch": torch.tensor(16), "old_per_token_logps": None, "names": list("abcdefgh")}  # fmt: skip
    batches = [{k: v[i : i + 2] if isinstance(v, list) or (torch.is_tensor(v) and v.ndim) else v for k, v in
                rows.items()} for i in range(0, 8, 2)]  # fmt: skip
    out = micro_batches_by_prompt(batches)
    assert [len(b["advantages"]) for b in out] == [2, 2, 2, 2]
    assert [b["prompt_ids"][:, -1].tolist() for b in out] == [[9, 9], [9, 9], [6, 6], [6, 6]]
    assert sorted(x for b in out for x in b["names"]) == list("abcdefgh")
    for b in out:  # every value moved with its row
        for name, adv, comp in zip(b["names"], b["advantages"], b["completion_ids"], strict=True):
            assert adv == "abcdefgh".index(name) and comp.tolist() == [2 * int(adv), 2 * int(adv) + 1]
        assert b["num_items_in_batch"] == 16 and b["old_per_token_logps"] is None
    images = [{**b, "pixel_values": torch.zeros(5, 3)} for b in batches]
    assert micro_batches_by_prompt(images) is images


def test_completion_scoring_gives_trl_log_probs_entropies_and_gradients(tmp_path, tokenizer):
    """On CPU the trainer scores only the completion positions (``score_completions``); TRL's fused LM head scores
    every position. Same log-probs, entropies (0 at padding) and LoRA gradients, for 1 or 3 sequences per forward."""
    from trl import GRPOTrainer

    model = tiny_nvfp4_policy(tokenizer)
    args = args_for(tmp_path, max_steps=1, aqn=False, temperature=0.7)
    trainer = QeRLGRPOTrainer(model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer)
    torch.manual_seed(1)
    for p in trainer.model.parameters():  # LoRA B starts at 0: give the adapters a gradient path of their own
        if p.requires_grad:
            p.data.normal_(0, 0.05)
    ids = torch.randint(0, len(tokenizer), (5, 14))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left-padded prompt
    mask[1, -2:] = 0  # a completion shorter than the batch's
    lora = [p for p in trainer.model.parameters() if p.requires_grad]
    results = []
    trainer._entropy_bonus_enabled = True  # as with an entropy bonus: the entropies carry gradients
    for fn in (GRPOTrainer._get_per_token_logps_and_entropies, QeRLGRPOTrainer._get_per_token_logps_and_entropies):
        for batch_size in (1, 3):
            logps, ent, _ = fn(trainer, trainer.model, ids, mask, 6, batch_size, compute_entropy=True)
            (logps.sum() + 0.1 * ent.sum()).backward()
            results.append((logps.detach(), ent.detach(), [p.grad.clone() for p in lora]))
            trainer.model.zero_grad()
    trl_logps, trl_ent, trl_grads = results[0]
    assert (trl_logps[1, -2:] == 0).all() and (trl_ent[1, -2:] == 0).all()
    for logps, ent, grads in results[1:]:
        torch.testing.assert_close(logps, trl_logps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, trl_ent, rtol=1e-5, atol=1e-5)
        for g, ref in zip(grads, trl_grads, strict=True):
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)
    trainer._entropy_bonus_enabled = False  # no bonus: the entropies (metrics, masks) are computed outside autograd
    logps, ent, _ = QeRLGRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, 6, 3,
                                                                       compute_entropy=True)  # fmt: skip
    assert logps.requires_grad and not ent.requires_grad
    torch.testing.assert_close(ent, trl_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_scoring_each_prompt_once_gives_the_whole_sequence_scores_and_gradients(tmp_path, tokenizer, batch_size):
    """``score_completions`` with rows of the same prompt (3 prompts: 3, 2 and 1 rows, not consecutive, one of them
    left-padded; completions of three lengths, one with a masked token inside) packs each prompt once and its
    completions after it into one row: the log-probs, entropies and LoRA gradients of one forward over the whole
    sequences, on fresh random weights."""
    from qerl_trl.trainer import prompt_groups, score_completions

    args = args_for(tmp_path, max_steps=1, aqn=False)
    model = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer, seed=3), even_token_reward, args, train_dataset=arithmetic(),
                            processing_class=tokenizer).model  # fmt: skip
    torch.manual_seed(2)
    lora = [p for p in model.parameters() if p.requires_grad]
    for p in lora:  # LoRA B starts at 0: give every adapter a gradient path of its own
        p.data.normal_(0, 0.05)
    pad = tokenizer.pad_token_id
    prompts = [torch.randint(3, len(tokenizer), (n,)).tolist() for n in (9, 6, 9)]
    order = [0, 1, 0, 2, 1, 0]
    comp = torch.randint(3, len(tokenizer), (6, 5))
    comp_mask = torch.ones_like(comp)
    comp_mask[1, 3:] = 0
    comp_mask[4, 1:] = 0
    comp_mask[0, 2] = 0  # masked inside: never attended to, scored 0
    comp[comp_mask == 0] = pad
    ids = torch.tensor([[pad] * (9 - len(prompts[g])) + prompts[g] for g in order])
    mask = (torch.arange(9) >= torch.tensor([9 - len(prompts[g]) for g in order])[:, None]).long()
    ids, mask = torch.cat([ids, comp], 1), torch.cat([mask, comp_mask], 1)
    assert prompt_groups(ids, mask, 9).tolist() == order
    calls: list[tuple[int, int]] = []
    hook = model.get_base_model().model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    results = []
    for share in (False, True):
        logps, ent, _ = score_completions(model, ids, mask, 5, batch_size, temperature=0.7, compute_entropy=True,
                                          share_prompts=share)  # fmt: skip
        (logps.sum() + 0.1 * ent.sum()).backward()
        results.append((logps.detach(), ent.detach(), [p.grad.clone() for p in lora]))
        model.zero_grad()
    n_calls = len(calls)
    long_ids = torch.cat([ids[:1, 7:9].expand(6, 2), torch.randint(3, len(tokenizer), (6, 60))], 1)
    with torch.no_grad():  # a 2-token prompt, 6 completions of 60: packed, 362 tokens and 362² pairs cost more
        score_completions(model, long_ids, torch.ones_like(long_ids), 60)
    assert model.config.hidden_size <= 64 and calls[n_calls:] == [(6, 62)]  # than 6 × 62 tokens and 6 × 62² pairs
    del calls[n_calls:]
    hook.remove()
    (ref_logps, ref_ent, ref_grads), (logps, ent, grads) = results
    assert torch.isfinite(logps).all() and torch.isfinite(ent).all()
    assert (logps[comp_mask == 0] == 0).all() and (logps[comp_mask == 1] < 0).all()
    torch.testing.assert_close(logps, ref_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    for g, ref in zip(grads, ref_grads, strict=True):  # float32 sums in another order: relative error of each tensor
        assert torch.isfinite(g).all() and ref.norm() > 0
        assert (g - ref).norm() / ref.norm() < 1e-4
    packed_calls = calls[1 if batch_size is None else 2 :]
    if batch_size is None:  # one row: prompts of 9, 6 and 9 tokens and completions of 5 + 5 + 5, 3 + 1, 5 tokens
        assert packed_calls == [(1, 48)]
    else:  # whole groups per forward: prompt 0 and its 3 rows, then prompts 1 and 2 (2 + 1 rows)
        assert packed_calls == [(1, 24), (1, 24)]


@pytest.mark.parametrize("do_sample", [False, True])
def test_shared_prefix_generation_gives_generate_tokens(tokenizer, do_sample):
    """``generate_from_shared_prefix``: runs of identical left-padded prompts (3, 2 and 1 rows, two prompt lengths)
    prefilled once per run, then ``generate`` from the copied KV cache: the tokens of plain ``generate``, greedy and
    sampled from the same seed."""
    from qerl_trl.rollout.transformers import generate_from_shared_prefix
    from transformers import GenerationConfig

    model = tiny_nvfp4_policy(tokenizer).eval()
    torch.manual_seed(0)
    a, b, c = (torch.randint(3, len(tokenizer), (n,)).tolist() for n in (9, 6, 9))
    pad_id = tokenizer.pad_token_id
    rows = [a, a, a, b, b, c]
    input_ids = torch.tensor([[pad_id] * (9 - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (9 - len(r)) + [1] * len(r) for r in rows])
    gen = GenerationConfig(max_new_tokens=7, do_sample=do_sample, temperature=1.0, top_k=0, top_p=1.0,
                           pad_token_id=pad_id, eos_token_id=None)  # fmt: skip
    outs = []
    for fn in (lambda **kw: model.generate(**kw), lambda **kw: generate_from_shared_prefix(model, **kw)):
        torch.manual_seed(1)
        with torch.no_grad():
            outs.append(fn(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen))
    assert outs[0].shape == (6, 16)
    assert torch.equal(outs[1], outs[0])


def test_trainer_prefills_each_prompt_group_once(tmp_path, tokenizer):
    """GRPO rollouts (transformers engine): the first forward of a generation step takes one row per prompt group
    (2 prompts x 4 generations → 2 rows), without and with AQN noise on."""
    model = tiny_nvfp4_policy(tokenizer)
    args = args_for(tmp_path, max_steps=2, aqn=True)  # step 2 generates with AQN noise on
    trainer = QeRLGRPOTrainer(model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer)
    rows: list[int] = []

    def count_rows(module, args, kwargs):  # (rows, tokens) of each forward without gradients
        if not torch.is_grad_enabled():
            rows.append(tuple(kwargs["input_ids"].shape))

    hook = trainer.model.get_base_model().model.register_forward_pre_hook(count_rows, with_kwargs=True)
    trainer.train()
    hook.remove()
    prompts = [shape for shape in rows if shape[1] > 1 and shape[0] != 1]  # (AQN's discovery traces one row)
    assert [n for n, _ in prompts] == [2, 2]  # one prefill of 2 rows per step, none of the 8 completions
    assert sum(n == 8 for n, _ in rows) >= 2  # the decoding ran on all 8 rows
    assert trainer.state.global_step == 2


def test_training_step_runs_sdpa_without_cudnn(tmp_path, tokenizer):
    """pytorch/pytorch#196678: cuDNN's SDPA backward can return NaN with a finite loss. Every attention forward of a
    training step (the loss's, and gradient checkpointing's recompute inside the backward) runs with cuDNN SDPA off;
    the caller's setting comes back after the step."""
    model = tiny_nvfp4_policy(tokenizer)
    args = args_for(tmp_path, max_steps=1, aqn=False, gradient_checkpointing=True)
    trainer = QeRLGRPOTrainer(model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer)
    seen: list[tuple[bool, bool]] = []  # (grad enabled, cuDNN SDPA enabled) per attention forward

    def record(module, inputs, output):
        seen.append((torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))

    attention = [m for n, m in trainer.model.named_modules() if n.endswith("self_attn")]
    hooks = [m.register_forward_hook(record) for m in attention]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default
    trainer.train()
    for hook in hooks:
        hook.remove()
    n_layers = len(attention)
    assert sum(grad for grad, _ in seen) >= 2 * n_layers  # the loss forward and the recompute in the backward
    assert not any(cudnn for _, cudnn in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuDNN SDPA backward runs on CUDA")
def test_training_sdpa_backends_avoid_the_cudnn_nan_backward():
    """The bug itself (pytorch/pytorch#196678, torch 2.11 on the H100), torch only: an explicit mask, a length % 128
    == 64 and rows whose logsumexp is below -88.7 give NaN in dQ with cuDNN, finite with TRAINING_SDPA_BACKENDS."""
    import math

    import torch.nn.functional as F
    from qerl_trl.trainer import TRAINING_SDPA_BACKENDS
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def grad_q(backends):
        torch.manual_seed(0)
        length, dim = 704, 64
        q = torch.randn(1, 1, length, dim, device="cuda", dtype=torch.bfloat16) * 0.1
        k = torch.randn(1, 1, length, dim, device="cuda", dtype=torch.bfloat16) * 0.1
        v = torch.randn(1, 1, length, dim, device="cuda", dtype=torch.bfloat16)
        q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(dim)  # every score ~ -120
        q.requires_grad_()
        mask = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()[None, None]
        with sdpa_kernel(backends):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(
                torch.randn(1, 1, length, dim, device="cuda", dtype=q.dtype)
            )
        return q.grad

    assert torch.isfinite(grad_q(TRAINING_SDPA_BACKENDS)).all()
    try:
        cudnn = grad_q([SDPBackend.CUDNN_ATTENTION])
    except RuntimeError:  # no cuDNN SDPA on this GPU / build
        return
    print("cuDNN dQ non-finite elements:", int((~torch.isfinite(cudnn)).sum()))  # the bug, where torch still has it


def test_non_finite_gradients_stop_before_the_optimizer_step(tmp_path, tokenizer):
    from qerl_trl.trainer import NonFiniteGradientError

    model = tiny_nvfp4_policy(tokenizer)
    args = args_for(tmp_path, max_steps=2, aqn=False)
    trainer = QeRLGRPOTrainer(model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer)
    lora = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in lora.items()}
    name = sorted(lora)[0]
    lora[name].register_hook(lambda grad: torch.full_like(grad, float("nan")))  # a backward that goes NaN
    with pytest.raises(NonFiniteGradientError, match=r"step 1: the gradient norm is nan; stopped before"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in lora.items())  # no weight moved


def test_config_errors():
    with pytest.raises(ValueError, match="logprob_batch_size"):
        QeRLConfig(output_dir="x", logprob_batch_size=0)
    with pytest.raises(ValueError, match="quantization"):
        QeRLConfig(output_dir="x", quantization="int4")
    with pytest.raises(ValueError, match="aqn_mode"):
        QeRLConfig(output_dir="x", aqn_mode="sometimes")
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        QeRLDAPOConfig(output_dir="x", max_completion_length=16, overlong_buffer_length=16)
    with pytest.raises(TypeError, match="QeRLDAPOConfig"):
        QeRLDAPOTrainer("offline-default", even_token_reward, QeRLConfig(output_dir="x"))
    assert QeRLConfig(output_dir="x", lora_r=16).lora_alpha == 16


def test_a_loaded_dense_model_under_a_4bit_quantization_is_refused(tmp_path, tokenizer):
    """A loaded dense model is not quantized by the trainer: under quantization='nvfp4-rtn' (the default) it trained
    as the bf16 baseline without a word. It is refused before TRL wraps it; quantization='none' takes it."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", vocab_size=len(tokenizer), max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    dense = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"dense LlamaForCausalLM but quantization='nvfp4-rtn'.*quantize_\(model\)"):
        QeRLGRPOTrainer(dense, even_token_reward, args_for(tmp_path), train_dataset=arithmetic(),
                        processing_class=tokenizer)  # fmt: skip
    trainer = QeRLGRPOTrainer(dense, even_token_reward, args_for(tmp_path, quantization="none"),
                              train_dataset=arithmetic(), processing_class=tokenizer)  # fmt: skip
    assert not any(isinstance(m, NVFP4Linear) for m in trainer.model.modules())


def test_a_data_set_without_a_prompt_column_is_refused_before_the_model_loads(tmp_path):
    """TRL reads the 'prompt' column only in the first step: a data set without one loaded the policy, built the
    trainer and failed with KeyError: 'prompt' deep in its data collation. Refused first, with the columns named (the
    model path here does not exist: nothing was loaded)."""
    no_prompt = Dataset.from_dict({"question": ["1+1="] * 4, "answer": ["2"] * 4})
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"^train_dataset has no 'prompt' column \(columns: question, answer\)"):
        QeRLGRPOTrainer(missing, even_token_reward, args_for(tmp_path), train_dataset=no_prompt)
    with pytest.raises(ValueError, match=r"^eval_dataset\['held'\] has no 'prompt' column"):
        QeRLGRPOTrainer(missing, even_token_reward, args_for(tmp_path), train_dataset=arithmetic(),
                        eval_dataset={"held": no_prompt})  # fmt: skip


def test_fewer_prompts_than_one_generation_round_are_refused_before_the_model_loads(tmp_path):
    """TRL's sampler yields whole generation rounds only: with fewer prompts than one round takes (here 1 < 8 / 4),
    train() ran 0 steps with transformers' warning and returned as if done. The CLI refused it
    (validation.check_enough_prompts); the Python API now does too, before anything loads."""
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"the training set has 1 prompt\(s\), fewer than the 2 one generation round"):
        QeRLGRPOTrainer(missing, even_token_reward, args_for(tmp_path), train_dataset=arithmetic(1))
    with pytest.raises(ValueError, match=r"the training set has 0 prompt\(s\)"):
        QeRLGRPOTrainer(missing, even_token_reward, args_for(tmp_path), train_dataset=Dataset.from_dict({"prompt": []}))


def test_a_reward_named_as_on_the_command_line_is_that_reward(tmp_path, tokenizer):
    """reward_funcs="arithmetic_accuracy" (a name --reward_funcs and the recipes take) went to TRL, which reads a string
    as a reward model id: after the policy loaded, an OSError about reaching huggingface.co. A QeRL reward's name is
    its function; any other string is still TRL's reward model."""
    from qerl_trl.rewards import REWARD_FUNCS

    trainer = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), ["arithmetic_accuracy", "format"], args_for(tmp_path),
                              train_dataset=arithmetic(), processing_class=tokenizer)  # fmt: skip
    assert trainer.reward_funcs == [REWARD_FUNCS["arithmetic_accuracy"], REWARD_FUNCS["format"]]
    assert trainer.reward_func_names == ["arithmetic_accuracy_reward", "format_reward"]


def test_a_peft_model_with_a_peft_config_too_is_refused(tmp_path, tokenizer):
    """A PeftModel and a peft_config: the trainer dropped the peft_config without a word and trained the model's own
    adapter (here rank 4 on q_proj instead of the asked rank 16 on v_proj); TRL refuses the pair. Refused in one line;
    the PeftModel alone trains its adapter."""
    from nvfp4.peft import register_nvfp4_lora
    from peft import LoraConfig, get_peft_model

    own = LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    register_nvfp4_lora(own)
    peft_model = get_peft_model(tiny_nvfp4_policy(tokenizer), own)
    asked = LoraConfig(r=16, target_modules=["v_proj"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"^model is a PeftModel and peft_config was given too"):
        QeRLGRPOTrainer(peft_model, even_token_reward, args_for(tmp_path), train_dataset=arithmetic(),
                        processing_class=tokenizer, peft_config=asked)  # fmt: skip
    trainer = QeRLGRPOTrainer(peft_model, even_token_reward, args_for(tmp_path), train_dataset=arithmetic(),
                              processing_class=tokenizer)  # fmt: skip
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("q_proj.lora_" in n for n in trained)


def test_chat_prompts_with_a_tokenizer_without_a_chat_template_are_refused_before_the_model_loads(
    tmp_path, base_dir, tokenizer
):
    """Chat-message prompts (every task's) and a base model's tokenizer: the Python API loaded and quantized the
    policy, then transformers refused at the first prompt ("Cannot use chat template functions"); the CLI checks it
    first (validation.check_chat_template). Refused before load_policy now, for a path and for a held model with its
    processing_class; plain-text prompts still go."""
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match=r"^train_dataset's prompts are chat messages and the tokenizer has no chat "
                                         r"template"):  # fmt: skip
        QeRLGRPOTrainer(str(base_dir), even_token_reward, args_for(tmp_path), train_dataset=arithmetic())
    base_tok = AutoTokenizer.from_pretrained(base_dir)
    with pytest.raises(ValueError, match="no chat template"):
        QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args_for(tmp_path),
                        train_dataset=arithmetic(), processing_class=base_tok)  # fmt: skip
    plain = Dataset.from_dict({"prompt": ["1+1=", "2+2="]})
    QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args_for(tmp_path), train_dataset=plain,
                    processing_class=base_tok)  # fmt: skip


def test_generation_wave_rows_on_an_engine_without_waves_is_refused():
    """Only the graph engine generates in waves; elsewhere generation_wave_rows would be ignored without a word (the
    whole batch decoded at once, the memory it was meant to bound spent)."""
    with pytest.raises(ValueError, match=r"generation_wave_rows=4 .* rollout_engine='transformers'"):
        QeRLConfig(output_dir="x", generation_wave_rows=4)
    assert QeRLConfig(output_dir="x", generation_wave_rows=4, rollout_engine="graph").generation_wave_rows == 4


def test_lora_target_modules_all_linear_adapts_every_projection(tmp_path, tokenizer):
    """``--lora_target_modules all-linear`` (PEFT's shorthand, which TRL's own scripts take) reached PEFT as the list
    ``['all-linear']``, a module name, and failed once the policy had loaded ("Target modules {'all-linear'} not found
    in the base model"; the memory plan refused it as an unknown target on a GPU). It now means PEFT's all-linear:
    every projection gets LoRA, ``lm_head`` none, and the plan counts the seven."""
    from qerl_trl.memory_plan import LORA_TARGETS, run_shape_from_config

    args = args_for(tmp_path, lora_target_modules=["all-linear"])
    assert run_shape_from_config(args).lora_targets == LORA_TARGETS
    trainer = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args, train_dataset=arithmetic(),
                              processing_class=tokenizer)  # fmt: skip
    adapted = {name.rsplit(".", 1)[-1] for name, m in trainer.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(LORA_TARGETS), adapted


def test_more_aqn_stages_than_steps_is_said_in_one_warning(tmp_path, tokenizer, caplog):
    """aqn_num_stages above the run's steps (the recipe's 5 stages with --max_steps 3, or 2 stages over 1 step) left
    stages without a step without a word: 4 stages over 2 steps never used stage 1's sigma_start nor the last stage,
    and 2 stages over 1 step never added any noise though aqn was on. One warning now names the empty stages."""
    trainer = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args_for(tmp_path, aqn_num_stages=4),
                              train_dataset=arithmetic(), processing_class=tokenizer)  # fmt: skip

    def warnings_for(total_steps: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qerl_trl.trainer"):
            trainer.build_aqn_controller(total_steps)
        return [r.getMessage() for r in caplog.records if "aqn_num_stages" in r.getMessage()]

    said = warnings_for(2)
    assert len(said) == 1 and "\n" not in said[0], said
    assert "aqn_num_stages 4 over 2 training steps" in said[0] and "stage(s) 1, 3 get no step" in said[0], said
    assert "aqn_num_stages <= 2" in said[0], said
    assert warnings_for(4) == [] and warnings_for(40) == []
    trainer.args.aqn_num_stages = 2
    (said,) = warnings_for(1)
    assert "no noise at all" in said, said


def test_the_model_card_of_a_local_base_model_names_it(tmp_path, tiny_dir):
    """The model card each checkpoint save writes (``<output_dir>/README.md``, TRL's) said "This model is a fine-tuned
    version of [None](https://huggingface.co/None)" and ``pipeline(..., model="None")`` whenever the base model was
    a local folder, as the offline default always is. It now names the folder, and the quick start the adapter."""
    args = args_for(tmp_path, max_steps=1, save_steps=1)
    trainer = QeRLGRPOTrainer(str(tiny_dir), even_token_reward, args, train_dataset=arithmetic())
    trainer.train()
    card = (Path(args.output_dir) / "README.md").read_text()
    assert "[None]" not in card and 'model="None"' not in card, card
    assert f"`{tiny_dir}`" in card and f'model="{Path(args.output_dir) / "final"}"' in card, card


def test_a_constant_sigma_below_the_default_end_is_accepted():
    """The constant schedule ignores aqn_sigma_end (docs/aqn.md); a constant σ of 1e-4 must not be refused for being
    below the default aqn_sigma_end of 5e-4. A decaying schedule still needs end <= start."""
    assert QeRLConfig(output_dir="x", aqn_schedule="constant", aqn_sigma_start=1e-4).aqn_sigma_start == 1e-4
    with pytest.raises(ValueError, match="aqn_sigma_end <= aqn_sigma_start"):
        QeRLConfig(output_dir="x", aqn_schedule="exponential", aqn_sigma_start=1e-4)


def test_compiled_generation_config_turns_on_the_compiled_static_decode(tmp_path):
    """TRL builds its generation config with disable_compile=True; on CUDA the trainer turns the compiled decode
    back on for a static cache, with a fixed cache length (no recompile per prompt length)."""
    from qerl_trl.rollout.transformers import compiled_generation_config
    from transformers import GenerationConfig

    args = QeRLConfig(output_dir=str(tmp_path), max_completion_length=64, generation_prompt_cache_len=100)
    gc = compiled_generation_config(GenerationConfig(cache_implementation="static", disable_compile=True), args)
    assert gc.disable_compile is False and gc.compile_config.dynamic is False and gc.max_cache_len == 164
    kept = GenerationConfig(cache_implementation="static", disable_compile=True, max_cache_len=4096)
    assert compiled_generation_config(kept, args).max_cache_len == 4096
    for gc in (
        GenerationConfig(disable_compile=True),
        GenerationConfig(cache_implementation="static", disable_compile=True),
    ):
        off = QeRLConfig(output_dir=str(tmp_path), compile_generation=False)
        cfg = compiled_generation_config(gc, off if gc.cache_implementation else args)
        assert cfg.disable_compile is True and getattr(cfg, "max_cache_len", None) is None


def test_calibrated_policy_is_cached_and_reused_on_resume(tmp_path, tokenizer, tiny_dir, caplog):
    """``quantization="gptq"``: calibrated on the first training prompts, saved under ``<output_dir>/calibrated``; a
    second trainer on the same run (a resume) loads that checkpoint instead of calibrating again."""

    args = args_for(tmp_path, quantization="gptq", calibration_samples=4, max_steps=1)
    first = QeRLGRPOTrainer(str(tiny_dir), even_token_reward, args, train_dataset=arithmetic(),
                            processing_class=tokenizer)  # fmt: skip
    cached = list((Path(args.output_dir) / "calibrated").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("tiny-llama-gptq-"), cached
    qc = json.loads((cached[0] / "config.json").read_text())["quantization_config"]
    assert qc["qerl"]["method"] == "gptq" and qc["qerl"]["calibration_samples"] == 4
    first.train()
    with caplog.at_level(logging.INFO, logger="qerl_trl.policy"):
        again = QeRLGRPOTrainer(str(tiny_dir), even_token_reward, args, train_dataset=arithmetic(),
                                processing_class=tokenizer)  # fmt: skip
    assert "no new calibration" in caplog.text
    packed = lambda m: {n: b for n, b in m.named_buffers() if n.endswith("weight_packed")}  # noqa: E731
    a, b = packed(first.model), packed(again.model)
    assert a and set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    # other prompts are another calibration: a new cache entry
    QeRLGRPOTrainer(str(tiny_dir), even_token_reward, args, train_dataset=arithmetic(32).select(range(8, 32)),
                    processing_class=tokenizer)  # fmt: skip
    assert len(list((Path(args.output_dir) / "calibrated").iterdir())) == 2


class SlowSaveTrainer(QeRLGRPOTrainer):
    """Saves step ``slow_step`` slowly: after the adapter and optimizer are written, it touches ``marker`` and sleeps,
    so the test can kill the process in the middle of that save."""

    slow_step, marker = 0, ""

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        if self.state.global_step == self.slow_step:
            Path(self.marker).touch()
            time.sleep(300)


def _train_until_killed(args, tokenizer, marker: str) -> None:
    SlowSaveTrainer.slow_step, SlowSaveTrainer.marker = 2, marker
    SlowSaveTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args, train_dataset=arithmetic(),
                    processing_class=tokenizer).train()  # fmt: skip


def test_kill_during_a_save_leaves_no_checkpoint_folder_and_resume_continues(tmp_path, tokenizer):
    """SIGKILL while checkpoint-2 is being written (a forked training process, its save slowed by a test hook): no
    ``checkpoint-2`` appears, ``save_total_limit=1`` has not deleted checkpoint-1 (rotation waits for the new folder),
    and ``resume_from_checkpoint=True`` continues from checkpoint-1 to a complete checkpoint-2."""
    import multiprocessing
    import signal

    from qerl_trl.checkpoints import STAGING_DIR, check_checkpoint, checkpoint_folders

    args = args_for(tmp_path, max_steps=2, save_steps=1, save_total_limit=1)
    run, marker = Path(args.output_dir), tmp_path / "saving-step-2"
    child = multiprocessing.get_context("fork").Process(target=_train_until_killed, args=(args, tokenizer, str(marker)))
    child.start()
    deadline = time.monotonic() + 240
    while not marker.exists() and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), f"the training process never reached the save of step 2 (exit code {child.exitcode})"
    staged = run / STAGING_DIR / "checkpoint-2"
    assert (staged / "adapter_model.safetensors").is_file() and (staged / "optimizer.pt").is_file()  # mid-save
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL

    assert [p.name for p in checkpoint_folders(run)] == ["checkpoint-1"]
    required = ["optimizer.pt", "scheduler.pt", AQN_STATE_NAME]
    check_checkpoint(run / "checkpoint-1", required)
    resumed = QeRLGRPOTrainer(tiny_nvfp4_policy(tokenizer), even_token_reward, args, train_dataset=arithmetic(),
                              processing_class=tokenizer)  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2 and sorted(step_numbers(resumed)) == [1, 2]
    assert [p.name for p in checkpoint_folders(run)] == ["checkpoint-2"]  # rotated once checkpoint-2 was in place
    check_checkpoint(run / "checkpoint-2", required)
    assert not (run / STAGING_DIR).exists()


def test_micro_batches_by_length_sorts_rows_and_cuts_each_micro_batch_to_its_longest():
    """Rows sorted by completion length into micro-batches of the same size; each micro-batch's per-token tensors cut
    after its longest row's last real token (the prompt's and per-row values untouched); every value moves with its
    row; a masked token inside a row is kept."""
    from qerl_trl.trainer import micro_batches_by_length

    lengths = [5, 1, 3, 2, 6, 1, 4, 2]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    mask[6, 1] = 0  # a masked token inside a row (a tool result): still before the row's last real token
    rows = {"prompt_ids": torch.arange(8)[:, None].repeat(1, 3), "prompt_mask": torch.ones(8, 3, dtype=torch.long),
            "completion_ids": torch.arange(48).view(8, 6) * mask, "completion_mask": mask,
            "old_per_token_logps": -torch.rand(8, 6) * mask, "importance_sampling_ratio": torch.rand(8, 1),
            "advantages": torch.arange(8.0), "num_items_in_batch": torch.tensor(int(mask.sum())), "ids": list(range(8))}  # fmt: skip
    batches = [{k: v[i : i + 2] if isinstance(v, list) or (torch.is_tensor(v) and v.ndim) else v for k, v in
                rows.items()} for i in range(0, 8, 2)]  # fmt: skip
    out = micro_batches_by_length(batches)
    assert [b["ids"] for b in out] == [[1, 5], [3, 7], [2, 6], [0, 4]]  # stable sort by length
    assert [b["completion_ids"].shape[1] for b in out] == [1, 2, 4, 6]
    for b in out:
        keep = b["completion_ids"].shape[1]
        for j, i in enumerate(b["ids"]):
            assert torch.equal(b["completion_ids"][j], rows["completion_ids"][i, :keep])
            assert torch.equal(b["completion_mask"][j], mask[i, :keep])
            assert torch.equal(b["old_per_token_logps"][j], rows["old_per_token_logps"][i, :keep])
            assert torch.equal(b["importance_sampling_ratio"][j], rows["importance_sampling_ratio"][i])
            assert torch.equal(b["prompt_ids"][j], rows["prompt_ids"][i]) and b["advantages"][j] == i
            assert int(mask[i, keep:].sum()) == 0  # only padding was cut
        assert b["num_items_in_batch"] == int(mask.sum())
    images = [{**b, "pixel_values": torch.zeros(5, 3)} for b in batches]  # not re-split, only cut
    assert [b["ids"] for b in micro_batches_by_length(images)] == [b["ids"] for b in batches]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampling_correction_is_trls_importance_ratio(mode):
    """The deferred correction computes TRL's vLLM importance-sampling ratio (GRPOTrainer's formulas, restated here
    from trl 1.16's _generate_and_score_completions): NaN engine logprobs give ratio 1, padding gives 1, clipping or
    masking at the bounds, per token or per sequence."""
    from qerl_trl.trainer import sampling_correction

    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 9, generator=g) * 3
    sampling = trainer + torch.randn(6, 9, generator=g) * 0.5
    sampling[1, 2] = float("nan")
    mask = (torch.arange(9) < torch.tensor([9, 7, 5, 3, 9, 1])[:, None]).float()
    lo, hi = 0.5, 2.0
    diff = torch.nan_to_num((trainer - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    want = ratio.clamp(lo, hi) if mode.endswith("truncate") else ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    got = sampling_correction(trainer, sampling, mask, mode, lo, hi)
    assert got.shape == want.shape and torch.equal(got, want)
    assert got.shape == ((6, 1) if mode.startswith("sequence") else (6, 9))
    if mode == "token_truncate":
        assert got[1, 2] == 1 and got[5, 3] == 1  # no engine logprob; padding
    if mode.endswith("mask"):  # no bound given: nothing masked
        assert (sampling_correction(trainer, sampling, mask, mode, None, None) > 0).all()
    with pytest.raises(ValueError, match="token_truncate"):
        sampling_correction(trainer, sampling, mask, "tokens", lo, hi)


def test_importance_sampling_is_per_token_by_default():
    """QeRL's default correction is TRL's ``token_truncate`` (each token's ratio clipped, every completion kept), not
    TRL's own default ``sequence_mask``, whose ratio is the product over the completion. At a per-token gap like the
    one AQN's noise makes on the H100 (offline default, σ = 1e-2: mean |Δ logprob| ≈ 0.2) a ratio over 300 tokens
    leaves most completions with almost no weight or none; per token, no completion drops out."""
    from qerl_trl.trainer import sampling_correction
    from trl import GRPOConfig

    assert GRPOConfig.__dataclass_fields__["vllm_importance_sampling_mode"].default == "sequence_mask"  # TRL's
    assert QeRLConfig(output_dir="x").vllm_importance_sampling_mode == "token_truncate"
    assert QeRLDAPOConfig(output_dir="x").vllm_importance_sampling_mode == "token_truncate"
    assert QeRLConfig(output_dir="x", vllm_importance_sampling_mode="sequence_mask").vllm_importance_sampling_mode == (
        "sequence_mask"
    )
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(256, 300, generator=g) * 3
    sampling = trainer + torch.randn(256, 300, generator=g) * 0.25  # mean |gap| 0.2
    mask = torch.ones(256, 300)
    per_sequence = sampling_correction(trainer, sampling, mask, "sequence_mask", None, 3.0)[:, 0]
    per_token = sampling_correction(trainer, sampling, mask, "token_truncate", None, 3.0)
    assert (per_sequence < 0.1).float().mean() > 0.3 and (per_sequence == 0).float().mean() > 0.3
    weight = (per_token * mask).sum(-1) / mask.sum(-1)  # what each completion's tokens carry on average
    assert weight.min() > 0.8 and (weight - 1).abs().mean() < 0.1


def test_an_unknown_importance_sampling_mode_is_refused_with_the_config():
    """A misspelt vllm_importance_sampling_mode used to pass the config and stop the run at its first loss (graph and
    vLLM engines: the correction and its metrics run even with the correction off), after the model had loaded."""
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode must be one of .*token_truncate.*got 'token'"):
        QeRLConfig(output_dir="x", rollout_engine="graph", vllm_importance_sampling_mode="token")


@pytest.mark.parametrize("field, value", [("loss_type", "dapoo"), ("scale_rewards", "grop"),
                                          ("multi_objective_aggregation", "sum")])  # fmt: skip
def test_trl_names_it_reads_only_inside_a_step_are_checked_with_the_config(field, value):
    """TRL 1.16 reads these only in the first step (advantages, loss), after the model has loaded and generated."""
    with pytest.raises(ValueError, match=rf"{field} must be one of .*got '{value}'"):
        QeRLConfig(output_dir="x", **{field: value})
    for loss in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"):
        QeRLConfig(output_dir="x", loss_type=loss)
    assert QeRLConfig(output_dir="x", scale_rewards=False).scale_rewards == "none"  # TRL's bool spelling still works


def test_sampling_correction_is_off_under_aqn_at_w4a16_unless_set():
    """AQN's noise lives in the engine's norms only, so TRL's correction would re-weight the exploration it adds: off by
    default while AQN is on with W4A16 rollouts (vLLM reached 0.856 / 0.838 without it on the offline default, 0.725 /
    0.787 with it), on without AQN (TRL's default) and with FP8 rollouts (a numeric gap); a value set is kept."""
    from trl import GRPOConfig

    assert GRPOConfig.__dataclass_fields__["vllm_importance_sampling_correction"].default is True  # TRL's
    assert QeRLConfig(output_dir="x").vllm_importance_sampling_correction is False
    assert QeRLDAPOConfig(output_dir="x").vllm_importance_sampling_correction is False
    assert QeRLConfig(output_dir="x", aqn=False).vllm_importance_sampling_correction is True
    fp8 = QeRLConfig(output_dir="x", rollout_engine="vllm", rollout_precision="fp8")
    assert fp8.vllm_importance_sampling_correction is True
    for value in (True, False):
        set_ = QeRLConfig(output_dir="x", vllm_importance_sampling_correction=value)
        assert set_.vllm_importance_sampling_correction is value


def test_micro_batches_by_length_give_the_same_step(tmp_path, tokenizer, monkeypatch):
    """The GPU re-split (rows sorted by completion length, each micro-batch cut to its longest row; for DAPO's
    token-summed loss also sized to even out their padded positions) makes the same optimizer step as TRL's shuffled,
    padded micro-batches of equal size: loss, gradient norm and LoRA update (one generation batch per step)."""
    from functools import partial

    import qerl_trl.trainer as trainer_module

    results = []
    for split in ("trl", "by_length", "balanced", "fewest"):
        model = tiny_nvfp4_policy(tokenizer)
        # a 40th of the vocabulary ends a completion (TRL reads the ids from the generation config): lengths spread,
        # the longest well past the prompt's ~36 tokens (as in the recipes: else no two rows fit one row's positions)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(1, len(tokenizer), 40)]
        rows = 1 if split == "fewest" else 2  # fewest: one row a micro-batch, as the 32B DAPO recipe; same 8 rows
        args = args_for(tmp_path / split, max_steps=1, aqn=False, optim="sgd", per_device_train_batch_size=rows,
                        gradient_accumulation_steps=8 // rows, max_completion_length=128)  # fmt: skip
        assert args.loss_type == "dapo"
        trainer = QeRLGRPOTrainer(
            model, even_token_reward, args, train_dataset=arithmetic(), processing_class=tokenizer
        )
        shapes: list[tuple[int, int]] = []
        if split == "trl":
            monkeypatch.setattr(trainer, "_regroups_micro_batches", lambda: False)
        else:  # this CPU process takes the GPU branch's re-split
            resplit = partial(trainer_module.micro_batches_by_length, balance=split != "by_length",
                              fewest=split == "fewest")  # fmt: skip
            monkeypatch.setattr(trainer_module, "micro_batches_by_prompt", resplit)
        real = trainer._compute_loss
        monkeypatch.setattr(trainer, "_compute_loss", lambda m, inputs, real=real, shapes=shapes: (
            shapes.append(tuple(inputs["completion_ids"].shape)), real(m, inputs))[1])  # fmt: skip
        trainer.train()
        monkeypatch.undo()
        lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        results.append((trainer.state.log_history[0], lora, shapes))
    (logs0, lora0, shapes0), *others = results
    widths0 = {w for _, w in shapes0}
    assert len(widths0) == 1 and {r for r, _ in shapes0} == {2}  # TRL's: all padded to the longest, 2 rows each
    (_, _, by_length), (_, _, balanced), (logs3, _, fewest) = others
    assert {r for r, _ in by_length} == {2} and min(w for _, w in by_length) < max(widths0), by_length
    assert sum(r for r, _ in balanced) == 8 and len({r for r, _ in balanced}) > 1, balanced  # sizes differ
    assert max(r * w for r, w in balanced) <= max(r * w for r, w in by_length)
    # fewest: the same rows in fewer forwards (the empty micro-batches run none), none larger than balanced's largest
    assert sum(r for r, _ in fewest) == 8 and len(fewest) < 8, fewest  # of 8 micro-batches, some left empty
    assert max(r * w for r, w in fewest) <= max(r * w for r, w in balanced)
    assert logs3["tokens_per_second/training"] > 0  # empty micro-batches are not averaged in
    for logs1, lora1, _ in others:
        assert_same_step(logs0, lora0, logs1, lora1)


def test_balanced_sizes_even_out_padded_positions():
    """``parts`` consecutive sizes summing to the rows, each ≥ 1, whose largest ``rows × (width + longest)`` is the
    smallest any consecutive split reaches (checked against every split of a small case)."""
    import itertools

    from qerl_trl.trainer import balanced_sizes

    def worst(lengths, width, sizes):
        ends = list(itertools.accumulate(sizes))
        return max(s * (width + lengths[e - 1]) for s, e in zip(sizes, ends, strict=True))

    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n, parts = int(torch.randint(4, 13, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        lengths = sorted(torch.randint(0, 50, (n,), generator=g).tolist())
        width = int(torch.randint(0, 20, (1,), generator=g))
        sizes = balanced_sizes(lengths, width, parts)
        assert len(sizes) == parts and sum(sizes) == n and min(sizes) >= 1
        best = min(worst(lengths, width, [b - a for a, b in itertools.pairwise((0, *cut, n))])
                   for cut in itertools.combinations(range(1, n), parts - 1))  # fmt: skip
        assert worst(lengths, width, sizes) == best, (lengths, width, parts, sizes)
    # the 7B GSM8K step's shape: 128 rows in 8 micro-batches, lengths 100 + Geometric(200) capped at 4,096
    torch.manual_seed(0)
    draws = torch.distributions.Geometric(torch.full((128,), 1 / 200)).sample()
    lengths = sorted(min(4096, 100 + int(d)) for d in draws.tolist())
    sizes = balanced_sizes(lengths, 256, 8)
    assert worst(lengths, 256, sizes) < 0.6 * worst(lengths, 256, [16] * 8)


def test_fewest_sizes_keep_the_largest_micro_batch_and_use_fewer():
    """``fewest``: the fewest consecutive micro-batches whose largest padded size is the balanced split's (checked
    against every split of a small case), then empty ones up to ``parts``; the 32B DAPO recipe's shape (128 rows, one
    a micro-batch) packs into a fraction of the micro-batches."""
    import itertools

    from qerl_trl.trainer import balanced_sizes

    def worst(lengths, width, sizes):
        ends = list(itertools.accumulate(s for s in sizes if s))
        return max(s * (width + lengths[e - 1]) for s, e in zip([s for s in sizes if s], ends, strict=True))

    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        n, parts = int(torch.randint(4, 11, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        lengths = sorted(torch.randint(0, 50, (n,), generator=g).tolist())
        width = int(torch.randint(0, 20, (1,), generator=g))
        bound = worst(lengths, width, balanced_sizes(lengths, width, parts))
        sizes = balanced_sizes(lengths, width, parts, fewest=True)
        used = [s for s in sizes if s]
        assert len(sizes) == parts and sum(sizes) == n and sizes[: len(used)] == used  # the empty ones last
        assert worst(lengths, width, sizes) <= bound
        least = min(k for k in range(1, n + 1) for cut in itertools.combinations(range(1, n), k - 1)
                    if worst(lengths, width, [b - a for a, b in itertools.pairwise((0, *cut, n))]) <= bound)  # fmt: skip
        assert len(used) == least, (lengths, width, parts, sizes)
    # the 32B DAPO recipe: 128 completions, 200 + Geometric(800) capped at 8,192, prompt 256, one row a micro-batch
    torch.manual_seed(0)
    draws = torch.distributions.Geometric(torch.full((128,), 1 / 800)).sample()
    lengths = sorted(min(8192, 200 + int(d)) for d in draws.tolist())
    sizes = balanced_sizes(lengths, 256, 128, fewest=True)
    assert worst(lengths, 256, sizes) == 256 + lengths[-1]  # the longest row alone, as before
    assert sum(1 for s in sizes if s) < 50
