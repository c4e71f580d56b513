"""How many CPU threads a replica's ranks get, and how their threads wait.

``os.cpu_count()`` counts the machine's CPUs, not the ones this process may
use. :func:`detect_budget` reads the two limits that decide it:

* the **affinity mask** (``os.sched_getaffinity``: ``taskset``, ``--cpuset-cpus``);
* the **CFS quota** of this process's cgroup and of every ancestor (the
  smallest wins): cgroup v2 ``cpu.max`` (``"max 100000"`` or ``"150000
  100000"``), cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (``-1``:
  none). A Kubernetes CPU limit of 1.5 is a quota of 1.5 cores.

Every path is read under ``root`` (default ``/``: ``proc/self/cgroup`` and
``sys/fs/cgroup/...``), so tests point it at a fake tree.

:func:`plan_threads` counts the frontend's share (``FRONTEND_SHARE`` of a core
for HTTP, tokenizing and detokenizing) and every rank's threads together:
``threads_per_rank = round((cores - frontend) / ranks)``, at least 1, unless
overridden (``--cpu-threads-per-rank``). When the plan fills the cores
(``frontend + ranks * threads > cores``) a thread that waits must not hold a
core that another thread needs while other work wants it:

* ranks of several threads keep OpenMP's default spins (libgomp's 300,000 polls,
  ~38 ms here: the fastest when quiet, 6-20% faster than short spins) and
  :mod:`model_shards.launch.cpu_governor` drops to one thread, which has no barriers, while
  other work takes the cores;
* ranks whose count stays fixed (``--cpu-threads-per-rank``,
  ``SHARDSERVE_THREAD_GOVERNOR=0``) get a short spin budget instead (libgomp
  ``GOMP_SPINCOUNT``, Intel OpenMP ``KMP_BLOCKTIME``): a whole scheduler slice burnt
  at each barrier whose partner was preempted is what collapsed throughput.

:func:`spin_budget_s` gives the shared-memory all-reduce a short budget too
(``SHARDSERVE_SPIN_US``). Variables the user set are kept.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from model_shards.launch.cpu_governor import ENV_VAR as GOVERNOR_ENV
from model_shards.launch.cpu_governor import switched_off as governor_off

FRONTEND_SHARE = 0.25
"""Cores the HTTP frontend process is expected to keep busy beside the ranks."""
SHORT_SPIN_COUNT = 1500
"""libgomp polls before a waiting thread sleeps (~190 us at 126 ns a ``pause``; ~60 us
at Intel's ~40 ns); waits inside one decode step's ops are shorter when both threads run."""
SHORT_SPIN_US = 100
"""The shared-memory all-reduce's spin before it sleeps, when the cores are filled."""
SPIN_ENV = "SHARDSERVE_SPIN_US"
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use: ``affinity`` CPUs, at most ``quota`` cores of time.

    ``quota_source``: the file the quota came from, or why there is none.
    """

    affinity: int
    quota: float | None
    quota_source: str

    @property
    def cores(self) -> float:
        """Cores of CPU time available: the affinity count, capped by the quota."""
        return min(float(self.affinity), self.quota) if self.quota else float(self.affinity)

    def describe(self) -> str:
        quota = f"quota {self.quota:g} cores" if self.quota else "no CPU quota"
        where = f"affinity {self.affinity} CPUs; {quota}, {self.quota_source}"
        return f"{self.cores:g} usable cores ({where})"


def detect_budget(root: str | Path = "/", affinity: set[int] | None = None) -> CpuBudget:
    """This process's CPU budget (affinity mask and cgroup quota, read under ``root``)."""
    cpus = affinity if affinity is not None else _affinity()
    quota = read_quota(Path(root))
    if quota is None:
        return CpuBudget(len(cpus), None, "no cgroup CPU quota file found")
    cores, source = quota
    return CpuBudget(len(cpus), cores, source)


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def read_quota(root: Path) -> tuple[float | None, str] | None:
    """``(cores or None for unlimited, source)`` from this process's cgroup (v2, else v1);
    ``None`` when no cpu controller is visible. The smallest limit on the path wins."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "0::/a/b" (v2) or "4:cpu,cpuacct:/a/b" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found = _v2_quota(root, path)
        elif "cpu" in controllers.split(","):
            found = _v1_quota(root, controllers, path)
        else:
            continue
        if found is not None:
            return found
    return None


def _cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and its ancestors up to ``mount``; just ``mount`` when ``path`` is not
    under it (a container whose cgroup mount is its own group, without a cgroup namespace)."""
    here = mount / path.strip("/")
    if not here.is_dir():
        return [mount]
    dirs = [here]
    while dirs[-1] != mount:
        dirs.append(dirs[-1].parent)
    return dirs


def _v2_quota(root: Path, path: str) -> tuple[float | None, str] | None:
    for mount in (root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"):
        if (mount / "cgroup.controllers").is_file():
            break
    else:
        return None
    best: tuple[float | None, str] | None = None
    for d in _cgroup_dirs(mount, path):
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        best = _smaller(best, None if quota == "max" else int(quota) / int(period), d / "cpu.max")
    return best


def _v1_quota(root: Path, controllers: str, path: str) -> tuple[float | None, str] | None:
    names = (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu")
    mount = next(
        (root / "sys/fs/cgroup" / n for n in names if (root / "sys/fs/cgroup" / n).is_dir()), None
    )
    if mount is None:
        return None
    best: tuple[float | None, str] | None = None
    for d in _cgroup_dirs(mount, path):
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        cores = quota / period if quota > 0 and period > 0 else None
        best = _smaller(best, cores, d / "cpu.cfs_quota_us")
    return best


def _smaller(
    best: tuple[float | None, str] | None, cores: float | None, where: Path
) -> tuple[float | None, str]:
    if best is not None and (cores is None or (best[0] is not None and best[0] <= cores)):
        return best
    return cores, str(where)


@dataclass(frozen=True)
class ThreadPlan:
    """``ranks`` processes of ``threads_per_rank`` threads each, beside a frontend taking
    ``frontend_share`` of a core, within ``budget``."""

    threads_per_rank: int
    ranks: int
    budget: CpuBudget
    frontend_share: float
    overridden: bool

    @property
    def demand(self) -> float:
        """Cores the plan keeps busy at full load: the frontend's share and every rank's threads."""
        return self.frontend_share + self.ranks * self.threads_per_rank

    @property
    def fills_cores(self) -> bool:
        """More runnable threads than cores at full load: waiting must give the core away."""
        return self.demand > self.budget.cores + 1e-9

    def describe(self) -> str:
        """The start-up log line: what was chosen and why."""
        why = (
            "--cpu-threads-per-rank"
            if self.overridden
            else f"round(({self.budget.cores:g} cores - {self.frontend_share:g} frontend) "
            f"/ {self.ranks} ranks)"
        )
        if not self.fills_cores:
            waits = "OpenMP's default spins: cores to spare"
        elif self.governed():
            waits = (
                f"OpenMP's default spins, {self.demand:g} cores wanted: fewer threads while "
                "other work takes the cores"
            )
        else:
            waits = f"short spins (GOMP_SPINCOUNT={SHORT_SPIN_COUNT}): {self.demand:g} cores wanted"
        return (
            f"CPU threads: {self.threads_per_rank} per rank x {self.ranks} ranks ({why}); "
            f"{self.budget.describe()}; waits: {waits}"
        )

    def governed(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Whether each rank's thread count follows :mod:`~model_shards.launch.cpu_governor` (more
        than one thread, not overridden, not switched off in ``environ``)."""
        return self.threads_per_rank > 1 and not self.overridden and not governor_off(environ)

    def wait_environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """Variables each rank starts with so that its OpenMP runtime (read once, when torch
        loads it) and the shm all-reduce wait as planned; the user's own are kept. An
        overridden count stays fixed (no :mod:`~model_shards.launch.cpu_governor`)."""
        env = {GOVERNOR_ENV: "0"} if self.overridden and GOVERNOR_ENV not in environ else {}
        if not self.fills_cores or any(name in environ for name in WAIT_VARIABLES):
            return env
        env[SPIN_ENV] = environ.get(SPIN_ENV, str(SHORT_SPIN_US))
        if not self.governed(environ):
            env.update({"GOMP_SPINCOUNT": str(SHORT_SPIN_COUNT), "KMP_BLOCKTIME": "0"})
        return env


def plan_threads(
    budget: CpuBudget,
    ranks: int,
    override: int | None = None,
    frontend_share: float = FRONTEND_SHARE,
) -> ThreadPlan:
    """Threads per rank for ``ranks`` CPU ranks on this machine (``override``: the flag's)."""
    if override is not None:
        return ThreadPlan(override, ranks, budget, frontend_share, True)
    share = (budget.cores - frontend_share) / ranks
    threads = max(1, math.floor(share + 0.5))  # round half up
    return ThreadPlan(threads, ranks, budget, frontend_share, False)


def spin_budget_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds a same-host wait may spin before it sleeps (``SHARDSERVE_SPIN_US``), or
    ``None``: the transport's own default (cores to spare)."""
    text = environ.get(SPIN_ENV)
    if not text:
        return None
    try:
        return max(0.0, float(text)) * 1e-6
    except ValueError:
        return None


def default_threads_per_rank(local_ranks: int) -> int:
    """Threads for each of ``local_ranks`` ranks started without a plan (``shardserve
    engine`` under torchrun: no frontend on this machine)."""
    return plan_threads(detect_budget(), local_ranks, frontend_share=0.0).threads_per_rank
