"""server.cli.flag_types: the argparse types the CLI and the media flags share; a bad value
exits 2 with argparse's message naming the flag."""

from __future__ import annotations

import argparse

import pytest

from server.cli import args as cli_args
from server.cli.args import build_parser
from server.cli.flag_types import int_in, non_negative_float, positive_float, positive_int
from server.media import multimodal


def test_values_and_refusals() -> None:
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5
    assert non_negative_float("0") == 0.0 and int_in(1, 5, "5") == 5
    for check, text, says in [
        (positive_int, "0", "must be >= 1, got 0"),
        (positive_int, "x", "not an integer: 'x'"),
        (positive_float, "0", "must be > 0, got 0.0"),
        (positive_float, "nan", "finite number >= 0"),
        (non_negative_float, "inf", "finite number >= 0"),
        (lambda t: int_in(1, 5, t), "6", "must be in 1..5, got 6"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            check(text)


def test_both_modules_use_the_shared_types() -> None:
    assert cli_args._positive_int is positive_int
    assert multimodal.positive_float is positive_float


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--video-fps", "0", "argument --video-fps: must be > 0, got 0.0"),
        ("--max-video-frames", "-2", "argument --max-video-frames: must be >= 1, got -2"),
        ("--media-fetch-timeout", "soon", "argument --media-fetch-timeout: not a number: 'soon'"),
        ("--cpu-threads-per-rank", "0", "argument --cpu-threads-per-rank: must be >= 1, got 0"),
    ],
)
def test_a_bad_value_exits_naming_the_flag(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", flag, value])
    assert info.value.code == 2
    assert says in capsys.readouterr().err
