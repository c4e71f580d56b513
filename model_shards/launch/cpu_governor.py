"""Fewer torch threads while other work takes a CPU rank's cores; all of them back when it stops.

Two OpenMP threads meet at hundreds of barriers in every decode step. When a
neighbour process (another server, a build, a benchmark loop) takes one of the
cores, every barrier waits for the preempted thread's next time slice, and a
step that took 30 ms takes a second. One thread has no barriers: it keeps the
core it has. :class:`ThreadGovernor` watches, every ``period_s``, the CPUs this
process may run on (its affinity mask):

* how much of them **other work** used: their busy time (``/proc/stat``'s ``cpuN``
  lines: user, nice, system, irq, softirq and steal — a hypervisor taking the
  vCPU is a neighbour too) less the CPU time of this server's own processes (the
  frontend and every rank: the parent process and all its descendants,
  ``/proc/PID/stat``);
* how much of them sat **idle** (idle + iowait).

Other work above ``DOWN_OTHER_CORES`` while less than ``UP_IDLE_CORES`` is idle, two
windows in a row: one thread fewer. Other work under ``UP_OTHER_CORES`` or that much
idle, two windows in a row: one thread more, up to the planned count. Only windows
spent mostly in steps vote (``MIN_STEPPING``): what ran while this rank sat idle took
nothing from it; and a step after ``IDLE_RESET_S`` without one starts again at the
planned count (the load that cost a thread may be gone: a burst of requests after a pause
otherwise spent its first second at one thread, ~1.5x slower at concurrency 1, before two
windows had voted; a neighbour still busy takes it away again within two windows). A
load generator on the same machine (the bench's: ~0.06 of a core at concurrency 8 and 32)
stays under both thresholds; a busy loop takes ~0.7 of a core beside two spinning threads
and a whole one beside one thread. On a big host
the idle cores keep the count: other work there does not take ours.

The signal is other processes' time, not our threads' waiting: with OpenMP's
default spins (which the governed plan keeps: :mod:`model_shards.launch.cpu_budget`) our
threads are always runnable, so on a quiet 2-core machine the frontend alone makes
them wait for a core ~half their runnable time (an earlier rule on that signal cost
~10% of quiet throughput).

:meth:`ThreadGovernor.tick` runs in the thread that runs the ops (OpenMP's
thread count belongs to the calling thread), before each step; between
windows it costs one clock read. It changes only how many threads split each
op, not the numbers: the cpu backend's kernels (``model_shards/backends/cpu/kernels/``) split
rows, panels or sequences among threads, so each output element is computed
by one thread in one order whatever the thread count.

A lone thread is also **bound to the CPU it is running on** (:class:`ThreadPlacement`) and
unbound when threads come back (left free, the scheduler can move it between the cores it
shares with the busy processes, and a move costs it its caches; vLLM's CPU worker binds its
one thread too). With two busy-loop neighbours on the bench's 2-core machine, binding
measured 106 against 91 output tok/s at concurrency 8 and 129 against 124 at 32 (AMD Zen 4:
two interleaved A/Bs of two runs each, the medians of the four; +14% and +4% on Zen 3;
``python -m benchmarks suites contention_ab``). ``SHARDSERVE_BIND_THREAD=0`` leaves it unbound.

On by default for a CPU rank with more than one thread; ``SHARDSERVE_THREAD_GOVERNOR=0``
(also ``false``/``off``/``no``) switches it off, and an explicit
``--cpu-threads-per-rank`` keeps its count fixed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

ENV_VAR = "SHARDSERVE_THREAD_GOVERNOR"
BIND_ENV_VAR = "SHARDSERVE_BIND_THREAD"
PERIOD_S = 0.5
DOWN_OTHER_CORES = 0.5
UP_OTHER_CORES = 0.35
UP_IDLE_CORES = 0.5
MIN_STEPPING = 0.5
IDLE_RESET_S = 2.0
_WINDOWS = 2  # consecutive windows that must agree before a change
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_BUSY_FIELDS = (1, 2, 3, 6, 7, 8)  # user nice system irq softirq steal (cpuN line, 1-based)
_IDLE_FIELDS = (4, 5)  # idle iowait

R = TypeVar("R")


def switched_off(environ: Mapping[str, str] = os.environ, variable: str = ENV_VAR) -> bool:
    """Whether ``variable`` (``SHARDSERVE_THREAD_GOVERNOR``, or ``SHARDSERVE_BIND_THREAD`` for
    the binding) switches its feature off (``0``/``false``/``off``/``no``); on otherwise."""
    return environ.get(variable, "").strip().lower() in ("0", "false", "off", "no")


@dataclass(frozen=True)
class CpuTimes:
    """Seconds since boot, summed over some CPUs: ``busy`` and ``idle``."""

    busy: float
    idle: float


def read_cpu_times(cpus: Iterable[int], stat: Path = Path("/proc/stat")) -> CpuTimes:
    """Busy and idle seconds of the CPUs ``cpus`` (their ``cpuN`` lines of ``/proc/stat``)."""
    wanted = {f"cpu{n}" for n in cpus}
    busy = idle = 0
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return CpuTimes(0.0, 0.0)
    for line in lines:
        fields = line.split()
        if not fields or fields[0] not in wanted:
            continue
        busy += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
        idle += sum(int(fields[i]) for i in _IDLE_FIELDS)
    return CpuTimes(busy / _TICKS, idle / _TICKS)


def family_pids(root: int, proc: Path = Path("/proc")) -> list[int]:
    """``root`` and all its descendants (``/proc/PID/task/TID/children``)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            tasks = list((proc / str(pid) / "task").iterdir())
        except OSError:  # it ended
            continue
        for task in tasks:
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    return found


def _stat_fields(stat: str) -> list[str]:
    """A ``/proc/PID/stat`` line's fields after ``pid (comm) `` (a comm may hold spaces and
    parentheses): field N of proc(5) is element N - 3."""
    return stat[stat.rindex(")") + 2 :].split()


def read_family_cpu_s(root: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) used so far by ``root`` and its living descendants."""
    return read_cpu_s(family_pids(root, proc), proc)


def read_cpu_s(pids: Iterable[int], proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) used so far by the living processes among ``pids``."""
    total = 0
    for pid in pids:
        try:
            stat = (proc / str(pid) / "stat").read_text()
        except OSError:
            continue
        fields = _stat_fields(stat)
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / _TICKS


@dataclass(frozen=True)
class Sample:
    """One reading: the clock, our CPUs' busy and idle seconds, our processes' CPU seconds."""

    at: float
    cpus: CpuTimes
    ours: float


def machine_sample(clock: Callable[[], float] = time.monotonic) -> Callable[[], Sample]:
    """The real probe: this process's affinity CPUs, and the parent process's family (the
    frontend that spawned this rank, or torchrun's agent, and all their children)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    root = os.getppid()

    def sample() -> Sample:
        return Sample(clock(), read_cpu_times(cpus), read_family_cpu_s(root))

    return sample


class ThreadGovernor:
    """Adjusts ``set_threads`` between 1 and ``max_threads`` from what the machine shows.

    ``sample`` is the probe (:func:`machine_sample`), ``clock`` the time source checked
    on every tick; both are injectable so the rules are testable without load.
    """

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        period_s: float = PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        sample: Callable[[], Sample] | None = None,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._set = set_threads
        self._period = period_s
        self._clock = clock
        self._sample = sample or machine_sample(clock)
        self._last = self._sample()
        self._stepping = 0.0  # seconds inside steps since the last sample
        self._votes = 0  # > 0: windows in a row that asked for more; < 0: for fewer
        self._last_step_end: float | None = None
        self.changes = 0

    def tick(self) -> None:
        """Sample once a period has passed, and change the thread count if two agree.

        A window in which this rank spent less than ``MIN_STEPPING`` of the time in steps
        (it sat idle: what other work did then took nothing from us) does not vote."""
        if self._clock() - self._last.at < self._period:
            return
        now, last = self._sample(), self._last
        self._last = now
        seconds = now.at - last.at
        stepping, self._stepping = self._stepping, 0.0
        if stepping < MIN_STEPPING * seconds:
            self._votes = 0
            return
        idle = (now.cpus.idle - last.cpus.idle) / seconds
        ours = now.ours - last.ours
        other = max(0.0, (now.cpus.busy - last.cpus.busy - ours) / seconds)
        if other > DOWN_OTHER_CORES and idle < UP_IDLE_CORES and self.threads > 1:
            vote = -1
        elif (other < UP_OTHER_CORES or idle >= UP_IDLE_CORES) and self.threads < self.max_threads:
            vote = 1
        else:
            vote = 0
        self._votes = self._votes + vote if vote and (self._votes * vote) >= 0 else vote
        if abs(self._votes) >= _WINDOWS:
            self._change(self.threads + vote, other, idle)

    def _change(self, threads: int, other: float, idle: float) -> None:
        log.info(
            "CPU threads %d -> %d (other work used %.2f of our cores; %.2f cores idle)",
            self.threads,
            threads,
            other,
            idle,
        )
        self.threads = threads
        self._set(threads)
        self._votes = 0
        self.changes += 1

    def wrap(self, step: Callable[..., R]) -> Callable[..., R]:
        """``step`` with a :meth:`tick` before each call."""

        def governed(*args: object, **kwargs: object) -> R:
            self._after_idle()
            self.tick()
            start = self._clock()
            try:
                return step(*args, **kwargs)
            finally:
                end = self._clock()
                self._stepping += end - start
                self._last_step_end = end

        return governed

    def _after_idle(self) -> None:
        """The planned count back for the first step after ``IDLE_RESET_S`` without steps."""
        last = self._last_step_end
        if last is None or self.threads == self.max_threads:
            return
        idle = self._clock() - last
        if idle >= IDLE_RESET_S:
            log.info(
                "CPU threads %d -> %d (first step after %.1f s idle)",
                self.threads,
                self.max_threads,
                idle,
            )
            self.threads = self.max_threads
            self._set(self.max_threads)
            self._votes = 0
            self.changes += 1


def current_cpu(stat: Path = Path("/proc/thread-self/stat")) -> int | None:
    """The CPU the calling thread last ran on (field 39 of its ``stat``), ``None`` if unknown."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    fields = _stat_fields(text)
    return int(fields[36]) if len(fields) > 36 else None


class ThreadPlacement:
    """Sets the op thread count (``set_count``: ``torch.set_num_threads``), and where a lone
    thread runs: at one thread the calling thread is bound to the CPU it is on (one of
    ``cpus``, the affinity mask it started with); above one it gets the whole mask back
    *before* the count grows, so that threads OpenMP starts then inherit the whole mask.
    Only the calling thread is bound (Linux affinity is per thread): the process's other
    threads (sockets, links) stay free. ``pinned``: the CPU it is bound to, or ``None``."""

    def __init__(
        self,
        set_count: Callable[[int], None],
        cpus: set[int],
        set_affinity: Callable[[int, set[int]], None] = os.sched_setaffinity,
        where: Callable[[], int | None] = current_cpu,
    ) -> None:
        self._set_count = set_count
        self._cpus = set(cpus)
        self._set_affinity = set_affinity
        self._where = where
        self.pinned: int | None = None

    def __call__(self, threads: int) -> None:
        if threads > 1 and self.pinned is not None:
            self._bind(self._cpus, None)
        self._set_count(threads)
        cpu = self._where() if threads == 1 and len(self._cpus) > 1 else None
        if cpu is not None and cpu in self._cpus:
            self._bind({cpu}, cpu)

    def _bind(self, cpus: set[int], pinned: int | None) -> None:
        try:
            self._set_affinity(0, cpus)
        except OSError as err:  # a mask the process may no longer use: stay as we are
            log.warning("could not bind the op thread to CPUs %s: %s", sorted(cpus), err)
            return
        self.pinned = pinned
        log.info("op thread %s", f"bound to CPU {pinned}" if pinned is not None else "unbound")


def govern_threads(worker: Any, threads: int, device_type: str) -> ThreadGovernor | None:
    """Put a governor in front of ``worker.execute`` (a CPU rank with more than one thread,
    unless switched off); returns it, or ``None`` when the count stays fixed."""
    if device_type != "cpu" or threads <= 1 or switched_off():
        return None
    import torch

    set_threads: Callable[[int], None] = torch.set_num_threads
    if not switched_off(variable=BIND_ENV_VAR):
        set_threads = ThreadPlacement(torch.set_num_threads, os.sched_getaffinity(0))
    governor = ThreadGovernor(threads, set_threads)
    worker.execute = governor.wrap(worker.execute)
    log.info(
        "CPU threads: %d, fewer while other work takes the cores (%s=0: fixed)", threads, ENV_VAR
    )
    return governor
