"""``python -m benchmarks``: every command names a module with ``main(argv)``, and the Makefile's
targets go through it."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as entry

REPO = Path(__file__).resolve().parents[2]


def test_every_command_has_a_main() -> None:
    for group, names in entry.COMMANDS.items():
        for name in names:
            module, rest = entry.resolve([group, name.replace("_", "-"), "--x"]) or ("", [])
            assert module == f"benchmarks.{group}.{name}" and rest == ["--x"]
            assert callable(importlib.import_module(module).main), module
    assert entry.resolve(["gpu-check", "--smoke"]) == ("benchmarks.gpu.check", ["--smoke"])
    assert entry.resolve(["--no-moe"]) == ("benchmarks.make_bench", ["--no-moe"])
    assert entry.resolve([]) == ("benchmarks.make_bench", [])
    assert entry.resolve(["micro", "nope"]) is None and entry.resolve(["suites"]) is None


def test_makefile_targets_use_the_entry_point() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "$(BIN)/python -m benchmarks\n" in makefile  # make bench
    assert "$(PYTHON) -m benchmarks gpu-check $(GPU_CHECK_ARGS)\n" in makefile
    (wheels,) = re.findall(r"PYTHON=\$\(PYTHON\) (\S+)\n", makefile)
    assert (REPO / wheels).is_file()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [["--help"], ["gpu-check", "--help"], ["micro", "x"]])
def test_help_runs(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *argv], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == (2 if argv[0] == "micro" else 0), done.stderr
    text = done.stdout + done.stderr
    assert ("--smoke" if argv[0] == "gpu-check" else "micro: decode_attention") in text
