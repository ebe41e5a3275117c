#!/usr/bin/env bash
# THERE, with no vLLM install: one call carrying .carry/kern (HERE: `bash benchmarks/vllm_gpu/fetch.sh --kernels`),
#     source benchmarks/vllm_gpu/kernels_env.sh && bash benchmarks/vllm_gpu/bg.sh start k \
#       'KERNEL_STEPS="1 2 3" bash benchmarks/vllm_gpu/kernels_job.sh'        # ~12 min; then bg.sh wait
# (kernels_env.sh installs from .carry/kern before the job starts: bg.sh's copy of the tree leaves .carry out.)
# One step after another, each under a timeout, files under $JOB_OUT:
# 1. issue #50 round 15: step A and step B's GPU tests (its timing, `gemm.py --round15`, left with the round's
#    decision: benchmarks/gemm.py@a4371b5);
# 2. the scale order's landing (stage 1: NVFP4_SCALE_MMA_LAYOUT): its GPU tests, the kernel tests with the switch on,
#    then `gemm.py --scale-pairs --peer-humming` on the 7B layer (every form, forward and dgrad, both scale orders on
#    the same weights, Humming 0.1.19 beside: step A dispatched against Humming on the whole layer);
# 3. issue #51: the graph engine's sampling-logprobs test, both arms;
# 4. the scale order's landing: the graph engine (7B NVFP4 + LoRA, B = 8 / 32 / 128) with the switch off, then on.
set -uo pipefail
source benchmarks/vllm_gpu/kernels_env.sh
O=${JOB_OUT:-/tmp/qerl-k-out}
mkdir -p "$O"
nvidia-smi -L > "$O/gpu.txt"
step() { [[ " ${KERNEL_STEPS:-1 2 3} " == *" $1 "* ]]; }
say() { echo "== $* ($(date -u +%T))"; }
tests() {  # tests LOG SECONDS PYTEST_ARGS...: verbose, under SIGINT so that pytest prints its summary when time is up
  local log=$1 s=$2
  shift 2
  timeout -s INT "$s" python3 -m pytest "$@" -m gpu -p no:cacheprovider -v -rA > "$O/$log.log" 2>&1
  echo "rc $?"; tail -n 3 "$O/$log.log"
}
if step 1; then
  say "1 round 15 tests"
  tests round15_tests 240 tests/nvfp4/test_hopper_ws.py -k round15
fi
if step 2; then
  say "2 scale order: tests with NVFP4_SCALE_MMA_LAYOUT=1"
  # SCALE_ORDER_TESTS: the files still to run when an earlier machine ended part way
  # shellcheck disable=SC2086
  NVFP4_SCALE_MMA_LAYOUT=1 tests scale_order_tests 420 ${SCALE_ORDER_TESTS:-tests/nvfp4/test_scale_mma_layout.py \
    tests/nvfp4/test_kernels.py tests/nvfp4/test_hopper_ws.py tests/nvfp4/test_linear.py}
  models=${SCALE_PAIRS_MODELS:-Qwen2.5-7B}  # 7B ran on the H100 at 4e1d05a; next: Qwen2.5-14B,Qwen2.5-32B
  say "2 gemm.py --scale-pairs, $models"
  mkdir -p "$O/scale_pairs"  # gemm.py writes its partial JSON there (a missing folder ended the 4e1d05a run's first try)
  # SCALE_PAIRS_S: 480 s held the 7B (132 s at 4e1d05a); three models want more
  timeout "${SCALE_PAIRS_S:-480}" python3 benchmarks/gemm.py --scale-pairs --compare-lora --no-mxfp4 --peer-humming --models "$models" \
    --out "$O/scale_pairs" > "$O/gemm_scale_pairs.log" 2>&1
  echo "rc $?"; grep -A12 "whole decoder layer" "$O/gemm_scale_pairs.log" | head -n 30
fi
if step 3; then
  say "3 sampling logprobs"
  tests logprobs_tests 240 tests/qerl_trl/test_graph_generate.py -k sampling_logprobs
fi
if step 4; then  # stage 2 of landing step A: the graph engine (7B NVFP4 + LoRA, fixed lengths) with the switch off, then on
  for on in 0 1; do
    say "4 rollout.py, graph engine, NVFP4_SCALE_MMA_LAYOUT=$on"
    NVFP4_SCALE_MMA_LAYOUT=$on timeout 330 python3 benchmarks/rollout.py --engine graph --models 7b --arms nvfp4 \
      --batch 8,32,128 --prompt-len 256 --new-tokens 256 --out "$O/rollout_scale_order_$on.json" \
      > "$O/rollout_scale_order_$on.log" 2>&1
    echo "rc $?"; tail -n 8 "$O/rollout_scale_order_$on.log"
  done
fi
say done
