"""Bodies of the classifier routes, in vLLM's shapes: ``/v1/score`` (``/score``),
``/v1/rerank`` (``/rerank``, Jina/Cohere-compatible) and ``/classify``.

``truncate_prompt_tokens`` (vLLM's): an input longer than the model's context is a 400
unless it is set; ``-1`` truncates to the context, ``k >= 1`` to ``k`` tokens (a pair longest
text first, as transformers' ``truncation=True``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.protocol import now

Truncation = Annotated[int, Field(ge=-1)]


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreRequest(BaseModel):
    """Pairs ``(text_1[i], text_2[i])``; one ``text_1`` pairs with every ``text_2`` (1:1,
    1:N or N:N)."""

    model_config = ConfigDict(extra="ignore")

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(BaseModel):
    """``documents`` ranked by relevance to ``query``; ``top_n`` of them (0: all)."""

    model_config = ConfigDict(extra="ignore")

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None


class ClassificationData(BaseModel):
    index: int
    object: Literal["classification"] = "classification"
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
