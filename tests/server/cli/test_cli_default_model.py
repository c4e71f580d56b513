"""``shardserve serve`` with no ``--model``: the packaged SmolLM2-135M-Instruct GGUF, its
tokenizer and chat template from the GGUF metadata, answers a question greedily."""

from __future__ import annotations

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
        live_server([], tmp_path) as server,
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
