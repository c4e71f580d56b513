"""/v1/chat/completions over raw HTTP: stop strings, UTF-8 in streams, validation.

The echo engine answers a chat with the rendered prompt (BOS dropped) up to
the template's first ``</s>``: ``"<|system|>\\n" + system message``.
"""

from __future__ import annotations

from typing import Any

import pytest

from server.text.tokenizer import Tokenizer
from tests.server.conftest import ServeFactory
from tests.server.error_body import assert_error
from tests.server.sse import read_events

pytestmark = pytest.mark.timeout(60)


def conversation(system: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]


async def stream_chat(served: Any, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    async with served.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events, done = await read_events(response)
    assert done
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return text, events


async def test_multibyte_stream(serve: ServeFactory) -> None:
    served = await serve(step_s=0.001)
    system = "héllo wörld 你好，世界 😀🎉🚀"
    text, events = await stream_chat(
        served, {"messages": conversation(system), "stream": True, "max_tokens": 100}
    )
    assert text == "<|system|>\n" + system
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in events]
    assert len(pieces) > 5 and all("\ufffd" not in p for p in pieces)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_spanning_tokens(
    serve: ServeFactory, tokenizer: Tokenizer, stream: bool
) -> None:
    served = await serve(step_s=0.003)
    system = "one two three four five"
    stop = "o thr"
    assert all(stop not in tokenizer.decode([t]) for t in tokenizer.encode(system))
    body = {"messages": conversation(system), "stop": stop, "stream": stream, "max_tokens": 100}
    if stream:
        text, events = await stream_chat(served, body)
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        response = await served.http.post("/v1/chat/completions", json=body)
        choice = response.json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert (text, finish) == ("<|system|>\none tw", "stop")
    rid = next(iter(served.engine.requests))
    assert served.engine.wait_for(lambda: rid in served.engine.aborted)


async def test_text_parts_and_max_tokens_fields(serve: ServeFactory) -> None:
    served = await serve()
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    messages = [{"role": "system", "content": parts}, {"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 50, "max_completion_tokens": 3}
    response = await served.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert served.engine.requests[response.json()["id"]].max_tokens == 3  # the new field wins
    body = {"messages": messages, "max_tokens": 100}
    text = (await served.http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert text["message"]["content"] == "<|system|>\none\ntwo"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 1000}, "max_completion_tokens"),
        ({"max_tokens": 1000}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no"}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"repetition_penalty": 3}, "repetition_penalty"),
        ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ],
)
async def test_bad_chat_request_400(serve: ServeFactory, body: dict[str, Any], param: str) -> None:
    served = await serve()
    request = {"messages": [{"role": "user", "content": "hi"}], **body}
    response = await served.http.post("/v1/chat/completions", json=request)
    assert_error(response, 400, param)


async def test_unknown_model_404(serve: ServeFactory) -> None:
    served = await serve()
    body = {"model": "other", "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(await served.http.post("/v1/chat/completions", json=body), 404, "model")
    assert error["code"] == "model_not_found"
