"""Start ``shardserve engine`` node processes (torchrun underneath) for tests, and reap them.

:func:`engine_nodes` starts one ``python -m server.cli engine`` per node, each
in its own session (its own process group: the command ``exec``\\s torchrun,
which starts the workers), logging to ``tmp_path/node<R>.log``. On exit it
sends SIGTERM to each group, waits, then SIGKILLs what is left, and checks
that no process of those groups survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


@contextmanager
def engine_nodes(
    node_args: list[list[str]], tmp_path: Path, env: dict[str, str] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run ``shardserve engine <args>`` once per entry of ``node_args``; yield the processes."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, args in enumerate(node_args):
            with (tmp_path / f"node{rank}.log").open("w") as log:
                command = [sys.executable, "-m", "server.cli", "engine", *args]
                kwargs = {"cwd": REPO, "env": full_env, "stdout": log, "stderr": log}
                procs.append(subprocess.Popen(command, start_new_session=True, **kwargs))
        yield procs
    finally:
        groups = [p.pid for p in procs]  # each Popen leads its own process group
        members = [m for pgid in groups for m in _group_members(pgid)]
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
        _gone, alive = psutil.wait_procs(members, timeout=20)
        for proc in alive:
            proc.kill()
        for p in procs:
            p.wait(10)
        deadline = time.monotonic() + 10
        while any(_group_members(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"engine processes needed SIGKILL: {alive}"


def logs(tmp_path: Path, nodes: int) -> str:
    return "\n".join(
        f"--- node {r} ---\n{(tmp_path / f'node{r}.log').read_text()}" for r in range(nodes)
    )
