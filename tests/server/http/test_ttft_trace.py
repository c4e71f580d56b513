"""Opt-in TTFT tracing in the frontend, against a fake engine behind a live uvicorn.

On: every stage of a streamed request is stamped in path order, the request goes to the
engine flagged for rank 0's stamps, those stamps come back with the first output, and one
JSON line per request is written at the first flush. Off: nothing is flagged or kept.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from model_shards.messages import StepOutputs, decode_engine_message, encode
from server.http import ttft_trace
from tests.server.conftest import ServeFactory
from tests.server.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)

FRONTEND_STAGES = [
    "http_received",
    "body_read",
    "validated",
    "tokenize_start",
    "tokenized",
    "submitted",
    "batch_sent",
    "frontend_received",
    "detokenized",
    "first_frame",
    "first_flush",
]


class _Stamping:
    """A socket wrapper adding rank-0-like stamps to a traced request's first output."""

    def __init__(self, sock: zmq.Socket[bytes], engine: FakeEngine) -> None:
        self._sock, self._engine = sock, engine

    def send_multipart(self, frames: list[bytes]) -> None:
        peer, payload = frames
        message = decode_engine_message(payload)
        if isinstance(message, StepOutputs):
            outputs = [
                msgspec.structs.replace(o, trace={"received": 1, "sampled": 2})
                if self._engine.requests[o.request_id].trace and o.num_prompt_tokens
                else o
                for o in message.outputs
            ]
            payload = encode(msgspec.structs.replace(message, outputs=outputs))
        self._sock.send_multipart([peer, payload])


class StampingEngine(FakeEngine):
    def _step(self, sock: zmq.Socket[bytes]) -> None:
        super()._step(_Stamping(sock, self))  # type: ignore[arg-type]


@pytest.fixture
def trace_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "trace.jsonl"
    ttft_trace.enable(path)
    try:
        yield path
    finally:
        ttft_trace.enable(None)


async def test_streamed_request_is_traced_in_path_order(
    serve: ServeFactory, trace_file: Path
) -> None:
    served = await serve(engine_class=StampingEngine)
    body = {"prompt": "hello world", "max_tokens": 3, "stream": True}
    async with served.http.stream("POST", "/v1/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
    response_id = json.loads(lines[0][6:])["id"]
    (record,) = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert record["request_ids"] == [response_id]
    assert served.engine.requests[response_id].trace  # rank 0 was asked for its stamps
    assert record["engine"] == {"received": 1, "sampled": 2}
    stamps = record["frontend"]
    assert list(stamps) == FRONTEND_STAGES
    times = [stamps[s] for s in FRONTEND_STAGES]
    assert times == sorted(times) and times[-1] <= time.monotonic_ns()


async def test_json_request_is_written_when_done(serve: ServeFactory, trace_file: Path) -> None:
    served = await serve()
    response = await served.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200
    (record,) = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert record["request_ids"] == [response.json()["id"]]
    assert "first_flush" not in record["frontend"] and "frontend_received" in record["frontend"]


async def test_off_by_default(serve: ServeFactory) -> None:
    served = await serve()
    body = {"prompt": "hello", "max_tokens": 2, "stream": True}
    async with served.http.stream("POST", "/v1/completions", json=body) as response:
        assert [line async for line in response.aiter_lines()][-2:] == ["data: [DONE]", ""]
    assert [r.trace for r in served.engine.requests.values()] == [False]
    assert not ttft_trace._by_request  # nothing kept


@ttft_trace.span("start", "end")
def _double(x: int) -> int:
    return 2 * x


@ttft_trace.first("first_item")
async def _count(closed: list[bool]) -> AsyncGenerator[int, None]:
    try:
        for i in range(3):
            yield i
    finally:
        closed.append(True)


async def test_seams_pass_through_untraced_and_stamp_traced() -> None:
    closed: list[bool] = []
    items = _count(closed)
    assert items.ag_code is _count.__wrapped__.__code__  # type: ignore[attr-defined]
    assert await anext(items) == 0  # untraced: the generator itself, no wrapper
    await items.aclose()
    assert _double(2) == 4
    trace = ttft_trace.Trace()
    token = ttft_trace._current.set(trace)
    try:
        assert _double(1) == 2
        first_end = trace.frontend["end"]
        while time.monotonic_ns() == first_end:  # a coarse clock: let it tick
            pass
        assert _double(2) == 4
        async with contextlib.aclosing(_count(closed)) as counted:
            assert await anext(counted) == 0
            stamped = trace.frontend["first_item"]
            assert await anext(counted) == 1
    finally:
        ttft_trace._current.reset(token)
    assert closed == [True, True]  # closing the stamped stream closed the generator
    assert list(trace.frontend) == ["start", "end", "first_item"]
    assert trace.frontend["start"] <= first_end < trace.frontend["end"] <= stamped  # last end
    assert trace.frontend["first_item"] == stamped  # the first item's stamp is kept
