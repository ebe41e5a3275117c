#!/usr/bin/env bash
# THERE, as a background job after install.sh finished (issue #47; one one-GPU machine):
#     bash benchmarks/vllm_gpu/bg.sh start b 'MACHINE_B_STEPS="1 2" bash benchmarks/vllm_gpu/machine_b.sh'   # ~20 min
# One step after another (a second vLLM engine on the card would fail vLLM's free-memory check), files under $JOB_OUT:
# 1. vLLM tests (issue #47 item 2): VLLM_TESTS (pytest paths or node ids; default the whole tests/vllm_integration),
#    VLLM_TESTS_S seconds (default 900), log $O/${VLLM_TESTS_LOG:-vllm_tests}.log; verbose and under SIGINT, so pytest
#    prints its summary and durations if the time runs out (tests needing 2 GPUs skip where one is visible);
# 2. `qerl train` offline default, 20 steps, one run per OFFLINE_ARMS entry ENGINE:IS_MODE:SEED (IS_MODE: token_truncate
#    = the correction on, off = vllm_importance_sampling_correction false, empty = the config's default: off under AQN
#    since 0e0058a); default: the shipped default on both engines at a third seed (item 3's arms at seeds 0 and 1 ran:
#    offline_default_h200_is_off_dce0c4f.json);
# 3. the shipped 32B DAPO recipe on vLLM (item 5 again: shared weights + packed micro-batches), 4. the same on the
#    graph engine (item 7 for the 32B recipe). Earlier jobs: b78624b (probe, offline default seed 0, 7B recipe on vLLM,
#    S0's second half), dce0c4f (steps 1-2: *_dce0c4f.*), e0a0a82 (steps 3-4 side by side, step 1's four tests, step 5
#    cut at 420 s: *_e0a0a82*). 5. (only when asked: MACHINE_B_STEPS="5") issue #48's `-m gpu` suite of the main tests,
#    verbose (each test's line stays if the time runs out). (Step 6 ran issue #50's kernel spikes and left with them:
#    round 12's at 0c004f2; round 14's two-CTA spike at ffe0fc3 on one H200, no-go: gemm_occupancy_h200_ffe0fc3.json,
#    docs/kernels.md.) 0c004f2 (one H200): step 1 as two jobs side by side on the one card, then the failures alone
#    (vllm_tests_h200_0c004f2_*.log).
set -uo pipefail
source benchmarks/vllm_gpu/env.sh
O=${JOB_OUT:-/tmp/qerl-b-out}
mkdir -p "$O"
nvidia-smi -L > "$O/gpu.txt"
step() { [[ " ${MACHINE_B_STEPS:-1 2 3 4} " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%T))"; }
if step 1; then
  say "1 vLLM tests: ${VLLM_TESTS:-tests/vllm_integration}"
  # shellcheck disable=SC2086  # VLLM_TESTS is a list of paths
  timeout -s INT "${VLLM_TESTS_S:-900}" python3 -m pytest ${VLLM_TESTS:-tests/vllm_integration} \
    -p no:cacheprovider -v -rA --durations=0 > "$O/${VLLM_TESTS_LOG:-vllm_tests}.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/${VLLM_TESTS_LOG:-vllm_tests}.log"
fi
if step 2; then
  for arm in ${OFFLINE_ARMS:-vllm::2 graph::2}; do
    IFS=: read -r engine is seed <<< "$arm"
    name=${engine}${is:+_$is}_seed$seed
    say "2 qerl train offline-default $name"
    extra=()
    [ "$engine" = vllm ] && extra=(--vllm '{"gpu_memory_utilization": 0.3}')
    [ "$is" = off ] && extra+=(--vllm_importance_sampling_correction false)
    [ -n "$is" ] && [ "$is" != off ] && extra+=(--vllm_importance_sampling_correction true --vllm_importance_sampling_mode "$is")
    /usr/bin/time -v -o "$O/train_$name.time" python3 -m qerl_trl train offline-default --max_steps 20 --seed "$seed" \
      --per_device_train_batch_size 32 --gradient_accumulation_steps 1 --save_steps 20 --save_total_limit 1 \
      --rollout_engine "$engine" --output_dir "$O/run_$name" "${extra[@]}" > "$O/train_$name.log" 2>&1
    echo "rc $?"; grep "qerl train:" "$O/train_$name.log" | tail -n 1
    rm -rf "$O/run_$name"/checkpoint-* "$O/run_$name/final"  # keep metrics and plots
  done
fi
# ~20 and ~25 min of a machine each: one GPU each, side by side on a two-GPU machine (README "Next session's
# machines": CUDA_VISIBLE_DEVICES and QERL_CACHE per job, so the two 32B checkpoints and engine caches stay apart)
for engine in vllm graph; do
  n=3 more=(--steps 2 --vllm-kv-gb 14); [ "$engine" = graph ] && n=4 more=(--steps 1)
  step $n || continue
  say "$n the 32B DAPO recipe on $engine"
  python3 benchmarks/grpo_step.py --models 32b --arms nvfp4 --rollout-engine "$engine" \
    --recipe bigmath-qwen2.5-32b-dapo --prompt-len 256 --lengths bigmath --warmup-steps 0 "${more[@]}" \
    --probe-tokens 256 --no-subprocess --out "$O/dapo_32b_$engine.json" > "$O/dapo_32b_$engine.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/dapo_32b_$engine.log"
done
if step 5; then  # issue #48: the whole `-m gpu` suite of the main tests once after the move (GPU_TESTS_S: its time)
  say "5 pytest -m gpu (the main tests)"
  timeout -s INT "${GPU_TESTS_S:-900}" python3 -m pytest -m gpu tests --ignore=tests/vllm_integration \
    -p no:cacheprovider -v -rfE --durations=15 > "$O/gpu_tests.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/gpu_tests.log"
fi
say "machine_b done"
