"""``POST /v1/responses``: a Responses request as a chat request, then JSON or the spec's SSE.

:func:`conversation` lays out the input items (the stored conversation of
``previous_response_id`` first: a 404 naming it when unknown). :func:`chat_request` turns
them and the request into a :class:`ChatCompletionRequest`: ``instructions`` a system message,
messages as they are (text parts joined, ``input_image`` as an ``image_url`` part), a
``function_call`` item a tool call of an assistant message (consecutive calls share one),
``function_call_output`` a ``tool`` message, ``tools`` and ``tool_choice`` in chat's nested
shape, ``text.format`` as ``response_format``, ``max_output_tokens`` as
``max_completion_tokens``. :func:`prepare` then plans it with :func:`server.api.chat.prepare`
(template, tokens, tool plan, grammar); a 400 there names the Responses field. :func:`complete`
returns the ``response`` object; :func:`server.api.responses_stream.stream` sends events. With
``store`` (the default) the response and its conversation are kept
(:mod:`server.api.responses_store`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from server.api import chat
from server.api.chat_protocol import ChatCompletionRequest
from server.api.responses_output import (
    IncompleteDetails,
    OutputBuilder,
    OutputItem,
    ResponseObject,
    ResponseUsage,
    Status,
)
from server.api.responses_protocol import (
    SAMPLING_KEYS,
    ResponsesReasoning,
    ResponsesRequest,
    ResponsesTextFormat,
)
from server.api.responses_store import ResponseStore
from server.api.serving import ServedModel
from server.http.errors import APIError, validation_error
from server.media.multimodal import PreparedImage
from server.text.chat_template import ChatTemplate

#: Chat fields a 400 from the chat machinery may name → the Responses field they came from.
_PARAMS = {
    "prompt": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.type": "text.format.type",
    "response_format.json_schema": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}
_TOOL_PARAMETERS = re.compile(r"^tools\[(\d+)\]\.function\.parameters$")


@dataclass(frozen=True)
class ResponsesPlan:
    """A Responses request planned: the chat plan it runs as and what to store after."""

    work: chat.ChatPlan
    chat_body: ChatCompletionRequest
    body: ResponsesRequest
    conversation: list[dict[str, Any]]  # input items so far (without instructions)


def conversation(store: ResponseStore, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The stored conversation of ``previous_response_id`` (404 if unknown), then ``input``."""
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        entry = store.get(body.previous_response_id)
        if entry is None:
            raise APIError(
                404,
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = entry.conversation
    if isinstance(body.input, str):
        return [*history, {"type": "message", "role": "user", "content": body.input}]
    return [*history, *(item.model_dump(exclude_none=True, by_alias=True) for item in body.input)]


def _part(part: dict[str, Any], param: str) -> dict[str, Any]:
    if part["type"] == "input_image":
        if not part.get("image_url"):
            raise APIError.bad_request(
                f"'{param}.image_url' is required: images by file_id are not supported",
                param=f"{param}.image_url",
            )
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    text = part.get("refusal") if part["type"] == "refusal" else part.get("text")
    return {"type": "text", "text": text or ""}


def _content(content: str | list[dict[str, Any]], param: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [_part(p, f"{param}[{j}]") for j, p in enumerate(content)]


def _messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of ``items`` (module docstring); ``reasoning`` items are skipped."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            content = _content(item["content"], f"input[{i}].content")
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": item["call_id"], "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            if not isinstance(output, str):
                output = "\n".join(p.get("text") or "" for p in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    return messages


def _response_format(text_format: ResponsesTextFormat | None) -> dict[str, Any] | None:
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise APIError.bad_request(
            "'text.format.schema' is required with type json_schema", param="text.format.schema"
        )
    schema = {"name": text_format.name or "response", "schema": text_format.schema_}
    return {"type": "json_schema", "json_schema": schema | {"strict": text_format.strict}}


def chat_request(body: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """``body`` over the conversation ``items`` as the chat route's request (module docstring)."""
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
        for t in body.tools or []
    ]
    fields = {
        "model": body.model,
        "messages": _messages(body.instructions, items),
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text.format if body.text else None),
        **{key: getattr(body, key) for key in SAMPLING_KEYS},
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(validation_error(list(exc.errors()))) from None


def renamed(error: APIError) -> APIError:
    """``error`` naming the Responses field where it names a chat field (any part of
    ``messages`` is ``input``: the indices differ)."""
    param = error.info.param
    if param is None:
        return error
    if param.startswith("messages"):
        new, old = "input", r"\bmessages(\[\d+\]|\.\w+)*"
    else:
        new = _PARAMS.get(param) or _TOOL_PARAMETERS.sub(r"tools[\1].parameters", param)
        old = rf"\b{re.escape(param)}\b"
    if new == param:
        return error
    message = re.sub(old, new, error.info.message)
    return APIError(
        error.status_code, message, type=error.info.type, param=new, code=error.info.code
    )


def prepare(
    serving: ServedModel,
    template: ChatTemplate | None,
    body: ResponsesRequest,
    chat_body: ChatCompletionRequest,
    items: list[dict[str, Any]],
    response_id: str,
    images: list[PreparedImage] | None = None,
) -> ResponsesPlan:
    """Render, tokenize and plan ``chat_body`` (:func:`server.api.chat.prepare`)."""
    try:
        work = chat.prepare(serving, template, chat_body, response_id, images)
    except APIError as exc:
        raise renamed(exc) from None
    grammar_param = work.grammar_param and _PARAMS.get(work.grammar_param, work.grammar_param)
    work = chat.ChatPlan(
        work.response_id, work.n, work.requests, grammar_param, work.tools, work.reasoning
    )
    return ResponsesPlan(work, chat_body, body, items)


def output_builder(plan: ResponsesPlan) -> OutputBuilder:
    """The builder of one answer's items: the plan's tool plan and reasoning parser."""
    thinks = plan.work.reasoning
    return OutputBuilder(plan.work.tools, thinks.stream() if thinks is not None else None)


def _echoed(body: ResponsesRequest) -> dict[str, Any]:
    """The request settings a ``response`` object repeats, with OpenAI's defaults."""
    text_format = body.text.format if body.text else None
    choice = body.tool_choice or ("auto" if body.tools else "none")
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": (body.reasoning or ResponsesReasoning()).model_dump(),
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def response_object(
    serving: ServedModel,
    plan: ResponsesPlan,
    status: Status,
    output: list[OutputItem],
    usage: ResponseUsage | None = None,
) -> ResponseObject:
    """The ``response`` object of ``plan`` with this status, output and usage."""
    incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    return ResponseObject(
        id=plan.work.response_id,
        status=status,
        incomplete_details=incomplete,
        model=serving.model_name,
        output=output,
        usage=usage,
        **_echoed(plan.body),
    )


def keep(store: ResponseStore, plan: ResponsesPlan, response: ResponseObject) -> None:
    """Store ``response`` and its conversation when the request asked to (``store``)."""
    if plan.body.store:
        output = [item.model_dump() for item in response.output]
        store.put(response, [*plan.conversation, *output])


async def complete(
    serving: ServedModel, plan: ResponsesPlan, store: ResponseStore
) -> ResponseObject:
    """Run the request to the end; the ``response`` object (stored if asked)."""
    (result,) = await serving.collect(plan.work, plan.chat_body.stop_strings)
    builder = output_builder(plan)
    incomplete = result.finish_reason == "length"
    builder.feed(result.text, last=True, incomplete=incomplete)
    usage = ResponseUsage.of(plan.work.prompt_tokens, result.completion_tokens)
    status: Status = "incomplete" if incomplete else "completed"
    response = response_object(serving, plan, status, builder.items, usage)
    keep(store, plan, response)
    return response
