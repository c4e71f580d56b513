"""The front door: API key, body size limit, X-Request-Id, and log lines carrying it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from server.http.request_context import RequestIdFilter
from tests.server.conftest import API_KEY, ServeFactory
from tests.server.error_body import assert_error

pytestmark = pytest.mark.timeout(60)

GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": "Basic x"},
    ],
)
async def test_api_key_required_on_v1(serve: ServeFactory, headers: dict[str, str]) -> None:
    served = await serve(api_key=API_KEY)
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions")]:
        response = await served.http.request(method, path, json=GOOD, headers=headers)
        error = assert_error(response, 401)
        assert error["code"] == "invalid_api_key" and API_KEY not in response.text
        assert response.headers["www-authenticate"] == "Bearer"
    unknown = await served.http.get("/v1/nope", headers=headers)
    assert unknown.status_code == 401  # no probing of routes without the key


async def test_api_key_accepted_and_open_routes(serve: ServeFactory) -> None:
    served = await serve(api_key=API_KEY)
    assert (await served.http.post("/v1/completions", json=GOOD, headers=AUTH)).status_code == 200
    assert (await served.http.get("/v1/models", headers=AUTH)).status_code == 200
    assert (await served.http.get("/health")).status_code == 200
    assert (await served.http.get("/metrics")).status_code == 200


async def test_no_key_configured_means_open(serve: ServeFactory) -> None:
    served = await serve()
    assert (await served.http.post("/v1/completions", json=GOOD)).status_code == 200


async def test_body_too_large_413(serve: ServeFactory) -> None:
    served = await serve(max_request_bytes=1000)
    big = {**GOOD, "prompt": "x" * 2000}
    error = assert_error(await served.http.post("/v1/completions", json=big), 413)
    assert error["code"] == "request_too_large" and "1000" in error["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    response = await served.http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(response, 413)
    assert (await served.http.post("/v1/completions", json=GOOD)).status_code == 200


async def test_request_id_echoed_or_generated(serve: ServeFactory) -> None:
    served = await serve(api_key=API_KEY)
    given = {"X-Request-Id": "my-trace-123", **AUTH}
    response = await served.http.post("/v1/completions", json=GOOD, headers=given)
    assert response.headers["x-request-id"] == "my-trace-123"
    response = await served.http.post("/v1/completions", json=GOOD, headers=AUTH)
    generated = response.headers["x-request-id"]
    assert len(generated) == 32
    # errors too (401 from the door, 400 from the route), and a malformed id is replaced
    assert (await served.http.get("/v1/models", headers={"X-Request-Id": "r1"})).headers[
        "x-request-id"
    ] == "r1"
    bad = await served.http.post(
        "/v1/completions", json={"prompt": ""}, headers={"X-Request-Id": "r2", **AUTH}
    )
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "r2"
    odd = await served.http.get("/health", headers={"X-Request-Id": "a b\tc"})
    assert odd.headers["x-request-id"] != "a b\tc"


async def test_streamed_response_carries_request_id(serve: ServeFactory) -> None:
    served = await serve()
    body = {**GOOD, "stream": True}
    async with served.http.stream(
        "POST", "/v1/completions", json=body, headers={"X-Request-Id": "s-1"}
    ) as response:
        assert response.headers["x-request-id"] == "s-1"
        await response.aread()


async def test_log_lines_carry_the_request_id(
    serve: ServeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    served = await serve()
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO, logger="shardserve.access"):
        await served.http.post("/v1/completions", json=GOOD, headers={"X-Request-Id": "log-me"})
    lines = [r for r in caplog.records if r.name == "shardserve.access"]
    assert any(getattr(r, "request_id", None) == "log-me" for r in lines)
    assert any("/v1/completions 200" in r.getMessage() for r in lines)


async def test_never_422(serve: ServeFactory) -> None:
    served = await serve()
    cases = [
        ("/v1/completions", b"\xff\xfe", None),
        ("/v1/completions", b"null", None),
        ("/v1/completions", b'{"prompt": 5}', "prompt"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', "messages"),
        ("/v1/chat/completions", b"[]", None),
    ]
    for path, content, param in cases:
        response = await served.http.post(
            path, content=content, headers={"content-type": "application/json"}
        )
        assert_error(response, 400, param)


async def test_access_log_fields_are_escaped(
    serve: ServeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``%0a`` in the path cannot forge a second access-log line."""
    served = await serve()
    with caplog.at_level(logging.INFO, logger="shardserve.access"):
        await served.http.get("/v1/x%0d%0aGET%20/v1/models%20200%20%5Cn")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "shardserve.access"]
    assert line.startswith("GET /v1/x\\r\\nGET /v1/models 200 \\\\n 404 ")
    assert line.isprintable()


DOCS = ("/docs", "/redoc", "/openapi.json")


async def test_api_docs_need_the_key(serve: ServeFactory) -> None:
    served = await serve(api_key=API_KEY)
    for path in DOCS:
        assert_error(await served.http.get(path), 401)
        assert (await served.http.get(path, headers=AUTH)).status_code == 200, path


async def test_api_docs_can_be_disabled(serve: ServeFactory) -> None:
    served = await serve(app_options={"disable_docs": True})
    for path in DOCS:
        assert (await served.http.get(path)).status_code == 404, path
    assert (await served.http.get("/health")).status_code == 200
