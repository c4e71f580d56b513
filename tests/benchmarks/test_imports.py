"""Imports inside ``benchmarks/`` run one way, with no cycle: the harness imports no other
folder; suites, micro-benchmarks and the GPU check import their own folder and the harness;
only the entry point and ``make_bench`` import the README builder. Function-level imports
count too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"
MAY_IMPORT = {
    "harness": {"harness"},
    "suites": {"suites", "harness"},
    "micro": {"micro", "harness"},
    "gpu": {"gpu", "harness"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py") if ".cache" not in p.parts}


def imports_of(path: Path) -> set[str]:
    """The ``benchmarks`` modules ``path`` imports, at its top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in MODULES and name != "benchmarks"}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def _cycle_from(start: str, path: list[str], done: set[str]) -> list[str] | None:
    for child in sorted(GRAPH[start]):
        if child in path:
            return [*path[path.index(child) :], child]
        if child not in done:
            cycle = _cycle_from(child, [*path, child], done)
            if cycle:
                return cycle
    done.add(start)
    return None


def test_no_import_cycle() -> None:
    done: set[str] = set()
    for name in sorted(GRAPH):
        cycle = _cycle_from(name, [name], done)
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_folders_import_one_way() -> None:
    wrong = []
    for name, imported in GRAPH.items():
        folder = name.split(".")[1] if "." in name else ""
        wrong += [
            f"{name} imports {other}"
            for other in imported
            if folder in MAY_IMPORT and other.split(".")[1] not in MAY_IMPORT[folder]
        ]
    assert not wrong, "\n".join(sorted(wrong))
