#!/usr/bin/env bash
# THERE, as a background job after install.sh finished (issue #47, must-show 2 and 3):
#     bash benchmarks/vllm_gpu/bg.sh start a 'bash benchmarks/vllm_gpu/machine_a.sh'
# 1. `qerl train` (offline default, 20 steps, seed 0) with rollout_engine vllm (colocated, our kernel inside vLLM),
# 2. the same with the graph engine, 3. tests/vllm_integration (both linear backends: qerl, native/Marlin).
# One after another: a second vLLM engine on the card would fail vLLM's free-memory check. Files under $JOB_OUT.
set -uo pipefail
source benchmarks/vllm_gpu/env.sh
O=${JOB_OUT:-/tmp/qerl-a-out}
mkdir -p "$O"
nvidia-smi -L > "$O/gpu.txt"
common=(offline-default --max_steps 20 --seed 0 --per_device_train_batch_size 32 --gradient_accumulation_steps 1
        --save_steps 20 --save_total_limit 1)
for engine in vllm graph; do
  extra=()
  [ "$engine" = vllm ] && extra=(--vllm '{"gpu_memory_utilization": 0.3}')
  echo "== qerl train --rollout_engine $engine ($(date -u +%T))"
  /usr/bin/time -v -o "$O/train_$engine.time" python3 -m qerl_trl train "${common[@]}" --rollout_engine "$engine" \
    --output_dir "$O/run_$engine" "${extra[@]}" > "$O/train_$engine.log" 2>&1
  echo "rc $? ($(date -u +%T))"; tail -n 5 "$O/train_$engine.log"
  rm -rf "$O/run_$engine"/checkpoint-*  # keep metrics, plots, final adapter
done
echo "== tests/vllm_integration ($(date -u +%T))"
timeout 900 python3 -m pytest tests/vllm_integration -p no:cacheprovider -q -rA --durations=20 > "$O/vllm_tests.log" 2>&1
echo "rc $? ($(date -u +%T))"; tail -n 5 "$O/vllm_tests.log"
