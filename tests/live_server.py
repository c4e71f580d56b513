"""Start the real ``shardserve serve`` CLI as a subprocess for end-to-end tests.

:func:`live_server` yields the base URL once the log says it is serving, and on
exit sends SIGTERM, checks the exit status and that every process the server
started is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
# ``make gpu-check`` serves on a GPU: SHARDSERVE_TEST_DEVICE=cuda
TEST_DEVICE = os.environ.get("SHARDSERVE_TEST_DEVICE", "cpu")


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


@contextmanager
def live_server(
    args: list[str], tmp_path: Path, start_timeout: float = 180
) -> Iterator[LiveServer]:
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "SHARDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--port",
        "0",
        "--device",
        TEST_DEVICE,
        *args,
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stderr=log, stdout=log)
    children: list[psutil.Process] = []
    try:
        url = None
        deadline = time.monotonic() + start_timeout
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            match = re.search(r"serving \S+ on (http://\S+)", log_path.read_text())
            url = match.group(1) if match else None
            time.sleep(0.2)
        assert url, f"server did not start:\n{log_path.read_text()}"
        children = psutil.Process(proc.pid).children(recursive=True)
        yield LiveServer(url, proc, log_path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
        _gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"processes left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for child in children:
            if child.is_running():
                child.kill()
