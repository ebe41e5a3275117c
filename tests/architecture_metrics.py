"""The structure counts of issues #38 and #48, computed from the source (``python tests/architecture_metrics.py [ROOT]``).

* ``parse_sites``: calls of the ``quantization``-string parser (``get_scheme``; before #38 ``parse_quantization`` /
  ``canonical_quantization``) outside the registry module ``qerl_trl/quantization.py``, as ``file:line: function``.
  Not counted: ``qerl_trl.arguments.check_quantization``, ``qerl train``'s check of the name against the option
  snapshot before torch is imported (#49), which makes no ``QuantScheme`` (the config's parse does, once).
* ``format_name_comparisons``: comparisons (``==``, ``!=``, ``in``, ``not in``, ``is``) with a format name as a string
  (``"nvfp4"``, ``"mxfp4"``, ``"nf4"``, ``"none"``), a registry constant or its ``.name`` (``fmt is MXFP4``), outside
  the two registries (``nvfp4/formats.py``, ``qerl_trl/quantization.py``), in packages/, integrations/ and benchmarks/.
* ``nvfp4_import_cycles``: modules of ``nvfp4`` on an import cycle (module-level and function-local imports alike);
  ``import_cycles``: the same for every package (``nvfp4``, ``aqn``, ``qerl_trl``, ``qerl_vllm``).
* ``private_imports``: names starting with ``_`` imported from another top-level package or, in benchmarks/ and
  examples/, from anything (``from nvfp4.kernels.decode import _mma_tiles``, ``from rollout import _csv``), and
  ``module._x`` reads of such a name through an imported module (``import qerl_trl.x as m; m._STATES``). Reads of
  ``_x`` on objects (``trainer._tokenizer``, ``GRPOTrainer._generate_single_turn``) are not counted.
* ``benchmark_lines``: lines of the ``*.py`` files under benchmarks/.
* ``engine_name_comparisons``: comparisons (``==``, ``!=``, ``in``, ``not in``) with a rollout-engine name as a string
  (the keys of ``ENGINES`` in ``qerl_trl/rollout/__init__.py``) or with a ``rollout_engine`` / ``engine`` attribute,
  and mappings keyed by engine names, outside that registry, in packages/, integrations/, benchmarks/ and examples/.
* ``engine_resolution_sites``: where an engine name becomes a class outside the registry: calls of ``engine_class``,
  ``ENGINES[...]`` subscripts, ``importlib.import_module`` of a ``qerl_trl.rollout`` module.
* ``format_lookups``: calls of ``get_format`` (a format looked up from its name) outside the registry
  ``nvfp4/formats.py``, in packages/, integrations/, benchmarks/ and examples/.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

PARSERS = {"get_scheme", "parse_quantization", "canonical_quantization"}
REGISTRIES = ("packages/nvfp4/src/nvfp4/formats.py", "packages/qerl-trl/src/qerl_trl/quantization.py")
ENGINE_REGISTRY = "packages/qerl-trl/src/qerl_trl/rollout/__init__.py"
PACKAGE_SRCS = {
    "nvfp4": "packages/nvfp4/src",
    "aqn": "packages/aqn/src",
    "qerl_trl": "packages/qerl-trl/src",
    "qerl_vllm": "integrations/vllm/src",
}
FORMAT_NAMES = {"nvfp4", "mxfp4", "nf4", "none"}
SOURCE_DIRS = ("packages", "integrations", "benchmarks", "examples")


def _files(root: Path, dirs=SOURCE_DIRS) -> list[Path]:
    return sorted(p for d in dirs for p in (root / d).rglob("*.py") if ".venv" not in p.parts)


def _rel(root: Path, p: Path) -> str:
    return p.relative_to(root).as_posix()


def _owners(tree: ast.AST) -> dict[int, str]:
    """``id(node)`` → the name of the innermost function holding it (nodes at module level are absent)."""
    owner: dict[int, str] = {}
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]:
        for node in ast.walk(fn):  # innermost function wins: ast.walk visits outer functions first
            if node is not fn:
                owner[id(node)] = fn.name
    return owner


def _calls(root: Path, dirs: tuple[str, ...], skip: str, names: set[str]) -> list[str]:
    """``file:line: function`` of each call of a function named in ``names`` (``f(...)`` or ``x.f(...)``) outside the
    file ``skip``, with the function that makes it."""
    out = []
    for p in _files(root, dirs):
        if _rel(root, p) == skip:
            continue
        tree = ast.parse(p.read_text())
        owner = _owners(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in names:
                    out.append(f"{_rel(root, p)}:{node.lineno}: {owner.get(id(node), '<module>')}")
    return out


def parse_sites(root: Path) -> list[str]:
    """``file:line: function`` of each call of the ``quantization`` parser outside its registry."""
    return _calls(root, SOURCE_DIRS, REGISTRIES[1], PARSERS)


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


def _imports(tree: ast.AST, module: str, is_pkg: bool, top: str = "nvfp4") -> set[str]:
    """Modules of package ``top`` that ``module`` imports, anywhere in its body."""
    found = set()
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == top}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != top:
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from . import ops` imports a module
    return found


def nvfp4_import_cycles(root: Path) -> list[list[str]]:
    return package_import_cycles(root, "nvfp4")


def import_cycles(root: Path) -> dict[str, list[list[str]]]:
    """The import cycles of every package (an empty list for a package without any)."""
    return {top: package_import_cycles(root, top) for top in PACKAGE_SRCS}


def package_import_cycles(root: Path, top: str) -> list[list[str]]:
    src = root / PACKAGE_SRCS[top]
    mods: dict[str, set[str]] = {}
    packages: set[str] = set()
    for p in sorted((src / top).rglob("*.py")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        if is_pkg:
            packages.add(name)
        mods[name] = _imports(ast.parse(p.read_text()), name, is_pkg, top)
    # a package's __init__ is not an edge target: importing pkg.x runs pkg/__init__ first whatever imports it,
    # which would put every module on a cycle through the package
    graph = {m: {d for d in deps if d in mods and d != m and d not in packages} for m, deps in mods.items()}
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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(root: Path, dotted: str) -> bool:
    """Whether ``dotted`` names a module of a package here (``from qerl_trl.rollout import graph``)."""
    parts = dotted.split(".")
    if parts[0] not in PACKAGE_SRCS:
        return False
    base = root / PACKAGE_SRCS[parts[0]] / Path(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def private_imports(root: Path) -> list[str]:
    out = []
    for p in _files(root):
        pkg = _top_package(root, p)
        tree = ast.parse(p.read_text())
        modules: dict[str, str] = {}  # local name → the module it is bound to (imported from elsewhere)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            if not isinstance(node, ast.ImportFrom) or node.level or node.module == "__future__":
                continue
            top = (node.module or "").split(".")[0]
            for a in node.names:
                if _is_module(root, f"{node.module}.{a.name}"):
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
            if pkg not in ("benchmarks", "examples") and top == pkg:
                continue
            for a in node.names:
                if _is_private(a.name):
                    out.append(f"{_rel(root, p)}:{node.lineno}: from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _is_private(node.attr):
                mod = modules.get(node.value.id)
                if mod is None or mod.split(".")[0] not in PACKAGE_SRCS:  # not ours (torch._dynamo, os._exit)
                    continue
                if pkg not in ("benchmarks", "examples") and mod.split(".")[0] == pkg:
                    continue
                out.append(f"{_rel(root, p)}:{node.lineno}: {mod}.{node.attr}")
    return sorted(set(out))


def benchmark_lines(root: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (root / "benchmarks").rglob("*.py"))


def engine_names(root: Path) -> set[str]:
    """The keys of ``ENGINES`` in the engine registry."""
    for node in ast.walk(ast.parse((root / ENGINE_REGISTRY).read_text())):
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "ENGINES" for t in targets):
                return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise ValueError(f"no ENGINES mapping in {ENGINE_REGISTRY}")


def _is_engine_name(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in names
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_engine_name(e, names) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr in ("rollout_engine", "engine")


def engine_name_comparisons(root: Path) -> list[str]:
    names = engine_names(root)
    out = []
    for p in _files(root):
        if _rel(root, p) == ENGINE_REGISTRY:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(_is_engine_name(n, names) for n in (node.left, *node.comparators)):
                out.append(f"{_rel(root, p)}:{node.lineno}")
            elif isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value in names for k in node.keys
            ) and all(isinstance(k, ast.Constant) and k.value in names for k in node.keys):
                out.append(f"{_rel(root, p)}:{node.lineno}: mapping keyed by engine names")
    return out


def engine_resolution_sites(root: Path) -> list[str]:
    out = []
    for p in _files(root):
        if _rel(root, p) == ENGINE_REGISTRY:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            site = None
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == "engine_class":
                    site = "engine_class(...)"
                elif name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                    if str(node.args[0].value).startswith("qerl_trl.rollout"):
                        site = f"import_module({node.args[0].value!r})"
            elif isinstance(node, ast.Name) and node.id == "engine_class" and isinstance(node.ctx, ast.Load):
                site = "engine_class"  # passed as a converter (argparse type=)
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "ENGINES":
                site = "ENGINES[...]"
            if site:
                out.append(f"{_rel(root, p)}:{node.lineno}")
    return sorted(set(out))  # one per line: ``engine_class(name)`` is a Name inside a Call


def format_lookups(root: Path) -> list[str]:
    """``file:line: function`` of each ``get_format`` call outside the registry (the function that makes it)."""
    return _calls(root, SOURCE_DIRS, REGISTRIES[0], {"get_format"})


def metrics(root: Path) -> dict[str, object]:
    return {
        "parse_sites": parse_sites(root),
        "format_name_comparisons": format_name_comparisons(root),
        "format_lookups": format_lookups(root),
        "engine_name_comparisons": engine_name_comparisons(root),
        "engine_resolution_sites": engine_resolution_sites(root),
        "import_cycles": import_cycles(root),
        "private_imports": private_imports(root),
        "benchmark_lines": benchmark_lines(root),
    }


def summary(m: dict[str, object]) -> dict[str, int]:
    cyc = m["import_cycles"]
    return {
        "parse_sites": len(m["parse_sites"]),
        "format_name_comparisons": len(m["format_name_comparisons"]),
        "format_lookups": len(m["format_lookups"]),
        "engine_name_comparisons": len(m["engine_name_comparisons"]),
        "engine_resolution_sites": len(m["engine_resolution_sites"]),
        "modules_on_import_cycles": {top: sum(len(c) for c in cycles) for top, cycles in cyc.items()},
        "private_imports": len(m["private_imports"]),
        "benchmark_lines": m["benchmark_lines"],
    }


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if a != "-v"]
    root = Path(paths[0] if paths else Path(__file__).resolve().parents[1])
    m = metrics(root)
    if "-v" in sys.argv:
        print(json.dumps(m, indent=1))
    print(json.dumps(summary(m)))
