"""One API request fanned out into its choices, and the choices run together.

:func:`plan` makes one :class:`GenerateRequest` per (prompt i, sample j), at
choice index ``i * n + j`` (OpenAI's order). Request ids are the response id
when there is a single choice, else ``{id}-{index}``. The engine seeds the
draw at position p from ``(seed, p)``, so samples of one prompt need distinct
seeds: sample 0 keeps the user's seed (so ``n=1`` and ``n>1`` agree on the
first choice), sample j > 0 gets the top 63 bits of output j of the splitmix64
stream seeded with ``seed`` (:mod:`model_shards.splitmix`); without a user seed
every sample gets a random seed (always set, so that a request replayed after a
replica failure draws the same tokens: :mod:`server.engine.supervisor`). Each choice is
checked against the context length (400 naming ``prompt`` or the max-tokens field).

:func:`collect` runs every choice to the end; :func:`merge` interleaves their
text deltas as they come. Either way an engine failure in one choice cancels
the others (aborting them on the engine) and is raised to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from model_shards.messages import (
    FinishReason,
    GenerateRequest,
    GrammarSpec,
    LoraRef,
    PromptLogprobs,
    SamplingParams,
)
from model_shards.splitmix import splitmix64
from server.engine.client import Engine
from server.http.errors import APIError
from server.http.metrics import Metrics
from server.text.generation import SampledToken, TextDelta, generate_text
from server.text.tokenizer import Tokenizer

_SEED_BITS = 63


def sample_seed(seed: int | None, sample: int, n: int) -> int:
    """The seed of sample ``sample`` (0-based) of ``n``; never ``None`` (module docstring)."""
    if sample == 0 and seed is not None:
        return seed
    if seed is None:
        return secrets.randbits(_SEED_BITS)
    return splitmix64(seed, sample) >> (64 - _SEED_BITS)  # output `sample` of seed's stream


@dataclass(frozen=True)
class ChoiceRequests:
    """The choices of one API request, in index order."""

    response_id: str
    n: int
    requests: list[GenerateRequest]
    grammar_param: str | None = None  # the field the requests' grammar comes from

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt (not once per sample), as OpenAI does."""
        return sum(len(r.prompt_token_ids) for r in self.requests[:: self.n])


def fan_out(
    response_id: str,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int | None,
    max_tokens_param: str,
    max_model_len: int,
    sampling: SamplingParams,
    stop_token_ids: list[int],
    ignore_eos: bool,
    grammar: GrammarSpec | None = None,
    prompt_logprobs: int | None = None,
    grammar_param: str | None = None,
    priority: int = 0,
    lora: LoraRef | None = None,
) -> ChoiceRequests:
    """One request per (prompt, sample); ``max_tokens=None`` means the rest of the context.
    ``grammar``: every choice's output is constrained to it (it comes from field
    ``grammar_param``); ``prompt_logprobs``: every choice's prompt is scored with that many
    top alternatives; ``priority``: the engine's scheduling priority (lower first); ``lora``:
    the LoRA adapter every choice runs with."""
    requests = []
    single = len(prompts) * n == 1
    for i, prompt_ids in enumerate(prompts):
        budget = _check_context(prompt_ids, max_tokens, max_tokens_param, max_model_len)
        if sampling.min_tokens > budget:
            raise APIError.bad_request(
                f"min_tokens ({sampling.min_tokens}) is larger than the {budget} tokens "
                "this completion may have",
                param="min_tokens",
            )
        for j in range(n):
            index = i * n + j
            params = msgspec.structs.replace(sampling, seed=sample_seed(sampling.seed, j, n))
            requests.append(
                GenerateRequest(
                    request_id=response_id if single else f"{response_id}-{index}",
                    prompt_token_ids=prompt_ids,
                    max_tokens=budget,
                    sampling=params,
                    stop_token_ids=stop_token_ids,
                    ignore_eos=ignore_eos,
                    grammar=grammar,
                    prompt_logprobs=prompt_logprobs,
                    priority=priority,
                    lora=lora,
                )
            )
    return ChoiceRequests(response_id, n, requests, grammar_param if grammar else None)


def _check_context(prompt_ids: list[int], max_tokens: int | None, param: str, limit: int) -> int:
    if not prompt_ids:
        raise APIError.bad_request("prompt encodes to zero tokens", param="prompt")
    if len(prompt_ids) >= limit:
        raise APIError.bad_request(
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{len(prompt_ids)} tokens, leaving no room for a completion.",
            param="prompt",
            code="context_length_exceeded",
        )
    budget = max_tokens or limit - len(prompt_ids)
    if len(prompt_ids) + budget > limit:
        raise APIError.bad_request(
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {len(prompt_ids) + budget} tokens ({len(prompt_ids)} in the prompt, "
            f"{budget} in the completion). Please reduce the prompt or {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return budget


@dataclass
class ChoiceResult:
    """A whole choice: its text, why it ended, its token count and (if asked) logprobs
    and its prompt's scores."""

    index: int
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    logprobs: list[SampledToken] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    parts: list[str] = field(default_factory=list, repr=False)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, delta: TextDelta) -> None:
        self.parts.append(delta.text)
        self.finish_reason = delta.finish_reason
        self.completion_tokens = delta.completion_tokens
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass(frozen=True)
class _Runner:
    engine: Engine
    tokenizer: Tokenizer
    stop_strings: list[str]
    metrics: Metrics | None

    def deltas(self, request: GenerateRequest) -> AsyncGenerator[TextDelta, None]:
        return generate_text(self.engine, self.tokenizer, request, self.stop_strings, self.metrics)


async def collect(
    plan: ChoiceRequests,
    engine: Engine,
    tokenizer: Tokenizer,
    stop_strings: list[str],
    metrics: Metrics | None = None,
) -> list[ChoiceResult]:
    """Run every choice to the end; results in index order."""
    runner = _Runner(engine, tokenizer, stop_strings, metrics)

    async def one(index: int, request: GenerateRequest) -> ChoiceResult:
        result = ChoiceResult(index)
        async with contextlib.aclosing(runner.deltas(request)) as deltas:
            async for delta in deltas:
                result.add(delta)
        return result

    return await _gather([one(i, r) for i, r in enumerate(plan.requests)])


async def _gather(work: list[Coroutine[Any, Any, ChoiceResult]]) -> list[ChoiceResult]:
    if len(work) == 1:
        return [await work[0]]
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


_DONE = object()


async def merge(
    plan: ChoiceRequests,
    engine: Engine,
    tokenizer: Tokenizer,
    stop_strings: list[str],
    metrics: Metrics | None = None,
) -> AsyncGenerator[tuple[int, TextDelta], None]:
    """``(choice index, delta)`` pairs as the choices produce them, until all finish.

    Closing this early cancels (aborts) every choice still running.
    """
    runner = _Runner(engine, tokenizer, stop_strings, metrics)
    if len(plan.requests) == 1:
        async with contextlib.aclosing(runner.deltas(plan.requests[0])) as deltas:
            async for delta in deltas:
                yield 0, delta
        return
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(index: int, request: GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(runner.deltas(request)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((index, delta))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(plan.requests)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield cast("tuple[int, TextDelta]", item)
    finally:
        await _cancel(tasks)
