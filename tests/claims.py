"""Check that every figure in a marked markdown table is held by a result file the table row names.

The README's speed table, BENCHMARKS' goal and topic tables and the marked tables of ``docs/*.md`` are checked by
``tests/test_claims.py``; run it by
hand with ``uv run python tests/claims.py README.md BENCHMARKS.md`` (prints each unsourced figure, exit code 1).

Conventions (also in BENCHMARKS.md, "How the figures are sourced"):

- **Marked tables.** A table is checked when the last non-blank line above it is ``<!-- claims: H1 | H2 -->``, naming
  the header cells of the columns that hold figures. Other columns (goals, verdicts, commands) are not checked.
  ``<!-- claims: H1 | H2; benchmarks/results/x.json 46de04b unit=ms -->`` also names files and a commit for every
  row (say them in the text above the table too: the comment does not render) and the unit of the numbers with
  decimals that the table writes without one.
- **Sources.** Every markdown link or ``code span`` in the row, in any column, whose path ends in ``.json``,
  ``.jsonl``, ``.log``, ``.csv`` or ``.txt`` (and the marker's files); looked up beside the markdown file, then from
  the repository root, then in ``benchmarks/results/``. A named file that does not exist is an error. A large JSON
  file should name the fields that hold the row's figures: ``gemm.json#layer_forward/speedup,layer_forward/lora_speedup``
  keeps only the numbers whose chain of keys holds one of those runs of keys (``layer_forward`` then ``speedup``),
  so that a wrong figure cannot match one of thousands of unrelated numbers.
- **Figures.** In a checked cell (code spans and link targets removed): every number with decimals (``0.645``), every
  number with a unit (``495 s``, ``48 %``, ``16.3 GB``, ``1.91×``, ``213.9 tok/s``) and every duration
  (``19 min 23 s``, ``1 h 0 min 49 s``, ``20 min``: matched in seconds). Integers without a unit are parameters (batch
  sizes, step counts, ``7B``, ``M = 16``) and are not checked; write a measured count with its unit. In ``a/b/c×``
  and ``a-b ms`` the unit belongs to each number. ``×`` is a ratio only when it follows the number without a space
  (``128 × 8`` is a product).
- **Matching.** A figure printed with ``d`` decimals matches a value ``v`` of a source when ``|v − x| ≤ ½·10^−d``.
  Values are every number of a JSON/JSONL file (recursive walk; numbers inside strings do not count) and every
  number of a text file. Units also allow these scalings of ``v``: ``%`` ×100 (fractions); ``ms`` ×1e3 (seconds) and
  ×1e-3 (µs); ``s`` ×1e-3 (ms); ``GB`` ×1e-9 (bytes) and ×1024e-9 (KiB); ``GiB`` ×2^-30 and ×2^-20; ``MB`` ×1e-6,
  ×1024e-6 and ×1e3 (GB). A ratio (``×``) also matches ``a / b`` where ``a`` and ``b`` are the same field of two
  arms of one run: records of one JSON list that each carry an ``arm`` field, at the same place inside each (a
  ratio comes from one run, both arms in one file).
- **Commit.** A row with a figure names the commit it was measured at: a hex word of 7-40 characters in the row,
  or a ``commit`` key in one of its files.
- **Labels.** A row whose first cell names a method of :data:`LABEL_TERMS` (``DAPO``, ``GRPO``, ``QLoRA``, ...) must
  name a file that mentions it (a whole word, any case, anywhere in the file's text): a GRPO step written down as a
  "DAPO step" fails. Only these names are checked; other words of a label are not.

The check says a number was written down by a run; it cannot say that it was the right number of that file: a
printed figure can match an unrelated number by chance, the more often the more numbers a file holds (hence the
field selections) and the fewer digits it prints.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SOURCE_EXTS = (".json", ".jsonl", ".log", ".csv", ".txt")
MARKER = re.compile(r"^<!--\s*claims:\s*(.*?)\s*-->\s*$")
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)[^)]*\)")
CODE = re.compile(r"`([^`]*)`")
NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
# A unit right after the number; "×" only when attached (a product is written with spaces: 128 × 8).
UNITS = r"×|\s?(?:%|GB/s|TB/s|tok/s|GiB|GB|MiB|MB|KiB|kB|ms|µs|us|s|nats)(?![\w/])"
# One number, or a list/range of numbers sharing the unit written after the last one.
FIGURE = re.compile(rf"(?<![\w.])[−+-]?(?P<nums>{NUM}(?:\s?/\s?{NUM}|[-–]{NUM})*)(?![\w])(?!\.\d)(?P<unit>{UNITS})?")
DURATION = re.compile(r"(?<![\w.])(?:(\d+) h )?(\d+) min(?: (\d+) s)?(?![\w])")
#: Methods a row's label may name; each must then appear in one of the row's files (see "Labels" above).
LABEL_TERMS = ("DAPO", "GRPO", "QLoRA", "AWQ", "GPTQ", "MXFP4", "NF4", "Humming")
SCALES = {
    None: (1.0,),
    "×": (1.0,),
    "%": (1.0, 100.0),
    "ms": (1.0, 1e3, 1e-3),
    "s": (1.0, 1e-3),
    "µs": (1.0, 1e3),
    "us": (1.0, 1e3),
    "GB": (1.0, 1e-9, 1024e-9),
    "GiB": (1.0, 2.0**-30, 2.0**-20),
    "MB": (1.0, 1e-6, 1024e-6, 1e3),
    "TB/s": (1.0, 1e-3),
    "duration": (1.0,),
}


@dataclass(frozen=True)
class Figure:
    """One number as printed: its value, the half-width of its last printed digit, and its unit (``None``: bare)."""

    text: str
    value: float
    tol: float
    unit: str | None


@dataclass
class Row:
    """A data row of a marked table: the text of its checked cells and of the whole row, where it is."""

    path: Path
    line: int
    label: str
    checked: list[str]
    text: str
    figures: list[Figure] = field(default_factory=list)
    head: str = ""  # the whole first cell: what the row says it measured


def figures(cell: str, default_unit: str | None = None) -> list[Figure]:
    """The figures of one table cell (see the module docstring); ``default_unit`` is that of numbers written bare."""
    text = CODE.sub(" ", LINK.sub(lambda m: m.group(1), cell)).replace("**", "")
    found: list[Figure] = []

    def duration(m: re.Match) -> str:
        h, mins, s = (int(g) if g else 0 for g in m.groups())
        tol = 0.5 if m.group(3) else 30.0
        found.append(Figure(m.group(0), 3600.0 * h + 60.0 * mins + s, tol, "duration"))
        return " "

    text = DURATION.sub(duration, text)
    for m in FIGURE.finditer(text):
        unit = (m.group("unit") or "").strip() or None
        if unit is None and default_unit and "." in m.group("nums"):
            unit = default_unit
        for num in re.split(r"\s?/\s?|[-–](?=\d)", m.group("nums")):
            decimals = len(num.split(".")[1]) if "." in num else 0
            if decimals == 0 and unit is None:
                continue  # a parameter (batch size, step count, model size), not a measured figure
            shown = num + ("" if unit in (None, "×") else " ") + (unit or "")
            found.append(Figure(shown, float(num.replace(",", "")), 0.5 * 10.0**-decimals, unit))
    return found


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip() for c in cells]


def marked_rows(md: Path) -> list[tuple[list[str], list[Row]]]:
    """Every marked table of ``md``: (its header, its data rows with the checked cells and their figures)."""
    lines = md.read_text().splitlines()
    tables = []
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j + 1 >= len(lines) or not lines[j].lstrip().startswith("|"):
            raise ValueError(f"{md}:{i + 1}: a claims marker must stand right above a table")
        header = [h.replace("**", "") for h in _split_row(lines[j])]
        columns, _, shared = m.group(1).partition(";")
        words = shared.split()
        unit = next((w.removeprefix("unit=") for w in words if w.startswith("unit=")), None)
        shared = " ".join(f"`{w}`" for w in words if not w.startswith("unit="))  # files and commit for every row
        wanted = [w.strip() for w in columns.split("|") if w.strip()]
        missing = [w for w in wanted if w not in header]
        if missing or not wanted:
            raise ValueError(f"{md}:{i + 1}: the marker names {missing or 'no'} column(s) not in the header {header}")
        cols = [header.index(w) for w in wanted]
        rows = []
        for k in range(j + 2, len(lines)):
            if not lines[k].lstrip().startswith("|"):
                break
            cells = _split_row(lines[k])
            checked = [cells[c] for c in cols if c < len(cells)]
            row = Row(md, k + 1, cells[0][:60], checked, f"{lines[k]} {shared}", head=cells[0])
            row.figures = [f for cell in checked for f in figures(cell, unit)]
            rows.append(row)
        tables.append((header, rows))
    return tables


@dataclass(frozen=True)
class Source:
    """A result file a row names, and the fields of it that hold the row's figures (empty: all of it)."""

    path: Path
    fields: tuple[tuple[str, ...], ...] = ()

    @property
    def name(self) -> str:
        return self.path.name + ("#" + ",".join("/".join(f) for f in self.fields) if self.fields else "")


def sources(row: Row) -> tuple[list[Source], list[str]]:
    """The result files a row names (with their ``#field,a/b`` selections), and the names that point at no file."""
    names = [t for _, t in LINK.findall(row.text)] + CODE.findall(row.text)
    found, missing = [], []
    for name in dict.fromkeys(n.strip() for n in names):
        file, _, frag = name.partition("#")
        if not file.endswith(SOURCE_EXTS) or " " in file:
            continue
        hits = [p for p in (row.path.parent / file, REPO / file, RESULTS / file) if p.is_file()]
        fields = tuple(tuple(f.split("/")) for f in frag.split(",") if f)
        (found.append(Source(hits[0].resolve(), fields)) if hits else missing.append(file))
    return found, missing


Entry = tuple[tuple[str, ...], float]  # the dict keys on the way to a number (list indices left out), the number


@dataclass
class Values:
    """The numbers of one result file; and, for ratios, each number of a run's arms at its place in each arm."""

    entries: list[Entry]
    by_place: dict[tuple, list[Entry]]  # one place inside an arm's record → that number in each arm
    commit: bool


def _walk(obj: object, keys: tuple, place: tuple | None, out: Values) -> None:
    """Collect every number of ``obj``; ``place`` is the path inside an arm's record (None outside the arms)."""
    if isinstance(obj, dict):
        out.commit |= "commit" in obj
        for k, v in obj.items():
            _walk(v, (*keys, k), None if place is None else (*place, k), out)
    elif isinstance(obj, list):
        arms = place is None and len(obj) > 1 and all(isinstance(v, dict) and "arm" in v for v in obj)
        for i, v in enumerate(obj):  # a list of records with an "arm" field: the arms of one run
            _walk(v, keys, () if arms else None if place is None else (*place, i), out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        out.entries.append((keys, float(obj)))
        if place is not None:
            out.by_place.setdefault(place, []).append((keys, float(obj)))


@cache
def values(path: Path) -> Values:
    """Parse a result file once (JSON, JSON lines, or text) into :class:`Values`."""
    text = path.read_text()
    if path.suffix not in (".json", ".jsonl"):  # a log or table: every number in it, no fields, no arms
        return Values([((), float(n.replace(",", ""))) for n in re.findall(NUM, text)], {}, bool(COMMIT.search(text)))
    docs = [json.loads(x) for x in text.splitlines() if x.strip()] if path.suffix == ".jsonl" else [json.loads(text)]
    out = Values([], {}, False)
    for doc in docs:
        _walk(doc, (), None, out)
    return out


def _selected(keys: tuple[str, ...], fields: tuple[tuple[str, ...], ...]) -> bool:
    """Whether a number's key path holds one of ``fields`` (each a run of consecutive keys); no fields: every one."""
    n = len(keys)
    return not fields or any(keys[i : i + len(f)] == f for f in fields for i in range(n - len(f) + 1))


@cache
def numbers(src: Source) -> tuple[list[float], list[float]]:
    """The selected numbers of a source, sorted, and the ratios of its arms' selected numbers, sorted."""
    v = values(src.path)
    flat = sorted(x for keys, x in v.entries if _selected(keys, src.fields))
    ratios = []
    for entries in v.by_place.values():
        xs = [x for keys, x in entries if _selected(keys, src.fields)]
        ratios += [a / b for a in xs for b in xs if b != 0 and a != b]
    return flat, sorted(ratios)


def _near(sorted_vals: list[float], x: float, tol: float) -> bool:
    tol = tol * (1 + 1e-9) + 1e-12
    i = bisect.bisect_left(sorted_vals, x - tol)
    return i < len(sorted_vals) and sorted_vals[i] <= x + tol


def held_by(fig: Figure, srcs: list[Source]) -> bool:
    """Whether one of ``srcs`` holds ``fig`` (at its printed precision, with its unit's scalings)."""
    for src in srcs:
        flat, ratios = numbers(src)
        for s in SCALES.get(fig.unit, (1.0,)):
            # v·s ≈ x  ⇔  v ≈ x/s within tol/s
            if _near(flat, fig.value / s, fig.tol / s) or _near(flat, -fig.value / s, fig.tol / s):
                return True
        if fig.unit == "×" and _near(ratios, fig.value, fig.tol):
            return True
    return False


def _word(term: str) -> re.Pattern:
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(term)}(?![A-Za-z])", re.IGNORECASE)


@cache
def _text(path: Path) -> str:
    return path.read_text()


def unsupported_labels(row: Row, srcs: list[Source]) -> list[str]:
    """The :data:`LABEL_TERMS` the row's first cell names that none of its files mentions."""
    named = [t for t in LABEL_TERMS if _word(t).search(CODE.sub(" ", row.head))]
    return [t for t in named if not any(_word(t).search(_text(s.path)) for s in srcs)]


def check(md: Path) -> list[str]:
    """Every problem of ``md``'s marked tables, one line each (empty: every figure is sourced)."""
    problems = []
    for _, rows in marked_rows(md):
        for row in rows:
            srcs, missing = sources(row)
            where = f"{md.name}:{row.line} ({row.label})"
            problems += [f"{where}: names {name}, which is not a file" for name in missing]
            if not row.figures:
                continue
            if not srcs:
                problems.append(f"{where}: figures {[f.text for f in row.figures]} but no result file named")
                continue
            if not COMMIT.search(row.text) and not any(values(s.path).commit for s in srcs):
                problems.append(f"{where}: names no commit (in the row or as a 'commit' key of its files)")
            names = ", ".join(s.name for s in srcs)
            problems += [
                f"{where}: {fig.text!r} is in none of {names}" for fig in row.figures if not held_by(fig, srcs)
            ]
            problems += [
                f"{where}: the label says {term}, which none of {names} mentions (what was measured?)"
                for term in unsupported_labels(row, srcs)
            ]
    return problems


if __name__ == "__main__":
    mds = [Path(a) for a in sys.argv[1:]] or [REPO / "README.md", REPO / "BENCHMARKS.md"]
    out = [p for md in mds for p in check(md)]
    print("\n".join(out) or f"every figure of the marked tables of {', '.join(m.name for m in mds)} is sourced")
    sys.exit(1 if out else 0)
