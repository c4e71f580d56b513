"""The frontend stays torch-free: importing every server module pulls in no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = [p.stem for p in (REPO / "server").glob("*.py") if p.stem != "__init__"]


@pytest.mark.timeout(60)
def test_server_imports_no_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}: importlib.import_module('server.' + name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
