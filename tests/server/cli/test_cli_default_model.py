"""``shardserve serve`` with no ``--model``: the packaged SmolLM2-135M-Instruct GGUF, its
tokenizer and chat template from the GGUF metadata, answers a question greedily, streams,
and follows a JSON schema and a required tool call (``--tool-call-parser hermes``: grammars
over the GGUF's own vocabulary on rank 0), on ``/v1/chat/completions`` and, through the
official ``openai`` SDK, on ``/v1/responses``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest

from model_shards.launch.packaged_model import SERVED_NAME
from tests.live_server import live_server


@pytest.mark.timeout(300)
def test_default_model_knows_the_capital_of_france(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARDSERVE_MODEL", raising=False)
    with (
        live_server(["--tool-call-parser", "hermes"], tmp_path) as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [SERVED_NAME]
        question = {"role": "user", "content": "What is the capital of France?"}
        body = {"model": SERVED_NAME, "messages": [question], "max_tokens": 24, "temperature": 0}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]
        assert "Paris" in answer["message"]["content"], answer
        assert answer["finish_reason"] == "stop"  # <|im_end|> ends the turn
        _structured_and_tools(http)
        _responses(server.url)


def _structured_and_tools(http: httpx.Client) -> None:
    question = {"role": "user", "content": "Give the capital of France as JSON."}
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
    }
    body = {
        "model": SERVED_NAME,
        "messages": [question],
        "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["choices"][0]["message"]["content"]) == {"capital": "Paris"}
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    question = {"role": "user", "content": "What is the weather in Paris?"}
    body = {
        "model": SERVED_NAME,
        "messages": [question],
        "max_tokens": 40,
        "temperature": 0,
        "tools": [weather],
        "tool_choice": "required",
    }
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}


class Capital(pydantic.BaseModel):
    capital: str


WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def _responses(url: str) -> None:
    """The Responses API on the real model: text, a parsed schema, a function-call round trip."""
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    greedy: dict[str, Any] = {"model": SERVED_NAME, "temperature": 0, "max_output_tokens": 40}
    answer = sdk.responses.create(input="What is the capital of France?", **greedy)
    assert answer.status == "completed" and "Paris" in answer.output_text, answer
    parsed = sdk.responses.parse(
        input="Give the capital of France as JSON.", text_format=Capital, **greedy
    )
    assert parsed.output_parsed == Capital(capital="Paris")
    asked = sdk.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        **greedy,
    )
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather", asked.output
    assert json.loads(call.arguments) == {"city": "Paris"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    final = sdk.responses.create(
        input=[result],  # type: ignore[list-item]
        previous_response_id=asked.id,
        **greedy,
    )
    assert final.status == "completed" and final.output_text, final  # the template took it all
    assert final.previous_response_id == asked.id
    sdk.close()
