"""The real thing: ``shardserve serve`` on the built-in tiny model, tp=2 on CPU, then SIGTERM.

Checks that the server answers, and (in :func:`tests.live_server.live_server`)
that after SIGTERM the frontend exits 0 and no rank process is left behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import psutil
import pytest

from model_shards.launch import replicas as launch
from model_shards.launch.default_model import ensure_default_model
from tests.live_server import live_server


@pytest.mark.timeout(240)
def test_serve_real_replica_and_stop(tmp_path: Path) -> None:
    toy = ensure_default_model(tmp_path / "cache")
    with live_server(["--model", str(toy), "-tp", "2"], tmp_path) as server:
        children = psutil.Process(server.process.pid).children(recursive=True)
        ranks = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(ranks) == 2
        expected = os.environ.get("GLIBC_TUNABLES", launch.HUGE_PAGE_TUNABLE)
        assert all(rank.environ().get("GLIBC_TUNABLES") == expected for rank in ranks)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            body = {"prompt": "Hello world", "max_tokens": 5, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] <= 5
            assert http.post("/v1/completions", json={"prompt": ""}).status_code == 400


def test_rank_environment_keeps_the_users_tunables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert launch.rank_environment({}) == {"GLIBC_TUNABLES": launch.HUGE_PAGE_TUNABLE}
    assert launch.rank_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {}
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("SHARDSERVE_TEST_VAR", "before")
    with launch.environment_with({"GLIBC_TUNABLES": "x", "SHARDSERVE_TEST_VAR": "during"}):
        assert os.environ["GLIBC_TUNABLES"] == "x"
        assert os.environ["SHARDSERVE_TEST_VAR"] == "during"
    assert "GLIBC_TUNABLES" not in os.environ  # set only while spawning
    assert os.environ["SHARDSERVE_TEST_VAR"] == "before"
