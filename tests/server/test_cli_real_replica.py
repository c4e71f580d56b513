"""The real thing: ``shardserve serve`` on the built-in model, tp=2 on CPU, then SIGTERM.

Skipped until ``model_shards.launch`` and ``model_shards.default_model`` import.
Checks that the server answers, and that after SIGTERM the frontend exits 0 and
no rank process is left behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

pytest.importorskip("model_shards.launch")
pytest.importorskip("model_shards.default_model")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_serve_real_replica_and_stop(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "SHARDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "server.cli", "serve", "--port", "0", "--device", "cpu"]
    with log_path.open("w") as log:
        proc = subprocess.Popen([*command, "-tp", "2"], cwd=REPO, env=env, stderr=log, stdout=log)
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            match = re.search(r"serving \S+ on (http://\S+)", log_path.read_text())
            url = match.group(1) if match else None
            time.sleep(0.2)
        assert url, log_path.read_text()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            body = {"prompt": "Hello world", "max_tokens": 5, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] <= 5
            assert http.post("/v1/completions", json={"prompt": ""}).status_code == 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
        _gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
