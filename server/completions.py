"""``POST /v1/completions``: request checks that need the engine, then JSON or SSE.

:func:`prepare` turns a validated :class:`CompletionRequest` into the engine's
:class:`GenerateRequest`, raising :class:`APIError` (400) for what pydantic
cannot know: token ids outside the vocabulary and prompts that do not fit the
context (``prompt + max_tokens > max_model_len``; ``max_tokens: null`` means
"the rest of the context"). :func:`complete` collects a whole answer;
:func:`stream` yields SSE frames ending with ``data: [DONE]``. Engine failures
become 400 (refused request) or 503 (engine dead); once a stream has started
they are sent as an error event before ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator

from model_shards.messages import FinishReason, GenerateRequest
from server.engine_client import EngineClient, EngineDeadError, EngineRequestError
from server.errors import APIError
from server.generation import generate_text
from server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from server.tokenizer import Tokenizer


def prepare(
    body: CompletionRequest,
    request_id: str,
    tokenizer: Tokenizer,
    vocab_size: int,
    max_model_len: int,
) -> GenerateRequest:
    """Tokenize and check ``body`` against the engine's vocabulary and context length."""
    prompt = body.prompt_input
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt)
    else:
        prompt_ids = list(prompt)
        _check_ids(prompt_ids, vocab_size, "prompt")
    stop_token_ids = list(body.stop_token_ids or [])
    _check_ids(stop_token_ids, vocab_size, "stop_token_ids")
    if not prompt_ids:
        raise APIError.bad_request("prompt encodes to zero tokens", param="prompt")
    if len(prompt_ids) >= max_model_len:
        raise APIError.bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(prompt_ids)} tokens, leaving no room for a completion.",
            param="prompt",
            code="context_length_exceeded",
        )
    max_tokens = body.max_tokens or max_model_len - len(prompt_ids)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise APIError.bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=body.sampling_params(),
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
    )


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError.bad_request(
            f"token id {bad[0]} in '{param}' is out of range: the vocabulary has "
            f"{vocab_size} tokens (ids 0..{vocab_size - 1})",
            param=param,
        )


def engine_api_error(exc: Exception) -> APIError:
    """Map an engine-side failure to the HTTP error the client sees."""
    if isinstance(exc, EngineRequestError):
        return APIError.bad_request(f"the engine refused the request: {exc}", code="engine_refused")
    if isinstance(exc, EngineDeadError):
        return APIError.unavailable(f"the engine is unavailable: {exc}")
    return APIError(500, "internal server error", type="server_error")


async def complete(
    engine: EngineClient,
    tokenizer: Tokenizer,
    request: GenerateRequest,
    body: CompletionRequest,
    model: str,
) -> CompletionResponse:
    """Run to the end and return the whole completion."""
    parts: list[str] = []
    finish: FinishReason | None = None
    usage = Usage.of(len(request.prompt_token_ids), 0)
    try:
        async for delta in generate_text(engine, tokenizer, request, body.stop_strings):
            parts.append(delta.text)
            finish = delta.finish_reason
            usage = Usage.of(delta.prompt_tokens, delta.completion_tokens)
    except (EngineRequestError, EngineDeadError) as exc:
        raise engine_api_error(exc) from exc
    return CompletionResponse(
        id=request.request_id,
        model=model,
        choices=[CompletionChoice(text="".join(parts), finish_reason=finish)],
        usage=usage,
    )


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def stream(
    engine: EngineClient,
    tokenizer: Tokenizer,
    request: GenerateRequest,
    body: CompletionRequest,
    model: str,
) -> AsyncGenerator[bytes, None]:
    """SSE frames: one chunk per text delta, the last with ``finish_reason``; usage
    in a final ``choices: []`` chunk when ``stream_options.include_usage``.

    An engine failure before the first frame raises :class:`APIError` from the
    first ``anext`` (the caller can still send a proper HTTP status); a later one
    is sent as an error event, followed by ``[DONE]``.
    """
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage = Usage.of(len(request.prompt_token_ids), 0)
    first = True
    deltas = generate_text(engine, tokenizer, request, body.stop_strings)
    async with contextlib.aclosing(deltas):
        try:
            async for delta in deltas:
                first = False
                usage = Usage.of(delta.prompt_tokens, delta.completion_tokens)
                choice = CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
                chunk = CompletionResponse(id=request.request_id, model=model, choices=[choice])
                yield _sse(chunk.model_dump_json())
        except (EngineRequestError, EngineDeadError) as exc:
            if first:
                raise engine_api_error(exc) from exc
            yield _sse(json.dumps(engine_api_error(exc).body()))
        else:
            if include_usage:
                final = CompletionResponse(
                    id=request.request_id, model=model, choices=[], usage=usage
                )
                yield _sse(final.model_dump_json())
    yield _sse("[DONE]")
