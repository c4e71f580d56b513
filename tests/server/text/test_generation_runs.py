"""Several tokens in one output (speculative decoding's accepted runs) read exactly as the same
tokens one output each: the text is cut at a stop string inside the run, tokens after the
stop string's are neither counted nor given logprobs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from model_shards.messages import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob
from server.text.generation import TextDelta, generate_text
from server.text.tokenizer import Tokenizer


class _Scripted:
    """An engine that answers every request with the given outputs."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs
        self.info = SimpleNamespace(eos_token_ids=[1])

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        for output in self.outputs:
            yield output


def _collect(tokenizer: Tokenizer, outputs: list[RequestOutput]) -> list[TextDelta]:
    request = GenerateRequest("r", [5], 64, SamplingParams(logprobs=0))

    async def run() -> list[TextDelta]:
        engine: Any = _Scripted(outputs)
        return [d async for d in generate_text(engine, tokenizer, request, ["STOP"])]

    return asyncio.run(run())


def test_a_stop_string_inside_a_run(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world STOP and more after it", add_special_tokens=False)
    lps = [TokenLogprob(-float(i), [], []) for i in range(len(ids))]
    one_each = [RequestOutput("r", [t], None, 1, [lp]) for t, lp in zip(ids, lps, strict=True)]
    runs = [
        RequestOutput("r", ids[:3], None, 1, lps[:3]),
        RequestOutput("r", ids[3:], "length", 0, lps[3:]),
    ]
    slow, fast = _collect(tokenizer, one_each), _collect(tokenizer, runs)
    text = "".join(d.text for d in fast)
    assert text == "".join(d.text for d in slow) == "hello world "
    assert fast[-1].finish_reason == slow[-1].finish_reason == "stop"
    assert fast[-1].completion_tokens == slow[-1].completion_tokens < len(ids)
    logprobs = [lp for d in fast for lp in d.logprobs or []]
    assert logprobs == [lp for d in slow for lp in d.logprobs or []]
    assert len(logprobs) == fast[-1].completion_tokens
