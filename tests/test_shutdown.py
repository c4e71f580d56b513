"""SIGTERM drains: a request in flight finishes, a new one gets 503, exit 0, no orphan;
and a client that disconnects gets its KV blocks freed (``/metrics`` KV usage back to 0)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.checkpoints import build_tiny_llama
from tests.live_server import live_server
from tests.waiting import async_wait_until


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled metric ``name`` in a ``/metrics`` page; -1 when absent."""
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else -1.0


def _kv_usage(http: httpx.Client) -> float:
    return _metric(http.get("/metrics").text, "shardserve_kv_cache_usage_ratio")


async def _until_in_flight(url: str, count: int) -> None:
    """Until the server holds ``count`` requests, every one running or waiting (none done)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:

        async def all_in_flight() -> bool:
            text = (await http.get("/metrics")).text
            in_flight = sum(
                _metric(text, f"shardserve_num_requests_{state}")
                for state in ("running", "waiting")
            )
            return in_flight == count

        await async_wait_until(
            all_in_flight, f"{count} requests in flight", timeout=60, interval=0.05
        )


async def _stream_text(url: str, max_tokens: int) -> tuple[str, int]:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:]).get("usage") or {}
    tokens = int(usage.get("completion_tokens", 0))
    return "".join(lines), tokens


async def _stream_all(url: str, max_tokens: int, count: int) -> list[tuple[str, int]]:
    return list(await asyncio.gather(*(_stream_text(url, max_tokens) for _ in range(count))))


@pytest.mark.timeout(240)
def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama")
    # One sequence at a time and several requests queued behind it: the drain lasts
    # seconds, so the probe below surely meets it, whatever the machine's speed.
    args = ["--model", str(model_dir), "--shutdown-timeout", "60", "--max-num-seqs", "1"]
    with live_server(args, tmp_path) as server:
        children = psutil.Process(server.process.pid).children(recursive=True)
        loop = asyncio.new_event_loop()
        in_flight = loop.create_task(_stream_all(server.url, 200, count=6))
        loop.run_until_complete(_until_in_flight(server.url, 6))  # running or queued
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        refused = None
        with httpx.Client(base_url=server.url, timeout=10) as http:
            while time.monotonic() < deadline:
                r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                if r.status_code == 503:
                    refused = r
                    break
                time.sleep(0.05)
        assert refused is not None and refused.json()["error"]["code"] == "shutting_down"
        results = loop.run_until_complete(in_flight)
        loop.close()
        assert [tokens for _text, tokens in results] == [200] * 6  # all finished in the drain
        assert server.process.wait(60) == 0, server.log()
        _gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive


@pytest.mark.timeout(240)
def test_disconnect_frees_kv_blocks(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama")
    with (
        live_server(["--model", str(model_dir)], tmp_path) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        body = {"prompt": "Hello world", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                if _kv_usage(http) > 0:
                    break  # blocks in use: now hang up
        deadline = time.monotonic() + 10
        while _kv_usage(http) != 0.0:
            # stats ride on step outputs: a tiny request makes the engine report them
            http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert time.monotonic() < deadline, http.get("/metrics").text
            time.sleep(0.1)
