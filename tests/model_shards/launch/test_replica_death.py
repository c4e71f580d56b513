"""``ReplicaHandle.death()``: which rank a failure report names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from model_shards.launch.replicas import ReplicaHandle


@dataclass
class _Process:
    """A finished or running process as ``multiprocessing`` shows it."""

    pid: int
    exitcode: int | None

    def is_alive(self) -> bool:
        return self.exitcode is None


def _handle(*exitcodes: int | None) -> ReplicaHandle:
    processes = [_Process(100 + rank, code) for rank, code in enumerate(exitcodes)]
    return ReplicaHandle("ipc://x", cast(Any, processes))


def test_names_none_while_every_rank_runs() -> None:
    assert _handle(None, None).death() is None


def test_names_the_rank_killed_by_a_signal_before_peers_that_exited_after_it() -> None:
    # rank 3 was SIGKILLed; rank 0 and rank 2 exited with errors when their links broke
    assert _handle(1, None, 1, -9).death() == "rank 3 (pid 103) killed by SIGKILL"


def test_names_the_first_dead_rank_when_none_was_signalled() -> None:
    assert _handle(None, 2, 1).death() == "rank 1 (pid 101) exited with code 2"
