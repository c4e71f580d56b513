"""The classifier routes (:mod:`server.api.scoring`), each under vLLM's two paths:
``POST /v1/score`` and ``/score``, ``/v1/rerank`` and ``/rerank``, and ``/classify``.

Each is checked as an embedding is (body 400 → model 404 → engine 503 → task and inputs
400, tokenized off the event loop), then shed and bounded by the app's admission and
deadline the app gives (``limits``), through the app's JSON responder.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel

from server.api import scoring
from server.api.pooling_protocol import ClassificationRequest, RerankRequest, ScoreRequest
from server.api.serving import ServedModel
from server.http.limits import Admission, Ticket
from server.http.openapi import BodySchemas

B = TypeVar("B", bound=BaseModel)

#: Every path this module serves (for the front door's metrics and API-key guard).
POOLING_ROUTES = ("/v1/score", "/score", "/v1/rerank", "/rerank", "/classify")

#: ``parse(request, model)``: the body as ``model``, or the 400 naming the field.
Parse = Callable[[Request, type[B]], Awaitable[B]]
#: ``respond_json(request, whole, ticket, timeout_s)``: ``whole()`` as JSON, ``ticket``
#: released when done, 504 past ``timeout_s``.
RespondJson = Callable[
    [Request, Callable[[], Awaitable[BaseModel]], Ticket, float | None], Awaitable[Response]
]


class Limits(Protocol):
    @property
    def admission(self) -> Admission: ...

    @property
    def request_timeout_s(self) -> float | None: ...


def add_pooling_routes(
    app: FastAPI,
    serving: ServedModel,
    schemas: BodySchemas,
    parse: Any,
    respond_json: RespondJson,
    limits: Limits,
) -> None:
    """Score, rerank and classify on ``app``; ``parse`` is a :data:`Parse`."""

    async def respond(
        request: Request, whole: Callable[[], Awaitable[BaseModel]], tokens: int
    ) -> Response:
        ticket = limits.admission.admit(tokens)
        return await respond_json(request, whole, ticket, limits.request_timeout_s)

    async def create_score(request: Request) -> Response:
        body: ScoreRequest = await parse(request, ScoreRequest)
        work = await serving.offload.run(scoring.prepare_score, serving, body)
        return await respond(request, lambda: scoring.score(serving, work), work.tokens)

    async def create_rerank(request: Request) -> Response:
        body: RerankRequest = await parse(request, RerankRequest)
        work = await serving.offload.run(scoring.prepare_rerank, serving, body)
        return await respond(request, lambda: scoring.rerank(serving, work, body), work.tokens)

    async def create_classify(request: Request) -> Response:
        body: ClassificationRequest = await parse(request, ClassificationRequest)
        work = await serving.offload.run(scoring.prepare_classify, serving, body)
        return await respond(request, lambda: scoring.classify(serving, work), work.tokens)

    for path, handler, model in (
        ("/v1/score", create_score, ScoreRequest),
        ("/score", create_score, ScoreRequest),
        ("/v1/rerank", create_rerank, RerankRequest),
        ("/rerank", create_rerank, RerankRequest),
        ("/classify", create_classify, ClassificationRequest),
    ):
        app.add_api_route(
            path,
            handler,
            methods=["POST"],
            response_model=None,
            openapi_extra=schemas.body(model),
            name=path.strip("/").replace("/", "_"),
        )
