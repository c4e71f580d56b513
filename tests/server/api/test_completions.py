"""/v1/completions end to end: live server, real engine client, fake engine (echo model)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.text.tokenizer import Tokenizer
from tests.server.conftest import BOS_ID, EOS_ID, Served, ServeFactory
from tests.server.sse import read_events

pytestmark = pytest.mark.timeout(60)


async def test_non_streamed_completion(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    served = await serve()
    prompt = "Hello world"
    n_prompt = len(tokenizer.encode(prompt))
    response = await served.http.post(
        "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n_prompt - 1}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": prompt, "logprobs": None, "finish_reason": "length"}
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_prompt - 1,
        "total_tokens": 2 * n_prompt - 1,
    }
    sent = served.engine.requests[body["id"]]
    assert sent.prompt_token_ids == tokenizer.encode(prompt) and sent.max_tokens == n_prompt - 1


async def test_streamed_completion(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    served = await serve()
    prompt = "héllo 你好 😀🎉"
    n_out = len(tokenizer.encode(prompt)) - 1
    request = {
        "prompt": prompt,
        "max_tokens": 2 * n_out,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with served.http.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events, done = await read_events(response)
    assert done
    *chunks, usage_chunk = events
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in events)
    assert len({c["id"] for c in events}) == 1
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == prompt * 2
    assert len(chunks) > 2 and all("\ufffd" not in t for t in texts)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": n_out + 1,
        "completion_tokens": 2 * n_out,
        "total_tokens": 3 * n_out + 1,
    }


async def test_token_id_prompt_and_eos(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    served = await serve()
    ids = tokenizer.encode("one two")[1:]
    response = await served.http.post(
        "/v1/completions", json={"prompt": [*ids, EOS_ID, *ids], "max_tokens": 50}
    )
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("one two", "stop")
    assert response.json()["usage"]["completion_tokens"] == len(ids) + 1  # EOS counted


async def test_ignore_eos_and_stop_token_ids(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    served = await serve()
    one, two = tokenizer.encode("one two")[1:], tokenizer.encode(" three")[1:]
    body: dict[str, Any] = {"prompt": [*one, EOS_ID, *two], "max_tokens": len(one) + 1 + len(two)}
    response = await served.http.post("/v1/completions", json={**body, "ignore_eos": True})
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("one two three", "length")
    response = await served.http.post(
        "/v1/completions", json={**body, "stop_token_ids": [two[0]], "ignore_eos": True}
    )
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("one two", "stop")


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_spanning_tokens(
    serve: ServeFactory, tokenizer: Tokenizer, stream: bool
) -> None:
    served = await serve(step_s=0.005)
    prompt = "one two three four five"
    stop = "o thr"  # spans the tokens of "two" and " three"
    assert all(stop not in tokenizer.decode([t]) for t in tokenizer.encode(prompt))
    request = {"prompt": prompt, "max_tokens": 100, "stop": [stop, "never"], "stream": stream}
    if stream:
        async with served.http.stream("POST", "/v1/completions", json=request) as response:
            events, done = await read_events(response)
        assert done
        texts = [e["choices"][0]["text"] for e in events]
        text, finish = "".join(texts), events[-1]["choices"][0]["finish_reason"]
        assert len(texts) > 2  # streamed piecewise; the "o" of "two" was never sent
    else:
        choice = (await served.http.post("/v1/completions", json=request)).json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    assert (text, finish) == ("one tw", "stop")
    rid = next(iter(served.engine.requests))
    assert served.engine.wait_for(lambda: rid in served.engine.aborted)


async def test_max_tokens_null_fills_the_context(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    served = await serve(max_model_len=40)
    response = await served.http.post("/v1/completions", json={"prompt": "x", "max_tokens": None})
    body = response.json()
    n_prompt = len(tokenizer.encode("x"))
    assert body["usage"]["completion_tokens"] == 40 - n_prompt
    assert body["choices"][0]["finish_reason"] == "length"


async def test_concurrent_requests_share_one_batch(serve: ServeFactory) -> None:
    """While the engine is busy, requests arriving within the window travel together."""
    served = await serve(batch_window_s=0.3, step_s=0.05)
    busy = {"prompt": "busy", "max_tokens": 200, "stream": True}
    async with served.http.stream("POST", "/v1/completions", json=busy) as streamed:
        await anext(streamed.aiter_lines())  # "busy" is on the engine
        await _share_one_batch(served)


async def _share_one_batch(served: Served) -> None:
    async def one(i: int) -> str:
        body = {"prompt": f"request {i}", "max_tokens": 3}
        response = await served.http.post("/v1/completions", json=body)
        assert response.status_code == 200
        return str(response.json()["id"])

    ids = await asyncio.gather(*(one(i) for i in range(6)))
    assert sorted(served.engine.batches[1]) == sorted(ids)
    assert len(served.engine.batches) == 2


async def test_models_endpoint(serve: ServeFactory) -> None:
    served = await serve()
    body = (await served.http.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == ("tiny", "model", 256)


async def test_bos_only_prompt_text_is_not_doubled(serve: ServeFactory) -> None:
    served = await serve()
    response = await served.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    rid = response.json()["id"]
    assert served.engine.requests[rid].prompt_token_ids.count(BOS_ID) == 1
