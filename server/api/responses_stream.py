"""``POST /v1/responses`` with ``stream: true``: the spec's server-sent events.

Each event is ``event: <type>`` and ``data: <json>`` with a ``sequence_number`` counting from
0: ``response.created`` and ``response.in_progress`` (the response, no output yet), the
output items' events (:class:`server.api.responses_output.OutputBuilder`), then
``response.completed`` (or ``response.incomplete`` at ``max_output_tokens``) with the whole
response, stored when asked. No ``[DONE]`` (OpenAI sends none). An engine refusal before the
first token is the request's HTTP error; a later failure ends the stream with
``response.failed``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncGenerator
from typing import Any

from server.api.responses import ResponsesPlan, keep, output_builder, response_object
from server.api.responses_output import ResponseError, ResponseUsage, Status
from server.api.responses_store import ResponseStore
from server.api.serving import ENGINE_ERRORS, ServedModel, engine_api_error


async def stream(
    serving: ServedModel, plan: ResponsesPlan, store: ResponseStore
) -> AsyncGenerator[bytes, None]:
    """The events of ``plan`` (module docstring)."""
    numbers = itertools.count()

    def frame(event: dict[str, Any]) -> bytes:
        event["sequence_number"] = next(numbers)
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    builder = output_builder(plan)
    deltas = serving.merge(plan.work, plan.chat_body.stop_strings)
    async with contextlib.aclosing(deltas):
        try:
            first = await anext(deltas)
        except ENGINE_ERRORS as exc:
            raise engine_api_error(exc, plan.work.grammar_param) from exc
        started = response_object(serving, plan, "in_progress", []).model_dump()
        yield frame({"type": "response.created", "response": started})
        yield frame({"type": "response.in_progress", "response": started})
        tokens, incomplete = 0, False
        try:
            async for _, delta in _chain(first, deltas):
                tokens = delta.completion_tokens
                last = delta.finish_reason is not None
                incomplete = delta.finish_reason == "length"
                for event in builder.feed(delta.text, last=last, incomplete=incomplete):
                    yield frame(event)
        except ENGINE_ERRORS as exc:
            error = engine_api_error(exc, plan.work.grammar_param).info
            failed = response_object(serving, plan, "failed", builder.items)
            failed.error = ResponseError(code=error.code or error.type, message=error.message)
            yield frame({"type": "response.failed", "response": failed.model_dump()})
            return
    usage = ResponseUsage.of(plan.work.prompt_tokens, tokens)
    status: Status = "incomplete" if incomplete else "completed"
    response = response_object(serving, plan, status, builder.items, usage)
    keep(store, plan, response)
    yield frame({"type": f"response.{status}", "response": response.model_dump()})


async def _chain(first: Any, rest: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    yield first
    async for item in rest:
        yield item
