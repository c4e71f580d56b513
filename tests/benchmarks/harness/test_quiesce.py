"""benchmarks/harness/quiesce.py: waiting for process trees to idle (the tree walk and its CPU time
are model_shards.launch.cpu_governor's, tested in
tests/model_shards/launch/test_cpu_governor.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness import quiesce


@pytest.mark.timeout(60)
def test_wait_quiet_waits_for_a_busy_grandchild_then_returns() -> None:
    """A shell whose child spins for 2.5 s: the wait lasts until the spin ends, not longer."""
    spin = f"{sys.executable} -c 'import time; t=time.time()\nwhile time.time()-t<2.5: pass'"
    parent = subprocess.Popen(["sh", "-c", f"{spin}; sleep 30"], start_new_session=True)
    try:
        time.sleep(0.3)  # the child has started
        waited = quiesce.wait_quiet([parent.pid], timeout_s=20)
        assert 1.5 < waited < 8
        assert quiesce.wait_quiet([parent.pid], timeout_s=20) < 2  # idle: one window
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)


@pytest.mark.timeout(60)
def test_running_servers_are_registered_while_up(tmp_path: Path) -> None:
    """servers.running lists its server's pid while it is up (what before_point waits on)."""
    from benchmarks.harness import servers

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("{}")  # GET /v1/models answers 200
    port = servers.free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--directory", str(tmp_path)]
    with servers.running(command, tmp_path / "log", f"http://127.0.0.1:{port}") as url:
        (pid,) = servers.running_pids()
        assert servers.pid_serving(url) == pid
        assert os.getpgid(pid) == pid  # its own session: stopping it reaches its children
        notes: list[str] = []
        quiesce.before_point(notes, "a point")  # an idle server: no wait worth a note
        assert notes == []
    assert servers.running_pids() == []
