"""A directory written whole or not at all (a cached checkpoint a later run may reuse)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

R = TypeVar("R")


def write_whole(target: Path, write: Callable[[Path], R]) -> R:
    """``write(tmp)`` into a fresh directory beside ``target``, which then replaces ``target``
    in one rename (a run killed half-way leaves no half checkpoint); ``write``'s result."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        written = write(tmp)
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written
