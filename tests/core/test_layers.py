"""The layer rules of docs/architecture.md, one test each, read from the source with ``ast``: every ``import`` and
``from ... import`` inside ``wantrain/``, at module level and inside functions alike.

Floors, bottom up: ``core`` · plug-ins (``models``, ``data``, ``optimizers``, ``schedulers``) · ``observers`` ·
``app`` · ``cli``. A module imported as ``from package import name`` counts as an import of ``package.name`` when
that is a module, else of ``package`` (Python runs the package's ``__init__`` either way; that is not an arrow).
"""

from __future__ import annotations

import ast
import graphlib
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "wantrain"
PLUG_INS = ("models", "data", "optimizers", "schedulers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """module -> the wantrain modules it imports (itself excluded)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x / from ..core import y
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        resolved = set()
        for target in targets:
            while target and target not in files:  # wantrain.core.events.CATALOGUE -> wantrain.core.events
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("wantrain"):
                resolved.add(target)
        graph[name] = frozenset(resolved)
    return graph


def floor(module: str) -> str:
    """``core``, ``plug-in``, ``observers``, ``app``, ``cli`` or ``root`` (``wantrain/__init__``, ``__main__``)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "root"
    top = parts[1]
    return "plug-in" if top in PLUG_INS else top if top in ("core", "observers", "app", "cli") else "unknown"


def offenders(graph: dict[str, frozenset[str]], source_floor: str, allowed) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if floor(a) == source_floor
                  for b in targets if not allowed(a, b))


def _same_package(a: str, b: str, depth: int) -> bool:
    return a.split(".")[:depth] == b.split(".")[:depth]


def observer_folder(module: str) -> str:
    """An observer's own unit: its feature folder (``wantrain.observers.alpha``) or its single file."""
    parts = module.split(".")
    return ".".join(parts[:3])


def test_every_module_has_a_floor():
    assert [m for m in import_graph() if floor(m) == "unknown"] == []


def test_no_logic_module_at_the_package_root():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_core_imports_only_core():
    assert offenders(import_graph(), "core", lambda a, b: floor(b) == "core") == []


def test_plug_ins_import_only_core_and_their_own_package():
    assert offenders(import_graph(), "plug-in",
                     lambda a, b: floor(b) == "core" or _same_package(a, b, 2)) == []


def test_observers_import_core_the_observers_root_and_their_own_folder():
    def allowed(a: str, b: str) -> bool:
        return floor(b) == "core" or b == "wantrain.observers" or observer_folder(a) == observer_folder(b)

    assert offenders(import_graph(), "observers", allowed) == []


def test_app_never_imports_cli():
    assert offenders(import_graph(), "app", lambda a, b: floor(b) != "cli" and floor(b) != "root") == []


READ_ONLY_COMMANDS = ("wantrain.cli.schedule", "wantrain.cli.inspect_lora")  # print what a plug-in computes


def test_cli_imports_only_cli_app_and_core():
    def allowed(a: str, b: str) -> bool:
        return floor(b) in ("cli", "app", "core") or (a in READ_ONLY_COMMANDS and floor(b) == "plug-in")

    assert offenders(import_graph(), "cli", allowed) == []


def find_circle(graph: dict[str, frozenset[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_no_import_circle_inside_wantrain():
    assert find_circle(import_graph()) is None


OBSERVERS_RULE = test_observers_import_core_the_observers_root_and_their_own_folder


@pytest.mark.parametrize(("module", "imported", "rule"), [
    ("wantrain.observers.norms", "wantrain.models.wan22", OBSERVERS_RULE),
    ("wantrain.observers.alpha.controller", "wantrain.data", OBSERVERS_RULE),
    ("wantrain.observers.alpha.controller", "wantrain.observers.lr_finder.math", OBSERVERS_RULE),
    ("wantrain.observers.evaluation.validation", "wantrain.app.assemble", OBSERVERS_RULE),
    ("wantrain.app.assemble", "wantrain.cli.main", test_app_never_imports_cli),
    ("wantrain.core.loop", "wantrain.observers", test_core_imports_only_core),
    ("wantrain.core.checkpoint", "wantrain", test_core_imports_only_core),
    ("wantrain.data.cache", "wantrain.models.wan22", test_plug_ins_import_only_core_and_their_own_package),
    ("wantrain.cli.report", "wantrain.observers.progress", test_cli_imports_only_cli_app_and_core),
    ("wantrain.cli.run", "wantrain.data", test_cli_imports_only_cli_app_and_core),
    ("wantrain.core.events", "wantrain.app.replay", test_no_import_circle_inside_wantrain),
])
def test_each_rule_fails_on_an_import_that_breaks_it(monkeypatch, module, imported, rule):
    graph = import_graph()
    assert imported not in graph[module]
    monkeypatch.setitem(globals(), "import_graph", lambda: {**graph, module: graph[module] | {imported}})
    with pytest.raises(AssertionError):
        rule()
