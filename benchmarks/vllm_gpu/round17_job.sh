#!/usr/bin/env bash
# THERE, as a bg.sh job after `source benchmarks/vllm_gpu/kernels_env.sh` (carry .carry/kern), alone on the card:
# issue #50 round 17 (docs/kernels.md): the turn-taking consumers' GPU tests, then the 7B table with --rounds beside
# Humming 0.1.19 (the pingpong arms only if their tests passed: a hung turn would hang the table), then the ncu of
# the tall tile and the pingpong forms beside ours at M = 1024. WAIT_FOR=<job>: start once that bg.sh job has ended.
set -u
O=${JOB_OUT:-/tmp/round17}
mkdir -p "$O"
[ -n "${WAIT_FOR:-}" ] && while [ ! -e "/tmp/qerl-bg/$WAIT_FOR.rc" ]; do sleep 3; done
echo "== tests ($(date -u +%T))"
timeout 420 python3 -m pytest -q -m gpu tests/nvfp4/test_hopper_ws.py -k round17 -rfE -p no:cacheprovider \
  > "$O/tests.log" 2>&1
r=$?; echo "tests rc $r"; tail -n 3 "$O/tests.log"
PP=(); [ "$r" = 0 ] && PP=(--pingpong 1,2)
echo "== gemm ($(date -u +%T))"
timeout 900 python3 benchmarks/gemm.py --ws "${PP[@]}" --peer-humming --no-mxfp4 --bwd-ms= \
  --ms "${GEMM_MS:-64,128,256,512,1024,2048}" --models "${GEMM_MODELS:-Qwen2.5-7B}" --out "$O/gemm" > "$O/gemm.log" 2>&1
echo "gemm rc $?"
echo "== ncu ($(date -u +%T))"
timeout 300 ncu --nvtx --nvtx-include "prof/" --set full --import-source no --csv --page raw --log-file "$O/ncu.csv" \
  python3 docs/scripts/ncu_ws_vs_humming.py --ms 1024 --tall "${PP[@]}" > "$O/ncu.log" 2>&1
echo "ncu rc $? ($(date -u +%T))"
