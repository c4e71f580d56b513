"""``POST /v1/chat/completions`` request and response bodies.

A message's ``content`` is a string, ``null``, or a list of ``{"type": "text",
"text": ...}`` parts (joined with newlines, as vLLM does) and ``image_url`` parts
(moved to the message's ``media``, a marker left in their place:
:mod:`server.media.parts`); other part types (audio, …) are refused. Extra message
keys (``name``, ``tool_calls``, ``tool_call_id``, ...) are passed to the chat template
untouched.
``max_completion_tokens`` wins over the legacy ``max_tokens``; neither means
"the rest of the context". ``top_logprobs`` (0..20) needs ``logprobs: true``.
``tools`` are function definitions passed to the chat template; ``tool_choice`` is
``none``, ``auto``, ``required`` or a named function (:mod:`server.api.chat_tools`);
an assistant message's ``tool_calls[].function.arguments`` JSON string is given to
the template as an object (as vLLM does). Roles are checked by :mod:`server.api.chat`.
``add_generation_prompt`` is a vLLM extension (default true), as is ``chat_template_kwargs``
(extra template variables such as ``enable_thinking``; not the ones the server sets). An
assistant message with ``tool_calls`` and ``content: null`` reaches the template with
``content`` an empty string (as vLLM's), so templates that concatenate it work. With a
``--reasoning-parser``, the answer's ``<think>`` block is ``reasoning_content`` and
``reasoning`` (message and deltas), absent otherwise.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from server.api.completion_protocol import PromptLogprobsList
from server.api.protocol import MAX_LOGPROBS, SamplingFields, Usage, now, unsupported
from server.media.parts import MediaPart, split_media_parts

#: The roles OpenAI defines (``function`` is the legacy tool result).
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


def _arguments_as_objects(tool_calls: Any) -> Any:
    """Assistant ``tool_calls`` with each JSON-string ``arguments`` parsed (for templates)."""
    if not isinstance(tool_calls, list):
        return tool_calls
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


class ChatMessage(BaseModel):
    """One message of the conversation; extra keys are kept for the template."""

    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1)]
    content: str | list[dict[str, Any]] | None = None
    # image parts (server.media.parts), never a client's field
    media: SkipJsonSchema[list[MediaPart]] = Field(default_factory=list, exclude=True)
    content_parts: SkipJsonSchema[list[dict[str, Any]] | None] = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _take_media(cls, data: Any) -> Any:
        return split_media_parts(data)

    @field_validator("content", mode="after")
    @classmethod
    def _text_only(cls, value: str | list[dict[str, Any]] | None) -> str | None:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported("only text and image_url content parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)

    def template_dict(self, content_parts: bool = False) -> dict[str, Any]:
        """The message as the chat template sees it (content already a string or None; with
        ``content_parts``, a list content as its parts, images as ``{"type": "image"}``)."""
        content = self.content_parts if content_parts and self.content_parts else self.content
        out = {**(self.model_extra or {}), "role": self.role, "content": content}
        if "tool_calls" in out:
            out["tool_calls"] = _arguments_as_objects(out["tool_calls"])
            if content is None and self.role == "assistant":
                out["content"] = ""
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``; see the module docstring."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    # vLLM's: extra variables for the chat template (e.g. enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the rendered prompt scored, top-N per token (0..20), not with stream
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("prompt_logprobs", mode="after")
    @classmethod
    def _prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise unsupported("prompt_logprobs is not available with stream (as in vLLM)")
        return value

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("range", "top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """What the engine is asked for: ``None`` (off) or the number of alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses --------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


def _without_none(keys: tuple[str, ...], data: Any) -> Any:
    """``data`` (a dumped model) without those of ``keys`` that are ``None``."""
    if isinstance(data, dict):
        for key in keys:
            if data.get(key, 0) is None:
                del data[key]
    return data


_OPTIONAL = ("tool_calls", "reasoning_content", "reasoning")  # left out when None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The answer; ``tool_calls`` appears only when the model called tools."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # --reasoning-parser: the <think> block (vLLM's two names for it), absent without one
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_none(_OPTIONAL, handler(self))


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_none(("name", "arguments"), handler(self))


class ToolCallDelta(BaseModel):
    """A streamed tool-call piece: ``id``, ``type`` and the name first, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_none(("id", "type"), handler(self))


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's: the rendered prompt's scores (one prompt for every choice), when asked
    prompt_logprobs: PromptLogprobsList | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


class ChatDelta(BaseModel):
    """A streamed message piece: ``role`` in a choice's first chunk only."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_none(_OPTIONAL, handler(self))


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
