"""argparse ``type=`` checks shared by the CLI's flags (:mod:`server.cli.args`) and the
media flags (:mod:`server.media.multimodal`). A leaf: it imports neither of them.

Each raises :class:`argparse.ArgumentTypeError` with what was wrong; argparse puts the
flag's name before it (``argument --video-fps: must be > 0, got 0.0``).
"""

from __future__ import annotations

import argparse
import math

from model_shards.config.replica import parse_size


def int_in(minimum: int, maximum: float, text: str) -> int:
    """``text`` as an integer in ``minimum..maximum`` (``math.inf``: no upper bound)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not minimum <= value <= maximum:
        bound = f">= {minimum}" if maximum == math.inf else f"in {minimum}..{maximum}"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


def non_negative_int(text: str) -> int:
    return int_in(0, math.inf, text)


def positive_int(text: str) -> int:
    return int_in(1, math.inf, text)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (NaN and infinity refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port to listen on; 0 picks a free one."""
    return int_in(0, 65535, text)


def listen_port(text: str) -> int:
    """A TCP port others must know in advance (0 would pick one nobody knows)."""
    return int_in(1, 65535, text)


def host_port(text: str) -> str:
    host, colon, port = text.rpartition(":")
    if not (host and colon and port.isdigit() and 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with PORT in 1..65535, got {text!r}")
    return text


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
