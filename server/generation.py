"""One request's token stream turned into text deltas: detokenize, then stop strings.

:func:`generate_text` yields :class:`TextDelta` values; the last one has a
``finish_reason``. Contracts:

* the concatenated ``text`` is the completion as the client sees it: special
  tokens skipped, the stop/EOS token that ended generation not rendered, and
  on a stop-string match cut before the stop string;
* no partial UTF-8 character and no partial stop string is ever emitted;
* ``completion_tokens`` counts every token the engine produced for the text
  so far (including a final stop/EOS token);
* a stop-string match ends the iteration with ``finish_reason="stop"`` and
  aborts the request on the engine; so does closing the iterator early.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from model_shards.messages import FinishReason, GenerateRequest
from server.detokenizer import IncrementalDetokenizer
from server.engine_client import EngineClient
from server.stop import StopStringMatcher
from server.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextDelta:
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int


async def generate_text(
    engine: EngineClient,
    tokenizer: Tokenizer,
    request: GenerateRequest,
    stop_strings: list[str],
) -> AsyncGenerator[TextDelta, None]:
    """Run ``request`` on ``engine`` and yield its text as it is produced."""
    detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
    matcher = StopStringMatcher(stop_strings)
    eos_ids = engine.info.eos_token_ids if engine.info and not request.ignore_eos else []
    unrendered = set(request.stop_token_ids) | set(eos_ids)
    prompt_tokens = len(request.prompt_token_ids)
    completion_tokens = 0
    async with contextlib.aclosing(engine.generate(request)) as outputs:
        async for output in outputs:
            prompt_tokens = output.num_prompt_tokens or prompt_tokens
            ids = output.new_token_ids
            completion_tokens += len(ids)
            if output.finish_reason == "stop" and ids and ids[-1] in unrendered:
                ids = ids[:-1]
            text = matcher.feed(detokenizer.add(ids))
            finish = output.finish_reason
            if finish is not None and not matcher.stopped:
                text += matcher.feed(detokenizer.finish())
                if not matcher.stopped:
                    text += matcher.flush()
            if matcher.stopped:
                finish = "stop"
            if text or finish is not None:
                yield TextDelta(text, finish, prompt_tokens, completion_tokens)
            if finish is not None:
                return  # leaving `aclosing` aborts the request if the engine is not done
