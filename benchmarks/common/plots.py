"""Figures of result files (matplotlib, no display)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` whole or not at all (a temporary file renamed into place) and close it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp" + out.suffix)
    fig.savefig(tmp, dpi=dpi)
    pyplot().close(fig)
    os.replace(tmp, out)
    return out


def plot_batches(
    results: list[dict], path: str | Path, labels: dict[str, str], ours: str, ours_name: str, title: str | None = None
) -> Path:
    """Tokens/s against batch size per (model, arm, run, engine) of a rollout JSON's ``results``, and arm ``ours``'s
    ratio to each other arm within one run and engine, into a PNG (``labels``: arm → legend name)."""
    plt = pyplot()
    curves: dict[tuple[str, str, int, str], dict[int, float]] = {}  # one per (model, engine, run, arm)
    for r in results:
        pts = {row["batch"]: row["tok_s"] for row in r.get("batches", []) if row.get("tok_s")}
        if pts:
            curves[(r["model"], r.get("engine", "generate"), r.get("run", 0), r["arm"])] = pts
    if not curves:
        raise ValueError("no (model, arm) in these results has a tok/s figure to plot")
    several_engines = len({k[1] for k in curves}) > 1
    several_runs = len({k[2] for k in curves}) > 1

    def name(m: str, e: str, run: int) -> str:
        return m + (f" {e}" if several_engines else "") + (f" run {run}" if several_runs else "")

    fig, (tx, rx) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    batches = sorted({b for pts in curves.values() for b in pts})
    for i, ((m, e, run, a), pts) in enumerate(sorted(curves.items())):
        bs, colour = sorted(pts), colours[i % len(colours)]  # one colour per curve, kept in the ratio panel
        tx.plot(bs, [pts[b] for b in bs], marker="o", color=colour, label=f"{name(m, e, run)} {labels.get(a, a)}")
        mine = curves.get((m, e, run, ours))
        if a != ours and mine:
            common = [b for b in bs if b in mine]
            rx.plot(common, [mine[b] / pts[b] for b in common], marker="o", color=colour,
                    label=f"{name(m, e, run)}: ÷ {labels.get(a, a)}")  # fmt: skip
    for ax in (tx, rx):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (completions generated at once)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    tx.set_yscale("log")
    tx.set_ylabel("tokens / s (prefill included)")
    rx.axhline(1.0, color="grey", lw=1, ls="--")
    rx.set_ylabel(f"{ours_name} tok/s ÷ other arm")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
