"""The raw record of one request, filled in while it streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OK = "ok"
PENDING = "pending"
CANCELLED = "cancelled"
"""Status values besides ``http_<code>`` and the client-side kinds of :mod:`client`."""


@dataclass(slots=True)
class RequestRecord:
    """One request as measured by the client. Times are milliseconds, except ``start_s``.

    * ``index``: position in the point's send order; ``start_s``: send time after point start.
    * ``status``: ``ok``; ``http_<code>`` for a non-200 answer; ``connect``, ``timeout``,
      ``transport`` (other network failure), ``stream_error`` (an ``error`` event in the
      stream), ``protocol`` (unparseable or empty stream); ``cancelled`` when the
      ``--duration`` deadline cut it short. Never retried.
    * ``prompt_tokens``: from the server's ``usage`` when reported, else the workload's count.
    * ``output_tokens``: ``usage.completion_tokens`` when reported (``usage_reported``),
      else ``chunks``, the number of streamed chunks that carried text.
    * ``ttft_ms``: send → first chunk with text; ``itl_ms``: gaps between text chunks;
      ``e2e_ms``: send → end of stream (``None`` unless the stream finished).
    """

    index: int
    output_len: int
    prompt_tokens: int | None = None
    start_s: float = 0.0
    status: str = PENDING
    output_tokens: int = 0
    chunks: int = 0
    usage_reported: bool = False
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``."""
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)
