"""Where the benchmarks read and write: the repository, ``benchmarks/``, its cache and results."""

from __future__ import annotations

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO = BENCH_DIR.parent
CACHE = BENCH_DIR / ".cache"
"""Checkpoints, datasets, logs and benchmark-only packages (git-ignored)."""
RESULTS = BENCH_DIR / "results"
