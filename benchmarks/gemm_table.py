"""Print BENCHMARKS.md's kernel tables (whole decoder layer, NVFP4 ÷ bf16) from a ``gemm.py`` JSON.

    uv run python benchmarks/gemm_table.py                         # benchmarks/results/gemm.json
    uv run python benchmarks/gemm_table.py other.json --commit abc1234

Forward: ``speedup`` (bf16 time ÷ ours, no LoRA on either side) and, where ``gemm.py --compare-lora`` ran,
``lora_speedup`` (bf16 without LoRA ÷ ours with the fused rank-32 LoRA, so a lower bound on ours + LoRA against
bf16 + LoRA); where ``--peer-humming`` ran, ``humming_speedup`` (Humming 0.1.10's NVFP4 GEMM, same run). Backward:
``speedup`` of ``dx = dy·W``. Each row names its source file and commit, as
``tests/test_claims.py`` asks; paste the output over the tables under "Kernels" in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _commit(data: dict) -> str | None:
    return data.get("commit") or data.get("versions", {}).get("commit")


def tables(data: dict, source: str, commit: str) -> str:
    """The forward and backward markdown tables (with their claims markers) of one gemm.py JSON."""
    models = sorted({r["model"] for r in data["layer_forward"]}, key=lambda m: float(m.split("-")[-1].rstrip("B")))
    short = {m: m.split("-")[-1] for m in models}  # Qwen2.5-7B → 7B
    out = []
    for key, label, extra in (("layer_forward", "", True), ("layer_backward", "dx ", False)):
        rows = data.get(key, [])
        has_hum = extra and any("humming_speedup" in r for r in rows)
        fields = f"{key}/speedup" + (f",{key}/lora_speedup" if extra else "") + (f",{key}/humming_speedup" if has_hum else "")
        src = f"[{Path(source).name}]({source}#{fields}), {commit}"
        if not rows:
            continue
        by = {(r["model"], r["M"]): r for r in rows}
        cols = [f"{label}{short[m]}" for m in models]
        has_lora = extra and any("lora_speedup" in r for r in rows)
        if has_lora:
            cols += [f"{short[m]} + LoRA" for m in models]
        if has_hum:
            cols += [f"Humming {short[m]}" for m in models]
        out += [f"<!-- claims: {' | '.join(cols)} -->", f"| M | {' | '.join(cols)} | source |"]
        out.append("|---:|" + "---:|" * len(cols) + "---|")
        for m_rows in sorted({r["M"] for r in rows}):
            cells = [by.get((m, m_rows), {}).get("speedup") for m in models]
            if has_lora:
                cells += [by.get((m, m_rows), {}).get("lora_speedup") for m in models]
            if has_hum:
                cells += [by.get((m, m_rows), {}).get("humming_speedup") for m in models]
            shown = " | ".join("—" if c is None else f"{c:.2f}×" for c in cells)
            out.append(f"| {m_rows} | {shown} | {src} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="?", default="benchmarks/results/gemm.json", help="a gemm.py JSON (repo-relative)")
    ap.add_argument("--commit", default=None, help="the commit the run measured (default: the JSON's own)")
    args = ap.parse_args()
    data = json.loads((REPO / args.json).read_text())
    commit = args.commit or _commit(data)
    if not commit:
        raise SystemExit(f"{args.json} names no commit: pass --commit <the measured commit>")
    print(tables(data, args.json, commit))


if __name__ == "__main__":
    main()
