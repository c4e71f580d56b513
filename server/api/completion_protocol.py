"""``POST /v1/completions`` request and response bodies.

After validation :attr:`CompletionRequest.prompts` is a non-empty list of
prompts, each a non-empty ``str`` or a non-empty ``list[int]`` (a batch gives
one choice per prompt and ``n``: index = prompt_i * n + j, as OpenAI does).
``logprobs`` is the number of top alternatives per token, 0..20 (OpenAI allows
5, vLLM 20). ``echo`` puts the prompt before each choice's text (and, with ``logprobs``,
its tokens before the generated ones: the first has a ``null`` logprob); ``max_tokens: 0``
is allowed only with ``echo`` (the prompt scored, nothing generated). ``prompt_logprobs``
(vLLM's, 0..20, not with ``stream``) gives each choice vLLM's per-prompt-token dicts.
``suffix`` is refused; ``best_of`` is accepted only when it equals ``n`` (it then means
nothing more).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, Field, StrictInt, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from model_shards.messages import FinishReason
from server.api.protocol import MAX_LOGPROBS, SamplingFields, TokenId, Usage, now, unsupported

#: Most prompts in one batched completion request.
MAX_BATCH_PROMPTS = 32

Prompt = str | list[int]


def _check_prompt(value: Any) -> Prompt:
    if not value:
        raise PydanticCustomError("empty", "prompt must not be empty")
    return cast(Prompt, value)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``; see the module docstring for the normalised fields."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("prompt", mode="after")
    @classmethod
    def _prompts(cls, value: Any) -> list[Prompt]:
        if isinstance(value, str) or not value or not isinstance(value[0], str | list):
            return [_check_prompt(value)]
        if len(value) > MAX_BATCH_PROMPTS:
            raise PydanticCustomError(
                "too_many", "at most {limit} prompts per request", {"limit": MAX_BATCH_PROMPTS}
            )
        return [_check_prompt(p) for p in value]

    @field_validator("best_of", mode="after")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise unsupported("best_of is not supported (only equal to n)")
        return value

    @field_validator("max_tokens", mode="after")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise PydanticCustomError("range", "max_tokens may be 0 only with echo")
        return value

    @field_validator("prompt_logprobs", mode="after")
    @classmethod
    def _prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise unsupported("prompt_logprobs is not available with stream (as in vLLM)")
        return value

    @field_validator("suffix", mode="after")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise unsupported("suffix (insertion) is not supported")
        return value

    @property
    def prompts(self) -> list[Prompt]:
        """``prompt`` after validation: one or more non-empty strings or id lists."""
        return cast("list[Prompt]", self.prompt)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top-N the engine scores the prompt with (``None``: no scoring)."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        asked = [k for k in wanted if k is not None]
        return max(asked) if asked else None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs object; one entry per token (with ``echo`` the prompt's
    first, the very first token's logprob and top alternatives ``null``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    """vLLM's ``Logprob``: one token's entry in a ``prompt_logprobs`` dict."""

    logprob: float
    rank: int
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt token (``None`` for the first), token id (as a
#: string) → entry, the prompt token's own first, then the top alternatives.
PromptLogprobsList = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: PromptLogprobsList | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


class CompletionResponse(BaseModel):
    """A whole completion, or one streamed chunk (``text`` is then the delta)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
