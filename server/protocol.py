"""OpenAI-compatible request and response bodies for ``/v1/completions`` and ``/v1/models``.

Requests are validated here and nowhere else: a :class:`CompletionRequest` that
constructs is well-formed except for the checks that need the engine's numbers
(vocabulary size, context length), which :mod:`server.completions` makes.
Unknown fields are ignored (clients send ``user`` and friends); fields we know
but do not implement (``n > 1``, ``echo``, ``logprobs``, ...) are refused with
a message naming them rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from pydantic_core import PydanticCustomError

from model_shards.messages import FinishReason, SamplingParams

MAX_STOP_STRINGS = 4

TokenId = Annotated[StrictInt, Field(ge=0)]


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """``POST /v1/completions``. After validation ``prompt`` is a non-empty ``str``
    or a non-empty ``list[int]`` and ``stop`` is a list of non-empty strings."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    ignore_eos: bool = False  # vLLM extension
    # Known OpenAI fields we do not implement: accepted only at their defaults.
    best_of: StrictInt | None = None
    echo: bool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored

    @field_validator("prompt", mode="after")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str):
            if not value:
                raise PydanticCustomError("empty", "prompt must not be empty")
            return value
        if not value:
            raise PydanticCustomError("empty", "prompt must not be empty")
        if isinstance(value[0], str | list):  # a batch of prompts
            if len(value) != 1:
                raise _unsupported("only one prompt per request is supported")
            return cls._one_prompt(value[0])
        return list(value)

    @field_validator("top_k", mode="after")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise PydanticCustomError("range", "top_k must be -1 or 0 (disabled) or >= 1")
        return value

    @field_validator("stop", mode="after")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_STRINGS:
            raise PydanticCustomError(
                "too_many", "at most {limit} stop strings are allowed", {"limit": MAX_STOP_STRINGS}
            )
        if any(not s for s in stops):
            raise PydanticCustomError("empty", "stop strings must not be empty")
        return stops

    @field_validator("n", mode="after")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise _unsupported("only n=1 is supported")
        return value

    @field_validator("best_of", mode="after")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise _unsupported("best_of is not supported (only 1)")
        return value

    @field_validator("echo", mode="after")
    @classmethod
    def _echo(cls, value: bool) -> bool:
        if value:
            raise _unsupported("echo is not supported")
        return value

    @field_validator("logprobs", "suffix", "logit_bias", mode="after")
    @classmethod
    def _absent(cls, value: Any) -> Any:
        if value:
            raise _unsupported("this field is not supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty", mode="after")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise _unsupported("penalties are not supported (only 0)")
        return value

    @property
    def prompt_input(self) -> str | list[int]:
        """``prompt`` after validation: one non-empty string or token-id list."""
        return cast("str | list[int]", self.prompt)

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` after validation (always a list)."""
        return self.stop if isinstance(self.stop, list) else []

    def sampling_params(self) -> SamplingParams:
        """The engine's sampling parameters; OpenAI defaults where a field is null."""
        top_k = self.top_k or 0
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k < 0 else top_k,
            seed=self.seed,
        )


# ---- responses --------------------------------------------------------------


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @staticmethod
    def of(prompt_tokens: int, completion_tokens: int) -> Usage:
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or one streamed chunk (``text`` is then the delta)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "shardserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
