"""The toolkit's layers: each package of utils/qat imports only its own layer and the ones below, and no
module imports itself back through others. Every import counts: module level, inside functions (a lazy
import is still a dependency) and under ``if TYPE_CHECKING``."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The layer table, bottom to top: a module may import its own layer and those below. The CLIs, scripts/,
#: segment/ and benchmarks/ sit above them all (TOP). docs/DEVELOPING.md's map says what each package holds.
LAYERS = {
    "utils.qat": 0,  # the package itself: __version__ only
    "utils.qat.core": 0,
    "utils.qat.quantize": 1,
    "utils.qat.model": 2,
    "utils.qat.onnx": 3,
    "utils.qat.trt": 4,
    "utils.qat.evaluation": 5,
    "utils.qat.run": 6,
}
TOP = 7
#: Where the checked modules live (the overlay's Python files and what runs them).
SOURCES = ("utils/qat/**/*.py", "*.py", "segment/*.py", "scripts/*.py", "benchmarks/*.py", "benchmarks/parts/*.py")
LIBRARY = "utils.qat"


def module_name(root: Path, path: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return {m for m in [base, *(f"{base}.{a.name}" for a in node.names)] if m in known}


def import_graph(root: Path = REPO, sources: tuple[str, ...] = SOURCES) -> dict[str, set[str]]:
    """Module -> the checked modules it imports, from every import statement in its file."""
    files = {module_name(root, f): f for pattern in sources for f in root.glob(pattern)}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            deps |= _targets(node, name, path.name == "__init__.py", known)
        graph[name] = deps - {name}
    return graph


def layer_of(module: str, layers: dict[str, int] = LAYERS, library: str = LIBRARY) -> int | None:
    """The module's layer: its longest package prefix in ``layers``; TOP outside the library; None for a
    library module in no package of the table (a new package needs its row)."""
    if module != library and not module.startswith(library + "."):
        return TOP
    owners = [p for p in layers if module == p or (p != library and module.startswith(p + "."))]
    return layers[max(owners, key=len)] if owners else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected group of more than one module, as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs are a few hundred modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(_closed_path(graph, set(group)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _closed_path(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first inside the group, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


def problems(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS, library: str = LIBRARY) -> list[str]:
    """One line per circle, per upward import and per library module with no layer."""
    found = [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    for module in sorted(graph):
        mine = layer_of(module, layers, library)
        if mine is None:
            found.append(f"{module} is in no layer: put it in a package of the layer table")
            continue
        for dep in sorted(graph[module]):
            theirs = layer_of(dep, layers, library)
            if theirs is not None and theirs > mine:
                found.append(f"upward import: {module} (layer {mine}) imports {dep} (layer {theirs})")
    return found


def test_layers_and_no_circle():
    graph = import_graph()
    # imports inside functions and under TYPE_CHECKING are edges too
    assert "utils.qat.trt.trt_engine" in graph["utils.qat.evaluation.backends"]
    assert "utils.qat.quantize.objectives" in graph["utils.qat.quantize.head"]
    assert "utils.qat.evaluation.backends" in graph["utils.qat.evaluation.evaluate"]
    assert not problems(graph), "\n".join(problems(graph))


def test_the_check_finds_a_planted_circle_and_an_upward_import(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def f():\n    from pkg.high import b\n",  # upward, and lazy
        "pkg/low/c.py": "from pkg.low import d\n",
        "pkg/low/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n",  # back to c
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "import pkg.low.c\n",
        "pkg/stray.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    layers = {"pkg": 0, "pkg.low": 0, "pkg.high": 1}
    graph = import_graph(tmp_path, ("pkg/**/*.py",))
    assert problems(graph, layers, "pkg") == [
        "import circle: pkg.low.c -> pkg.low.d -> pkg.low.c",
        "upward import: pkg.low.a (layer 0) imports pkg.high (layer 1)",  # its __init__ runs too
        "upward import: pkg.low.a (layer 0) imports pkg.high.b (layer 1)",
        "pkg.stray is in no layer: put it in a package of the layer table",
    ]
    (tmp_path / "pkg/low/d.py").write_text("")
    (tmp_path / "pkg/low/a.py").write_text("")
    (tmp_path / "pkg/stray.py").unlink()
    assert problems(import_graph(tmp_path, ("pkg/**/*.py",)), layers, "pkg") == []
