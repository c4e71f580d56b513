"""``--reasoning-parser``, ``chat_template_kwargs`` and ``content: null`` assistant turns with
the official ``openai`` SDK against a live server whose fake engine echoes the last message
(the template renders just that): the model "writes" whatever the test sends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from server.text.tokenizer import Tokenizer
from tests.server.api.test_openai_sdk import SDK
from tests.server.conftest import ServeFactory, write_tiny_tokenizer

pytestmark = pytest.mark.timeout(60)

#: Echo the last message; ``enable_thinking=false`` (a chat_template_kwargs) prefixes a mark;
#: every message's content is concatenated, as templates that need a string do.
TEMPLATE = (
    "{% for m in messages %}{% set joined = m['role'] + ': ' + m['content'] %}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
    "{{ messages[-1]['content'] }}{{ eos_token }}"
)
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.fixture(scope="module")
def echo_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = write_tiny_tokenizer(tmp_path_factory.mktemp("reasoning"), chat_template=TEMPLATE)
    return Tokenizer.from_dir(Path(directory))


async def _sdk(serve: ServeFactory, tokenizer: Tokenizer, **options: Any) -> SDK:
    served = await serve(served_tokenizer=tokenizer, app_options=options)
    return SDK(served, api_key="unused")


@pytest.fixture
async def qwen3(serve: ServeFactory, echo_tokenizer: Tokenizer) -> AsyncIterator[SDK]:
    sdk = await _sdk(serve, echo_tokenizer, reasoning_parser="qwen3", tool_call_parser="hermes")
    yield sdk
    sdk.client.close()


def _say(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


async def _whole(sdk: SDK, text: str, **kwargs: Any) -> Any:
    result = await sdk.call(
        lambda c: c.chat.completions.create(model="tiny", messages=_say(text), **kwargs)
    )
    return result.choices[0]


async def _streamed(sdk: SDK, text: str, **kwargs: Any) -> list[tuple[str, str]]:
    """The stream's non-empty delta fields in order: ``(field, text)``; reasoning checked
    to come under both its names."""

    def run(c: openai.OpenAI) -> list[Any]:
        messages = _say(text)
        return list(
            c.chat.completions.create(model="tiny", messages=messages, stream=True, **kwargs)
        )

    out = []
    for chunk in await sdk.call(run):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        if extra.get("reasoning"):
            out.append(("reasoning", extra["reasoning"]))
        if delta.content:
            out.append(("content", delta.content))
        for call in delta.tool_calls or []:
            out.append(("tool_call", call.function.name or call.function.arguments or ""))
    return out


def _joined(pieces: list[tuple[str, str]], kind: str) -> str:
    return "".join(text for field, text in pieces if field == kind)


async def test_qwen3_reasoning_whole_and_streamed(qwen3: SDK) -> None:
    text = "<think>Paris is in France.</think>It is sunny."
    choice = await _whole(qwen3, text)
    extra = choice.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == "Paris is in France."
    assert choice.message.content == "It is sunny." and choice.finish_reason == "stop"
    pieces = await _streamed(qwen3, text)
    kinds = [field for field, _ in pieces]
    assert kinds.count("reasoning") > 1  # streamed as it came, token by token
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # reasoning first
    assert _joined(pieces, "reasoning") == "Paris is in France."
    assert _joined(pieces, "content") == "It is sunny."
    plain = await _whole(qwen3, "No thinking here.")
    assert plain.message.content == "No thinking here."
    assert "reasoning_content" not in (plain.message.model_extra or {})


async def test_tool_calls_after_reasoning(qwen3: SDK) -> None:
    text = f"<think>They want weather.</think>\n<tool_call>{json.dumps(CALL)}</tool_call>"
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    choice = await _whole(qwen3, text, tools=tools)
    assert choice.message.model_extra["reasoning"] == "They want weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    pieces = await _streamed(qwen3, text, tools=tools)
    assert _joined(pieces, "reasoning") == "They want weather."
    assert next(t for f, t in pieces if f == "tool_call") == "get_weather"
    assert "<tool_call>" not in _joined(pieces, "content")


async def test_responses_put_the_reasoning_in_its_own_item(qwen3: SDK) -> None:
    text = "<think>Paris is in France.</think>It is sunny."
    whole = await qwen3.call(lambda c: c.responses.create(model="tiny", input=text))
    thinking, message = whole.output
    assert thinking.type == "reasoning" and thinking.id.startswith("rs_")
    assert [part.text for part in thinking.content or []] == ["Paris is in France."]
    assert message.type == "message" and whole.output_text == "It is sunny."

    def stream(c: openai.OpenAI) -> tuple[list[Any], Any]:
        with c.responses.stream(model="tiny", input=text) as events:
            return list(events), events.get_final_response()

    events, final = await qwen3.call(stream)
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert (
        kinds.index("response.reasoning_text.delta")
        < kinds.index("response.reasoning_text.done")
        < first_text
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Paris is in France." and len(deltas) > 1
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "It is sunny."


async def test_deepseek_r1_starts_inside_the_reasoning(
    serve: ServeFactory, echo_tokenizer: Tokenizer
) -> None:
    sdk = await _sdk(serve, echo_tokenizer, reasoning_parser="deepseek_r1")
    text = "Let me see: 6 times 7.\n</think>\n\n42"
    choice = await _whole(sdk, text)
    assert choice.message.model_extra["reasoning_content"] == "Let me see: 6 times 7.\n"
    assert choice.message.content == "\n\n42"
    pieces = await _streamed(sdk, text)
    assert _joined(pieces, "reasoning") == "Let me see: 6 times 7.\n"
    assert _joined(pieces, "content") == "\n\n42"
    unterminated = await _whole(sdk, "still thinking")
    assert unterminated.message.content is None
    assert unterminated.message.model_extra["reasoning"] == "still thinking"
    shaped = {"structured_outputs": {"regex": "[a-z ]+"}}  # from the first token: no block
    plain = await _whole(sdk, "plain words", extra_body=shaped)
    assert plain.message.content == "plain words" and not plain.message.model_extra
    sdk.client.close()


async def test_chat_template_kwargs_reach_the_template(qwen3: SDK) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert (await _whole(qwen3, "hi", extra_body=off)).message.content == "NOTHINK hi"
    assert (await _whole(qwen3, "hi")).message.content == "hi"
    reserved = {"chat_template_kwargs": {"messages": []}}
    with pytest.raises(openai.BadRequestError) as info:
        await _whole(qwen3, "hi", extra_body=reserved)
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


async def test_tool_round_trip_with_null_assistant_content(qwen3: SDK) -> None:
    """The assistant turn's ``content: null`` reaches a template that concatenates it as ''."""
    messages: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    result = await qwen3.call(lambda c: c.chat.completions.create(model="tiny", messages=messages))
    assert result.choices[0].message.content == "sunny"
