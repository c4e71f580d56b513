"""``shardserve bench`` is the load generator (deploy/loadtest.py) under the main CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_shardserve_bench_runs_the_load_generator() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "server.cli", "bench", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert run.returncode == 0, run.stderr
    assert "--base-url" in run.stdout and "--sweep-concurrency" in run.stdout
    listed = subprocess.run(
        [sys.executable, "-m", "server.cli", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert "bench" in listed.stdout


@pytest.mark.timeout(60)
def test_shardserve_bench_bad_flag_names_it() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "bench",
            "--base-url",
            "http://127.0.0.1:9",
            "--concurrency",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert run.returncode == 2
    assert "--concurrency" in run.stderr
