"""Every bad request gets an OpenAI-style error with the right status; the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from server.text.tokenizer import Tokenizer
from tests.server.conftest import ServeFactory
from tests.server.error_body import assert_error

pytestmark = pytest.mark.timeout(60)

GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}


async def assert_still_serving(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "Hello"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
        ({"model": "tiny", "prompt": "x", "top_k": -5}, "top_k"),
        ({"model": "tiny", "prompt": "x", "n": 17}, "n"),
        ({"model": "tiny", "prompt": "x", "n": 0}, "n"),
        ({"model": "tiny", "prompt": ["x"] * 20, "n": 16}, "n"),
        ({"model": "tiny", "prompt": "x", "min_p": 1.5}, "min_p"),
        ({"model": "tiny", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": "tiny", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"model": "tiny", "prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"model": "tiny", "prompt": "x", "min_tokens": 17}, "min_tokens"),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "tiny", "prompt": "x", "logprobs": -1}, "logprobs"),
        ({"model": "tiny", "prompt": "x", "seed": "abc"}, "seed"),
        ({"model": "tiny", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"model": "tiny", "prompt": "x", "suffix": "end"}, "suffix"),
        ({"model": "tiny", "prompt": ["x", ""]}, "prompt"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "tiny", "prompt": ""}, "prompt"),
        ({"model": "tiny", "prompt": []}, "prompt"),
        ({"model": "tiny", "prompt": {"text": "x"}}, "prompt"),
        ({"model": "tiny"}, "prompt"),
        ({"model": "tiny", "prompt": [5, 99999]}, "prompt"),
        ({"model": "tiny", "prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 300}, "max_tokens"),
        ({"model": "tiny", "prompt": list(range(3, 260)), "max_tokens": 1}, "prompt"),
    ],
)
async def test_bad_request_400(serve: ServeFactory, body: dict[str, Any], param: str) -> None:
    served = await serve()
    response = await served.http.post("/v1/completions", json=body)
    error = assert_error(response, 400, param)
    assert error["type"] == "invalid_request_error"
    await assert_still_serving(served.http)


async def test_context_length_error_names_the_numbers(serve: ServeFactory) -> None:
    served = await serve()
    body = {"prompt": "Hello", "max_tokens": 255}
    error = assert_error(await served.http.post("/v1/completions", json=body), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded" and "256" in error["message"]


@pytest.mark.parametrize(
    "content", [b"{not json", b"", b"[1, 2]", b'"just a string"', b'{"prompt": "x",}']
)
async def test_malformed_json_400(serve: ServeFactory, content: bytes) -> None:
    served = await serve()
    response = await served.http.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert_error(response, 400)
    await assert_still_serving(served.http)


async def test_unknown_model_404(serve: ServeFactory) -> None:
    served = await serve()
    response = await served.http.post("/v1/completions", json={**GOOD, "model": "gpt-5"})
    error = assert_error(response, 404, "model")
    assert error["code"] == "model_not_found" and "gpt-5" in error["message"]
    await assert_still_serving(served.http)


async def test_unknown_route_and_method(serve: ServeFactory) -> None:
    served = await serve()
    error = assert_error(await served.http.post("/v1/chat/nonsense", json=GOOD), 404)
    assert "/v1/chat/nonsense" in error["message"]
    assert_error(await served.http.get("/v1/completions"), 405)
    await assert_still_serving(served.http)


async def test_engine_refusal_400(serve: ServeFactory, tokenizer: Tokenizer) -> None:
    refused = tokenizer.encode("the fox")[-1]
    served = await serve(refuse_token=refused)
    for stream in (False, True):
        body = {"prompt": "the fox", "max_tokens": 4, "stream": stream}
        response = await served.http.post("/v1/completions", json=body)
        error = assert_error(response, 400)  # streamed too: refused before the first frame
        assert error["code"] == "engine_refused" and "refused token" in error["message"]
    await assert_still_serving(served.http)
