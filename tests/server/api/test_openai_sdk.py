"""The official ``openai`` SDK against a live server (fake echo engine behind it).

The SDK's client is synchronous; each call runs in a worker thread so the
server keeps running on the test's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import openai
import pytest

from server.text.tokenizer import Tokenizer
from tests.server.conftest import API_KEY, BOS_ID, EOS_ID, Served, ServeFactory

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


class SDK:
    """An ``openai.OpenAI`` client for a live server; :meth:`call` runs it off the loop."""

    def __init__(self, served: Served, api_key: str = API_KEY) -> None:
        self.served = served
        self.client = openai.OpenAI(
            base_url=served.base_url + "/v1", api_key=api_key, max_retries=0, timeout=30
        )

    async def call(self, fn: Callable[[openai.OpenAI], T]) -> T:
        return await asyncio.to_thread(fn, self.client)


@pytest.fixture
async def sdk(serve: ServeFactory) -> AsyncIterator[SDK]:
    client = SDK(await serve(api_key=API_KEY))
    yield client
    client.client.close()


def chat_echo(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> str:
    """What the echo engine answers: the rendered prompt without BOS, up to its first EOS."""
    from server.text.chat_template import ChatTemplate

    assert tokenizer.chat_template is not None
    text = ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens).render(
        messages, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = [t for t in ids if t != BOS_ID]
    return tokenizer.decode(body[: body.index(EOS_ID)])


def echo(tokenizer: Tokenizer, prompt: str, max_tokens: int) -> str:
    """The echo engine's completion of a text prompt."""
    body = tokenizer.encode(prompt)[1:]
    return tokenizer.decode((body * max_tokens)[:max_tokens])


MESSAGES: list[Any] = [{"role": "user", "content": "héllo 你好 😀"}]


async def test_completion(sdk: SDK, tokenizer: Tokenizer) -> None:
    n_prompt = len(tokenizer.encode("Hello world"))
    result = await sdk.call(
        lambda c: c.completions.create(model="tiny", prompt="Hello world", max_tokens=n_prompt - 1)
    )
    (choice,) = result.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, "Hello world", "length")
    assert result.usage is not None and result.usage.prompt_tokens == n_prompt


async def test_completion_stream(sdk: SDK, tokenizer: Tokenizer) -> None:
    def run(c: openai.OpenAI) -> list[Any]:
        stream = c.completions.create(
            model="tiny",
            prompt="one two",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        return list(stream)

    chunks = await sdk.call(run)
    *texts, usage = chunks
    assert "".join(c.choices[0].text for c in texts) == echo(tokenizer, "one two", 6)
    assert texts[-1].choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == 6


async def test_completion_n_and_batch(sdk: SDK, tokenizer: Tokenizer) -> None:
    result = await sdk.call(
        lambda c: c.completions.create(
            model="tiny", prompt=["one", "two"], n=2, max_tokens=2, seed=7
        )
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    one, two = echo(tokenizer, "one", 2), echo(tokenizer, "two", 2)
    assert [c.text for c in result.choices] == [one, one, two, two]
    assert result.usage is not None and result.usage.completion_tokens == 8
    requests = [sdk.served.engine.requests[f"{result.id}-{i}"] for i in range(4)]
    seeds = [r.sampling.seed for r in requests]
    assert seeds[0] == seeds[2] == 7 and seeds[1] == seeds[3] != 7  # per sample, deterministic
    again = await sdk.call(
        lambda c: c.completions.create(model="tiny", prompt="one", n=2, max_tokens=1, seed=7)
    )
    assert sdk.served.engine.requests[f"{again.id}-1"].sampling.seed == seeds[1]


async def test_completion_logprobs(sdk: SDK, tokenizer: Tokenizer) -> None:
    prompt = "one two"
    result = await sdk.call(
        lambda c: c.completions.create(model="tiny", prompt=prompt, max_tokens=3, logprobs=2)
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 3 and "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.token_logprobs == [-0.5] * 3
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), len("".join(logprobs.tokens[:2]))]
    assert logprobs.top_logprobs is not None
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        assert len(top) == 2 and top[token] == -0.5
    assert sdk.served.engine.requests[result.id].sampling.logprobs == 2


async def test_chat(sdk: SDK, tokenizer: Tokenizer) -> None:
    result = await sdk.call(
        lambda c: c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100)
    )
    (choice,) = result.choices
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == chat_echo(tokenizer, MESSAGES)
    assert choice.finish_reason == "stop" and choice.logprobs is None
    sent = sdk.served.engine.requests[result.id]
    assert sent.prompt_token_ids.count(BOS_ID) == 1 and sent.max_tokens == 100


async def test_chat_stream(sdk: SDK, tokenizer: Tokenizer) -> None:
    def run(c: openai.OpenAI) -> list[Any]:
        stream = c.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_completion_tokens=100,
            stream=True,
            stream_options={"include_usage": True},
        )
        return list(stream)

    *chunks, usage = await sdk.call(run)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == chat_echo(tokenizer, MESSAGES)
    assert len(chunks) > 3 and all(
        "\ufffd" not in (c.choices[0].delta.content or "") for c in chunks
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == len(tokenizer.encode(content)) - 1 + 1  # + EOS


async def test_chat_n_and_logprobs(sdk: SDK, tokenizer: Tokenizer) -> None:
    result = await sdk.call(
        lambda c: c.chat.completions.create(
            model="tiny", messages=MESSAGES, n=3, max_tokens=4, logprobs=True, top_logprobs=3
        )
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    for choice in result.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        assert len(entries) == 4
        assert "".join(e.token for e in entries) == choice.message.content
        for entry in entries:
            assert entry.logprob == -0.5 and entry.bytes == list(entry.token.encode())
            assert [t.logprob for t in entry.top_logprobs] == [-0.5, -1.5, -2.5]
            assert entry.top_logprobs[0].token == entry.token
    seeds = {sdk.served.engine.requests[f"{result.id}-{i}"].sampling.seed for i in range(3)}
    assert len(seeds) == 3 and None not in seeds  # random but distinct without a user seed


async def test_chat_stream_n(sdk: SDK) -> None:
    def run(c: openai.OpenAI) -> list[Any]:
        return list(
            c.chat.completions.create(
                model="tiny", messages=MESSAGES, n=2, max_tokens=3, stream=True
            )
        )

    chunks = await sdk.call(run)
    by_index: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk.choices
        by_index[choice.index].append(choice)
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"
        assert choices[-1].finish_reason == "length"
    texts = ["".join(c.delta.content or "" for c in cs) for cs in by_index.values()]
    assert texts[0] == texts[1] != ""


async def test_typed_errors(sdk: SDK, serve: ServeFactory) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.call(lambda c: c.completions.create(model="tiny", prompt="x", temperature=5))
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await sdk.call(
            lambda c: c.chat.completions.create(model="tiny", messages=MESSAGES, top_logprobs=2)
        )
    with pytest.raises(openai.BadRequestError, match="roles must be user or assistant"):
        await sdk.call(
            lambda c: c.chat.completions.create(
                model="tiny", messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]
            )
        )
    with pytest.raises(openai.NotFoundError, match="gpt-5"):
        await sdk.call(lambda c: c.chat.completions.create(model="gpt-5", messages=MESSAGES))
    wrong = SDK(sdk.served, api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await wrong.call(lambda c: c.models.list())
    wrong.client.close()
    models = await sdk.call(lambda c: c.models.list())
    assert [m.id for m in models.data] == ["tiny"]


async def test_chat_without_template_is_400(serve: ServeFactory, tokenizer_dir: Any) -> None:
    from tests.server.conftest import write_tiny_tokenizer

    directory = write_tiny_tokenizer(tokenizer_dir.parent / "no-template", chat_template=None)
    client = SDK(await serve(served_tokenizer=Tokenizer.from_dir(directory)), api_key="unused")
    with pytest.raises(openai.BadRequestError) as info:
        await client.call(lambda c: c.chat.completions.create(model="tiny", messages=MESSAGES))
    assert info.value.code == "no_chat_template" and "chat template" in str(info.value)
    client.client.close()
