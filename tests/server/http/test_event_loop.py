"""Requests whose preparation grows with their size never hold up the event loop.

A huge prompt and a long ``bad_words`` list are sent while ``/health`` is polled back to
back on the same server. Tokenizing such input takes the tokenizer a measurable time, timed
here: preparing it on the event loop would make ``/health`` wait at least that long. The
longest ``/health`` wait must stay below a tenth of the prompt's tokenizing, and below one
tokenizing of the list (parsing its 50,000 JSON strings is itself a sizeable part of
that). Both get a 400 naming the field, found before the tokenizer runs.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable
from typing import Any

import httpx
import pytest

from server.api.protocol import MAX_BAD_WORDS
from server.text.tokenizer import Tokenizer
from tests.server.conftest import ServeFactory
from tests.server.error_body import assert_error

pytestmark = pytest.mark.timeout(120)

WORDS = [
    "quick",
    "brown",
    "fox",
    "jumps",
    "lazy",
    "dog",
    "hello",
    "world",
    "emoji",
    "text",
    "one",
    "two",
    "three",
]


def _text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    pieces = [w + p for w in WORDS for p in " ,.!"]
    return "".join(rng.choices(pieces, k=chars // 4))[:chars]


async def _longest_health_wait(
    http: httpx.AsyncClient, work: Awaitable[httpx.Response]
) -> tuple[float, httpx.Response]:
    """Run ``work`` while ``/health`` is polled back to back: the longest poll, the response."""
    task = asyncio.ensure_future(work)
    longest = 0.0
    while not task.done():
        start = time.perf_counter()
        health = await http.get("/health")
        longest = max(longest, time.perf_counter() - start)
        assert health.status_code == 200
    return longest, await task


def _tokenize_seconds(tokenizer: Tokenizer, texts: list[str]) -> float:
    start = time.perf_counter()
    for text in texts:
        tokenizer.encode(text, add_special_tokens=False)
    return time.perf_counter() - start


async def test_huge_prompt_and_bad_words_leave_health_alone(
    serve: ServeFactory, tokenizer: Tokenizer
) -> None:
    served = await serve()
    prompt = _text(3_000_000, seed=1)
    reference = _tokenize_seconds(tokenizer, [prompt[: len(prompt) // 10]])  # a tenth of it
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    longest, response = await _longest_health_wait(
        served.http, served.http.post("/v1/completions", json=body)
    )
    assert_error(response, 400, "prompt")
    assert longest < reference, (longest, reference)

    words = _text(340_000, seed=2).split()
    reference = _tokenize_seconds(tokenizer, words)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "bad_words": words}
    longest, response = await _longest_health_wait(
        served.http, served.http.post("/v1/completions", json=body)
    )
    assert_error(response, 400, "bad_words")
    assert longest < reference, (longest, reference)


async def test_limits_name_the_field_and_the_largest_allowed_lists_work(
    serve: ServeFactory,
) -> None:
    served = await serve()
    messages = [{"role": "user", "content": _text(200_000, seed=3)}]
    chat = await served.http.post("/v1/chat/completions", json={"messages": messages})
    assert_error(chat, 400, "messages")
    long_stop = {"prompt": "hi", "stop": ["x" * 1025]}
    assert_error(await served.http.post("/v1/completions", json=long_stop), 400, "stop")
    words = [f"w{i}" for i in range(MAX_BAD_WORDS)]
    body = {"prompt": "hello world", "max_tokens": 3, "bad_words": words}
    response = await served.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    banned = served.engine.requests[response.json()["id"]].sampling.bad_words_token_ids
    assert len(banned) == len({tuple(ids) for ids in banned}) > MAX_BAD_WORDS  # two spellings
