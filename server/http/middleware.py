"""The front door: a pure ASGI middleware every HTTP request passes first.

In order, for each request:

1. request id: the client's ``X-Request-Id`` (if short and printable) or a new
   one; set for logging (:mod:`server.http.request_context`) and echoed on every
   response, errors included;
2. auth: with an API key configured, every ``/v1/*`` route and the API docs
   (``/docs``, ``/redoc``, ``/openapi.json``) need ``Authorization: Bearer <key>``
   (compared in constant time) else 401; ``/health`` and ``/metrics`` stay open;
3. size: a body over ``max_request_bytes`` is a 413, decided from
   ``Content-Length`` before reading, or while reading a chunked body (the body
   is buffered up to the limit, then handed to the app);
4. draining (a graceful shutdown under way, :mod:`server.http.lifecycle`): every
   route but ``/metrics`` gets a 503; otherwise the request counts as in
   flight until its response has ended;
5. the app. The request is counted in the metrics by route (``other`` for
   unknown paths) and status when its response starts, and logged as one
   line when it ends (method and path escaped: a ``%0a`` in a path cannot
   forge another line).

Error bodies have the OpenAI shape. Streaming responses pass through
untouched (no buffering of the response).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

from starlette.datastructures import Headers, MutableHeaders

from server.http.errors import APIError
from server.http.lifecycle import Lifecycle
from server.http.metrics import Metrics
from server.http.request_context import choose_request_id, post_in_flight, request_id_var

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

access_log = logging.getLogger("shardserve.access")

#: Default ``--max-request-bytes``.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
OPEN_PATHS = frozenset({"/health", "/metrics"})
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
#: API routes outside ``/v1`` (vLLM's aliases), guarded by the API key like ``/v1/*``.
UNVERSIONED_API_PATHS = frozenset({"/score", "/rerank", "/classify"})


class _TooLarge(Exception):
    pass


class FrontDoor:
    """Wrap ``app``; see the module docstring for what it does to each request."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        routes: Collection[str],
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
        self.app = app
        self.metrics = metrics
        self.routes = frozenset(routes)
        self._key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.lifecycle = lifecycle or Lifecycle()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = choose_request_id(headers.get("x-request-id"))
        token = request_id_var.set(request_id)
        path: str = scope.get("path", "")
        route = path if path in self.routes else "other"
        status: int | None = None
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)["x-request-id"] = request_id
                self.metrics.count_http(route, status)  # before the client can see it
            await send(message)

        try:
            error = self._refusal(scope, headers)
            if error is None:
                try:
                    receive = await self._buffered(receive)
                except _TooLarge:
                    error = self._too_large()
            if error is not None:
                response = error.response()
                if error.status_code == 401:
                    response.headers["www-authenticate"] = "Bearer"
                await response(scope, receive, send_with_id)
            elif self.lifecycle.draining and path != "/metrics":
                await _shutting_down().response()(scope, receive, send_with_id)
            else:
                self.lifecycle.enter()
                counted = post_in_flight() if scope.get("method") == "POST" else None
                try:
                    with counted or contextlib.nullcontext():
                        await self.app(scope, receive, send_with_id)
                finally:
                    self.lifecycle.leave()
        finally:
            if status is None:  # no response started (the app raised)
                status = 500
                self.metrics.count_http(route, status)
            elapsed_ms = (time.perf_counter() - start) * 1000
            method = _escaped(str(scope.get("method")))
            access_log.info("%s %s %d %.1f ms", method, _escaped(path), status, elapsed_ms)
            request_id_var.reset(token)

    def _refusal(self, scope: Scope, headers: Headers) -> APIError | None:
        """The 401 or 413 decided from headers alone, if any."""
        path: str = scope.get("path", "")
        guarded = path.startswith("/v1") or path in DOCS_PATHS or path in UNVERSIONED_API_PATHS
        if self._key is not None and path not in OPEN_PATHS and guarded:
            scheme, _, credential = headers.get("authorization", "").partition(" ")
            given = credential.strip().encode() if scheme.lower() == "bearer" else b""
            if not hmac.compare_digest(given, self._key):
                return APIError(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body exceeds the limit of {self.max_request_bytes} bytes "
            "(--max-request-bytes)",
            code="request_too_large",
        )

    async def _buffered(self, receive: Receive) -> Receive:
        """Read the whole body (at most the limit), then replay it to the app."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected: let the app see it
                return _replay([message], receive)
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                raise _TooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return _replay([body], receive)


def _escaped(field: str) -> str:
    """``field`` with control characters, backslashes and non-ASCII as escapes."""
    if field.isprintable() and "\\" not in field:
        return field
    return field.encode("unicode_escape").decode("ascii")


def _shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down; retry on another instance",
        type="server_error",
        code="shutting_down",
    )


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
