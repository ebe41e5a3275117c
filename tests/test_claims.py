"""Every figure in the README's speed table, BENCHMARKS' tables and the marked tables of docs/*.md names a committed
result file that holds it.

The rules (what a figure is, how it is matched) are in ``tests/claims.py``; ``uv run python tests/claims.py`` prints
what is unsourced.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from claims import REPO, check, figures, marked_rows


def test_readme_speed_table_is_sourced():
    tables = marked_rows(REPO / "README.md")
    assert tables, "README.md has no marked speed table (<!-- claims: ... --> above it)"
    assert sum(len(rows) for _, rows in tables) >= 8
    assert check(REPO / "README.md") == []


def test_benchmarks_tables_are_sourced():
    tables = marked_rows(REPO / "BENCHMARKS.md")
    headers = [h for h, _ in tables]
    assert ["goal", "current figure", "verdict", "measured", "command → source"] in headers, "the goals table"
    assert check(REPO / "BENCHMARKS.md") == []


@pytest.mark.parametrize("md", sorted(p.name for p in (REPO / "docs").glob("*.md")))
def test_docs_marked_tables_are_sourced(md):
    """The design notes' marked tables (docs/kernels.md's rounds, docs/fp8_rollouts.md's spikes) hold to the same
    rule: a marker that names a column the header lacks, or a figure no named file holds, fails here."""
    assert check(REPO / "docs" / md) == []


def _doc(tmp_path: Path, row: str, data: dict | None = None) -> Path:
    if data is not None:
        (tmp_path / "run.json").write_text(json.dumps(data))
    md = tmp_path / "doc.md"
    md.write_text(f"Text.\n\n<!-- claims: figure -->\n| what | figure | source |\n|---|---|---|\n{row}\n")
    return md


RUN = {"commit": "46de04b", "results": [{"arm": "nvfp4", "tok_s": 213.91, "peak_gb": 6.164, "wall_s": 1163.2},
                                        {"arm": "bf16", "tok_s": 112.09, "peak_gb": 15.577, "share": 0.48}]}  # fmt: skip


def test_sourced_figures_pass(tmp_path):
    row = "| 7B, B = 1 | 213.9 tok/s vs 112.1: **1.91×**; 6.2 vs 15.6 GB; 48 %; 19 min 23 s | [run](run.json) |"
    assert check(_doc(tmp_path, row, RUN)) == []


def test_planted_unsourced_number_fails(tmp_path):
    row = "| 7B, B = 1 | 213.9 tok/s, **2.37×**, 6.2 GB | [run](run.json) |"
    problems = check(_doc(tmp_path, row, RUN))
    assert len(problems) == 1 and "'2.37×' is in none of run.json" in problems[0], problems


def test_planted_number_in_the_real_readme_fails(tmp_path):
    lines = (REPO / "README.md").read_text().splitlines()
    (_, rows), *_ = marked_rows(REPO / "README.md")
    cells = lines[rows[0].line - 1].split("|")  # ['', what, ratio, source, '']
    cells[2] = " 9.87× and" + cells[2]  # an unsourced ratio planted in the checked column
    lines[rows[0].line - 1] = "|".join(cells)
    (tmp_path / "README.md").write_text("\n".join(lines))
    problems = check(tmp_path / "README.md")
    assert len(problems) == 1 and "'9.87×' is in none of gemm.json" in problems[0], problems


@pytest.mark.parametrize(
    "row, expected",
    [
        ("| x | 1.91× | |", "but no result file named"),  # a figure and no source
        ("| x | 1.91× | [run](missing.json) |", "names missing.json, which is not a file"),
        ("| x | 1.91× | [run](run.json) |", "names no commit"),
    ],
)
def test_missing_source_or_commit_fails(tmp_path, row, expected):
    data = {"results": [{"tok_s": 213.91}, {"tok_s": 112.09}]}  # no commit key
    problems = check(_doc(tmp_path, row, data))
    assert any(expected in p for p in problems), problems


def test_what_counts_as_a_figure():
    found = [(f.text, f.value, f.unit) for f in figures("7B, M = 1/8/16, B=8, d4205f1, torch 2.11.0, 128 × 8,192")]
    assert found == []  # settings, commits and versions are not figures
    found = {f.text: (f.value, f.tol) for f in figures("2.03/2.15/2.10×, 49-64 s, 0.131 → 0.756, 19 min 23 s, 20 min")}
    assert found == {
        "2.03×": (2.03, 0.005),
        "2.15×": (2.15, 0.005),
        "2.10×": (2.10, 0.005),
        "49 s": (49.0, 0.5),
        "64 s": (64.0, 0.5),
        "0.131": (0.131, 0.0005),
        "0.756": (0.756, 0.0005),
        "19 min 23 s": (1163.0, 0.5),
        "20 min": (1200.0, 30.0),
    }


def test_a_label_its_file_does_not_support_fails(tmp_path):
    """A row labelled with a method its file never mentions (the "32B DAPO step" that measured a GRPO step) fails;
    the same row labelled with what the file says passes."""
    data = {"commit": "d96b193", "what": "GRPO step, grpo_step.py", "summary": {"step_s": 46.44}}
    problems = check(_doc(tmp_path, "| 32B DAPO step | 46.44 s | [run](run.json) |", data))
    assert len(problems) == 1 and "the label says DAPO, which none of run.json mentions" in problems[0], problems
    assert check(_doc(tmp_path, "| 32B GRPO step | 46.44 s | [run](run.json) |", data)) == []
