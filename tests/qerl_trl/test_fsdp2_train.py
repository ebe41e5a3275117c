"""``qerl train`` under FSDP2: ``accelerate launch`` with the shipped ``recipes/accelerate/fsdp2.yaml``, 2 CPU
processes (gloo), 2 GRPO steps of the tiny NVFP4 + LoRA policy with AQN on.

Checked: both processes finish; the policy was sharded (the model is an FSDP2 module, every 4-bit layer holds half
its rows, and what each rank gathers back is the same bytes on both ranks and as the unsharded quantization of the
checkpoint); the LoRA adapter moved from its initialisation and was saved; the rewards and losses are finite.

This file is also the worker: ``accelerate launch ... tests/qerl_trl/test_fsdp2_train.py MODEL_DIR OUT_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
FSDP2_CONFIG = REPO / "recipes" / "accelerate" / "fsdp2.yaml"


def _sha(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def even_token_reward(completions, completion_ids, **kwargs):
    """Fraction of completion tokens with an even id (non-constant on a random policy, so advantages are not 0)."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def run(model_dir: str, out_dir: str) -> None:
    from nvfp4 import NVFP4Linear
    from nvfp4.fsdp import gathered_quantized_weight
    from qerl_trl.cli import parse_train_args, train
    from torch.distributed.fsdp import FSDPModule

    argv = ["offline-default", "--model_name_or_path", model_dir, "--output_dir", out_dir,
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--gradient_accumulation_steps", "1",
            "--lora_r", "8", "--lora_alpha", "8", "--max_completion_length", "6", "--max_steps", "2",
            "--save_steps", "1", "--aqn_num_stages", "2", "--learning_rate", "1e-3", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0", "--rollout_engine", "transformers",
            "--task_options", json.dumps({"n_examples": 16, "digits": 1, "ops": "+"})]  # fmt: skip
    script_args, config = parse_train_args(argv)
    script_args.rewards = [even_token_reward]
    trainer = train(script_args, config)
    model = trainer.accelerator.unwrap_model(trainer.model)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    rows = sorted({m.stored("weight_packed").to_local().shape[0] / m.out_features for m in layers.values()})
    weights = [gathered_quantized_weight(layers[n]) for n in sorted(layers)]
    record = {
        "rank": trainer.accelerator.process_index,
        "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "fsdp_module": isinstance(trainer.model, FSDPModule),
        "quantized_layers": len(layers),
        "local_row_fractions": rows,
        "quant_sha": _sha([t for w in weights for t in (w.packed, w.scale, w.global_scale)]),
        "logs": [h for h in trainer.state.log_history if "reward" in h],
        "sigma": trainer.aqn.sigma(1),
    }
    Path(out_dir, f"rank{record['rank']}.json").write_text(json.dumps(record))
    # as qerl train ends (cli.main): every rank here before the group goes, else gloo's threads can abort the process
    # at exit ("terminate called without an active exception": rank 1 of a clean clone of 46a110a)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


def test_qerl_train_two_processes_under_fsdp2(tmp_path, tiny_dir):
    from nvfp4 import NVFP4Linear
    from qerl_trl.policy import load_policy
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO / "tests")}
    out = tmp_path / "fsdp2"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP2_CONFIG),
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(29500 + os.getpid() % 2000),
           __file__, str(tiny_dir), str(out)]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"\n2-process FSDP2 qerl train, 2 steps: {seconds:.0f} s; rank 0: {ranks[0]}")
    assert [r["world"] for r in ranks] == [2, 2]
    assert all(r["fsdp_module"] and r["distributed_type"] == "DistributedType.FSDP" for r in ranks)
    assert all(r["local_row_fractions"] == [0.5] and r["quantized_layers"] == 14 for r in ranks)
    # the gathered 4-bit weights: the same bytes on both ranks, and the checkpoint's RTN quantization, unchanged
    fresh = load_policy(str(tiny_dir), quantization="rtn")
    want = [m.quantized_weight for _, m in sorted(fresh.named_modules()) if isinstance(m, NVFP4Linear)]
    assert {r["quant_sha"] for r in ranks} == {_sha([t for w in want for t in (w.packed, w.scale, w.global_scale)])}
    logs = ranks[0]["logs"]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) and math.isfinite(h["reward"]) for h in logs)
    assert all(h["reward_std"] > 0 for h in logs)  # advantages not all 0: the adapter gets a gradient
    assert ranks[0]["sigma"] > 0  # AQN on at step 2
    # every step saved a checkpoint (save_steps 1): the adapter only is gathered, never the 4-bit base (gloo cannot
    # all-gather its FP8 scales; at 72B it would be ~41 GB a save)
    saved = [load_file(out / d / "adapter_model.safetensors") for d in ("checkpoint-2", "final")]
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    lora = load_file(out / "final" / "adapter_model.safetensors")
    assert lora and all(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k), "a lora_B is still 0"


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
