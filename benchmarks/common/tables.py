"""Markdown tables of result rows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def fmt(x: Any, nd: int = 1) -> str:
    """A table cell: ``—`` for None, floats to ``nd`` decimals, anything else as ``str``."""
    return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, ``l`` (default) or ``r`` (numbers)."""
    align = align.ljust(len(header), "l")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
