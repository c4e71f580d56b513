"""Busy neighbours: ``while True: pass`` processes beside a benchmark, each in its own session
(as another user's work would be), and the stop of a whole session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[list[int]]:
    """``count`` busy-loop processes (each its own session), killed on exit; yields their pids."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]
    try:
        time.sleep(1.0 if count else 0.0)  # let the scheduler and our governor see them
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            kill_session(p)


def kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL every process of ``proc``'s session (started with ``start_new_session``: its
    process group is its pid), then reap ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
