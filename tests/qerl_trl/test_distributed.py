"""Data parallel training: ``accelerate launch`` with the shipped DDP config, 2 CPU processes (gloo), 2 GRPO steps.

The same run (NVFP4 policy + LoRA + AQN with σ > 0 on step 2, ``rollout_seed_per_prompt``, the globally normalised
``dapo`` loss) on 1 process with the whole batch and on 2 processes with half each must end with the same LoRA
weights: the rollouts, the AQN noise, the advantages and the gradient are the same, only summed in another order.

This file is also the worker: ``accelerate launch ... tests/qerl_trl/test_distributed.py MODEL_DIR OUT_DIR B``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DDP_CONFIG = REPO / "recipes" / "accelerate" / "ddp.yaml"
GLOBAL_BATCH = 16  # 4 prompts × 4 generations per step
NUM_GENERATIONS = 4


def even_token_reward(completions, completion_ids, **kwargs):
    """Fraction of completion tokens with an even id (non-constant on a random policy, so advantages are not 0)."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def run(model_dir: str, out_dir: str, per_device_batch: int):
    """``qerl train`` (the CLI's own ``train``) on ``model_dir``; each rank writes ``rank<i>.json`` into ``out_dir``."""
    from qerl_trl.cli import parse_train_args, train
    from qerl_trl.trainer import quantized_buffer_names

    seen: list = []

    def recorded_reward(completions, completion_ids, question, trainer_state, **kwargs):
        seen.extend([trainer_state.global_step, q, list(ids)] for q, ids in zip(question, completion_ids))
        return even_token_reward(completions, completion_ids)

    recorded_reward.__name__ = "even_tokens"
    argv = _train_argv(
        model_dir,
        out_dir,
        per_device_batch,
        max_completion_length=8,
        max_steps=2,
        save_steps=2,
        aqn_num_stages=2,
        learning_rate="1e-3",
        loss_type="dapo",
        task_options=json.dumps({"n_examples": 32, "digits": 1, "ops": "+"}),
        dataloader_num_workers=0,
    )
    script_args, config = parse_train_args(argv)
    script_args.rewards = [recorded_reward]
    trainer = train(script_args, config)
    model = trainer.accelerator.unwrap_model(trainer.model)
    noisy = dict(trainer.aqn.engine_weights(model, 1, dtype=torch.float32))  # step 2's (global_step 1) noisy norms
    digest = _sha([noisy[k] for k in sorted(noisy)])
    buffers = dict(model.named_buffers())
    quant = quantized_buffer_names(model)
    record = {
        "world": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
        "noise_sha": digest,
        "sigma": trainer.aqn.sigma(1),
        "rollouts": seen,
        "logs": [h for h in trainer.state.log_history if "reward" in h],
        "quant_dtypes": sorted({str(buffers[n].dtype) for n in quant}),
        "quant_sha": _sha([buffers[n] for n in quant]),
        "ddp_ignored": len(getattr(trainer.model, "_ddp_params_and_buffers_to_ignore", [])),
        "wrapped": type(trainer.model_wrapped).__name__,
    }
    Path(out_dir, f"rank{record['rank']}.json").write_text(json.dumps(record))
    return trainer


def run_dapo(model_dir: str, out_dir: str, per_device_batch: int) -> None:
    """One DAPO step with dynamic sampling: half the prompts get a constant reward, so groups are dropped and refilled;
    each rank writes ``dapo<i>.json`` (its logs and the questions it was rewarded on)."""
    from qerl_trl.cli import parse_train_args, train

    seen: list = []

    def half_constant(completions, completion_ids, question, b, **kwargs):
        seen.extend(question)
        return [1.0 if bi % 2 == 0 else r for bi, r in zip(b, even_token_reward(completions, completion_ids))]

    argv = _train_argv(
        model_dir,
        out_dir,
        per_device_batch,
        algorithm="dapo",
        max_completion_length=4,
        max_steps=1,
        save_steps=1000,
        aqn="false",
        overlong_buffer_length=0,
        max_resample_rounds=8,
        task_options=json.dumps({"n_examples": 32, "digits": 1}),
    )
    script_args, config = parse_train_args(argv)
    script_args.rewards = [half_constant]
    trainer = train(script_args, config)
    record = {"logs": [h for h in trainer.state.log_history if "reward" in h], "questions": seen}
    Path(out_dir, f"dapo{trainer.accelerator.process_index}.json").write_text(json.dumps(record))


def _train_argv(model_dir: str, out_dir: str, per_device_batch: int, **options: object) -> list[str]:
    """``qerl train offline-default`` arguments both runs share (model, output, batch, group, LoRA r=8, per-prompt
    rollout seeds, one micro-batch per step (the recipe's 4 micro-batches of 8 are a CPU-memory setting), no
    progress bars), then ``options`` as ``--name value``."""
    common = dict(model_name_or_path=model_dir, output_dir=out_dir, per_device_train_batch_size=per_device_batch,
                  num_generations=NUM_GENERATIONS, lora_r=8, lora_alpha=8, rollout_seed_per_prompt="true",
                  gradient_accumulation_steps=1, disable_tqdm="true")  # fmt: skip
    return ["offline-default"] + [a for k, v in {**common, **options}.items() for a in (f"--{k}", str(v))]


def _sha(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _lora(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "adapter_model.safetensors")


def test_rollout_seed_is_a_pure_function_and_vllm_is_refused():
    from qerl_trl.config import QeRLConfig
    from qerl_trl.trainer import rollout_seed

    assert rollout_seed(0, 3, 0, 5) == rollout_seed(0, 3, 0, 5)
    assert (
        len({rollout_seed(0, 3, 0, i) for i in range(64)} | {rollout_seed(1, 3, 0, 0), rollout_seed(0, 4, 0, 0)}) == 66
    )
    assert all(0 <= rollout_seed(s, 1, 1, 1) < 2**63 for s in range(10))
    args = QeRLConfig(output_dir="x", rollout_seed_per_prompt=True)
    assert args.ddp_broadcast_buffers is False and args.ddp_find_unused_parameters is False
    with pytest.raises(ValueError, match="rollout_seed_per_prompt"):
        QeRLConfig(output_dir="x", rollout_seed_per_prompt=True, rollout_engine="vllm")


_DAPO_CONFIG_WORKER = """
import sys
from accelerate import PartialState
from qerl_trl import QeRLDAPOConfig

try:
    QeRLDAPOConfig(output_dir=sys.argv[1], per_device_train_batch_size=2, num_generations=4, max_steps=1,
                   max_completion_length=8, use_cpu=True, report_to="none")
    print("CONFIG ACCEPTED")
except ValueError as e:
    print("CONFIG REFUSED:", e)
PartialState().destroy_process_group()
"""


def test_dapo_dynamic_sampling_needs_whole_groups_on_each_process(tmp_path):
    """2 processes x 2 rows with groups of 4: TRL accepts it (4 rows in all), but each process would hold half a
    group, and dynamic sampling judges whole groups per process (it failed at the first step, after the model had
    loaded and generated, with "2 advantages do not split into groups of 4"): refused with the config."""
    worker = tmp_path / "worker.py"
    worker.write_text(_DAPO_CONFIG_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG), "--num_processes",
           "2", "--mixed_precision", "no", "--main_process_port", str(29500 + (os.getpid() + 1000) % 2000),
           str(worker), str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO).stdout
    lines = [line for line in out.splitlines() if line.startswith("CONFIG ")]
    assert len(lines) == 2, out[-3000:]
    assert all("REFUSED" in line and "num_generations (4)" in line and "2 rows" in line for line in lines), lines


def test_ddp_two_processes_match_one_process(tmp_path, tiny_dir):
    """2 gloo processes × B = 1 process × 2B: same rollouts, same AQN noise, same final LoRA weights."""
    from qerl_trl.policy import load_policy
    from qerl_trl.trainer import quantized_buffer_names

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO / "tests")}
    two = tmp_path / "two"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(DDP_CONFIG),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(29500 + os.getpid() % 2000),
        __file__,
        str(tiny_dir),
        str(two),
        str(GLOBAL_BATCH // 2),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)

    one = tmp_path / "one"
    trainer = run(str(tiny_dir), str(one), GLOBAL_BATCH)  # meanwhile: the same run in this process
    out, _ = proc.communicate(timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, out[-6000:]

    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    single = json.loads((one / "rank0.json").read_text())
    assert [r["world"] for r in ranks] == [2, 2] and single["world"] == 1
    assert {r["wrapped"] for r in ranks} == {"DistributedDataParallel"}
    assert all(r["ddp_ignored"] > 0 for r in ranks)  # the NVFP4 buffers are out of DDP's broadcasts

    # AQN: σ > 0 on step 2, the same noise on every rank and in the single process
    assert single["sigma"] > 0 and {r["noise_sha"] for r in ranks} == {single["noise_sha"]}
    # rollouts: the two ranks' slices together are the single process's batch, token for token
    assert sorted(map(json.dumps, ranks[0]["rollouts"] + ranks[1]["rollouts"])) == sorted(
        map(json.dumps, single["rollouts"])
    )
    assert len(single["rollouts"]) == 2 * GLOBAL_BATCH
    # the reward varied inside groups (else every advantage is 0 and the comparison is vacuous)
    assert all(h["reward_std"] > 0 and h["frac_reward_zero_std"] < 1 for h in single["logs"])

    # LoRA: moved away from its initialisation, and the same on 1 and 2 processes
    a, b = _lora(one), _lora(two)
    assert a.keys() == b.keys() and a
    assert all(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k), "a lora_B is still 0 (its init)"
    max_diff = max((a[k] - b[k]).abs().max().item() for k in a)
    scale = max(a[k].abs().max().item() for k in a)
    print(
        f"\n2-process DDP run {seconds:.0f} s; max |LoRA(1 proc) - LoRA(2 procs)| = {max_diff:.3g} (max |w| {scale:.3g})"
    )
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")

    # checkpoint written once, whole, with the AQN state; the 4-bit base is still 4-bit and unchanged
    ckpt = two / "checkpoint-2"
    assert (ckpt / "aqn_state.json").is_file() and (ckpt / "rng_state_0.pth").is_file()
    assert (ckpt / "rng_state_1.pth").is_file() and not (two / ".staging").exists()
    assert {tuple(r["quant_dtypes"]) for r in ranks} == {("torch.float32", "torch.float8_e4m3fn", "torch.uint8")}
    fresh = load_policy(str(tiny_dir), quantization="rtn")  # quantized on load again: the same RTN bits
    assert (
        {r["quant_sha"] for r in ranks}
        == {single["quant_sha"]}
        == {_sha([dict(fresh.named_buffers())[n] for n in quantized_buffer_names(fresh)])}
    )
    del trainer

    # DAPO dynamic sampling on 2 processes: both ranks run the same number of refill rounds (their generation and
    # scoring gather across ranks), each ends with its own full batch of informative groups, from different prompts
    dapo = [json.loads((two / "dapo" / f"dapo{r}.json").read_text()) for r in (0, 1)]
    (log0,), (log1,) = dapo[0]["logs"], dapo[1]["logs"]
    assert log0["dapo/resample_rounds"] == log1["dapo/resample_rounds"] >= 1
    assert log0["dapo/informative_group_fraction"] == log1["dapo/informative_group_fraction"] < 1
    assert log0["dapo/unfilled_groups"] == log1["dapo/unfilled_groups"] == 0
    assert len(dapo[0]["questions"]) == len(dapo[1]["questions"]) > GLOBAL_BATCH // 2  # refills were generated


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    run_dapo(sys.argv[1], str(Path(sys.argv[2]) / "dapo"), int(sys.argv[3]))
    from accelerate import PartialState

    PartialState().wait_for_everyone()  # every rank here first, as qerl train ends
    PartialState().destroy_process_group()  # before exit: gloo's threads can abort it otherwise (pytorch#190489)
