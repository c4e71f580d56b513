"""``POST /v1/chat/completions``: template the messages, then JSON or SSE.

:func:`prepare` renders the conversation with the checkpoint's chat template
(:mod:`server.chat_template`), tokenizes it without adding special tokens (the
template writes them) and plans one engine request per choice. A checkpoint
without a template, or a template that refuses the messages, is a 400 naming
``messages``. :func:`complete` returns a ``chat.completion``; :func:`stream`
yields ``chat.completion.chunk`` frames: for each choice first a delta with
``role: assistant`` and empty content, then content deltas, the last with its
``finish_reason``; usage in a final ``choices: []`` chunk when
``stream_options.include_usage``; then ``data: [DONE]``. Engine failures are
handled as in :mod:`server.completions`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator

from server.chat_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
)
from server.chat_template import ChatTemplate, ChatTemplateError
from server.choices import Plan, plan
from server.errors import APIError
from server.logprobs import chat_logprobs
from server.protocol import Usage
from server.serving import ENGINE_ERRORS, Serving, check_ids, engine_api_error, sse


def load_template(serving: Serving) -> ChatTemplate | None:
    """The served checkpoint's compiled template, or ``None`` when it has none.

    Raises :class:`ChatTemplateError` if the template does not compile.
    """
    source = serving.tokenizer.chat_template
    return None if source is None else ChatTemplate(source, serving.tokenizer.special_tokens)


def prepare(
    serving: Serving, template: ChatTemplate | None, body: ChatCompletionRequest, response_id: str
) -> Plan:
    """Check, render and tokenize ``body``; one engine request per choice."""
    vocab_size = serving.check(body.model)
    if template is None:
        raise APIError.bad_request(
            f"the model `{serving.model_name}` has no chat template (no 'chat_template' in "
            "tokenizer_config.json and no chat_template.jinja); use /v1/completions instead",
            param="messages",
            code="no_chat_template",
        )
    try:
        text = template.render(
            [m.template_dict() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
        )
    except ChatTemplateError as exc:
        raise APIError.bad_request(f"'messages': {exc}", param="messages") from exc
    stop_token_ids = list(body.stop_token_ids or [])
    check_ids(stop_token_ids, vocab_size, "stop_token_ids")
    max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    return plan(
        response_id,
        [serving.tokenizer.encode(text, add_special_tokens=False)],
        n=body.n,
        max_tokens=body.requested_max_tokens,
        max_tokens_param=max_param,
        max_model_len=serving.max_model_len,
        sampling=body.sampling_params(body.num_logprobs),
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
    )


async def complete(
    serving: Serving, work: Plan, body: ChatCompletionRequest
) -> ChatCompletionResponse:
    """Run every choice to the end and return the whole ``chat.completion``."""
    results = await serving.collect(work, body.stop_strings)
    choices = [
        ChatChoice(
            index=r.index,
            message=AssistantMessage(content=r.text),
            finish_reason=r.finish_reason,
            logprobs=None if r.logprobs is None else chat_logprobs(serving.tokenizer, r.logprobs),
        )
        for r in results
    ]
    return ChatCompletionResponse(
        id=work.response_id,
        model=serving.model_name,
        choices=choices,
        usage=Usage.of(work.prompt_tokens, sum(r.completion_tokens for r in results)),
    )


async def stream(
    serving: Serving, work: Plan, body: ChatCompletionRequest
) -> AsyncGenerator[bytes, None]:
    """SSE ``chat.completion.chunk`` frames; see the module docstring.

    An engine failure before the first content frame raises :class:`APIError`
    from the first ``anext``; a later one is sent as an error event before ``[DONE]``.
    """

    def chunk(*choices: ChatChunkChoice, usage: Usage | None = None) -> bytes:
        frame = ChatCompletionChunk(
            id=work.response_id, model=serving.model_name, choices=list(choices), usage=usage
        )
        return sse(frame.model_dump_json())

    tokens = dict.fromkeys(range(len(work.requests)), 0)
    started: set[int] = set()
    deltas = serving.merge(work, body.stop_strings)
    async with contextlib.aclosing(deltas):
        try:
            async for index, delta in deltas:
                if index not in started:
                    started.add(index)
                    role = ChatDelta(role="assistant", content="")
                    yield chunk(ChatChunkChoice(index=index, delta=role))
                tokens[index] = delta.completion_tokens
                logprobs = None
                if delta.logprobs is not None:
                    logprobs = chat_logprobs(serving.tokenizer, delta.logprobs)
                content = ChatDelta(content=delta.text) if delta.text else ChatDelta()
                yield chunk(
                    ChatChunkChoice(
                        index=index,
                        delta=content,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                    )
                )
        except ENGINE_ERRORS as exc:
            if not started:
                raise engine_api_error(exc) from exc
            yield sse(json.dumps(engine_api_error(exc).body()))
        else:
            if body.include_usage:
                yield chunk(usage=Usage.of(work.prompt_tokens, sum(tokens.values())))
    yield sse("[DONE]")
