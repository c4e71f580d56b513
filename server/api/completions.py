"""``POST /v1/completions``: request checks that need the engine, then JSON or SSE.

:func:`prepare` turns a validated :class:`CompletionRequest` into a
:class:`~server.api.choices.ChoiceRequests` (one engine request per prompt and sample),
raising :class:`APIError` (400) for what pydantic cannot know: token ids
outside the vocabulary and prompts that do not fit the context
(``prompt + max_tokens > max_model_len``; ``max_tokens: null`` means "the
rest of the context"). :func:`complete` collects every choice; :func:`stream`
yields SSE frames (one choice per chunk, ``index`` set) ending with
``data: [DONE]``. Engine failures become 400 (refused request) or 503 (engine
dead); once a stream has started they are sent as an error event before
``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator

from server.api.choices import ChoiceRequests, fan_out
from server.api.completion_protocol import CompletionChoice, CompletionRequest, CompletionResponse
from server.api.logprobs import completion_logprobs
from server.api.protocol import MAX_N, Usage
from server.api.serving import (
    ENGINE_ERRORS,
    ServedModel,
    bad_words_ids,
    check_ids,
    engine_api_error,
    sse,
)
from server.http.errors import APIError

#: Most choices (prompts × n) one completion request may ask for.
MAX_CHOICES = 4 * MAX_N


def prepare(serving: ServedModel, body: CompletionRequest, response_id: str) -> ChoiceRequests:
    """Check ``body`` against the engine and tokenize it into one request per choice."""
    vocab_size = serving.check(body.model)
    if len(body.prompts) * body.n > MAX_CHOICES:
        raise APIError.bad_request(
            f"'n': {len(body.prompts)} prompts × n={body.n} is {len(body.prompts) * body.n} "
            f"choices; at most {MAX_CHOICES} are allowed",
            param="n",
        )
    prompts = []
    for prompt in body.prompts:
        if isinstance(prompt, str):
            prompts.append(serving.tokenizer.encode(prompt))
        else:
            check_ids(prompt, vocab_size, "prompt")
            prompts.append(list(prompt))
    stop_token_ids = list(body.stop_token_ids or [])
    check_ids(stop_token_ids, vocab_size, "stop_token_ids")
    check_ids(list(body.logit_bias_ids), vocab_size, "logit_bias")
    check_ids(list(body.allowed_token_ids or []), vocab_size, "allowed_token_ids")
    grammar = body.grammar()
    return fan_out(
        response_id,
        prompts,
        n=body.n,
        max_tokens=body.max_tokens,
        max_tokens_param="max_tokens",
        max_model_len=serving.max_model_len,
        sampling=body.sampling_params(
            body.logprobs, bad_words_ids(serving.tokenizer, body.bad_words)
        ),
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
        grammar=grammar,
    )


async def complete(
    serving: ServedModel, work: ChoiceRequests, body: CompletionRequest
) -> CompletionResponse:
    """Run every choice to the end and return the whole completion."""
    results = await serving.collect(work, body.stop_strings)
    choices = [
        CompletionChoice(
            index=r.index,
            text=r.text,
            finish_reason=r.finish_reason,
            logprobs=None
            if r.logprobs is None
            else completion_logprobs(serving.tokenizer, r.logprobs),
        )
        for r in results
    ]
    completion_tokens = sum(r.completion_tokens for r in results)
    return CompletionResponse(
        id=work.response_id,
        model=serving.model_name,
        choices=choices,
        usage=Usage.of(work.prompt_tokens, completion_tokens),
    )


async def stream(
    serving: ServedModel, work: ChoiceRequests, body: CompletionRequest
) -> AsyncGenerator[bytes, None]:
    """SSE frames: one chunk per choice's text delta, its last with ``finish_reason``;
    usage in a final ``choices: []`` chunk when ``stream_options.include_usage``.

    An engine failure before the first frame raises :class:`APIError` from the
    first ``anext`` (the caller can still send a proper HTTP status); a later one
    is sent as an error event, followed by ``[DONE]``.
    """
    tokens = dict.fromkeys(range(len(work.requests)), 0)
    offsets = dict.fromkeys(range(len(work.requests)), 0)
    first = True
    deltas = serving.merge(work, body.stop_strings)
    async with contextlib.aclosing(deltas):
        try:
            async for index, delta in deltas:
                first = False
                tokens[index] = delta.completion_tokens
                logprobs = None
                if delta.logprobs is not None:
                    logprobs = completion_logprobs(
                        serving.tokenizer, delta.logprobs, offsets[index]
                    )
                    offsets[index] += sum(len(t) for t in logprobs.tokens)
                choice = CompletionChoice(
                    index=index,
                    text=delta.text,
                    finish_reason=delta.finish_reason,
                    logprobs=logprobs,
                )
                chunk = CompletionResponse(
                    id=work.response_id, model=serving.model_name, choices=[choice]
                )
                yield sse(chunk.model_dump_json())
        except ENGINE_ERRORS as exc:
            if first:
                raise engine_api_error(exc) from exc
            yield sse(json.dumps(engine_api_error(exc).body()))
        else:
            if body.include_usage:
                usage = Usage.of(work.prompt_tokens, sum(tokens.values()))
                final = CompletionResponse(
                    id=work.response_id, model=serving.model_name, choices=[], usage=usage
                )
                yield sse(final.model_dump_json())
    yield sse("[DONE]")
