"""Stop strings, matched on streamed text in the frontend.

:class:`StopStringMatcher` takes text deltas and returns the part that is safe
to send: text that cannot be the start of a stop string. A tail that could
still grow into a stop string (the longest suffix that is a proper prefix of
one) is held back, so a stop string spread over several tokens is never
emitted in part. On a match the text is cut before the stop string (which is
not included) and :attr:`stopped` becomes true; later input is ignored.
"""

from __future__ import annotations


class StopStringMatcher:
    """Filter a text stream against ``stops`` (non-empty strings; none = pass-through)."""

    def __init__(self, stops: list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = list(stops)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the text now safe to emit."""
        if self.stopped or not delta:
            return ""
        if not self._stops:
            return delta
        buffer = self._held + delta
        cut = min((i for i in (buffer.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """End of stream: release the held tail (it never completed a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
