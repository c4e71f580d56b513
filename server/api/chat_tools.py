"""Tool calling on ``/v1/chat/completions``: ``tool_choice`` → a plan, output → ``tool_calls``.

* ``none`` (or no tools): plain text;
* ``auto``: the model writes calls in its own format; the server's tool-call parser
  (``--tool-call-parser``, else the one the chat template shows,
  :func:`server.text.tool_parsers.detect`) finds them;
* a named function: the output is constrained to that function's ``parameters``
  schema and becomes the arguments of one call;
* ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one schema per tool (at most one item unless ``parallel_tool_calls``; with
  ``auto`` only the first call is kept then).

A response with calls has ``message.tool_calls`` (ids ``call_<hex>``), content only
for text before the calls, and ``finish_reason: "tool_calls"`` when the model stopped
by itself. :class:`ToolStream` turns a choice's text deltas into OpenAI-shaped
``delta.tool_calls`` chunks: per call first ``index``, ``id``, ``type`` and the name,
then the arguments (as they come for a named function, whole otherwise).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from model_shards.messages import GrammarSpec
from server.api.chat_protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatDelta,
    ChatFinishReason,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)
from server.api.structured import canonical_json, checked
from server.http.errors import APIError
from server.text.tool_parsers import PARSERS, ParsedCall, ToolParser

Mode = Literal["none", "auto", "named", "required"]


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode = "none"
    parser: ToolParser | None = None
    name: str = ""  # the named function
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only


def _parameters(body: ChatCompletionRequest, i: int) -> dict[str, Any]:
    assert body.tools is not None
    params = body.tools[i].function.parameters
    return params if params is not None else {"type": "object"}


def tool_plan(
    body: ChatCompletionRequest, parser_name: str | None
) -> tuple[ToolPlan, GrammarSpec | None]:
    """The plan and the grammar (for ``required`` and a named function) of ``body``."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise APIError.bad_request(
                "'tool_choice' other than none needs 'tools'", param="tool_choice"
            )
        return ToolPlan(), None
    if choice == "none":
        return ToolPlan(), None
    if choice == "auto":
        if parser_name is None:
            raise APIError.bad_request(
                "'tool_choice': auto needs a tool-call parser; this model's chat template "
                "shows no known tool format: start the server with --tool-call-parser",
                param="tool_choice",
            )
        return ToolPlan("auto", PARSERS[parser_name](), parallel=body.parallel_tool_calls), None
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise APIError.bad_request(
                f"'tool_choice': no tool named {choice.function.name!r} in 'tools'",
                param="tool_choice",
            )
        i = names.index(choice.function.name)
        param = f"tools[{i}].function.parameters"
        grammar = checked("json_schema", canonical_json(_parameters(body, i)), param)
        return ToolPlan("named", name=choice.function.name), grammar
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": _parameters(body, i)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return ToolPlan("required"), checked("json_schema", canonical_json(schema), "tools")


def _required_calls(text: str) -> list[ParsedCall]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    return [
        ParsedCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a whole answer under ``plan``."""
    if plan.mode == "named":
        return None, [ParsedCall(plan.name, text)]
    if plan.mode == "required":
        calls = _required_calls(text)
        return (None, calls) if calls else (text, [])
    if plan.mode == "auto" and plan.parser is not None:
        content, calls = plan.parser.extract(text)
        return content, calls if plan.parallel else calls[:1]
    return text, []


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(calls: bool, reason: ChatFinishReason | None) -> ChatFinishReason | None:
    return "tool_calls" if calls and reason == "stop" else reason


def message(plan: ToolPlan, text: str) -> AssistantMessage:
    """The assistant message of a whole answer."""
    content, calls = parse_calls(plan, text)
    if not calls:
        return AssistantMessage(content=text)
    tool_calls = [
        ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return AssistantMessage(content=content, tool_calls=tool_calls)


def _call_deltas(index: int, call: ParsedCall) -> list[ChatDelta]:
    header = ToolCallDelta(
        index=index, id=call_id(), type="function", function=FunctionCallDelta(name=call.name)
    )
    args = ToolCallDelta(index=index, function=FunctionCallDelta(arguments=call.arguments))
    return [ChatDelta(tool_calls=[header]), ChatDelta(tool_calls=[args])]


@dataclass
class ToolStream:
    """One choice's text deltas → content and ``tool_calls`` deltas (module docstring)."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    calls_sent: int = 0
    _started: bool = field(default=False, repr=False)

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def feed(self, delta: str) -> list[ChatDelta]:
        self.text += delta
        if self.plan.mode == "named":
            out = []
            if not self._started:
                self._started = True
                out = _call_deltas(0, ParsedCall(self.plan.name, ""))[:1]
                self.calls_sent = 1
            if delta:
                piece = ToolCallDelta(index=0, function=FunctionCallDelta(arguments=delta))
                out.append(ChatDelta(tool_calls=[piece]))
            return out
        if self.plan.mode != "auto" or self.plan.parser is None:
            return []  # required: the array is parsed whole at the end
        end = self.plan.parser.safe_end(self.text)
        return self._content(end) + self._complete_hermes_calls()

    def _content(self, end: int) -> list[ChatDelta]:
        if end <= self.content_sent:
            return []
        piece = self.text[self.content_sent : end]
        self.content_sent = end
        return [ChatDelta(content=piece)]

    def _complete_hermes_calls(self) -> list[ChatDelta]:
        """Calls whose closing tag has come (Hermes only: other formats end with the text)."""
        closing = "</tool_call>"
        if self.plan.parser is None or self.plan.parser.name != "hermes":
            return []
        last = self.text.rfind(closing)
        if last < 0:
            return []
        _, calls = parse_calls(self.plan, self.text[: last + len(closing)])
        return self._new_calls(calls)

    def _new_calls(self, calls: list[ParsedCall]) -> list[ChatDelta]:
        out = []
        for i in range(self.calls_sent, len(calls)):
            out += _call_deltas(i, calls[i])
        self.calls_sent = max(self.calls_sent, len(calls))
        return out

    def finish(self) -> list[ChatDelta]:
        """What is left once the answer is whole."""
        if self.plan.mode == "named":
            return self.feed("") if not self._started else []
        _, calls = parse_calls(self.plan, self.text)
        return self._new_calls(calls) if calls else self._content(len(self.text))
