"""The dotted names and imports a user copies from the README, the package READMEs and docs/ resolve today.

A name in backticks such as ``qerl_trl.rollout.graph.generate.graph_generate`` and every ``import`` / ``from ... import``
line of a fenced Python block must import: a rename or a move that leaves the docs behind fails here, not for a user.
Names at a commit (``benchmarks/x.py@1486a77``) and modules of other packages are not checked.
"""

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted(REPO.glob("packages/*/README.md")), *sorted((REPO / "docs").glob("*.md"))]
PACKAGES = ("nvfp4", "aqn", "qerl_trl")
NAME = re.compile(r"`((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*)+)[`(]")
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+([\w, ]+)|import\s+([\w., ]+))", re.M)


def resolve(dotted: str) -> None:
    """Import the longest importable module prefix of ``dotted`` and get the rest as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)  # AttributeError names the missing piece
        return
    raise ModuleNotFoundError(dotted)


def doc_names() -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        text = doc.read_text()
        found |= {(doc.relative_to(REPO).as_posix(), m) for m in NAME.findall(text) if not m.endswith(".md")}
        for block in FENCE.findall(text):
            for frm, names, mods in IMPORT.findall(block):
                if frm:
                    found |= {(doc.relative_to(REPO).as_posix(), f"{frm}.{n.strip()}") for n in names.split(",")}
                else:
                    found |= {(doc.relative_to(REPO).as_posix(), m.strip()) for m in mods.split(",")}
    return sorted(found)


@pytest.mark.parametrize(("doc", "name"), doc_names())
def test_doc_name_resolves(doc: str, name: str) -> None:
    resolve(name)
