"""One launch of each form on the 7B gate and down inside an NVTX range ``prof``, warmed up outside it, for ncu: our
ws tile ``(256, 2, 3, 1)`` (``--tall``: round 16's 128 x 256 tile too), dequantize + cuBLAS, bf16 cuBLAS and Humming
(whichever ``humming-kernels`` imports); docs/kernels.md round 16 (issue #50: what idles the tensor pipe of both
W4A16 kernels at M = 1024; run at 92cc613, ``benchmarks/results/ncu_ws_vs_humming_h100_92cc613.json``).

    ncu --nvtx --nvtx-include "prof/" --set full --import-source no --csv --page raw \
        --log-file $JOB_OUT/ncu_ws_vs_humming.csv python3 docs/scripts/ncu_ws_vs_humming.py --ms 1024
    python3 docs/scripts/ncu_ws_vs_humming.py --ms 1024 --summary ncu_ws_vs_humming.csv summary.json   # no GPU

Prints the launch order (shape, M, form) so that the CSV's kernels (one or two per form: dequantize + cuBLAS is two)
can be told apart; round 10's ``benchmarks/results/gemm_ws_ncu.json`` holds the metrics read then.
"""

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gemm  # noqa: E402  (benchmarks/gemm.py: its weights, Humming's layers, the ws config)
from nvfp4.kernels import LinearConfig, nvfp4_linear  # noqa: E402
from nvfp4.kernels.nvfp4_gemm import entry_config  # noqa: E402

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


#: round 16's tall ws tile as a dispatch-table entry, 128 tokens x 256 rows: 31 % fewer L2 -> SM bytes, slower
TALL = ("ws", 128, 4, 6, 2)
#: the forms in launch order (``tall_ws`` with ``--tall`` only): :func:`forms` builds them, :func:`summary` labels by it
FORMS = ("ours_ws", "tall_ws", "dequant_cublas", "bf16", "humming")


def forms(q: tuple, w: torch.Tensor, layer, m: int, tall: bool = False) -> dict:
    """Each form as a no-argument call on the weight and one ``[m, k]`` bf16 input (``tall``: round 16's tall tile
    after ours)."""
    (n, k), x = w.shape, torch.randn(m, w.shape[1], device=w.device, dtype=torch.bfloat16)
    calls = {
        "ours_ws": lambda: nvfp4_linear(x, *q, None, config=gemm.ws_candidate(m, n, k)),
        "tall_ws": lambda: nvfp4_linear(x, *q, None, config=entry_config(TALL, m, n, k)),
        "dequant_cublas": lambda: nvfp4_linear(x, *q, None, config=LinearConfig(dequant=True, mma=True)),
        "bf16": lambda: F.linear(x, w),
        "humming": None if layer is None else (lambda: layer(x)),
    }
    return {f: calls[f] for f in FORMS if calls[f] is not None and (tall or f != "tall_ws")}


#: what the summary keeps of each kernel: (its key, the ncu metric's name or a regex of it)
METRICS = {
    "duration_us": "gpu__time_duration.sum",
    "cycles": "sm__cycles_elapsed.avg",
    "tensor_pipe_active_pct": r"sm__pipe_tensor_type_hmma_hgmma.*_cycles_active\.avg\.pct_of_peak_sustained_elapsed",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_read_mb": "dram__bytes_read.sum",
    "l2_sectors_from_sm": "lts__t_sectors_srcunit_tex.sum",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "instructions": "smsp__inst_executed.sum",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    **{f"stall_{r}": f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in (
        "barrier", "long_scoreboard", "wait", "dispatch_stall", "math_pipe_throttle", "gmma", "mio_throttle")},
}


def summary(csv_path: str, shapes: list[str], ms: list[int], tall: bool = False) -> list[dict]:
    """The kernels of an ncu ``--csv --page raw`` log of this script, labelled in launch order (shape, M, form;
    dequantize + cuBLAS is two kernels, ``dequant_cublas:dequant`` and ``:cublas``), with :data:`METRICS`."""
    import csv
    import re

    lines = Path(csv_path).read_text().splitlines()
    rows = list(csv.reader(lines[next(i for i, line in enumerate(lines) if line.startswith('"ID"')):]))
    head, data = rows[0], rows[2:]  # rows[1]: units
    names = [f for f in FORMS if tall or f != "tall_ws"]
    labels = [(s, m, f) for s in shapes for m in ms for form in names
              for f in ((f"{form}:dequant", f"{form}:cublas") if form == "dequant_cublas" else (form,))]  # fmt: skip
    cols = {key: next(j for j, h in enumerate(head) if re.fullmatch(pat, h)) for key, pat in METRICS.items()}
    out = []
    for (shape, m, form), row in zip(labels, data, strict=True):
        vals = {key: float(row[j].replace(",", "")) for key, j in cols.items()}
        vals["duration_us"] /= 1e3
        vals["clock_ghz"] = vals["cycles"] / vals["duration_us"] / 1e3  # not locked: the kernels ran at 1.3-1.6 GHz
        vals["dram_read_mb"] /= 1e6
        out.append({"shape": shape, "N, K": SHAPES[shape], "M": m, "form": form, "kernel": row[6][:60], **vals})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1024", help="comma list of M")
    ap.add_argument("--shapes", default="gate,down", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tall", action="store_true", help="also round 16's tall ws tile (128 x 256), after ours")
    ap.add_argument("--summary", nargs=2, metavar=("CSV", "JSON"), help="no GPU: summarise an ncu log of a run")
    args = ap.parse_args()
    if args.summary:
        rows = summary(args.summary[0], args.shapes.split(","), [int(m) for m in args.ms.split(",")], args.tall)
        Path(args.summary[1]).write_text(json.dumps({"ncu_csv": args.summary[0], "kernels": rows}, indent=1) + "\n")
        keys = ["duration_us", "cycles", "clock_ghz", "tensor_pipe_active_pct", "issue_active_pct", "l2_throughput_pct", "dram_throughput_pct",
                "dram_read_mb", "l2_sectors_from_sm", "l2_hit_pct", "stall_barrier", "stall_long_scoreboard"]
        print("| shape | M | form | " + " | ".join(keys) + " |\n|---|---:|---|" + "---:|" * len(keys))
        for r in rows:
            print(f"| {r['shape']} | {r['M']} | {r['form']} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |")
        return
    with torch.no_grad():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            q, w, layer = weights(n, k)  # once a shape: gemm.Weights quantizes and copies hundreds of MB
            for m in map(int, args.ms.split(",")):
                for form, call in forms(q, w, layer, m, args.tall).items():
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
