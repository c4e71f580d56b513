"""Fewer torch threads while other work takes a CPU rank's cores; all of them back when it stops.

Two OpenMP threads meet at hundreds of barriers in every decode step. When a
neighbour process (another server, a build, a benchmark loop) takes one of the
cores, every barrier waits for the preempted thread's next time slice, and a
step that took 30 ms takes a second. One thread has no barriers: it keeps the
core it has. :class:`ThreadGovernor` watches, every ``period_s``:

* how long this process's runnable threads waited for a CPU
  (``/proc/self/task/*/schedstat``, field 2) against how long they ran (field 1):
  above ``DOWN_WAIT_FRACTION`` for two windows in a row, one thread fewer;
* how much of the machine was idle (``/proc/stat``, idle + iowait): half a
  core (``UP_IDLE_CORES``; the frontend keeps part of the core a dropped thread
  left) idle for two windows in a row, one thread more, up to the planned count.

:meth:`ThreadGovernor.tick` runs in the thread that runs the ops (OpenMP's
thread count belongs to the calling thread), before each step; between
windows it costs one clock read. It changes only how many threads split each
op, not the numbers: the cpu backend's kernels (``model_shards/kernels/``) split
rows, panels or sequences among threads, so each output element is computed
by one thread in one order whatever the thread count.

Opt-in: ``SHARDSERVE_THREAD_GOVERNOR=1`` (also ``true``/``on``/``yes``), never with an
explicit ``--cpu-threads-per-rank``. Off by default: on a quiet 2-core machine the
frontend and a load generator alone make the threads wait 45-60% of their runnable time,
so the governor dropped a thread there too and cost ~10% of quiet throughput at
concurrency 32 (A/B in the same run: 536 against 596 tok/s); the short spins of
:mod:`model_shards.cpu_budget` alone keep contention from collapsing throughput.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

ENV_VAR = "SHARDSERVE_THREAD_GOVERNOR"
PERIOD_S = 0.5
DOWN_WAIT_FRACTION = 0.2
UP_IDLE_CORES = 0.5
_WINDOWS = 2  # consecutive windows that must agree before a change
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

R = TypeVar("R")


def switched_off(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the governor stays out (the default; ``SHARDSERVE_THREAD_GOVERNOR=1`` opts in)."""
    return environ.get(ENV_VAR, "").strip().lower() not in ("1", "true", "on", "yes")


def read_wait_run_ns(proc: Path = Path("/proc/self")) -> tuple[int, int]:
    """(ns this process's threads waited on a run queue, ns they ran), summed over threads."""
    waited = ran = 0
    try:
        tasks = list((proc / "task").iterdir())
    except OSError:
        return 0, 0
    for task in tasks:
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # the thread ended
            continue
        ran += int(fields[0])
        waited += int(fields[1])
    return waited, ran


def read_idle_s(stat: Path = Path("/proc/stat")) -> float:
    """Seconds all CPUs of the machine have been idle (idle + iowait) since boot."""
    try:
        with stat.open() as f:
            fields = f.readline().split()
    except OSError:
        return 0.0
    return (int(fields[4]) + int(fields[5])) / _TICKS


class ThreadGovernor:
    """Adjusts ``set_threads`` between 1 and ``max_threads`` from what the machine shows.

    ``read_wait_run`` and ``read_idle`` are the probes (defaults: ``/proc``), ``clock``
    the time source; all three are injectable so the rules are testable without load.
    """

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        period_s: float = PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        read_wait_run: Callable[[], tuple[int, int]] = read_wait_run_ns,
        read_idle: Callable[[], float] = read_idle_s,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._set = set_threads
        self._period = period_s
        self._clock = clock
        self._read_wait_run = read_wait_run
        self._read_idle = read_idle
        self._last = (clock(), *read_wait_run(), read_idle())
        self._votes = 0  # > 0: windows in a row that asked for more; < 0: for fewer
        self.changes = 0

    def tick(self) -> None:
        """Sample once a period has passed, and change the thread count if two agree."""
        now = self._clock()
        if now - self._last[0] < self._period:
            return
        waited, ran, idle = *self._read_wait_run(), self._read_idle()
        t0, waited0, ran0, idle0 = self._last
        self._last = (now, waited, ran, idle)
        runnable = (waited - waited0) + (ran - ran0)
        wait_fraction = (waited - waited0) / runnable if runnable > 0 else 0.0
        idle_cores = (idle - idle0) / (now - t0)
        if wait_fraction > DOWN_WAIT_FRACTION and self.threads > 1:
            vote = -1
        elif idle_cores >= UP_IDLE_CORES and self.threads < self.max_threads:
            vote = 1
        else:
            vote = 0
        self._votes = self._votes + vote if vote and (self._votes * vote) >= 0 else vote
        if abs(self._votes) >= _WINDOWS:
            self._change(self.threads + vote, wait_fraction, idle_cores)

    def _change(self, threads: int, wait_fraction: float, idle_cores: float) -> None:
        log.info(
            "CPU threads %d -> %d (threads waited %.0f%% of their runnable time for a core; "
            "%.2f cores idle)",
            self.threads,
            threads,
            100 * wait_fraction,
            idle_cores,
        )
        self.threads = threads
        self._set(threads)
        self._votes = 0
        self.changes += 1

    def wrap(self, step: Callable[..., R]) -> Callable[..., R]:
        """``step`` with a :meth:`tick` before each call."""

        def governed(*args: object, **kwargs: object) -> R:
            self.tick()
            return step(*args, **kwargs)

        return governed


def govern_threads(worker: Any, threads: int, device_type: str) -> ThreadGovernor | None:
    """Put a governor in front of ``worker.execute`` (a CPU rank with more than one thread,
    unless switched off); returns it, or ``None`` when the count stays fixed."""
    if device_type != "cpu" or threads <= 1 or switched_off():
        return None
    import torch

    governor = ThreadGovernor(threads, torch.set_num_threads)
    worker.execute = governor.wrap(worker.execute)
    log.info("CPU threads: %d, fewer while other work takes the cores (%s=1)", threads, ENV_VAR)
    return governor
