"""``--reasoning-parser qwen3`` on a live ``shardserve serve`` of a tiny random Qwen3 (its
published chat template): a regex grammar forces the output to be ``<think>…</think>…``,
which the official ``openai`` SDK gets back split, whole and streamed. One server."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.checkpoints import TOKENIZER_VOCAB_SIZE
from tests.families import qwen3
from tests.live_server import live_server

pytestmark = pytest.mark.timeout(300)

THINK, ANSWER = "[a-z]{1,4}", "[a-z]{1,4}"
FORCED = {"structured_outputs": {"regex": f"<think>{THINK}</think>{ANSWER}"}}
ASK: dict[str, Any] = {
    "model": "q",
    "messages": [{"role": "user", "content": "Think, then answer."}],
    "max_tokens": 64,
    "temperature": 0,
    "extra_body": FORCED,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    path = tmp_path_factory.mktemp("qwen3-reasoning") / "model"
    model = qwen3.build(path, vocab_size=TOKENIZER_VOCAB_SIZE)  # every token the chat needs
    args = ["--model", str(model), "--served-model-name", "q", "--reasoning-parser", "qwen3"]
    with live_server(args, model.parent) as server:
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield sdk
        sdk.close()


def test_forced_think_block_is_reasoning_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**ASK).choices[0]
    assert whole.finish_reason == "stop", whole
    reasoning = (whole.message.model_extra or {}).get("reasoning_content")
    assert re.fullmatch(THINK, reasoning or ""), whole.message
    assert whole.message.model_extra["reasoning"] == reasoning
    assert re.fullmatch(ANSWER, whole.message.content or ""), whole.message
    kinds, thought, said = [], "", ""
    for chunk in client.chat.completions.create(**ASK, stream=True):
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning_content") or ""
        assert piece == ((delta.model_extra or {}).get("reasoning") or "")
        thought += piece
        said += delta.content or ""
        kinds += ["reasoning"] * bool(piece) + ["content"] * bool(delta.content)
    assert kinds == sorted(kinds, reverse=True) and "content" in kinds  # reasoning first
    assert (thought, said) == (reasoning, whole.message.content)  # temperature 0: the same
