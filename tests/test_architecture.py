"""The structure issues #38 and #48 set up stays: counted from the source by ``tests/architecture_metrics.py``."""

from __future__ import annotations

from pathlib import Path

import architecture_metrics as am

ROOT = Path(__file__).resolve().parents[1]
#: where a ``quantization`` string is parsed into its ``QuantScheme``, one site per entry point, the object flowing on
#: from there (the trainer and ``qerl eval`` hand the parsed scheme to ``load_model`` / ``load_policy``, which return it
#: as it is). ``qerl train``'s check before TRL is imported (``qerl_trl.arguments.check_quantization``) checks the name
#: against the option snapshot and keeps no object: the config's parse is ``qerl train``'s one.
#: ``nvfp4-quantize`` takes a format (``--format``, looked up by ``get_format``), no ``quantization`` string.
PARSE_ENTRY_POINTS = {
    "qerl_trl/config.py: __post_init__": "qerl train (recipe and command line) and QeRLConfig(quantization=...)",
    "qerl_trl/evaluation.py: _scheme_arg": "qerl eval --quantization",
    "qerl_trl/evaluation.py: load_model": "Python: load_model(quantization=<name>)",
    "qerl_trl/policy.py: load_policy": "Python: load_policy(quantization=<name>)",
}


def test_quantization_strings_are_parsed_once_per_entry_point():
    sites = [f"{s.split(':')[0].split('/src/')[-1]}:{s.split(':')[-1]}" for s in am.parse_sites(ROOT)]
    assert sorted(sites) == sorted(PARSE_ENTRY_POINTS), sorted(sites)  # one each: none added, none repeated


def test_no_format_name_comparisons_outside_the_registries():
    assert am.format_name_comparisons(ROOT) == []


#: where a format name enters (a serialized config, a CLI option, a public function that accepts a name): the only
#: ``get_format`` calls outside the registry; inside, the ``Format`` object flows on
FORMAT_ENTRY_POINTS = {
    "nvfp4/hf.py: __init__",  # NVFP4Config(format=...), also from a saved config
    "qerl_vllm/quant.py: from_config",  # the vLLM plugin's config from a checkpoint's
    "nvfp4/cli.py: _format_arg",  # nvfp4-quantize --format
    "nvfp4/linear.py: __init__",  # NVFP4Linear(format=...)
    "nvfp4/linear.py: from_linear",
    "nvfp4/linear.py: quantize_model",
    "nvfp4/card.py: write_model_card",
}


def test_format_names_are_looked_up_where_they_enter_only():
    sites = {f"{s.split(':')[0].split('/src/')[-1]}:{s.split(':')[-1]}" for s in am.format_lookups(ROOT)}
    assert sites <= FORMAT_ENTRY_POINTS, sites - FORMAT_ENTRY_POINTS


def test_nvfp4_has_no_import_cycle():
    assert am.nvfp4_import_cycles(ROOT) == []


def test_no_package_has_an_import_cycle():
    assert am.import_cycles(ROOT) == {top: [] for top in am.PACKAGE_SRCS}


#: no benchmark compares its --engine / --rollout-engine values with engine names: grpo_step.py reads the engine's
#: rules from its class (QeRLConfig's resolution: ``generates_from_copy``, ``compile_decode``, the memory attributes),
#: rollout.py has one engine (graph_generate). No benchmark imports or reads a private name (gemm.py and
#: kernel_sass.py read nvfp4_gemm's NUM_SMS, pick_split, JIT_KERNELS)
def test_no_engine_name_comparisons_outside_the_engine_registry():
    assert am.engine_name_comparisons(ROOT) == []


def test_an_engine_name_becomes_a_class_once_per_entry_point():
    """``qerl train`` (and the Python API): ``QeRLConfig``; ``qerl eval``: its ``--engine`` option."""
    sites = [s.split(":")[0].split("/src/")[-1] for s in am.engine_resolution_sites(ROOT)]
    assert sorted(sites) == ["qerl_trl/config.py", "qerl_trl/evaluation.py"], sites


def test_no_private_names_imported_across_packages_or_by_benchmarks():
    assert am.private_imports(ROOT) == []


def test_benchmarks_hold_what_a_maintainer_reruns():
    # issue #48's target is 3,500: reaching it would delete the scripts behind current BENCHMARKS rows (learning study,
    # quality, quantization time) and kernel_sass.py (issue #50); a ratchet at this tree.
    # +101 (5,710 → 5,811): gemm.py --fp8, issue #51's FP8-rollout spike (bf16 / W4A16 / FP8 arms in one run)
    # +208 (→ 6,019, issue #47 item 5): grpo_step.py --recipe runs `qerl train` itself, timed, with the worst-case probe
    # +109 (→ 6,128, issue #52 machine E; the tree stood at 6,011, so 117 lines added): vllm_gpu/merge_e.py (109: the
    # job's folder as one JSON), shapes 72b + tiny-hd64 (5), rollout_vllm.py --build-only --nvfp4-only (3)
    # +5 (→ 6,133, issue #51 item 2): rollout_vllm.py's vllm-nvfp4-fp8 / -auto arms (rollout_precision through
    # vLLM's additional_config), for the GPU measurement against bf16 + LoRA and W4A16
    # +112 (→ 6,245, issue #51 item 1): rollout.py / rollout_vllm.py --profile, ms per decode step by kernel category
    # (common/profiler.py: the categories, lm_head by position, profile_decode, profile_table)
    # +338 (→ 6,583, 3fdda47, merged without a line here): vllm_gpu/repro_probe.py, the vLLM LoRA-sync repro probe
    # -484 (→ 6,099): learning_study.py's CPU study and common/entropy.py left (code at 4f53c7b); shared pieces, compaction
    # -334 (→ 5,765): vllm_gpu/repro_probe.py left once its H200 run was recorded (repro_probe_h200_b78624b.log: vLLM's
    # LoRA shrink atomics; its config writer is qerl_vllm.lora_shrink now); -2 (→ 5,763): grpo_step --recipe takes the
    # graph engine (S3g), _PASS as one string; the worst-case probe's micro-batch cut to per_device_batch rows
    # -251 (→ 5,512, issue #48): gemm.py's finished modes left (--compare-ct, --compare-reduce, --fewer-stages,
    # --profile, --fp8; code at dce0c4f); the (model, arm) loop, worker command line, in-process runner and shared
    # options moved to common/workers; profiler's unused run_arms left; quality's setup, gemm.py's Humming layers and
    # the commit / versions helpers once each (grpo_step's settings keep every field its committed JSONs hold)
    # -14 (→ 5,498, #48): grpo_step's options no run set left (code at e0a0a82); the rollout scripts' shared rows once
    # -69 (→ 5,429, #48): no option left; duplicated code merged (rollout arms, workers, grpo_step), dead code left
    # -98 (→ 5,331, #50): gemm.py --spike and kernel_sass.py --ss left with round 12's no-go (code at 0c004f2)
    # +74 (→ 5,405, issue #50 round 14): gemm.py --occupancy (hopper_ws with one consumer x two
    # CTAs per SM beside the shipped kernel, bf16 and Humming), kernel_sass.py --ws CONSUMERS,CTAS_PER_SM
    # -67 (→ 5,338, #50): gemm.py --occupancy, kernel_sass.py --ws CONSUMERS,CTAS left with round 14's no-go
    # (code at ffe0fc3)
    # -287 (→ 5,051, #48): train_phases.py left (the main command by phase, #37's history; code at ffe0fc3)
    # -297 (→ 4,754, #48): compaction, no behaviour change: docstrings and help that repeated BENCHMARKS.md,
    # rollout_vllm's run options from common.workers, counter_diff once, learning_study's figures through common.plots,
    # quantize_time's unused --keep-ckpt
    # +14 (→ 4,768, #51): learning_study.py --fp8, the FP8-rollout parity study's two arms with vLLM rollouts (--formats
    # and --fp8 as PRESETS)
    # -118 (→ 4,650, #48; code at e48270c): rollout.py's transformers `generate` engine (graph_generate only), grpo_step.py's DDP mode,
    # rollout_vllm.py's never-run -base arms; options no run set (--lora-r, --lora-dtype, --nvfp4-method,
    # --no-double-quant, --compile-mode, --fullgraph, --cpu, --verbose, --gpu-memory-utilization) fixed as settings
    # +4 (→ 4,654, #51): learning_study's vLLM arms with a fixed KV cache (vLLM's profiling is not safe for engines
    # starting side by side on one card)
    # +5 (→ 4,659): every result JSON names its Humming (humming-kernels' version: vLLM's Humming arm, --peer-humming)
    # +73 (→ 4,732, #50): gemm.py --round15, round 15 step A's timing beside the shipped kernel, bf16 and Humming
    # +5 (→ 4,737, #50): gemm.py --round15 times round 15 step B (inflight=True) too, after its float64 check
    # +2 (→ 4,739, #50): gemm.py --round15's ROUND15_ARMS=stepa (step A alone, should step B's kernel fault)
    # -115 (→ 4,624, #48): module docstrings say what each script measures once (commands and history in
    # BENCHMARKS.md); rollout.py, rollout_vllm.py and grpo_step.py on one harness (common.workers.run_meta,
    # run_arm_grid prints the header and table; common.profiler.with_profile); gemm.py's q_ct (--compare-ct's)
    # and the -base arms' labels left; code at 89ad567
    # +25 (→ 4,649, #50): gemm.py --scale-pairs, every form (forward, dgrad, fused LoRA with --compare-lora) with
    # the scales in round 15 step A's order beside the [N, K/16] scales on the same weights (pairs_ms, pairs_err):
    # the landing's time measurement
    # +1 (→ 4,650): grpo_step's bf16 arm sets quantization='none' (the trainer refuses a dense model under a 4-bit one)
    # +3 (→ 4,653): the fixed-length rows' `tokens_crc32` (two runs, e.g. the scale orders on and off, computed the same
    # tokens: a correctness check the timing runs give for free)
    # +182 (→ 4,835, issues #47 / #51): vllm_gpu/lora_tune.py, vLLM's LoRA shrink / expand tiles at a model's sites (the
    # decode profile at 35bcdd6: 3.1-3.8 ms of a 7B step at B >= 128); +1 profiler (cuBLAS's FP8 nvjet names). A spike:
    # it leaves once its files ship in the engine or its no-go is recorded; +6 (→ 4,841): rollout_vllm.py's JSON records
    # the environment that changes what it measures (VLLM_TUNED_CONFIG_FOLDER, NVFP4_SCALE_MMA_LAYOUT, the backend); +6 (→ 4,847): lora_tune.py keeps each site's tensors alive and clears both lru-cached lookups; +2 (→ 4,849): --one-split; +4 (→ 4,853): gemm.py times the scale order NVFP4Linear holds
    # -62 (→ 4,791, #48): gemm.py's timing loops through one rotated() (each form's calls over its weight copies, as
    # before), the sweep's forward and backward passes one loop, its compressed-tensors candidates left (every shape it
    # sweeps takes the MMA layout); behaviour unchanged, code at 6a06c59
    # -13 (→ 4,778, #48): grpo_step.py's worker and --recipe share the lengths' keywords (_length_kwargs: fixed, spread
    # EOS ids, or vLLM's 127 stop ids), StepClock's settings as arguments, the prefill and vLLM's weight sync timed
    # through one _Clock.wrap; same fields (spread_eos_ids now 0 where no spread), code at 6a06c59
    # -41 (→ 4,737, #48): compaction, no behaviour change: grpo_step's step rows and summary as comprehensions, AQN's
    # timer one context manager; rollout.py's graph_generate call in its worker; common.workers' hidden worker options in
    # add_run_arguments; common.models' unused ROLLOUT_BNB_CPU; code at 6a06c59
    # -19 (→ 4,718, #48): learning_study's MPS daemon under mock.patch.dict, its metrics reader and run environment
    # inline; quality.py's two tables share their error cells (output checked equal on CPU); code at 6a06c59
    # +6 (→ 4,724, #48): lines of the compaction above back within 120 characters; gemm.py's sweep prints fwd / bwd again
    # -119 (→ 4,605, #48): quantize_time.py --mode hf left, never run (from_pretrained with NVFP4Config against a bf16
    # load; code at 6a06c59); the layers mode writes the same JSON
    # +8 (→ 4,613, #47 / #51): rollout_vllm.py --lora-tiles (shipped: our arms with the engine's tuned LoRA tiles, stock
    # arms with vLLM's, in one run; stock / tuned: all alike). lora_tune.py stays: it writes the files qerl_vllm ships
    # (tuned_lora_configs/, 6a06c59), per GPU and model shape
    # +1 (→ 4,614): quality.py --arms takes ids (nvfp4, mxfp4, nf4-dq, nf4): the NF4 rows' names hold commas, so
    # two of the four arms could not be picked by name; an unknown id is refused in one line
    # +5 (→ 4,619): lora_tune.py merges its entries into the files already in --out-dir (a second model's shapes join
    # the shipped files)
    # -79 (→ 4,540, #50 / #48): gemm.py --round15 left with round 15's decision (step A landed, step B no-go; code at
    # a4371b5); kernels_job.sh step 1 keeps the round's GPU tests
    # -176 (→ 4,364, #48): lora_tune.py --check-only / --one-split left (no run set them; code at 6ee5805); compaction,
    # no behaviour change: the tables of grpo_step / rollout / rollout_vllm / learning_study (output checked equal on
    # every committed result), Usage blocks and common's __all__ lists; gemm.py / kernel_sass.py untouched (#50 branch)
    # -27 (→ 4,337, #50): gemm.py --scale-pairs left at stage 2's end (both scale orders side by side: the MMA kernels
    # read only step A's order now; code at 6ee5805), and rollout_vllm.py no longer records NVFP4_SCALE_MMA_LAYOUT
    # +171 (→ 4,508, #51 item 3): fp8_lora_spike.py, the FP8 + LoRA spike's timer (the adapter as K columns of the FP8
    # GEMM beside the FP8 layer alone and vLLM's adapter on top); a spike: it leaves with its go / no-go recorded
    # -8 (→ 4,500): gemm.py's CUDA-graph timing loop moved to common/timing.py, which the spike's timer calls instead of
    # its copy
    # -153 (→ 4,347, #51 item 3): fp8_lora_spike.py left with forms 1 and 2's no-go (code at 902c614)
    # +30 (→ 4,377, #50): gemm.py's arms timed in rotated rounds (common.timing.interleaved, --rounds): the arm timed
    # first ran 0-20 % faster than the same kernel timed after bf16 cuBLAS, 16 of 16 pairs (round 16's JSON); bf16 and
    # Humming's error apart from their timing; the sweep's reference is bf16 alone (it timed our current config too);
    # ws_candidate builds its config through nvfp4_gemm.entry_config (the dispatch table's own), not a copy of it
    # +6 (→ 4,383, #50 round 17's spike): gemm.py --pingpong, the ws tile with its consumers taking turns beside it in
    # the same rounds; -6 (→ 4,377): left with the round's no-go (code at f568402)
    # +12 (→ 4,389, #50): common.timing.balanced_orders, a Williams design for interleaved's rounds: with the order
    # only rotated, each arm followed the same neighbour every round, and two arms of one kernel differed by 3-7 %
    # (gemm_round17_h100_f568402.json, prev / ws at M = 1024); +1 (→ 4,390): gemm.py's JSON names its commit
    assert am.benchmark_lines(ROOT) <= 4390
