"""Wait until benchmarked servers have stopped working before the next point starts.

A point cut at its time cap cancels its requests on the client side, but a server may keep
computing them: ``transformers serve`` measured here went on at two cores for 12 s after
eight cancelled requests. Whatever point runs next would then share the machine with that
leftover work, an extra neighbour that none of its conditions names. :func:`wait_quiet`
polls the CPU time of each server's process tree (the process and all its descendants,
from ``/proc``: :func:`model_shards.launch.cpu_governor.read_family_cpu_s`, what the thread
governor reads of its own server) until the trees together used less than ``QUIET_CORES``
over one window; :func:`before_point` does it for every server that
:func:`benchmarks.harness.servers.running` has up.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from benchmarks.harness import servers
from model_shards.launch.cpu_governor import read_family_cpu_s

QUIET_CORES = 0.15
WINDOW_S = 1.0
TIMEOUT_S = 240.0
LONG_WAIT_S = 5.0  # a wait longer than this goes into the run's notes


def wait_quiet(roots: Iterable[int], timeout_s: float = TIMEOUT_S) -> float:
    """Block until the process trees of ``roots`` used under ``QUIET_CORES`` cores over one
    ``WINDOW_S`` window; the seconds waited (``timeout_s`` or more: still busy, gave up)."""
    start = time.monotonic()
    roots = list(roots)
    while True:
        before = sum(read_family_cpu_s(root) for root in roots)
        time.sleep(WINDOW_S)
        used = sum(read_family_cpu_s(root) for root in roots) - before
        waited = time.monotonic() - start
        if used < QUIET_CORES * WINDOW_S or waited >= timeout_s:
            return waited


def before_point(notes: list[str], point: str) -> None:
    """Wait until every running benchmark server is idle; a long wait goes into ``notes``."""
    waited = wait_quiet(servers.running_pids())
    if waited > LONG_WAIT_S:
        notes.append(f"{waited:.0f} s waited for idle servers before {point}")
