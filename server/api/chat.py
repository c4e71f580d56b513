"""``POST /v1/chat/completions``: template the messages, then JSON or SSE.

:func:`prepare` renders the conversation with the checkpoint's chat template
(:mod:`server.text.chat_template`), tokenizes it without adding special tokens (the
template writes them) and plans one engine request per choice. A checkpoint
without a template, or a template that refuses the messages, is a 400 naming
``messages``. :func:`complete` returns a ``chat.completion``; :func:`stream`
yields ``chat.completion.chunk`` frames: for each choice first a delta with
``role: assistant`` and empty content, then content deltas, the last with its
``finish_reason``; usage in a final ``choices: []`` chunk when
``stream_options.include_usage``; then ``data: [DONE]``. Engine failures are
handled as in :mod:`server.api.completions`.

Roles must be OpenAI's (:data:`server.api.chat_protocol.ROLES`; else a 400 naming
``messages[i].role``). vLLM's ``prompt_logprobs`` (not with ``stream``) scores the rendered
prompt once for all choices: the response's top-level ``prompt_logprobs``, as vLLM's.
``chat_template_kwargs`` go to the template as extra variables. With a reasoning parser
(``--reasoning-parser``, :mod:`server.text.reasoning`) the ``<think>`` block is split off
first: ``reasoning_content``/``reasoning`` deltas come before the content's, and tool calls
are read from the content only. ``tools`` go to the template; ``tool_choice`` and the output's
tool calls are :mod:`server.api.chat_tools`'; ``response_format`` and the other
structured-output fields constrain the output (:mod:`server.api.structured`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from server.api.chat_protocol import (
    ROLES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
)
from server.api.chat_tools import ToolPlan, ToolStream, finish_reason, message, tool_plan
from server.api.choices import ChoiceRequests, fan_out
from server.api.logprobs import chat_logprobs, vllm_prompt_logprobs
from server.api.protocol import Usage
from server.api.serving import (
    ENGINE_ERRORS,
    ServedModel,
    bad_words_ids,
    check_ids,
    engine_api_error,
    sse,
)
from server.http.errors import APIError
from server.media.multimodal import PreparedImage, prompt_ids, template_messages, with_media
from server.text.chat_template import SERVER_VARIABLES, ChatTemplate, ChatTemplateError
from server.text.reasoning import ReasoningParser, ReasoningStream


def load_template(serving: ServedModel) -> ChatTemplate | None:
    """The served checkpoint's compiled template, or ``None`` when it has none.

    Raises :class:`ChatTemplateError` if the template does not compile.
    """
    source = serving.tokenizer.chat_template
    return None if source is None else ChatTemplate(source, serving.tokenizer.special_tokens)


@dataclass(frozen=True)
class ChatPlan(ChoiceRequests):
    """A chat request's choices, how its tool calls are made and read, and its reasoning
    parser (none for a named or required tool call: the output is the call; none for one
    that starts inside the block, ``deepseek_r1``, under a structured-output grammar)."""

    tools: ToolPlan = field(default_factory=ToolPlan)
    reasoning: ReasoningParser | None = None


def _check_roles(body: ChatCompletionRequest) -> None:
    for i, m in enumerate(body.messages):
        if m.role not in ROLES:
            raise APIError.bad_request(
                f"'messages[{i}].role' must be one of {', '.join(ROLES)}, not {m.role!r}",
                param=f"messages[{i}].role",
            )


def _template_variables(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """``chat_template_kwargs``, or a 400 if it sets a variable the server sets."""
    for name in body.chat_template_kwargs or {}:
        if name in SERVER_VARIABLES:
            raise APIError.bad_request(
                f"'chat_template_kwargs' may not set {name!r}: use the request's own field",
                param="chat_template_kwargs",
            )
    return body.chat_template_kwargs


def _render(
    serving: ServedModel, template: ChatTemplate | None, body: ChatCompletionRequest
) -> str:
    """The prompt text of ``body``'s conversation, or the 400 naming ``messages``."""
    if template is None:
        raise APIError.bad_request(
            f"the model `{serving.model_name}` has no chat template (no 'chat_template' in "
            "tokenizer_config.json and no chat_template.jinja); use /v1/completions instead",
            param="messages",
            code="no_chat_template",
        )
    try:
        text = template.render(
            template_messages(serving.tokenizer, body, serving.image_model),
            add_generation_prompt=body.add_generation_prompt,
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            variables=_template_variables(body),
        )
    except ChatTemplateError as exc:
        raise APIError.bad_request(f"'messages': {exc}", param="messages") from exc
    serving.check_prompt_chars(text, "messages")
    return text


def prepare(
    serving: ServedModel,
    template: ChatTemplate | None,
    body: ChatCompletionRequest,
    response_id: str,
    images: list[PreparedImage] | None = None,
) -> ChatPlan:
    """Check, render and tokenize ``body``; one engine request per choice. ``images``: its
    image parts, loaded (:func:`server.media.multimodal.load_chat_images`)."""
    vocab_size = serving.check(body.model)
    _check_roles(body)
    tools, tool_grammar = tool_plan(body, serving.tool_parser)
    grammar = body.grammar()
    if tool_grammar is not None and grammar is not None:
        raise APIError.bad_request(
            "'tool_choice' required or a named function already constrains the output; "
            "drop the structured-output field",
            param="tool_choice",
        )
    text = _render(serving, template, body)
    stop_token_ids = list(body.stop_token_ids or [])
    check_ids(stop_token_ids, vocab_size, "stop_token_ids")
    check_ids(list(body.logit_bias_ids), vocab_size, "logit_bias")
    check_ids(list(body.allowed_token_ids or []), vocab_size, "allowed_token_ids")
    max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    ids, media = prompt_ids(serving.tokenizer, text, images or [], serving.image_model)
    work = fan_out(
        response_id,
        [ids],
        n=body.n,
        max_tokens=body.requested_max_tokens,
        max_tokens_param=max_param,
        max_model_len=serving.max_model_len,
        sampling=body.sampling_params(
            body.num_logprobs, bad_words_ids(serving.tokenizer, body.bad_words)
        ),
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
        grammar=grammar or tool_grammar,
        prompt_logprobs=body.prompt_logprobs,
        grammar_param="tool_choice" if tool_grammar is not None else body.grammar_param,
        priority=serving.check_priority(body.priority),
        lora=serving.lora_of(body.model),
    )
    requests = with_media(work.requests, media)
    thinks = serving.reasoning if tools.mode in ("none", "auto") else None
    if thinks is not None and grammar is not None and thinks.starts_in_reasoning:
        thinks = None  # a grammar shapes the output from its first token: no open block
    return ChatPlan(work.response_id, work.n, requests, work.grammar_param, tools, thinks)


def answer(work: ChatPlan, text: str) -> AssistantMessage:
    """The message of a whole answer: the reasoning split off first, tool calls read from
    the rest (the content)."""
    if work.reasoning is None:
        return message(work.tools, text)
    reasoning, content = work.reasoning.split(text)
    out = message(work.tools, content or "")
    update: dict[str, Any] = {"reasoning_content": reasoning, "reasoning": reasoning}
    if not out.content and not out.tool_calls:
        update["content"] = content
    return out.model_copy(update=update)


async def complete(
    serving: ServedModel, work: ChatPlan, body: ChatCompletionRequest
) -> ChatCompletionResponse:
    """Run every choice to the end and return the whole ``chat.completion``."""
    results = await serving.collect(work, body.stop_strings)
    messages = [answer(work, r.text) for r in results]
    choices = [
        ChatChoice(
            index=r.index,
            message=m,
            finish_reason=finish_reason(bool(m.tool_calls), r.finish_reason),
            logprobs=None if r.logprobs is None else chat_logprobs(serving.tokenizer, r.logprobs),
        )
        for r, m in zip(results, messages, strict=True)
    ]
    scored = None
    if body.prompt_logprobs is not None:
        scores = results[0].prompt_logprobs
        if scores is None:
            raise RuntimeError("the engine sent no prompt logprobs for a request that asked")
        prompt = work.requests[0].prompt_token_ids
        scored = vllm_prompt_logprobs(serving.tokenizer, prompt, scores, body.prompt_logprobs)
    return ChatCompletionResponse(
        id=work.response_id,
        model=serving.answered_by(work),
        choices=choices,
        usage=Usage.of(work.prompt_tokens, sum(r.completion_tokens for r in results)),
        prompt_logprobs=scored,
    )


async def stream(
    serving: ServedModel, work: ChatPlan, body: ChatCompletionRequest
) -> AsyncGenerator[bytes, None]:
    """SSE ``chat.completion.chunk`` frames; see the module docstring.

    An engine failure before the first content frame raises :class:`APIError`
    from the first ``anext``; a later one is sent as an error event before ``[DONE]``.
    """

    def chunk(*choices: ChatChunkChoice, usage: Usage | None = None) -> bytes:
        frame = ChatCompletionChunk(
            id=work.response_id, model=serving.answered_by(work), choices=list(choices), usage=usage
        )
        return sse(frame.model_dump_json())

    tokens = dict.fromkeys(range(len(work.requests)), 0)
    started: set[int] = set()
    streams = {i: ToolStream(work.tools) for i in range(len(work.requests))}
    thinking = {i: work.reasoning.stream() for i in streams} if work.reasoning else {}
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
                last = delta.finish_reason is not None
                pieces = _pieces(streams[index], thinking.get(index), delta.text, last)
                for piece in pieces[:-1]:
                    yield chunk(ChatChunkChoice(index=index, delta=piece))
                reason = finish_reason(streams[index].called, delta.finish_reason)
                yield chunk(
                    ChatChunkChoice(
                        index=index, delta=pieces[-1], logprobs=logprobs, finish_reason=reason
                    )
                )
        except ENGINE_ERRORS as exc:
            if not started:
                raise engine_api_error(exc, work.grammar_param) from exc
            yield sse(json.dumps(engine_api_error(exc, work.grammar_param).body()))
        else:
            if body.include_usage:
                yield chunk(usage=Usage.of(work.prompt_tokens, sum(tokens.values())))
    yield sse("[DONE]")


def _pieces(
    stream: ToolStream, thinking: ReasoningStream | None, text: str, last: bool
) -> list[ChatDelta]:
    """The deltas one text delta makes (at least one: an empty one carries the rest):
    reasoning first, then content and tool calls (from the content only)."""
    out = []
    if thinking is not None:
        reasoning, text = thinking.feed(text, last=last)
        if reasoning:
            out.append(ChatDelta(reasoning_content=reasoning, reasoning=reasoning))
    if stream.plan.mode == "none":
        out += [ChatDelta(content=text)] if text else []
    else:
        out += stream.feed(text) + (stream.finish() if last else [])
    return out or [ChatDelta()]
