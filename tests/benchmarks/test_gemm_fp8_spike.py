"""``benchmarks/gemm.py --fp8`` (issue #51's FP8-rollout spike) end to end on the CPU: small shapes, the references
in place of the Triton kernels (no bf16 in the interpreter), one call per arm in place of the CUDA-graph timing.
What it checks is the plumbing the GPU run relies on: every arm is built and called, the errors are measured, the
layer rows sum the linears."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _gemm_module():
    spec = importlib.util.spec_from_file_location("gemm_bench_fp8", ROOT / "benchmarks" / "gemm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gemm_bench_fp8"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_fp8_spike_mode_runs_every_arm_on_the_cpu(monkeypatch, tmp_path):
    from nvfp4 import fp8, ops
    from nvfp4.kernels import fp8 as kfp8

    mod = _gemm_module()
    calls: list[int] = []

    def once(fns, *_, **__):
        for f in fns:
            f()
        calls.append(len(fns))
        return 1.0

    def act_quant_ref(x, mode="plain", norm_weight=None, eps=1e-6, residual=None, write_q=True, write_y=False,
                      residual_out=None):  # fmt: skip
        q, s, y, ro = fp8.act_quant_reference(x, mode, norm_weight, eps, residual)
        return (q if write_q else None, s if write_q else None, y if write_y else None, ro)

    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "ROTATE_BYTES", 1e5)
    monkeypatch.setattr(mod, "time_graph", once)
    monkeypatch.setattr(
        mod, "nvfp4_linear", lambda x, p, s, g, b=None, config=None: ops.linear_reference(x, p, s, g, b)
    )
    monkeypatch.setattr(kfp8, "act_quant", act_quant_ref)
    shapes = {"qkv": (192, 256), "o": (256, 256), "gate_up": (512, 256), "down": (256, 512)}
    monkeypatch.setattr(mod, "FP8_SHAPES", shapes)
    torch.manual_seed(0)
    res = mod.run_fp8([1, 3], tmp_path)
    rows, layer = res["fp8_spike"], res["layer"]
    assert len(rows) == 8 and len(layer) == 2 and len(calls) == 8 * len(mod.FP8_ARMS)
    for r in rows:
        assert all(f"{a}_ms" in r and f"{a}_x_bf16" in r for a in mod.FP8_ARMS), r
        assert 0.01 < r["fp8_err"] < 0.08 and 0.01 < r["fp8_pro_err"] < 0.08 and r["ours_err"] < 0.01, r
    assert all(lr["fp8_pro_ms"] == 4.0 and lr["fp8_pro_x_bf16"] == 1.0 for lr in layer)
    assert (tmp_path / "gemm_fp8_spike_partial.json").is_file()
