"""``POST /v1/responses`` request body (OpenAI's Responses API, as vLLM serves it).

``input`` is a string (one user message) or a list of items: messages (``role`` user, system,
developer or assistant; ``content`` a string or ``input_text`` / ``output_text`` /
``input_image`` / ``refusal`` parts), ``function_call`` and ``function_call_output`` items, and
``reasoning`` items (accepted, not rendered). ``tools`` are function tools (flat:
``{"type": "function", "name", "parameters"}``); ``tool_choice`` is ``none``, ``auto``,
``required`` or ``{"type": "function", "name"}``. ``text.format`` is ``text``, ``json_object``
or ``json_schema`` (flat: ``name``, ``schema``, ``strict``). Refused with a 400 naming the
field: built-in and other non-function tools, ``background: true``, ``truncation: auto``,
``conversation``, ``prompt`` templates, item references, file and audio inputs, logprobs.
``reasoning``, ``metadata``, ``include`` (without logprobs), ``service_tier``, ``user`` and
the cache and safety keys are accepted and echoed or ignored, as vLLM does. Unknown fields
are ignored. The answer's shapes are in :mod:`server.api.responses_output`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from server.api.protocol import MAX_STOP_STRINGS, Penalty, unsupported

Role = Literal["user", "system", "developer", "assistant"]
ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_PART_TYPES = ("input_text", "output_text", "input_image", "refusal")


class ResponsesContentPart(BaseModel):
    """A content part: text (``input_text``/``output_text``), an image or a refusal."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "output_text", "input_image", "refusal"]
    text: str | None = None
    image_url: str | None = None
    refusal: str | None = None


def _parts(value: Any, param: str) -> None:
    """Refuse a content part type we do not take, naming it."""
    for j, part in enumerate(value if isinstance(value, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_TYPES:
            raise unsupported(
                f"{param}[{j}].type {kind!r} is not supported: content parts may be "
                + ", ".join(_PART_TYPES)
            )


def _check_item(item: Any, param: str) -> None:
    """Name what is wrong with an input item before pydantic's union message would."""
    if not isinstance(item, dict):
        raise unsupported(f"{param} must be an object")
    kind = item.get("type", "message")
    if kind not in ITEM_TYPES:
        raise unsupported(
            f"{param}.type {kind!r} is not supported: items may be " + ", ".join(ITEM_TYPES)
        )
    if kind == "message" and item.get("role") not in ROLES:
        raise PydanticCustomError(
            "range",
            f"{param}.role must be one of {', '.join(ROLES)} (a tool's result is a "
            "function_call_output item)",
        )
    key = "content" if kind == "message" else "output"
    _parts(item.get(key), f"{param}.{key}")


class ResponsesMessageItem(BaseModel):
    """A message of the conversation; ``type`` may be left out."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Role
    content: str | list[ResponsesContentPart]


class ResponsesFunctionCallItem(BaseModel):
    """A call the model made earlier (``arguments``: JSON text)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str


class ResponsesFunctionOutputItem(BaseModel):
    """A call's result, sent back as a tool message."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[ResponsesContentPart]


class ResponsesReasoningItem(BaseModel):
    """A reasoning item of an earlier turn: accepted, not rendered (chat templates drop past
    thinking); the reasoning parser (issue #45 item 2) may render it."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ITEM_TYPES else None


InputItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("message")]
    | Annotated[ResponsesFunctionCallItem, Tag("function_call")]
    | Annotated[ResponsesFunctionOutputItem, Tag("function_call_output")]
    | Annotated[ResponsesReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class ResponsesFunctionTool(BaseModel):
    """A function the model may call (Responses' flat shape)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``schema``."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    description: str | None = None
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: ResponsesTextFormat | None = None


class ResponsesReasoning(BaseModel):
    """Accepted and echoed; a model without a reasoning parser ignores it (as vLLM does)."""

    model_config = ConfigDict(extra="allow")

    effort: str | None = None
    summary: str | None = None


#: Fields the chat route's :class:`server.api.protocol.SamplingFields` takes unchanged.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``; see the module docstring."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    background: bool = False
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    conversation: Any = None  # refused
    prompt: Any = None  # refused (stored prompt templates)

    @field_validator("conversation", "prompt", mode="after")
    @classmethod
    def _not_served(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise unsupported(f"{info.field_name} is not supported")
        return value

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise unsupported("top_logprobs is not supported on /v1/responses")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise PydanticCustomError("empty", "input must be a string or a non-empty list")
            for i, item in enumerate(value):
                _check_item(item, f"input[{i}]")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise unsupported(
                    f"tools[{i}].type {kind!r} is not supported: only function tools "
                    "(built-in tools such as web_search are not served)"
                )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise unsupported(
                f"tool_choice type {value.get('type')!r} is not supported: give none, auto, "
                "required or a function"
            )
        return value

    @field_validator("include", mode="after")
    @classmethod
    def _no_logprobs(cls, value: list[str] | None) -> list[str] | None:
        if value and "message.output_text.logprobs" in value:
            raise unsupported("include 'message.output_text.logprobs' is not supported")
        return value

    @field_validator("background", mode="after")
    @classmethod
    def _foreground(cls, value: bool) -> bool:
        if value:
            raise unsupported("background responses are not supported; leave background false")
        return value

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_truncation(cls, value: Any) -> Any:
        if value == "auto":
            raise unsupported("truncation 'auto' is not supported; a prompt too long is a 400")
        return value
