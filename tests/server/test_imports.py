"""The frontend stays torch-free and load-tester-free; the CLI modules import one way."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = [p.stem for p in (REPO / "server").glob("*.py") if p.stem != "__init__"]


def _run_clean(code: str) -> None:
    """Run ``code`` in a fresh interpreter (a clean ``sys.modules``); fail with its stderr."""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(60)
def test_server_imports_no_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}: importlib.import_module('server.' + name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    _run_clean(code)


@pytest.mark.timeout(60)
def test_server_cli_does_not_import_the_load_tester() -> None:
    """``shardserve bench`` imports it by name when run (tests/deploy/test_bench_command.py)."""
    code = (
        "import sys\n"
        "import server.cli.serve, server.cli.args, server.cli.engine\n"
        "deploy = sorted(m for m in sys.modules if m == 'deploy' or m.startswith('deploy.'))\n"
        "assert not deploy, deploy\n"
    )
    _run_clean(code)


#: Each CLI module may import only those before it: imports run one way, no cycle.
CLI_MODULES = ("server.cli.args", "server.cli.engine", "server.cli.serve")


def _imports_of(module: str) -> set[str]:
    """Every module ``module`` imports, at its top or inside a function."""
    tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_cli_modules_import_one_way() -> None:
    """``server.cli.serve`` → ``server.cli.engine`` → ``server.cli.args``, never back; and
    none of them names the load tester in an import."""
    for i, module in enumerate(CLI_MODULES):
        imported = _imports_of(module)
        later = imported & set(CLI_MODULES[i:])
        assert not later, f"{module} imports {sorted(later)}: a cycle among the CLI modules"
        assert not any(name.split(".")[0] == "deploy" for name in imported), (module, imported)
