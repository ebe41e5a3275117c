"""``benchmarks/quality.py --formats --arms`` takes ids: the NF4 rows' names hold commas, so a comma list of names
could not pick them; an unknown id is refused in one line before anything loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_arms_are_ids_and_an_unknown_one_is_refused_in_one_line():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from quality import FORMAT_ARMS
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert list(FORMAT_ARMS) == ["nvfp4", "mxfp4", "nf4-dq", "nf4"]
    assert all("," not in arm for arm in FORMAT_ARMS) and any("," in row[0] for row in FORMAT_ARMS.values())
    cmd = [sys.executable, str(REPO / "benchmarks" / "quality.py"), "--formats", "--arms", "nf4,NF4 (bnb"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == "quality.py: error: unknown --arms id NF4 (bnb"
