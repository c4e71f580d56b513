"""How much CPU the kernel gives a server-shaped process beside busy neighbours.

The contention table's two-neighbour rows are decided by CPU share, not work per token:
there vLLM's CPU build gets 1.1-1.3 of the 2 cores and shardserve ~0.67, the fair third
each of three sessions gets under the kernel's autogroups. This probe shows where vLLM's
extra share comes from. :file:`sched_share_probe.c` is a process shaped like an inference
server (a spinning op thread bound to CPU 0; optionally one thread waking every
``waker_us`` and a sibling process of the same session computing a share of every 10 ms);
it runs, in its own session, beside ``--neighbours`` ``while True: pass`` processes (each in
its own session, as in the contention bench) in each of :data:`SHAPES` in turn, and the
cores each used are printed::

    python -m benchmarks micro sched_share [--neighbours 2] [--seconds 10]

On the 2-core machines of this project (Linux 6.18, EEVDF, autogroups on), the spinner alone,
with the waker alone or with the sibling alone gets its fair 0.67; with a 1 kHz waker *and*
the sibling it gets ~1.0 core and a neighbour sharing CPU 0 drops to ~0.1-0.4. That is
vLLM-CPU's shape (its worker and its 47 threads bound to CPU 0, gloo threads polling, the
engine-core process on the other CPU), and what was measured of it beside two neighbours:
the worker 0.99 cores, the neighbour on CPU 0 0.07. With autogroups off
(``kernel.sched_autogroup_enabled=0``) the shape gets 0.73, like the others: it is the group
scheduling of sessions that favours it. shardserve does not copy the shape on purpose: its
extra share is taken from the neighbours, not earned by less work.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks.harness.neighbours import busy_neighbours, kill_session
from benchmarks.harness.paths import CACHE
from model_shards.launch.cpu_governor import read_cpu_s, read_family_cpu_s

SOURCE = Path(__file__).resolve().with_name("sched_share_probe.c")
BINARY = CACHE / "sched_share_probe"


class Shape(NamedTuple):
    """The probe's arguments: bound to CPU 0, waker threads, their period, sibling's %."""

    pin: int
    wakers: int
    waker_us: int
    sibling_percent: int


SHAPES = {
    "spinner bound to CPU 0": Shape(1, 0, 1000, 0),
    "+ 1 kHz waker thread": Shape(1, 1, 1000, 0),
    "+ sibling process (10%)": Shape(1, 0, 1000, 10),
    "+ 1 kHz waker + sibling (vLLM's shape)": Shape(1, 1, 1000, 10),
    "+ 100 Hz waker + sibling": Shape(1, 1, 10_000, 10),
}


def build_probe() -> Path:
    """The probe compiled once (``cc``) into ``benchmarks/.cache``."""
    if not BINARY.exists() or BINARY.stat().st_mtime < SOURCE.stat().st_mtime:
        BINARY.parent.mkdir(parents=True, exist_ok=True)
        command = ["cc", "-O1", "-pthread", "-o", str(BINARY), str(SOURCE)]
        subprocess.run(command, check=True)
    return BINARY


def measure(shape: Shape, neighbours: int, seconds: float) -> tuple[float, list[float]]:
    """Cores used by the probe's processes and by each neighbour over ``seconds``."""
    args = [str(build_probe()), *(str(v) for v in shape)]
    with busy_neighbours(neighbours) as pids:
        probe = subprocess.Popen(args, start_new_session=True)
        try:
            time.sleep(1.0)  # the scheduler's averages settle
            ours, theirs = read_family_cpu_s(probe.pid), [read_cpu_s([p]) for p in pids]
            time.sleep(seconds)
            ours = read_family_cpu_s(probe.pid) - ours
            theirs = [read_cpu_s([p]) - t for p, t in zip(pids, theirs, strict=True)]
        finally:
            kill_session(probe)
    return ours / seconds, [t / seconds for t in theirs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--neighbours", type=int, default=2, help="busy-loop processes")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured per shape")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    print(
        f"{cores} cores, {args.neighbours} neighbours: a fair share is "
        f"{cores / (args.neighbours + 1):.2f} cores a session"
    )
    for name, shape in SHAPES.items():
        ours, theirs = measure(shape, args.neighbours, args.seconds)
        spread = ", ".join(f"{t:.2f}" for t in theirs)
        print(f"{name:<40} probe {ours:.2f} cores; neighbours {spread}", flush=True)
    return 0
