"""``POST /v1/chat/completions`` request and response bodies.

A message's ``content`` is a string, ``null``, or a list of ``{"type": "text",
"text": ...}`` parts (joined with newlines, as vLLM does); other part types
(images, audio) are refused. Extra message keys (``name``, ``tool_calls``,
``tool_call_id``, ...) are passed to the chat template untouched.
``max_completion_tokens`` wins over the legacy ``max_tokens``; neither means
"the rest of the context". ``top_logprobs`` (0..20) needs ``logprobs: true``.
Tools, non-text ``response_format`` and ``logit_bias`` are refused.
``add_generation_prompt`` is a vLLM extension (default true).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from model_shards.messages import FinishReason
from server.protocol import MAX_LOGPROBS, SamplingFields, Usage, now, unsupported


class ChatMessage(BaseModel):
    """One message of the conversation; extra keys are kept for the template."""

    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1)]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _text_only(cls, value: str | list[dict[str, Any]] | None) -> str | None:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(
                    "only text content parts ({'type': 'text', 'text': ...}) are supported"
                )
            texts.append(part["text"])
        return "\n".join(texts)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (content already a string or None)."""
        return {**(self.model_extra or {}), "role": self.role, "content": self.content}


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``; see the module docstring."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("range", "top_logprobs requires logprobs to be true")
        return value

    @field_validator("tools", mode="after")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise unsupported("tools (function calling) are not supported")
        return value

    @field_validator("tool_choice", mode="after")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none", "auto"):
            raise unsupported("tool_choice is not supported")
        return value

    @field_validator("response_format", mode="after")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise unsupported("only response_format {'type': 'text'} is supported")
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A streamed message piece: ``role`` in a choice's first chunk only."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
