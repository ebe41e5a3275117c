"""The structure counts of issue #38, computed from the source (``python tests/architecture_metrics.py [ROOT]``).

* ``parse_sites``: calls of the ``quantization``-string parser (``get_scheme``; before #38 ``parse_quantization`` /
  ``canonical_quantization``) outside the registry module ``qerl_trl/quantization.py``.
* ``format_name_comparisons``: comparisons (``==``, ``!=``, ``in``, ``not in``, ``is``) with a format name as a string
  (``"nvfp4"``, ``"mxfp4"``, ``"nf4"``, ``"none"``), a registry constant or its ``.name`` (``fmt is MXFP4``), outside
  the two registries (``nvfp4/formats.py``, ``qerl_trl/quantization.py``), in packages/, integrations/ and benchmarks/.
* ``nvfp4_import_cycles``: modules of ``nvfp4`` on an import cycle (module-level and function-local imports alike).
* ``private_imports``: names starting with ``_`` imported from another top-level package or, in benchmarks/ and
  examples/, from anything (``from nvfp4.kernels.decode import _mma_tiles``, ``from rollout import _csv``).
* ``benchmark_lines``: lines of the ``*.py`` files under benchmarks/.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

PARSERS = {"get_scheme", "parse_quantization", "canonical_quantization"}
REGISTRIES = ("packages/nvfp4/src/nvfp4/formats.py", "packages/qerl-trl/src/qerl_trl/quantization.py")
FORMAT_NAMES = {"nvfp4", "mxfp4", "nf4", "none"}
SOURCE_DIRS = ("packages", "integrations", "benchmarks", "examples")


def _files(root: Path, dirs=SOURCE_DIRS) -> list[Path]:
    return sorted(p for d in dirs for p in (root / d).rglob("*.py") if ".venv" not in p.parts)


def _rel(root: Path, p: Path) -> str:
    return p.relative_to(root).as_posix()


def parse_sites(root: Path) -> list[str]:
    out = []
    for p in _files(root):
        if _rel(root, p) == REGISTRIES[1]:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in PARSERS:
                    out.append(f"{_rel(root, p)}:{node.lineno}")
    return out


def _is_format_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() in FORMAT_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_format_name(e) for e in node.elts)
    if isinstance(node, ast.Attribute) and node.attr == "name":
        node = node.value
    return isinstance(node, ast.Name) and node.id in ("NVFP4", "MXFP4")  # MXFP4.name, `fmt is MXFP4`


def format_name_comparisons(root: Path) -> list[str]:
    out = []
    for p in _files(root, ("packages", "integrations", "benchmarks")):
        if _rel(root, p) in REGISTRIES:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(_is_format_name(n) for n in (node.left, *node.comparators)):
                out.append(f"{_rel(root, p)}:{node.lineno}")
    return out


def _imports(tree: ast.AST, module: str, is_pkg: bool) -> set[str]:
    """Modules of ``nvfp4`` that ``module`` imports, anywhere in its body."""
    found = set()
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "nvfp4"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "nvfp4":
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from . import ops` imports a module
    return found


def nvfp4_import_cycles(root: Path) -> list[list[str]]:
    src = root / "packages/nvfp4/src"
    mods: dict[str, set[str]] = {}
    for p in sorted((src / "nvfp4").rglob("*.py")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        mods[name] = _imports(ast.parse(p.read_text()), name, is_pkg)
    # a package's __init__ is not an edge target: importing nvfp4.x runs nvfp4/__init__ first whatever imports it,
    # which would put every module on a cycle through the package
    graph = {
        m: {d for d in deps if d in mods and d != m and d not in ("nvfp4", "nvfp4.kernels")} for m, deps in mods.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def _top_package(root: Path, p: Path) -> str:
    rel = p.relative_to(root).parts
    if rel[0] in ("benchmarks", "examples"):
        return rel[0]
    src = rel.index("src")
    return rel[src + 1]


def private_imports(root: Path) -> list[str]:
    out = []
    for p in _files(root):
        pkg = _top_package(root, p)
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module == "__future__":
                continue
            top = (node.module or "").split(".")[0]
            if pkg not in ("benchmarks", "examples") and top == pkg:
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{_rel(root, p)}:{node.lineno}: from {node.module} import {a.name}")
    return out


def benchmark_lines(root: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (root / "benchmarks").rglob("*.py"))


def metrics(root: Path) -> dict[str, object]:
    cycles = nvfp4_import_cycles(root)
    return {
        "parse_sites": parse_sites(root),
        "format_name_comparisons": format_name_comparisons(root),
        "nvfp4_import_cycles": cycles,
        "private_imports": private_imports(root),
        "benchmark_lines": benchmark_lines(root),
    }


def summary(m: dict[str, object]) -> dict[str, int]:
    cyc = m["nvfp4_import_cycles"]
    return {
        "parse_sites": len(m["parse_sites"]),
        "format_name_comparisons": len(m["format_name_comparisons"]),
        "nvfp4_modules_on_import_cycles": sum(len(c) for c in cyc),
        "private_imports": len(m["private_imports"]),
        "benchmark_lines": m["benchmark_lines"],
    }


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    m = metrics(root)
    if "-v" in sys.argv:
        print(json.dumps(m, indent=1))
    print(json.dumps(summary(m)))
