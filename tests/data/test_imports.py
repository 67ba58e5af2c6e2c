"""The modules of wantrain.data import one another without a circle (issue 17.8): the cache owns the storage,
training fills it."""

from __future__ import annotations

import ast
from pathlib import Path

import wantrain.data

PACKAGE = Path(wantrain.data.__file__).parent


def _module_imports(path: Path) -> set[str]:
    """Modules of wantrain.data that ``path`` imports anywhere, ``if TYPE_CHECKING:`` blocks and functions included."""
    local = {p.stem for p in PACKAGE.glob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["wantrain", "data"]:
                found.add(parts[2] if len(parts) > 2 and parts[2] in local else "__init__")
    return found - {path.stem}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]  # a node on the current path is in ``path``
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_data_modules_import_each_other_without_a_circle():
    graph = {p.stem: _module_imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert "training" in graph and "cache" in graph["training"]  # the check sees the imports it must see
    circle = _cycle(graph)
    assert circle is None, " -> ".join(circle)
    assert "training" not in graph["cache"] and "dataset" not in graph["cache"]


def test_the_cycle_check_finds_a_circle():
    assert _cycle({"cache": {"training"}, "training": {"cache", "clips"}, "clips": set()}) == [
        "cache", "training", "cache"]
