"""Answering a generation: the body parsed, then JSON or SSE, within a deadline and a ticket.

:func:`parse_body` reads a raw body with pydantic (a 400 naming the field, never FastAPI's 422);
:func:`respond` sends a stream's frames as SSE or a whole answer as JSON, aborting the
generation if the client leaves (499) or ``request_timeout_s`` passes (504, or an SSE error
event once streaming), and releases the load-shedding ticket however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from server.api.choices import ChoiceRequests
from server.http import ttft_trace
from server.http.errors import validation_error
from server.http.limits import Admission, Ticket, timeout_error, with_deadline

T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)

#: How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (aborting the generation) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _chain(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """``first`` then ``rest``; closing this closes ``rest`` (which aborts the request)."""
    async with contextlib.aclosing(rest):
        yield first
        async for frame in rest:
            yield frame


async def parse_body(request: Request, model: type[B]) -> B:
    return _validate(await request.body(), model)


@ttft_trace.span("body_read", "validated")
def _validate(raw: bytes, model: type[B]) -> B:
    """``raw`` as a ``model``, or the 400 naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


@ttft_trace.first("first_frame")
async def _released(
    frames: AsyncGenerator[bytes, None], ticket: Ticket
) -> AsyncGenerator[bytes, None]:
    """``frames``, then ``ticket`` released (however the stream ends)."""
    try:
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame
    finally:
        ticket.release()


async def respond(
    request: Request,
    streamed: bool,
    frames: Callable[[], AsyncGenerator[bytes, None]],
    whole: Callable[[], Awaitable[BaseModel]],
    ticket: Ticket,
    timeout_s: float | None,
) -> Response:
    """Send ``frames()`` as SSE or ``whole()`` as JSON; abort if the client leaves or the
    ``timeout_s`` deadline passes; ``ticket`` is released when the response is done."""
    if streamed:
        return await respond_streamed(request, frames, ticket, timeout_s)
    return await respond_json(request, whole, ticket, timeout_s)


async def respond_streamed(
    request: Request,
    frames: Callable[[], AsyncGenerator[bytes, None]],
    ticket: Ticket,
    timeout_s: float | None,
) -> Response:
    """``frames()`` as SSE, ended at the ``timeout_s`` deadline; see :func:`_respond`."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    stream = _released(with_deadline(frames(), deadline, timeout_s), ticket)
    try:  # the first frame decides the status: a refusal is still a 4xx
        first = await _unless_disconnected(request, anext(stream))
    except _ClientGone:
        await stream.aclose()
        return Response(status_code=499)
    except StopAsyncIteration:  # cannot happen: a stream always ends with [DONE]
        first = b""
    except BaseException:
        await stream.aclose()
        raise
    return StreamingResponse(
        _chain(first, stream),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def respond_json(
    request: Request,
    whole: Callable[[], Awaitable[BaseModel]],
    ticket: Ticket,
    timeout_s: float | None,
) -> Response:
    """``whole()`` as JSON: 504 (cancelled, so aborted) past the ``timeout_s`` deadline,
    499 if the client left first; ``ticket`` is released either way."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            result = await _unless_disconnected(request, whole())
    except _ClientGone:
        return Response(status_code=499)
    except TimeoutError:
        raise timeout_error(timeout_s or 0.0) from None
    finally:
        ticket.release()
    return JSONResponse(result.model_dump())


def work_tokens(work: ChoiceRequests) -> int:
    """Tokens a plan may hold: each choice's prompt plus its ``max_tokens``."""
    return sum(len(r.prompt_token_ids) + r.max_tokens for r in work.requests)


@dataclass(frozen=True)
class Limits:
    """What every work route applies between its checks and the engine."""

    admission: Admission
    request_timeout_s: float | None
