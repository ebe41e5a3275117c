#!/usr/bin/env bash
# THERE, as a background job after install.sh finished (issue #47, items 2, 3, 5, 7; one one-GPU machine):
#     bash benchmarks/vllm_gpu/bg.sh start b 'bash benchmarks/vllm_gpu/machine_b.sh'
# One after another (a second vLLM engine on the card would fail vLLM's free-memory check), files under $JOB_OUT:
# 1. repro_probe.py: is the open test's run-to-run logprob gap ours or vLLM's LoRA shrink (split-K atomics)?
# 2. `qerl train` offline default, 20 steps, seed 0, vllm then graph (item 3, per-token importance sampling default),
# 3. the 7B GSM8K recipe through `qerl train` on vLLM (item 7), 4. S0's second half of tests/vllm_integration,
# 5. the shipped 32B DAPO recipe on vLLM (item 5, shared weights + packed micro-batches). MACHINE_B_SKIP="1 4" skips.
set -uo pipefail
source benchmarks/vllm_gpu/env.sh
O=${JOB_OUT:-/tmp/qerl-b-out}
mkdir -p "$O"
nvidia-smi -L > "$O/gpu.txt"
skip() { [[ " ${MACHINE_B_SKIP:-} " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%T))"; }
if ! skip 1; then
  say "1 repro_probe"
  timeout 300 python3 benchmarks/vllm_gpu/repro_probe.py --timeout 270 > "$O/repro_probe.log" 2>&1
  echo "rc $?"; grep CHECK "$O/repro_probe.log" | tail -n 30
fi
if ! skip 2; then
  for engine in vllm graph; do
    say "2 qerl train offline-default --rollout_engine $engine"
    extra=()
    [ "$engine" = vllm ] && extra=(--vllm '{"gpu_memory_utilization": 0.3}')
    /usr/bin/time -v -o "$O/train_$engine.time" python3 -m qerl_trl train offline-default --max_steps 20 --seed 0 \
      --per_device_train_batch_size 32 --gradient_accumulation_steps 1 --save_steps 20 --save_total_limit 1 \
      --rollout_engine "$engine" --output_dir "$O/run_$engine" "${extra[@]}" > "$O/train_$engine.log" 2>&1
    echo "rc $?"; tail -n 3 "$O/train_$engine.log"
    rm -rf "$O/run_$engine"/checkpoint-*  # keep metrics, plots, the final adapter
  done
fi
if ! skip 3; then
  say "3 the 7B GSM8K recipe on vLLM"
  python3 benchmarks/grpo_step.py --models 7b --arms nvfp4 --rollout-engine vllm --recipe gsm8k-qwen2.5-7b-grpo \
    --prompt-len 256 --lengths gsm8k --warmup-steps 1 --steps 2 --vllm-kv-gb 12 --no-subprocess \
    --out "$O/gsm8k_7b_recipe.json" > "$O/gsm8k_7b_recipe.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/gsm8k_7b_recipe.log"
fi
if ! skip 4; then
  say "4 tests/vllm_integration, second half"
  t=tests/vllm_integration
  timeout 900 python3 -m pytest $t/test_vllm_eval.py $t/test_vllm_mxfp4.py $t/test_vllm_rollouts.py \
    $t/test_grpo_step_recipe.py -p no:cacheprovider -q -rA --durations=20 > "$O/vllm_tests.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/vllm_tests.log"
fi
if ! skip 5; then
  say "5 the 32B DAPO recipe on vLLM"
  python3 benchmarks/grpo_step.py --models 32b --arms nvfp4 --rollout-engine vllm --recipe bigmath-qwen2.5-32b-dapo \
    --prompt-len 256 --lengths bigmath --warmup-steps 0 --steps 2 --vllm-kv-gb 14 --probe-tokens 256 --no-subprocess \
    --out "$O/dapo_32b_vllm.json" > "$O/dapo_32b_vllm.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/dapo_32b_vllm.log"
fi
say "machine_b done"
