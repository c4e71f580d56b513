"""What ``/v1/responses`` answers: the ``response`` object, its output items, and the builder
that turns generated text into items and the spec's stream events.

:class:`OutputBuilder` is fed the text of one choice as it comes; it opens a ``message`` item
(one ``output_text`` part) for text and a ``function_call`` item per tool call (read by
:class:`server.api.chat_tools.ToolStream` under the request's tool plan), and returns the
events each piece makes, in the spec's order: ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``… then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
for a message; ``response.output_item.added``, ``response.function_call_arguments.delta``…,
``response.function_call_arguments.done``, ``response.output_item.done`` for a call. Events are
dicts without ``sequence_number`` (the stream numbers them). A whole answer goes through the
same builder, so the JSON answer and the stream's final response have the same items.
Item ids: ``msg_<hex>``, ``fc_<hex>``; call ids ``call_<hex>`` (:func:`chat_tools.call_id`).

With ``--reasoning-parser`` (:mod:`server.text.reasoning`) the builder splits the ``<think>``
block off first: it becomes a ``reasoning`` item (id ``rs_<hex>``, one ``reasoning_text``
content part; ``response.reasoning_text.delta``… then ``response.reasoning_text.done``) before
the message and calls, which are read from the rest. ``reasoning`` input items are not
rendered (:func:`server.api.responses._messages`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from server.api.chat_protocol import ChatDelta
from server.api.chat_tools import ToolPlan, ToolStream
from server.api.protocol import now
from server.text.reasoning import ReasoningStream

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Status
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Status


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Status


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @staticmethod
    def of(input_tokens: int, output_tokens: int) -> ResponseUsage:
        total = input_tokens + output_tokens
        return ResponseUsage(
            input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=total
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The ``response`` object: the request's settings echoed, the output, the usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(BaseModel):
    """The answer of ``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


Event = dict[str, Any]


@dataclass
class OutputBuilder:
    """One choice's text → output items and their events (module docstring)."""

    tools: ToolPlan
    reasoning: ReasoningStream | None = None  # the request's parser's, if any
    items: list[OutputItem] = field(default_factory=list)
    _stream: ToolStream | None = None
    _open: OutputItem | None = None

    def __post_init__(self) -> None:
        self._stream = ToolStream(self.tools)

    def feed(self, text: str, last: bool = False, incomplete: bool = False) -> list[Event]:
        """The events ``text`` makes; with ``last``, also those that end the open item (its
        status ``incomplete`` with ``incomplete``: the answer hit ``max_output_tokens``). An
        answer with neither text nor calls is one empty message."""
        assert self._stream is not None
        events: list[Event] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, last=last)
            events += self._think(thought) if thought else []
        if self.tools.mode == "none":
            pieces = [ChatDelta(content=text)] if text else []
        else:
            pieces = self._stream.feed(text) + (self._stream.finish() if last else [])
        for piece in pieces:
            if piece.content:
                events += self._text(piece.content)
            for call in piece.tool_calls or []:
                if call.id is not None:
                    events += self._call(call.id, call.function.name or "")
                if call.function.arguments:
                    events += self._arguments(call.function.arguments)
        if last:
            if not any(not isinstance(item, OutputReasoning) for item in self.items):
                events += self._message()
            events += self._close("incomplete" if incomplete else "completed")
        return events

    def _where(self, item: OutputItem) -> Event:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _message(self) -> list[Event]:
        events = self._close()
        message = OutputMessage(id=item_id("msg"), status="in_progress", content=[])
        events += self._added(message)
        part = OutputText(text="")
        where = self._where(message) | {"content_index": 0}
        events.append({"type": "response.content_part.added", **where, "part": part.model_dump()})
        message.content.append(part)
        return events

    def _text(self, text: str) -> list[Event]:
        events = [] if isinstance(self._open, OutputMessage) else self._message()
        assert isinstance(self._open, OutputMessage)
        self._open.content[0].text += text
        where = self._where(self._open) | {"content_index": 0}
        delta = {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []}
        return [*events, delta]

    def _think(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self._open, OutputReasoning):
            thinking = OutputReasoning(
                id=item_id("rs"), content=[ReasoningText(text="")], status="in_progress"
            )
            events = self._close() + self._added(thinking)
        assert isinstance(self._open, OutputReasoning)
        self._open.content[0].text += text
        where = self._where(self._open) | {"content_index": 0}
        return [*events, {"type": "response.reasoning_text.delta", **where, "delta": text}]

    def _call(self, call_id: str, name: str) -> list[Event]:
        events = self._close()
        call = OutputFunctionCall(
            id=item_id("fc"), call_id=call_id, name=name, arguments="", status="in_progress"
        )
        return events + self._added(call)

    def _arguments(self, delta: str) -> list[Event]:
        assert isinstance(self._open, OutputFunctionCall)
        self._open.arguments += delta
        return [
            {
                "type": "response.function_call_arguments.delta",
                **self._where(self._open),
                "delta": delta,
            }
        ]

    def _added(self, item: OutputItem) -> list[Event]:
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        return [
            {"type": "response.output_item.added", "output_index": index, "item": item.model_dump()}
        ]

    def _close(self, status: Status = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = self._where(item)
        events: list[Event] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            at = where | {"content_index": 0}
            events.append(
                {"type": "response.output_text.done", **at, "text": part.text, "logprobs": []}
            )
            events.append({"type": "response.content_part.done", **at, "part": part.model_dump()})
        elif isinstance(item, OutputReasoning):
            at = where | {"content_index": 0}
            text = item.content[0].text
            events.append({"type": "response.reasoning_text.done", **at, "text": text})
        else:
            events.append(
                {"type": "response.function_call_arguments.done", **where}
                | {"name": item.name, "arguments": item.arguments}
            )
        done = {"type": "response.output_item.done", "output_index": where["output_index"]}
        return [*events, done | {"item": item.model_dump()}]
