"""The FSDP2 memory plan (``plan_fsdp2``, ``qerl plan``): per-GPU bytes when the policy is sharded over N GPUs, and the
smallest GPU count that fits, in one line (exit 2 when the run does not fit). Shapes are Qwen2.5's published sizes."""

from __future__ import annotations

import pytest
from qerl_trl.memory_plan import (
    GB,
    H100_80GB_BYTES,
    LORA_TARGETS,
    QWEN25_SHAPES,
    RunShape,
    fsdp2_answer,
    plan_fsdp2,
    plan_memory,
    smallest_fsdp2_gpus,
)

Q72 = QWEN25_SHAPES["Qwen/Qwen2.5-72B-Instruct"]
Q32 = QWEN25_SHAPES["Qwen/Qwen2.5-32B-Instruct"]
#: the shipped 32B DAPO recipe's shape (micro-batch 1 x (1,024 + 8,192) tokens, 128 completions per process)
DAPO = RunShape(quantization="nvfp4", lora_r=32, lora_targets=LORA_TARGETS, generation_rows=128, micro_batch_rows=1,
                prompt_len=1024, completion_len=8192, cache_len=9216)  # fmt: skip


def test_one_gpu_is_the_plain_plan_and_sharding_divides_the_held_bytes():
    assert plan_fsdp2(Q32, DAPO, H100_80GB_BYTES, 1) == plan_memory(Q32, DAPO, H100_80GB_BYTES)
    base = plan_memory(Q72, DAPO, H100_80GB_BYTES)
    plans = {n: plan_fsdp2(Q72, DAPO, H100_80GB_BYTES, n) for n in (1, 2, 4, 8)}
    for n in (2, 4, 8):
        p = plans[n]
        # sharded: 1/n of everything; whole: 2 gathered decoder layers + embeddings and lm_head
        assert p.details["fsdp_sharded"] == pytest.approx((base.weights + base.lora + base.optimizer) / n, rel=1e-6)
        assert p.weights < plans[n // 2].weights and p.optimizer == -(-base.optimizer // n)
        assert p.training == base.training and p.kv_per_row == base.kv_per_row  # per process, as without FSDP
    # 72B in NVFP4: ~44.5 GB of weights on one GPU, ~28 GB on each of 2 (embeddings and lm_head stay whole: 2.5 GB each)
    assert 44 * GB < base.weights < 45 * GB and 27 * GB < plans[2].weights < 29 * GB


def test_72b_with_colocated_vllm_needs_two_gpus():
    """vLLM colocated with tensor_parallel_size = N holds its own weight shard and KV cache: 72B cannot fit one
    80 GB GPU (two copies of 44 GB), fits 2 according to the plan; the line says so and names the smallest count."""
    vllm = RunShape(**{**DAPO.__dict__, "held_generation": False})
    assert smallest_fsdp2_gpus(Q72, vllm, H100_80GB_BYTES, vllm_colocate=True) == 2
    fits, line = fsdp2_answer(Q72, vllm, H100_80GB_BYTES, 1, name="72B", vllm_colocate=True)
    assert not fits and "does not fit" in line and line.endswith("smallest GPU count that fits: 2 (estimate)")
    fits, line = fsdp2_answer(Q72, vllm, H100_80GB_BYTES, 2, name="72B", vllm_colocate=True)
    assert fits and "under FSDP2 on 2 GPUs" in line and "vLLM TP=2" in line and "\n" not in line
    plan = plan_fsdp2(Q72, vllm, H100_80GB_BYTES, 2, vllm_colocate=True)
    assert plan.details["vllm_weights"] == pytest.approx(plan_memory(Q72, vllm, H100_80GB_BYTES).weights / 2, abs=1)
    assert plan.kv_per_row == -(-Q72.kv_bytes_per_token(2) * 9216 // 2)  # KV heads split over the 2 GPUs
    # a GPU too small for any count up to 8
    fits, line = fsdp2_answer(Q72, vllm, 10 * 10**9, 2, name="72B", vllm_colocate=True)
    assert not fits and "no count up to 8 GPUs fits" in line


def test_qerl_plan_command_one_line_and_exit_code(capsys):
    """``qerl plan`` reads the recipe and the model's published shape (no Hub, nothing loaded): one line, exit 2
    when the run does not fit."""
    from qerl_trl.cli import main

    args = ["plan", "bigmath-qwen2.5-32b-dapo", "--model_name_or_path", "Qwen/Qwen2.5-72B-Instruct",
            "--rollout_engine", "vllm"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--gpus", "1"])
    assert exit_info.value.code == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "does not fit" in out[0] and "smallest GPU count that fits: 2" in out[0]
    main(args + ["--gpus", "2", "--memory-budget-gb", "85.5"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and ": fits:" in out[0] and "under FSDP2 on 2 GPUs of 85.5 GB" in out[0]
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model_name_or_path", "no/such-model", "--gpus", "2"])
    assert exit_info.value.code == 2 and "no known shape" in capsys.readouterr().err


def test_qerl_train_checks_the_fsdp2_plan_under_an_fsdp2_launch(monkeypatch, tmp_path, tiny_dir):
    """Under ``accelerate launch --config_file fsdp2.yaml`` (its environment), ``qerl train``'s memory check is the
    FSDP2 plan's: a budget too small stops the run with the one line, a large one passes."""
    from qerl_trl.cli import check_memory, parse_train_args
    from qerl_trl.memory_plan import MemoryPlanError

    script_args, config = parse_train_args(["offline-default", "--model_name_or_path", str(tiny_dir),
                                            "--output_dir", str(tmp_path)])  # fmt: skip
    for name, value in {"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MemoryPlanError, match=r"under FSDP2 on 2 GPUs of 0\.0 GB: does not fit.*no count up to 8 GPUs fits"):
        check_memory(script_args, config, budget_bytes=10**6)
    assert check_memory(script_args, config, budget_bytes=80 * 10**9) is True


def test_vllm_tensor_parallel_size_sets_the_engine_share_per_gpu(capsys):
    """``vllm.tensor_parallel_size`` = T: engines of T GPUs each (weights / T and KV heads / T per GPU, the rows of T
    processes per engine); unset, one engine over all the GPUs. T = 1 on 2 GPUs is two whole 72B engines: no count
    fits; a T that does not divide the GPU count is refused in one line (``qerl plan`` exits 2)."""
    from qerl_trl.cli import main
    from qerl_trl.memory_plan import MemoryPlanError

    vllm = RunShape(**{**DAPO.__dict__, "held_generation": False})
    auto = plan_fsdp2(Q72, vllm, H100_80GB_BYTES, 4, vllm_colocate=True)
    two = plan_fsdp2(Q72, vllm, H100_80GB_BYTES, 4, vllm_colocate=True, vllm_tp=2)
    assert auto.details["vllm_tp"] == 4 and two.details["vllm_tp"] == 2
    assert two.details["vllm_weights"] == pytest.approx(2 * auto.details["vllm_weights"], abs=2)
    assert two.kv_per_row == -(-Q72.kv_bytes_per_token(2) * 9216 // 2) and two.run.generation_rows == 2 * 128
    assert plan_fsdp2(Q72, vllm, H100_80GB_BYTES, 4, vllm_colocate=True, vllm_tp=4) == auto
    fits, line = fsdp2_answer(Q72, vllm, H100_80GB_BYTES, 2, name="72B", vllm_colocate=True, vllm_tp=1)
    assert not fits and "vLLM TP=1" in line and "no count up to 8 GPUs fits" in line
    assert smallest_fsdp2_gpus(Q72, vllm, H100_80GB_BYTES, vllm_colocate=True, vllm_tp=2) == 2
    with pytest.raises(MemoryPlanError, match="tensor_parallel_size=3 must divide the GPU count"):
        plan_fsdp2(Q72, vllm, H100_80GB_BYTES, 4, vllm_colocate=True, vllm_tp=3)
    args = ["plan", "bigmath-qwen2.5-32b-dapo", "--model_name_or_path", "Qwen/Qwen2.5-72B-Instruct",
            "--rollout_engine", "vllm"]  # fmt: skip
    main(args + ["--gpus", "2", "--vllm", '{"tensor_parallel_size": 2}', "--memory-budget-gb", "85.5"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and ": fits:" in out[0] and "vLLM TP=2" in out[0]
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--gpus", "2", "--vllm", '{"tensor_parallel_size": 3}'])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "must divide the number of training processes (2)" in err[-1]


def test_colocated_vllm_sharing_the_weights_counts_them_once(capsys):
    """``vllm.share_weights`` (one process, TP = 1): the policy's frozen NVFP4 projections, embeddings and lm_head are
    views of the engine's, so the plan counts them once: 7B, ~3.7 GB of packed projections + ~2.2 GB of embeddings
    and lm_head less; the engine adds its norms and biases only. Several GPUs, or TP > 1: nothing shared."""
    from qerl_trl.cli import main

    q7 = QWEN25_SHAPES["Qwen/Qwen2.5-7B-Instruct"]
    run = RunShape(**{**DAPO.__dict__, "held_generation": False})
    twice = plan_fsdp2(q7, run, H100_80GB_BYTES, 1, vllm_colocate=True)
    once = plan_fsdp2(q7, run, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_shares_weights=True)
    shared = once.details["vllm_shared_weights"]
    assert 3.6 * GB < shared - 2 * 152064 * 3584 * 2 < 3.8 * GB  # the projections, beyond embeddings + lm_head
    assert twice.weights - once.weights == shared and once.details["vllm_weights"] < 0.01 * GB  # norms + biases
    dense = RunShape(**{**run.__dict__, "quantization": "none"})  # dense linears: only the embeddings are shared
    assert plan_fsdp2(q7, dense, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_shares_weights=True).details[
        "vllm_shared_weights"] == 2 * 152064 * 3584 * 2  # fmt: skip
    for gpus, tp in ((2, 2), (2, 1)):
        plan = plan_fsdp2(q7, run, H100_80GB_BYTES, gpus, vllm_colocate=True, vllm_tp=tp, vllm_shares_weights=True)
        assert "vllm_shared_weights" not in plan.details
    args = ["plan", "gsm8k-qwen2.5-7b-grpo", "--rollout_engine", "vllm", "--gpus", "1"]
    main(args)
    line = capsys.readouterr().out.strip()
    assert "shared with the policy" in line, line
    main(args + ["--vllm", '{"share_weights": false}'])
    assert "shared with the policy" not in capsys.readouterr().out
    # both copies exist while the engine starts (the policy's are freed after): 72B still needs 2 GPUs
    assert once.startup_extra == shared and once.peak(1) >= once.fixed + once.per_row + shared
    vllm72 = RunShape(**{**DAPO.__dict__, "held_generation": False})
    assert smallest_fsdp2_gpus(Q72, vllm72, H100_80GB_BYTES, vllm_colocate=True, vllm_shares_weights=True) == 2
