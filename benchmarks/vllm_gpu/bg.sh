#!/usr/bin/env bash
# THERE (the device machine), from the repository root: jobs that outlive one 10-minute command.
#     bash benchmarks/vllm_gpu/bg.sh start NAME 'COMMAND'   # COMMAND runs detached (setsid) in a copy of this tree
#     bash benchmarks/vllm_gpu/bg.sh wait MAX_S             # until every job has ended or MAX_S passed; then the
#                                                           # logs and result files go to $OUT/bg.tgz
# A job's COMMAND runs in /tmp/qerl-tree-NAME (a copy taken at start: the device refreshes the checkout between calls)
# with $JOB_OUT=/tmp/qerl-bg/NAME for its files; its output goes to /tmp/qerl-bg/NAME.log, its exit code to NAME.rc.
# /tmp lives only while the machine stays warm: send the next call within 30 s of the last.
set -uo pipefail
BG=/tmp/qerl-bg
mkdir -p "$BG"
case "${1:-}" in
  start)
    name=$2 cmd=$3
    tree=/tmp/qerl-tree-$name
    rm -rf "$tree" "$BG/$name" "$BG/$name.rc" && mkdir -p "$tree" "$BG/$name"
    tar --exclude=./.carry --exclude=./.git -cf - . | tar -xf - -C "$tree"
    # the copy has no .git: the JSONs name their commit through $QERL_COMMIT (benchmarks/common/env.py), "+dirty" when
    # the tree differs from it
    commit=$(git rev-parse --short=7 HEAD 2>/dev/null || echo unknown)
    [ -n "$(git status --porcelain 2>/dev/null)" ] && commit="$commit+dirty"
    QERL_COMMIT=${QERL_COMMIT:-$commit} JOB_OUT="$BG/$name" setsid nohup bash -c "cd '$tree' && ( $cmd ); echo \$? > '$BG/$name.rc'" \
      > "$BG/$name.log" 2>&1 < /dev/null &
    echo "bg.sh: started $name (pid $!) in $tree at $commit; log $BG/$name.log"
    ;;
  wait)
    max=${2:-540} t0=$(date +%s)
    while :; do
      running=$(for l in "$BG"/*.log; do [ -e "$l" ] && [ ! -e "${l%.log}.rc" ] && basename "${l%.log}"; done)
      [ -z "$running" ] && break
      [ $(( $(date +%s) - t0 )) -ge "$max" ] && break
      sleep 5
    done
    for l in "$BG"/*.log; do
      [ -e "$l" ] || continue
      n=$(basename "${l%.log}")
      echo "=== $n: $( [ -e "$BG/$n.rc" ] && echo "ended, rc $(cat "$BG/$n.rc")" || echo running ) ==="
      tail -n 25 "$l"
    done
    # weights stay behind (16 MiB a file comes back): their list does not
    (cd "$BG" && find . -type f -printf '%10s %p\n' | sort -k2) > "$BG/files.txt"
    [ -n "${OUT:-}" ] && tar -czf "$OUT/bg.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
      --exclude='*.gguf' -C "$BG" . && echo "bg.sh: $(du -h "$OUT/bg.tgz" | cut -f1) to \$OUT/bg.tgz"
    [ -z "$running" ] && echo "bg.sh: all jobs ended" || echo "bg.sh: still running: $running"
    ;;
  *) echo "usage: bg.sh start NAME 'COMMAND' | bg.sh wait MAX_S" >&2; exit 2 ;;
esac
