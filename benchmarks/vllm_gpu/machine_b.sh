#!/usr/bin/env bash
# THERE, as a background job after install.sh finished (issue #47; one one-GPU machine):
#     bash benchmarks/vllm_gpu/bg.sh start b 'MACHINE_B_STEPS="1 2" bash benchmarks/vllm_gpu/machine_b.sh'   # ~20 min
# One step after another (a second vLLM engine on the card would fail vLLM's free-memory check), files under $JOB_OUT:
# 1. the vLLM tests that failed on the H200 at b78624b (CPU-only assumptions, vLLM's LoRA shrink atomics), fixed since;
# 2. `qerl train` offline default, 20 steps, one run per OFFLINE_ARMS entry ENGINE:IS_MODE:SEED (IS_MODE: QeRL's
#    default token_truncate, or off = vllm_importance_sampling_correction false; empty for graph) — item 3: does the
#    vLLM run learn like the graph engine's once AQN's deliberate noise is not re-weighted, and how far seeds spread;
# 3. the shipped 32B DAPO recipe on vLLM (item 5 again: shared weights + packed micro-batches), 4. the same on the
#    graph engine (item 7 for the 32B recipe). 2026-11-28 (b78624b) ran the earlier steps: the probe, the offline
#    default on both engines (seed 0), the 7B recipe on vLLM, S0's second half (results: *_b78624b.*).
set -uo pipefail
source benchmarks/vllm_gpu/env.sh
O=${JOB_OUT:-/tmp/qerl-b-out}
mkdir -p "$O"
nvidia-smi -L > "$O/gpu.txt"
step() { [[ " ${MACHINE_B_STEPS:-1 2 3 4} " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%T))"; }
if step 1; then
  say "1 the vLLM tests fixed since b78624b"
  t=tests/vllm_integration
  timeout 900 python3 -m pytest $t/test_vllm_mxfp4.py $t/test_grpo_step_recipe.py \
    "$t/test_vllm_engine.py::test_lora_sync_changes_outputs_like_hf" \
    $t/test_vllm_rollouts.py -k "lora or weights_once or mxfp4 or recipe or two_trainer or aqn_noise" \
    -p no:cacheprovider -q -rA --durations=20 > "$O/vllm_tests.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/vllm_tests.log"
fi
if step 2; then
  for arm in ${OFFLINE_ARMS:-vllm:off:0 vllm:token_truncate:1 vllm:off:1 graph::1}; do
    IFS=: read -r engine is seed <<< "$arm"
    name=${engine}${is:+_$is}_seed$seed
    say "2 qerl train offline-default $name"
    extra=()
    [ "$engine" = vllm ] && extra=(--vllm '{"gpu_memory_utilization": 0.3}')
    [ "$is" = off ] && extra+=(--vllm_importance_sampling_correction false)
    [ -n "$is" ] && [ "$is" != off ] && extra+=(--vllm_importance_sampling_mode "$is")
    /usr/bin/time -v -o "$O/train_$name.time" python3 -m qerl_trl train offline-default --max_steps 20 --seed "$seed" \
      --per_device_train_batch_size 32 --gradient_accumulation_steps 1 --save_steps 20 --save_total_limit 1 \
      --rollout_engine "$engine" --output_dir "$O/run_$name" "${extra[@]}" > "$O/train_$name.log" 2>&1
    echo "rc $?"; grep "qerl train:" "$O/train_$name.log" | tail -n 1
    rm -rf "$O/run_$name"/checkpoint-* "$O/run_$name/final"  # keep metrics and plots
  done
fi
for engine in vllm graph; do  # ~20 and ~25 min of a machine each (README "Next session's machines"): one per machine
  n=3 more=(--steps 2 --vllm-kv-gb 14); [ "$engine" = graph ] && n=4 more=(--steps 1)
  step $n || continue
  say "$n the 32B DAPO recipe on $engine"
  python3 benchmarks/grpo_step.py --models 32b --arms nvfp4 --rollout-engine "$engine" \
    --recipe bigmath-qwen2.5-32b-dapo --prompt-len 256 --lengths bigmath --warmup-steps 0 "${more[@]}" \
    --probe-tokens 256 --no-subprocess --out "$O/dapo_32b_$engine.json" > "$O/dapo_32b_$engine.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/dapo_32b_$engine.log"
done
say "machine_b done"
