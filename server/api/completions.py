"""``POST /v1/completions``: request checks that need the engine, then JSON or SSE.

:func:`prepare` turns a validated :class:`CompletionRequest` into a
:class:`~server.api.choices.ChoiceRequests` (one engine request per prompt and sample),
raising :class:`APIError` (400) for what pydantic cannot know: token ids
outside the vocabulary and prompts that do not fit the context
(``prompt + max_tokens > max_model_len``; ``max_tokens: null`` means "the
rest of the context"). :func:`complete` collects every choice; :func:`stream`
yields SSE frames (one choice per chunk, ``index`` set) ending with
``data: [DONE]``. Engine failures become 400 (refused request) or 503 (engine
dead); once a stream has started they are sent as an error event before
``[DONE]``.

With ``echo`` each choice's text (a stream's first chunk of it, as vLLM does) starts with its
prompt: the string as sent, or a token-id prompt decoded. The engine scores the prompt when
``echo`` has ``logprobs`` or ``prompt_logprobs`` is set (:class:`Choices`). ``max_tokens: 0``
runs one engine token and drops it: the choice is the prompt alone, ``finish_reason``
``length``, no completion tokens.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from model_shards.messages import PromptLogprobs
from server.api.choices import ChoiceRequests, ChoiceResult, fan_out
from server.api.completion_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from server.api.logprobs import (
    completion_logprobs,
    echo_logprobs,
    end_offset,
    joined,
    vllm_prompt_logprobs,
)
from server.api.protocol import MAX_N, Usage
from server.api.serving import (
    ENGINE_ERRORS,
    ServedModel,
    bad_words_ids,
    check_ids,
    engine_api_error,
    sse,
)
from server.http.errors import APIError
from server.text.generation import TextDelta

#: Most choices (prompts × n) one completion request may ask for.
MAX_CHOICES = 4 * MAX_N


def prepare(serving: ServedModel, body: CompletionRequest, response_id: str) -> ChoiceRequests:
    """Check ``body`` against the engine and tokenize it into one request per choice."""
    vocab_size = serving.check(body.model)
    if len(body.prompts) * body.n > MAX_CHOICES:
        raise APIError.bad_request(
            f"'n': {len(body.prompts)} prompts × n={body.n} is {len(body.prompts) * body.n} "
            f"choices; at most {MAX_CHOICES} are allowed",
            param="n",
        )
    prompts = []
    for prompt in body.prompts:
        if isinstance(prompt, str):
            serving.check_prompt_chars(prompt, "prompt")
            prompts.append(serving.tokenizer.encode(prompt))
        else:
            check_ids(prompt, vocab_size, "prompt")
            prompts.append(list(prompt))
    stop_token_ids = list(body.stop_token_ids or [])
    check_ids(stop_token_ids, vocab_size, "stop_token_ids")
    check_ids(list(body.logit_bias_ids), vocab_size, "logit_bias")
    check_ids(list(body.allowed_token_ids or []), vocab_size, "allowed_token_ids")
    grammar = body.grammar()
    return fan_out(
        response_id,
        prompts,
        n=body.n,
        max_tokens=1 if body.echo_only else body.max_tokens,
        max_tokens_param="max_tokens",
        max_model_len=serving.max_model_len,
        sampling=body.sampling_params(
            None if body.echo_only else body.logprobs,
            bad_words_ids(serving.tokenizer, body.bad_words),
        ),
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
        grammar=grammar,
        prompt_logprobs=body.engine_prompt_logprobs,
        grammar_param=body.grammar_param,
        priority=serving.check_priority(body.priority),
        lora=serving.lora_of(body.model),
    )


@dataclass
class Choices:
    """Formats one request's choices: the echoed prompt, the logprobs objects, the
    generated part dropped for ``max_tokens: 0``; per choice, a stream's state."""

    serving: ServedModel
    work: ChoiceRequests
    body: CompletionRequest
    _echoed: set[int] = field(default_factory=set)
    _offsets: dict[int, int] = field(default_factory=dict)  # a stream's next text offset

    def prompt_text(self, index: int) -> str:
        """Choice ``index``'s prompt as echoed: the string sent, or the ids decoded."""
        prompt = self.body.prompts[index // self.work.n]
        if isinstance(prompt, str):
            return prompt
        return self.serving.tokenizer.decode(prompt)

    def completion_tokens(self, count: int) -> int:
        return 0 if self.body.echo_only else count

    def choice(self, index: int, delta: TextDelta | ChoiceResult) -> CompletionChoice:
        """The choice (or a stream's chunk of it) for ``delta``: a stream's next text delta,
        or a whole choice."""
        body = self.body
        first = index not in self._echoed
        self._echoed.add(index)
        text = "" if body.echo_only else delta.text
        finish = delta.finish_reason
        if body.echo_only and finish is not None:
            finish = "length"
        if body.echo and first:
            text = self.prompt_text(index) + text
        return CompletionChoice(
            index=index,
            text=text,
            finish_reason=finish,
            logprobs=self._logprobs(index, delta, first),
            prompt_logprobs=None
            if body.prompt_logprobs is None
            else vllm_prompt_logprobs(
                self.serving.tokenizer,
                self.work.requests[index].prompt_token_ids,
                self._scores(delta),
                body.prompt_logprobs,
            ),
        )

    def _logprobs(
        self, index: int, delta: TextDelta | ChoiceResult, first: bool
    ) -> CompletionLogprobs | None:
        body, tokenizer = self.body, self.serving.tokenizer
        if body.logprobs is None:
            return None
        head = None
        if body.echo and first:
            prompt_ids = self.work.requests[index].prompt_token_ids
            head = echo_logprobs(tokenizer, prompt_ids, self._scores(delta), body.logprobs)
        generated = [] if body.echo_only else delta.logprobs
        if generated is None and head is None:
            return None
        start = end_offset(head) if head is not None else self._offsets.get(index, 0)
        tail = completion_logprobs(tokenizer, generated or [], start)
        out = tail if head is None else joined(head, tail)
        self._offsets[index] = end_offset(out) if out.tokens else start
        return out

    @staticmethod
    def _scores(delta: TextDelta | ChoiceResult) -> PromptLogprobs:
        if delta.prompt_logprobs is None:
            raise RuntimeError("the engine sent no prompt logprobs for a request that asked")
        return delta.prompt_logprobs


async def complete(
    serving: ServedModel, work: ChoiceRequests, body: CompletionRequest
) -> CompletionResponse:
    """Run every choice to the end and return the whole completion."""
    results = await serving.collect(work, body.stop_strings)
    formatter = Choices(serving, work, body)
    choices = [formatter.choice(r.index, r) for r in results]
    completion_tokens = formatter.completion_tokens(sum(r.completion_tokens for r in results))
    return CompletionResponse(
        id=work.response_id,
        model=serving.answered_by(work),
        choices=choices,
        usage=Usage.of(work.prompt_tokens, completion_tokens),
    )


async def stream(
    serving: ServedModel, work: ChoiceRequests, body: CompletionRequest
) -> AsyncGenerator[bytes, None]:
    """SSE frames: one chunk per choice's text delta, its last with ``finish_reason``;
    usage in a final ``choices: []`` chunk when ``stream_options.include_usage``.

    An engine failure before the first frame raises :class:`APIError` from the
    first ``anext`` (the caller can still send a proper HTTP status); a later one
    is sent as an error event, followed by ``[DONE]``.
    """
    tokens = dict.fromkeys(range(len(work.requests)), 0)
    formatter = Choices(serving, work, body)
    first = True
    deltas = serving.merge(work, body.stop_strings)
    async with contextlib.aclosing(deltas):
        try:
            async for index, delta in deltas:
                first = False
                tokens[index] = formatter.completion_tokens(delta.completion_tokens)
                choice = formatter.choice(index, delta)
                chunk = CompletionResponse(
                    id=work.response_id, model=serving.answered_by(work), choices=[choice]
                )
                yield sse(chunk.model_dump_json())
        except ENGINE_ERRORS as exc:
            if first:
                raise engine_api_error(exc, work.grammar_param) from exc
            yield sse(json.dumps(engine_api_error(exc, work.grammar_param).body()))
        else:
            if body.include_usage:
                usage = Usage.of(work.prompt_tokens, sum(tokens.values()))
                final = CompletionResponse(
                    id=work.response_id, model=serving.answered_by(work), choices=[], usage=usage
                )
                yield sse(final.model_dump_json())
    yield sse("[DONE]")
