"""``/v1/score``, ``/v1/rerank`` and ``/classify`` on a classifier replica (a cross-encoder).

As for embeddings, a request is served in two steps: ``prepare_*`` makes the checks
(model 404, engine 503, task and inputs 400) and tokenizes into a :class:`PoolingWork`,
one engine request per input; ``score``, ``rerank`` and ``classify`` run it.

- score: each pair ``(text_1, text_2)`` tokenized as the tokenizer pairs texts (BERT:
  ``[CLS] a [SEP] b [SEP]``, token types 0 then 1); the score is the one-label classifier's
  logit through the checkpoint's sentence-transformers activation, sigmoid when it names
  none (vLLM's ``get_cross_encoder_activation_function``). A model with several labels
  cannot score (400).
- rerank: the score of ``(query, document)`` for every document, sorted best first,
  ``top_n`` of them.
- classify: each text alone; ``probs`` is softmax over the labels (sigmoid for one label,
  or by ``problem_type``: :mod:`model_shards.config.classifier`), ``label`` the likeliest.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from model_shards.messages import EmbeddingResult, EmbedRequest, PoolingTask
from server.api.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from server.api.protocol import new_id
from server.api.serving import ServedModel, engine_api_error
from server.http.errors import APIError

#: Most inputs (pairs, documents or texts) in one request.
MAX_INPUTS = 1024


@dataclass(frozen=True)
class PoolingWork:
    """A checked, tokenized request: one engine request per input, in input order."""

    id: str
    requests: list[EmbedRequest]

    @property
    def tokens(self) -> int:
        """Input tokens, summed over the inputs (what admission counts)."""
        return sum(len(r.token_ids) for r in self.requests)


def _texts(value: str | list[str], param: str, serving: ServedModel) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise APIError.bad_request(f"'{param}' must not be empty", param=param)
    if len(texts) > MAX_INPUTS:
        raise APIError.bad_request(f"at most {MAX_INPUTS} texts in '{param}'", param=param)
    for text in texts:
        serving.check_prompt_chars(text, param)
    return texts


def _limit(serving: ServedModel, truncate: int | None) -> int | None:
    """The tokens an input is cut to (``None``: not cut), from ``truncate_prompt_tokens``."""
    if truncate is None:
        return None
    if truncate == -1:
        return serving.max_model_len
    if not 1 <= truncate <= serving.max_model_len:
        raise APIError.bad_request(
            f"'truncate_prompt_tokens' ({truncate}) must be -1 or in 1..{serving.max_model_len}",
            param="truncate_prompt_tokens",
        )
    return truncate


def _fits(ids: list[int], serving: ServedModel, param: str) -> list[int]:
    if len(ids) > serving.max_model_len:
        raise APIError.bad_request(
            f"an input of '{param}' has {len(ids)} tokens; this model takes at most "
            f"{serving.max_model_len} (or set 'truncate_prompt_tokens')",
            param=param,
            code="context_length_exceeded",
        )
    return ids


def _check(serving: ServedModel, model: str | None, scoring: bool) -> None:
    """The 404/503/400 of the model and its task; scoring needs one label."""
    serving.check(model, task="classify")
    labels = serving.engine.info.labels if serving.engine.info is not None else []
    if scoring and len(labels) != 1:
        raise APIError.bad_request(
            f"model `{serving.model_name}` has {len(labels)} labels; scoring needs a cross-encoder "
            "with one (use /classify)",
            param="model",
            code="wrong_model_task",
        )


def _pairs(
    serving: ServedModel, firsts: list[str], seconds: list[str], param: str, truncate: int | None
) -> list[tuple[list[int], list[int]]]:
    limit = _limit(serving, truncate)
    out = []
    for first, second in zip(firsts, seconds, strict=True):
        ids, types = serving.tokenizer.encode_pair(first, second, limit)
        out.append((_fits(ids, serving, param), types))
    return out


def _work(
    prefix: str, task: PoolingTask, encoded: list[tuple[list[int], list[int]]]
) -> PoolingWork:
    rid = new_id(prefix)
    requests = [
        EmbedRequest(f"{rid}-{i}", ids, types, task=task) for i, (ids, types) in enumerate(encoded)
    ]
    return PoolingWork(rid, requests)


def prepare_score(serving: ServedModel, body: ScoreRequest) -> PoolingWork:
    """Raise the 404/503/400 ``body`` gets now, else tokenize its pairs."""
    _check(serving, body.model, scoring=True)
    firsts = _texts(body.text_1, "text_1", serving)
    seconds = _texts(body.text_2, "text_2", serving)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise APIError.bad_request(
            f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: pair them 1:1, "
            "1:N or N:N",
            param="text_2",
        )
    pairs = _pairs(serving, firsts, seconds, "text_2", body.truncate_prompt_tokens)
    return _work("score", "score", pairs)


def prepare_rerank(serving: ServedModel, body: RerankRequest) -> PoolingWork:
    """Raise the 404/503/400 ``body`` gets now, else tokenize ``(query, document)`` pairs."""
    _check(serving, body.model, scoring=True)
    serving.check_prompt_chars(body.query, "query")
    documents = _texts(body.documents, "documents", serving)
    queries = [body.query] * len(documents)
    pairs = _pairs(serving, queries, documents, "documents", body.truncate_prompt_tokens)
    return _work("rerank", "score", pairs)


def prepare_classify(serving: ServedModel, body: ClassificationRequest) -> PoolingWork:
    """Raise the 404/503/400 ``body`` gets now, else tokenize each text."""
    _check(serving, body.model, scoring=False)
    texts = _texts(body.input, "input", serving)
    limit = _limit(serving, body.truncate_prompt_tokens)
    tokenizer = serving.tokenizer
    if limit is None:
        encoded = tokenizer.encode_many(texts)
    else:
        encoded = [tokenizer.encode_truncated(text, limit) for text in texts]
    for ids in encoded:
        _fits(ids, serving, "input")
    return _work("classify", "classify", [(ids, []) for ids in encoded])


async def _run(serving: ServedModel, work: PoolingWork) -> list[EmbeddingResult]:
    """Every input of ``work`` through the engine; failures as their HTTP error (400/503)."""
    engine, metrics = serving.engine, serving.metrics
    try:
        return list(
            await asyncio.gather(*(metrics.track_embedding(r, engine.embed) for r in work.requests))
        )
    except Exception as exc:
        raise engine_api_error(exc) from exc


def _usage(work: PoolingWork) -> PoolingUsage:
    return PoolingUsage(prompt_tokens=work.tokens, total_tokens=work.tokens)


async def score(serving: ServedModel, work: PoolingWork) -> ScoreResponse:
    results = await _run(serving, work)
    data = [ScoreData(index=i, score=r.embedding[0]) for i, r in enumerate(results)]
    return ScoreResponse(id=work.id, model=serving.model_name, data=data, usage=_usage(work))


async def rerank(serving: ServedModel, work: PoolingWork, body: RerankRequest) -> RerankResponse:
    results = await _run(serving, work)
    ranked = sorted(range(len(results)), key=lambda i: -results[i].embedding[0])
    top = ranked[: body.top_n or len(ranked)]
    out = [
        RerankResult(
            index=i,
            document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
            relevance_score=results[i].embedding[0],
        )
        for i in top
    ]
    usage = RerankUsage(total_tokens=work.tokens)
    return RerankResponse(id=work.id, model=serving.model_name, usage=usage, results=out)


async def classify(serving: ServedModel, work: PoolingWork) -> ClassificationResponse:
    results = await _run(serving, work)
    labels = serving.engine.info.labels if serving.engine.info is not None else []
    data = []
    for i, result in enumerate(results):
        probs = result.embedding
        best = max(range(len(probs)), key=probs.__getitem__)
        label = labels[best] if best < len(labels) else None
        data.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
    return ClassificationResponse(
        id=work.id, model=serving.model_name, data=data, usage=_usage(work)
    )
