"""Named, timed steps: each prints when it starts and how long it took; the first failure
names its step and ends the run with exit status 1 (after the clean-up steps)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


class StepFailed(Exception):
    """A check's own failure: the message says what was expected and what was seen."""


@dataclass
class Steps:
    """The run's clock and its step log (``(name, seconds, ok)`` in order)."""

    start: float = field(default_factory=time.monotonic)
    done: list[tuple[str, float, bool]] = field(default_factory=list)
    failed: str | None = None

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.start

    def say(self, message: str) -> None:
        """One line on stdout, stamped with the run's elapsed time."""
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the block as step ``name``; an exception marks it (and the run) failed and
        propagates after the line ``FAILED: <name>: <reason>``."""
        self.say(f"{name} ...")
        began = time.monotonic()
        try:
            yield
        except BaseException as exc:
            seconds = time.monotonic() - began
            self.done.append((name, seconds, False))
            if self.failed is None:
                self.failed = name
            reason = str(exc) or type(exc).__name__
            self.say(f"FAILED: {name} after {seconds:.1f}s: {reason}")
            raise
        seconds = time.monotonic() - began
        self.done.append((name, seconds, True))
        self.say(f"ok: {name} ({seconds:.1f}s)")

    def summary(self) -> int:
        """Print every step's time and the verdict; the exit status (0 or 1)."""
        print("\nstep timings:", flush=True)
        for name, seconds, ok in self.done:
            print(f"  {'ok  ' if ok else 'FAIL'} {seconds:7.1f}s  {name}")
        total = self.elapsed()
        if self.failed is not None:
            print(f"deploy-check FAILED at step '{self.failed}' ({total:.0f}s)", file=sys.stderr)
            return 1
        print(f"deploy-check passed in {total:.0f}s ({total / 60:.1f} min)")
        return 0
