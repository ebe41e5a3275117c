#!/usr/bin/env bash
# THERE, with no vLLM install: one call carrying .carry/kern (HERE: `bash benchmarks/vllm_gpu/fetch.sh --kernels`),
#     source benchmarks/vllm_gpu/kernels_env.sh && bash benchmarks/vllm_gpu/bg.sh start k \
#       'KERNEL_STEPS="1 3" bash benchmarks/vllm_gpu/kernels_job.sh'        # then bg.sh wait
# (kernels_env.sh installs from .carry/kern before the job starts: bg.sh's copy of the tree leaves .carry out.)
# One step after another, each under a timeout, files under $JOB_OUT:
# 1. issue #50 round 15: step A and step B's GPU tests (its timing, `gemm.py --round15`, left with the round's
#    decision: benchmarks/gemm.py@a4371b5);
# 3. issue #51: the graph engine's sampling-logprobs test, both arms.
# (Steps 2 and 4, the scale order's landing with NVFP4_SCALE_MMA_LAYOUT off and on and `gemm.py --scale-pairs`, left at
# stage 2's end with the switch: benchmarks/vllm_gpu/kernels_job.sh@6ee5805.)
set -uo pipefail
source benchmarks/vllm_gpu/kernels_env.sh
O=${JOB_OUT:-/tmp/qerl-k-out}
mkdir -p "$O"
nvidia-smi -L > "$O/gpu.txt"
step() { [[ " ${KERNEL_STEPS:-1 3} " == *" $1 "* ]]; }
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
if step 3; then
  say "3 sampling logprobs"
  tests logprobs_tests 240 tests/qerl_trl/test_graph_generate.py -k sampling_logprobs
fi
say done
