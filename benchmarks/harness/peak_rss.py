"""Peak resident memory of a running server's processes, from ``/proc``.

``VmHWM`` of ``/proc/PID/status`` is a process's peak RSS since it started (weights, KV
cache, buffers, mapped file pages it touched). A shardserve server is a frontend process and
one process per rank, which ``multiprocessing`` spawns (their command line runs
``multiprocessing.spawn``; its resource tracker is a child too, and is no rank);
``llama-server`` is one process, its own only rank.
"""

from __future__ import annotations

from pathlib import Path

from model_shards.launch.cpu_governor import family_pids

PROC = Path("/proc")
SPAWN_MARK = "multiprocessing.spawn"


def peak_rss_mib(pid: int, proc: Path = PROC) -> float | None:
    """``VmHWM`` of ``pid`` in MiB; ``None`` when the process or the field is gone."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return None


def _cmdline(pid: int, proc: Path) -> str:
    try:
        return (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rank_pids(root: int, proc: Path = PROC) -> list[int]:
    """The spawned rank processes among ``root``'s descendants (``[root]`` when there are
    none: a one-process server)."""
    ranks = [pid for pid in family_pids(root, proc) if SPAWN_MARK in _cmdline(pid, proc)]
    return sorted(ranks) or [root]


def server_peak_rss(root: int, proc: Path = PROC) -> dict[str, object]:
    """``{"ranks": [MiB per rank], "frontend": MiB or None}`` of the server rooted at
    ``root`` (``frontend`` is ``None`` for a one-process server)."""
    ranks = rank_pids(root, proc)
    frontend = None if ranks == [root] else peak_rss_mib(root, proc)
    return {"ranks": [peak_rss_mib(pid, proc) for pid in ranks], "frontend": frontend}
