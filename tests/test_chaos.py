"""Chaos: ``kill -9`` a rank of a live tp=2 x pp=2 server mid-generation; nobody notices.

32 concurrent requests (half streamed; half greedy, half seeded sampling; 24
tokens each, ``ignore_eos``) run once fault-free, then twice more while a rank
is killed: first rank 3, then rank 0 (the coordinator). Each time ``/health``
turns 503 within 2 s, the log names the rank and ``SIGKILL``, the supervisor
restarts the replica, every request completes with exactly the fault-free
output (replayed with ``resume_output_ids``), and ``/health`` is 200 again.
At the end no process of the server (original or restarted ranks) is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from tests.checkpoints import build_tiny_llama
from tests.live_server import LiveServer, live_server
from tests.waiting import wait_until

NEW_TOKENS = 24
NUM_REQUESTS = 32
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "1 2 3 4"]


def _body(i: int) -> dict[str, object]:
    body: dict[str, object] = {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": NEW_TOKENS,
        "ignore_eos": True,
        "stream": i % 2 == 1,
    }
    if i % 4 < 2:
        body["temperature"] = 0
    else:
        body.update(temperature=0.9, seed=1000 + i)
    return body


async def _one(client: httpx.AsyncClient, body: dict[str, object]) -> str:
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["completion_tokens"] == NEW_TOKENS, data
        return str(data["choices"][0]["text"])
    text, done = "", False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    assert done
    return text


async def _all(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=240) as client:
        return list(await asyncio.gather(*(_one(client, _body(i)) for i in range(NUM_REQUESTS))))


def _running(http: httpx.Client) -> float:
    match = re.search(
        r"^shardserve_generation_tokens_total (\S+)$", http.get("/metrics").text, re.MULTILINE
    )
    return float(match.group(1)) if match else 0.0


def _rank_pids(log: str) -> list[int]:
    found = re.findall(r"rank pids \[([^\]]*)\]", log)
    assert found, log
    return [int(p) for p in found[-1].split(",")]


def _kill_and_check(server: LiveServer, rank: int, expected: list[str]) -> None:
    pool = ThreadPoolExecutor(1)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        before = _running(http)
        result: Future[list[str]] = pool.submit(asyncio.run, _all(server.url))
        wait_until(
            lambda: _running(http) >= before + 2 * NUM_REQUESTS,
            "some tokens out: the requests are mid-generation",
            timeout=120,
            interval=0.05,
            explain=server.log,
        )
        pid = _rank_pids(server.log())[rank]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while http.get("/health").status_code == 200:
            assert time.monotonic() - killed_at < 2.0, "a dead rank went unnoticed for 2 s"
            time.sleep(0.05)
        assert result.result(timeout=240) == expected
        assert re.search(rf"rank {rank} \(pid {pid}\) killed by SIGKILL", server.log())
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
    pool.shutdown()


@pytest.mark.timeout(300)
def test_killed_ranks_are_restarted_and_requests_replayed(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=True)
    args = ["--model", str(model_dir), "-tp", "2", "-pp", "2", "--max-restarts", "3"]
    seen: set[psutil.Process] = set()
    with live_server(args, tmp_path) as server:
        me = psutil.Process(server.process.pid)
        expected = asyncio.run(_all(server.url))
        for rank in (3, 0):
            seen.update(me.children(recursive=True))
            _kill_and_check(server, rank, expected)
        seen.update(me.children(recursive=True))
        assert server.log().count("recovered (restart") == 2
        assert "replaying request" in server.log()  # in-flight requests were resumed
    _gone, alive = psutil.wait_procs(list(seen), timeout=15)
    assert not alive, f"processes left behind: {alive}"
