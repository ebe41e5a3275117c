#!/usr/bin/env bash
# THERE (the device machine), from the repository root, once install.sh finished on this warm machine (issue #47,
# item 6: the full rollout table from one machine):
#     bash benchmarks/vllm_gpu/rollout_table.sh start     # starts background jobs with bg.sh, returns at once
#     bash benchmarks/vllm_gpu/bg.sh wait 540              # in each later call, until "bg.sh: all jobs ended"
# 7B shapes (random weights), prompt 256, 256 new tokens, LoRA r = 32, B in {8, 32, 64, 128}; fixed lengths and
# --eos-mean-tokens 128 --min-new-tokens 32 (the same length distribution in both engines). Four runs:
#   vllm_fixed   rollout_vllm.py: builds the checkpoints first (~5 min on GPU), then vLLM bf16 + LoRA, NVFP4 + LoRA
#                stock Marlin, ours, stock Humming (linear_backend=humming), fixed lengths, 2 repeats
#   vllm_spread  the same four arms with spread lengths (waits for vllm_fixed's checkpoints)
#   graph_fixed  rollout.py --engine graph: bf16 + LoRA, NVFP4 + LoRA (ours), fixed lengths, 2 repeats
#   graph_spread the same with spread lengths
# One lane (a bg.sh job, CUDA_VISIBLE_DEVICES = its GPU) per GPU, up to 4: on nvidia-h100-x4 each run has a GPU of
# its own and all four run at once (~18-23 min, the vLLM spread run last); with fewer GPUs lane i % n runs them
# one after another (1 GPU: ~50 min, more than one 30-minute machine). Arm ratios are only taken within one run (one
# GPU); the engines' rows come from different GPUs of the same host.
# Every run stops starting arms when the lane's time budget (TABLE_BUDGET_S, default 1380 s from `start`) minus one
# arm's timeout has passed, so the machine ends inside its 30 minutes; what ran is in the JSONs. Results and logs:
# /tmp/qerl-bg/laneN/<run>.json and .log (bg.sh wait packs them into $OUT/bg.tgz).
# Off the device (to check the script): TABLE_TINY=1 (tiny model, CPU), PYTHON=<python with vllm>, TABLE_NO_ENV=1.
set -uo pipefail
HERE=benchmarks/vllm_gpu
BG=/tmp/qerl-bg
# lane i % n takes RUNS[i]: the two long ones first; TABLE_RUNS="..." runs a part (one GPU: two machines' worth)
read -ra RUNS <<< "${TABLE_RUNS:-vllm_fixed graph_spread graph_fixed vllm_spread}"

case "${1:-}" in
  start)
    n=0
    command -v nvidia-smi > /dev/null && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    lanes=$(( n < 1 ? 1 : (n > 4 ? 4 : n) ))
    t0=$(date +%s)
    rm -f "$BG/ckpt.ok" "$BG/ckpt.failed"
    for ((l = 0; l < lanes; l++)); do
      gpu=""
      [ "$n" -ge 1 ] && gpu="CUDA_VISIBLE_DEVICES=$l"
      bash "$HERE/bg.sh" start "lane$l" "$gpu TABLE_T0=$t0 bash $HERE/rollout_table.sh lane $l $lanes"
    done
    echo "rollout_table.sh: $lanes lane(s) for ${#RUNS[@]} runs ($n GPUs); poll with: bash $HERE/bg.sh wait 540"
    ;;
  lane)
    lane=$2 lanes=$3
    [ "${TABLE_NO_ENV:-0}" = 1 ] || source "$HERE/env.sh" || exit 1
    P=${PYTHON:-python3}
    O=${JOB_OUT:-/tmp/qerl-table-out}
    mkdir -p "$O"
    T0=${TABLE_T0:-$(date +%s)}
    BUDGET=${TABLE_BUDGET_S:-1380}
    if [ "${TABLE_TINY:-0}" = 1 ]; then
      M=tiny SIZE=(--batch 2 --prompt-len 8 --new-tokens 16) SPREAD=(--eos-mean-tokens 8 --min-new-tokens 4)
      VMODEL=(--tiny) GMODEL=(--tiny --no-compile) VT=300 GT=300
    else
      M=7b SIZE=(--batch 8,32,64,128 --prompt-len 256 --new-tokens 256)
      SPREAD=(--eos-mean-tokens 128 --min-new-tokens 32)
      VMODEL=(--models 7b) GMODEL=(--models 7b) VT=360 GT=420  # arm timeouts: vLLM init + Humming's JIT; graph compiles
    fi
    VARMS=vllm-bf16,vllm-nvfp4-marlin,vllm-nvfp4,vllm-nvfp4-humming
    [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && nvidia-smi -L > "$O/gpu.txt" 2>&1
    deadline() {  # seconds from now after which the run starts no new arm (0: no time left for one arm)
      local d=$(( BUDGET - ($(date +%s) - T0) - $1 ))
      echo $(( d > 0 ? d : 0 ))
    }
    for ((i = lane; i < ${#RUNS[@]}; i += lanes)); do
      run=${RUNS[$i]}
      echo "== $run ($(date -u +%T), lane $lane, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-})"
      case "$run" in
        vllm_*)
          if [ "$run" = vllm_fixed ] || [[ " ${RUNS[*]} " != *" vllm_fixed "* ]]; then  # this run builds them
            if $P benchmarks/rollout_vllm.py "${VMODEL[@]}" --build-only > "$O/build.log" 2>&1; then
              touch "$BG/ckpt.ok"
            else
              touch "$BG/ckpt.failed"; echo "checkpoint build failed: $O/build.log"; tail -n 20 "$O/build.log"; continue
            fi
          else
            while [ ! -e "$BG/ckpt.ok" ] && [ ! -e "$BG/ckpt.failed" ]; do sleep 5; done
            [ -e "$BG/ckpt.ok" ] || { echo "no checkpoints (vllm_fixed's build failed)"; continue; }
          fi
          extra=(--repeats 2)
          [ "$run" = vllm_spread ] && extra+=("${SPREAD[@]}")
          d=$(deadline "$VT")
          [ "$d" -gt 0 ] || { echo "skipped: no time left in the lane's budget"; continue; }
          $P benchmarks/rollout_vllm.py "${VMODEL[@]}" --arms "$VARMS" "${SIZE[@]}" "${extra[@]}" --arm-timeout "$VT" \
            --deadline-s "$d" --out "$O/rollout_vllm_${M}_${run#vllm_}.json" > "$O/$run.log" 2>&1
          ;;
        graph_*)
          extra=(--repeats 2)
          [ "$run" = graph_spread ] && extra=(--repeats 2 --spread-warmups 1 "${SPREAD[@]}")
          d=$(deadline "$GT")
          [ "$d" -gt 0 ] || { echo "skipped: no time left in the lane's budget"; continue; }
          $P benchmarks/rollout.py "${GMODEL[@]}" --arms bf16,nvfp4 --engine graph "${SIZE[@]}" "${extra[@]}" \
            --arm-timeout "$GT" --deadline-s "$d" --out "$O/rollout_graph_${M}_${run#graph_}.json" > "$O/$run.log" 2>&1
          ;;
      esac
      echo "rc $? ($(date -u +%T))"; tail -n 12 "$O/$run.log"
    done
    ;;
  *) echo "usage: bash $HERE/rollout_table.sh start" >&2; exit 2 ;;
esac
