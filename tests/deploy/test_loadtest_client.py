"""One streamed request, measured: how each kind of SSE stream fills its record."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from deploy.loadtest_lib.client import Target, stream_request
from deploy.loadtest_lib.records import RequestRecord
from deploy.loadtest_lib.workload import RequestSpec

SPEC = RequestSpec(prompt="hi", prompt_tokens=1, output_len=3)


def _sse(*events: object) -> bytes:
    lines = [f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events]
    return "".join(lines).encode()


async def _send(body: bytes, status: int = 200) -> RequestRecord:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body)

    record = RequestRecord(index=0, output_len=SPEC.output_len)
    transport = httpx.MockTransport(answer)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        await stream_request(
            client, Target("m", "completions"), SPEC, record, 10.0, time.perf_counter()
        )
    return record


def _text(t: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": t}]}


async def test_text_chunks_and_usage_fill_the_record() -> None:
    usage = {"choices": [], "usage": {"completion_tokens": 5, "prompt_tokens": 2}}
    record = await _send(_sse(_text("a"), _text(""), _text("b"), usage, "[DONE]"))
    assert record.status == "ok"
    assert record.chunks == 2 and len(record.itl_ms) == 1
    assert record.ttft_ms is not None and record.e2e_ms is not None
    assert (record.output_tokens, record.prompt_tokens, record.usage_reported) == (5, 2, True)


async def test_without_usage_the_text_chunks_are_the_output_tokens() -> None:
    record = await _send(_sse(_text("a"), _text("b"), _text("c"), "[DONE]"))
    assert (record.status, record.output_tokens, record.usage_reported) == ("ok", 3, False)


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (_sse({"choices": []}, "[DONE]"), "protocol", "carried no text"),
        (_sse(_text("a"), {"error": {"message": "boom"}}), "stream_error", "boom"),
        (_sse([1, 2]), "protocol", "not a JSON object"),
    ],
    ids=["no-text", "error-event", "not-an-object"],
)
async def test_bad_streams_are_recorded_not_raised(body: bytes, status: str, error: str) -> None:
    record = await _send(body)
    assert record.status == status
    assert record.error is not None and error in record.error
    assert record.e2e_ms is None


async def test_a_non_200_answer_keeps_its_status_and_text() -> None:
    record = await _send(b"overloaded", status=503)
    assert (record.status, record.error) == ("http_503", "overloaded")
