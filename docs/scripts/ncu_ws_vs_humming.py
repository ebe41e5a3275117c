"""One launch of each form on the 7B gate and down inside an NVTX range ``prof``, warmed up outside it, for ncu: our
ws tile ``(256, 2, 3, 1)``, dequantize + cuBLAS, bf16 cuBLAS and Humming (whichever ``humming-kernels`` imports);
docs/kernels.md round 16's next step (issue #50: what bounds both W4A16 kernels at ~0.86x bf16 at M = 1024 when
L2 -> SM bytes do not).

    ncu --nvtx --nvtx-include "prof/" --set full --import-source no --csv --page raw \
        --log-file $JOB_OUT/ncu_ws_vs_humming.csv python3 docs/scripts/ncu_ws_vs_humming.py --ms 1024

Prints the launch order (shape, M, form) so that the CSV's kernels (one or two per form: dequantize + cuBLAS is two)
can be told apart; round 10's ``benchmarks/results/gemm_ws_ncu.json`` holds the metrics read then.
"""

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gemm  # noqa: E402  (benchmarks/gemm.py: its weights, Humming's layers, the ws config)
from nvfp4.kernels import LinearConfig, nvfp4_linear  # noqa: E402

SHAPES = {"gate": (18944, 3584), "down": (3584, 18944)}  # Qwen2.5-7B, (N, K)


def weights(n: int, k: int) -> tuple:
    """``(NVFP4 tensors, bf16 weight, Humming's layer or None)`` of one random ``[n, k]`` weight."""
    wts = gemm.Weights(n, k)
    try:
        layer = gemm.humming_layers(SimpleNamespace(n=n, k=k, q=[None], bf16=[wts.bf16[0]]))[0]
    except ImportError as e:
        print(f"humming: not importable ({e}); its form is left out", flush=True)
        layer = None
    return wts.q[0], wts.bf16[0], layer


def forms(q: tuple, w: torch.Tensor, layer, m: int) -> dict:
    """Each form as a no-argument call on the weight and one ``[m, k]`` bf16 input."""
    (n, k), x = w.shape, torch.randn(m, w.shape[1], device=w.device, dtype=torch.bfloat16)
    out = {
        "ours_ws": lambda: nvfp4_linear(x, *q, None, config=gemm.ws_candidate(m, n, k)),
        "dequant_cublas": lambda: nvfp4_linear(x, *q, None, config=LinearConfig(dequant=True, mma=True)),
        "bf16": lambda: F.linear(x, w),
    }
    if layer is not None:
        out["humming"] = lambda: layer(x)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1024", help="comma list of M")
    ap.add_argument("--shapes", default="gate,down", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    with torch.no_grad():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            q, w, layer = weights(n, k)  # once a shape: gemm.Weights quantizes and copies hundreds of MB
            for m in map(int, args.ms.split(",")):
                for form, call in forms(q, w, layer, m).items():
                    for _ in range(args.warmup):
                        call()
                    torch.cuda.synchronize()
                    torch.cuda.nvtx.range_push("prof")
                    call()
                    torch.cuda.synchronize()
                    torch.cuda.nvtx.range_pop()
                    print(f"launched {name} N={n} K={k} M={m} {form}", flush=True)


if __name__ == "__main__":
    main()
