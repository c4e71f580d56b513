"""``POST /v1/embeddings`` for encoder replicas (OpenAI shape).

``input`` is a string, a list of strings, a list of token ids, or a list of
token-id lists. Text is tokenized here (special tokens added) and truncated to
the encoder's window, as sentence-transformers does; token ids must already
fit. ``encoding_format`` ``float`` (default) or ``base64`` (little-endian
float32, as the OpenAI SDK decodes it).

A request is served in two steps, so that the app can shed load and set a
deadline in between (as for generation): :func:`prepare` makes the checks
(model 404, engine 503, task and inputs 400) and tokenizes into an
:class:`EmbeddingWork`; :func:`embed` runs its inputs on the engine, each
recorded in the metrics (:meth:`~server.http.metrics.Metrics.track_embedding`).
Cancelling :func:`embed` (deadline, client gone) aborts every input still
queued on the engine; an input already in a running batch finishes there and
its result is dropped by the engine client.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from model_shards.messages import EmbedRequest
from server.api.protocol import new_id
from server.api.serving import ServedModel, check_ids, engine_api_error
from server.http.errors import APIError

MAX_INPUTS = 256


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _inputs(body: EmbeddingRequest, serving: ServedModel, vocab_size: int) -> list[list[int]]:
    raw: list[str] | list[list[int]]
    if isinstance(body.input, str):
        raw = [body.input]
    elif body.input and isinstance(body.input[0], int):
        raw = [[int(t) for t in body.input]]
    else:
        raw = body.input  # type: ignore[assignment]
    if not raw:
        raise APIError.bad_request("'input' must not be empty", param="input")
    if len(raw) > MAX_INPUTS:
        raise APIError.bad_request(f"at most {MAX_INPUTS} inputs per request", param="input")
    out = []
    for item in raw:
        if isinstance(item, str):
            if not item:
                raise APIError.bad_request("'input' strings must not be empty", param="input")
            ids = serving.tokenizer.encode_truncated(item, serving.max_model_len)
        else:
            ids = list(item)
            if not ids:
                raise APIError.bad_request("'input' token lists must not be empty", param="input")
            if len(ids) > serving.max_model_len:
                raise APIError.bad_request(
                    f"an input has {len(ids)} tokens; this model takes at most "
                    f"{serving.max_model_len}",
                    param="input",
                )
            check_ids(ids, vocab_size, "input")
        out.append(ids)
    return out


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


@dataclass(frozen=True)
class EmbeddingWork:
    """A checked, tokenized embedding request: one engine request per input."""

    requests: list[EmbedRequest]

    @property
    def tokens(self) -> int:
        """Input tokens, summed over the inputs (what admission counts)."""
        return sum(len(r.token_ids) for r in self.requests)


def prepare(serving: ServedModel, body: EmbeddingRequest) -> EmbeddingWork:
    """Raise the 404/503/400 ``body`` gets now, else tokenize it into engine requests."""
    vocab_size = serving.check(body.model, task="embed")
    inputs = _inputs(body, serving, vocab_size)
    rid = new_id("embd")
    return EmbeddingWork([EmbedRequest(f"{rid}-{i}", ids) for i, ids in enumerate(inputs)])


async def embed(
    serving: ServedModel, work: EmbeddingWork, body: EmbeddingRequest
) -> EmbeddingResponse:
    """Embed every input of ``work``; engine failures as their HTTP error (400/503)."""
    engine, metrics = serving.engine, serving.metrics
    try:
        results = await asyncio.gather(
            *(metrics.track_embedding(r, engine.embed) for r in work.requests)
        )
    except Exception as exc:
        raise engine_api_error(exc) from exc
    data = []
    for i, result in enumerate(results):
        vector = result.embedding
        if body.dimensions is not None and body.dimensions != len(vector):
            raise APIError.bad_request(
                f"this model's embeddings have {len(vector)} dimensions and cannot be "
                f"shortened to {body.dimensions}",
                param="dimensions",
            )
        data.append(EmbeddingData(index=i, embedding=_encode(vector, body.encoding_format)))
    tokens = work.tokens
    return EmbeddingResponse(
        data=data,
        model=serving.model_name,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
