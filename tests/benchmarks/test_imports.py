"""Imports inside ``benchmarks/`` run one way, with no cycle: the harness imports no other
folder; suites, micro-benchmarks and the GPU check import their own folder and the harness;
only the entry point and ``make_bench`` import the README builder. Function-level imports
count too."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import import_cycles, import_graph

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"
MAY_IMPORT = {
    "harness": {"harness"},
    "suites": {"suites", "harness"},
    "micro": {"micro", "harness"},
    "gpu": {"gpu", "harness"},
}


SOURCES = [p for p in PACKAGE.rglob("*.py") if ".cache" not in p.parts]
# the benchmarks package's own modules (``benchmarks`` itself, the root, left out)
GRAPH = {
    name: {other for other in imported if other != "benchmarks"}
    for name, imported in import_graph(SOURCES).items()
}


def test_no_import_cycle() -> None:
    cycles = import_cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


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
