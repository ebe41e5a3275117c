"""Dump the SASS (nvdisasm -c -g: with source lines) of hopper_ws configs compiled for sm_90a without a GPU
(round 15, issue #50).

    uv run python docs/scripts/ours_sass.py OUTDIR 64,2,12,2 128,2,8,2 64,2,12,2,1 128,2,8,2,1

(every config in round 15 step A's scale order, the kernel's only one since stage 2's end; a 6th field, which chose
step A before, is read and ignored; a 7th field 1: step B on top of it, ``inflight=True``, e.g. 64,2,12,2,0,1,1) writes OUTDIR/ours_<config>.{cubin,sass}; then ``python docs/scripts/sass_loop_counts.py OUTDIR/ours_64_2_12_2.sass
--groups 64`` counts the consumer's mainloop (64 decoded weights per thread per unit of SUB=2 stages, TC=1 tile).
"""

import subprocess
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "nvfp4" / "src"))
from nvfp4.kernels import hopper_ws  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for c in sys.argv[2:]:
    bm, t, st, sub, *fx = map(int, c.split(","))
    comp = hopper_ws.compile_sm90(bm, t, st, sub, bool(fx and fx[0]), inflight=len(fx) > 2 and bool(fx[2]))
    tag = c.replace(",", "_")
    (out / f"ours_{tag}.cubin").write_bytes(comp.asm["cubin"])
    sass = subprocess.run([BIN / "nvdisasm", "-c", "-g", out / f"ours_{tag}.cubin"], capture_output=True, text=True)
    (out / f"ours_{tag}.sass").write_text(sass.stdout)
    print(c, "shared", comp.metadata.shared, "B", flush=True)
