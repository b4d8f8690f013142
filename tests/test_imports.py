"""The toolkit's modules import each other without a circle (module-level imports; imports inside functions
are how a module reaches a heavier one lazily, and are not edges here)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    files = [*root.glob("utils/qat/**/*.py"), *root.glob("*.py"), root / "segment" / "qat_seg.py"]
    modules = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f for f in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for top in ast.parse(path.read_text()).body:
            for node in ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else [top]:
                if isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name in modules}
                elif isinstance(node, ast.ImportFrom) and node.module:
                    deps |= {m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if m in modules}
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if not state.get(nxt) and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if not state.get(start) and (found := visit(start, [])):
            return found
    return None


def test_no_import_circle():
    graph = import_graph()
    assert "utils.qat.quantize.calib" in graph and "utils.qat.quantize.rules" in graph["utils.qat.quantize.calib"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_check_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
