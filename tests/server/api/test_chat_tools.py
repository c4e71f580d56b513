"""Tool calls: each ``--tool-call-parser`` on scripted outputs in its model family's real
format, whole and streamed (through :class:`server.api.chat_tools.ToolStream`, as the SDK
reassembles it); ``tool_choice`` plans; ``tools`` rendered by the chat template exactly
as ``transformers`` renders them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from model_shards.launch.default_model import write_default_model
from server.api.chat_protocol import ChatCompletionRequest, ChatDelta
from server.api.chat_tools import ToolPlan, ToolStream, message, tool_plan
from server.http.errors import APIError
from server.text.chat_template import ChatTemplate
from server.text.tokenizer import Tokenizer
from server.text.tool_parsers import PARSERS, detect

WEATHER = {"city": "Paris", "days": 3}
TIME = {"tz": "Europe/Oslo"}
TEMPLATES = Path(__file__).parents[2] / "families"

# (parser, model output, expected content, expected calls)
SCRIPTED: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (  # Qwen2.5 / Hermes: text, then one tag per call
        "hermes",
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}\n</tool_call>',
        "Let me check both.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (  # Qwen3 with its thinking block before the call
        "hermes",
        "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "<think>\nThe user wants weather.\n</think>",
        [("get_weather", WEATHER)],
    ),
    ("hermes", "No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
    (  # Llama 3.1 / 3.2: the whole answer is the call
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Oslo"}}',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("llama3_json", "Paris is sunny {mostly}.", "Paris is sunny {mostly}.", []),
    (  # Mistral v3 tokenizers: one JSON array
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}]',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (  # Mistral v11+: name[ARGS]{...} per call
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Oslo"}',
        "Sure.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (  # the [TOOL_CALLS] special token dropped by the detokenizer
        "mistral",
        '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        None,
        [("get_weather", WEATHER)],
    ),
    ("mistral", "[1] see the docs", "[1] see the docs", []),
]


@pytest.mark.parametrize(("parser", "output", "content", "calls"), SCRIPTED)
def test_parser_on_scripted_output(
    parser: str, output: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    got = message(ToolPlan("auto", PARSERS[parser]()), output)
    assert got.content == (content if calls else output)
    got_calls = [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls or []]
    assert got_calls == calls
    assert len({c.id for c in got.tool_calls or []}) == len(calls)


def _reassemble(deltas: list[ChatDelta]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call index, as the SDK accumulates chunks."""
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for piece in d.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize(("parser", "output", "content", "calls"), SCRIPTED)
def test_parser_streamed_in_pieces(
    parser: str, output: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    stream = ToolStream(ToolPlan("auto", PARSERS[parser]()))
    deltas: list[ChatDelta] = []
    for i in range(0, len(output), 3):
        deltas += stream.feed(output[i : i + 3])
    deltas += stream.finish()
    text, got = _reassemble(deltas)
    # streamed content is the raw text before the calls (whitespace included)
    assert (text.strip() if calls else text) == (content or "" if calls else output)
    assert [(n, json.loads(a)) for n, a in got] == calls
    assert stream.called == bool(calls)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    _, output, _, calls = SCRIPTED[0]
    plan = ToolPlan("auto", PARSERS["hermes"](), parallel=False)
    got = message(plan, output)
    assert [c.function.name for c in got.tool_calls or []] == [calls[0][0]]
    stream = ToolStream(plan)
    deltas = [d for i in range(0, len(output), 5) for d in stream.feed(output[i : i + 5])]
    assert [n for n, _ in _reassemble(deltas + stream.finish())[1]] == [calls[0][0]]


def test_named_function_streams_its_arguments_as_they_come() -> None:
    stream = ToolStream(ToolPlan("named", name="get_weather"))
    pieces = ['{"city": ', '"Paris", ', '"days": 3}']
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    assert len(deltas) == 1 + len(pieces)
    assert _reassemble(deltas) == ("", [("get_weather", json.dumps(WEATHER))])


def _request(**fields: Any) -> ChatCompletionRequest:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": _SCHEMA}},
        {"type": "function", "function": {"name": "noop"}},
    ]
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **fields}
    )


_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}


def test_tool_choice_plans() -> None:
    plan, grammar = tool_plan(_request(), "hermes")
    assert plan.mode == "auto" and grammar is None
    plan, grammar = tool_plan(_request(tool_choice="none"), None)
    assert plan.mode == "none" and grammar is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan, grammar = tool_plan(_request(tool_choice=named), None)
    assert plan.mode == "named" and grammar is not None
    assert json.loads(grammar.spec) == _SCHEMA
    plan, grammar = tool_plan(_request(tool_choice="required", parallel_tool_calls=False), None)
    assert plan.mode == "required" and grammar is not None
    schema = json.loads(grammar.spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    with pytest.raises(APIError) as info:
        tool_plan(_request(tool_choice={"type": "function", "function": {"name": "x"}}), None)
    assert info.value.info.param == "tool_choice"
    with pytest.raises(APIError):
        tool_plan(_request(), None)  # auto without a parser


def test_detect_parser_from_templates() -> None:
    assert detect((TEMPLATES / "qwen3_chat_template.jinja").read_text()) == "hermes"
    assert detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect("{{ messages }}") is None


def test_tools_render_as_transformers(tmp_path: Path) -> None:
    write_default_model(tmp_path)
    shutil.copy(TEMPLATES / "qwen3_chat_template.jinja", tmp_path / "chat_template.jinja")
    tools: list[Any] = [
        {"type": "function", "function": {"name": "get_weather", "parameters": _SCHEMA}}
    ]
    call: dict[str, Any] = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    openai_messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = ChatCompletionRequest.model_validate({"messages": openai_messages, "tools": tools})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is not None
    ours = ChatTemplate(tok.chat_template, tok.special_tokens).render(
        [m.template_dict() for m in body.messages],
        add_generation_prompt=True,
        tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
    )
    hf_messages = [dict(m) for m in openai_messages]
    hf_messages[1] = {
        **hf_messages[1],
        "tool_calls": [{**call, "function": {**call["function"], "arguments": {"city": "Oslo"}}}],
    }
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        hf_messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert "<tools>" in ours and '"get_weather"' in ours and "<tool_response>" in ours


def test_tool_call_parser_flag() -> None:
    from server.cli.args import build_parser
    from server.cli.frontend_flags import TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])
    assert args.tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--tool-call-parser", "xml"])
    assert info.value.code == 2
