"""The FastAPI application: routes only; the work is in the route modules.

:func:`build_app` is a factory (no module globals): the front door, then one ``_add_*`` function
per route family. ``POST /v1/completions`` (:mod:`server.api.completions`) and
``/v1/chat/completions`` (:mod:`server.api.chat`) answer JSON or SSE; ``POST /v1/embeddings``
needs an encoder replica; ``GET /health`` is 503 unless the engine is ready and the replica
alive; ``GET /v1/models`` and ``GET /metrics`` (Prometheus) complete the set.

Every request first passes the front door (:mod:`server.http.middleware`). A generation is then
checked in order: body (400) → model name (404) → engine serviceable (503) → vocabulary/context
(400; the tokenizing and templating run off the event loop, :class:`~server.http.offload.Offload`)
→ load shedding (429 + ``Retry-After``, :mod:`server.http.limits`), and ended by
``request_timeout_s`` (504, or an SSE error event once streaming). A chat request with
images or videos passes the model, engine and request-count checks before anything is
fetched or decoded (:func:`_admit_media`), then its tokens are counted. An embedding checks its task
and inputs in place of vocabulary/context. A client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from server.api import chat, completions, embeddings
from server.api.chat_protocol import ChatCompletionRequest
from server.api.choices import ChoiceRequests
from server.api.completion_protocol import CompletionRequest
from server.api.embeddings import EmbeddingRequest
from server.api.protocol import ModelCard, ModelList, new_id
from server.api.serving import ServedModel
from server.engine.client import Engine
from server.http import ttft_trace
from server.http.errors import APIError, install_error_handlers, validation_error
from server.http.lifecycle import Lifecycle
from server.http.limits import Admission, Ticket, timeout_error, with_deadline
from server.http.metrics import Metrics
from server.http.middleware import DEFAULT_MAX_REQUEST_BYTES, FrontDoor
from server.http.openapi import BodySchemas
from server.media import multimodal
from server.media.fetch import MediaOptions
from server.text import reasoning, tool_parsers
from server.text.chat_template import ChatTemplate
from server.text.tokenizer import Tokenizer

T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)

#: How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.5

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/models",
    "/health",
    "/metrics",
)


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


async def _parse(request: Request, model: type[B]) -> B:
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


async def _respond(
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
        return await _respond_streamed(request, frames, ticket, timeout_s)
    return await _respond_json(request, whole, ticket, timeout_s)


async def _respond_streamed(
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


async def _respond_json(
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


def _work_tokens(work: ChoiceRequests) -> int:
    """Tokens a plan may hold: each choice's prompt plus its ``max_tokens``."""
    return sum(len(r.prompt_token_ids) + r.max_tokens for r in work.requests)


@dataclass(frozen=True)
class _Limits:
    """What every work route applies between its checks and the engine."""

    admission: Admission
    request_timeout_s: float | None


def build_app(
    engine_client: Engine,
    tokenizer: Tokenizer,
    served_model_name: str,
    max_model_len: int,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics: Metrics | None = None,
    admission: Admission | None = None,
    request_timeout_s: float | None = None,
    lifecycle: Lifecycle | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    image_model: multimodal.ImageModel | None = None,
    media_options: MediaOptions | None = None,
    disable_docs: bool = False,
) -> FastAPI:
    """An OpenAI-compatible app serving ``served_model_name`` through ``engine_client``.

    ``api_key`` guards every ``/v1/*`` route; ``admission`` sheds load (default: no limit);
    ``request_timeout_s`` ends a generation or embedding (default: never); ``lifecycle``: the
    draining state the CLI flips on SIGTERM; ``tool_call_parser`` reads ``auto`` tool calls
    (default: :func:`server.text.tool_parsers.detect`); ``reasoning_parser`` splits the
    ``<think>`` block off chat answers (:mod:`server.text.reasoning`); ``image_model``: how a
    VLM takes images (``None``: text only); ``disable_docs`` (``--disable-fastapi-docs``) drops
    ``/docs``, ``/redoc`` and ``/openapi.json`` (else they need the API key when there is one).
    ``ValueError`` at start-up if the chat template does not compile.
    """
    metrics = metrics or Metrics()
    lifecycle = lifecycle or Lifecycle()
    limits = _Limits(admission or Admission(), request_timeout_s)
    schemas = BodySchemas()
    parser = tool_call_parser or tool_parsers.detect(tokenizer.chat_template)
    serving = ServedModel(
        engine_client,
        tokenizer,
        served_model_name,
        max_model_len,
        metrics,
        parser,
        image_model,
        media_options or MediaOptions(),
        reasoning=reasoning.reasoning_parser(reasoning_parser),
    )
    template = chat.load_template(serving)
    app = FastAPI(
        title="shardserve",
        summary="OpenAI-compatible completions",
        docs_url=None if disable_docs else "/docs",
        redoc_url=None if disable_docs else "/redoc",
        openapi_url=None if disable_docs else "/openapi.json",
    )
    _install_front_door(app, metrics, lifecycle, api_key, max_request_bytes)
    _add_status_routes(app, serving, lifecycle)
    _add_completion_route(app, serving, schemas, limits)
    _add_embedding_route(app, serving, schemas, limits)
    _add_chat_route(app, serving, template, schemas, limits)
    schemas.install(app)
    return app


def _install_front_door(
    app: FastAPI,
    metrics: Metrics,
    lifecycle: Lifecycle,
    api_key: str | None,
    max_request_bytes: int,
) -> None:
    """OpenAI-style error handlers, the :class:`FrontDoor` middleware, and around it the
    opt-in TTFT trace's (:class:`ttft_trace.TraceDoor`)."""
    install_error_handlers(app)
    app.add_middleware(
        FrontDoor,
        metrics=metrics,
        routes=ROUTES,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        lifecycle=lifecycle,
    )
    app.add_middleware(ttft_trace.TraceDoor)  # added last: the outermost


def _add_status_routes(app: FastAPI, serving: ServedModel, lifecycle: Lifecycle) -> None:
    """``GET /health``, ``GET /metrics`` and ``GET /v1/models``."""
    engine, metrics = serving.engine, serving.metrics

    @app.get("/health")
    async def health() -> Response:
        if lifecycle.draining:
            return APIError.unavailable("the server is shutting down").response()
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        reason = engine.dead_reason or "engine is not ready"
        return APIError.unavailable(reason).response()

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        name = serving.model_name
        modalities = serving.image_model.modalities if serving.image_model else ["text"]
        card = ModelCard(
            id=name, root=name, max_model_len=serving.max_model_len, modalities=modalities
        )
        return ModelList(data=[card])


def _add_completion_route(
    app: FastAPI, serving: ServedModel, schemas: BodySchemas, limits: _Limits
) -> None:
    """``POST /v1/completions``: JSON or SSE."""

    @app.post("/v1/completions", response_model=None, openapi_extra=schemas.body(CompletionRequest))
    async def create_completion(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        work: ChoiceRequests = await serving.offload.run(
            completions.prepare, serving, body, new_id("cmpl")
        )
        return await _respond(
            request,
            body.stream,
            lambda: completions.stream(serving, work, body),
            lambda: completions.complete(serving, work, body),
            limits.admission.admit(_work_tokens(work)),
            limits.request_timeout_s,
        )


def _add_embedding_route(
    app: FastAPI, serving: ServedModel, schemas: BodySchemas, limits: _Limits
) -> None:
    """``POST /v1/embeddings``: JSON, with the same shedding and deadline as generation."""

    @app.post("/v1/embeddings", response_model=None, openapi_extra=schemas.body(EmbeddingRequest))
    async def create_embedding(request: Request) -> Response:
        body = await _parse(request, EmbeddingRequest)
        work = await serving.offload.run(embeddings.prepare, serving, body)
        return await _respond_json(
            request,
            lambda: embeddings.embed(serving, work, body),
            limits.admission.admit(work.tokens),
            limits.request_timeout_s,
        )


def _add_chat_route(
    app: FastAPI,
    serving: ServedModel,
    template: ChatTemplate | None,
    schemas: BodySchemas,
    limits: _Limits,
) -> None:
    """``POST /v1/chat/completions``: JSON or SSE, rendered with ``template``."""

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=schemas.body(ChatCompletionRequest),
    )
    async def create_chat_completion(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        ticket = _admit_media(serving, body, limits.admission)
        try:
            media = serving.image_model, serving.media_options
            images = await multimodal.load_chat_images(body, *media)
            work = await serving.offload.run(
                chat.prepare, serving, template, body, new_id("chatcmpl"), images
            )
            tokens = _work_tokens(work)
            ticket = limits.admission.admit(tokens) if ticket is None else ticket.grow(tokens)
        except BaseException:
            if ticket is not None:
                ticket.release()
            raise
        return await _respond(
            request,
            body.stream,
            lambda: chat.stream(serving, work, body),
            lambda: chat.complete(serving, work, body),
            ticket,
            limits.request_timeout_s,
        )


def _admit_media(
    serving: ServedModel, body: ChatCompletionRequest, admission: Admission
) -> Ticket | None:
    """For a request with media: its 404/503, then its place (429), before any fetch."""
    if not multimodal.has_media(body):
        return None
    serving.check(body.model)
    return admission.admit(0)
