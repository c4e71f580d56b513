"""Tiny random checkpoints of every decoder family beyond Llama/Mistral/Qwen2, one module
each, found by :func:`families`.

A family module defines ``NAME`` (a short id), ``build(path: Path) -> Path`` (a
``transformers`` config → ``save_pretrained`` → safetensors checkpoint plus tokenizer
files, odd sizes so tensor splits are uneven where the model allows) and optionally
``LAYOUTS`` (the ``(tp, pp)`` layouts it can take; default all four of
:data:`LAYOUTS`). The module's file name is its ``NAME``.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def families() -> list[ModuleType]:
    """Every family module of this package, sorted by name (``SHARDSERVE_TEST_FAMILIES``,
    comma-separated, keeps only those named: for working on one family)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    wanted = os.environ.get("SHARDSERVE_TEST_FAMILIES")
    if wanted:
        names = [n for n in names if n in wanted.split(",")]
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def layouts_of(family: ModuleType) -> list[tuple[int, int]]:
    return list(getattr(family, "LAYOUTS", LAYOUTS))
