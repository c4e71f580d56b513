"""Run the real ``shardserve`` entry point in-process with spawning replaced by
:class:`Spawned`: what the flag checks let through never starts a rank."""

from __future__ import annotations

import os
from collections.abc import Iterator

import psutil
import pytest

from server.cli.serve import main


class Spawned(Exception):
    """Raised where a process would have been spawned (or torchrun exec'ed)."""


@pytest.fixture
def no_spawning(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The real launch module, except that spawning ranks or exec-ing torchrun raises."""
    import model_shards.launch.replicas

    def spawn(*args: object, **kwargs: object) -> None:
        raise Spawned

    monkeypatch.setattr(model_shards.launch.replicas, "start_replica", spawn)
    monkeypatch.setattr(os, "execv", spawn)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, f"processes left behind: {left}"


def run_cli(argv: list[str]) -> int:
    """``main(argv)``'s exit status, argparse's ``SystemExit`` included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def error_line(err: str) -> str:
    """The line saying what is wrong (argparse's usage line before it names every flag)."""
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]
