#!/usr/bin/env bash
# Run HERE (a machine with the package registry), from anywhere in the checkout:
#     bash benchmarks/vllm_gpu/fetch.sh [--full] [--bench]
# Downloads the cp312 manylinux x86_64 wheels of benchmarks/vllm_gpu/wheels.txt into .carry/vllm/dl (gitignored),
# makes the vllm wheel lean (unless --full: see wheels.txt), splits every file larger than one call's budget into
# numbered parts, and packs files and parts into call folders .carry/vllm/callN, each at most one call's budget, with
# a manifest (sha256 of every whole file, its parts and their calls) in every call folder.
#
# One call's budget: the device takes 64 MiB per call, working tree included, so a call folder holds
#     64 MiB - (tracked + untracked-not-ignored files of this checkout) - CALL_MARGIN_MIB (default 3)
# (override with CALL_BUDGET_MIB). The device machine: `bash benchmarks/vllm_gpu/install.sh` in every call (README.md).
#   --full   the vllm wheel as published (304 MB: 3 more calls)
#   --bench  only what the engine and the benchmarks need (no wheel of wheels.txt's "tests" section: no trl, no
#            offline default model), into .carry/vllm-bench: fewer calls for a machine that only measures
#   --kernels  no vLLM: Humming 0.1.19 (the newest; its only need the image lacks is pyelftools) and pytest's wheels,
#            2.5 MB into .carry/kern, carried beside the tree in ONE call: kernel tests and gemm.py's peer column
#            without the 5 install calls (THERE: `source benchmarks/vllm_gpu/kernels_env.sh`)
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
HERE=benchmarks/vllm_gpu
OUT=.carry/vllm
LEAN=1
BENCH=0
for arg in "$@"; do
  case "$arg" in
    --full) LEAN=0 ;;
    --bench) BENCH=1; OUT=.carry/vllm-bench ;;
    --kernels) OUT=.carry/kern ;;
    *) echo "usage: bash $HERE/fetch.sh [--full] [--bench] [--kernels]" >&2; exit 2 ;;
  esac
done
if [ "$OUT" = .carry/kern ]; then
  rm -rf "$OUT" && mkdir -p "$OUT"
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform any -d "$OUT" humming-kernels==0.1.19 \
    pyelftools==0.33 pytest pluggy iniconfig pygments packaging 2> >(grep -v "is ignored: it is neither" >&2)
  du -sh "$OUT" && exit 0
fi
git check-ignore -q "$OUT/x" || { echo "fetch.sh: $OUT is not gitignored; it must never be committed" >&2; exit 1; }

# --- 1. download (one version of each; pip skips files already in dl/) ---------------------------------------------
mkdir -p "$OUT/dl"
REQS=$(mktemp)
trap 'rm -f "$REQS"' EXIT
if [ "$BENCH" = 1 ]; then  # up to the "# --- tests" section
  sed -n '/^# --- tests/q;p' "$HERE/wheels.txt"
else
  cat "$HERE/wheels.txt"
fi | sed -e 's/#.*//' -e 's/[[:space:]]//g' | grep -v '^$' > "$REQS"
PLATFORMS=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 5 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done  # the image is glibc 2.39 (Ubuntu 24.04)
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$OUT/dl" -r "$REQS" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

# exactly the listed versions, one file each
python3 - "$REQS" "$OUT/dl" <<'PY'
import os, re, sys
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = dict(l.strip().split("==") for l in open(sys.argv[1]) if l.strip())
want = {norm(k): v for k, v in want.items()}
have = {}
for f in os.listdir(sys.argv[2]):
    if f.endswith(".whl"):
        name, version = f.split("-")[:2]
        have.setdefault(norm(name), []).append((version, f))
stale = [f for n, fs in have.items() for v, f in fs if want.get(n) != v]
for f in stale:  # an older wheels.txt's download: not carried
    os.remove(os.path.join(sys.argv[2], f))
for n, fs in have.items():  # two platform tags of one version (an earlier download): keep one, pip takes one
    for v, f in sorted(f for f in fs if want.get(n) == f[0])[1:]:
        os.remove(os.path.join(sys.argv[2], f))
missing = [n for n in want if not any(v == want[n] for v, _ in have.get(n, []))]
if missing:
    sys.exit(f"fetch.sh: no wheel downloaded for {missing}")
PY

# --- 2. the lean wheels --------------------------------------------------------------------------------------------
rm -rf "$OUT/stage" "$OUT"/call*
mkdir -p "$OUT/stage"
for f in "$OUT"/dl/*.whl; do ln "$f" "$OUT/stage/"; done

lean() {  # lean WHEEL PATTERN...: a copy of WHEEL without the files PATTERN matches, its RECORD to match
  local whl=$1 rec tmp
  shift
  rm "$OUT/stage/$whl"
  cp "$OUT/dl/$whl" "$OUT/stage/$whl"
  zip -q -d "$OUT/stage/$whl" "$@"
  # RECORD lists every file with its hash: drop the removed ones so that pip's view matches the archive
  rec=$(unzip -Z1 "$OUT/stage/$whl" | grep '\.dist-info/RECORD$')
  tmp=$(mktemp -d)
  unzip -q -o "$OUT/stage/$whl" "$rec" -d "$tmp"
  python3 - "$tmp/$rec" "$@" <<'PY'
import csv, fnmatch, io, sys
path, pats = sys.argv[1], sys.argv[2:]
rows = [r for r in csv.reader(open(path, newline="")) if not any(fnmatch.fnmatch(r[0], p) for p in pats)]
buf = io.StringIO()
csv.writer(buf, lineterminator="\n").writerows(rows)
open(path, "w", newline="").write(buf.getvalue())
PY
  (cd "$tmp" && zip -q -X "$OLDPWD/$OUT/stage/$whl" "$rec")
  rm -rf "$tmp"
}

if [ "$LEAN" = 1 ]; then
  # binaries an sm90 (H100/H200) dense-model run never loads: vllm imports each inside try/except ImportError
  lean "$(cd "$OUT/stage" && ls vllm-*.whl)" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
    'vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/vllm-rs' 'vllm/third_party/deep_gemm/_C.cpython-310-*' \
    'vllm/third_party/deep_gemm/_C.cpython-311-*' 'vllm/third_party/deep_gemm/_C.cpython-313-*' \
    'vllm/third_party/deep_gemm/_C.cpython-314-*' 'vllm/third_party/fmha_sm100/*'
fi
BNB=$(cd "$OUT/stage" && ls bitsandbytes-*.whl 2>/dev/null || true)
if [ -n "$BNB" ]; then
  # the image's torch is cu130: bitsandbytes loads libbitsandbytes_cuda130.so only (43 MB -> 3.6 MB)
  lean "$BNB" 'bitsandbytes/libbitsandbytes_rocm*' 'bitsandbytes/libbitsandbytes_xpu*' \
    'bitsandbytes/libbitsandbytes_cuda1[12]*' 'bitsandbytes/libbitsandbytes_cuda132.so'
fi

# --- 3. one call's budget ------------------------------------------------------------------------------------------
TREE=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null \
        | awk '{s += $1} END {print s + 0}')
if [ -d shared ]; then TREE=$((TREE + $(du -sb shared | cut -f1))); fi
MIB=$((1024 * 1024))
if [ -n "${CALL_BUDGET_MIB:-}" ]; then
  BUDGET=$((CALL_BUDGET_MIB * MIB))
else
  BUDGET=$((64 * MIB - TREE - ${CALL_MARGIN_MIB:-3} * MIB))
fi
[ "$BUDGET" -gt $((8 * MIB)) ] || { echo "fetch.sh: the working tree ($TREE bytes) leaves no room in a call" >&2; exit 1; }

# --- 4. split, pack into calls, manifest ---------------------------------------------------------------------------
python3 - "$OUT" "$BUDGET" "$TREE" "$LEAN" <<'PY'
import hashlib, os, sys
out, budget, tree, lean = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
stage = os.path.join(out, "stage")

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

files, pieces = [], []  # pieces: (size, piece name, whole file)
for name in sorted(os.listdir(stage)):
    path = os.path.join(stage, name)
    size = os.path.getsize(path)
    files.append((name, size, sha256(path)))
    if size <= budget:
        pieces.append((size, name, name))
        continue
    with open(path, "rb") as f:  # split -b BUDGET -d: name.part-00, name.part-01, ...
        for i, block in enumerate(iter(lambda: f.read(budget), b"")):
            part = f"{name}.part-{i:02d}"
            with open(os.path.join(stage, part), "wb") as g:
                g.write(block)
            pieces.append((len(block), part, name))
    os.remove(path)

calls: list[list[tuple[int, str, str]]] = []  # first-fit decreasing
for piece in sorted(pieces, key=lambda p: (-p[0], p[1])):
    for call in calls:
        if sum(p[0] for p in call) + piece[0] <= budget:
            call.append(piece)
            break
    else:
        calls.append([piece])
where = {}
for i, call in enumerate(calls, 1):
    d = os.path.join(out, f"call{i}")
    os.makedirs(d)
    for _, piece, _ in call:
        os.link(os.path.join(stage, piece), os.path.join(d, piece))
        where[piece] = i
lines = [f"# {len(calls)} calls; budget {budget} bytes a call; working tree {tree} bytes; lean vllm: {lean}",
         "# file\tsha256\tbytes\tparts (in order)\tcalls"]
for name, size, digest in files:
    parts = sorted(p for _, p, w in pieces if w == name)
    lines.append(f"{name}\t{digest}\t{size}\t{','.join(parts)}\t{','.join(str(where[p]) for p in parts)}")
manifest = "\n".join(lines) + "\n"
for i in range(1, len(calls) + 1):
    with open(os.path.join(out, f"call{i}", "manifest.tsv"), "w") as f:
        f.write(manifest)
total = sum(s for s, _, _ in pieces)
print(f"{len(files)} wheels, {total / 1e6:.1f} MB in {len(calls)} calls of at most {budget / 2**20:.1f} MiB "
      f"(working tree {tree / 2**20:.1f} MiB)")
for i, call in enumerate(calls, 1):
    print(f"  call{i}: {sum(p[0] for p in call) / 1e6:6.1f} MB  {', '.join(p[1] for p in call)}")
print(f"device time for the install: about {len(calls)} x 60-90 s = {len(calls)} to {len(calls) * 1.5:g} min "
      "(the last call also installs: ~1 min more)")
PY
rm -rf "$OUT/stage"
