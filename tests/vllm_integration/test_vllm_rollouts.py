"""``QeRLGRPOTrainer(rollout_engine="vllm")`` on the real CPU engine, offline default model in NVFP4 (RTN).

Colocate (one trainer + in-process engine per module): GRPO steps run through vLLM with TRL's importance-sampling
correction on; the engine follows the trainer's LoRA updates (adapter sync, never merged); AQN noise reaches the
engine's norms (the same draw as the transformers path) and is restored bit-identically. Server mode: a separately
launched ``vllm.entrypoints.openai.api_server`` (LoRA via ``/v1/load_lora_adapter``, norms via dev-mode
``/collective_rpc``), killed at the end whatever happens.

Measured on this machine (2 CPU cores, fp32 engine + fp32 trainer; see the printed reports):
``sampling/sampling_logp_difference/mean`` ≈ 7e-6 (max ≈ 3e-5) on noise-free steps, also after LoRA updates;
≈ 0.36 on a σ = 0.01 step (there the engine samples from the noisy policy, the trainer scores with the clean one).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from vllm_test_helpers import (
    EAGER,
    ENGINE_DTYPE,
    TOL,
    check_forced,
    compare_forced,
    hf_forced,
    nvfp4_offline_checkpoint,
    too_few_gpus,
    vllm_server,
)

PROMPTS = ["The capital of France is", "Question: Tom has 3 apples and buys 5 more. How many apples does he have?"]
N_TOKENS = 8
LORA_RANK = 8
SIGMA = 0.01
# bounds over measured values: the engine-vs-trainer gaps per engine dtype (vllm_test_helpers.TOL: float32 on CPU,
# measured ~7e-6; bf16 on CUDA, 0.03-0.04), and on a σ = 0.01 step (float32: ~0.36; bf16 on the H100: 0.67)
CLEAN_GAP = TOL.clean_gap  # sampling_logp_difference/mean on noise-free steps
NOISY_GAP = 1.5


def even_token_reward(completions, completion_ids, **kwargs):
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def _args(tmp: Path, cls=None, vllm: dict | None = None, **kw):
    from qerl_trl.config import QeRLConfig

    base = dict(
        output_dir=str(tmp / "run"),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=N_TOKENS,
        logging_steps=1,
        save_steps=1000,
        report_to=[],
        learning_rate=1e-3,
        gradient_checkpointing=False,
        seed=0,
        disable_tqdm=True,
        lora_r=LORA_RANK,
        # two stages over the run: noise-free first, then σ = SIGMA
        aqn_num_stages=2,
        aqn_sigma_start=SIGMA,
        aqn_sigma_end=SIGMA,
        rollout_engine="vllm",
        vllm={"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": EAGER, **(vllm or {})},
    )
    base.update(kw)
    return (cls or QeRLConfig)(**base)


def _dataset():
    from qerl_trl.tasks import load_task

    return load_task("arithmetic", n_examples=16, demo=False)


def _steps(trainer):
    return [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return nvfp4_offline_checkpoint()


def test_dapo_step_with_dynamic_sampling_through_colocated_vllm(ckpt, tmp_path):
    """DAPO's refill rounds concatenate the engine's batches (sampling logprobs, IS ratios) like TRL's own."""
    from qerl_trl.config import QeRLDAPOConfig
    from qerl_trl.dapo import QeRLDAPOTrainer

    args = _args(tmp_path, cls=QeRLDAPOConfig, max_steps=1, max_resample_rounds=1, aqn=False)
    trainer = QeRLDAPOTrainer(str(ckpt), even_token_reward, args, train_dataset=_dataset())
    try:
        trainer.train()
    finally:
        trainer.rollout.generation.close()
    steps = _steps(trainer)
    assert trainer.state.global_step == 1 and len(steps) == 1
    gap = steps[0]["sampling/sampling_logp_difference/mean"]
    print(f"\n[dapo] logp_gap_mean={gap}  resample_rounds={steps[0].get('dapo/resample_rounds')}")
    assert math.isfinite(gap) and gap < CLEAN_GAP


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 GRPO steps with colocated vLLM rollouts (steps 0-1 noise-free, step 2 at σ = SIGMA).

    The policy is the dense offline default quantized on load (RTN): the trainer saves that NVFP4 model once for the
    engine (same tensors as the trainer's, so the engine-vs-trainer gaps below are pure engine arithmetic)."""
    from qerl_trl.trainer import QeRLGRPOTrainer

    tmp = tmp_path_factory.mktemp("colocate")
    trainer = QeRLGRPOTrainer(
        "offline-default",
        even_token_reward,
        _args(tmp, vllm={"cache_dir": str(tmp / "vllm-cache")}),
        train_dataset=_dataset(),
    )
    scoring = []  # autograd on or off in each logprob pass of the trainer: TRL scores old logprobs with it off
    score = trainer._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        scoring.append(torch.is_grad_enabled()),
        score(*a, **k),
    )[1]
    synced = []  # the global_step of each sync_lora call the trainer makes
    sync = trainer.rollout.sync_lora
    trainer.rollout.sync_lora = lambda: (synced.append(trainer.state.global_step), sync())[1]
    start = time.perf_counter()
    trainer.train()
    trainer._test_train_seconds = time.perf_counter() - start
    del trainer._get_per_token_logps_and_entropies, trainer.rollout.sync_lora
    trainer._test_scoring_passes, trainer._test_synced = scoring, synced
    yield trainer
    trainer.rollout.generation.close()


def _prompt_ids(trainer):
    tok = trainer.processing_class
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _engine_greedy(trainer, prompt_ids, **kw):
    # no min_tokens: with processed_logprobs vLLM reports logprobs after its min-tokens EOS mask (renormalized),
    # HF's raw logits do not; both sides stop at EOS instead
    return trainer.rollout.generation.engine.generate(prompt_ids, {"temperature": 0.0, "max_tokens": N_TOKENS}, **kw)


def _hf_forced(trainer, prompt_ids, engine_out):
    """The trainer's policy (float32, dequantized weights held) teacher-forced on the engine's tokens."""
    from nvfp4 import cache_dequantized

    model = trainer.accelerator.unwrap_model(trainer.model)
    was_training = model.training
    model.eval()
    try:
        with cache_dequantized(model, torch.float32):
            return hf_forced(model, prompt_ids, engine_out)
    finally:
        model.train(was_training)


def test_grpo_step_with_fp8_rollouts_through_colocated_vllm(ckpt, tmp_path):
    """``rollout_precision="fp8"`` (issue #51): the trainer's engine loads with the plugin's FP8 path (its linears
    hold the E4M3 copy only) and a GRPO step runs; the engine-vs-trainer logprob gap TRL logs is the FP8 error, well
    above a W4A16 engine's float32 rounding, and TRL's importance-sampling correction sees it."""
    from qerl_trl.trainer import QeRLGRPOTrainer

    args = _args(tmp_path, max_steps=1, aqn=False, rollout_precision="fp8")
    trainer = QeRLGRPOTrainer(str(ckpt), even_token_reward, args, train_dataset=_dataset())
    try:
        trainer.train()

        def weight_dtypes(model):
            return sorted({str(m.weight.dtype) for m in model.modules()
                           if type(getattr(m, "quant_method", None)).__name__ == "NVFP4KernelLinearMethod"})  # fmt: skip

        assert trainer.rollout.generation.engine.llm.apply_model(weight_dtypes)[0] == ["torch.float8_e4m3fn"]
        (step,) = _steps(trainer)
        gap = step["sampling/sampling_logp_difference/mean"]
        print(f"\n[fp8 colocate] sampling_logp_difference/mean={gap:.4f} max="
              f"{step['sampling/sampling_logp_difference/max']:.3f}")  # fmt: skip
        assert CLEAN_GAP < gap < NOISY_GAP and "sampling/importance_sampling_ratio/mean" in step
    finally:
        trainer.rollout.close()


def test_grpo_steps_through_colocated_vllm_log_logprob_gap_and_sigma(trained):
    from qerl_trl.rollout.vllm import ColocateVLLMGeneration

    assert isinstance(trained.rollout.generation, ColocateVLLMGeneration)
    saved = Path(trained.rollout.generation.engine.model_path)  # the NVFP4 checkpoint written for the engine
    assert saved.parent.name == "vllm-cache"
    assert (
        json.loads((saved / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    )
    assert trained.use_vllm and not trained.args.use_vllm  # TRL's correction on; its own VLLMGeneration never built
    # the engine is driven through the RolloutEngine interface: nothing of TRL's vLLM branch is planted in the trainer
    assert not hasattr(trained, "vllm_generation") and not hasattr(trained, "_last_loaded_step")
    assert trained._test_synced == [0, 1, 2]  # sync_lora once per step, by the trainer
    assert trained.state.global_step == 3
    steps = _steps(trained)
    assert len(steps) == 3
    gaps = [s["sampling/sampling_logp_difference/mean"] for s in steps]
    sigmas = [s["aqn/sigma"] for s in steps]
    print(
        f"\n[colocate] train {trained._test_train_seconds:.0f}s  sigma={sigmas}  logp_gap_mean={gaps}  "
        f"logp_gap_max={[s['sampling/sampling_logp_difference/max'] for s in steps]}"
    )
    assert sigmas == [0.0, 0.0, SIGMA]
    assert all(math.isfinite(g) for g in gaps)
    # steps 0 and 1: the engine holds the trainer's policy (step 1: after one LoRA update, synced as an adapter)
    assert gaps[0] < CLEAN_GAP and gaps[1] < CLEAN_GAP
    # step 2: the engine sampled under AQN noise, the trainer scores with the clean policy (IS correction applies)
    assert CLEAN_GAP < gaps[2] < NOISY_GAP
    assert all("sampling/importance_sampling_ratio/mean" in s for s in steps)
    # on-policy steps: the correction came from the loss forward, no separate scoring forward ran
    passes = trained._test_scoring_passes
    assert trained._defers_sampling_correction() and passes and all(passes), passes
    assert trained.rollout.generation.last_synced_step == 2
    lora_moved = [
        n for n, p in trained.model.named_parameters() if p.requires_grad and "lora_B" in n and p.abs().max() > 0
    ]
    assert lora_moved, "LoRA did not train"


def test_colocated_trainer_views_what_the_engine_holds_by_default(trained):
    """``vllm.share_weights`` (default on): after the engine started, the trainer's frozen tensors the engine holds
    bit for bit are views of its parameters. On CPU the default linear backend dequantizes (a dense weight), so only the
    (tied) embedding is shared and every packed linear keeps the trainer's copy, with the reason; with the ``qerl``
    backend (CUDA's default from Hopper on) everything is."""
    from nvfp4 import NVFP4Linear
    from qerl_vllm.quant import resolve_backend

    report = trained.rollout.generation.shared_weights
    model = trained.accelerator.unwrap_model(trained.model)
    linears = sum(isinstance(m, NVFP4Linear) for m in model.modules())
    print(f"\n[shared weights, {resolve_backend()} backend] {report.summary()}")
    assert "model.embed_tokens.weight" in report.shared and report.bytes_freed > 0
    if resolve_backend() == "qerl":
        assert report.not_shared == {} and len(report.shared) == 3 * linears + 1
    else:
        assert len(report.not_shared) == 3 * linears and linears == 210
        assert all("through NVFP4DequantLinearMethod, not as packed NVFP4" in why for why in report.not_shared.values())
    engine_embed = trained.rollout.generation.engine.shareable_weights().dense["model.embed_tokens.weight"]
    assert model.get_input_embeddings().weight.data_ptr() == engine_embed.data_ptr()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied


def _max_logprob_change(outs, refs) -> float:
    return max(abs(a - b) for o, r in zip(outs, refs) for a, b in zip(o.logprobs, r.logprobs))


def test_engine_follows_lora_update_like_the_trainer(trained):
    """The engine with the synced adapter matches the trainer's PeftModel (teacher-forced, per-dtype tolerance) and
    differs from its base model by far more than from itself run to run (the same generation twice: 0 where LoRA is
    bit-reproducible, on CUDA through the session's one-split LoRA shrink, conftest.py). The engine-vs-trainer gap is
    no noise floor for it: in bf16 that gap is rounding of the adapter's effect's order (mean 0.061 against a 0.27
    effect on the H200, 2026-11-28)."""
    trained.rollout.generation.sync_weights()  # the adapter after the last optimizer step (global_step 3)
    assert trained.rollout.generation.last_synced_step == 3
    prompt_ids = _prompt_ids(trained)
    ours = _engine_greedy(trained, prompt_ids)
    run_to_run = _max_logprob_change(_engine_greedy(trained, prompt_ids), ours)
    cmp = compare_forced(ours, _hf_forced(trained, prompt_ids, ours))
    base = _engine_greedy(trained, prompt_ids, lora=None)
    lora_effect = _max_logprob_change(ours, base)
    print(f"\n[lora] engine vs HF PeftModel: {cmp}; engine synced-vs-base max |Δlogp| = {lora_effect:.4g}, "
          f"synced run to run {run_to_run:.4g}")  # fmt: skip
    check_forced(cmp)
    assert lora_effect > 10 * max(run_to_run, 1e-5), "the synced adapter should change the engine"


def test_aqn_noise_on_engine_matches_hf_and_restores_bit_identically(trained):
    ctl, rollout = trained.aqn, trained.rollout.generation
    model = trained.accelerator.unwrap_model(trained.model)
    step = 2
    assert ctl.sigma(step) == SIGMA
    prompt_ids = _prompt_ids(trained)
    clean_w = rollout.engine.norm_weights()
    before = _engine_greedy(trained, prompt_ids)
    with trained.rollout.set_noise(ctl, model, step):  # the controller's draw, on the engine's norms
        during = _engine_greedy(trained, prompt_ids)
    after = _engine_greedy(trained, prompt_ids)
    with ctl.rollout(model, step):  # the transformers path's noise at the same step
        cmp = compare_forced(during, _hf_forced(trained, prompt_ids, during))
    delta = max(abs(a - b) for o, p in zip(during, before) for a, b in zip(o.logprobs, p.logprobs))
    print(f"\n[aqn] engine noisy-vs-clean max |Δlogp| = {delta:.4g}; engine vs HF under the same noise: {cmp}")
    assert delta > 1e-3
    check_forced(cmp)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.logprobs for o in after] == [o.logprobs for o in before]  # bit-identical floats
    after_w = rollout.engine.norm_weights()
    assert all(torch.equal(after_w[n], clean_w[n]) for n in clean_w)


# ---------------------------------------------------------------------------------------------- one copy of the weights
@pytest.fixture
def qerl_backend():
    """The engine keeps the NVFP4 linears packed (``QERL_VLLM_NVFP4_BACKEND=qerl``, CUDA's default from Hopper on; on
    CPU its linears run nvfp4's reference op), so that the trainer's packed tensors can be views of them."""
    from qerl_vllm.quant import BACKEND_ENV

    before = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = "qerl"  # read while the engine loads the model (in this process)
    yield
    if before is None:
        os.environ.pop(BACKEND_ENV, None)
    else:
        os.environ[BACKEND_ENV] = before


def _storage_spans(module: torch.nn.Module) -> dict[int, int]:
    """``{storage start: bytes}`` of every parameter and buffer of ``module``."""
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*module.parameters(), *module.buffers())
    }


def test_an_engine_whose_setup_fails_after_its_start_is_closed(ckpt, tmp_path, monkeypatch):
    """An error after the colocated engine started (here the weight share) closes the engine before it propagates:
    its weights and KV cache are not left behind in a process that goes on (a notebook, a retry)."""
    import qerl_trl.rollout.vllm as rollout_vllm
    from qerl_vllm.engine import VLLMEngine

    closed = []
    real_close = VLLMEngine.close

    def close(self):
        closed.append(self)
        real_close(self)

    def refuse(*a, **k):
        raise RuntimeError("weight share refused")

    monkeypatch.setattr(VLLMEngine, "close", close)
    monkeypatch.setattr(rollout_vllm, "share_engine_weights", refuse)
    from qerl_trl.trainer import QeRLGRPOTrainer

    with pytest.raises(RuntimeError, match="weight share refused"):
        QeRLGRPOTrainer(str(ckpt), even_token_reward, _args(tmp_path, max_steps=1, aqn=False), train_dataset=_dataset())
    assert len(closed) == 1


def test_colocated_trainer_and_engine_hold_the_weights_once(ckpt, tmp_path, qerl_backend):
    """Sharing on the real engine (``share_weights_with`` on ``VLLMEngine.shareable_weights``), before and after: every
    frozen NVFP4 tensor and the embedding of the trainer lie inside the engine's parameter storages; the unique bytes of
    trainer + engine drop by exactly the trainer's copies (~60 MB packed + ~113 MB fp32 embedding here); the trainer's
    logits and loss are bit-identical, the engine generates the same tokens and logprobs, and a GRPO step still trains
    the LoRA through the shared base."""
    from nvfp4 import NVFP4Linear
    from qerl_trl.rollout.shared_weights import share_weights_with, unique_storage_bytes
    from qerl_trl.trainer import QeRLGRPOTrainer

    args = _args(tmp_path, max_steps=1, aqn=False, vllm={"share_weights": False})
    trainer = QeRLGRPOTrainer(str(ckpt), even_token_reward, args, train_dataset=_dataset())
    generation = trainer.rollout.generation
    try:
        assert generation.shared_weights.not_shared == {"*": "vllm.share_weights is off"}
        engine = generation.engine
        model = trainer.accelerator.unwrap_model(trainer.model)
        engine_model = engine.llm.apply_model(lambda m: m)[0]  # in-process engine: the worker's model itself
        linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
        embed = model.get_input_embeddings().weight
        own_bytes = unique_storage_bytes(*linears) + embed.untyped_storage().nbytes()
        prompt_ids = _prompt_ids(trainer)
        batch = torch.tensor([prompt_ids[1]], device=embed.device)  # the trainer's device (CUDA there)

        def forward():
            with torch.no_grad():
                out = model(input_ids=batch, labels=batch)
            return out.logits, out.loss

        logits_before, loss_before = forward()
        generated_before = _engine_greedy(trainer, prompt_ids, lora=None)
        bytes_before = unique_storage_bytes(model, engine_model)

        report = share_weights_with(model, engine.shareable_weights())
        print(f"\n[one copy] {report.summary()}")
        assert report.not_shared == {} and len(report.shared) == 3 * len(linears) + 1 == 631
        frozen = [t for m in linears for t in (m.weight_packed, m.weight_scale, m.weight_global_scale)] + [embed]
        spans = _storage_spans(engine_model)
        for t in frozen:  # inside one of the engine's parameter storages
            start = t.untyped_storage().data_ptr()
            assert start in spans and start <= t.data_ptr() < start + spans[start]
        bytes_after = unique_storage_bytes(model, engine_model)
        saved = bytes_before - bytes_after
        print(f"[one copy] trainer + engine unique bytes {bytes_before / 1e6:.1f} MB -> {bytes_after / 1e6:.1f} MB "
              f"(-{saved / 1e6:.1f} MB; the trainer's own copies were {own_bytes / 1e6:.1f} MB)")  # fmt: skip
        assert saved == report.bytes_freed == own_bytes

        logits_after, loss_after = forward()
        assert torch.equal(logits_after, logits_before) and torch.equal(loss_after, loss_before)
        generated_after = _engine_greedy(trainer, prompt_ids, lora=None)
        assert [g.token_ids for g in generated_after] == [g.token_ids for g in generated_before]
        assert [g.logprobs for g in generated_after] == [g.logprobs for g in generated_before]

        trainer.train()  # one GRPO step on the shared base
        steps = _steps(trainer)
        assert trainer.state.global_step == 1 and steps[0]["sampling/sampling_logp_difference/mean"] < CLEAN_GAP
        assert [n for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n and p.abs().max() > 0]
        assert all(t.untyped_storage().data_ptr() in spans for t in frozen)  # still the engine's after training
    finally:
        generation.close()


# ---------------------------------------------------------------------------------------------- server mode
@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    """``vllm serve``-equivalent on 127.0.0.1 with runtime LoRA loading and the dev-mode RPC route; always killed."""
    tmp = tmp_path_factory.mktemp("server")
    args = [
        "--model", str(ckpt), "--dtype", ENGINE_DTYPE, "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager", "--seed", "0",
        "--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", "1",
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "qerl_vllm.worker.QeRLWorkerExtension",
    ]  # fmt: skip
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    with vllm_server(args, tmp / "serve.log", env, timeout=240) as url:
        yield url, tmp


def _server_greedy(rollout, prompt_ids, lora: str | None):
    payload = {
        "model": lora or rollout.base_model,
        "prompt": prompt_ids,
        "max_tokens": N_TOKENS,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    out = rollout._request("POST", "/v1/completions", payload)
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in sorted(out["choices"], key=lambda c: c["index"])]


def test_grpo_steps_through_a_vllm_server(server, ckpt, tmp_path):
    from qerl_trl.rollout.vllm import ServerVLLMGeneration
    from qerl_trl.trainer import QeRLGRPOTrainer

    url, shared = server
    args = _args(tmp_path, max_steps=2, vllm={"server_url": url, "adapter_dir": str(shared / "adapters")})
    trainer = QeRLGRPOTrainer(str(ckpt), even_token_reward, args, train_dataset=_dataset())
    rollout = trainer.rollout.generation
    assert isinstance(rollout, ServerVLLMGeneration) and not hasattr(trainer, "vllm_generation")
    prompt_ids = _prompt_ids(trainer)
    base_before = _server_greedy(rollout, prompt_ids, None)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    steps = _steps(trainer)
    gaps = [s["sampling/sampling_logp_difference/mean"] for s in steps]
    sigmas = [s["aqn/sigma"] for s in steps]
    print(f"\n[server] train {seconds:.0f}s  sigma={sigmas}  logp_gap_mean={gaps}")
    assert trainer.state.global_step == 2 and len(steps) == 2
    assert sigmas == [0.0, SIGMA]  # step 1's noisy norms went through /collective_rpc
    assert gaps[0] < CLEAN_GAP and CLEAN_GAP < gaps[1] < NOISY_GAP

    # norms restored on the server: the base model answers as before training. Same tokens; logprobs equal up to the
    # server's run-to-run float noise (seen: 9e-6 on one token), far below what σ = 1e-2 noise left on would give
    # (gaps ~0.1-1). Bit-identical restore of the weights themselves is checked on the colocated engine.
    after = _server_greedy(rollout, prompt_ids, None)
    assert [ids for ids, _ in after] == [ids for ids, _ in base_before]
    assert max(abs(a - b) for (_, la), (_, lb) in zip(after, base_before) for a, b in zip(la, lb)) < 1e-4
    # LoRA sync through /v1/load_lora_adapter: the server follows the trainer's latest adapter
    rollout.sync_weights()
    models = [m["id"] for m in rollout._request("GET", "/v1/models")["data"]]
    assert rollout.lora_name == "qerl-step2" and rollout.lora_name in models, models
    ours = [tuple(x) for x in _server_greedy(rollout, prompt_ids, rollout.lora_name)]
    cmp = compare_forced(ours, _hf_forced(trainer, prompt_ids, ours))
    print(f"[server lora] server vs HF PeftModel: {cmp}")
    check_forced(cmp)
    json.dumps(steps)  # the logged metrics are plain numbers
    # closing the trainer unloads its adapter from the server and deletes the files it passed (the server stays up)
    trainer.close()
    models = [m["id"] for m in rollout._request("GET", "/v1/models")["data"]]
    assert "qerl-step2" not in models and rollout.base_model in models, models
    assert not any((shared / "adapters").iterdir()), list((shared / "adapters").iterdir())


# ------------------------------------------------------------------------------ server mode, 2 trainer processes
DDP_CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "accelerate" / "ddp.yaml"


def _server_ddp_worker(ckpt: str, url: str, adapter_dir: str, out_dir: str) -> None:
    """One of 2 ``accelerate launch`` trainer processes (DDP over gloo) sharing the server: 2 GRPO steps."""
    from qerl_trl.trainer import QeRLGRPOTrainer

    out = Path(out_dir)
    args = _args(out, max_steps=2, vllm={"server_url": url, "adapter_dir": adapter_dir}, per_device_train_batch_size=4)
    trainer = QeRLGRPOTrainer(ckpt, even_token_reward, args, train_dataset=_dataset())
    sent: list[int] = []
    request = trainer.rollout.generation._request

    def counting(method, path, payload=None):  # what this rank sends to the server, by route
        if path == "/v1/completions":
            sent.append(len(payload["prompt"]))
        elif path in ("/v1/load_lora_adapter", "/collective_rpc"):
            sent.append(path)
        return request(method, path, payload)

    trainer.rollout.generation._request = counting
    trainer.train()
    rank = trainer.accelerator.process_index
    report = {
        "world": trainer.accelerator.num_processes,
        "wrapped": type(trainer.model_wrapped).__name__,
        "global_step": trainer.state.global_step,
        "steps": _steps(trainer),
        "prompts_sent": sum(x for x in sent if isinstance(x, int)),
        "syncs_sent": [x for x in sent if isinstance(x, str)],
        "lora_name": trainer.rollout.generation.lora_name,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    # gloo's threads abort the process at interpreter exit now and then unless the group is destroyed first
    # ("terminate called without an active exception" on rank 0 in one CI run; pytorch#190489)
    trainer.accelerator.wait_for_everyone()  # as qerl train ends: every rank here before the group goes
    trainer.accelerator.end_training()


@pytest.mark.skipif(too_few_gpus(2), reason="2 trainer processes need 2 GPUs under CUDA (NCCL: one device a rank)")
def test_two_trainer_processes_share_one_vllm_server(server, ckpt, tmp_path):
    """``accelerate launch`` (the shipped DDP config, 2 gloo processes) against one server: every rank sends its own
    prompts, only the main process pushes the LoRA adapter and the AQN norms, both ranks finish the same steps."""
    url, shared = server
    out = tmp_path / "ddp"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG), "--num_processes", "2",
        "--mixed_precision", "no", "--main_process_port", str(29500 + os.getpid() % 2000), __file__,
        str(ckpt), url, str(shared / "ddp-adapters"), str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    written = sorted(p.name for p in out.glob("rank*.json"))  # says whether a failure came before or after training
    assert proc.returncode == 0, f"reports written: {written}\n" + (proc.stdout + proc.stderr)[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"\n[server ddp] {[(r['prompts_sent'], r['syncs_sent']) for r in ranks]}")
    assert [r["world"] for r in ranks] == [2, 2] and {r["wrapped"] for r in ranks} == {"DistributedDataParallel"}
    assert [r["global_step"] for r in ranks] == [2, 2]
    # each rank sent its own slice itself: 1 prompt (× 4 completions) per step, over 2 steps
    assert [r["prompts_sent"] for r in ranks] == [2, 2]
    # the main process alone synced the adapter each step and pushed the step-1 noise (σ > 0); the other never did
    assert ranks[1]["syncs_sent"] == []
    assert ranks[0]["syncs_sent"].count("/v1/load_lora_adapter") >= 1 and "/collective_rpc" in ranks[0]["syncs_sent"]
    sigmas = [s["aqn/sigma"] for s in ranks[0]["steps"]]
    assert sigmas == [0.0, SIGMA]
    gaps = [s["sampling/sampling_logp_difference/mean"] for s in ranks[0]["steps"]]
    assert gaps[0] < CLEAN_GAP and CLEAN_GAP < gaps[1] < NOISY_GAP  # noise reached the server for both ranks' rollouts
    models = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())["data"]
    assert ranks[0]["lora_name"] in [m["id"] for m in models]


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    _server_ddp_worker(*sys.argv[1:5])
