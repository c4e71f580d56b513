"""Frozen settings of one load-test run: load points, SLOs and the run as a whole.

Everything here is validated on construction: a bad value raises ``ValueError``
naming the command-line flag and the fix, before any request is sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[Endpoint, ...] = ("completions", "chat")


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One load level.

    * ``concurrency``: at most this many requests in flight (``None``: unbounded).
    * ``request_rate``: mean arrivals per second, inter-arrival times drawn from a gamma
      distribution of shape ``burstiness`` and mean ``1 / request_rate`` (``None``: no
      pacing, send as fast as ``concurrency`` allows).
    * ``burstiness``: 1 is a Poisson process; < 1 burstier, > 1 more regular.

    With both ``None`` every request is sent at once (needs ``--num-requests``).
    """

    concurrency: int | None
    request_rate: float | None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not (
            self.request_rate > 0 and math.isfinite(self.request_rate)
        ):
            raise ValueError(
                f"--request-rate must be a positive number (or 'inf'), got {self.request_rate}"
            )
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be > 0 (1 = Poisson), got {self.burstiness}")

    @property
    def label(self) -> str:
        """Short human name, e.g. ``c=8``, ``rate=2/s``, ``rate=2/s b=0.5 c=8``, ``all-at-once``."""
        parts: list[str] = []
        if self.request_rate is not None:
            parts.append(f"rate={self.request_rate:g}/s")
            if self.burstiness != 1.0:
                parts.append(f"b={self.burstiness:g}")
        if self.concurrency is not None:
            parts.append(f"c={self.concurrency}")
        return " ".join(parts) or "all-at-once"

    @property
    def load_value(self) -> float | None:
        """The x-axis value of this point: the rate if paced, else the concurrency."""
        if self.request_rate is not None:
            return self.request_rate
        return float(self.concurrency) if self.concurrency is not None else None


SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency objectives in milliseconds; ``None`` means no objective."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None


def parse_slo(text: str | None) -> SLO:
    """Parse ``--slo ttft:200,tpot:50[,e2e:5000]`` (milliseconds) into an :class:`SLO`."""
    if not text:
        return SLO()
    values: dict[str, float] = {}
    for item in text.split(","):
        key, sep, raw = item.strip().partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo: expected KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        try:
            ms = float(raw)
        except ValueError:
            raise ValueError(f"--slo: {key} needs a number of milliseconds, got {raw!r}") from None
        if not ms > 0:
            raise ValueError(f"--slo: {key} must be > 0 ms, got {raw}")
        values[f"{key}_ms"] = ms
    return SLO(**values)


def parse_number_list(text: str, flag: str, kind: type[int] | type[float]) -> list[Any]:
    """Parse ``1,8,32`` for ``flag``; an empty or malformed list is a ``ValueError``."""
    try:
        values = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: give at least one value, e.g. {flag} 1,8,32")
    return values


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run (never the API key: results files get shared).

    ``num_requests`` and ``duration_s`` bound each load point; at least one is set.
    ``dataset`` replaces the synthetic ``input_len`` prompts; ``output_len`` is then the
    default for rows without their own. ``extra_body`` is merged into every request body.
    """

    base_url: str
    model: str
    endpoint: Endpoint
    points: tuple[LoadPoint, ...]
    input_len: int = 256
    output_len: int = 128
    dataset: str | None = None
    num_requests: int | None = 100
    duration_s: float | None = None
    timeout_s: float = 600.0
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if not self.points:
            raise ValueError("no load point: give --concurrency, --request-rate or a --sweep-*")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("unbounded run: give --num-requests and/or --duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        unpaced = [p for p in self.points if p.concurrency is None and p.request_rate is None]
        if unpaced and self.num_requests is None:
            raise ValueError(
                "sending all requests at once needs --num-requests "
                "(or bound the load with --concurrency or a finite --request-rate)"
            )
