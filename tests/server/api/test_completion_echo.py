"""/v1/completions ``echo``, ``max_tokens: 0`` and vLLM's ``prompt_logprobs``: live server, real
engine client, fake echo engine (its prompt scores: :func:`fake_prompt_logprobs`)."""

from __future__ import annotations

from typing import Any

import pytest

from server.text.tokenizer import Tokenizer
from tests.server.conftest import ServeFactory
from tests.server.fake_engine import fake_prompt_logprobs
from tests.server.sse import read_events

pytestmark = pytest.mark.timeout(60)


def _generated(ids: list[int], n: int) -> list[int]:
    """The echo engine's ``n`` tokens for prompt ``ids`` (BOS first)."""
    return (ids[1:] * n)[:n]


def _offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for token in tokens:
        out.append(at)
        at += len(token)
    return out


async def test_echo_with_logprobs(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    served = await serve()
    prompt = "one two three"
    ids = tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2}
    response = await served.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    generated = tokenizer.decode(_generated(ids, 3))
    assert choice["text"] == prompt + generated and "prompt_logprobs" not in choice
    lp = choice["logprobs"]
    texts = [tokenizer.token_text(t) for t in ids]
    assert lp["tokens"][: len(ids)] == texts and len(lp["tokens"]) == len(ids) + 3
    assert lp["text_offset"] == _offsets(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    scores = fake_prompt_logprobs(ids, 2, tokenizer.vocab_size)
    assert lp["token_logprobs"][1 : len(ids)] == scores.logprobs
    assert lp["token_logprobs"][len(ids) :] == [-0.5] * 3  # the generated tokens'
    for i in range(1, len(ids)):
        top = {
            tokenizer.token_text(t): v
            for t, v in zip(scores.top_ids[i - 1], scores.top_logprobs[i - 1], strict=True)
        }
        top.setdefault(texts[i], scores.logprobs[i - 1])
        assert lp["top_logprobs"][i] == top
    sent = served.engine.requests[response.json()["id"]]
    assert sent.prompt_logprobs == 2 and sent.sampling.logprobs == 2 and sent.max_tokens == 3


async def test_loglikelihood_request(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    """lm-evaluation-harness's ``local-completions``: token-id prompts in a batch, ``echo``,
    ``logprobs: 1``, ``max_tokens: 0``; here also ``n: 2``: each choice echoes its prompt."""
    served = await serve()
    prompts = [tokenizer.encode("one two three"), tokenizer.encode("four five")[1:]]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "n": 2}
    response = await served.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    for choice in data["choices"]:
        ids = prompts[choice["index"] // 2]
        assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        want = fake_prompt_logprobs(ids, 1, tokenizer.vocab_size).logprobs
        assert sum(lp["token_logprobs"][1:]) == pytest.approx(sum(want))
        assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert data["usage"] == {
        "prompt_tokens": len(prompts[0]) + len(prompts[1]),
        "completion_tokens": 0,
        "total_tokens": len(prompts[0]) + len(prompts[1]),
    }
    sent = served.engine.requests[f"{data['id']}-3"]
    assert (sent.max_tokens, sent.prompt_logprobs, sent.sampling.logprobs) == (1, 1, None)


async def test_vllm_prompt_logprobs(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    served = await serve()
    ids = tokenizer.encode("one two")
    body = {"prompt": "one two", "max_tokens": 2, "prompt_logprobs": 2}
    response = await served.http.post("/v1/completions", json=body)
    (choice,) = response.json()["choices"]
    assert choice["text"] == tokenizer.decode(_generated(ids, 2)) and choice["logprobs"] is None
    scores = fake_prompt_logprobs(ids, 2, tokenizer.vocab_size)
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        own = {
            "logprob": scores.logprobs[i - 1],
            "rank": i,
            "decoded_token": tokenizer.token_text(ids[i]),
        }
        expected: dict[str, Any] = {str(ids[i]): own}
        for rank, (t, v) in enumerate(
            zip(scores.top_ids[i - 1], scores.top_logprobs[i - 1], strict=True), 1
        ):
            entry = {"logprob": v, "rank": rank, "decoded_token": tokenizer.token_text(t)}
            expected.setdefault(str(t), entry)
        assert got[i] == expected and next(iter(got[i])) == str(ids[i])


async def test_chat_prompt_logprobs_score_the_rendered_prompt(
    serve: ServeFactory, tokenizer: Tokenizer
) -> None:
    served = await serve()
    messages = [{"role": "user", "content": "one two"}]
    body = {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1}
    response = await served.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    got = response.json()["prompt_logprobs"]
    sent = served.engine.requests[response.json()["id"]]
    ids = sent.prompt_token_ids  # the template's rendering, tokenized
    assert sent.prompt_logprobs == 1 and len(got) == len(ids) and got[0] is None
    scores = fake_prompt_logprobs(ids, 1, tokenizer.vocab_size)
    for i in range(1, len(ids)):
        own = got[i][str(ids[i])]
        assert own == {
            "logprob": scores.logprobs[i - 1],
            "rank": i,
            "decoded_token": tokenizer.token_text(ids[i]),
        }
    plain = await served.http.post("/v1/chat/completions", json={"messages": messages})
    assert "prompt_logprobs" not in plain.json()


async def test_streamed_echo(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    served = await serve()
    prompt = "one two three"
    ids = tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 0, "n": 2, "stream": True}
    async with served.http.stream("POST", "/v1/completions", json=body) as response:
        events, done = await read_events(response)
    assert done
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert chunks[0]["text"].startswith(prompt)
        assert "".join(c["text"] for c in chunks) == prompt + tokenizer.decode(_generated(ids, 4))
        tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
        assert len(tokens) == len(ids) + 4 and offsets == _offsets(tokens)
        assert chunks[0]["logprobs"]["token_logprobs"][0] is None


async def test_bad_combinations_are_400(serve: ServeFactory) -> None:
    served = await serve()
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        (
            "/v1/completions",
            {"prompt": "x", "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
    ]
    for route, body, param in cases:
        response = await served.http.post(route, json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text
