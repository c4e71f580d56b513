"""Opt-in time-to-first-token tracing: where one request's time goes until its first byte.

Off unless ``SHARDSERVE_TTFT_TRACE`` names a file when the frontend starts (or
:func:`enable` is called); then every HTTP request carries a :class:`Trace` in a
context variable (every task a request spawns sees it) and each stage stamps
``time.monotonic_ns()`` into it. The stamps attach at a few seams, not inside the code:

* :class:`TraceDoor`, the outermost ASGI middleware: ``http_received``, and ``first_flush``
  (the first chunk of a streamed body handed to the socket);
* :func:`span` on a function (its call and its return): ``body_read``/``validated`` (the
  route's body validation), ``tokenize_start``/``tokenized`` (``Tokenizer.encode``);
* :func:`first` on an async generator function (its first item): ``detokenized``
  (``generate_text``), ``first_frame`` (the route's SSE frames);
* the engine client's wire: :func:`traced` (``submitted``; the request goes to rank 0 with
  ``GenerateRequest.trace``), :func:`mark_requests` (``batch_sent``) and
  :func:`engine_output` (``frontend_received``, with rank 0's own stamps,
  :mod:`model_shards.engine.request_trace`).

``CLOCK_MONOTONIC`` is one clock for the whole host, so the stamps of rank 0 and of a client on
the same machine line up with these. At the first flush (or when the response ends, for a JSON
response) the trace is appended to the file as one JSON line ``{"request_ids", "frontend",
"engine"}`` (:mod:`benchmarks.suites.ttft` reads it). Each stage keeps its first stamp except a
span's end (the last). Disabled, a seam costs one context-variable lookup per request (per
engine output in the client) and allocates nothing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import AsyncGenerator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model_shards.messages import GenerateRequest, RequestOutput

TRACE_ENV = "SHARDSERVE_TTFT_TRACE"

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


@dataclass
class Trace:
    """One HTTP request's stamps (ns), its engine request ids and rank 0's stamps."""

    frontend: dict[str, int] = field(default_factory=dict)
    engine: dict[str, int] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)
    written: bool = False


_current: ContextVar[Trace | None] = ContextVar("shardserve_ttft_trace", default=None)
_by_request: dict[str, Trace] = {}  # traced engine requests not answered yet
_path: Path | None = Path(os.environ[TRACE_ENV]) if os.environ.get(TRACE_ENV) else None


def enable(path: Path | None) -> None:
    """Write traces to ``path`` from now on (``None``: tracing off)."""
    global _path
    _path = path


class TraceDoor:
    """ASGI middleware around the whole app (the front door included): while tracing is on,
    each HTTP request gets a :class:`Trace`, written at its first streamed flush or else when
    its response ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _path is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace = Trace({"http_received": time.monotonic_ns()})
        token = _current.set(trace)

        async def send_traced(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and message.get("more_body"):
                trace.frontend.setdefault("first_flush", time.monotonic_ns())
                _write(trace)

        try:
            await self.app(scope, receive, send_traced)
        finally:
            _current.reset(token)
            _write(trace)


def span(start: str, end: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function: within a traced request, ``start`` is stamped as it is called
    (the first call's kept) and ``end`` as it returns (the last call's kept)."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def spanned(*args: P.args, **kwargs: P.kwargs) -> R:
            trace = _current.get()
            if trace is None:
                return fn(*args, **kwargs)
            trace.frontend.setdefault(start, time.monotonic_ns())
            result = fn(*args, **kwargs)
            trace.frontend[end] = time.monotonic_ns()
            return result

        return spanned

    return decorate


def first(
    stage: str,
) -> Callable[[Callable[P, AsyncGenerator[T, None]]], Callable[P, AsyncGenerator[T, None]]]:
    """Decorate an async generator function: within a traced request, ``stage`` is stamped
    when the first item comes out; untraced, the call returns the generator itself."""

    def decorate(
        fn: Callable[P, AsyncGenerator[T, None]],
    ) -> Callable[P, AsyncGenerator[T, None]]:
        @functools.wraps(fn)
        def stamped(*args: P.args, **kwargs: P.kwargs) -> AsyncGenerator[T, None]:
            items = fn(*args, **kwargs)
            trace = _current.get()
            return items if trace is None else _stamp_first(items, trace.frontend, stage)

        return stamped

    return decorate


async def _stamp_first(
    items: AsyncGenerator[T, None], stamps: dict[str, int], stage: str
) -> AsyncGenerator[T, None]:
    """``items`` unchanged, ``stage`` stamped at the first; closing this closes ``items``."""
    async with contextlib.aclosing(items):
        async for item in items:
            if stage not in stamps:
                stamps[stage] = time.monotonic_ns()
            yield item


def traced(request: GenerateRequest) -> GenerateRequest:
    """``request`` as sent to the engine: flagged for rank 0's stamps when traced."""
    trace = _current.get()
    if trace is None:
        return request
    trace.frontend.setdefault("submitted", time.monotonic_ns())
    trace.request_ids.append(request.request_id)
    _by_request[request.request_id] = trace
    return msgspec.structs.replace(request, trace=True)


def mark_requests(requests: list[GenerateRequest], stage: str) -> None:
    """Stamp ``stage`` on the traces of the traced ``requests`` (outside their context)."""
    if not _by_request:
        return
    now = time.monotonic_ns()
    for request in requests:
        trace = _by_request.get(request.request_id)
        if trace is not None:
            trace.frontend.setdefault(stage, now)


def engine_output(output: RequestOutput) -> None:
    """An output arrived from rank 0: keep its stamps (the first output carries them)."""
    if not _by_request:
        return
    trace = _by_request.pop(output.request_id, None)
    if trace is not None:
        trace.frontend.setdefault("frontend_received", time.monotonic_ns())
        trace.engine.update(output.trace or {})


def _write(trace: Trace) -> None:
    """Append ``trace`` to the file once, if it is a generation's (not ``/v1/models``)."""
    if trace.written:
        return
    trace.written = True
    for rid in trace.request_ids:
        _by_request.pop(rid, None)
    path = _path
    if path is not None and trace.request_ids:
        record = {
            "request_ids": trace.request_ids,
            "frontend": trace.frontend,
            "engine": trace.engine,
        }
        with path.open("a") as sink:
            sink.write(json.dumps(record) + "\n")
