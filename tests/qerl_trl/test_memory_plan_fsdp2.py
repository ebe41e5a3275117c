"""The FSDP2 memory plan (``plan_fsdp2``, ``qerl plan``): per-GPU bytes when the policy is sharded over N GPUs, and the
smallest GPU count that fits, in one line (exit 2 when the run does not fit). Shapes are Qwen2.5's published sizes."""

from __future__ import annotations

import json

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
#: the 32B DAPO recipe fixes 14 GiB of KV cache a GPU (sized for 32B on one H100); 72B plans leave it to the plan
KV_FROM_PLAN = '{"kv_cache_memory_bytes": null}'
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
            "--vllm", KV_FROM_PLAN]  # fmt: skip
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



def test_qerl_train_checks_a_colocated_vllm_with_a_fixed_kv_cache_on_one_gpu(tmp_path, tiny_dir, capsys):
    """One process, ``rollout_engine="vllm"`` colocated with ``vllm.kv_cache_memory_bytes`` set (the 7B GSM8K
    recipe's way): ``qerl train``'s memory check plans the engine too (its cache held beside the policy) and stops in
    one line naming the setting when that cache does not fit; without the setting nothing is planned (vLLM sizes its
    own cache from ``gpu_memory_utilization``)."""
    from qerl_trl.cli import check_memory, parse_train_args
    from qerl_trl.memory_plan import MemoryPlanError

    def config_with(vllm: dict):
        return parse_train_args(["offline-default", "--model_name_or_path", str(tiny_dir), "--output_dir",
                                 str(tmp_path), "--rollout_engine", "vllm", "--vllm", json.dumps(vllm)])  # fmt: skip

    script_args, config = config_with({"kv_cache_memory_bytes": 40 * 10**9})
    with pytest.raises(MemoryPlanError, match="vllm.kv_cache_memory_bytes") as info:
        check_memory(script_args, config, budget_bytes=16 * 10**9)
    assert "\n" not in str(info.value)
    script_args, config = config_with({"kv_cache_memory_bytes": 2**30})
    assert check_memory(script_args, config, budget_bytes=16 * 10**9) is True
    assert ": fits:" in capsys.readouterr().out
    script_args, config = config_with({"gpu_memory_utilization": 0.3})
    assert check_memory(script_args, config, budget_bytes=16 * 10**9) is None

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
            "--vllm", KV_FROM_PLAN]  # fmt: skip
    main(args + ["--gpus", "2", "--vllm", '{"tensor_parallel_size": 2, "kv_cache_memory_bytes": null}', "--memory-budget-gb", "85.5"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and ": fits:" in out[0] and "vLLM TP=2" in out[0]
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--gpus", "2", "--vllm", '{"tensor_parallel_size": 3, "kv_cache_memory_bytes": null}'])
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


Q7 = QWEN25_SHAPES["Qwen/Qwen2.5-7B-Instruct"]
GIB = 2**30
#: the 7B GSM8K recipe's shape: 128 completions, micro-batch 16 x (1,024 + 4,096) tokens, rollouts by colocated vLLM
GSM8K = RunShape(quantization="nvfp4", lora_r=32, lora_targets=LORA_TARGETS, generation_rows=128, micro_batch_rows=16,
                 prompt_len=1024, completion_len=4096, cache_len=5120, held_generation=False)  # fmt: skip


def test_vllm_kv_cache_memory_bytes_is_the_planned_kv_cache(capsys):
    """``vllm.kv_cache_memory_bytes``: vLLM allocates exactly that on each GPU whatever the rows, so the plan holds it
    and its rows at once are the sequences it holds (of ``min(cache_len, max_model_len)`` positions: 56 KiB a position
    for Qwen2.5-7B); the engine schedules the rest. The 7B recipe as shipped: 12 GiB, 48 sequences of 4,608 positions
    (not 64 x 5,120 positions at 0.29 GB each)."""
    from qerl_trl.cli import main

    rows_model = plan_fsdp2(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_shares_weights=True)
    plan = plan_fsdp2(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_shares_weights=True,
                      vllm_kv_cache_bytes=12 * GIB, vllm_max_model_len=4608)  # fmt: skip
    assert Q7.kv_bytes_per_token(2) == 56 * 1024 and plan.kv_per_row == 56 * 1024 * 4608
    assert plan.kv_cache_bytes == 12 * GIB and plan.per_row == 0 and plan.fixed == rows_model.fixed + 12 * GIB
    assert plan.wave_rows == 12 * GIB // (56 * 1024 * 4608) == 48  # vLLM: "Maximum concurrency ... 48.76x"
    assert plan.peak(1) == plan.peak(48) == rows_model.fixed + 12 * GIB + plan.training  # training over the start
    # max_model_len unset: sequences of cache_len positions, and vLLM's start check is the model's 32,768 positions
    plan = plan_fsdp2(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=12 * GIB)
    assert plan.wave_rows == 12 * GIB // (56 * 1024 * 5120) and plan.details["vllm_kv_start"] == 56 * 1024 * 32768
    # TP = 2: the KV heads split, 12 GiB on each GPU holds twice as many sequences (the engine's two processes' rows)
    two = plan_fsdp2(Q7, GSM8K, H100_80GB_BYTES, 2, vllm_colocate=True, vllm_kv_cache_bytes=12 * GIB,
                     vllm_max_model_len=4608)  # fmt: skip
    assert two.kv_per_row == 56 * 1024 * 4608 // 2 and two.wave_rows == 97
    main(["plan", "gsm8k-qwen2.5-7b-grpo", "--rollout_engine", "vllm", "--gpus", "1"])
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and ": fits:" in line, line
    assert "KV cache 12.9 GB fixed by vllm.kv_cache_memory_bytes, holding 48 of the 128 sequences of 4608" in line


def test_vllm_kv_cache_too_small_for_one_sequence_or_too_large_stops_in_one_line(capsys):
    """A fixed cache that cannot hold one sequence of vLLM's max_model_len (vLLM would refuse to start), or that does
    not fit beside the rest: does not fit, one line naming vllm.kv_cache_memory_bytes and the value that would do;
    ``qerl plan`` exits 2. Unset (None or 0, as vLLM reads it): the row model, unchanged."""
    from qerl_trl.cli import main

    # 1 GiB, max_model_len unset: vLLM checks the model's 32,768 positions (1.75 GiB); on 2 GPUs (TP 2) 0.875 GiB each
    fits, line = fsdp2_answer(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=GIB)
    assert not fits and "\n" not in line and line.endswith("smallest GPU count that fits: 2 (estimate)"), line
    assert "vllm.kv_cache_memory_bytes=1073741824 cannot hold one sequence of 32768 positions" in line
    assert "raise it to 1879048192 or more, or lower vllm.max_model_len" in line
    fits, line = fsdp2_answer(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=GIB,
                              vllm_max_model_len=4608)  # fmt: skip
    assert fits and "holding 4 of the 128 sequences of 4608 positions at once" in line, line
    # 60 GiB beside 42 GB of training on an 80 GB GPU: over; the largest cache that fits is named, and it fits
    fits, line = fsdp2_answer(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=60 * GIB,
                              vllm_max_model_len=4608)  # fmt: skip
    assert not fits and "\n" not in line and "GB over with its fixed KV cache" in line, line
    room = int(line.split("set vllm.kv_cache_memory_bytes to ")[1].split()[0])
    assert room % 2**20 == 0 and 12 * GIB < room < 60 * GIB
    assert fsdp2_answer(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=room,
                        vllm_max_model_len=4608)[0]  # fmt: skip
    assert not fsdp2_answer(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=room + 2**20,
                            vllm_max_model_len=4608)[0]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "gsm8k-qwen2.5-7b-grpo", "--gpus", "1", "--vllm",  # null: the recipe's max_model_len unset
              '{"kv_cache_memory_bytes": 1073741824, "max_model_len": null}'])  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    assert exit_info.value.code == 2 and len(out) == 1 and "cannot hold one sequence of 32768 positions" in out[0]
    # unset: the plan of before, whatever max_model_len says
    before = plan_fsdp2(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True)
    for kv in (None, 0):
        assert plan_fsdp2(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=kv,
                          vllm_max_model_len=4608) == before  # fmt: skip
    assert before.kv_cache_bytes == 0 and before.per_row == before.kv_per_row == 56 * 1024 * 5120


def test_a_vllm_server_holds_the_generation_rows_on_its_own_gpus(capsys):
    """``vllm.server_url``: the server generates on GPUs of its own, so the training GPUs hold the policy, its LoRA and
    optimizer state and the training micro-batch only; the 32B DAPO recipe fits 1 GPU (``qerl plan`` counted the 128
    rows' 309.7 GB of KV cache here: no count up to 8 GPUs fit, and ``qerl train`` under FSDP2 refused the run)."""
    from qerl_trl.cli import main

    server = '{"server_url": "http://127.0.0.1:8000", "kv_cache_memory_bytes": null}'
    for gpus in ("1", "2"):
        main(["plan", "bigmath-qwen2.5-32b-dapo", "--vllm", server, "--gpus", gpus])
        line = capsys.readouterr().out.strip()
        assert "\n" not in line and ": fits:" in line and "generation on the vLLM server" in line, line
        assert line.endswith("smallest GPU count that fits: 1 (estimate)"), line
    server_run = RunShape(**{**DAPO.__dict__, "held_generation": False})
    plan = plan_fsdp2(Q32, server_run, H100_80GB_BYTES, 2, vllm_server=True)
    assert plan.per_row == plan.prefill_per_row == 0 and plan.wave_rows == 128
    assert plan.peak(128) == plan.fixed + plan.training


def test_a_vllm_tensor_parallel_size_that_does_not_split_the_heads_is_refused(capsys):
    """vLLM splits the attention heads over its TP workers and refuses at start a size that does not divide them
    (Qwen2.5-7B: 28 heads, 4 KV heads: TP 3 or 8 cannot run). The plan says so before anything loads, names the sizes
    that would, and the smallest GPU count skips such sizes instead of answering one vLLM would refuse."""
    from qerl_trl.cli import main
    from qerl_trl.memory_plan import MemoryPlanError

    assert Q7.tensor_parallel_problem(1) is None and Q7.tensor_parallel_problem(4) is None
    assert "28 attention heads" in Q7.tensor_parallel_problem(3)
    assert "28 attention heads" in Q7.tensor_parallel_problem(8)
    assert Q72.tensor_parallel_problem(8) is None  # 64 heads, 8 KV heads
    vllm = RunShape(**{**DAPO.__dict__, "held_generation": False})
    with pytest.raises(MemoryPlanError, match=r"tensor_parallel_size=3 .*28 attention heads.*: use 1"):
        plan_fsdp2(Q7, vllm, H100_80GB_BYTES, 3, vllm_colocate=True)
    with pytest.raises(MemoryPlanError, match=r"tensor_parallel_size=8 .*28 attention heads.*: use 1, 2 or 4"):
        plan_fsdp2(Q7, vllm, H100_80GB_BYTES, 8, vllm_colocate=True)
    assert plan_fsdp2(Q7, vllm, H100_80GB_BYTES, 3, vllm_colocate=True, vllm_tp=1).details["vllm_tp"] == 1
    assert plan_fsdp2(Q7, vllm, H100_80GB_BYTES, 3).details["num_gpus"] == 3  # no vLLM engine: no head rule
    # GPUs of 19 GB with a 4 GB KV cache each: 1 and 2 do not fit, 3 would (TP 3: 18-20 GB) but vLLM refuses it
    assert smallest_fsdp2_gpus(Q7, vllm, 19 * 10**9, vllm_colocate=True, vllm_kv_cache_bytes=4 * 10**9) == 4
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "gsm8k-qwen2.5-7b-grpo", "--gpus", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "28 attention heads" in err[0], err


def test_qerl_plan_prints_every_figure_in_decimal_gb(capsys):
    """``qerl plan`` printed GB of 10**9 bytes (an H100's 81,559 MiB as 85.5 GB) and, in the same line, the KV cache one
    sequence needs in GiB (2**30 bytes): one unit now, GB, the unit of --memory-budget-gb too."""
    from qerl_trl.cli import main
    from qerl_trl.memory_plan import GB

    assert GB == 1e9 and f"{H100_80GB_BYTES / GB:.1f}" == "85.5"
    # 1 GiB of cache, max_model_len unset: one sequence of 32,768 positions needs 1.75 GiB = 1.88 GB
    _, line = fsdp2_answer(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=GIB)
    assert "(vLLM's max_model_len, 1.88 GB per GPU)" in line and "GiB" not in line, line
    # a cache too large to fit beside the rest, of a model whose one sequence is more than the room left
    _, line = fsdp2_answer(Q7, GSM8K, H100_80GB_BYTES, 1, vllm_colocate=True, vllm_kv_cache_bytes=60 * GIB,
                           vllm_max_model_len=400_000)  # fmt: skip
    assert "lowering vllm.kv_cache_memory_bytes cannot: one sequence needs 22.94 GB" in line and "GiB" not in line, line
    with pytest.raises(SystemExit):
        main(["plan", "gsm8k-qwen2.5-7b-grpo", "--gpus", "1", "--vllm", '{"kv_cache_memory_bytes": 1073741824, "max_model_len": null}'])  # fmt: skip
    out = capsys.readouterr().out
    assert "1 GPU of 85.5 GB" in out and "GB per GPU)" in out and "GiB" not in out, out
