"""A one-line progress bar on stderr (no dependency), redrawn at most ten times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from deploy.loadtest_lib.records import RequestRecord

WIDTH = 30
MIN_REDRAW_S = 0.1


class ProgressBar:
    """Shows one load point's progress against ``total`` requests or ``duration_s``.

    ``finish(record)`` counts a finished request; ``draw()`` repaints (rate-limited unless
    ``force``); ``close()`` prints the final state and a newline.
    """

    def __init__(
        self, label: str, total: int | None, duration_s: float | None, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.total = total
        self.duration_s = duration_s
        self.stream = stream if stream is not None else sys.stderr
        self.ok = 0
        self.failed = 0
        self.started = time.monotonic()
        self._drawn = 0.0

    def finish(self, record: RequestRecord) -> None:
        if record.ok:
            self.ok += 1
        else:
            self.failed += 1
        self.draw()

    def _fraction(self, elapsed: float) -> float:
        done = self.ok + self.failed
        by_count = done / self.total if self.total else 0.0
        by_time = elapsed / self.duration_s if self.duration_s else 0.0
        return min(1.0, max(by_count, by_time))

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < MIN_REDRAW_S:
            return
        self._drawn = now
        elapsed = now - self.started
        filled = int(self._fraction(elapsed) * WIDTH)
        total = f"/{self.total}" if self.total else ""
        line = (
            f"\r[{self.label}] |{'#' * filled}{'.' * (WIDTH - filled)}| "
            f"{self.ok + self.failed}{total} ok={self.ok} failed={self.failed} {elapsed:.1f}s"
        )
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        self.draw(force=True)
        self.stream.write("\n")
        self.stream.flush()
