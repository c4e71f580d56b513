"""/health and request failures when the engine is not ready, dies, or reports a fatal error."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.server.conftest import ServeFactory
from tests.server.sse import read_events
from tests.waiting import async_wait_until

pytestmark = pytest.mark.timeout(60)

GOOD = {"prompt": "Hello", "max_tokens": 1}


async def wait_until(condition: Callable[[], bool]) -> None:
    await async_wait_until(condition, "the engine's record to change")


async def test_health_ok(serve: ServeFactory) -> None:
    served = await serve()
    response = await served.http.get("/health")
    assert response.status_code == 200


async def test_not_ready_then_ready(serve: ServeFactory) -> None:
    served = await serve(ready=False, wait_ready=False)
    response = await served.http.get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert (await served.http.post("/v1/completions", json=GOOD)).status_code == 503
    served.engine.set_ready()
    await wait_until(lambda: served.client.info is not None)
    assert (await served.http.get("/health")).status_code == 200
    assert (await served.http.post("/v1/completions", json=GOOD)).status_code == 200


async def test_dead_engine_fails_pending_and_health(serve: ServeFactory) -> None:
    served = await serve(step_s=0.05)
    body = {"prompt": "Hello world", "max_tokens": 200, "stream": True}
    async with served.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        first = await anext(lines)
        assert first.startswith("data: {")
        served.engine.stop()  # the replica dies mid-request
        rest = [line async for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"engine_unavailable"' in rest[-2]
    assert (await served.http.get("/health")).status_code == 503
    response = await served.http.post("/v1/completions", json=GOOD)
    assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"


async def test_fatal_engine_error_non_streamed(serve: ServeFactory) -> None:
    served = await serve(step_s=0.05)
    body = {"prompt": "Hello world", "max_tokens": 200}
    pending = asyncio.ensure_future(served.http.post("/v1/completions", json=body))
    await wait_until(lambda: bool(served.engine.batches))
    served.engine.send_fatal("CUDA error: device lost")
    response = await pending
    assert response.status_code == 503
    assert "device lost" in response.json()["error"]["message"]
    assert (await served.http.get("/health")).status_code == 503


async def test_stream_disconnect_aborts(serve: ServeFactory) -> None:
    served = await serve(step_s=0.02)
    body = {"prompt": "Hello world", "max_tokens": 250, "stream": True}
    async with served.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        await anext(lines)
    (rid,) = served.engine.requests
    await wait_until(lambda: rid in served.engine.aborted)
    await wait_until(lambda: served.client.num_pending == 0)


async def test_non_streamed_disconnect_aborts(serve: ServeFactory) -> None:
    served = await serve(step_s=0.05)
    body = {"prompt": "Hello world", "max_tokens": 250}
    pending = asyncio.ensure_future(served.http.post("/v1/completions", json=body))
    await wait_until(lambda: bool(served.engine.requests))
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    (rid,) = served.engine.requests
    await wait_until(lambda: rid in served.engine.aborted)


async def test_full_stream_sends_no_abort(serve: ServeFactory) -> None:
    served = await serve()
    body = {"prompt": "Hello world", "max_tokens": 5, "stream": True}
    async with served.http.stream("POST", "/v1/completions", json=body) as response:
        events, done = await read_events(response)
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"
    # an abort would travel the same ordered socket as the next request: once that request
    # has reached the engine, any abort of the first would have arrived before it
    follow_up = await served.http.post("/v1/completions", json=GOOD)
    assert follow_up.status_code == 200
    await wait_until(lambda: len(served.engine.requests) == 2)
    assert served.engine.aborted == []
