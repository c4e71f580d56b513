"""The FastAPI application: routes only; the work is in the route modules.

:func:`build_app` is a factory (no module globals): the front door, then one ``_add_*`` function
per route family. ``POST /v1/completions`` (:mod:`server.api.completions`) and
``/v1/chat/completions`` (:mod:`server.api.chat`) answer JSON or SSE, as does
``/v1/responses`` (:mod:`server.api.responses`, a chat request underneath; ``GET`` and
``DELETE /v1/responses/{id}`` on its store); ``POST /v1/embeddings`` needs an encoder replica,
the classifier routes (``/v1/score``, ``/v1/rerank``, ``/classify``:
:mod:`server.http.pooling_routes`) a cross-encoder; ``GET /health`` is 503 unless the engine
is ready and the replica alive; ``GET /v1/models``, ``GET /metrics`` (Prometheus) end the set.

Every request first passes the front door (:mod:`server.http.middleware`). A generation is then
checked in order: body (400) → model name (404) → engine serviceable (503) → vocabulary/context
(400; the tokenizing and templating run off the event loop, :class:`~server.http.offload.Offload`)
→ load shedding (429 + ``Retry-After``, :mod:`server.http.limits`), and ended by
``request_timeout_s`` (504, or an SSE error event once streaming). A chat (or Responses) request
with images or videos passes the model, engine and request-count checks before anything is
fetched or decoded (:func:`_admit_media`), then its tokens are counted. An embedding checks its task
and inputs in place of vocabulary/context. A client that disconnects aborts its request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from server.api import chat, completions, embeddings, responses, responses_stream
from server.api.chat_protocol import ChatCompletionRequest
from server.api.choices import ChoiceRequests
from server.api.completion_protocol import CompletionRequest
from server.api.embeddings import EmbeddingRequest
from server.api.lora import LoraRegistry
from server.api.protocol import ModelCard, ModelList, new_id
from server.api.responses_output import ResponseDeleted, ResponseObject, item_id
from server.api.responses_protocol import ResponsesRequest
from server.api.responses_store import ResponseStore
from server.api.serving import ServedModel
from server.engine.client import Engine
from server.http import ttft_trace
from server.http.errors import APIError, install_error_handlers
from server.http.lifecycle import Lifecycle
from server.http.limits import Admission, Ticket
from server.http.lora_routes import LORA_ROUTES, add_lora_routes
from server.http.metrics import Metrics
from server.http.middleware import DEFAULT_MAX_REQUEST_BYTES, FrontDoor
from server.http.openapi import BodySchemas
from server.http.pooling_routes import POOLING_ROUTES, add_pooling_routes
from server.http.respond import Limits, parse_body, respond, respond_json, work_tokens
from server.media import multimodal
from server.media.fetch import MediaOptions
from server.text import reasoning, tool_parsers
from server.text.chat_template import ChatTemplate
from server.text.tokenizer import Tokenizer

P = TypeVar("P")  # a route's plan of a request

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    *POOLING_ROUTES,
    *LORA_ROUTES,
    "/v1/models",
    "/health",
    "/metrics",
)


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
    scheduling_policy: str = "fcfs",
    response_store: ResponseStore | None = None,
    loras: LoraRegistry | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving ``served_model_name`` through ``engine_client``.

    ``api_key`` guards every ``/v1/*`` route; ``admission`` sheds load (default: no limit);
    ``request_timeout_s`` ends a generation or embedding (default: never); ``lifecycle``: the
    draining state the CLI flips on SIGTERM; ``tool_call_parser`` reads ``auto`` tool calls
    (default: :func:`server.text.tool_parsers.detect`); ``reasoning_parser`` splits the
    ``<think>`` block off chat answers (:mod:`server.text.reasoning`); ``image_model``: how a
    VLM takes images (``None``: text only); ``disable_docs`` (``--disable-fastapi-docs``) drops
    ``/docs``, ``/redoc`` and ``/openapi.json`` (else they need the API key when there is one);
    ``scheduling_policy``: the engine's (a request's ``priority`` needs ``priority``);
    ``response_store``: what ``/v1/responses`` keeps (default: one with the default bounds);
    ``loras``: LoRA adapters (:mod:`server.api.lora`). ``ValueError`` if the template fails.
    """
    metrics, lifecycle = metrics or Metrics(), lifecycle or Lifecycle()
    limits, schemas = Limits(admission or Admission(), request_timeout_s), BodySchemas()
    serving = ServedModel(
        engine_client,
        tokenizer,
        served_model_name,
        max_model_len,
        metrics,
        tool_call_parser or tool_parsers.detect(tokenizer.chat_template),
        image_model,
        media_options or MediaOptions(),
        scheduling_policy=scheduling_policy,
        reasoning=reasoning.reasoning_parser(reasoning_parser),
        loras=loras,
    )
    template = chat.load_template(serving)
    app = _fastapi(disable_docs)
    _install_front_door(app, metrics, lifecycle, api_key, max_request_bytes)
    _add_status_routes(app, serving, lifecycle)
    _add_completion_route(app, serving, schemas, limits)
    _add_embedding_route(app, serving, schemas, limits)
    _add_chat_route(app, serving, template, schemas, limits)
    _add_responses_routes(app, serving, template, schemas, limits, response_store)
    add_lora_routes(app, loras)
    schemas.install(app)
    return app


def _fastapi(disable_docs: bool) -> FastAPI:
    """The bare app; ``disable_docs``: no ``/docs``, ``/redoc`` nor ``/openapi.json``."""
    return FastAPI(
        title="shardserve",
        summary="OpenAI-compatible completions",
        docs_url=None if disable_docs else "/docs",
        redoc_url=None if disable_docs else "/redoc",
        openapi_url=None if disable_docs else "/openapi.json",
    )


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
        adapters = [] if serving.loras is None else serving.loras.refs()
        cards = [card] + [
            card.model_copy(update={"id": ref.name, "root": ref.path, "parent": name})
            for ref in adapters
        ]
        return ModelList(data=cards)


def _add_completion_route(
    app: FastAPI, serving: ServedModel, schemas: BodySchemas, limits: Limits
) -> None:
    """``POST /v1/completions``: JSON or SSE."""

    @app.post("/v1/completions", response_model=None, openapi_extra=schemas.body(CompletionRequest))
    async def create_completion(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        work: ChoiceRequests = await serving.offload.run(
            completions.prepare, serving, body, new_id("cmpl")
        )
        return await respond(
            request,
            body.stream,
            lambda: completions.stream(serving, work, body),
            lambda: completions.complete(serving, work, body),
            limits.admission.admit(work_tokens(work)),
            limits.request_timeout_s,
        )


def _add_embedding_route(
    app: FastAPI, serving: ServedModel, schemas: BodySchemas, limits: Limits
) -> None:
    """``POST /v1/embeddings`` and the classifier routes (:mod:`server.http.pooling_routes`):
    JSON, with the same shedding and deadline as generation."""
    add_pooling_routes(app, serving, schemas, parse_body, respond_json, limits)

    @app.post("/v1/embeddings", response_model=None, openapi_extra=schemas.body(EmbeddingRequest))
    async def create_embedding(request: Request) -> Response:
        body = await parse_body(request, EmbeddingRequest)
        work = await serving.offload.run(embeddings.prepare, serving, body)
        return await respond_json(
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
    limits: Limits,
) -> None:
    """``POST /v1/chat/completions``: JSON or SSE, rendered with ``template``."""

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=schemas.body(ChatCompletionRequest),
    )
    async def create_chat_completion(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)

        async def prepare() -> chat.ChatPlan:
            media = serving.image_model, serving.media_options
            images = await multimodal.load_chat_images(body, *media)
            return await serving.offload.run(
                chat.prepare, serving, template, body, new_id("chatcmpl"), images
            )

        work, ticket = await _admitted(serving, body, limits.admission, prepare, lambda w: w)
        return await respond(
            request,
            body.stream,
            lambda: chat.stream(serving, work, body),
            lambda: chat.complete(serving, work, body),
            ticket,
            limits.request_timeout_s,
        )


async def _admitted(
    serving: ServedModel,
    body: ChatCompletionRequest,
    admission: Admission,
    prepare: Callable[[], Awaitable[P]],
    work_of: Callable[[P], ChoiceRequests],
) -> tuple[P, Ticket]:
    """``prepare()`` (images loaded, the request planned) under load shedding: a request with
    media gets its 404/503, then its place (429), before any fetch; then the ticket covers
    the plan's tokens (``work_of``). The ticket is released if anything fails."""
    ticket = _admit_media(serving, body, admission)
    try:
        plan = await prepare()
        tokens = work_tokens(work_of(plan))
        return plan, admission.admit(tokens) if ticket is None else ticket.grow(tokens)
    except BaseException:
        if ticket is not None:
            ticket.release()
        raise


def _admit_media(
    serving: ServedModel, body: ChatCompletionRequest, admission: Admission
) -> Ticket | None:
    """For a request with media: its 404/503, then its place (429), before any fetch."""
    if not multimodal.has_media(body):
        return None
    serving.check(body.model)
    return admission.admit(0)


def _add_responses_routes(
    app: FastAPI,
    serving: ServedModel,
    template: ChatTemplate | None,
    schemas: BodySchemas,
    limits: Limits,
    response_store: ResponseStore | None,
) -> None:
    """``POST /v1/responses`` (JSON or SSE, through the chat machinery), and ``GET`` and
    ``DELETE /v1/responses/{response_id}`` on ``response_store``."""
    store = ResponseStore() if response_store is None else response_store

    @app.post("/v1/responses", response_model=None, openapi_extra=schemas.body(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        items = responses.conversation(store, body)
        chat_body = responses.chat_request(body, items)

        async def prepare() -> responses.ResponsesPlan:
            media = serving.image_model, serving.media_options
            try:
                images = await multimodal.load_chat_images(chat_body, *media)
            except APIError as exc:
                raise responses.renamed(exc) from None
            return await serving.offload.run(
                responses.prepare,
                *(serving, template, body, chat_body, items, item_id("resp"), images),
            )

        admission = limits.admission
        plan, ticket = await _admitted(serving, chat_body, admission, prepare, lambda p: p.work)
        return await respond(
            request,
            body.stream,
            lambda: responses_stream.stream(serving, plan, store),
            lambda: responses.complete(serving, plan, store),
            ticket,
            limits.request_timeout_s,
        )

    _add_stored_response_routes(app, store)


def _add_stored_response_routes(app: FastAPI, store: ResponseStore) -> None:
    """``GET`` and ``DELETE /v1/responses/{response_id}``: 404 unless ``store`` has it."""

    def stored(response_id: str) -> ResponseObject:
        entry = store.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"Response with response_id '{response_id}' not found (unknown, deleted, evicted "
                "or not stored).",
                param="response_id",
                code="response_not_found",
            )
        return entry.response

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> ResponseObject:
        return stored(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> ResponseDeleted:
        stored(response_id)
        store.delete(response_id)
        return ResponseDeleted(id=response_id)
