"""Subprocesses of ``make gpu-check``: each in its own session, logged, always stoppable.

Every child (checkpoint builder, pytest, the server and its ranks, the HF benchmark)
runs in a new session (process group) with stdout and stderr in one log file. A
:class:`Procs` registry remembers them, so a global timeout or Ctrl-C stops all of them
(SIGTERM to each group, SIGKILL after a grace period) before the reports are written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.paths import REPO


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, the repo importable, offline hubs, unbuffered Python."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    base = {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return {**os.environ, **base, "PYTHONUNBUFFERED": "1", **(extra or {})}


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path
    started: float  # time.monotonic() at launch
    started_wall: float  # time.time() at launch (log stamps are wall-clock)

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or ``None`` if still running after ``timeout_s`` (not killed)."""
        try:
            return self.popen.wait(max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left of it."""
        pgid = self.popen.pid  # start_new_session: the group id is the leader's pid
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            self.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # children that outlived the leader, or a hang
        self.wait(5.0)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Procs:
    running: list[Proc] = field(default_factory=list)

    def start(self, command: list[str], log: Path, extra_env: dict[str, str] | None = None) -> Proc:
        log.parent.mkdir(parents=True, exist_ok=True)
        wall, mono = time.time(), time.monotonic()
        with log.open("wb") as sink:
            popen = subprocess.Popen(
                command,
                cwd=REPO,
                env=child_env(extra_env),
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(popen, log, mono, wall)
        self.running.append(proc)
        return proc

    def stop(self, proc: Proc, grace_s: float = 10.0) -> None:
        proc.stop(grace_s)
        if proc in self.running:
            self.running.remove(proc)

    def stop_all(self, grace_s: float = 5.0) -> None:
        for proc in list(self.running):
            self.stop(proc, grace_s)
