#!/usr/bin/env bash
# Run THERE (the device machine), from the repository root, in every install call (see README.md):
#     bash benchmarks/vllm_gpu/install.sh
# Each call carries one folder .carry/vllm/callN (or .carry/vllm-bench/callN) made by fetch.sh. This script copies what this call brought into
# /tmp/vllm_parts (kept between back-to-back calls while the machine stays warm); once the parts of every call are
# there it reassembles the split wheels, checks every sha256 against the manifest, installs all wheels with
# `pip install --no-index --no-deps --target /tmp/vllm_site`, registers qerl-vllm's vLLM plugin entry point (the
# package itself is imported from the working tree), and smoke-tests `import vllm` / `from vllm import LLM`.
# Idempotent: a finished install is kept (/tmp/vllm_site/.qerl-install-ok holds the manifest's hash). Exit code 0
# only once installed; 3 while parts of other calls are still to come (calls 1 to N-1: expected).
# Then: `source benchmarks/vllm_gpu/env.sh` in each later call on the same warm machine.
#
# Off the device (to check the script): INSTALL_PIP_ARGS adds pip arguments (e.g. --python-version 3.12 --platform
# manylinux_2_28_x86_64 --only-binary=:all: --implementation cp), INSTALL_SKIP_SMOKE=1 skips the import test,
# VLLM_PARTS / VLLM_SITE move the two folders.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel 2>/dev/null || (cd "$(dirname "$0")/../.." && pwd))"
PY=${PYTHON:-python3}
PARTS=${VLLM_PARTS:-/tmp/vllm_parts}
SITE=${VLLM_SITE:-/tmp/vllm_site}
t0=$(date +%s)

shopt -s nullglob
calls=(.carry/vllm/call*/ .carry/vllm-bench/call*/)
if [ ${#calls[@]} -eq 0 ] && [ ! -f "$PARTS/manifest.tsv" ]; then
  echo "install.sh: no .carry/vllm*/callN folder in this call and nothing in $PARTS: carry one (README.md)" >&2
  exit 1
fi
mkdir -p "$PARTS"
for d in "${calls[@]}"; do
  if [ -f "$PARTS/manifest.tsv" ] && ! cmp -s "$d/manifest.tsv" "$PARTS/manifest.tsv"; then
    echo "install.sh: $d comes from another fetch.sh run than the parts in $PARTS; starting over" >&2
    rm -rf "$PARTS" "$SITE"
    mkdir -p "$PARTS"
  fi
  cp -f "$d"/* "$PARTS/"
  echo "install.sh: copied $(basename "$d") ($(du -sm "$d" | cut -f1) MB) to $PARTS"
done

MANIFEST_SHA=$(sha256sum "$PARTS/manifest.tsv" | cut -d' ' -f1)
if [ -f "$SITE/.qerl-install-ok" ] && [ "$(cat "$SITE/.qerl-install-ok")" = "$MANIFEST_SHA" ]; then
  echo "install.sh: already installed in $SITE (this warm machine); source benchmarks/vllm_gpu/env.sh"
  exit 0
fi

# Which parts are still missing? (a fresh machine has lost the parts of earlier calls: start again from call 1)
# rc 3 until installed: the last call's `install.sh && ... bg.sh start ... && sleep N` stops where a part is missing
"$PY" - "$PARTS" <<'PY' || exit 3
import os, sys
parts = sys.argv[1]
rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(parts, "manifest.tsv")) if not l.startswith("#")]
missing = sorted({int(c) for name, sha, size, ps, cs in rows for p, c in zip(ps.split(","), cs.split(","))
                  if not os.path.exists(os.path.join(parts, p))})
have = sorted({int(c) for name, sha, size, ps, cs in rows for p, c in zip(ps.split(","), cs.split(","))
               if os.path.exists(os.path.join(parts, p))})
if missing:
    print(f"install.sh: this machine holds the parts of calls {have}; still to carry: "
          + ", ".join(f"call{c}" for c in missing)
          + " (back to back: the machine keeps /tmp only while warm)")
    sys.exit(1)
PY

# Reassemble and verify
WHOLE="$PARTS/whole"
rm -rf "$WHOLE"
mkdir -p "$WHOLE"
while IFS=$'\t' read -r name sha size parts calls_; do
  case "$name" in \#*) continue ;; esac
  IFS=',' read -r -a ps <<< "$parts"
  if [ ${#ps[@]} -eq 1 ] && [ "${ps[0]}" = "$name" ]; then
    ln -f "$PARTS/$name" "$WHOLE/$name"
  else
    (cd "$PARTS" && cat "${ps[@]}") > "$WHOLE/$name"
  fi
  got=$(sha256sum "$WHOLE/$name" | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then
    echo "install.sh: sha256 mismatch for $name ($got, manifest $sha): a part is damaged; carry its calls again" >&2
    exit 1
  fi
done < "$PARTS/manifest.tsv"
echo "install.sh: $(ls "$WHOLE" | wc -l) wheels reassembled and verified ($(du -sm "$WHOLE" | cut -f1) MB)"

# Install (no index, no dependency resolution: the list is complete for the image, see wheels.txt)
rm -rf "$SITE"
# shellcheck disable=SC2086
"$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
  --target "$SITE" ${INSTALL_PIP_ARGS:-} "$WHOLE"/*.whl
# qerl-vllm's plugin entry point (pyproject: vllm.general_plugins qerl_nvfp4 = qerl_vllm.plugin:register), so that
# every vLLM process, a server's too, registers nvfp4_w4a16; the code itself comes from integrations/vllm/src.
DI="$SITE/qerl_vllm-0.1.0.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: qerl-vllm\nVersion: 0.1.0\n' > "$DI/METADATA"
printf '[vllm.general_plugins]\nqerl_nvfp4 = qerl_vllm.plugin:register\n' > "$DI/entry_points.txt"
: > "$DI/RECORD"
echo "install.sh: installed into $SITE ($(du -sm "$SITE" | cut -f1) MB)"

if [ "${INSTALL_SKIP_SMOKE:-0}" != 1 ]; then
  export PYTHONPATH="$SITE:$PWD/packages/nvfp4/src:$PWD/packages/aqn/src:$PWD/packages/qerl-trl/src:$PWD/integrations/vllm/src${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import vllm; print('vllm', vllm.__version__)"
  "$PY" - <<'PY'
# `from vllm import LLM`, the plugin's entry point, and vllm's requirements against the image's versions (a report:
# pip installed --no-deps, so a version the image holds outside vllm's pin shows here, not as an install error)
import importlib.metadata as md
from packaging.requirements import Requirement
import torch
from vllm import LLM  # noqa: F401
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "qerl_nvfp4" in eps, eps
off = []
for r in md.requires("vllm") or []:
    req = Requirement(r)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        v = md.version(req.name)
    except md.PackageNotFoundError:
        off.append(f"{req.name} absent")
        continue
    if req.specifier and not req.specifier.contains(v, prereleases=True):
        off.append(f"{req.name} {v} (vllm wants {req.specifier})")
print(f"from vllm import LLM: ok; torch {torch.__version__}, cuda {torch.cuda.is_available()}; plugins {eps}")
print("vllm requirements not met as pinned (guarded imports / lean wheel, see wheels.txt):", "; ".join(off) or "none")
# Humming (rollout_vllm.py's vllm-nvfp4-humming arm): its modules and what its JIT needs, found without importing it
# (import humming starts background builds). A report: the arm skips itself, with the reason, where humming fails.
import glob, importlib.util, os, shutil, sysconfig
mods = []
for mod, dist in (("humming", "humming-kernels"), ("elftools", "pyelftools"), ("cuda.bindings", "cuda-bindings"),
                  ("cuda.pathfinder", "cuda-pathfinder"), ("pynvml", "nvidia-ml-py"), ("filelock", "filelock"),
                  ("jinja2", "jinja2"), ("tabulate", "tabulate")):
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        found = False
    try:
        v = md.version(dist)
    except md.PackageNotFoundError:
        v = "?"
    mods.append(f"{dist} {v}" if found else f"{dist} ABSENT")
inc = os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/include"
need = {h: os.path.exists(f"{inc}/{h}") or bool(glob.glob(f"{inc}/*/{h}"))
        for h in ("cuda.h", "nvrtc.h", "crt/host_defines.h", "cuda/std/cstdint")}
tools = {t: bool(shutil.which(t)) for t in ("g++", "ninja", "nvcc")}
tools["Python.h"] = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
print("install.sh: humming:", "; ".join(mods), "|", inc, need, "|", tools)
PY
fi
echo "$MANIFEST_SHA" > "$SITE/.qerl-install-ok"
echo "install.sh: done in $(( $(date +%s) - t0 )) s; in later calls on this warm machine: source benchmarks/vllm_gpu/env.sh"
