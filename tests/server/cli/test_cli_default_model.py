"""``shardserve serve`` with no ``--model``: the packaged SmolLM2-135M-Instruct GGUF, its
tokenizer and chat template from the GGUF metadata, answers a question greedily, streams,
and follows a JSON schema and a required tool call (``--tool-call-parser hermes``: grammars
over the GGUF's own vocabulary on rank 0)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
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
