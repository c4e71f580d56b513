"""SIGINT/SIGTERM during ``shardserve serve``: raised as :class:`Stop` in the main thread, held
back while ranks are spawned, and remembered in :class:`ServeState` so that a stop swallowed on
the way (inside a logging call) is still seen before serving starts."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType


class Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    """SIGINT/SIGTERM → :class:`Stop`, optionally held back during a critical section.

    Every signal is also recorded in ``state.signal``: a :class:`Stop` raised where
    something swallows exceptions (inside a logging call, whose handler reports and
    drops them) is still seen by :func:`raise_if_signalled` before serving starts."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, state: ServeState) -> None:
        self._state = state
        self._held: int | None = None
        self._holding = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._state.signal = self._state.signal or signum
        if self._holding:
            self._held = self._held or signum
        else:
            raise Stop(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Signals arriving inside the block are raised when it ends."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._held is not None:
            raise Stop(self._held)

    def ignore(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class ServeState:
    """What the signal handler and the serve loop share."""

    serving: bool = False  # uvicorn started: a signal from now on is a normal stop
    signal: int | None = None  # the first SIGINT/SIGTERM received, if any


def raise_if_signalled(state: ServeState) -> None:
    """Raise the :class:`Stop` of a signal that arrived but was swallowed on the way."""
    if state.signal is not None:
        raise Stop(state.signal)
