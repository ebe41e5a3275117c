"""``qerl_trl.memory_plan``: the bytes of each part of a step, the rows that fit, the pre-flight check and the recipes.

Model configs are built locally with the published sizes of Qwen2.5-7B/14B/32B-Instruct (no Hub). The plan is checked
against arithmetic (the issue's KV-cache example, weights by format), against the committed H100 runs of
``benchmarks/grpo_step.py`` (weights and peak memory), and every shipped recipe against an 80 GB H100.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from qerl_trl.memory_plan import (
    GB,
    H100_80GB_BYTES,
    LORA_TARGETS,
    MemoryPlanError,
    ModelShape,
    RunShape,
    check_plan,
    plan_fsdp2,
    plan_memory,
    preflight,
    run_shape_from_config,
)
from transformers import AutoConfig

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

#: config.json sizes of Qwen2.5-{7B,14B,32B}-Instruct (also benchmarks/rollout.py's MODELS)
QWEN25 = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
HUB_IDS = {"Qwen/Qwen2.5-7B-Instruct": "7b", "Qwen/Qwen2.5-14B-Instruct": "14b", "Qwen/Qwen2.5-32B-Instruct": "32b"}


def qwen(size: str):
    return AutoConfig.for_model("qwen2", **QWEN25[size])


def _run(**kw) -> RunShape:
    base = dict(quantization="nvfp4", lora_r=32, lora_targets=LORA_TARGETS, generation_rows=128, micro_batch_rows=8,
                prompt_len=512, completion_len=8192, cache_len=512 + 8192)  # fmt: skip
    return RunShape(**{**base, **kw})


def test_issue_example_32b_kv_cache():
    """Qwen2.5-32B: 64 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 256 KiB per token; 128 rows x ~8,700
    positions is ~290 GB (the issue's numbers)."""
    shape = ModelShape.from_config(qwen("32b"))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (64, 8, 128)
    assert shape.kv_bytes_per_token(2) == 64 * 8 * 128 * 2 * 2 == 256 * 1024
    plan = plan_memory(shape, _run(), H100_80GB_BYTES)
    assert plan.kv_per_row == 256 * 1024 * 8704
    assert 285 * GB < 128 * plan.kv_per_row < 295 * GB  # ~292 GB


@pytest.mark.parametrize("size", ["7b", "14b", "32b"])
def test_weights_by_format(size):
    """Projection weights at 0.5625 B (NVFP4), 2 B (bf16), ~0.516 B (NF4 double-quantized); embeddings + lm_head in
    bf16; LoRA r (in + out) per projection."""
    shape = ModelShape.from_config(qwen(size))
    c = QWEN25[size]
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * 128
    linear = c["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * i)
    dense = 2 * 2 * c["vocab_size"] * h
    plans = {q: plan_memory(shape, _run(quantization=q), H100_80GB_BYTES) for q in ("nvfp4", "none", "nf4")}
    assert plans["none"].weights == pytest.approx(2 * linear + dense, rel=1e-3)
    assert plans["nvfp4"].weights == pytest.approx(0.5625 * linear + dense, rel=1e-3)
    assert plans["nf4"].weights < plans["nvfp4"].weights
    lora = c["num_hidden_layers"] * 32 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))
    assert plans["nvfp4"].details["lora_params"] == lora
    assert plans["nvfp4"].lora == 2 * 4 * lora and plans["nvfp4"].optimizer == 2 * 4 * lora  # fp32, AdamW


def _measured_runs(engine: str = "graph"):
    """(file, settings, result) of the committed grpo_step runs on one GPU with the given rollout engine."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    for name in ("grpo_step_7b_graph.json", "grpo_step_14b_graph.json", "grpo_step_32b_graph.json",
                 "grpo_step_7b_b128.json"):  # fmt: skip
        data = json.loads((RESULTS / name).read_text())
        for r in data["results"]:
            if r.get("status") == "ok" and r.get("rollout_engine") == engine and r.get("world_size", 1) == 1:
                yield name, data["settings"], r


def _benchmark_plan(settings: dict, r: dict):
    """The plan of a grpo_step run: its shapes, LoRA in bf16 (``--lora-dtype``), cache = prompt + completion."""
    rows = settings.get("per_device_batch") or settings["group"]
    run = RunShape(
        quantization={"nvfp4": "nvfp4", "bf16": "none", "qlora": "nf4"}[r["arm"]], lora_r=settings["lora_r"],
        lora_targets=LORA_TARGETS, generation_rows=rows * (settings.get("grad_accum") or 1), micro_batch_rows=rows,
        prompt_len=settings["prompt_len"], completion_len=settings["completion_len"],
        cache_len=settings["prompt_len"] + settings["completion_len"], lora_param_bytes=2,
        gradient_checkpointing=settings["grad_ckpt"],
    )  # fmt: skip
    return plan_memory(ModelShape.from_config(qwen(r["model"])), run, H100_80GB_BYTES), run.generation_rows


def test_plan_bounds_the_measured_h100_peaks():
    """Against every committed one-GPU graph-engine step (7B/14B/32B, NVFP4 / bf16 / NF4, 8 or 128 completions): the
    weights within 2 % of ``weights_gpu_gb`` (LoRA included), and the planned peak at least the measured peak and at
    most 25 % above it (the activation coefficients are fitted to these runs and rounded up)."""
    seen = 0
    for name, settings, r in _measured_runs():
        plan, rows = _benchmark_plan(settings, r)
        weights = (plan.weights + plan.details["lora_params"] * 2) / GB
        assert weights == pytest.approx(r["weights_gpu_gb"], rel=0.02), (name, r["arm"])
        measured = r["summary"]["peak_gpu_gb"]
        planned = plan.peak(rows) / GB
        assert measured <= planned <= 1.25 * measured, (name, r["arm"], planned, measured)
        seen += 1
    assert seen >= 9


@pytest.mark.parametrize("budget_gb", [20, 40, 55, 80, 141])
def test_wave_rows_is_the_most_that_fits(budget_gb):
    plan = plan_memory(ModelShape.from_config(qwen("32b")), _run(micro_batch_rows=1), budget_gb * GB)
    w = plan.wave_rows
    if w:
        assert plan.peak(w) <= plan.usable_bytes
        assert plan.waves == math.ceil(128 / w) and plan.rows_per_wave * plan.waves >= 128
        assert plan.rows_per_wave <= w
    assert w == 128 or plan.peak(w + 1) > plan.usable_bytes


def test_check_plan_one_line_messages():
    shape = ModelShape.from_config(qwen("32b"))
    fine = plan_memory(shape, _run(micro_batch_rows=1), H100_80GB_BYTES)
    check_plan(fine)  # waves of 17
    with pytest.raises(MemoryPlanError, match="rollout_engine='graph'") as e:
        check_plan(fine, waves_allowed=False)  # a whole batch of 128 rows at once: ~300 GB
    assert "\n" not in str(e.value)
    big_batch = plan_memory(shape, _run(micro_batch_rows=8), H100_80GB_BYTES)
    with pytest.raises(MemoryPlanError, match=r"GB over the .* lower per_device_train_batch_size \(8;") as e:
        check_plan(big_batch)
    assert "\n" not in str(e.value)
    with pytest.raises(MemoryPlanError, match="quantize the policy"):  # 32B in bf16: 65.5 GB of weights
        check_plan(plan_memory(shape, _run(quantization="none"), 60 * GB))
    with pytest.raises(MemoryPlanError, match="weights alone do not fit"):
        check_plan(plan_memory(shape, _run(), 20 * GB))


def test_unknown_model_or_targets():
    moe = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    with pytest.raises(MemoryPlanError, match="mixture-of-experts"):
        ModelShape.from_config(moe)
    with pytest.raises(MemoryPlanError, match="LoRA targets"):
        _run(lora_targets=("q_proj", "lm_head"))
    with pytest.raises(MemoryPlanError, match="quantization"):
        _run(quantization="int3")


def _config(tmp_path, **kw):
    from qerl_trl import QeRLConfig

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=16, gradient_accumulation_steps=8,
                num_generations=8, max_completion_length=4096, report_to="none", rollout_engine="graph")  # fmt: skip
    return QeRLConfig(**{**base, **kw})


def test_run_shape_from_config(tmp_path):
    """TRL's generation batch per process (per_device_train_batch_size x steps_per_generation), the graph engine's
    cache length, the format of ``quantization``, fp32 LoRA and AdamW."""
    run = run_shape_from_config(_config(tmp_path))
    assert (run.generation_rows, run.micro_batch_rows, run.prompt_len, run.cache_len) == (128, 16, 1024, 1024 + 4096)
    assert run.quantization == "nvfp4" and run.lora_targets == LORA_TARGETS and run.lora_param_bytes == 4
    assert run.optimizer_states == 2 and run.gradient_checkpointing  # GRPOConfig's default
    run = run_shape_from_config(
        _config(tmp_path, quantization="nf4", nf4_double_quant=False, steps_per_generation=4, gradient_checkpointing=False,
                generation_kwargs={"max_cache_len": 6000}, lora_target_modules=["q_proj", "v_proj"]),
        activation_bytes=2,
    )  # fmt: skip
    assert (run.generation_rows, run.cache_len, run.quantization) == (64, 6000, "nf4-no-double-quant")
    assert run.lora_targets == ("q_proj", "v_proj") and run.activation_bytes == 2 and not run.gradient_checkpointing


def test_run_shape_rows_per_process_do_not_shrink_with_a_planned_gpu_count(tmp_path):
    """``qerl plan --gpus N`` parses the config in one process (TRL's generation batch then counts one process) and
    plans N: each of the N processes still generates per_device_train_batch_size x steps_per_generation rows, as
    ``qerl train`` under the launch plans them (TRL's batch of N processes, sharded over N)."""
    args = _config(tmp_path)  # 16 x 8 = 128 completions per process
    assert args.world_size == 1
    for gpus in (1, 2, 4):
        assert run_shape_from_config(args, world_size=gpus).generation_rows == 128


def test_preflight(tmp_path):
    """Graph engine: waves set when the batch does not fit at once; a generation_wave_rows the user set that does not
    fit is one line; vLLM is not planned; the transformers engine must fit the whole batch."""
    model = qwen("32b")
    args = _config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=128, num_generations=16,
                   max_completion_length=8192, gradient_checkpointing=True, bf16=False)  # fmt: skip
    plan = preflight(args, model, H100_80GB_BYTES)
    assert plan.run.activation_bytes == 4  # a CPU-parsed config: fp32 activations (the GPU's would be bf16)
    assert args.generation_wave_rows == plan.wave_rows >= 1 and plan.waves > 1
    args.generation_wave_rows = 100
    with pytest.raises(MemoryPlanError, match=rf"generation_wave_rows=100 does not fit.*set it to {plan.wave_rows} or"):
        preflight(args, model, H100_80GB_BYTES)
    args.generation_wave_rows = None
    settings = dict(per_device_train_batch_size=1, gradient_accumulation_steps=128, num_generations=16,
                    max_completion_length=8192, gradient_checkpointing=True, bf16=False)  # fmt: skip
    assert preflight(_config(tmp_path, rollout_engine="vllm", **settings), model, 1) is None  # sizes its own memory
    args = _config(tmp_path, rollout_engine="transformers", **settings)
    with pytest.raises(MemoryPlanError, match="use rollout_engine='graph'"):
        preflight(args, model, H100_80GB_BYTES)
    assert args.generation_wave_rows is None


def _recipe_model_config(model_name: str, offline_model_path: Path):
    if model_name == "offline-default":
        return AutoConfig.from_pretrained(offline_model_path)
    assert model_name in HUB_IDS, f"add the sizes of {model_name}'s config.json to QWEN25 / HUB_IDS"
    return qwen(HUB_IDS[model_name])


def test_shipped_recipes_fit_an_h100(tmp_path, offline_model_path):
    """Every shipped recipe, as written, on an 80 GB H100 (pure arithmetic, activations in bf16 as on the GPU): the plan
    fits, in one batch or in waves. Both GPU recipes run on colocated vLLM (weights shared) and hold the KV cache their
    ``vllm.kv_cache_memory_bytes`` fixes: the 7B GSM8K recipe 12 GiB, 48 sequences of 4,608 positions
    (``max_model_len``) at once at 56 KiB a position (the engine schedules the other 80); the 32B DAPO recipe 14 GiB, 6
    of 9,216 at 256 KiB. The 32B recipe on its fallback engine (``--rollout_engine graph``, 128 completions x 8,192
    tokens, micro-batch 1) is generated in 8 waves of 16 rows with a planned peak under 75 GB."""
    from qerl_trl.cli import RECIPES_DIR, parse_train_args

    got = {}
    for recipe in sorted(RECIPES_DIR.glob("*.yaml")):
        script_args, config = parse_train_args([recipe.stem, "--output_dir", str(tmp_path / recipe.stem)])
        shape = ModelShape.from_config(_recipe_model_config(script_args.model_name_or_path, offline_model_path))
        run = run_shape_from_config(config, activation_bytes=2)
        engine = config.rollout_engine_class
        if engine.colocated_engine(config):  # vLLM beside the policy: its weights (shared) and paged KV cache count too
            plan = plan_fsdp2(shape, run, H100_80GB_BYTES, 1, vllm_colocate=True,
                              vllm_shares_weights=config.vllm.share_weights,
                              vllm_kv_cache_bytes=config.vllm.kv_cache_memory_bytes,
                              vllm_max_model_len=config.vllm.max_model_len)  # fmt: skip
        else:
            plan = plan_memory(shape, run, H100_80GB_BYTES)
        check_plan(plan, waves_allowed=engine.generates_in_waves or engine.colocated_engine(config))
        got[recipe.stem] = (plan.waves, plan.rows_per_wave, plan.peak(plan.rows_per_wave) / GB, plan)
    assert set(got) >= {"offline-default", "gsm8k-qwen2.5-7b-grpo", "bigmath-qwen2.5-32b-dapo"}
    assert got["offline-default"][:2] == (1, 32)
    plan = got["gsm8k-qwen2.5-7b-grpo"][3]
    assert plan.kv_cache_bytes == 12 * 2**30 and plan.wave_rows == 12 * 2**30 // (56 * 1024 * 4608) == 48
    assert plan.peak(plan.wave_rows) <= plan.usable_bytes and plan.per_row == 0  # 12 GiB held, not 64 x 0.29 GB
    plan = got["bigmath-qwen2.5-32b-dapo"][3]
    assert plan.kv_cache_bytes == 14 * 2**30 and plan.wave_rows == 14 * 2**30 // (256 * 1024 * 9216) == 6
    assert plan.peak(plan.wave_rows) <= 65 * GB and plan.per_row == 0, plan.summary()
    _, config = parse_train_args(["bigmath-qwen2.5-32b-dapo", "--rollout_engine", "graph", "--output_dir", str(tmp_path)])
    plan = plan_memory(ModelShape.from_config(qwen("32b")), run_shape_from_config(config, activation_bytes=2), H100_80GB_BYTES)
    assert (plan.waves, plan.rows_per_wave) == (8, 16) and plan.peak(plan.rows_per_wave) <= 75 * GB, plan.summary()
    assert plan.run.generation_rows == 128 and plan.run.completion_len == 8192
    assert 2.4 * GB < plan.kv_per_row < 2.45 * GB  # 256 KiB x 9216 positions


def test_cli_impossible_plan_stops_before_the_model_loads(tmp_path, capsys):
    """``qerl train --memory-budget-gb 0.05``: the offline default recipe cannot fit; one line on stderr (what, by how
    much, what to change), exit code 2, nothing built (no run folder)."""
    from qerl_trl.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "offline-default", "--output_dir", str(out), "--memory-budget-gb", "0.05"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qerl train: error: the run does not fit in 0.1 GB"), err
    assert "GB over the" in err[0] and not out.exists()
    for bad in ("-1", "inf", "lots"):
        with pytest.raises(SystemExit) as e:
            main(["train", "offline-default", "--output_dir", str(out), "--memory-budget-gb", bad])
        assert e.value.code == 2 and "--memory-budget-gb must be" in capsys.readouterr().err


def test_cli_check_memory_prints_the_waves(tmp_path, capsys):
    """The graph engine over a budget that holds some rows but not all: ``check_memory`` sets generation_wave_rows
    and prints one line with the wave size."""
    from qerl_trl.cli import check_memory, parse_train_args

    script_args, config = parse_train_args(
        ["offline-default", "--rollout_engine", "graph", "--output_dir", str(tmp_path)]
    )
    full = check_memory(script_args, config, budget_bytes=H100_80GB_BYTES)
    assert full.waves == 1 and config.generation_wave_rows is None and capsys.readouterr().out == ""
    budget = int((full.peak(full.run.generation_rows // 3)) / (1 - full.margin))
    plan = check_memory(script_args, config, budget_bytes=budget)
    out = capsys.readouterr().out.strip().splitlines()
    assert config.generation_wave_rows == plan.wave_rows and plan.waves in (3, 4)
    assert len(out) == 1 and f"generated in {plan.waves} waves of <= {plan.rows_per_wave} rows" in out[0], out


def test_fp8_copy_on_a_run_that_does_not_fit_in_w4a16_either_names_what_would(tmp_path):
    """``rollout_precision='fp8'`` on a run whose w4a16 plan does not fit either (the 32B DAPO recipe on 20 GB: its
    NVFP4 weights alone are 20.7 GB): the one line is the plan's own (what does not fit, what to change), not the FP8
    copy's, whose advice ``use rollout_precision='w4a16'`` would not fit either."""
    from qerl_trl.cli import parse_train_args

    _, config = parse_train_args(["bigmath-qwen2.5-32b-dapo", "--output_dir", str(tmp_path), "--rollout_precision",
                                  "fp8", "--rollout_engine", "graph"])  # fmt: skip
    with pytest.raises(MemoryPlanError) as info:
        preflight(config, qwen("32b"), 20 * 10**9)
    line = str(info.value)
    assert "\n" not in line and line.startswith("the run does not fit in 20.0 GB"), line
    assert "the policy's weights alone do not fit" in line and "use rollout_precision='w4a16'" not in line, line


def test_fp8_copy_is_counted_and_a_plan_it_does_not_fit_stops_in_one_line(tmp_path):
    """``rollout_precision`` fp8 / auto with the graph engine: the E4M3 copy of the projections (1 byte a weight + 4
    per output row) is added to the policy's weights; the 7B GSM8K recipe keeps its 2 waves of 64 on an H100, the 32B
    DAPO recipe would go from 8 waves of 16 to 32 of 4 and stops with one line naming the numbers (issue #51)."""
    from dataclasses import replace

    from qerl_trl.cli import parse_train_args
    from qerl_trl.memory_plan import QWEN25_SHAPES, _weight_parts

    def plan_of(recipe: str, model: str, precision: str):
        _, config = parse_train_args([recipe, "--output_dir", str(tmp_path / recipe), "--rollout_precision", precision,
                                      "--rollout_engine", "graph"])  # fmt: skip (the engine whose copy the policy holds)
        config.bf16 = True  # plan the GPU run's activations
        return config, plan_memory(QWEN25_SHAPES[model], run_shape_from_config(config), H100_80GB_BYTES)

    _, w4 = plan_of("gsm8k-qwen2.5-7b-grpo", "Qwen/Qwen2.5-7B-Instruct", "w4a16")
    config, auto = plan_of("gsm8k-qwen2.5-7b-grpo", "Qwen/Qwen2.5-7B-Instruct", "auto")
    assert auto.run.rollout_precision == "auto" and w4.details["fp8_copy"] == 0
    assert 6.53 * GB < auto.details["fp8_copy"] < 6.54 * GB
    assert auto.weights - w4.weights == auto.details["fp8_copy"]
    assert (auto.waves, auto.rows_per_wave) == (w4.waves, w4.rows_per_wave) == (2, 64)
    assert preflight(config, qwen("7b"), H100_80GB_BYTES) is not None
    config, fp8 = plan_of("bigmath-qwen2.5-32b-dapo", "Qwen/Qwen2.5-32B-Instruct", "fp8")
    assert 31.2 * GB < fp8.details["fp8_copy"] < 31.3 * GB
    with pytest.raises(MemoryPlanError) as info:
        preflight(config, qwen("32b"), H100_80GB_BYTES)
    line = str(info.value)
    assert "\n" not in line and line.startswith("rollout_precision='fp8' adds a 31.2 GB FP8 copy of the linears")
    assert "20.7 GB of weights" in line and "32 wave(s) of <= 4 instead of 8 of <= 16" in line, line
    assert line.endswith("use rollout_precision='w4a16' here") and config.generation_wave_rows is None
    # a colocated vLLM engine (FSDP2 plan): fp8 holds the E4M3 copy instead of the NVFP4 projections, auto both
    shape = QWEN25_SHAPES["Qwen/Qwen2.5-7B-Instruct"]
    engine = {p: plan_fsdp2(shape, replace(w4.run, rollout_precision=p), H100_80GB_BYTES, 2, vllm_colocate=True,
                            vllm_tp=1).details["vllm_weights"] for p in ("w4a16", "fp8", "auto")}  # fmt: skip
    copy, nvfp4 = auto.details["fp8_copy"], 28 * _weight_parts(shape, w4.run)["layer_projections"]
    assert engine["auto"] - engine["w4a16"] == pytest.approx(copy, abs=1)
    assert engine["fp8"] - engine["w4a16"] == pytest.approx(copy - nvfp4, abs=1)
