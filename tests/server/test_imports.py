"""The frontend and the config readers stay torch-free, the frontend load-tester-free; the CLI
modules import one way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_graph import import_graph

REPO = Path(__file__).resolve().parents[2]


def _modules(package: str) -> list[str]:
    """Every module of ``package`` (a dotted name), its subpackages' included."""
    root = REPO / package.replace(".", "/")
    return [
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for p in sorted(root.rglob("*.py"))
        if p.name != "__main__.py"
    ]


#: the frontend (DESIGN: no torch), and the checkpoint-config readers it imports (GGUF's too)
TORCH_FREE = [
    *_modules("server"),
    *_modules("model_shards.config"),
    *_modules("model_shards.gguf"),
    "model_shards.messages",
]


def _run_clean(code: str) -> None:
    """Run ``code`` in a fresh interpreter (a clean ``sys.modules``); fail with its stderr."""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_torch_free_list_covers_the_packages() -> None:
    assert len(_modules("server")) > 40 and "server.api.chat" in TORCH_FREE
    assert "model_shards.config.replica" in TORCH_FREE
    assert "model_shards.gguf.architectures" in TORCH_FREE


@pytest.mark.timeout(60)
def test_server_and_config_import_no_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE!r}: importlib.import_module(name)\n"
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
CLI_MODULES = (
    "server.cli.args",
    "server.cli.flag_checks",
    "server.cli.startup",
    "server.cli.engine",
    "server.cli.run_batch",
    "server.cli.serve",
)


def test_cli_modules_import_one_way() -> None:
    """Each of ``args``, ``startup``, ``engine``, ``run_batch``, ``serve`` imports only those
    before it, never back; and
    none of them names the load tester in an import (at its top or inside a function)."""
    sources = [*(REPO / "server" / "cli").glob("*.py"), *(REPO / "deploy").rglob("*.py")]
    graph = import_graph(sources)
    for i, module in enumerate(CLI_MODULES):
        imported = graph[module]
        later = imported & set(CLI_MODULES[i:])
        assert not later, f"{module} imports {sorted(later)}: a cycle among the CLI modules"
        assert not any(name.split(".")[0] == "deploy" for name in imported), (module, imported)
