"""One request's token stream turned into text deltas: detokenize, then stop strings.

:func:`generate_text` yields :class:`TextDelta` values; the last one has a
``finish_reason``. Contracts:

* the concatenated ``text`` is the completion as the client sees it: special
  tokens skipped, the stop/EOS token that ended generation not rendered, and
  on a stop-string match cut before the stop string;
* no partial UTF-8 character and no partial stop string is ever emitted;
* ``completion_tokens`` counts every token the engine produced for the text
  so far (including a final stop/EOS token); an output of several tokens (speculative
  decoding) is taken one token at a time, so tokens after a stop string's are not counted;
* a stop-string match ends the iteration with ``finish_reason="stop"`` and
  aborts the request on the engine; so does closing the iterator early;
* ``logprobs`` is ``None`` unless the request asked for them; then it lists
  ``(token_id, TokenLogprob)`` for the tokens received since the previous
  delta (tokens whose text is held back travel with the next delta), without
  the unrendered stop/EOS token that ended generation. On a stop-string match
  the tokens that made up the stop string are still listed (as in vLLM);
* ``prompt_logprobs`` is ``None`` except on the first delta after the engine scored the
  prompt (``GenerateRequest.prompt_logprobs``): the whole prompt's scores, once;
* with ``metrics``, the sequence's latencies and token counts are recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from model_shards.messages import FinishReason, GenerateRequest, PromptLogprobs, TokenLogprob
from server.engine.client import Engine
from server.http import ttft_trace
from server.http.metrics import Metrics
from server.text.detokenizer import IncrementalDetokenizer
from server.text.stop import StopStringMatcher
from server.text.tokenizer import Tokenizer

SampledToken = tuple[int, TokenLogprob]


@dataclass(frozen=True)
class TextDelta:
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[SampledToken] | None = None
    prompt_logprobs: PromptLogprobs | None = None


@ttft_trace.first("detokenized")
async def generate_text(
    engine: Engine,
    tokenizer: Tokenizer,
    request: GenerateRequest,
    stop_strings: list[str],
    metrics: Metrics | None = None,
) -> AsyncGenerator[TextDelta, None]:
    """Run ``request`` on ``engine`` and yield its text as it is produced."""
    detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
    matcher = StopStringMatcher(stop_strings)
    eos_ids = engine.info.eos_token_ids if engine.info and not request.ignore_eos else []
    unrendered = set(request.stop_token_ids) | set(eos_ids)
    prompt_tokens = len(request.prompt_token_ids)
    completion_tokens = 0
    want_logprobs = request.sampling.logprobs is not None
    pending: list[SampledToken] = []
    scores: PromptLogprobs | None = None  # the prompt's, until a delta carries them
    scored = False
    source = engine.generate(request)
    if metrics is not None:
        source = metrics.track(request, source)
    async with contextlib.aclosing(source) as outputs:
        async for output in outputs:
            prompt_tokens = output.num_prompt_tokens or prompt_tokens
            if output.prompt_logprobs is not None and not scored:
                scores, scored = output.prompt_logprobs, True
            ids = output.new_token_ids
            if output.finish_reason == "stop" and ids and ids[-1] in unrendered:
                completion_tokens += 1  # counted, never rendered
                ids = ids[:-1]
            text = ""
            for i, token in enumerate(ids):  # one at a time: a stop string ends at its token
                completion_tokens += 1
                if want_logprobs and output.logprobs is not None and i < len(output.logprobs):
                    pending.append((token, output.logprobs[i]))
                text += matcher.feed(detokenizer.add([token]))
                if matcher.stopped:
                    break
            finish = output.finish_reason
            if finish is not None and not matcher.stopped:
                text += matcher.feed(detokenizer.finish())
                if not matcher.stopped:
                    text += matcher.flush()
            if matcher.stopped:
                finish = "stop"
            if text or finish is not None:
                sent, pending = (pending, []) if want_logprobs else (None, pending)
                yield TextDelta(text, finish, prompt_tokens, completion_tokens, sent, scores)
                scores = None
            if finish is not None:
                return  # leaving `aclosing` aborts the request if the engine is not done
