"""Opt-in time-to-first-token tracing: where one request's time goes until its first byte.

Off unless ``SHARDSERVE_TTFT_TRACE`` names a file when the frontend starts (or
:func:`enable` is called); then every HTTP request carries a :class:`Trace` in a
context variable (set by the front door, so every task a request spawns sees it) and
each stage stamps ``time.monotonic_ns()`` into it: ``http_received`` (front door),
``body_read`` and ``validated`` (route), ``tokenize_start``/``tokenized``,
``submitted`` (to the engine client; the request is sent with
``GenerateRequest.trace``), ``batch_sent`` (the batcher flushed it),
``frontend_received`` (its first output arrived; rank 0's own stamps,
:mod:`model_shards.engine.request_trace`, come with it), ``detokenized`` (first text),
``first_frame`` (the first SSE frame built) and ``first_flush`` (handed to the
socket). ``CLOCK_MONOTONIC`` is one clock for the whole host, so the stamps of rank 0
and of a client on the same machine line up with these.

At the first flush (or when the response ends, for a JSON response) the trace is
appended to the file as one JSON line ``{"request_ids", "frontend", "engine"}``
(:mod:`benchmarks.suites.ttft` reads it). Each stage keeps its first stamp except
``tokenized`` (the last). Disabled, every call is one context-variable lookup.
"""

from __future__ import annotations

import json
import os
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from model_shards.messages import GenerateRequest, RequestOutput

TRACE_ENV = "SHARDSERVE_TTFT_TRACE"


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


def begin() -> Token[Trace | None] | None:
    """The front door: a new request starts (a no-op unless tracing is on); pass the
    result to :func:`end` when the response is done."""
    if _path is None:
        return None
    return _current.set(Trace({"http_received": time.monotonic_ns()}))


def mark(stage: str, *, last: bool = False) -> None:
    """Stamp ``stage`` now on the current request's trace (first stamp kept, or the
    ``last`` one)."""
    trace = _current.get()
    if trace is not None:
        now = time.monotonic_ns()
        if last:
            trace.frontend[stage] = now
        else:
            trace.frontend.setdefault(stage, now)


def traced(request: GenerateRequest) -> GenerateRequest:
    """``request`` as sent to the engine: flagged for rank 0's stamps when traced."""
    trace = _current.get()
    if trace is None:
        return request
    mark("submitted")
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
    trace = _by_request.pop(output.request_id, None)
    if trace is not None:
        trace.frontend.setdefault("frontend_received", time.monotonic_ns())
        trace.engine.update(output.trace or {})


def first_flush() -> None:
    """The first response bytes went to the socket: stamp and write the trace."""
    mark("first_flush")
    end()


def end(token: Token[Trace | None] | None = None) -> None:
    """The response is done (or its first bytes were sent): write the trace once; with
    :func:`begin`'s ``token`` (the front door, same context), forget it too."""
    trace = _current.get()
    if token is not None:
        _current.reset(token)
    if trace is None or trace.written:
        return
    trace.written = True
    for rid in trace.request_ids:
        _by_request.pop(rid, None)
    path = _path
    if path is not None and trace.request_ids:  # a generation (not /v1/models, /metrics)
        record = {
            "request_ids": trace.request_ids,
            "frontend": trace.frontend,
            "engine": trace.engine,
        }
        with path.open("a") as sink:
            sink.write(json.dumps(record) + "\n")
