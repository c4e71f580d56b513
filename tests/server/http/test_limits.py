"""Load shedding (429 + Retry-After) and --request-timeout (504 / SSE error), on the fake engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.http.errors import APIError
from server.http.limits import Admission
from tests.server.conftest import ServeFactory
from tests.waiting import async_wait_until


async def test_queue_limits_refuse_with_429_and_retry_after(serve: ServeFactory) -> None:
    served = await serve(step_s=0.05, app_options={"admission": Admission(max_requests=2)})
    body = {"prompt": "Hello world", "max_tokens": 20, "ignore_eos": True}
    slow = [asyncio.ensure_future(served.http.post("/v1/completions", json=body)) for _ in range(2)]
    await async_wait_until(lambda: len(served.engine.active_ids) == 2, "both to be generating")
    refused = await served.http.post("/v1/completions", json=body)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_overloaded"
    assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
    again = await served.http.post("/v1/completions", json=body)
    assert again.status_code == 200  # the slots came back


async def test_token_limit_counts_prompt_and_max_tokens(serve: ServeFactory) -> None:
    served = await serve(step_s=0.05, app_options={"admission": Admission(max_tokens=40)})
    body = {"prompt": "Hello world", "max_tokens": 30, "ignore_eos": True}
    first = asyncio.ensure_future(served.http.post("/v1/completions", json=body))
    await async_wait_until(lambda: len(served.engine.active_ids) == 1, "the first to generate")
    refused = await served.http.post("/v1/completions", json=body)
    assert refused.status_code == 429 and "max-queued-tokens" in refused.text
    assert (await first).status_code == 200


async def test_request_timeout_is_504_and_aborts(serve: ServeFactory) -> None:
    served = await serve(step_s=0.05, app_options={"request_timeout_s": 0.3})
    body = {"prompt": "Hello world", "max_tokens": 200, "ignore_eos": True}
    r = await served.http.post("/v1/completions", json=body)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "request_timeout"
    await async_wait_until(lambda: len(served.engine.aborted) == 1, "the abort to reach the engine")
    assert served.engine.active_ids == []


async def test_request_timeout_ends_a_stream_with_an_error_event(serve: ServeFactory) -> None:
    served = await serve(step_s=0.05, app_options={"request_timeout_s": 0.5})
    body = {"prompt": "Hello world", "max_tokens": 200, "ignore_eos": True, "stream": True}
    lines = []
    async with served.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "request_timeout"
    assert len(lines) > 3  # some text came before the deadline
    await async_wait_until(lambda: served.engine.active_ids == [], "the engine to stop generating")


async def test_hostile_bodies_are_4xx_and_harmless(serve: ServeFactory) -> None:
    served = await serve()
    bodies = [
        b'{"prompt": "a", "temperature": NaN}',
        b'{"prompt": "a", "top_p": Infinity}',
        b'{"prompt": "a", "top_k": 1000000000000000000000000000000}',
        b'{"prompt": "a", "max_tokens": 1000000000000000000000000000000}',
        b'{"prompt": [1, 2, 100000000000000000000000000]}',
        b'{"prompt": "\xff\xfe"}',
        b"[" * 5000 + b"]" * 5000,
        b'{"prompt": "a", "n": "2"}',
        b'{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}',
        b'{"prompt": "a", "logprobs": 21}',
    ]
    for raw in bodies:
        r = await served.http.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert 400 <= r.status_code < 500, (raw[:60], r.text)
        assert r.json()["error"]["message"]
    ok = await served.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_media_ticket_grows_within_the_token_limit() -> None:
    """A request with media is admitted with no tokens, then grows by its prompt's; a
    refusal then gives its place back."""
    admission = Admission(max_tokens=10)
    other = admission.admit(8)
    ticket = admission.admit(0)
    with pytest.raises(APIError) as caught:
        ticket.grow(5)
    assert caught.value.status_code == 429
    assert (admission.requests, admission.tokens) == (1, 8)
    other.release()
    alone = admission.admit(0).grow(50)  # alone, a request is never refused for its size
    assert (admission.requests, admission.tokens) == (1, 50)
    alone.release()
    assert (admission.requests, admission.tokens) == (0, 0)
