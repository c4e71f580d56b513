"""The FastAPI application: routes only; the work is in :mod:`server.completions`.

:func:`build_app` is a factory (no module globals): everything a route needs
is captured from its arguments. Routes:

* ``POST /v1/completions``: OpenAI completions, JSON or SSE (``stream: true``);
* ``GET /v1/models``: the one served model, with ``max_model_len``;
* ``GET /health``: 200 when the engine is ready and the replica alive, else 503.

Order of checks for a completion: body (400) → model name (404) → engine
health (503) → vocabulary/context (400) → generation. A non-streamed request
whose client disconnects is aborted on the engine, as a streamed one is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from server.completions import complete, prepare, stream
from server.engine_client import EngineClient
from server.errors import APIError, install_error_handlers, validation_error
from server.protocol import CompletionRequest, ModelCard, ModelList, new_completion_id
from server.tokenizer import Tokenizer

T = TypeVar("T")

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


def build_app(
    engine_client: EngineClient,
    tokenizer: Tokenizer,
    served_model_name: str,
    max_model_len: int,
) -> FastAPI:
    """An OpenAI-compatible app serving ``served_model_name`` through ``engine_client``."""
    app = FastAPI(title="shardserve", summary="OpenAI-compatible completions")
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine_client.healthy:
            return JSONResponse({"status": "ok"})
        reason = engine_client.dead_reason or "engine is not ready"
        return APIError.unavailable(reason).response()

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=served_model_name, root=served_model_name, max_model_len=max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        try:
            body = CompletionRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise validation_error(list(exc.errors())) from None
        if body.model is not None and body.model != served_model_name:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist; this server serves "
                f"`{served_model_name}`.",
                param="model",
                code="model_not_found",
            )
        info = engine_client.info
        if info is None or not engine_client.healthy:
            raise APIError.unavailable(engine_client.dead_reason or "engine is not ready")
        generate = prepare(body, new_completion_id(), tokenizer, info.vocab_size, max_model_len)
        if body.stream:
            frames = stream(engine_client, tokenizer, generate, body, served_model_name)
            try:  # the first frame decides the status: a refusal is still a 4xx
                first = await _unless_disconnected(request, anext(frames))
            except _ClientGone:
                await frames.aclose()
                return Response(status_code=499)
            except StopAsyncIteration:  # cannot happen: a stream always ends with [DONE]
                first = b""
            return StreamingResponse(
                _chain(first, frames),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            result = await _unless_disconnected(
                request, complete(engine_client, tokenizer, generate, body, served_model_name)
            )
        except _ClientGone:
            return Response(status_code=499)
        return JSONResponse(result.model_dump())

    return app
