"""The real thing: ``shardserve serve`` on the built-in model, tp=2 on CPU, then SIGTERM.

Checks that the server answers, and (in :func:`tests.live_server.live_server`)
that after SIGTERM the frontend exits 0 and no rank process is left behind.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil
import pytest

from tests.live_server import live_server


@pytest.mark.timeout(240)
def test_serve_real_replica_and_stop(tmp_path: Path) -> None:
    with live_server(["-tp", "2"], tmp_path) as server:
        assert len(psutil.Process(server.process.pid).children(recursive=True)) >= 2
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            body = {"prompt": "Hello world", "max_tokens": 5, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] <= 5
            assert http.post("/v1/completions", json={"prompt": ""}).status_code == 400
