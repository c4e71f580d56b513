"""``--reasoning-parser``: each parser whole and streamed in every two-piece cut and one
character at a time (tags split across pieces), without tags and with an unterminated block."""

from __future__ import annotations

import pytest

from server.text.reasoning import PARSERS, ReasoningParser, reasoning_parser

# (parser, output, reasoning, content) of a whole answer
CASES: list[tuple[str, str, str | None, str | None]] = [
    ("deepseek_r1", "I think.\n</think>\n\nParis.", "I think.\n", "\n\nParis."),
    ("deepseek_r1", "<think>I think.</think>Paris.", "I think.", "Paris."),
    ("deepseek_r1", "still thinking <thi", "still thinking <thi", None),  # unterminated
    ("deepseek_r1", "no tags at all", "no tags at all", None),
    ("deepseek_r1", "</think>Paris.", None, "Paris."),
    ("deepseek_r1", "a < b </think>x <think> y", "a < b ", "x <think> y"),
    ("qwen3", "<think>\nweighing\n</think>\n\nParis.", "\nweighing\n", "\n\nParis."),
    ("qwen3", "Sure. <think>hm</think> Paris.", "hm", "Sure.  Paris."),
    ("qwen3", "no tags at all", None, "no tags at all"),
    ("qwen3", "<think>unterminated", None, "<think>unterminated"),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("qwen3", "<think></think>Paris.", None, "Paris."),
    ("qwen3", "", None, None),
]


def _streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_split_whole(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert PARSERS[name]().split(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_streamed_in_any_pieces_equals_whole(
    name: str, text: str, reasoning: str | None, content: str | None
) -> None:
    parser = PARSERS[name]()
    if name == "qwen3" and "<think>" in text and "</think>" not in text:
        # streamed, an unterminated block has gone out as reasoning already
        reasoning, content = text.split("<think>", 1)[1], text.split("<think>", 1)[0] or None
    expected = (reasoning or "", content or "")
    assert _streamed(parser, [text]) == expected
    assert _streamed(parser, list(text)) == expected
    for cut in range(len(text) + 1):
        assert _streamed(parser, [text[:cut], text[cut:]]) == expected


def test_a_split_tag_is_held_back_then_released() -> None:
    stream = PARSERS["qwen3"]().stream()
    assert stream.feed("Hi <th") == ("", "Hi ")
    assert stream.feed("ink>abc</") == ("abc", "")
    assert stream.feed("think>done") == ("", "done")
    assert stream.finish() == ("", "")
    stream = PARSERS["qwen3"]().stream()
    assert stream.feed("1 <") == ("", "1 ")
    assert stream.feed("2") == ("", "<2")  # not a tag after all
    assert stream.feed(" <thin") == ("", " ")
    assert stream.finish() == ("", "<thin")


def test_deepseek_streams_reasoning_until_the_end_tag() -> None:
    stream = PARSERS["deepseek_r1"]().stream()
    assert stream.feed("<thi") == ("", "")  # may be the opening tag: held
    assert stream.feed("nk>Let me") == ("Let me", "")
    assert stream.feed(" see</th") == (" see", "")
    assert stream.feed("ink>42") == ("", "42")


def test_unknown_name_names_the_flag() -> None:
    assert reasoning_parser(None) is None
    assert reasoning_parser("qwen3").name == "qwen3"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="--reasoning-parser"):
        reasoning_parser("o1")
