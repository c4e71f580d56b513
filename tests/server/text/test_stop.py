"""Stop strings: cut before the match, never emit a partial stop string."""

from __future__ import annotations

import pytest

from server.text.stop import StopStringMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops)
    out = [matcher.feed(d) for d in deltas]
    out.append(matcher.flush())
    return out, matcher.stopped


def test_no_stops_is_pass_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


def test_match_inside_one_delta() -> None:
    out, stopped = run(["END"], ["hello END world"])
    assert stopped and "".join(out) == "hello "


def test_match_spanning_deltas_is_never_partially_emitted() -> None:
    out, stopped = run(["STOP"], ["one S", "T", "O", "P two"])
    assert stopped and out == ["one ", "", "", "", ""]


def test_false_start_is_released() -> None:
    out, stopped = run(["STOP"], ["a ST", "ART", " b"])
    assert not stopped and "".join(out) == "a START b"
    assert out[0] == "a "  # "ST" held back until it could no longer start "STOP"


def test_earliest_of_several_stops_wins() -> None:
    out, stopped = run(["two", "one"], ["zero one two"])
    assert stopped and "".join(out) == "zero "


def test_held_tail_released_at_end() -> None:
    out, stopped = run(["STOP"], ["abc ST"])
    assert not stopped and out == ["abc ", "ST"]


def test_input_after_stop_ignored() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == "a"
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""])
