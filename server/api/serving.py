"""What every generating route shares: the served model, its checks, errors and SSE framing.

:class:`ServedModel` bundles the engine client, tokenizer, model name, context
length and metrics that a route needs. :meth:`ServedModel.check` makes the checks
only the frontend can make, in order: model name (404) → engine serviceable,
i.e. healthy or recovering (503) → the route's task is the model's (400).
:func:`check_ids` names the field of a token id outside the vocabulary (400);
:meth:`ServedModel.check_prompt_chars` refuses a text prompt too long to fit the context before
it is tokenized (400). The routes run their preparation (tokenizing, templates, ``bad_words``)
through :attr:`ServedModel.offload`, off the event loop.
The engine checks every request again, whoever sends it
(:mod:`model_shards.engine.request_checks`: ids, sampling ranges, context, KV pool);
a refusal there reaches the client as a 400 (``engine_refused``).
:meth:`ServedModel.collect` and :meth:`ServedModel.merge` run a request's choices
(:mod:`server.api.choices`) on this engine.
:func:`engine_api_error` maps engine failures to HTTP errors: a refused
request is a 400, a dead engine a 503.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from model_shards.messages import LoraRef
from server.api import choices
from server.engine.client import Engine, EngineDeadError, EngineRequestError
from server.http.errors import APIError
from server.http.metrics import Metrics
from server.http.offload import Offload
from server.media.fetch import MediaOptions
from server.text.generation import TextDelta
from server.text.reasoning import ReasoningParser
from server.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from server.api.lora import LoraRegistry
    from server.media.multimodal import ImageModel

#: What a replica of each ``EngineReady.task`` serves, in the 400 of a route it cannot serve.
TASK_NAMES = {
    "generate": "text generation",
    "embed": "embeddings",
    "classify": "classification and scoring (a cross-encoder)",
}

#: The fewest characters per token :attr:`ServedModel.max_prompt_chars` assumes.
MIN_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class ServedModel:
    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: Metrics
    tool_parser: str | None = None  # the --tool-call-parser (or the template's) name
    image_model: ImageModel | None = None  # a vision-language model's image intake
    media_options: MediaOptions = field(default_factory=MediaOptions)  # the media flags
    offload: Offload = field(default_factory=Offload)  # the threads requests are prepared in
    reasoning: ReasoningParser | None = None  # --reasoning-parser
    scheduling_policy: str = "fcfs"  # the engine's --scheduling-policy
    loras: LoraRegistry | None = None  # --enable-lora: the adapters a request may name

    def check_priority(self, priority: int) -> int:
        """``priority``, or a 400 naming it if the engine does not schedule by priority."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise APIError.bad_request(
                f"'priority' ({priority}) needs --scheduling-policy priority; this server "
                f"schedules {self.scheduling_policy}",
                param="priority",
            )
        return priority

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text prompt cannot fit ``max_model_len`` tokens: no token
        covers more than twice the longest vocabulary entry (at least
        :data:`MIN_CHARS_PER_TOKEN`; an unknown-word token or a normalizer may cover more
        than its own text)."""
        per_token = max(MIN_CHARS_PER_TOKEN, 2 * self.tokenizer.max_token_chars)
        return self.max_model_len * per_token

    def check_prompt_chars(self, text: str, param: str) -> None:
        """400 naming ``param`` if ``text`` is longer than :attr:`max_prompt_chars`."""
        limit = self.max_prompt_chars
        if len(text) > limit:
            raise APIError.bad_request(
                f"'{param}' has {len(text)} characters; this model's context of "
                f"{self.max_model_len} tokens takes at most {limit}",
                param=param,
                code="context_length_exceeded",
            )

    def check(self, model: str | None, task: str = "generate") -> int:
        """Raise the 404 (unknown ``model``), 503 (engine not serviceable) or 400 (``task``
        is not the model's) a request gets now; return the vocabulary size."""
        if model is not None and model != self.model_name and self.lora_of(model) is None:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )
        info = self.engine.info
        if info is None or not self.engine.serviceable:
            raise APIError.unavailable(self.engine.dead_reason or "engine is not ready")
        if info.task != task:
            raise APIError.bad_request(
                f"`{self.model_name}` serves {TASK_NAMES[info.task]}; this route needs a model "
                f"that serves {TASK_NAMES[task]}",
                param="model",
                code="wrong_model_task",
            )
        return info.vocab_size

    def answered_by(self, work: choices.ChoiceRequests) -> str:
        """The ``model`` of a response: the LoRA adapter the requests ran with, else ours."""
        lora = work.requests[0].lora if work.requests else None
        return self.model_name if lora is None else lora.name

    def lora_of(self, model: str | None) -> LoraRef | None:
        """The LoRA adapter ``model`` names, or ``None`` (the base model, or unknown)."""
        if model is None or self.loras is None or model == self.model_name:
            return None
        return self.loras.get(model)

    async def collect(
        self, work: choices.ChoiceRequests, stop: list[str]
    ) -> list[choices.ChoiceResult]:
        """Every choice of ``work`` run to the end; an engine failure as its HTTP error."""
        try:
            return await choices.collect(work, self.engine, self.tokenizer, stop, self.metrics)
        except ENGINE_ERRORS as exc:
            raise engine_api_error(exc, work.grammar_param) from exc

    def merge(
        self, work: choices.ChoiceRequests, stop: list[str]
    ) -> AsyncGenerator[tuple[int, TextDelta], None]:
        """``(choice index, text delta)`` pairs as the choices of ``work`` produce them."""
        return choices.merge(work, self.engine, self.tokenizer, stop, self.metrics)


def bad_words_ids(tokenizer: Tokenizer, words: list[str] | None) -> list[list[int]]:
    """Each bad word's ids as written and after a space (vLLM's two spellings), once each
    (first seen first; linear in the words' length)."""
    texts = [text for word in words or [] for text in (word.lstrip(), " " + word.lstrip())]
    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    for ids in tokenizer.encode_many(texts, add_special_tokens=False) if texts else []:
        key = tuple(ids)
        if ids and key not in seen:
            seen.add(key)
            out.append(ids)
    return out


def check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 naming ``param`` if an id is outside ``0..vocab_size-1``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError.bad_request(
            f"token id {bad[0]} in '{param}' is out of range: the vocabulary has "
            f"{vocab_size} tokens (ids 0..{vocab_size - 1})",
            param=param,
        )


def engine_api_error(exc: Exception, grammar_param: str | None = None) -> APIError:
    """Map an engine-side failure to the HTTP error the client sees; a refusal of the
    request's grammar (it did not compile, or not in time, or its masks were too slow)
    names ``grammar_param``, the field it came from."""
    if isinstance(exc, EngineRequestError) and (exc.code or "").startswith("grammar_"):
        prefix = f"'{grammar_param}': " if grammar_param else ""
        return APIError.bad_request(f"{prefix}{exc}", param=grammar_param, code=exc.code)
    if isinstance(exc, EngineRequestError):
        return APIError.bad_request(f"the engine refused the request: {exc}", code="engine_refused")
    if isinstance(exc, EngineDeadError):
        return APIError.unavailable(f"the engine is unavailable: {exc}")
    return APIError(500, "internal server error", type="server_error")


def sse(payload: str) -> bytes:
    """One server-sent event carrying ``payload``."""
    return f"data: {payload}\n\n".encode()


ENGINE_ERRORS = (EngineRequestError, EngineDeadError)
