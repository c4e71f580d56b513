"""``/v1/responses`` with the official ``openai`` SDK against a live server (fake echo engine).

The served template writes the last message's content, then EOS, then the whole conversation:
the echo engine therefore answers exactly the last message (it stops at EOS), while the prompt
it received shows how the conversation was rendered.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest

from server.api.responses_store import ResponseStore
from server.text.tokenizer import Tokenizer
from tests.server.api.test_openai_sdk import SDK
from tests.server.conftest import API_KEY, EOS_ID, ServeFactory, write_tiny_tokenizer
from tests.server.error_body import assert_error

pytestmark = pytest.mark.timeout(60)

TEMPLATE = (
    "{{ messages[-1]['content'] }}{{ eos_token }}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "[call {{ c['id'] }} {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}]"
    "{% endfor %}{% endif %}"
    "{% if m['tool_call_id'] is defined %}[result of {{ m['tool_call_id'] }}]{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class Weather(pydantic.BaseModel):
    city: str
    celsius: int


@pytest.fixture
def served_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    directory = tokenizer_dir.parent / "responses-template"
    return Tokenizer.from_dir(write_tiny_tokenizer(directory, chat_template=TEMPLATE))


@pytest.fixture
async def sdk(serve: ServeFactory, served_tokenizer: Tokenizer) -> AsyncIterator[SDK]:
    options = {"tool_call_parser": "hermes", "response_store": ResponseStore(max_responses=3)}
    served = await serve(api_key=API_KEY, served_tokenizer=served_tokenizer, app_options=options)
    client = SDK(served)
    yield client
    client.client.close()


def prompt_of(sdk: SDK, tokenizer: Tokenizer, response_id: str) -> str:
    """The conversation as rendered for ``response_id`` (after the echoed part)."""
    ids = sdk.served.engine.requests[response_id].prompt_token_ids
    return tokenizer.decode(ids[ids.index(EOS_ID) + 1 :])


async def test_create_retrieve_delete(sdk: SDK, served_tokenizer: Tokenizer) -> None:
    text = "héllo 你好"
    response = await sdk.call(
        lambda c: c.responses.create(model="tiny", input=text, instructions="Be brief.")
    )
    assert response.id.startswith("resp_") and response.status == "completed"
    assert response.output_text == text and response.instructions == "Be brief."
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    sent = sdk.served.engine.requests[response.id]
    assert response.usage is not None
    assert response.usage.input_tokens == len(sent.prompt_token_ids)
    assert (
        response.usage.output_tokens
        == len(served_tokenizer.encode(text, add_special_tokens=False)) + 1
    )  # EOS
    assert (
        prompt_of(sdk, served_tokenizer, response.id) == f"<system>Be brief.<user>{text}<assistant>"
    )
    again = await sdk.call(lambda c: c.responses.retrieve(response.id))
    assert again.model_dump() == response.model_dump()
    await sdk.call(lambda c: c.responses.delete(response.id))
    for gone in (
        lambda c: c.responses.retrieve(response.id),
        lambda c: c.responses.delete(response.id),
    ):
        with pytest.raises(openai.NotFoundError, match=response.id):
            await sdk.call(gone)


async def test_stream_events_in_order(sdk: SDK) -> None:
    def run(c: openai.OpenAI) -> tuple[list[Any], Any]:
        with c.responses.stream(model="tiny", input="one two three", max_output_tokens=50) as s:
            return list(s), s.get_final_response()

    events, final = await sdk.call(run)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1 and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "one two three" == final.output_text
    assert final.status == "completed" and final.output[0].id == events[2].item.id
    stored = await sdk.call(lambda c: c.responses.retrieve(final.id))
    assert stored.output_text == text


async def test_max_output_tokens_ends_incomplete(sdk: SDK) -> None:
    whole = await sdk.call(lambda c: c.responses.create(input="one two", max_output_tokens=2))
    assert whole.status == "incomplete" and whole.output[0].status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    body = {"input": "one two", "max_output_tokens": 2, "stream": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    async with sdk.served.http.stream("POST", "/v1/responses", json=body, headers=headers) as r:
        lines = [line async for line in r.aiter_lines() if line]
    events = [json.loads(line[len("data: ") :]) for line in lines[1::2]]
    assert [f"event: {e['type']}" for e in events] == lines[::2]  # each data after its event
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["usage"]["output_tokens"] == 2


async def test_parse_with_a_pydantic_format(sdk: SDK) -> None:
    answer = '{"city": "Paris", "celsius": 21}'
    parsed = await sdk.call(
        lambda c: c.responses.parse(model="tiny", input=answer, text_format=Weather)
    )
    assert parsed.output_parsed == Weather(city="Paris", celsius=21)
    grammar = sdk.served.engine.requests[parsed.id].grammar
    assert grammar is not None and grammar.kind == "json_schema"
    assert json.loads(grammar.spec) == Weather.model_json_schema() | {"additionalProperties": False}


async def test_function_call_round_trip(sdk: SDK, served_tokenizer: Tokenizer) -> None:
    def call_streamed(c: openai.OpenAI) -> tuple[list[str], Any]:
        with c.responses.stream(model="tiny", input=CALL_TEXT, tools=[WEATHER_TOOL]) as s:
            return [e.type for e in s], s.get_final_response()

    kinds, first = await sdk.call(call_streamed)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = await sdk.call(
        lambda c: c.responses.create(
            model="tiny", previous_response_id=first.id, input=[result], tools=[WEATHER_TOOL]
        )
    )
    assert second.output_text == "Sunny, 21 C" and second.previous_response_id == first.id
    rendered = prompt_of(sdk, served_tokenizer, second.id)
    assert rendered == (
        f"<user>{CALL_TEXT}<assistant>"
        f'[call {call.call_id} get_weather {{"city": "Paris"}}]'
        f"<tool>Sunny, 21 C[result of {call.call_id}]<assistant>"
    )
    # the same conversation sent as input items, without the store
    items = [{"role": "user", "content": CALL_TEXT}, call.model_dump(), result]
    third = await sdk.call(
        lambda c: c.responses.create(model="tiny", input=items, store=False, tool_choice="none")
    )
    assert prompt_of(sdk, served_tokenizer, third.id) == rendered
    with pytest.raises(openai.NotFoundError):
        await sdk.call(lambda c: c.responses.retrieve(third.id))


async def test_previous_response_chain_and_eviction(sdk: SDK, served_tokenizer: Tokenizer) -> None:
    first = await sdk.call(lambda c: c.responses.create(input="one", instructions="old"))
    second = await sdk.call(
        lambda c: c.responses.create(input="two", previous_response_id=first.id, instructions="new")
    )
    assert second.output_text == "two"
    rendered = prompt_of(sdk, served_tokenizer, second.id)
    assert rendered == "<system>new<user>one<assistant>one<user>two<assistant>"  # no "old"
    with pytest.raises(openai.NotFoundError) as missing:
        await sdk.call(lambda c: c.responses.create(input="x", previous_response_id="resp_nope"))
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for word in ("three", "four"):  # the store holds 3: the first response is evicted
        await sdk.call(lambda c, w=word: c.responses.create(input=w))  # type: ignore[misc]
    with pytest.raises(openai.NotFoundError):
        await sdk.call(lambda c: c.responses.retrieve(first.id))
    third = await sdk.call(  # the chain does not need its evicted start
        lambda c: c.responses.create(input="five", previous_response_id=second.id)
    )
    assert prompt_of(sdk, served_tokenizer, third.id).startswith("<user>one<assistant>one")


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_refusal_is_a_400(
    serve: ServeFactory, tokenizer: Tokenizer, stream: bool
) -> None:
    refused = tokenizer.encode("Hello", add_special_tokens=False)[0]
    served = await serve(refuse_token=refused)
    body = {"input": "Hello", "stream": stream}
    error = assert_error(await served.http.post("/v1/responses", json=body), 400)
    assert error["code"] == "engine_refused"


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
IMAGE_URL = "input[0].content[0].image_url"
BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [IMAGE]}]}, "input"),  # a text-only model
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
        IMAGE_URL,
    ),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    (
        {"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "no"}},
        "tool_choice",
    ),
    (
        {
            "input": "x",
            "tools": [WEATHER_TOOL | {"parameters": {"type": 5}}],
            "tool_choice": {"type": "function", "name": "get_weather"},
        },
        "tools[0].parameters",
    ),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "stop": [""]}, "stop"),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "w"}}},
        "text.format.schema",
    ),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 3}}}},
        "text.format.schema",
    ),
    ({"input": "x", "model": "gpt-5"}, "model"),
    ({"input": "x " * 20_000}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
async def test_bad_inputs_are_openai_errors(
    serve: ServeFactory, body: dict[str, Any], param: str
) -> None:
    served = await serve()
    status = 404 if param == "model" else 400
    assert_error(await served.http.post("/v1/responses", json=body), status, param)
    assert_error(await served.http.get("/v1/responses/resp_x"), 404, "response_id")
    assert_error(await served.http.delete("/v1/responses/resp_x"), 404, "response_id")
