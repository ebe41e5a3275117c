"""Reproduce Humming 0.1.19's Hopper NVFP4 W4A16 kernel source on a machine without a GPU (round 15, issue #50).

Usage (the wheel unzipped into /tmp/h19src; torch, jinja2, filelock from the project's venv; nothing is installed):

    PYTHONPATH=/tmp/h19src uv run python docs/scripts/humming_sass.py OUTDIR

Humming's device query (a compiled extension) is replaced *in this process only* by an H200's numbers; its own
tuner (``get_heuristics_config``) picks the config for the 7B gate/down at M = 64 and 128, and its ``HummingKernel``
renders the CUDA source, whose NVRTC/NVCC compile is intercepted: the source, the kernel expression and the flags
are written to OUTDIR/<name>/ and compiled there with nvcc -arch=sm_90a -cubin (its own NVCC flags).
"""

import contextlib
import json
import os
import subprocess
import sys
import types

import torch

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/sass/h19"

FAKE = dict(index=0, name="NVIDIA H200", is_ppu=False, sm_count=132, max_threads_per_block=1024,
            max_threads_per_sm=2048, max_registers_per_sm=65536, sm_major=9, sm_minor=0, sm_version=90,
            l2_cache_size=50 * 2**20, l2_cache_size_mb=50.0, l1_cache_size=256 * 1024, l1_cache_size_kb=256.0,
            default_smem_size=48 * 1024, max_smem_size=227 * 1024, max_smem_size_kb=227.0, memory_clock_khz=3_200_000,
            memory_bus_width=6144, sm_clock_khz=1_980_000, memory_bandwidth_gbps=4800.0, tensorcore_tops=989.0)

torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
torch.cuda.current_device = lambda: 0

import humming.device as hdev  # noqa: E402

_fake_ext = types.SimpleNamespace(_DeviceInfo=lambda index: types.SimpleNamespace(**FAKE, print=lambda: None))
hdev._get_device_info_extension = lambda: _fake_ext
hdev.get_device_index = lambda device=None: 0
for name in list(sys.modules):
    if name.startswith("humming"):
        m = sys.modules[name]
        if hasattr(m, "get_device_index"):
            m.get_device_index = hdev.get_device_index

from humming.jit.compiler import NVCCCompiler  # noqa: E402
from humming.kernel.humming import HummingKernel  # noqa: E402
from humming.schema import BaseWeightSchema  # noqa: E402
from humming.transform import prepare_layer_config  # noqa: E402
from humming.tune import get_heuristics_config  # noqa: E402

CAPTURED = {}


def fake_compile(cls, code, sm_version, kernel_expr, disable_fast_math=False, postprocess_cubin=None):
    CAPTURED.update(code=code, sm_version=sm_version, kernel_expr=kernel_expr,
                    flags=NVCCCompiler.get_flags(sm_version, disable_fast_math))
    return "/dev/null"


for c in (NVCCCompiler, sys.modules["humming.jit.compiler"].NVRTCCompiler):
    c.compile = classmethod(fake_compile)
HummingKernel.register_kernel = lambda self: None

# the weight config of benchmarks/gemm.py's humming_layers (Humming >= 0.1.19), resolved as HummingLayer does
schema = BaseWeightSchema.from_config(dict(quant_method="humming", b_dtype="float4e2m1", bs_dtype="float8e4m3",
                                           group_size=16, scale_type="group", scale_2_type="tensor"))
for lname, (n, k) in {"gate": (18944, 3584), "down": (3584, 18944)}.items():
    lc = prepare_layer_config(shape_n=n, shape_k=k, weight_schema=schema, torch_dtype=torch.bfloat16, device=0)
    for m in (64, 128):
        tuning = get_heuristics_config(lc, shape_m=m, device=0)
        # as HummingKernel.prepare_kernels: layer config (its JSON string) | tuning config, num_sms dropped
        cfg = json.loads(lc.to_str()) | {kk: v for kk, v in tuning.items() if kk != "num_sms"}
        CAPTURED.clear()
        HummingKernel._instances.clear()
        HummingKernel(**cfg)  # renders the source; its compile is the fake_compile above
        d = os.path.join(OUT, f"{lname}_m{m}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "kernel.cu"), "w") as f:
            f.write(CAPTURED["code"])
            # what NVCCCompiler._compile appends to instantiate the kernel
            f.write(f"\nauto ptr = reinterpret_cast<void*>(&{CAPTURED['kernel_expr']});\n")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(dict(tuning=tuning, kernel_expr=CAPTURED["kernel_expr"], flags=CAPTURED["flags"],
                           sm=CAPTURED["sm_version"]), f, indent=1, default=str)
        print(lname, m, json.dumps(tuning, default=str), flush=True)
        cmd = ["nvcc", os.path.join(d, "kernel.cu"), "-o", os.path.join(d, "kernel.cubin")] + CAPTURED["flags"]
        r = subprocess.run(cmd + ["--resource-usage", "-lineinfo"], capture_output=True, text=True)
        regs = [ln.strip() for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln]
        print(f"  nvcc rc={r.returncode}", *regs, sep="\n  ", flush=True)
