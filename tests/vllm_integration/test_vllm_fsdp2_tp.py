"""``qerl train --rollout_engine vllm`` under FSDP2 with a tensor-parallel engine: 2 CPU processes (gloo), the shipped
``recipes/accelerate/fsdp2.yaml``, one vLLM engine of ``tensor_parallel_size`` 2 spread over the two trainer processes
(vLLM's ``external_launcher`` backend on the launch's own process group; ``vllm.tensor_parallel_size`` left unset:
all the processes under FSDP2).

The policy is a tiny random Llama (head_dim 64: vLLM's CPU attention takes no smaller head; 4 query / 2 KV heads, so
each TP worker holds half of each) quantized to NVFP4 on load. Checked on both ranks after 2 GRPO steps (AQN on, σ > 0
at step 1):

* the policy is an FSDP2 module and the engine one of TP 2 (one worker per process);
* the steps ran through the engine with TRL's importance-sampling bookkeeping: step 0 (noise-free, the first adapter)
  has ``sampling/sampling_logp_difference/mean`` at float32 noise (the TP engine with the synced adapter and the
  FSDP2 policy agree), and each process scored its own rows (the two ranks' completions differ);
* after a sync, the adapter the engine holds (the folder of its current ``LoRARequest``) is, bit for bit, the sharded
  policy's adapter gathered whole, and the same on both ranks;
* AQN through the engine: inside ``AQNController.rollout(policy, 1, engine=...)`` every worker's RMSNorm weights are
  the controller's float32 draw gathered whole from the shards (bit-identical), and after it the clean weights are
  back, bit-identical.

This file is also the worker: ``accelerate launch ... tests/vllm_integration/test_vllm_fsdp2_tp.py MODEL_DIR OUT_DIR
DIAG_DIR`` (each worker dumps its Python stacks into ``DIAG_DIR/stacks-rank{r}.txt`` on SIGUSR1). A launch that runs
past :data:`LAUNCH_TIMEOUT_S` fails the test with both workers' stacks instead of hanging.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from vllm_test_helpers import too_few_gpus

REPO = Path(__file__).resolve().parents[2]
FSDP2_CONFIG = REPO / "recipes" / "accelerate" / "fsdp2.yaml"
#: this checkout's packages ahead of whatever the vLLM venv installed editable
SOURCES = [
    REPO / p for p in ("packages/qerl-trl/src", "packages/nvfp4/src", "packages/aqn/src", "integrations/vllm/src")
]
#: a pass takes ~35 s on 2 idle cores, ~2 min while other jobs share them; a hang fails long before CI's 900 s
LAUNCH_TIMEOUT_S = 420
SHM = Path("/dev/shm")


def even_token_reward(completions, completion_ids, **kwargs):
    """Fraction of completion tokens with an even id (non-constant on a random policy, so advantages are not 0)."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def _engine_norms(worker) -> dict[str, torch.Tensor]:
    """The RMSNorm weights a vLLM worker computes with now (run in the worker through ``collective_rpc``)."""
    from qerl_vllm.engine import norm_param_names

    model = worker.model_runner.model
    params = dict(model.named_parameters())
    return {n: params[n].detach().to("cpu", copy=True) for n in norm_param_names(model)}


def run(model_dir: str, out_dir: str) -> None:
    from qerl_trl.cli import parse_train_args, train
    from qerl_trl.rollout.vllm import adapter_state, full_tensors
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule

    vllm = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20,
            "cache_dir": str(Path(out_dir) / "engine-ckpt"),
            "adapter_dir": str(Path(out_dir) / "engine-adapters")}  # fmt: skip  # not /dev/shm: a killed run leaks it
    argv = ["offline-default", "--model_name_or_path", model_dir, "--output_dir", out_dir,
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--gradient_accumulation_steps", "1",
            "--lora_r", "8", "--lora_alpha", "8", "--max_completion_length", "6", "--max_steps", "2",
            "--save_steps", "1000", "--aqn_num_stages", "2", "--aqn_sigma_start", "0.01", "--aqn_sigma_end", "0.01",
            "--learning_rate", "1e-3", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
            "--logging_steps", "1", "--rollout_engine", "vllm", "--vllm", json.dumps(vllm),
            "--task_options", json.dumps({"n_examples": 16, "digits": 1, "ops": "+"})]  # fmt: skip
    script_args, config = parse_train_args(argv)
    seen: list[list[int]] = []

    def recorded_reward(completions, completion_ids, **kwargs):
        seen.extend(list(map(int, ids)) for ids in completion_ids)  # this process's rows
        return even_token_reward(completions, completion_ids)

    script_args.rewards = [recorded_reward]
    trainer = train(script_args, config)
    rank = trainer.accelerator.process_index
    gen = trainer.rollout.generation
    policy = trainer.accelerator.unwrap_model(trainer.model)

    # the adapter the engine holds after a sync (the last step's update came after the last step's sync): the
    # sharded policy's, gathered whole
    gen.sync_weights()
    state, _ = adapter_state(policy)
    held = load_file(Path(gen.engine.lora_request.lora_path) / "adapter_model.safetensors")
    adapter_equal = held.keys() == state.keys() and all(torch.equal(held[k], state[k]) for k in state)

    # AQN through the engine at a step with σ > 0
    ctl, step = trainer.aqn, 1
    clean = gen.engine.llm.collective_rpc(_engine_norms)[0]
    with ctl.rollout(policy, step, engine=gen):
        noisy = gen.engine.llm.collective_rpc(_engine_norms)[0]
    after = gen.engine.llm.collective_rpc(_engine_norms)[0]
    want = full_tensors(dict(ctl.engine_weights(policy, step, dtype=torch.float32)))
    want = {k.removeprefix("base_model.model."): v for k, v in want.items()}
    noisy_equal = bool(want) and all(torch.equal(noisy[k], v) for k, v in want.items())
    untouched = [k for k in noisy if k not in want]  # the final norm (AQN leaves it alone by default)
    record = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "fsdp_module": isinstance(trainer.model, FSDPModule),
        "tp_size": gen.tp_size,
        "engine_tp": gen.engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
        "external_launcher": gen.engine.external_launcher,
        "logs": [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h],
        "sigma": ctl.sigma(step),
        "adapter_tensors": len(state),
        "adapter_equal": adapter_equal,
        "adapter_sum": float(sum(v.double().sum() for v in state.values())),
        "noised_norms": len(want),
        "noisy_equal": noisy_equal,
        "noise_moved": all(not torch.equal(noisy[k], clean[k]) for k in want),
        "others_clean": all(torch.equal(noisy[k], clean[k]) for k in untouched),
        "restored": all(torch.equal(after[k], clean[k]) for k in clean),
        "completions": seen,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    trainer.rollout.close()  # the TP engine leaves the launch's process group alone
    trainer.accelerator.wait_for_everyone()  # as qerl train ends: no rank tears its group down while one is in a collective
    trainer.accelerator.end_training()


def _tiny_dir(root: Path) -> Path:
    """A tiny random Llama with vLLM-CPU-sized heads (head_dim 64) and the offline default's tokenizer."""
    sys.path.insert(0, str(REPO / "tests"))
    from nvfp4.offline import offline_default_model_path
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(offline_default_model_path())
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, intermediate_size=512, vocab_size=len(tok),
                         max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)  # fmt: skip
    path = root / "tiny-llama-hd64"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _workers(launcher: int) -> list[int]:
    """The pids of this file's worker processes under the ``accelerate launch`` process ``launcher`` (torchrun starts
    them in sessions of their own, so the launch's process group does not reach them)."""
    found, todo = [], [launcher]
    while todo:
        pid = todo.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            todo.append(child)
            try:
                if Path(__file__).name in Path(f"/proc/{child}/cmdline").read_text():
                    found.append(child)
            except OSError:
                pass
    return found


def _stop(launch: subprocess.Popen, diag: Path) -> str:
    """Kill a launch that hangs, after each worker dumped its Python stacks (SIGUSR1: ``faulthandler``); the stacks."""
    workers = _workers(launch.pid)
    for sig in (signal.SIGUSR1, signal.SIGKILL):
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, sig)
        time.sleep(3 if sig == signal.SIGUSR1 else 0)  # faulthandler writes the stacks
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launch.pid, signal.SIGKILL)
    launch.wait()
    stacks = [f"--- {f.name}\n{f.read_text()}" for f in sorted(diag.glob("stacks-rank*.txt"))]
    return "\n".join(stacks) or f"no stacks written (workers found: {workers})"


def _shm_in_use() -> set[str]:
    """The /dev/shm files some process maps now."""
    used = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            used.update(line.split(None, 5)[-1] for line in maps.read_text().splitlines() if " /dev/shm/" in line)
        except OSError:  # gone, or not ours to read
            pass
    return used


def _remove_stale_cpushm(min_age_s: float = 60.0) -> list[str]:
    """vLLM-CPU's TP shared-memory segments (``/dev/shm/*cpushm*``) that no process maps: a worker killed or ended by
    ``os._exit`` leaves them, and the next engine of the same group name then fails to create them (errno 17). Its
    group names are fixed under the external launcher (no run id), so a leftover breaks every later run."""
    if not SHM.is_dir():
        return []
    used, now, removed = _shm_in_use(), time.time(), []
    for f in SHM.glob("*cpushm*"):
        try:
            if str(f) not in used and now - f.stat().st_mtime > min_age_s:
                f.unlink()
                removed.append(f.name)
        except OSError:
            pass
    return removed


@pytest.mark.skipif(too_few_gpus(2), reason="2 trainer processes and a TP-2 engine need 2 GPUs under CUDA")
def test_qerl_train_fsdp2_with_a_tensor_parallel_vllm_engine(tmp_path):
    from ports import free_port

    _remove_stale_cpushm()
    model_dir = _tiny_dir(tmp_path)
    out, diag = tmp_path / "run", tmp_path / "diag"
    diag.mkdir()
    pythonpath = os.pathsep.join([*map(str, SOURCES), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": pythonpath,
           "VLLM_LOGGING_LEVEL": "WARNING"}  # fmt: skip
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the external launcher sets its own
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP2_CONFIG),
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()),
           __file__, str(model_dir), str(out), str(diag)]  # fmt: skip
    log_path = tmp_path / "launch.log"
    start = time.perf_counter()
    with log_path.open("w") as log:
        launch = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            returncode, stacks = launch.wait(timeout=LAUNCH_TIMEOUT_S), None
        except subprocess.TimeoutExpired:
            returncode, stacks = None, _stop(launch, diag)
            _remove_stale_cpushm(min_age_s=0)  # the killed workers' segments
    if stacks is not None:
        pytest.fail(f"the 2-process launch did not finish in {LAUNCH_TIMEOUT_S} s (a hang); the workers' Python "
                    f"stacks:\n{stacks}\n--- the launch's log, last lines:\n{log_path.read_text()[-4000:]}")  # fmt: skip
    seconds = time.perf_counter() - start
    output = log_path.read_text()
    assert returncode == 0, output[-8000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"\n2-process FSDP2 qerl train with a TP=2 vLLM engine, 2 steps: {seconds:.0f} s; rank 0: {ranks[0]}")
    for r in ranks:
        assert r["world"] == 2 and r["fsdp_module"]
        assert r["tp_size"] == 2 and r["engine_tp"] == 2 and r["external_launcher"]
        logs = r["logs"]
        assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
        # step 0: noise-free, the first adapter synced: the TP engine and the FSDP2 policy agree to float32 noise
        assert logs[0]["sampling/sampling_logp_difference/mean"] < 1e-3
        assert r["sigma"] > 0 and r["adapter_equal"] and r["adapter_tensors"] == 28
        assert r["noised_norms"] == 4 and r["noisy_equal"] and r["noise_moved"] and r["others_clean"]
        assert r["restored"]
    assert "Invalid process group" not in output  # closing the TP engine left the launch's group alone
    assert ranks[0]["adapter_sum"] == ranks[1]["adapter_sum"]
    # each process kept its own rows of the group's generation: 4 per step, not the other rank's
    assert [len(r["completions"]) for r in ranks] == [8, 8] and ranks[0]["completions"] != ranks[1]["completions"]


if __name__ == "__main__":
    stacks_file = open(Path(sys.argv[3], f"stacks-rank{os.environ['RANK']}.txt"), "w")  # noqa: SIM115 - open till exit
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)  # the test's view of a hang
    run(sys.argv[1], sys.argv[2])
