"""OpenAI-compatible pieces shared by every route: sampling fields, usage, models, errors.

Requests are validated by pydantic and nowhere else: a request model that
constructs is well-formed except for the checks that need the engine's numbers
(vocabulary size, context length), which the route modules make. Unknown
fields are ignored (clients send ``user`` and friends); fields we know but do
not implement are refused with a message naming them rather than silently
ignored. The route-specific bodies are in :mod:`server.api.completion_protocol`
and :mod:`server.api.chat_protocol`; both extend :class:`SamplingFields`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from pydantic_core import PydanticCustomError

from model_shards.messages import GrammarSpec, SamplingParams

MAX_STOP_STRINGS = 4
#: Longest stop string (characters): each is matched against every streamed text delta.
MAX_STOP_CHARS = 1024
#: Most ``bad_words``, and the longest one (characters); each is tokenized twice and checked
#: by the engine at every step.
MAX_BAD_WORDS = 512
MAX_BAD_WORD_CHARS = 256
#: Most choices one request may ask for (``n``); vLLM has no cap, OpenAI 128.
MAX_N = 16
#: Most top alternatives per token (the engine's limit).
MAX_LOGPROBS = 20

TokenId = Annotated[StrictInt, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def unsupported(message: str) -> PydanticCustomError:
    """A validation error for a known field we do not implement (a 400 naming it)."""
    return PydanticCustomError("unsupported", message)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields every generating route accepts; ``None`` means the OpenAI default.

    ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
    ``stop_token_ids``, ``ignore_eos``, ``allowed_token_ids``, ``bad_words``, ``structured_outputs``
    and ``guided_*`` are vLLM extensions. ``logit_bias`` maps token ids (as strings)
    to -100..100; ``response_format`` and the structured-output fields are turned into
    one grammar by :meth:`grammar` (:mod:`server.api.structured`).
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(le=2**31 - 1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    # vLLM's: lower first under --scheduling-policy priority
    priority: Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)] = 0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    bad_words: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
            Field(max_length=MAX_BAD_WORDS),
        ]
        | None
    ) = None
    user: str | None = None  # accepted and ignored

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
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise PydanticCustomError(
                "too_long",
                "stop strings may have at most {limit} characters",
                {"limit": MAX_STOP_CHARS},
            )
        return stops

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()):
                raise PydanticCustomError(
                    "range", "logit_bias keys must be token ids (non-negative integers)"
                )
        return value

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with integer keys (validated)."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def grammar(self) -> GrammarSpec | None:
        """The one output constraint asked for, checked (400 naming the field), or ``None``."""
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        from server.api import structured

        return structured.grammar_of(self.response_format, self.structured_outputs, guided)

    @property
    def grammar_param(self) -> str | None:
        """The field :meth:`grammar`'s constraint comes from (``None``: no grammar)."""
        from server.api import structured

        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        return structured.grammar_param(self.response_format, self.structured_outputs, guided)

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` after validation (always a list)."""
        return self.stop if isinstance(self.stop, list) else []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self, logprobs: int | None, bad_words_token_ids: list[list[int]] | None = None
    ) -> SamplingParams:
        """The engine's sampling parameters (seed as given; choices re-seed them);
        ``bad_words_token_ids``: ``bad_words`` tokenized
        (:func:`server.api.serving.bad_words_ids`)."""
        top_k = self.top_k or 0

        def pick(value: float | None, default: float) -> float:
            return default if value is None else value

        return SamplingParams(
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=0 if top_k < 0 else top_k,
            min_p=pick(self.min_p, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            seed=self.seed,
            logprobs=logprobs,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias_ids,
            allowed_token_ids=None if self.allowed_token_ids is None else [*self.allowed_token_ids],
            bad_words_token_ids=bad_words_token_ids or [],
        )


# ---- responses --------------------------------------------------------------


def new_id(prefix: str) -> str:
    """A fresh response id, e.g. ``cmpl-<hex>`` or ``chatcmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "shardserve"
    root: str
    max_model_len: int
    modalities: list[str] = ["text"]  # what prompts may hold: "text", "image"
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
